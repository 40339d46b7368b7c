#!/usr/bin/env bash
# The GPU suite's training steps compiled for an H200 here, on a machine without a GPU, into DIR,
# for a GPU session to load instead of compiling them (benchmarks/gpu_suite.sh with SUITE_EXECUTABLES=DIR):
#
#   PYTHON=/path/to/python benchmarks/gpu_prepare.sh DIR [PART ...]    PART: below (default: all)
#
# PYTHON: a Python with jax[cuda13] at the GPU host's jax version (XLA:GPU's compiler,
# benchmarks/gpu_compile.py); run from the repository root, at the commit the GPU session will run
# (a Pallas kernel's source lines are part of a step's key). AUTOTUNE=FOLDER: the autotuning
# results an earlier suite run brought back (its OUT/autotune): each part compiles with
# FOLDER/<its bench's name> where there is one (the card's matmul tiles and cuBLAS calls for the
# fusions it holds; XLA's default tiles, much smaller, without), and says which.
#
# Parts (the issue-44 preset's first parts whose steps nljax compiles; each step's overrides as the
# suite gives them, so that the lowered program, and with it the key, is the one the card computes):
#   b128               bench_titans_demo_b128_memory: titans_demo bf16 at batch 128, model.remat=memory (auto's
#                      forms: the parallel form)
#   vs_pytorch         titans_vs_bf16: titans_demo bf16, auto's forms (the parallel form on a GPU); also
#                      titans_alone's step and titans_forms' parallel variant (the same program)
#   fused350m_parallel4 bench_nl_350m_fused_parallel4: unrolled, memory_impl=parallel, memory_unroll=4
#   titans_forms       ab_titans_forms: titans_demo bf16, the scan, memory_impl=parallel (memory_unroll 1 and 16)
#                      and =parallel_pallas
#                      (autotuning results: ab_titans_forms', else ab_titans_loop's, whose runs had the
#                      scan's and the loop kernel's steps: docs/gpu/2026-11-30-h200/autotune.tgz)
#   ab350m             ab_nl_350m: nl_350m bf16 unrolled with the GPU paths, the scan and memory_impl=parallel
#   titans_loop        ab_titans_loop: titans_demo bf16, the scan and memory_impl=parallel_pallas
#                      (its second step is also vs_pytorch_loop's all-levels step: the same program)
#   fused350m_loop     bench_nl_350m_fused_loop: nl_350m unrolled, memory_impl=parallel_pallas
#   fused350m_best     bench_nl_350m_fused_best: unrolled, the scan, memory_unroll=4
#   fused350m_parallel bench_nl_350m_fused_parallel: unrolled, memory_impl=parallel
#   titans_unroll      ab_titans_unroll: titans_demo bf16, memory_impl=parallel at memory_unroll 1, 2, 4
#   titans_cmdbuf      ab_titans_cmdbuf_while and _while_skip_temp (the first also the logged run under +WHILE
#                      and vs_pytorch_while's step: the same program under the same flags):
#                      vs_pytorch's step under those sets' XLA flags (part of a step's key; the
#                      default set's step is vs_pytorch's); while_u2 and _u4: at memory_unroll 2 and 4 under +WHILE
# Only the step where every level fires (the benches' --patterns worst, ab.py's step);
# titans_pytorch.py also compiles level 0's step, which the card compiles. Measured on the 2-core
# CPU machine (2026-11-30): titans_demo's two steps 45-104 s each, 3.1-3.7 MiB each; b128 78 s,
# 3.4 MiB; nl_350m's fused350m_loop step 117 s, 6.5 MiB; with auto's parallel form (2026-12-01, the
# machine busy with the tests): b128 184 s, 3.8 MiB; vs_pytorch 133 s, 3.7 MiB;
# fused350m_parallel4 331 s, 7.8 MiB; with the backward loop's cotangents packed and the card's
# driver named (2026-12-01, the machine otherwise idle): b128 99 s, 3.8 MiB; vs_pytorch 73 s, 3.7 MiB;
# fused350m_parallel4 145 s, 7.9 MiB; titans_unroll 284 s for its three (1, 2, 4: 3.7, 4.2, 5.0 MiB;
# unroll 1 is vs_pytorch's file); with the loops' slices off the loop counter (2026-12-01, the machine
# busy with other compiles and tests): vs_pytorch 71 s; titans_cmdbuf 392 s for its four (3.7, 3.7,
# 4.2, 5.0 MiB); b128 182 s; fused350m_parallel4 207 s; titans_unroll 387 s; 42 MiB for those five
# parts (the other parts not measured). A GPU
# session carries at most 64 MiB with the checkout. Each part's report goes to DIR/PART.json.
set -u
DIR=${1:?usage: benchmarks/gpu_prepare.sh DIR [PART ...]}
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cpu  # the CUDA plugin's start-up checks fail on a machine without a GPU
mkdir -p "$DIR"

# as benchmarks/gpu_suite.sh gives them (FUSED, BF16)
FUSED=(model.remat=memory model.nl_lm.attention=auto model.nl_lm.embed_grad=onehot)
SCAN=(model.nl_lm.memory_impl=scan)  # the rows measured with the scan name it (auto: the parallel form on a GPU)
BF16=(model.dtype=bfloat16)
WHILE=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL  # titans_cmdbuf's flag sets, as the suite gives them
SKIP_TEMP=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
ALL=(b128 vs_pytorch titans_cmdbuf fused350m_parallel4 titans_unroll fused350m_best ab350m titans_forms titans_loop fused350m_loop
     fused350m_parallel)

