"""One live run per run.dir: a lock file that a second run (resumed or not) is refused by.

`<run.dir>/nljax.lock` is created with O_EXCL (atomic, also on NFS v3+ and other shared file
systems) by process 0 and holds its host, pid and start time; a thread touches it every
HEARTBEAT_S seconds. A lock left by a run that died is stale and taken over:

- where its pid is ours to see (the same host, boot and pid namespace), when that process is
  gone: its pid is not alive (a crash or SIGKILL frees it at once), belongs to a process started
  at another time (the pid was reused), or is this process's own while this process does not
  hold the lock. A live process keeps its lock however old the heartbeat (a run suspended with
  Ctrl-Z or by the scheduler);
- elsewhere (another host, or another container with the same hostname: a restarted container
  has a new pid namespace), whose pids we cannot see, when its heartbeat is older than STALE_S.
  So is a lock file that cannot be read or is no lock (damaged, not JSON, not UTF-8): it is judged
  by its heartbeat alone, refused (in one line) while younger than STALE_S.

A stale lock is renamed aside before it is removed, and removed only if it is the one judged
stale: two runs taking over the same dead run's lock at once cannot both hold run.dir. A run that
exits (normally or with an error) removes its lock, only while the file is still its own.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from nljax.config import ConfigError
from nljax.writable import broken_link, dangling

NAME = "nljax.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0  # 10 missed heartbeats: the run is taken for dead
_HELD: set[Path] = set()  # the locks this process holds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _identity() -> dict:
    """This boot and pid namespace (Linux; empty elsewhere): where a lock's pid means a process we see."""
    out = {}
    try:
        out["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        out["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return out


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name start at field 3


def holder(path: Path, now: float | None = None) -> dict | None:
    """The live run holding the lock at `path`, or None (no lock, or a stale one)."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
        info = json.loads(path.read_text())
        host, pid = str(info["host"]), int(info["pid"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # being written this instant, or damaged: judge by the heartbeat alone
        return {"host": "?", "pid": "?", "started": "?"} if time.time() - _mtime(path) < STALE_S else None
    here = _identity()
    if host == socket.gethostname() and all(info.get(k, v) == v for k, v in here.items()):
        if pid == os.getpid():
            return info if path.absolute() in _HELD else None
        if not _alive(pid) or info.get("pid_start") not in (None, _started_at(pid)):
            return None
        return info
    return info if age < STALE_S else None


def refuse_if_live(run_dir: str | Path, what: str = "run.dir") -> None:
    """Raises when a live run holds `run_dir`'s lock: before a resume reads anything, so that the
    line names the live run rather than what it has not written yet. `what`: the setting naming
    the directory (run.dir, checkpoint.dir), for the line."""
    path = Path(run_dir).absolute() / NAME
    live = holder(path)
    if live is not None and live["host"] == "?":
        raise ConfigError(f"{what} {path.parent} has a lock file {path} that cannot be read, written less than "
                          f"{STALE_S / 60:g} minutes ago: a run may be starting there; if none is, remove the file")
    if live is not None:
        raise ConfigError(
            f"{what} {path.parent} is in use by a live run (host {live['host']}, pid {live['pid']}, "
            f"started {live.get('started', '?')}); wait for it to end or stop it, or use another {what}"
        )


def make_run_dir(path: Path, what: str = "run.dir") -> None:
    """Creates run.dir (and its parents), or says in one line why it cannot be."""
    if dangling(path):  # mkdir would say only "File exists"
        raise ConfigError(broken_link(path, f"{what} {path}"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be created: {e.strerror or e}") from None


def _read(path: Path) -> bytes | None:
    """The lock file's bytes (not text: a damaged one, not UTF-8, is judged and removed as any
    stale lock), or None."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class RunLock:
    """Held from `acquire` until `release`; refreshes its heartbeat in a daemon thread."""

    def __init__(self, run_dir: str | Path, what: str = "run.dir"):
        self.path = Path(run_dir).absolute() / NAME
        self.what = what  # the setting naming the directory, for the lines
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.text: str | None = None  # what this run wrote into the lock file

    def acquire(self) -> "RunLock":
        make_run_dir(self.path.parent, self.what)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "pid_start": _started_at(os.getpid()), **_identity()}
        for _ in range(3):  # a stale lock is removed and creation tried again; a racer may win it
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                judged = _read(self.path)
                refuse_if_live(self.path.parent, self.what)
                self._remove_stale(judged)
                continue
            except OSError as e:  # a read-only run.dir (permissions, a read-only mount): a traceback before
                raise ConfigError(f"{self.what} {self.path.parent} cannot be written (its lock {self.path}: "
                                  f"{e.strerror or e})") from None
            self.text = json.dumps(info)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(self.text)
            except OSError as e:  # a full disk, a quota: an empty lock left behind would refuse the next run
                self.path.unlink(missing_ok=True)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            _HELD.add(self.path)
            self._thread = threading.Thread(target=self._beat, name="nljax-lock-heartbeat", daemon=True)
            self._thread.start()
            return self
        raise ConfigError(f"{self.what} {self.path.parent}: could not take its lock {self.path} (another run races for it)")

    def _remove_stale(self, judged: bytes | None) -> None:
        """Removes the stale lock whose text was `judged`, and only that one: another run may have
        taken it over since it was read (renamed aside first, atomically; one that is not the lock
        judged stale goes back)."""
        aside = self.path.with_name(f"{NAME}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run removed it first
        if _read(aside) == judged:
            aside.unlink(missing_ok=True)
            return
        try:  # a racer's fresh lock: back where it was, unless a third run made one meanwhile
            os.link(aside, self.path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)

    def _ours(self) -> bool:
        """Whether the lock file is still this run's (a run suspended past STALE_S on another host
        may have lost it to a run that took it for dead)."""
        return self.text is not None and _read(self.path) == self.text.encode()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self._ours():
                    os.utime(self.path)
            except OSError:
                pass  # a transient file-system error; the next beat tries again

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._ours():  # never another run's
            self.path.unlink(missing_ok=True)
        _HELD.discard(self.path)
