"""The host allocator under XLA:CPU: freed memory kept for the next step.

XLA:CPU allocates a step's temporaries afresh on every execution (1.5 GB for titans_demo at
4 x 512). glibc serves blocks that large with `mmap` and gives them back with `munmap` when they
are freed, so every step the kernel faults the same memory in again, 4 KB at a time, and zeroes
it: measured, 7.4 M page faults in a two-minute bench, ~20% of titans_demo's step and ~30% of the
default job's (docs/benchmarks/2026-11-24-cpu.md).

`retain()` tells glibc, through `mallopt`, to keep what is freed for reuse: one arena for every
thread (M_ARENA_MAX=1, so XLA's worker threads allocate from the heap that keeps it), no `mmap`
for large blocks (M_MMAP_MAX=0) and no trimming of the heap (M_TRIM_THRESHOLD=-1). The process
then holds its peak host memory between steps, which every step needs again anyway. Numerics are
unchanged (the same bits; only where the memory comes from changes).

Each command-line program (nljax/cli.py) calls `retain()` before JAX starts its backends, and it
acts only where it helps and is wanted:

- on Linux with glibc (`mallopt` is glibc's);
- when JAX will compute on the CPU (`jax_platforms` says cpu, or no accelerator plugin is
  installed): on a GPU the step's temporaries live in device memory;
- before JAX's backends exist: a thread keeps the arena it first allocated from, and measured,
  the settings applied later do nothing for the step; so a process whose JAX has started (a
  notebook, the test suite) is left alone. A script that calls a command's `main()` before
  touching JAX gets them, as the command would;
- unless the user chose: NLJAX_HOST_MALLOC=system, anything in LD_PRELOAD (an allocator, a
  profiler), malloc settings in GLIBC_TUNABLES, or glibc's MALLOC_* variables.

`release()` gives the kept memory back at once, for a process that moves on to work with another
peak (benchmarks/titans_pytorch.py, between the two libraries).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
import platform
import sys

import jax

from nljax.errors import ConfigError

ENV = "NLJAX_HOST_MALLOC"  # retain (the default) | system
MODES = ("retain", "system")

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8

RETAINED = "retain (mallopt: one arena, no mmap, no trim)"
_decision: str | None = None  # what retain() did, for the benchmarks' records


def retain() -> str:
    """Apply the settings above where they apply; returns what was done, in words."""
    global _decision
    mode = os.environ.get(ENV, "retain")
    if mode not in MODES:
        raise ConfigError(f"${ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    if _decision == RETAINED:
        return _decision  # applied already in this process: it stays applied
    reason = _not_applicable(mode)
    if reason is None:
        libc = ctypes.CDLL(None)
        refused = [name for name, p, v in (("M_ARENA_MAX", M_ARENA_MAX, 1), ("M_MMAP_MAX", M_MMAP_MAX, 0),
                                           ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, -1)) if libc.mallopt(p, v) != 1]
        reason = (RETAINED if not refused
                  else f"partly (mallopt refused {', '.join(refused)})")
    _decision = reason
    return reason


def release() -> bool:
    """Where `retain()` applied: give the heap's free memory back to the system now (glibc's
    `malloc_trim`), for a process about to leave a phase whose peak the next one will not reach
    again soon. The next step faults what it needs in once more. Returns whether it ran."""
    if _decision != RETAINED:
        return False
    ctypes.CDLL(None).malloc_trim(0)
    return True


def _not_applicable(mode: str) -> str | None:
    if mode == "system":
        return f"system (${ENV}=system)"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "system (not Linux with glibc)"
    if os.environ.get("LD_PRELOAD") or "malloc" in os.environ.get("GLIBC_TUNABLES", "") or _glibc_env():
        return "system (the user's: LD_PRELOAD, GLIBC_TUNABLES or MALLOC_*)"
    if not _computes_on_cpu():
        return "system (an accelerator backend)"
    if backends_started():
        return "system (JAX's backends had started)"
    return None


def _glibc_env() -> list[str]:
    """glibc's own allocator variables (MALLOC_ARENA_MAX, MALLOC_TRIM_THRESHOLD_, ...) in the
    environment; MALLOC_CONF is jemalloc's."""
    return sorted(k for k in os.environ if k.startswith("MALLOC_") and k != "MALLOC_CONF")


def _computes_on_cpu() -> bool:
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not _accelerator_plugins()


def _accelerator_plugins() -> bool:
    """Whether a PJRT plugin (CUDA, ROCm, ...) or libtpu is installed, found the way JAX finds
    them (the `jax_plugins` namespace package and entry points), without importing them."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    spec = importlib.util.find_spec("jax_plugins")
    return spec is not None and any(pkgutil.iter_modules(spec.submodule_search_locations or []))


def backends_started() -> bool:
    from jax._src import xla_bridge  # no public API says this; absent, assume started (do nothing)

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started is None or bool(started())


def settings() -> dict:
    """The host allocator's settings, for a benchmark's record: the environment's, and what
    `retain()` did in this process (None: it was not called)."""
    names = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", ENV, *_glibc_env())
    env = {k: os.environ[k] for k in names if k in os.environ}
    return {**env, "nljax": _decision}
