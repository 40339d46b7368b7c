"""The host allocator's settings (nljax/measure/hostmem.py): applied only where they act, and they make
freed memory come back without page faults."""

import os
import platform
import subprocess
import sys

import jax
import pytest

from nljax.errors import ConfigError
from nljax.measure import hostmem

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="mallopt is glibc's")

# A fresh process: retain() before JAX's backends start, then a 256 MB block allocated, written
# and freed twice; the page faults of the second round (the first one's memory, reused or not).
PROBE = """
import ctypes, resource
from nljax.measure import hostmem
print(hostmem.retain())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 256 << 20
def round_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    page = p - p % 4096  # 4 KB pages even where transparent huge pages are "always"
    libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(n + p - page), 15)  # MADV_NOHUGEPAGE
    ctypes.memset(p, 1, n)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
round_faults()
print(round_faults())
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
kept = rss()
print(hostmem.release(), kept - rss())  # whether release() ran, the resident bytes it gave back
"""


def probe(**env) -> tuple[str, int, tuple[bool, int]]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", hostmem.ENV) and not k.startswith("MALLOC_")}
    full = {**full, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    decision, faults, last = out.stdout.splitlines()[:3]
    released, freed = last.split()
    return decision, int(faults), (released == "True", int(freed))


@glibc
def test_retained_memory_comes_back_without_page_faults_until_released():
    decision, retained, (released, freed) = probe()
    assert decision.startswith("retain"), decision
    assert released and freed > 200 << 20, freed  # release() hands the kept 256 MB back
    decision, system, (released, _) = probe(NLJAX_HOST_MALLOC="system")
    assert decision.startswith("system"), decision
    assert not released
    # 256 MB is 65,536 pages of 4 KB: glibc's default maps and unmaps the block, so every round
    # faults it in again; retained, it is reused
    assert system > 1000, system
    assert retained < system / 20, (retained, system)
    print(f"page faults of the second round: {retained} retained, {system} system")


def test_left_alone_after_jax_started_or_when_the_user_chose(monkeypatch):
    jax.devices()  # this test process's backends exist: too late, nothing is changed
    monkeypatch.delenv(hostmem.ENV, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    if platform.libc_ver()[0] == "glibc":
        assert hostmem.retain() == "system (JAX's backends had started)"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert hostmem.retain().startswith("system")
    assert hostmem.settings()["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # glibc's own variable: the user's choice too
    assert hostmem.retain().startswith("system (the user's")
    assert hostmem.settings()["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv(hostmem.ENV, "system")
    assert hostmem.retain() == f"system (${hostmem.ENV}=system)"
    assert hostmem.settings()["nljax"] == f"system (${hostmem.ENV}=system)"


def test_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "jemalloc")
    with pytest.raises(ConfigError, match="NLJAX_HOST_MALLOC must be one of retain, system, got 'jemalloc'"):
        hostmem.retain()


@glibc
def test_an_accelerator_backend_is_left_alone():
    decision, _, _ = probe(JAX_PLATFORMS="cuda,cpu")  # read from the config: nothing is started
    assert decision == "system (an accelerator backend)"
