# 2026-12-01: titans_demo's training step (model.dtype=bfloat16, batch 4 x 512, memory_impl auto: the
# parallel form on a GPU) compiled for an H200 on the 2-core CPU machine with the H200 host's jax
# (0.11.2: the /tmp/gv13 environment of docs/gpu/2026-11-29-compile-offline-jax0.11/commands.sh),
# once per set of XLA command-buffer flags, with XLA's dump of the step's thunks. From the
# repository root (about 2-4 min each; D: this folder):
set -x
export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
D=docs/gpu/2026-12-01-command-buffers
C="/tmp/gv13/bin/python $D/compile_step.py"
run() {  # name, compile_step.py's own options, then XLA flags
  local name=$1 opt=$2; shift 2
  XLA_FLAGS="--xla_dump_to=/tmp/cb/$name --xla_dump_hlo_as_text $*" $C /tmp/cb/$name.hlo $opt
}
# gpu_compile.py's target config as it was before this commit (no CUDA driver named):
run default --no-driver
run while --no-driver --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
run off --no-driver --xla_gpu_enable_command_buffer=
# the card's CUDA 13.0 driver and toolkit described (gpu_compile.py's target config since):
run drv_default ""
run drv_while "" --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
run drv_while_unroll "" --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true
run drv_no_dsf "" --xla_gpu_enable_command_buffer=-DYNAMIC_SLICE_FUSION
# thunks.txt: each variant's thunks after XLA's thunk passes (none ran for `off`: its thunks before them)
for v in default while off drv_default drv_while drv_while_unroll drv_no_dsf; do
  f=$(ls /tmp/cb/$v/module_*.jit_train_step.thunk_sequence_after_thunk_passes.txt 2>/dev/null \
      || ls /tmp/cb/$v/module_*.jit_train_step.thunk_sequence.txt)
  echo "== $v"; python $D/thunks.py "$f"; echo
done
# the compiled step's XLA debug options (the defaults of this XLA): /tmp/cb/default/module_*.jit_train_step.config.pbtxt
# loop_bodies_*.txt: the first memory layer's forward and backward loops from drv_default's and
# default's thunk_sequence_after_thunk_passes.txt
# The HLO text of every variant is the same but for a source line in its metadata (diff); kernels:
# 4,390 per step in each (OUT.json, nljax.measure.hlo.launching), buffers 1,035,095,820 bytes.
# Later the same day, at the commit whose loops slice at min(i, n - 1) (memory._scan):
# thunks_min_offset.txt. The step again, with the driver named, under XLA's defaults and +WHILE:
run x_default ""
run x_while "" --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
# one memory layer's forward + backward at titans_demo's memory shapes, as the variants were tried
# (/tmp/kc/dump.py: benchmarks/memory_kernel.py's inputs, jax.grad of the parallel form, compiled
# for an H200 with memory_kernel's shapes; thunks.py on its dump), each variant of memory._scan's
# offset in turn: the loop's counter (lax.scan: 5 dynamic-slice fusions, 35 graph launches), an
# optimization barrier on it (XLA's HloEvaluator refuses opt-barrier while compiling), a second
# counter carried and incremented (XLA still reads it as the counter: 5), one clamped with min/max
# in the carry (none; 61 kernels a chunk against 59), min(i, n - 1) of the counter (none; 59; kept)
XLA_FLAGS="--xla_dump_to=/tmp/cb/Lexp --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
  /tmp/gv13/bin/python /tmp/kc/dump.py titans_demo parallel /tmp/cb/Lexp.hlo
# nl_350m's step with fused350m_parallel4's overrides under +WHILE (thunks_min_offset.txt, n350_while):
# compile_step.py with `cfg = config.load(os.environ.get("CFG", "titans_demo"), ...)` in place of its
# titans_demo, then
CFG=nl_350m XLA_FLAGS="--xla_dump_to=/tmp/cb/n350_while --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
  /tmp/gv13/bin/python compile_step2.py /tmp/cb/n350_while.hlo model.remat=memory model.nl_lm.attention=auto \
  model.nl_lm.embed_grad=onehot model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel model.nl_lm.memory_unroll=4
