#!/usr/bin/env bash
# The GPU measurements of issue 17 (item 6), in sequence, on one H100, in about 8 minutes:
#
#   benchmarks/gpu_suite.sh OUT_DIR
#
# Each bench is short (few warm-up and timed steps) and writes JSON into OUT_DIR; a summary
# against the targets is printed at the end (and written to OUT_DIR/summary.txt). Needs no
# network: jax/flax/optax/orbax/torch are installed; titans-pytorch is installed from wheels in
# .whl/ when it is not importable, and its part is skipped with a message when neither works.
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
  "$@" > "$OUT/$name.log" 2>&1 && tail -n 12 "$OUT/$name.log" || { echo "FAILED ($name), see $OUT/$name.log"; tail -n 5 "$OUT/$name.log"; }
  echo "   ($((SECONDS - t0)) s)"
}

# 1. titans_demo: compile time per variant, tokens/s per pattern (batch 4 x 512)
run bench_titans_demo $PY -m nljax.bench --config configs/titans_demo.yaml --steps 5 --warmup 2 \
  "${BF16[@]}" --out "$OUT/bench_titans_demo.json"

# 2. titans_demo vs titans-pytorch in bf16 at batch 4 (target: >= 100x its tokens/s)
if ! $PY -c "import titans_pytorch" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install --no-index --find-links .whl titans-pytorch > "$OUT/pip_titans.log" 2>&1 \
    || echo "titans-pytorch: install from .whl/ failed, see $OUT/pip_titans.log"
fi
if $PY -c "import titans_pytorch" 2>/dev/null; then
  run titans_vs_bf16 $PY benchmarks/titans_pytorch.py --device cuda --dtype bf16 --threads 0 \
    --rounds 5 --warmup 2 --out "$OUT/titans_vs_bf16.json"
else
  echo "== titans_vs_bf16: skipped, titans_pytorch is not importable (carry its wheels in .whl/)"
fi

# 3. titans_demo at batch 128 x 512: peak memory (target: under 20 GB)
run bench_titans_demo_b128 $PY -m nljax.bench --config configs/titans_demo.yaml train.batch_size=128 \
  --patterns worst --steps 3 --warmup 1 "${BF16[@]}" --out "$OUT/bench_titans_demo_b128.json"

# 4. ~350M-parameter nested-learning LM at sequence 2048 (target: >= 40% MFU); the all-levels
#    step only (one compilation, not three): its FLOPs are within 0.1% of level 0's
run bench_nl_350m $PY -m nljax.bench --config configs/nl_350m.yaml --patterns worst --steps 3 --warmup 1 \
  "${BF16[@]}" --out "$OUT/bench_nl_350m.json"

# 5. MeanFlow DiT-B/4 at 32x32 vs flow matching (target: MeanFlow step <= 1.6x)
run bench_dit_b4_meanflow $PY -m nljax.bench --config configs/meanflow_dit_b4.yaml --synthetic 32x32x3 \
  --steps 5 --warmup 2 "${BF16[@]}" --out "$OUT/bench_dit_b4_meanflow.json"
run bench_dit_b4_flow_matching $PY -m nljax.bench --config configs/meanflow_dit_b4.yaml --synthetic 32x32x3 \
  --steps 5 --warmup 2 meanflow.loss=flow_matching "${BF16[@]}" --out "$OUT/bench_dit_b4_flow_matching.json"

$PY benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
