#!/usr/bin/env bash
# The GPU measurements of issue 17 (item 6) on one H100 or H200, in parts that each fit a 10-minute call:
#
#   benchmarks/gpu_suite.sh OUT_DIR [PART ...]     PART: kernel titans graphs memory dit nl350m cycle
#                                                  (default: all, in order)
#
#   kernel  the fused Pallas memory kernel (issue 44) compiled for this GPU: checked against the scan
#           (reads, final states, gradients) and timed against it, forward and forward + backward,
#           at titans_demo's and nl_350m's memory shapes (target: fwd+bwd >= 3x the scan's); 16
#           compilations (the kernel, its scan-backward fallback and the scan; checks and timings),
#           not yet run on a GPU: a few minutes
#   titans  titans_demo vs titans-pytorch in bf16 at batch 4 (interleaved, one process); titans_demo's
#           step with model.remat memory (the default), none and block, interleaved and profiled
#   graphs  titans_demo with CUDA graphs around XLA's while loops (the inner loop's scan), profiled
#   memory  titans_demo at batch 128 x 512 with model.remat=block and =memory: peak memory
#   dit     MeanFlow DiT-B/4 at 32x32 and its flow-matching twin
#   nl350m  nl_350m (seq 2048) with its block remat, with model.remat=memory, and with
#           model.remat=memory unrolled (scan_layers=false: no per-layer stacking), profiled
#   cycle   titans_demo's four pulse variants: compile time and tokens/s of each
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

# bf16 compute for nljax once mixed precision (model.dtype, item 2) exists; float32 before.
if $PY -c "import sys, nljax.config as c; sys.exit('dtype' not in c.ModelConfig.__dataclass_fields__)"; then
  BF16=(model.dtype=bfloat16)
else
  BF16=(); echo "note: nljax has no model.dtype yet: nljax runs float32"
fi

run() {  # name, then the command; a failed bench is reported and the suite goes on
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1 && tail -n 30 "$OUT/$name.log" || { echo "FAILED ($name), see $OUT/$name.log"; tail -n 5 "$OUT/$name.log"; }
  echo "   ($((SECONDS - t0)) s)"
}

part_kernel() {
  # the memory kernel alone at the two configs' memory shapes; exits non-zero when the check fails
  run memory_kernel $PY benchmarks/memory_kernel.py --shapes titans_demo,nl_350m --rounds 10 --warmup 2 \
    --out "$OUT/memory_kernel.json"
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
    --profile 2 "${BF16[@]}" --out "$OUT/bench_nl_350m.json"
  run bench_nl_350m_memory $PY -m nljax.bench --config nl_350m --patterns worst --steps 3 --warmup 1 \
    --profile 2 "${BF16[@]}" model.remat=memory --out "$OUT/bench_nl_350m_memory.json"
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

PARTS=("${@:2}")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(kernel titans graphs memory dit nl350m cycle)
for part in "${PARTS[@]}"; do  # all checked before any runs
  case $part in
    kernel|titans|graphs|memory|dit|nl350m|cycle) ;;
    *) echo "unknown part '$part' (parts: kernel titans graphs memory dit nl350m cycle)"; exit 2 ;;
  esac
done
for part in "${PARTS[@]}"; do
  part_$part
done

$PY benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
