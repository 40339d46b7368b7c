"""Preemption: SIGTERM is a notice, not a crash.

Schedulers (SLURM, Kubernetes, spot VMs) send SIGTERM some seconds before they kill a job. The
trainer then finishes the step in flight, saves a checkpoint at that step boundary on every
process, waits until it is on disk and exits with 128 + SIGTERM = 143 (non-zero, so that a job
controller restarts it; `--resume` then continues exactly, as from any checkpoint).

Every process must save at the same step. One process: a Python handler sets a flag that the
loop reads after each step. Several processes (`jax.distributed`): JAX's preemption service
(started by `jax.distributed.initialize`) already catches SIGTERM on whichever processes receive
it, agrees on a step (the largest step any process has reached, plus one) through the
coordination service, and `reached_preemption_sync_point(step)` turns True on every process at
that step. A Python handler would replace JAX's, so none is installed there.

The service's "largest step reached" is the last step each process passed to it, 0 before the
first call: a notice during a resumed run's start-up (restore, compilation) would set the step
to 1, which a run resumed at step 500 never reaches, and the notice would be lost (no save; the
scheduler's SIGKILL ends the run). So `nljax.train` reports the step it resumes from the moment
`jax.distributed.initialize` returns (`check_in`, before the start-up's collectives; only
`--resume=auto`'s decision, which the step depends on, comes first), and `trainer.train` again
first thing, for a caller that joined the processes itself.

One process defers SIGTERM the same way from the start of `nljax.run.trainer.train` to its end: a
notice during start-up (restore, compilation) stops the run after its first step, saved; one
after the last step lets the final report finish (exit 0: the run is complete). A second SIGTERM
stops at once (`Terminated`: the checkpoints already on disk are kept, the lock released), for
whoever means "now" — one at least `Notice.REPEAT_S` after the first: a scheduler's notice often
reaches a process twice at once (sent to the whole job and forwarded by a launcher).

"At once" holds inside a compilation too. Python runs a signal handler in the main thread
between two bytecodes, so one that arrives while the main thread is inside a long C call (XLA
compiling a step: a minute, several on a GPU) would wait for it. So the signals are read by a
thread too (`signal.set_wakeup_fd`: one byte per signal, taken by the main thread's handler
when it runs within `Notice.GRACE_S`, else by the reader), which applies the rules above and
hands a decision to stop to the main thread (the signal sent to it again); when
the main thread has not taken it within `Notice.STUCK_S`, it is inside such a call, and the
thread ends the process itself: the same line, the same exit code, `os._exit` (the checkpoints already on disk are
kept; the run's lock is left to be taken over, its process being gone). Not for a Ctrl-C in a
session the user types into (a notebook's kernel, IPython, `python -i`: `nljax.train.main` called
there), which would be lost with the process: there the Ctrl-C is raised when the call returns.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

import jax
from jax.experimental import multihost_utils


class Stopped(BaseException):
    """The run stopped on a signal: the command prints the message and exits with `exit_code`
    (128 + the signal). A BaseException, as KeyboardInterrupt is: a signal may arrive inside
    any `except Exception` (a save, a checkpoint read), which must not take it for its own error
    (a damaged checkpoint, a failed save)."""

    exit_code = 128 + signal.SIGTERM


class Preempted(Stopped):
    """Raised by the loop once the preemption checkpoint is saved."""

    def __init__(self, step: int, sig: int = signal.SIGTERM, saved: bool = True):
        what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "preempted (SIGTERM)"
        how = "checkpoint saved; continue with --resume" if saved else "nothing saved (checkpoint.every=0)"
        super().__init__(f"{what}: stopped after step {step}, {how}")
        self.step, self.exit_code = step, 128 + sig


class Unreported(Stopped):
    """Ctrl-C in the final report (its evaluation, the throughput table), once training is over:
    the final checkpoint is on disk. "interrupted (Ctrl-C)" alone left the user to guess whether
    the training was lost."""

    def __init__(self, step: int, saved: bool):
        how = (f"the final checkpoint ({step}) is saved; --resume writes the report and summary.json, evaluating "
               "it again" if saved else "no checkpoint saved (checkpoint.every=0)")
        super().__init__(f"interrupted (Ctrl-C) in the final report, after the last step: {how}")
        self.exit_code = 128 + signal.SIGINT


class Terminated(Stopped):
    """A second SIGTERM after a notice: stop at once, nothing more saved."""

    def __init__(self):
        super().__init__("terminated (a second SIGTERM): stopped at once; the checkpoints already on disk are kept")


_checked_in = False  # this process told the service its first step (once: the command, or train())


def check_in(first_step: Callable[[], int]) -> None:
    """Tells JAX's preemption service, before the slow part of start-up, the step this process
    counts from (a later step is also fine: a notice then stops the run that many steps later).
    Once per process, and only with several: `first_step()` may open checkpoints."""
    global _checked_in
    if jax.process_count() > 1 and not _checked_in:
        multihost_utils.reached_preemption_sync_point(first_step())
        _checked_in = True


def _prog() -> str:
    """The command's name as its own last line gives it (`python -m nljax.train`: nljax.train,
    `nljax.cli.main`'s prog), else nljax."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name.startswith("nljax.") else "nljax"


