"""The run.dir lock: a live run refuses a second one; a dead run's lock does not block."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nljax import runlock
from nljax.config import ConfigError


def _write(path, host, pid, age_s=0.0):
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "then"}))
    t = time.time() - age_s
    os.utime(path, (t, t))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_lock_refuses_and_stale_locks_are_taken_over(tmp_path):
    path = tmp_path / runlock.NAME
    _write(path, socket.gethostname(), os.getpid())  # this test process: alive
    with pytest.raises(ConfigError, match=f"is in use by a live run .host {socket.gethostname()}, pid {os.getpid()}"):
        runlock.RunLock(tmp_path).acquire()
    _write(path, "other-host", 1, age_s=10)  # another host, recent heartbeat: alive
    with pytest.raises(ConfigError, match="host other-host"):
        runlock.RunLock(tmp_path).acquire()
    for host, pid, age in ((socket.gethostname(), _dead_pid(), 0), ("other-host", 1, runlock.STALE_S + 1)):
        _write(path, host, pid, age)  # a killed run on this host; a silent one on another
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
