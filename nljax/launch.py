"""Local launcher:  python -m nljax.launch --nproc N [--cpu-devices M] -- <command ...>

Starts N copies of a command as the processes of one multi-process JAX run on this machine,
like `torchrun --standalone`: process 0 hosts the coordination service on 127.0.0.1 at a free
port, and each process gets `NLJAX_COORDINATOR`, `NLJAX_NUM_PROCESSES` and `NLJAX_PROCESS_ID`
(read by every nljax CLI, see `nljax.runtime.distributed`). Each output line is prefixed with its
process index. If a process exits non-zero, the others get `--grace` seconds to exit on their
own (they usually do: their collectives fail, or they raise the same lockstep error), then are
killed, and the launcher exits with the first failure's code. Ctrl-C, SIGTERM (a scheduler's
preemption notice) and SIGHUP (the terminal closed) are passed on to every process as SIGTERM,
on which it saves a checkpoint and exits (`nljax.runtime.preemption`); whatever is left after
`--save-grace` seconds (a large state's save takes a while: longer than a failure's `--grace`),
or at a second signal, is killed, said in one line. Their output is written out before the launcher exits.

Each process runs in its own session, so a command started through a shell is stopped with
everything it started, and what a command leaves running when it exits is killed. SIGKILL, not
SIGTERM, is what reliably ends a JAX process that has joined a distributed run: JAX's preemption
service takes SIGTERM as a preemption notice.

The processes do not outlive the launcher, even when it is killed with SIGKILL: on Linux each is
started with a parent-death signal (SIGKILL, `prctl(PR_SET_PDEATHSIG)`), and a small guard
process, which the launcher feeds through a pipe, kills every process's session when that pipe
closes without the launcher saying it is done (this catches what the commands started too). A
process that cannot be started (or whose output thread cannot) stops the ones already started.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from nljax.runtime.launchenv import ENV_COORDINATOR, ENV_LAUNCHER, ENV_LOCAL_DEVICE_IDS, ENV_NUM_PROCESSES, ENV_PROCESS_ID

PROG = "nljax.launch"

SETTLE_S = 1.0  # after a first failure, how long to watch for the others before naming the cause


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, index: int, nproc: int, coordinator: str, cpu_devices: int | None,
              devices_per_proc: int | None) -> dict:
    env = dict(base)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(nproc)
    env[ENV_PROCESS_ID] = str(index)
    env[ENV_LAUNCHER] = shlex.join(["python", "-m", PROG, "--nproc", str(nproc),
                                    *(["--cpu-devices", str(cpu_devices)] if cpu_devices is not None else []),
                                    *(["--devices-per-proc", str(devices_per_proc)] if devices_per_proc else [])])
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    if cpu_devices is not None:
        # JAX reads every config option from the upper-case environment variable of its name.
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
    if devices_per_proc is not None:
        ids = range(index * devices_per_proc, (index + 1) * devices_per_proc)
        env[ENV_LOCAL_DEVICE_IDS] = ",".join(map(str, ids))
    return env


# The guard: reads the process group ids of the workers, one a line, from its stdin; "done"
# means the launcher stopped them itself; end of input without it means the launcher died.
GUARD = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


def _parent_death_signal():
    """A preexec_fn that makes the child receive SIGKILL when the launcher dies (Linux), or None.
    The libc function is looked up here, before any fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec():
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(137)

    return preexec


# What a worker's native libraries print that says nothing to a user: gloo's note, one per
# process and peer group, that its connections are up ("[Gloo] Rank 0 is connected to 1 peer
# ranks. Expected number of connected peer ranks is : 1"), written to fd 1 behind Python's back.
# A process's two devices' notes, printed at once, interleave at any of the note's pieces
# ("[Gloo] Rank [Gloo] Rank 1 is connected to ...", then a line "0 is connected to ..." with the
# first one's rest, or a line "Expected number of connected peer ranks is : 1"): a line made of
# these pieces alone, one of them words, is one.
# And JAX's note of a SIGTERM taken as a preemption notice ("W1202 05:12:09.413211   25945
# preemption_notifier.cc:90] SIGTERM caught at 2026-12-02T05:12:09..."), one per process after
# the launcher's own line, before each process's "preempted (SIGTERM): ..." line.
# (`\d++`: possessive, as a number split every way took 2^digits tries: a worker's line of 30 digits
# and "connected" held the launcher for a minute)
NOISE = re.compile(r"^(?=.*(Gloo|connected))(\[Gloo\] Rank |\d++| is connected to | peer ranks\. ?|"
                   r"Expected number of connected peer ranks is : )+$"
                   r"|^W\d{4} [\d:.]+ +\d+ preemption_notifier\.cc:\d+\] SIGTERM caught at ")
