# 2026-12-01: titans_demo and nl_350m compiled for an H200 on the 2-core CPU machine with the H200
# host's jax (0.11.2, the /tmp/gv13 environment of docs/gpu/2026-11-29-compile-offline-jax0.11/commands.sh),
# before (commit 8c1067c: the parallel form's reads for all chunks at once) and after (commit 66c92b0:
# the reads in groups, `memory.read_groups`). From the repository root at each commit (OUT: this folder):
set -x
export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
G="/tmp/gv13/bin/python benchmarks/gpu_compile.py --gpu h200"
P=parallel:model.nl_lm.memory_impl=parallel
# at 8c1067c (before):
$G --config titans_demo --variant $P --out OUT/before_titans_demo_b128.json model.dtype=bfloat16 train.batch_size=128
$G --config titans_demo --no-base --variant $P --out OUT/before_titans_demo_b4.json model.dtype=bfloat16
$G --config nl_350m --no-base --variant $P --out OUT/before_nl_350m.json
# at 66c92b0 (after): the same three commands, into OUT/after_*.json
# Forced group counts (forced_titans_demo_b128_gN.json: N groups of 16 / N chunks): the titans_demo
# batch 128 command on a scratch copy with 66c92b0's grouping code whose memory_parallel took its group
# count from an environment variable (not in the tree; memory_parallel(groups=N) is what it set).
# The figures "without summing each group's cotangents inside it"
# (docs/benchmarks/2026-12-01-parallel-form-read-groups.md)
# came from an earlier scratch version whose backward stacked the reads' and the loop's input
# cotangents for all chunks and summed them after the groups, as before the groups; not kept.
