"""Whether a fused kernel compiles on this device: what `auto` asks before it picks one.

Attention's `auto` picks a fused form on a GPU from its shapes (`attention_kernel.gpu_unsupported`,
`attention.cudnn_refusal`), but a shape those rules take can still fail in the device's
compiler: a Triton kernel needing more than the 227 KiB of shared memory an H100 or H200 gives
one block (the memory kernel's backward once did, compiled offline:
docs/concepts/memory-kernel.md), a cuDNN without sliding windows. A failure there would stop
every run with a compiler traceback at its first step. So before `auto` takes a fused form it
compiles that form alone, forward and backward, at one stream row and one head (the kernels'
resources do not depend on the batch or the number of heads: each program is one (row, head)),
and takes the next form when it does not compile, saying so in one line. A probe costs its
compilation: the attention kernels' take seconds; the memory kernel's took up to two minutes
(nl_350m's backward, offline, the kernel of 2026-11-28), one reason the memory's `auto` is the
scan and probes nothing.

Explicit choices are not probed: a user who names a form gets it, or the compiler's error.
Every process of a multi-host run probes on its own device; the devices of one run are alike.
"""

from __future__ import annotations

import sys
from typing import Callable

import jax

from nljax.errors import first_line
from nljax.models import platform

_SEEN: dict[tuple, str | None] = {}  # once per process and shape: a probe is a compilation


def refusal(key: tuple, fn: Callable, *args) -> str | None:
    """None when `jax.jit(fn)` compiles for `args` (arrays or ShapeDtypeStructs) on JAX's
    default device, or the one the program is built for (`platform.device()`); else the
    compiler's error, one line. Cached under `key`."""
    if (device := platform.device()) is not None:
        on = jax.sharding.SingleDeviceSharding(device)
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), args)
    key = (platform.backend(), device.device_kind if device is not None else None, *key)
    if key not in _SEEN:
        try:
            with platform.lowering():
                jax.jit(fn).lower(*args).compile()
            _SEEN[key] = None
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises is the reason given
            _SEEN[key] = f"{type(e).__name__}: {first_line(e)}"[:300]
    return _SEEN[key]


def warn_fallback(setting: str, tried: str, why: str, using: str) -> None:
    """The one line `auto` prints when a fused form does not compile here."""
    print(f"nljax: warning: {setting}=auto: {tried} does not compile on this device ({why}); using {using}",
          file=sys.stderr, flush=True)


def grad_of_sum(fn: Callable) -> Callable:
    """args (a tuple of `fn`'s arguments) -> their gradient of the sum of `fn`'s outputs (in
    float32): what a probe compiles, so that the backward kernels are compiled too."""
    return jax.grad(lambda args: sum(x.astype("float32").sum() for x in jax.tree.leaves(fn(*args))))
