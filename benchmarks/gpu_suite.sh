#!/usr/bin/env bash
# The GPU measurements on one H100 or H200, in parts:
#
#   benchmarks/gpu_suite.sh OUT_DIR [PART ...]     PART: a part or a preset below (default: issue44)
#
# Presets:
#   issue44  (the default) one device call of under 8 minutes (issue 44), the rows in the order
#            they matter: b128 vs_pytorch vs_pytorch_while titans_alone fused350m_parallel4 titans_unroll fused350m_best
#            ab350m pullback attn_tiles vs_pytorch_parallel titans_forms fused350m_graphs fused350m_best8
#            fused350m fused350m_loop vs_pytorch_loop kernel_loop titans_loop fused350m_parallel kernel
#            fused350m_unrolled fused350m_memunroll fused350m_kernel paths titans_cmdbuf.
#            Since the third H200 run of 2026-11-30 (docs/benchmarks/2026-11-30-h200-c.md) memory_impl
#            auto is the parallel form on a GPU (x0.906 the scan's step in nl_350m, side by side; its
#            reads in groups of chunks since, to hold titans_demo's batch 128 under 20 GB, compiled
#            offline): first batch 128's peak memory on the card with it, then titans_demo (auto)
#            against titans-pytorch (the README's figure), then auto's step alone through ab.py's loop
#            (interleaved with four other forms the scan took 41.9 ms a step, 2.6x titans_pytorch.py's
#            loop: whether the interleaving costs it), then the parallel form with 4 chunks per loop
#            iteration in nl_350m and with 1, 4 and 16 in titans_demo (beside the scan's), then the
#            rows measured before.
#            A wall-clock budget (SUITE_BUDGET_S, default 450 s for this preset) caps every bench at
#            what is left of it, so the call ends in time whatever a compile costs; a bench the budget
#            stops is reported as STOPPED, what did not fit is named in the log, and the summary says
#            "-". Compiling takes most of a call (H200, 2026-11-30: titans_demo 45-47 s per variant,
#            nl_350m unrolled 74 s; kernel_loop 160 s in all): the first call gets through about the
#            first two or three parts, a second call the parts the log names as left out (e.g.
#            `benchmarks/gpu_suite.sh OUT vs_pytorch b128 fused350m_best`), unless the steps were
#            compiled ahead (SUITE_EXECUTABLES, below).
#   issue17  the parts of issue 17 (item 6), each fitting a 10-minute call: titans graphs memory dit
#            nl350m cycle (no budget unless SUITE_BUDGET_S is set)
#
# Parts of issue 44 (nl_lm's GPU paths: model.nl_lm.attention, embed_grad, loss_chunk, memory_impl):
#   paths              benchmarks/gpu_paths.py: cuDNN and Pallas attention vs the blocked form, the one-hot
#                      and segment-sum embedding gradients vs the scatter-add, the chunked cross-entropy vs
#                      the full one (outputs and gradients on this GPU; each pair's time), at nl_350m's shapes
#   kernel             the fused inner-loop memory kernel (issue 44, item 2): its own part, below
#   kernel_loop        the same for the parallel form's loop kernel alone (memory_impl=parallel_pallas)
#                      and the parallel form (memory_impl=parallel): benchmarks/memory_kernel.py
#                      --variant "loop kernel" --variant parallel
#   fused350m          nl_350m with model.remat=memory and the GPU paths (attention auto = the Pallas
#                      kernel, the one-hot embedding gradient), the inner loop's scan (memory_impl=scan,
#                      as in every fused350m row but those naming another), scanned layers, profiled; the loss is
#                      not chunked (at a byte vocabulary the chunked loss was the slower, 2026-11-28)
#   fused350m_unrolled the same unrolled (model.nl_lm.scan_layers=false), profiled
#   fused350m_memunroll the same scanned with 4 inner-loop chunks per loop iteration
#                      (model.nl_lm.memory_unroll=4): the inner loop was most of the 2026-11-28 step
#   fused350m_best     the two that were faster on 2026-11-28 together (unrolled, memory_unroll=4),
#                      profiled, its trace and compiled program kept (OUT/trace_nl_350m_fused_best)
#   fused350m_best8    the same with 8 inner-loop chunks per loop iteration
#   fused350m_parallel unrolled with model.nl_lm.memory_impl=parallel (the loop carries the end states
#                      alone, the reads of all chunks after it at once: at most half the products per
#                      chunk of the scan with remat),
#                      profiled
#   fused350m_parallel4 the same with memory_unroll=4
#   fused350m_loop     unrolled with model.nl_lm.memory_impl=parallel_pallas (the parallel form's loop of
#                      end states as one Pallas kernel per layer, the reads XLA's), profiled
#   fused350m_graphs   fused350m_best with --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL: XLA's
#                      while loops inside CUDA graphs where it takes them (jax 0.11.2's XLA does not
#                      take a loop whose body writes at the loop counter's offset unless it also
#                      unrolls it; a loop of known trip count reads no predicate back either way:
#                      docs/benchmarks/2026-12-01-command-buffers.md)
#   fused350m_kernel   the same scanned with the fused memory kernel (model.nl_lm.memory_impl=pallas),
#                      profiled: the kernel in the whole step
#   vs_pytorch         titans_demo (auto's forms: the parallel form on a GPU) vs titans-pytorch in bf16 at
#                      batch 4 x 512 (interleaved, one process)
#   vs_pytorch_while   the same with XLA's while loops in its CUDA graphs
#                      (--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL): compiled offline, the whole step
#                      one graph launch instead of 103 (titans_cmdbuf's `while` set)
#   vs_pytorch_loop    the same with memory_impl=parallel_pallas (the loop kernel)
#   vs_pytorch_parallel the same with memory_impl=parallel named (auto's choice on a GPU since 2026-12-01)
#   titans_alone       titans_demo at batch 4 x 512 with auto's forms alone in ab.py's process, timed
#                      through the training loop and profiled as titans_forms times it among four others
#   titans_forms       titans_demo at batch 4 x 512 with the scan, memory_impl=parallel (also with its
#                      16 chunks in one loop iteration, memory_unroll=16: 3,655 kernels per step against 4,390,
#                      compiled offline) and memory_impl=parallel_pallas, interleaved and profiled (where each
#                      step's device idles), timed through the training loop; the scan also with
#                      train.dispatch_ahead=false
#   ab350m             nl_350m unrolled with the GPU paths, the scan and memory_impl=parallel,
#                      interleaved in one process and profiled, timed through the training loop
#   attn_tiles         the Pallas attention's three kernels (forward, dK/dV, dQ) each timed alone over
#                      its candidate tiles, warps, stages and split loops at nl_350m's shapes, then the
#                      fastest of each together against the default launch (benchmarks/attention_tiles.py;
#                      small Triton kernels: about 0.3-0.8 s to compile each, 117 launches at most)
#   pullback           the parallel form alone with its hand-written pull-back (memory.end_pullback) and
#                      with JAX's, against the scan, at titans_demo's and nl_350m's memory shapes
#                      (benchmarks/memory_kernel.py; no Pallas kernel: quick to compile)
#   titans_loop        titans_demo at batch 4 x 512 with the scan and memory_impl=parallel_pallas,
#                      interleaved and profiled: two compilations, before titans_unroll's three
#   titans_unroll      titans_demo at batch 4 x 512 with memory_impl=parallel (auto's on a GPU) at 1, 2 and 4
#                      inner-loop chunks per loop iteration (model.nl_lm.memory_unroll; the scan's and 16 were
#                      measured on 2026-11-30; parallel_pallas: titans_loop), interleaved and
#                      profiled: its step is bound by its kernel count, which unrolling lowers (the scan in
#                      nl_350m: 21,557 -> 17,179 at 4), at the price of the step's dispatch
#   b128               titans_demo at batch 128 x 512, model.remat=memory (auto's forms): peak memory
#   titans_cmdbuf      titans_demo at batch 4 x 512 (auto's forms) alone through ab.py's training loop, once
#                      per set of XLA command-buffer flags, each in its own process (XLA_FLAGS is a
#                      process's), in this order: XLA's defaults, the whole step one graph (+WHILE), the
#                      same with temporaries at fixed addresses, with 2 and with 4 chunks per loop
#                      iteration, 8 steps with XLA's log of each graph's launches and recordings under
#                      +WHILE and under the defaults (titans_cmdbuf_log_while, titans_cmdbuf_log),
#                      temporaries at fixed addresses alone, whole loops unrolled into one graph, none (op
#                      by op); about 60-90 s each on the card compiled, less loaded: a call of its own,
#                      which a budget may cut before the last sets
#                      (docs/benchmarks/2026-12-01-command-buffers.md)
#
# Parts of issue 17 (auto's forms: since 2026-12-01 the inner loop's parallel form on a GPU, where
# their runs before measured the scan; dit has no neural memory):
#   titans  titans_demo vs titans-pytorch in bf16 at batch 4 (interleaved, one process); titans_demo's
#           step with model.remat memory (the default), none and block, interleaved and profiled
#   graphs  titans_demo with CUDA graphs around XLA's while loops (the inner loop's), profiled
#   memory  titans_demo at batch 128 x 512 with model.remat=block and =memory: peak memory
#   dit     MeanFlow DiT-B/4 at 32x32 and its flow-matching twin
#   nl350m  nl_350m (seq 2048) scanned with block remat, scanned with model.remat=memory, and with
#           model.remat=memory unrolled (scan_layers=false: no per-layer stacking; the config's forms
#           since 2026-11-28), profiled
#   cycle   titans_demo's four pulse variants: compile time and tokens/s of each
#
# Executables compiled ahead: SUITE_EXECUTABLES=DIR exports NLJAX_EXECUTABLES=DIR (absolute), so that
# every training step the parts compile through nljax (bench, ab.py, titans_pytorch.py; not
# memory_kernel.py's or gpu_paths.py's kernels) is loaded from DIR where its executable is there
# (benchmarks/gpu_prepare.sh DIR writes them on a machine without a GPU; carry DIR with the
# checkout) and compiled as before where it is not. machine.txt names DIR and its file count; a
# bench's JSON says per step "executable": "compiled" or "loaded from FILE" (its compile_s is then a
# load time). An executable compiled without the card has the matmul tiles of the autotuning results
# gpu_prepare.sh was given (AUTOTUNE=OUT/autotune of an earlier run of this suite), XLA's defaults
# elsewhere: its step times are those tiles', not the ones this card would pick (docs/guides/gpu.md,
# "Executables compiled ahead").
#
# Dry run: GPU_SUITE_DRY_RUN=1 runs the issue-44 parts on whatever device there is (a CPU) with tiny
# shapes, one step each: the script's own check (tests/test_gpu_suite.py), not a measurement.
#
# Each bench is short (few warm-up and timed steps) and writes JSON into OUT_DIR; a summary
# against the targets of every part run so far is printed at the end (OUT_DIR/summary.txt).
# `--profile 2` adds where the device time of 2 steps went (nljax/measure/traces.py) to the JSON and log. Needs no
# network: jax/flax/optax/orbax/torch are installed; titans-pytorch is installed from wheels in
# .whl/ when it is not importable (`benchmarks/fetch_wheels.sh` downloads them on a machine with
# network; copy .whl/ to the GPU machine with the checkout), and its part is skipped with a message
# when neither works.
# Run from the repository root.
set -u
OUT=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------ which parts