compile() {  # part, the suite's bench name (NAME or NAME,FALLBACK: whose autotuning results), then gpu_compile.py's arguments
  local part=$1 names=$2 name=""; shift 2
  local tuned=()
  for n in ${names//,/ }; do
    if [ -n "${AUTOTUNE:-}" ] && [ -d "$AUTOTUNE/$n" ]; then name=$n; break; fi
  done
  if [ -n "$name" ]; then
    tuned=(--autotune "$AUTOTUNE/$name"); echo "== $part: the card's autotuning results from $AUTOTUNE/$name"
  else
    echo "== $part: no autotuning results (AUTOTUNE/${names//,/ or AUTOTUNE/}): XLA's default matmul tiles"
  fi
  local t0=$SECONDS
  $PY benchmarks/gpu_compile.py --gpu h200 --save-executables "$DIR" --out "$DIR/$part.json" "${tuned[@]}" "$@" \
    || echo "FAILED ($part)"
  echo "   ($((SECONDS - t0)) s)"
}

part_titans_forms() {
  compile titans_forms ab_titans_forms,ab_titans_loop --config titans_demo --variant parallel:model.nl_lm.memory_impl=parallel \
    --variant parallel16:model.nl_lm.memory_impl=parallel,model.nl_lm.memory_unroll=16 \
    --variant loop:model.nl_lm.memory_impl=parallel_pallas "${BF16[@]}" "${SCAN[@]}"
}
part_ab350m() {
  compile ab350m ab_nl_350m --config nl_350m --variant parallel:model.nl_lm.memory_impl=parallel \
    "${BF16[@]}" "${FUSED[@]}" model.nl_lm.scan_layers=false "${SCAN[@]}"
}
part_titans_loop() {
  compile titans_loop ab_titans_loop --config titans_demo --variant loop:model.nl_lm.memory_impl=parallel_pallas \
    "${BF16[@]}" "${SCAN[@]}"
}
fused350m() {  # part, bench name suffix, the part's own overrides
  # without the bench's own autotuning results, ab_nl_350m's: the same model, unrolled, both forms
  local part=$1 name=bench_nl_350m_fused$2; shift 2
  compile "$part" "$name,ab_nl_350m" --config nl_350m "${BF16[@]}" "${FUSED[@]}" "$@"
}
part_fused350m_loop() { fused350m fused350m_loop _loop model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel_pallas; }
part_fused350m_best() { fused350m fused350m_best _best model.nl_lm.scan_layers=false model.nl_lm.memory_unroll=4 "${SCAN[@]}"; }
part_fused350m_parallel4() { fused350m fused350m_parallel4 _parallel4 model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel model.nl_lm.memory_unroll=4; }
part_vs_pytorch() {
  compile vs_pytorch titans_vs_bf16,titans_vs_bf16_parallel --config titans_demo "${BF16[@]}"
}
part_fused350m_parallel() { fused350m fused350m_parallel _parallel model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel; }
part_titans_unroll() {
  # without its own autotuning results, titans_vs_bf16_parallel's: its unroll-1 step is vs_pytorch's
  # (the same key: with other tiles it would replace that file), the others share most fusions
  compile titans_unroll ab_titans_unroll,titans_vs_bf16_parallel --config titans_demo --no-base \
    --variant parallel1:model.nl_lm.memory_impl=parallel,model.nl_lm.memory_unroll=1 \
    --variant parallel2:model.nl_lm.memory_impl=parallel,model.nl_lm.memory_unroll=2 \
    --variant parallel4:model.nl_lm.memory_impl=parallel,model.nl_lm.memory_unroll=4 "${BF16[@]}"
}
part_titans_cmdbuf() {
  # the sets' runs give XLA_FLAGS "$WHILE" and "$WHILE $SKIP_TEMP" (the key keeps their order);
  # without their own autotuning results, vs_pytorch's: the same program
  local name flags
  for name in while while_skip_temp; do
    flags=$WHILE; [ $name = while ] || flags+=" $SKIP_TEMP"
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" compile "titans_cmdbuf_$name" "ab_titans_cmdbuf_$name,titans_vs_bf16_parallel" \
      --config titans_demo "${BF16[@]}"
  done
  # while_u2, while_u4: 2 and 4 chunks per loop iteration under +WHILE (most fusions are vs_pytorch's)
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$WHILE" compile titans_cmdbuf_while_u24 \
    ab_titans_cmdbuf_while_u2,titans_vs_bf16_parallel --config titans_demo --no-base \
    --variant u2:model.nl_lm.memory_unroll=2 --variant u4:model.nl_lm.memory_unroll=4 "${BF16[@]}"
}
part_b128() {
  compile b128 bench_titans_demo_b128_memory --config titans_demo "${BF16[@]}" model.remat=memory train.batch_size=128
}

PARTS=("${@:2}")
if [ ${#PARTS[@]} -eq 0 ]; then PARTS=("${ALL[@]}"); fi
for part in "${PARTS[@]}"; do  # all checked before any compiles
  case " ${ALL[*]} " in
    *" $part "*) ;;
    *) echo "unknown part '$part' (parts: ${ALL[*]})"; exit 2 ;;
  esac
done
for part in "${PARTS[@]}"; do
  part_$part
done
echo "executables in $DIR: $(find "$DIR" -maxdepth 1 -name '*.xla' | wc -l) files, $(du -sh "$DIR" | cut -f1)"