def _interactive() -> bool:
    """Whether this is a session a user types into, which is theirs to keep: a Jupyter kernel or
    IPython (`get_ipython()`), `python -i`, the interactive interpreter."""
    ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return bool(sys.flags.interactive) or hasattr(sys, "ps1") or (callable(ipython) and ipython() is not None)


def _say(line: bytes) -> None:
    """One line on standard error, unbuffered (one write, whatever the main thread prints), and
    best effort: a standard error that is gone (a closed terminal, a `| tee` that Ctrl-C ended)
    must not turn a notice into a crash in the main thread nor end the reader thread."""
    try:
        os.write(2, line)
    except OSError:
        pass


class Notice:
    """Whether a preemption notice asks the run to stop after the current step. A context
    manager: the single-process handlers live while it is open (the whole run: `trainer.train`).
    One process takes Ctrl-C (SIGINT) inside the step loop once a step is done (`in_loop`) as a
    notice too, the way a user at a terminal means it: the step finishes and is saved; a second
    Ctrl-C, or one before (the start-up, the first step's compilation: nothing to save), stops at
    once (KeyboardInterrupt: one line, nothing saved). Under
    the launcher a Ctrl-C reaches the launcher, which sends every process SIGTERM."""

    # A SIGTERM this soon after the notice is the same notice: a scheduler that signals every
    # process of a job (SLURM, a systemd unit) and a launcher (nljax.launch, srun) that forwards
    # its own reach a process twice within milliseconds.
    REPEAT_S = 2.0
    # The main thread runs a pending handler within microseconds unless it is inside a C call.
    GRACE_S = 0.05  # what the reader leaves it to take a signal first
    STUCK_S = 1.0  # how long the reader waits for it to raise a decision to stop

    def __init__(self):
        self.received = 0  # the signal of the notice, 0: none
        self.received_at = 0.0  # time.monotonic() of the notice
        self.in_loop = False  # set by the training loop while it steps, once a step is done
        self.looped = False  # set by the training loop as it starts: the start-up is over
        self._old: dict = {}
        self._stop: BaseException | None = None  # decided by the reader, raised in the main thread
        self._ours = {signal.SIGTERM: 0, signal.SIGINT: 0}  # the reader's own re-sent signals, to pass over
        self._lock = threading.RLock()
        self._wake: tuple | None = None  # (read end, write end, the wakeup fd before ours)

    def __enter__(self) -> "Notice":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            r, w = socket.socketpair()
            w.setblocking(False)
            # the wakeup fd before the handlers: a signal that finds the handler finds its byte too
            self._wake = (r, w, signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False))
            self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            threading.Thread(target=self._read, args=(r,), name="nljax-signals", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:  # first: from here on the reader decides and re-sends nothing (`_take`,
            wake, self._wake = self._wake, None  # `_hand_over`), the handlers it re-sends to being gone
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        if wake:
            r, w, before = wake
            signal.set_wakeup_fd(before)
            w.close()  # the reader's recv returns b"": it ends and closes its end

    def _on_signal(self, sig, _frame) -> None:
        """The main thread's handler: the signals the reader has not read yet are taken here, at
        once, as before there was a reader (each arrival is one byte of the wakeup fd, read by
        one of the two); then it raises what either decided."""
        r = self._wake[0] if self._wake else None
        while r is not None:
            try:
                data = r.recv(64, socket.MSG_DONTWAIT)
            except OSError:  # nothing left to read (BlockingIOError), or the reader has closed it
                break
            for s in data:
                self._stop = self._take(s) or self._stop
        stop, self._stop = self._stop, None
        if stop is not None:
            raise stop

    def _read(self, r: socket.socket) -> None:
        """The reader thread: a signal the main thread's handler has not taken within GRACE_S is
        taken here (the main thread first: there a notice counts at once, as a step ends)."""
        with r:
            while r.recv(1, socket.MSG_PEEK):  # b"": the write end closed (`__exit__`)
                time.sleep(self.GRACE_S)
                try:
                    data = r.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:  # the main thread took it
                    continue
                for sig in data:
                    if stop := self._take(sig):
                        self._hand_over(sig, stop)

    def _take(self, sig: int) -> BaseException | None:
        """One arrival of `sig`, by whichever thread read it: the rules (`_decide`), unless it is
        the reader's own resending."""
        with self._lock:  # re-entrant: a handler may run inside the main thread's own call
            if not self._wake:  # read after `__exit__`: the run it would stop has ended
                return None
            if self._ours.get(sig):
                self._ours[sig] -= 1
                return None
            return self._decide(sig) if sig in self._ours else None

    def _hand_over(self, sig: int, stop: BaseException) -> None:
        """The reader's decision to stop, to the main thread; the process ended here when the main
        thread does not take it within STUCK_S (it is inside a C call: a compilation)."""
        self._stop = stop
        # The signal again, to the main thread, until its handler has raised `stop`: it interrupts
        # a system call there (a sleep, a read), which _thread.interrupt_main would not. Again,
        # because one that lands just before the main thread enters such a call is seen only
        # when the call returns.
        deadline = time.monotonic() + self.STUCK_S
        while self._stop is stop and time.monotonic() < deadline:
            with self._lock:  # not once `__exit__` has begun: the handler it restores would take it
                if not self._wake:
                    return
                self._ours[sig] += 1  # read back from the wakeup fd: not a new arrival
                signal.pthread_kill(threading.main_thread().ident, sig)
            time.sleep(0.1)
        if self._stop is stop and self._wake and isinstance(stop, KeyboardInterrupt) and _interactive():
            # a notebook's kernel (its interrupt is Ctrl-C) or an interactive session: ending the
            # process lost the session (the kernel died). The main thread's handler raises the
            # Ctrl-C when the call returns, the signals sent to it being pending there.
            _say(f"{_prog()}: Ctrl-C: stopping when the compilation in progress returns (it cannot be "
                 "interrupted)\n".encode())
            return
        if self._stop is stop and self._wake:  # the main thread is inside a C call (a compilation): end here
            line = f"{_prog()}: {str(stop) or 'interrupted (Ctrl-C)'} (inside a compilation, which was not waited for)\n"
            _say(line.encode())
            os._exit(stop.exit_code if isinstance(stop, Stopped) else 128 + signal.SIGINT)

    def _decide(self, sig: int) -> BaseException | None:
        """What a signal means now: an exception to stop with at once, or None (a notice, or the
        same notice again)."""
        if sig == signal.SIGINT and (self.received or not self.in_loop):
            return KeyboardInterrupt()
        if sig == signal.SIGTERM and self.received:
            return Terminated() if time.monotonic() - self.received_at >= self.REPEAT_S else None
        self.received, self.received_at = sig, time.monotonic()
        if sig == signal.SIGINT:
            _say(b"\nnljax: Ctrl-C: stopping after this step (Ctrl-C again: at once, unsaved)\n")
        elif not self.looped:  # the start-up (restore, compilation) can take minutes: said now, not at the end
            _say(b"nljax: SIGTERM during start-up: the run stops after its first step, saved "
                        b"(SIGTERM again: at once)\n")
        return None

    def stop_after(self, step: int) -> bool:
        """Asked once per step, in order, on every process with the same step (the training loop:
        after the step's hooks, or right before the next dispatch where the next step goes ahead
        of this one's result): True on all of them at the same step once a notice arrived."""
        if jax.process_count() == 1:
            return bool(self.received)
        return multihost_utils.reached_preemption_sync_point(step)
