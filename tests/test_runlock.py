"""The run.dir lock: a live run refuses a second one; a dead run's lock does not block."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nljax.config import ConfigError
from nljax.runtime import runlock


def _write(path, host, pid, age_s=0.0, **more):
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "then", **more}))
    t = time.time() - age_s
    os.utime(path, (t, t))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_lock_refuses_and_stale_locks_are_taken_over(tmp_path):
    path = tmp_path / runlock.NAME
    here, live = socket.gethostname(), os.getppid()  # pytest's parent: alive
    _write(path, here, live, age_s=10)
    with pytest.raises(ConfigError, match=f"is in use by a live run .host {here}, pid {live}"):
        runlock.RunLock(tmp_path).acquire()
    _write(path, "other-host", 1, age_s=10)  # another host, recent heartbeat: alive
    with pytest.raises(ConfigError, match="host other-host"):
        runlock.RunLock(tmp_path).acquire()
    ours = runlock._identity()
    # a live run suspended (Ctrl-Z, the scheduler) for longer than the heartbeat's limit still holds it
    _write(path, here, live, runlock.STALE_S + 1, pid_start=runlock._started_at(live), **ours)
    with pytest.raises(ConfigError, match="in use by a live run"):
        runlock.RunLock(tmp_path).acquire()
    other_ns = {**ours, "pidns": "pid:[1]"}  # a container of the same hostname: its pids are not ours to see
    _write(path, here, live, 10, **other_ns)
    with pytest.raises(ConfigError, match="in use by a live run"):
        runlock.RunLock(tmp_path).acquire()
    stale = (
        (here, _dead_pid(), 0, {}),  # a killed run on this host
        (here, os.getpid(), 0, {}),  # a killed run whose pid this process has now (pid 1 in a container)
        (here, live, 0, {"pid_start": "0", **ours}),  # its pid reused by a process started later
        (here, live, runlock.STALE_S + 1, other_ns),  # a silent run in another container of this hostname
        ("other-host", 1, runlock.STALE_S + 1, {}),  # a silent run on another host
    )
    for host, pid, age, more in stale:
        _write(path, host, pid, age, **more)
        lock = runlock.RunLock(tmp_path).acquire()
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match="in use by a live run"):
            runlock.RunLock(tmp_path).acquire()  # held now
        lock.release()
        assert not path.exists()


def test_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = runlock.RunLock(tmp_path).acquire()
    path = tmp_path / runlock.NAME
    os.utime(path, (0, 0))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 5
    lock.release()


def test_a_stale_lock_taken_over_by_a_racer_is_left_to_it(tmp_path, monkeypatch):
    """Two runs judge the same dead run's lock stale; the other one removes it and takes the lock
    before this one acts: this one must neither delete the racer's fresh lock nor hold a lock
    beside it (it is refused, naming the racer). A run that lost its lock never removes the one
    that replaced it."""
    path, here, live = tmp_path / runlock.NAME, socket.gethostname(), os.getppid()
    _write(path, here, _dead_pid())
    judge = runlock.refuse_if_live

    def racer_wins(run_dir, what="run.dir"):  # judged stale, then the racer's lock appears
        judge(run_dir, what)
        _write(path, here, live, pid_start=runlock._started_at(live), **runlock._identity())

    monkeypatch.setattr(runlock, "refuse_if_live", racer_wins)
    with pytest.raises(ConfigError, match=f"in use by a live run .host {here}, pid {live}"):
        runlock.RunLock(tmp_path).acquire()
    assert json.loads(path.read_text())["pid"] == live and [p.name for p in tmp_path.iterdir()] == [runlock.NAME]
    monkeypatch.setattr(runlock, "refuse_if_live", judge)
    path.unlink()
    lock = runlock.RunLock(tmp_path).acquire()
    _write(path, "other-host", 1)  # taken over by a run that judged this one dead (suspended too long)
    lock.release()
    assert json.loads(path.read_text())["host"] == "other-host"


@pytest.mark.slow  # an edge case of 10-15 s: the README's suite kept under 15 minutes on 2 cores (.ci/run runs it)
def test_a_lock_that_cannot_be_written_is_one_line_and_left_nowhere(tmp_path):
    """A full disk (here: a file-size limit of 0) when the lock is written: one line naming the
    lock file, exit 1, and no empty lock left to refuse the next run (it was, for 5 minutes)."""
    from helpers import QUICK, TINY, cli, subprocess_env

    args = ["--quiet", f"run.dir={tmp_path / 'run'}", "train.steps=1", "mesh.intra=1", "--cpu-devices", "1", *TINY, *QUICK]
    limited = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY)); "
               "from nljax.train import main; sys.exit(main(sys.argv[1:]))")
    # every compilation before the lock is written to the compile cache (run.compile_cache=auto),
    # and fails there first: JAX's warning of it is not a line of nljax's (it was, on a slow machine).
    # An empty cache of its own: one the suite's other runs filled would load, and write nothing
    p = subprocess.run([sys.executable, "-c", limited, *args], capture_output=True, text=True, timeout=300,
                       env=subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                                          XDG_CACHE_HOME=str(tmp_path / "cache")))
    lock = tmp_path / "run" / runlock.NAME
    assert p.returncode == 1 and p.stderr.strip() == f"nljax.train: error: cannot write {lock}: [Errno 27] File too large", p.stderr
    assert not lock.exists()
    cli("nljax.train", *args)  # the next run is not refused


def test_a_live_process_of_another_user_holds_its_lock(tmp_path, monkeypatch):
    """A pid that signal 0 may not reach (EPERM: another user's live process, on a shared machine)
    is alive: its lock is not taken over."""
    path, here = tmp_path / runlock.NAME, socket.gethostname()
    _write(path, here, 4242, **runlock._identity())

    def not_ours(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(runlock.os, "kill", not_ours)
    with pytest.raises(ConfigError, match="in use by a live run .host .*, pid 4242"):
        runlock.RunLock(tmp_path).acquire()


def test_a_process_start_mark_is_its_start_time():
    """`_started_at` is the process's start (in clock ticks after boot): a process started now
    reads as started now, and the mark does not change as the process runs and grows."""
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.readline(); x = bytearray(1 << 26); "
                          "sys.stdin.readline()"], stdin=subprocess.PIPE, text=True)
    try:
        first = runlock._started_at(p.pid)
        started = boot + int(first) / os.sysconf("SC_CLK_TCK")
        assert t0 - 2 <= started <= time.time() + 2
        p.stdin.write("\n")
        p.stdin.flush()
        time.sleep(0.5)  # it has grown by 64 MiB
        assert runlock._started_at(p.pid) == first
    finally:
        p.kill()
        p.wait()