ISSUE44=(b128 vs_pytorch vs_pytorch_while titans_alone fused350m_parallel4 titans_unroll fused350m_best ab350m pullback attn_tiles
         vs_pytorch_parallel titans_forms fused350m_graphs fused350m_best8 fused350m fused350m_loop vs_pytorch_loop
         kernel_loop titans_loop fused350m_parallel kernel fused350m_unrolled fused350m_memunroll fused350m_kernel paths
         titans_cmdbuf)
ISSUE17=(titans graphs memory dit nl350m cycle)
PARTS=()
for part in "${@:2}"; do
  case $part in
    issue44) PARTS+=("${ISSUE44[@]}"); : "${SUITE_BUDGET_S:=450}" ;;
    issue17) PARTS+=("${ISSUE17[@]}") ;;
    *) PARTS+=("$part") ;;
  esac
done
if [ ${#PARTS[@]} -eq 0 ]; then PARTS=("${ISSUE44[@]}"); : "${SUITE_BUDGET_S:=450}"; fi
for part in "${PARTS[@]}"; do  # all checked before any runs
  case " ${ISSUE44[*]} ${ISSUE17[*]} " in
    *" $part "*) ;;
    *) echo "unknown part '$part' (parts: ${ISSUE44[*]} ${ISSUE17[*]}; presets: issue44 issue17)"; exit 2 ;;
  esac