# An nljax command's one-line refusal (a bad override, say): every process reads the same config
# and refuses it alike, so the user is shown it once, not once per process.
REFUSAL = re.compile(r"^nljax\.\w+: error: ")


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock, refusals: set[str]) -> None:
    writable = True
    for raw in iter(stream.readline, b""):
        if not writable:  # still read: a worker blocked on a full pipe would never exit
            continue
        line = raw.decode(errors="replace").rstrip("\n")
        if NOISE.match(line):
            continue
        with lock:
            if REFUSAL.match(line):
                if line in refusals:
                    continue
                refusals.add(line)
            try:
                out.write(f"{prefix}{line}\n")
                out.flush()
            except (OSError, ValueError):  # the reader went away (`| head`), the stream closed
                writable = False
    stream.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the id: not ours to wait for
        return False


class Group:
    """The N processes, their output threads, and how they are stopped."""

    def __init__(self, command: Sequence[str], envs: list[dict]):
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.refusals: set[str] = set()  # the one-line errors already shown (`REFUSAL`)
        # Its own session: a Ctrl-C to the launcher's terminal does not reach it.
        self.guard = subprocess.Popen([sys.executable, "-c", GUARD], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, text=True)
        preexec = _parent_death_signal()
        try:
            for i, env in enumerate(envs):
                p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=preexec)
                self.procs.append(p)
                self.guard.stdin.write(f"{p.pid}\n")  # its session's process group
                self.guard.stdin.flush()
                for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] ", self.lock, self.refusals), daemon=True)
                    t.start()
                    self.threads.append(t)
        except BaseException as e:  # e.g. the command not found, or no thread left: none is orphaned
            self.stop(grace=0.0)
            if isinstance(e, RuntimeError):  # threading's "can't start new thread"
                raise OSError(errno.EAGAIN, str(e)) from e
            raise

    def say(self, text: str) -> None:
        with self.lock:
            print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def signal(self, sig: int) -> None:
        """`sig` to every process's session, whether or not the process itself still runs: the
        command and whatever it started (a shell may exit at once while what it ran saves)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:  # nothing left in it
                pass

    def running(self) -> bool:
        """Whether anything still runs in the processes' sessions."""
        for p in self.procs:
            p.poll()  # reaped: a finished process no longer counts as its session's member
        return any(_group_alive(p.pid) for p in self.procs)

    def stop(self, grace: float, hurry=lambda: False) -> bool:
        """SIGTERM, then SIGKILL for whatever is left after `grace` seconds (or once `hurry()`);
        whether anything was left to kill."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.running() and not hurry():
            time.sleep(0.05)
        left = self.running()
        self.kill()
        return left

    def kill(self) -> None:
        """SIGKILL to whatever is left; returns when nothing is (the guard then has nothing to do)."""
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        deadline = time.monotonic() + 5.0
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.release_guard()

    def release_guard(self) -> None:
        """Every process has ended: the guard exits without killing anything."""
        if self.guard.poll() is None:
            try:
                self.guard.stdin.write("done\n")
                self.guard.stdin.close()
            except OSError:
                pass
            self.guard.wait()

    def finish(self) -> None:
        """Waits, 5 s at most, for the output still in the pipes to be written."""
        deadline = time.monotonic() + 5.0
        for t in self.threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))


def exit_code(returncode: int) -> int:
    """Shell convention for a process ended by a signal: 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


def run(command: Sequence[str], nproc: int, cpu_devices: int | None = None, grace: float = 10.0,
        devices_per_proc: int | None = None, save_grace: float = 120.0) -> int:
    coordinator = f"127.0.0.1:{free_port()}"
    envs = [child_env(os.environ, i, nproc, coordinator, cpu_devices, devices_per_proc) for i in range(nproc)]
    stopping: list[int] = []

    def on_signal(sig, _frame):
        stopping.append(sig)

    # Installed first: the children live in their own sessions, so nothing else would stop them.
    # SIGHUP too (the terminal closed): the processes get their notice, not the parent-death kill
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        group = Group(command, envs)
    except BaseException:
        for s, h in old.items():
            signal.signal(s, h)
        raise
    group.say(f"{nproc} processes, coordinator {coordinator}, pids {' '.join(str(p.pid) for p in group.procs)}")
    try:
        return watch(group, stopping, grace, save_grace)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if group.running():
            group.stop(grace=1.0)
        group.release_guard()


