"""Which form of the neural memory's inner loop runs (`model.nl_lm.memory_impl`): the scan
(`memory.memory_forward`), the parallel form (`memory.memory_parallel`), the whole-chunk Pallas
kernel (`memory_kernel`) or the parallel form's loop as a kernel (`memory_loop_kernel`). Its own
module: the kernel modules build on each other, and the choice takes all of them."""

from __future__ import annotations

import functools

from nljax.errors import ConfigError
from nljax.models import memory_kernel as mk
from nljax.models import memory_loop_kernel as ml
from nljax.models import platform
from nljax.models.memory import memory_forward, memory_parallel


def inner_loop(impl: str, kind: str, chunk: int, dim: int, hidden: int, *, remat: bool, unroll: int):
    """`model.nl_lm.memory_impl`'s inner loop: (state, q, k, v, theta, eta, alpha) -> (y, state).
    The kernels and `memory.memory_parallel` always keep only the chunk-start states for their
    backward pass (as `remat` does); `unroll` is the scans'."""
    form = select(impl, kind, chunk, dim, hidden)
    if form == "pallas":
        return functools.partial(mk.memory_kernel, kind=kind, chunk=chunk)
    if form == "parallel_pallas":
        return functools.partial(ml.memory_parallel_kernel, kind=kind, chunk=chunk)
    if form == "parallel":  # keeps only the chunk-start states, whatever `remat` says
        return functools.partial(memory_parallel, kind=kind, chunk=chunk, unroll=unroll)
    return functools.partial(memory_forward, kind=kind, chunk=chunk, remat=remat, unroll=unroll)


def select(impl: str, kind: str, chunk: int, dim: int, hidden: int, backend: str | None = None) -> str:
    """The inner loop's implementation for `model.nl_lm.memory_impl` on `backend` (default: `platform.backend()`):
    'scan', 'parallel', 'pallas' or 'parallel_pallas'. auto is the parallel form on a GPU and the
    scan elsewhere. On one H200 (2026-11-30) the parallel form ran x0.906 the scan's step in
    nl_350m and x0.898 in titans_demo, side by side, and with its reads in groups of chunks
    titans_demo's batch 128 compiles to 19.4 GB against the scan's 18.4 (offline); on a CPU,
    bound by arithmetic rather than by launches, it is 1.01-1.03x slower
    (docs/concepts/memory-kernel.md). Both kernels were
    slower than the scan on the H200. `pallas` and `parallel_pallas` (`memory_loop_kernel`) are
    the kernels as asked, `parallel` (`memory.memory_parallel`) and `scan` run on every backend."""
    backend = backend or platform.backend()
    kernel = impl in ("pallas", "parallel_pallas")
    if kernel and backend == "gpu" and (why := mk.gpu_unsupported(kind, chunk, dim, hidden)):
        raise ConfigError(f"model.nl_lm.memory_impl={impl}: {why}")
    if impl == "auto":
        return "parallel" if backend == "gpu" else "scan"
    return impl
