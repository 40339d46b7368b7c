# 2026-12-01: the parallel form's backward loop with its per-chunk cotangents packed, compiled for an
# H200 on the 2-core CPU machine with the H200 host's jax (0.11.2, the /tmp/gv13 environment of
# docs/gpu/2026-11-29-compile-offline-jax0.11/commands.sh) and benchmarks/gpu_compile.py naming the
# card's CUDA 13 driver (helper-70's change; the HLO and buffers are as without it).
# before: commit 6729e8b's model code (four stacked arrays); after: commit f332fb4 (k's and v's side by
# side, end_inputs' eight cotangents packed in one array). all_packed_nl_350m.json: every per-chunk
# cotangent packed in one array (commit 937d084, replaced by f332fb4: 10,566 kernels, 31.5 GB; compiled
# before the driver was named). From the repository root at each commit (OUT: this folder):
set -x
export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
G="/tmp/gv13/bin/python benchmarks/gpu_compile.py --gpu h200"
P=parallel:model.nl_lm.memory_impl=parallel
$G --config titans_demo --no-base --variant $P --out OUT/after_titans_demo_b4.json model.dtype=bfloat16
$G --config nl_350m --no-base --variant $P --out OUT/after_nl_350m.json
$G --config titans_demo --no-base --variant $P --out OUT/after_titans_demo_b128.json model.dtype=bfloat16 train.batch_size=128
# one memory layer's kernels per chunk (forward + backward loop bodies):
python benchmarks/memory_kernel.py --launches h200 --variant parallel --shapes titans_demo,nl_350m > OUT/memory_kernel_launches.txt
# one memory layer's kernels at 1, 2 and 4 chunks per loop iteration (titans_unroll's variants):
/tmp/gv13/bin/python docs/gpu/2026-12-01-packed-cotangents/unroll_launches.py > OUT/unroll_launches.txt