done
if [ -n "${SUITE_EXECUTABLES:-}" ]; then  # before anything runs: a wrong folder is one line, not a suite of compiles
  if [ ! -d "$SUITE_EXECUTABLES" ]; then echo "SUITE_EXECUTABLES=$SUITE_EXECUTABLES: not a directory"; exit 2; fi
  export NLJAX_EXECUTABLES
  NLJAX_EXECUTABLES=$(cd "$SUITE_EXECUTABLES" && pwd)
fi
if [ -n "${GPU_SUITE_DRY_RUN:-}" ]; then  # the summary says so too
  echo "dry run (GPU_SUITE_DRY_RUN): tiny shapes, one step each; nothing here is a measurement" | tee "$OUT/DRY_RUN"
fi

# the card, the software and the code, for the report (a GPU figure names its card)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: none"
  $PY -c "import jax, jaxlib, sys; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices(), 'python', sys.version.split()[0])"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git here)')"
  if [ -n "${NLJAX_EXECUTABLES:-}" ]; then
    echo "executables: NLJAX_EXECUTABLES=$NLJAX_EXECUTABLES ($(find "$NLJAX_EXECUTABLES" -maxdepth 1 -name '*.xla' | wc -l) files)"
  fi
} > "$OUT/machine.txt" 2>&1

# XLA's autotuning results on this card (its choice of matmul tiles and libraries per fusion), one
# file per fusion in one folder per bench (OUT/autotune/NAME): each bench still compiles with a cold
# cache, as it did before, and the files come back with the results, for compiling offline with the
# card's own choices (benchmarks/gpu_compile.py compiles with default tiles: no card to time them).
# Probed first: an XLA that does not know the flag runs the suite without it.
AUTOTUNE_FLAG=--xla_gpu_per_fusion_autotune_cache_dir
if XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE_FLAG=$OUT/autotune/probe" $PY -c "import jax; jax.numpy.zeros(2).block_until_ready()" \
    > "$OUT/autotune_probe.log" 2>&1; then
  echo "autotune: $AUTOTUNE_FLAG=$OUT/autotune/NAME" >> "$OUT/machine.txt"
else
  echo "autotune: $AUTOTUNE_FLAG refused by this XLA (OUT/autotune_probe.log); the suite runs without it" | tee -a "$OUT/machine.txt"
  AUTOTUNE_FLAG=""
