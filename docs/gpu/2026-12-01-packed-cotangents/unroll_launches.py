# One memory layer's forward + backward (the parallel form, titans_demo's memory shapes) compiled for
# an H200 offline at 1, 2 and 4 chunks per loop iteration: the kernels it launches (the numbers in
# benchmarks/gpu_suite.sh's part_titans_unroll). From the repository root:
#   PYTHONPATH=$PWD JAX_PLATFORMS=cpu /tmp/gv13/bin/python docs/gpu/2026-12-01-packed-cotangents/unroll_launches.py
# Output at commit f332fb4's model code (the packing kept): unroll_launches.txt; at 937d084's (every
# cotangent packed in one array, since replaced): 1 1062, 2 970, 4 954.
import sys
sys.path.insert(0, "benchmarks")
import jax  # noqa: E402
import memory_kernel as mkb  # noqa: E402
from gpu_compile import gpu_device  # noqa: E402
from nljax.measure import hlo  # noqa: E402
from nljax.models import memory as nm, platform  # noqa: E402

device = gpu_device("h200")
s = mkb.shapes_of("titans_demo")
state, xs = mkb.inputs(s)
on_card = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
with platform.compiling_for("gpu", device), platform.lowering():
    impls = mkb.implementations(s, interpret=False)
    for u in (1, 2, 4):
        orig = nm.memory_parallel
        nm.memory_parallel = lambda *a, u=u, **kw: orig(*a, unroll=u, **kw)
        fn = jax.grad(lambda st, a: mkb.loss_and_outputs(impls["parallel"])(st, a)[0], argnums=(0, 1))
        text = jax.jit(fn).lower(*jax.tree.map(on_card, (state, xs))).compile().as_text()
        nm.memory_parallel = orig
        print(u, sum(t for _, t, _ in hlo.launching(text)), flush=True)
