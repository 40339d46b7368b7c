"""JAX's persistent compilation cache for training runs (`run.compile_cache`).

Every pulse pattern of a CMS cycle is its own compiled step; a resumed or repeated run would
compile each again. With the cache on, XLA's executables are kept on disk, keyed by the program,
the devices and the JAX version, so the second start loads them instead: same executables, same
results, less waiting. `nljax.bench` keeps it off while it runs (`off`: it measures compile times).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import jax

from nljax.errors import ConfigError


CACHE_HIT = "/jax/compilation_cache/cache_hits"  # JAX's monitoring event for an executable read from the cache
_hits = 0
_listening = False


def _count(event: str, **kwargs) -> None:
    global _hits
    if event == CACHE_HIT:
        _hits += 1


def hits() -> int:
    """Executables this process has read from the persistent cache so far (a compilation that
    hit the cache is said so, nljax/run/phases.py)."""
    return _hits


def directory(setting: str) -> Path | None:
    """`auto`: the user's cache directory ($XDG_CACHE_HOME or ~/.cache, then nljax/jax), shared
    by every run of this user; `none`: no cache; anything else: that directory."""
    if setting == "none":
        return None
    if setting == "auto":
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nljax" / "jax"
    return Path(setting)


def enable(setting: str) -> Path | None:
    """Turn the cache on as `setting` says (before the first compilation); the directory used."""
    path = directory(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.compile_cache: {path} cannot be created: {e.strerror or e}") from None
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(path))
    if before and Path(before) != path:
        # JAX opens its cache at the first directory a process compiles with and keeps writing
        # there: a second run in one process (the Python API) with another directory reopens it
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    global _listening
    if not _listening:  # once per process
        jax.monitoring.register_event_listener(_count)
        _listening = True
    # An entry that cannot be written (a full disk) costs only its compile time at the next start;
    # JAX warns with several lines for each one, and on a full disk before the run's own first
    # write, which then stops the run with the one line that names the file (tested)
    warnings.filterwarnings("ignore", message="Error writing persistent compilation cache entry", category=UserWarning)
    return path


@contextlib.contextmanager
def off():
    """JAX's persistent cache off inside, as it was after: `nljax.bench` times compilations, and
    a cache that JAX_COMPILATION_CACHE_DIR turns on, or a run's `run.compile_cache` earlier in the
    same process (a notebook), had it load a step and say "compiled pattern L0 in 0.6 s" (3.5 s
    compiled). JAX decides once whether a process uses the cache: `reset_cache` asks again."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()