def watch(group: Group, stopping: list[int], grace: float, save_grace: float = 120.0) -> int:
    """Polls the processes until all have exited, or a signal arrived (`stopping`, appended by the
    handler); returns the launcher's exit code. After the first failure the others get `grace`
    seconds to exit on their own before they are killed; after a signal, `save_grace`."""
    failed: tuple[int, int] | None = None  # (process index, exit code)
    failed_at = 0.0
    first_bad_at: float | None = None
    while True:
        codes = [p.poll() for p in group.procs]
        if stopping:
            group.say(f"received signal {stopping[0]}; stopping all processes (a second signal: at once)")
            # the processes save a preemption checkpoint first: they get the save's grace
            if group.stop(save_grace, hurry=lambda: len(stopping) > 1) and len(stopping) == 1:
                group.say(f"killed the processes still running {save_grace:g} s after the signal (--save-grace): "
                          "their preemption checkpoint may be incomplete (a resume never reads an incomplete one)")
            group.finish()  # their last lines ("preempted ... checkpoint saved") included
            codes = [exit_code(p.returncode) for p in group.procs]
            # 143: saved its preemption checkpoint (or a plain command ended by the SIGTERM); any
            # other code is the run's to report (a save that failed, killed at the grace's end)
            other = [c for c in codes if c not in (0, 128 + signal.SIGTERM, 128 + stopping[0])]
            if other:
                group.say(f"exit codes by process: {', '.join(map(str, codes))}")
                return next((c for c in other if c > 128), other[0])  # a signal death is the likelier cause
            return 128 + stopping[0]
        if failed is None:
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and first_bad_at is None:
                first_bad_at = time.monotonic()
            if bad and (time.monotonic() - first_bad_at >= SETTLE_S or all(c is not None for c in codes)):
                # A worker killed by a signal is the likelier cause: its peers' collectives then fail
                # and they exit with 1 within milliseconds, often inside the same poll. So the report
                # waits SETTLE_S and names a signal death first.
                i, c = min(bad, key=lambda ic: (ic[1] > 0, ic[0]))
                failed, failed_at = (i, exit_code(c)), time.monotonic()
                # 143: a run stopped by a preemption notice (SIGTERM to a worker, not the launcher),
                # its checkpoint saved: said as such, not as a crash; nothing to stop once all ended
                why = " (SIGTERM: a run saves a checkpoint first)" if failed[1] == 128 + signal.SIGTERM else ""
                rest = "" if all(c is not None for c in codes) else f"; stopping the others within {grace:g} s"
                group.say(f"process {failed[0]} (pid {group.procs[failed[0]].pid}) exited with code "
                          f"{failed[1]}{why}{rest}")
        if all(c is not None for c in codes):
            if group.running():  # what the commands started and left behind does not outlive the launcher
                group.say("killing what the processes left running")
                group.kill()
            break
        if failed is not None and time.monotonic() - failed_at > grace:
            group.say("killing the processes still running")
            group.stop(grace=1.0)
            break
        time.sleep(0.05)
    group.finish()
    group.release_guard()
    if failed is not None:
        codes = ", ".join(str(exit_code(p.returncode)) for p in group.procs)
        group.say(f"exit codes by process: {codes}")
        return failed[1] or 1
    return 0


MAX_NPROC = 256  # processes one launcher starts on its host


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=PROG,
        description="Run N processes of one multi-process JAX run on this machine (coordinator on 127.0.0.1).",
        usage=f"python -m {PROG} --nproc N [--cpu-devices M] [--grace S] [--save-grace S] -- command [args ...]",
    )
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="number of processes")
    p.add_argument("--cpu-devices", type=int, metavar="M", help="emulate M CPU devices in each process")
    p.add_argument("--devices-per-proc", type=int, metavar="K",
                   help="give process i the accelerators i*K .. i*K+K-1 (default: every process sees all)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds the other processes get to exit on their own after one failed, before being killed")
    p.add_argument("--save-grace", type=float, default=120.0, metavar="S",
                   help="seconds the processes get after a signal (Ctrl-C, SIGTERM: a preemption notice) to save their "
                        "checkpoint and exit, before being killed; keep it under the scheduler's own (Slurm: KillWait, "
                        "or --signal's lead time)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command every process runs, after --")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # `launch.main([...])` from Python returns the code, as the other commands' do
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    problem = None
    if not command:
        problem = "no command given (put it after --)"
    elif args.nproc < 1:
        problem = f"--nproc must be >= 1, got {args.nproc}"
    elif args.nproc > MAX_NPROC:  # processes on this host, each a JAX runtime
        problem = f"--nproc must be at most {MAX_NPROC}, got {args.nproc}"
    elif args.cpu_devices is not None and args.cpu_devices < 1:
        problem = f"--cpu-devices must be >= 1, got {args.cpu_devices}"
    elif args.cpu_devices is not None and args.cpu_devices > 1024:  # as nljax.cli.MAX_CPU_DEVICES
        problem = f"--cpu-devices must be at most 1024, got {args.cpu_devices}"
    elif args.devices_per_proc is not None and args.devices_per_proc < 1:
        problem = f"--devices-per-proc must be >= 1, got {args.devices_per_proc}"
    elif args.devices_per_proc is not None and args.cpu_devices is not None:  # JAX applies device ids to GPUs alone
        problem = ("--devices-per-proc chooses GPUs, --cpu-devices emulates CPU devices: give one of them "
                   "(--cpu-devices M gives each process M devices)")
    elif args.devices_per_proc is not None and args.nproc == 1:  # JAX takes device ids only when joining processes
        problem = "--devices-per-proc is for several processes; choose one process's devices with CUDA_VISIBLE_DEVICES"
    for flag, value in (("--grace", args.grace), ("--save-grace", args.save_grace)):
        if problem is None and not value >= 0:  # nan too
            problem = f"{flag} must be >= 0, got {value}"
        elif problem is None and value > 3600:
            problem = f"{flag} must be at most 3600 s, got {value}"
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return run(command, args.nproc, args.cpu_devices, args.grace, args.devices_per_proc, args.save_grace)
    except OSError as e:  # e.g. the command does not exist, or no thread can be started
        print(f"{PROG}: error: cannot start {command[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
