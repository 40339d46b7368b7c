"""The platform a model is built and traced for: JAX's default backend, unless a program is being
compiled for another one.

The GPU forms are chosen when a model is built (attention, the inner loop's implementation, the
embedding's gradient) and a Pallas kernel decides when it is traced whether to run compiled or
interpreted. Both follow the platform the program will run on. That is JAX's default backend,
except when a CPU-only machine compiles a training step for a GPU it does not have
(`benchmarks/gpu_compile.py`, through a GPU topology's compile-only devices): there the program
is built and traced inside `compiling_for("gpu")`, so that it holds the same kernels as on the
GPU itself, not their interpreted forms.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax
from jax.extend import backend as jax_backend

# (backend, CUDA, device) of the innermost compiling_for; a context variable: another thread (or
# task) building a model at the same time builds for its own platform
_TARGET: contextvars.ContextVar[tuple[str, bool, Any] | None] = contextvars.ContextVar("nljax_target", default=None)


def backend() -> str:
    """'gpu', 'cpu' or 'tpu': the platform the program being built runs on."""
    target = _TARGET.get()
    return target[0] if target else jax.default_backend()


def on_cuda() -> bool:
    """Whether that platform is a CUDA GPU (ROCm has no cuDNN, and its Triton differs)."""
    if target := _TARGET.get():
        return target[1]
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in jax_backend.get_backend().platform_version.lower()


def device() -> Any:
    """The device a compile-time probe (`compiles.refusal`) compiles for: None for JAX's default
    device; inside `compiling_for`, its device (e.g. a GPU topology's compile-only device)."""
    target = _TARGET.get()
    return target[2] if target else None


@contextlib.contextmanager
def compiling_for(name: str, device: Any = None) -> Iterator[None]:
    """Build and trace for `name` ('gpu': a CUDA GPU, 'cpu') inside the block, whatever JAX's
    default backend is; probes compile for `device` (None: JAX's default)."""
    if name not in ("gpu", "cpu", "tpu"):
        raise ValueError(f"compiling_for: a platform is 'gpu', 'cpu' or 'tpu', not {name!r}")
    token = _TARGET.set((name, name == "gpu", device))
    try:
        yield
    finally:
        _TARGET.reset(token)


def lowering() -> contextlib.AbstractContextManager:
    """Where a program built for `device()` is lowered and compiled: that device as JAX's default
    one, when there is one. Pallas's GPU lowering asks the default device what card it targets
    (its compute capability; jax 0.11 refuses a CPU with "No supported GPU devices found"); a
    compile-only device answers as the card would. Otherwise nothing changes."""
    target = device()
    return jax.default_device(target) if target is not None else contextlib.nullcontext()


def cuda_lowering(card: str = "NVIDIA H100") -> contextlib.AbstractContextManager:
    """Where a machine without a GPU lowers a program that holds Pallas kernels for CUDA
    (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`: the tests, and
    benchmarks/triton_resources.py). jax 0.11's Triton lowering asks the default device which card
    it targets and refuses a CPU ("No supported GPU devices found"): inside this block an abstract
    mesh names `card`. jax 0.10 asks nothing (and lowers no kernel under such a mesh), and a GPU
    answers for itself: nothing changes there."""
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11) or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=card, num_cores=None, platform="gpu")
    return use_abstract_mesh(AbstractMesh((1,), ("_",), axis_types=(AxisType.Auto,), abstract_device=device))