fi

# bf16 compute for nljax once mixed precision (model.dtype, item 2) exists; float32 before.
if $PY -c "import sys, nljax.config as c; sys.exit('dtype' not in c.ModelConfig.__dataclass_fields__)"; then
  BF16=(model.dtype=bfloat16)
else
  BF16=(); echo "note: nljax has no model.dtype yet: nljax runs float32"
fi

run() {  # name, then the command; a failed bench is reported and the suite goes on
  local name=$1; shift
  local cap=()
  if [ "${SUITE_BUDGET_S:-0}" -gt 0 ]; then  # what is left of the call's budget caps this bench
    local left=$((SUITE_BUDGET_S - SECONDS))
    # at least 1 s whatever SUITE_MIN_S says: `timeout 0` would not cap the bench at all
    if [ $left -lt "${SUITE_MIN_S:-30}" ] || [ $left -lt 1 ]; then echo "== $name: skipped, ${left} s left of SUITE_BUDGET_S=$SUITE_BUDGET_S"; return; fi
    cap=(timeout --kill-after=10 $left)
  fi
  echo "== $name: $*"
  local t0=$SECONDS
  local rc=0
  XLA_FLAGS="${XLA_FLAGS:-}${AUTOTUNE_FLAG:+ $AUTOTUNE_FLAG=$OUT/autotune/$name}" "${cap[@]}" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    tail -n 30 "$OUT/$name.log"
  elif [ ${#cap[@]} -gt 0 ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $((SECONDS - t0)) -ge "$left" ]; then
    # timeout's own codes once the cap has passed: not the bench's failure (a bench the kernel's
    # OOM killer ends also exits 137, but before its cap)
    echo "STOPPED ($name): SUITE_BUDGET_S=$SUITE_BUDGET_S ran out after $((SECONDS - t0)) s, see $OUT/$name.log"
    echo "stopped by the suite's budget (SUITE_BUDGET_S=$SUITE_BUDGET_S) after $((SECONDS - t0)) s" >> "$OUT/$name.log"
  else
    echo "FAILED ($name, exit $rc), see $OUT/$name.log"; tail -n 5 "$OUT/$name.log"
  fi
  echo "   ($((SECONDS - t0)) s)"
}

part_titans() {
  # titans_demo vs titans-pytorch in bf16 at batch 4 (target: >= 100x its tokens/s)
  if ! $PY -c "import titans_pytorch" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install --no-index --find-links .whl titans-pytorch > "$OUT/pip_titans.log" 2>&1 \
      || echo "titans-pytorch: install from .whl/ failed, see $OUT/pip_titans.log"
  fi
  if $PY -c "import titans_pytorch" 2>/dev/null; then
    run titans_vs_bf16 $PY benchmarks/titans_pytorch.py --device cuda --dtype bf16 --threads 0 \
      --rounds 5 --warmup 2 --out "$OUT/titans_vs_bf16.json"
  else
    echo "== titans_vs_bf16: skipped, titans_pytorch is not importable (copy its wheels into .whl/, benchmarks/fetch_wheels.sh)"
  fi
  # the all-levels step, profiled (latency-bound, i.e. the device idle between kernels, or not),
  # with the inner loop's chunks recomputed (the default), stored, and whole blocks recomputed
  run ab_titans_remat $PY benchmarks/ab.py --config titans_demo --rounds 10 --warmup 2 --profile 2 \
    "${BF16[*]} model.remat=memory" "${BF16[*]} model.remat=none" "${BF16[*]} model.remat=block" \
    --out "$OUT/ab_titans_remat.json"
}

part_graphs() {
  # titans_demo with XLA's while loops inside CUDA graphs (one launch per loop instead of one per
  # kernel); an XLA that does not know the flag fails this row only
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    run bench_titans_demo_graphs $PY -m nljax.bench --config titans_demo --patterns worst \
    --steps 5 --warmup 2 --profile 2 "${BF16[@]}" --out "$OUT/bench_titans_demo_graphs.json"
}

part_memory() {
  # titans_demo at batch 128 x 512: peak memory (target: under 20 GB)
  for remat in memory block; do
    run bench_titans_demo_b128_$remat $PY -m nljax.bench --config titans_demo train.batch_size=128 \
      model.remat=$remat --patterns worst --steps 3 --warmup 1 "${BF16[@]}" --out "$OUT/bench_titans_demo_b128_$remat.json"
  done
}

part_dit() {
  # MeanFlow DiT-B/4 at 32x32 vs flow matching (target: MeanFlow step <= 1.6x)
  run bench_dit_b4_meanflow $PY -m nljax.bench --config meanflow_dit_b4 --synthetic 32x32x3 \
    --steps 5 --warmup 2 "${BF16[@]}" --out "$OUT/bench_dit_b4_meanflow.json"
  run bench_dit_b4_flow_matching $PY -m nljax.bench --config meanflow_dit_b4 --synthetic 32x32x3 \
    --steps 5 --warmup 2 meanflow.loss=flow_matching "${BF16[@]}" --out "$OUT/bench_dit_b4_flow_matching.json"
}

part_nl350m() {
  # ~350M-parameter nested-learning LM at sequence 2048 (target: >= 40% MFU); the all-levels
  # step only (one compilation, not three): its FLOPs are within 0.1% of level 0's. The config's
  # block remat recomputes every sub-block's matmuls; model.remat=memory keeps them (20 GiB of
  # residuals at batch 8 x 2048 since the norms, GELU and scores are recomputed, 86 before).
  run bench_nl_350m $PY -m nljax.bench --config nl_350m --patterns worst --steps 3 --warmup 1 \
    --profile 2 "${BF16[@]}" model.remat=block model.nl_lm.scan_layers=true --out "$OUT/bench_nl_350m.json"
  run bench_nl_350m_memory $PY -m nljax.bench --config nl_350m --patterns worst --steps 3 --warmup 1 \
    --profile 2 "${BF16[@]}" model.remat=memory model.nl_lm.scan_layers=true --out "$OUT/bench_nl_350m_memory.json"
  # the H200's profile (docs/benchmarks/2026-11-27-h200.md) put 10% of the remat=memory step in the layer scan's
  # stacking of saved activations: the unrolled net has none (and a longer compile)
  run bench_nl_350m_unrolled $PY -m nljax.bench --config nl_350m --patterns worst --steps 3 --warmup 1 \
    --profile 2 "${BF16[@]}" model.remat=memory model.nl_lm.scan_layers=false --out "$OUT/bench_nl_350m_unrolled.json"
}

part_cycle() {
  # titans_demo: compile time per variant, tokens/s per pattern (batch 4 x 512)
  run bench_titans_demo $PY -m nljax.bench --config titans_demo --steps 5 --warmup 2 \
    "${BF16[@]}" --out "$OUT/bench_titans_demo.json"
}

# ------------------------------------------------------------------ issue 44: nl_lm's GPU paths

DRY=${GPU_SUITE_DRY_RUN:-}
if [ -n "$DRY" ]; then  # tiny shapes on any device, one step each: the script checked, nothing measured
  STEPS=(--steps 1 --warmup 0 --profile 1)
  PLAIN=(--steps 1 --warmup 0)
  # nl_350m's and titans_demo's structure (MLP memories, scanned units for nl_350m) at a toy size
  NL350=(model.dim=32 model.heads=2 model.depth=2 model.nl_lm.memory_layers=[0,1] model.nl_lm.window=16
         model.nl_lm.memory_heads=2 model.nl_lm.memory_dim=16 model.nl_lm.memory_hidden=16 model.nl_lm.memory_chunk=16
         train.batch_size=2 train.seq_len=64)
  TITANS=(model.dim=32 model.heads=2 model.depth=2 model.nl_lm.memory_layers=[1] model.nl_lm.memory_heads=2
          model.nl_lm.memory_dim=16 model.nl_lm.memory_hidden=16 train.seq_len=64)
  B128=(train.batch_size=2)
  TORCH=(--device cpu --threads 0 --batch 2 --seq 64 --rounds 1 --warmup 0 --skip-torch)
else
  STEPS=(--steps 3 --warmup 1 --profile 2)
  PLAIN=(--steps 2 --warmup 1)  # a peak-memory row: no profile (its parse costs time the budget lacks)
  NL350=()
  TITANS=()
  B128=(train.batch_size=128)
  TORCH=(--device cuda --threads 0 --rounds 3 --warmup 1)
fi
# the GPU paths: attention auto (the Pallas kernel on a CUDA GPU, the blocked form elsewhere), the
# one-hot embedding gradient
FUSED=(model.remat=memory model.nl_lm.attention=auto model.nl_lm.embed_grad=onehot)
# the inner loop's scan, named: memory_impl auto is the parallel form on a GPU since 2026-12-01, and
# the rows measured with the scan before stay the scan's
SCAN=(model.nl_lm.memory_impl=scan)

part_paths() {
  run paths $PY benchmarks/gpu_paths.py ${DRY:+--dry-run --reps 2} --out "$OUT/paths.json"
}

memory_bench() {  # $1: the JSON's name; then memory_kernel.py's --variant flags (none: every variant)
  local name=$1; shift
  if [ -n "$DRY" ]; then
    run "$name" $PY benchmarks/memory_kernel.py --shapes tiny --interpret --rounds 1 --warmup 0 "$@" \
      --out "$OUT/$name.json"
  else
    run "$name" $PY benchmarks/memory_kernel.py --shapes titans_demo,nl_350m --rounds 10 --warmup 2 "$@" \
      --out "$OUT/$name.json"
  fi
}

part_kernel() {
  # the fused inner-loop memory kernel alone (model.nl_lm.memory_impl, benchmarks/memory_kernel.py), at
  # titans_demo's and nl_350m's memory shapes, checked against the scan then timed (target: fwd+bwd
  # >= 3x the scan's); a dry run interprets it at tiny shapes. Exits non-zero when the check fails.
  memory_bench memory_kernel
}

part_kernel_loop() {
  # the parallel form's loop kernel and the parallel form alone, checked against the scan then timed
  memory_bench memory_loop_kernel --variant "loop kernel" --variant parallel
}

part_attn_tiles() {
  # the kernels ran at 12-15% of the card's bf16 peak with jax's reference's launch (2026-11-28:
  # 0.90 ms forward + backward per layer at nl_350m's shapes); capped below the budget
  # so that the side-by-side of the default and the fastest launches still runs
  run attention_tiles $PY benchmarks/attention_tiles.py ${DRY:+--dry-run} --budget-s 200 --out "$OUT/attention_tiles.json"
}

part_pullback() {
  # the parallel form's backward loop written out (end_pullback) against JAX's pull-back of the same
  # function, side by side, each checked against the scan first (fewer kernels per chunk offline:
  # 62 against 75 at titans_demo's shapes; what that is worth on the card)
  memory_bench memory_pullback --variant parallel --variant "parallel, JAX's pull-back"
}

fused350m() {  # $1: the row's name after bench_nl_350m_fused; then its own overrides or bench flags
  local name=bench_nl_350m_fused$1; shift
  run "$name" $PY -m nljax.bench --config nl_350m --patterns worst "${STEPS[@]}" "${BF16[@]}" \
    "${FUSED[@]}" "$@" "${NL350[@]}" --out "$OUT/$name.json"
}

part_fused350m() {
  # the trace and the compiled program kept (OUT/trace_nl_350m_fused/program.hlo.txt), as for the
  # best row: the profile's placement of command-buffer kernels checked offline
  fused350m "" model.nl_lm.scan_layers=true "${SCAN[@]}" --profile-dir "$OUT/trace_nl_350m_fused"
}

part_fused350m_best() {
  # 2026-11-28 (H200): unrolled 154.6 ms and memory_unroll=4 170.0 ms against the scanned 180.3 ms,
  # each alone; together, measured first
  fused350m _best model.nl_lm.scan_layers=false model.nl_lm.memory_unroll=4 "${SCAN[@]}" --profile-dir "$OUT/trace_nl_350m_fused_best"
}

part_fused350m_best8() {
  fused350m _best8 model.nl_lm.scan_layers=false model.nl_lm.memory_unroll=8 "${SCAN[@]}"
}

part_fused350m_parallel() {
  # the reads out of the inner loop (model.nl_lm.memory_impl=parallel): its loop bodies have at
  # most half the products per chunk of the scan with remat; on the 2-core CPU its step was
  # 1.01-1.03x the scan's (2026-11-30, with end_pullback; docs/concepts/memory-kernel.md): more
  # products in all
  fused350m _parallel model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel
}

part_fused350m_loop() {
  # the parallel form with its loop of end states as one Pallas kernel per layer (interpreted in a
  # dry run): fewer spills than the whole-chunk kernel's in the offline compile (docs/concepts/memory-kernel.md)
  fused350m _loop model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel_pallas
}

part_fused350m_parallel4() {
  fused350m _parallel4 model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel model.nl_lm.memory_unroll=4
}

part_fused350m_graphs() {
  # an XLA that does not know the flag fails this row only
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    fused350m _graphs model.nl_lm.scan_layers=false model.nl_lm.memory_unroll=4 "${SCAN[@]}"
}

part_fused350m_unrolled() {
  # the layer scan's stacking of saved activations was 10% of the H200's remat=memory step: none unrolled
  fused350m _unrolled model.nl_lm.scan_layers=false "${SCAN[@]}"
}

part_fused350m_memunroll() {
  # the inner loop (4 memory layers x 32 chunks, ~97 kernels each) was most of the 2026-11-28 step:
  # 4 chunks per loop iteration give XLA longer bodies to fuse and a quarter of the iterations
  fused350m _memunroll model.nl_lm.scan_layers=true model.nl_lm.memory_unroll=4 "${SCAN[@]}"
}

part_fused350m_kernel() {
  # the inner loop as the fused Pallas kernel (interpreted in a dry run: slow, tiny shapes)
  fused350m _kernel model.nl_lm.scan_layers=true model.nl_lm.memory_impl=pallas
}

part_vs_pytorch() {
  # titans_demo vs titans-pytorch in bf16 at batch 4 x 512 (target: >= 100x its tokens/s); in a dry
  # run nljax's side alone (--skip-torch)
  vs_pytorch titans_vs_bf16
}

part_vs_pytorch_while() {
  # the one-graph step (titans_cmdbuf's `while` set) against titans-pytorch: the target's own figure
  # under the flags that may reach it (docs/benchmarks/2026-12-01-command-buffers.md)
  XLA_FLAGS="${XLA_FLAGS:-} $WHILE" vs_pytorch titans_vs_bf16_while
}

part_vs_pytorch_loop() {
  # the same with the loop kernel (memory_impl=parallel_pallas): 5.3x fewer kernels per step than
  # the scan, compiled offline; the target measured with the candidate that may reach it
  vs_pytorch titans_vs_bf16_loop model.nl_lm.memory_impl=parallel_pallas
}

vs_pytorch() {  # $1: the row's name; then nljax overrides
  local name=$1; shift
  if [ -z "$DRY" ] && ! $PY -c "import titans_pytorch" 2>/dev/null; then
    if ls .whl/*.whl > /dev/null 2>&1; then
      $PY -m pip install --no-index --find-links .whl titans-pytorch > "$OUT/pip_titans.log" 2>&1 \
        || echo "titans-pytorch: install from .whl/ failed, see $OUT/pip_titans.log"
    fi
    if ! $PY -c "import titans_pytorch" 2>/dev/null; then
      echo "== $name: skipped, titans_pytorch is not importable (copy its wheels into .whl/, benchmarks/fetch_wheels.sh)"
      return
    fi
  fi
  run "$name" $PY benchmarks/titans_pytorch.py --dtype bf16 "${TORCH[@]}" --out "$OUT/$name.json" \
    "${TITANS[@]}" "$@"
}

part_vs_pytorch_parallel() {
  # the parallel form named: 70.4x titans-pytorch through the training loop on 2026-11-30's third
  # run (15.4 ms a step), before it was auto's choice on a GPU (vs_pytorch's since)
  vs_pytorch titans_vs_bf16_parallel model.nl_lm.memory_impl=parallel
}

part_titans_alone() {
  # the scan's step ran 41.9 ms in ab.py's loop among four other forms and 16.3 ms in titans_pytorch.py's
  # (the parallel form's 37.6 and 15.4 ms): auto's step alone says whether ab.py's interleaving of
  # executables is what costs the difference
  local rounds=(--rounds 6 --warmup 1 --loop 8 --profile 4)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --loop 2 --profile 2); fi
  run ab_titans_alone $PY benchmarks/ab.py --config titans_demo "${rounds[@]}" "${BF16[*]} ${TITANS[*]}" \
    --out "$OUT/ab_titans_alone.json"
}

part_titans_unroll() {
  # the parallel form (auto's on a GPU) at 1, 2 and 4 chunks per loop iteration: compiled for an H200
  # offline, one memory layer's forward + backward launched 1,063, 978 and 930 kernels, the step
  # 4,244, 3,998 and 3,854 (2026-12-01);
  # fully unrolled (16) its step's dispatch took 41.8 ms on the card (2026-11-30, second run)
  local v=()
  for u in 1 2 4; do v+=("${BF16[*]} ${TITANS[*]} model.nl_lm.memory_impl=parallel model.nl_lm.memory_unroll=$u"); done
  local rounds=(--rounds 10 --warmup 2 --profile 2)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --profile 1); fi
  run ab_titans_unroll $PY benchmarks/ab.py --config titans_demo "${rounds[@]}" "${v[@]}" --out "$OUT/ab_titans_unroll.json"
}

part_titans_loop() {
  # compiled for an H200 offline (jax 0.11.2): 7,682 kernels per step with the scan, 1,456 with the loop kernel
  local v=("${BF16[*]} ${TITANS[*]} ${SCAN[*]}" "${BF16[*]} ${TITANS[*]} model.nl_lm.memory_impl=parallel_pallas")
  local rounds=(--rounds 10 --warmup 2 --profile 2)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --profile 1); fi
  run ab_titans_loop $PY benchmarks/ab.py --config titans_demo "${rounds[@]}" "${v[@]}" --out "$OUT/ab_titans_loop.json"
}

part_titans_forms() {
  # the 2026-11-30 H200 profile: the loop kernel cut the step's kernels 5.2x and its idle time by a
  # quarter only; each variant's profile now splits the idle time (before, between, after the ops).
  # Timed through the training loop (--loop 8), with the scan also without dispatching ahead
  # (train.dispatch_ahead=false: the step shares the first variant's compiled step)
  local v=("${BF16[*]} ${TITANS[*]} ${SCAN[*]}" "${BF16[*]} ${TITANS[*]} ${SCAN[*]} train.dispatch_ahead=false"
           "${BF16[*]} ${TITANS[*]} model.nl_lm.memory_impl=parallel"
           "${BF16[*]} ${TITANS[*]} model.nl_lm.memory_impl=parallel model.nl_lm.memory_unroll=16"
           "${BF16[*]} ${TITANS[*]} model.nl_lm.memory_impl=parallel_pallas")
  local rounds=(--rounds 6 --warmup 1 --loop 8 --profile 4)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --loop 2 --profile 2); fi
  run ab_titans_forms $PY benchmarks/ab.py --config titans_demo "${rounds[@]}" "${v[@]}" --out "$OUT/ab_titans_forms.json"
}

# XLA's command buffers (CUDA graphs) in jax 0.11.2's XLA, read from its source and the thunks of
# titans_demo's step compiled offline for an H200 (docs/benchmarks/2026-12-01-command-buffers.md):
# every inner-loop body is one graph launched 16 times a step from the host. Until the parallel
# form's loops sliced at an offset XLA does not read as their counter (memory._scan, 2026-12-01),
# each launch was recorded again first and +WHILE left the loops to the host; now, compiled
# offline, a loop body's graph has nothing that asks for it and +WHILE makes the whole step one
# graph (103 launches a step before). Each entry: a set's name, then its flags (none: XLA's
# defaults), in the order a short call should reach them (the budget skips the rest): XLA's
# defaults; the whole step one graph (+WHILE), then with its temporaries at fixed addresses (an
# update of that one graph would re-record all of its kernels), then with 2 and 4 chunks per loop
# iteration (`while_u2`, `while_u4`: fewer kernels, whose dispatch a graph no longer pays for from
# the host; titans_unroll times them without; each alone in its process, as every set here: a
# graph is recorded again when its buffers moved, which another executable run between two of its
# steps may cause); XLA's own log of the graphs' launches and updates (`log...`: not timed) with
# +WHILE and with the defaults; the temporaries alone; whole loops unrolled in one graph; no graphs
# at all
WHILE=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
SKIP_TEMP=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
CMDBUF=("default"
        "while $WHILE"
        "while_skip_temp $WHILE $SKIP_TEMP"
        "while_u2 $WHILE"
        "while_u4 $WHILE"
        "log_while $WHILE"
        "log"
        "skip_temp $SKIP_TEMP"
        "unroll --xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true"
        "off --xla_gpu_enable_command_buffer=")

part_titans_cmdbuf() {
  # auto's step alone (ab.py's loop, as titans_alone), once per flag set; a set this XLA refuses
  # (an older jax: a flag it does not know) is skipped, the others still run
  local rounds=(--rounds 4 --warmup 1 --loop 8 --profile 2) sets=("${CMDBUF[@]}")
  # a dry run checks the script with the first two sets and the log (each a compile: minutes on 2 cores)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --loop 2 --profile 1); sets=("${CMDBUF[@]:0:2}" log); fi
  local set name flags
  for set in "${sets[@]}"; do
    name=${set%% *}; flags=${set#"$name"}; flags=${flags# }
    if [ -n "$flags" ] && ! XLA_FLAGS="${XLA_FLAGS:-} $flags" JAX_PLATFORMS=cpu $PY -c "import jax; jax.numpy.zeros(2)" \
        > "$OUT/ab_titans_cmdbuf_${name}_probe.log" 2>&1; then
      echo "== ab_titans_cmdbuf_$name: skipped, this XLA refuses $flags (OUT/ab_titans_cmdbuf_${name}_probe.log)"
      continue
    fi
    if [ "${name%%_*}" = log ]; then
      # XLA's own account under the set's flags (its log of command_buffer_thunk.cc): each launch of
      # a graph, and each recording before one with why (updated_allocs: buffers whose address moved
      # since the last launch; needs_update). Logging costs the host time: not timed against the others
      XLA_FLAGS="${XLA_FLAGS:-}${flags:+ $flags}" TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
        run "titans_cmdbuf_$name" $PY benchmarks/ab.py --config titans_demo --rounds 1 --warmup 1 --loop 4 \
        "${BF16[*]} ${TITANS[*]}" --out "$OUT/titans_cmdbuf_$name.json"
      continue
    fi
    local variant="${BF16[*]} ${TITANS[*]}"
    case $name in while_u*) variant+=" model.nl_lm.memory_unroll=${name#while_u}" ;; esac
    XLA_FLAGS="${XLA_FLAGS:-}${flags:+ $flags}" run "ab_titans_cmdbuf_$name" $PY benchmarks/ab.py --config titans_demo \
      "${rounds[@]}" "$variant" --out "$OUT/ab_titans_cmdbuf_$name.json"
  done
}

part_ab350m() {
  # the parallel form was 1.21x the scan alone at nl_350m's shapes, and its step within 1.5% of the
  # scan's measured two days apart (2026-11-28, -30): side by side, through the training loop
  # (dispatched ahead: what training gets), it ran x0.906 the scan's step on 2026-11-30's third run,
  # which made it `auto`'s choice on a GPU
  local base="${BF16[*]} ${FUSED[*]} model.nl_lm.scan_layers=false ${NL350[*]}"
  local rounds=(--rounds 5 --warmup 1 --loop 4 --profile 2)
  if [ -n "$DRY" ]; then rounds=(--rounds 1 --warmup 0 --loop 2 --profile 2); fi
  run ab_nl_350m $PY benchmarks/ab.py --config nl_350m "${rounds[@]}" "$base ${SCAN[*]}" "$base model.nl_lm.memory_impl=parallel" \
    --out "$OUT/ab_nl_350m.json"
}

part_b128() {
  # titans_demo at batch 128 x 512 with model.remat=memory (target: under 20 GB); auto's parallel form
  # reads its chunks in groups at this batch (compiled offline: 19.4 GB against the scan's 18.4; the card's figure)
  run bench_titans_demo_b128_memory $PY -m nljax.bench --config titans_demo --patterns worst "${PLAIN[@]}" \
    "${BF16[@]}" model.remat=memory "${B128[@]}" "${TITANS[@]}" --out "$OUT/bench_titans_demo_b128_memory.json"
}

for part in "${PARTS[@]}"; do
  part_$part
done

$PY benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
