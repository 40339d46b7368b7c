# 2026-11-29: nl_350m and titans_demo compiled for an H200 on the 2-core CPU machine with the H200
# host's jax (0.11.2). jax 0.11 needs Python >= 3.12; the machine has 3.11, so a Python 3.13 was built
# from Debian's source package (trixie's python3.13_3.13.5.orig.tar.xz from deb.debian.org):
#   ./configure --prefix=/tmp/py313 && make -j2 && make install
#   /tmp/py313/bin/python3.13 -m venv /tmp/gv13
#   /tmp/gv13/bin/pip install "jax[cuda13]==0.11.2" flax==0.12.10 optax==0.2.8 orbax-checkpoint==0.12.4
#   /tmp/gv13/bin/pip install -e .            # this checkout
# Then, from the repository root (OUT: this folder):
set -x
G="/tmp/gv13/bin/python benchmarks/gpu_compile.py --gpu h200"
$G --config nl_350m --variant scanned:model.nl_lm.scan_layers=true --variant scanned_memory_unroll4:model.nl_lm.scan_layers=true,model.nl_lm.memory_unroll=4 --variant scanned_pallas:model.nl_lm.scan_layers=true,model.nl_lm.memory_impl=pallas --variant parallel_pallas:model.nl_lm.memory_impl=parallel_pallas --out OUT/nl_350m.json
$G --config nl_350m --no-base --precision highest --variant parallel_pallas:model.nl_lm.memory_impl=parallel_pallas --variant scanned_pallas:model.nl_lm.scan_layers=true,model.nl_lm.memory_impl=pallas --out OUT/nl_350m_highest.json
$G --config titans_demo --variant parallel_pallas:model.nl_lm.memory_impl=parallel_pallas --variant pallas:model.nl_lm.memory_impl=pallas --out OUT/titans_demo.json model.dtype=bfloat16
$G --config titans_demo --no-base --precision highest --variant parallel_pallas:model.nl_lm.memory_impl=parallel_pallas --variant pallas:model.nl_lm.memory_impl=pallas --out OUT/titans_demo_highest.json model.dtype=bfloat16
# The whole-chunk kernel of commit 494a303 (git worktree add /tmp/wt494 494a303), under highest and default:
/tmp/gv13/bin/python docs/gpu/2026-11-29-compile-offline/whole_chunk_kernel.py /tmp/wt494 highest default
