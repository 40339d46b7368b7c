"""The whole-chunk memory kernel of another checkout, forward and backward at nl_350m's memory
shapes, compiled for an H200 on a CPU-only machine at each precision given: the check behind the
2026-11-29 report's paragraph on shared memory. Run from the repository root:

    git worktree add /tmp/wt494 494a303
    python docs/gpu/2026-11-29-compile-offline/whole_chunk_kernel.py /tmp/wt494 highest default

That checkout predates nljax.models.platform: JAX's default backend is reported as "gpu" so that
its kernels are compiled, not interpreted; the device is JAX's default while lowering (jax 0.11's Pallas asks it
which card it compiles for)."""

import sys
import time

sys.path.insert(0, sys.argv[1])
sys.path.insert(1, "benchmarks")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_platforms", "cpu")
import gpu_compile  # noqa: E402

device = gpu_compile.gpu_device("h200")
jax.default_backend = lambda: "gpu"
import nljax.models.memory_kernel as mk  # noqa: E402

print(mk.__file__)
B, H, T, d, hidden, chunk = 8, 8, 2048, 64, 128, 64  # nl_350m's memory layers
on = jax.sharding.SingleDeviceSharding(device)
S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=on)
state = {"M": {"W1": S(B, H, d, hidden), "W2": S(B, H, hidden, d)}, "S": {"W1": S(B, H, d, hidden), "W2": S(B, H, hidden, d)}}
args = (state, S(B, H, T, d), S(B, H, T, d), S(B, H, T, d), S(B, H, T), S(B, H, T), S(B, H, T))


def loss(state, q, k, v, theta, eta, alpha):
    y, final = mk.memory_kernel(state, q, k, v, theta, eta, alpha, kind="mlp", chunk=chunk)
    return y.sum() + sum(x.sum() for x in jax.tree.leaves(final))


for precision in sys.argv[2:]:
    t0 = time.time()
    try:
        with jax.default_matmul_precision(None if precision == "default" else precision), jax.default_device(device):
            jax.jit(jax.grad(loss, argnums=tuple(range(7)))).lower(*args).compile()
        print(f"{precision}: compiled in {time.time() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        print(f"{precision}: FAILED {str(e).splitlines()[0][:300]}")
