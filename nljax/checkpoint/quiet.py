"""Orbax's own reports of what nljax reports itself, hidden while nljax works with Orbax.

Orbax logs routine warnings through absl (e.g. for every read-only manager): `warnings_hidden`.
When a read or a write fails (a damaged checkpoint, a full disk), the one exception that reaches
nljax, reported in one line, comes with three kinds of noise: `errors_hidden`.

- Orbax's writer threads log the error with a traceback (absl).
- TensorStore completes the reads or writes still in flight and calls back into Orbax's event
  loop, which is closed by then, possibly before the error reaches nljax: each callback raises
  'Event loop is closed' where nobody catches it, and Python prints a traceback
  (`sys.unraisablehook`).
- asyncio logs 'exception was never retrieved' for the other reads or writes of the failed
  operation when they are garbage-collected, and Python warns 'coroutine ... was never awaited'
  for the writes the failed operation never started (`warnings.showwarning`); the read
  coroutines that died with it report 'Exception ignored in: <coroutine ...>' with a traceback
  each (`sys.unraisablehook`: one per array, thousands when several damaged checkpoints are
  skipped); asyncio reports 'Task was destroyed but it is pending!' for Orbax's tasks still
  waiting when a multi-process save failed on another process. These are dropped only once a
  failure was caught (`fail`).

Both are context managers: the filters are installed on entry and removed on exit, so nothing
outside nljax's own Orbax calls loses a report. Only those reports are dropped, nothing else
that happens meanwhile. The callbacks of a failed operation arrive from TensorStore's threads
after the exception has reached nljax, as soon as the main thread lets them run: a caller that
caught a failure calls `settle()` before leaving the scope, which waits for them and for Orbax's
worker threads of the failed operation (their tracebacks; at most a few seconds).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import sys
import threading
import time
import traceback
import warnings


@contextlib.contextmanager
def warnings_hidden():
    """absl's warnings (Orbax's routine ones) dropped; its errors still shown."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _not_orbax_metadata_parse(record: logging.LogRecord) -> bool:
    """False for Orbax's log of a step's unreadable _CHECKPOINT_METADATA (two lines with the
    file's content), which nljax reports itself in one line (`storage.damage`)."""
    return not str(record.msg).startswith("Failed to json parse Metadata file:")


@contextlib.contextmanager
def metadata_errors_hidden():
    """Orbax's absl error for a step whose _CHECKPOINT_METADATA does not parse dropped (a manager
    reads every step's when it starts); its other errors still shown."""
    log = logging.getLogger("absl")
    log.addFilter(_not_orbax_metadata_parse)
    try:
        yield
    finally:
        log.removeFilter(_not_orbax_metadata_parse)


class _Filters:
    """The four filters of one `errors_hidden` scope. Each scope has its own, so that a scope
    nested in another removes its own filters and leaves the other's."""

    def __init__(self, previous_hook, previous_show, report=None):
        self.report = report
        self.previous_hook = previous_hook
        self.previous_show = previous_show
        self.on = True
        self.dropped = 0  # callbacks into a closed event loop dropped so far
        self.failed = False  # a failure was caught (`fail`, `settle`): its unstarted writes may follow
        # after the scope of a failure: its reads' and writes' tasks may still be collected later
        # (the event loop of a finished Orbax thread goes with its last reference, at any time, up
        # to the interpreter's exit), each logging 'exception was never retrieved'
        self.lingering = False

    def fail(self) -> None:
        """A read or write failed: from now on its coroutines' reports are its noise. Called where
        the exception is caught, since they may be finalized before `settle` runs."""
        self.failed = True

    def settle(self, quiet_s: float = 0.1, limit_s: float = 5.0) -> None:
        """After a failed read or write: wait until the callbacks of the operations it left in
        flight have arrived (none for `quiet_s`, at most `limit_s`), then collect their futures,
        so that their reports arrive while they are still dropped."""
        self.failed = True
        start = last_change = time.monotonic()
        seen = self.dropped
        while time.monotonic() - last_change < quiet_s and time.monotonic() - start < limit_s:
            time.sleep(0.01)  # lets TensorStore's threads take the GIL and call back
            if self.dropped != seen:
                seen, last_change = self.dropped, time.monotonic()
        # Orbax's own worker threads of the failed operation log their error with a traceback when
        # they end, which on a loaded machine can be well after the callbacks went quiet (seen:
        # 'cannot schedule new futures after shutdown' printed after the one-line error)
        # Joined as a plain thread: Orbax's own `join` re-raises the thread's error once it ended,
        # which turned the one-line error into a traceback whenever the thread ended during the wait
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and _orbax_worker(thread):
                threading.Thread.join(thread, max(0.0, limit_s - (time.monotonic() - start)))
        gc.collect()

    def orbax_thread_errors(self, record: logging.LogRecord) -> bool:
        """Drops Orbax's error reports that carry a traceback: the exception itself reaches nljax.
        Each is first `report`ed: the failure it reports, as it happens."""
        ours = self.on and record.exc_info and "orbax" in record.pathname
        if ours and self.report is not None and record.levelno >= logging.ERROR:
            self.report(record.exc_info[1])  # not a warning's traceback: Orbax carried on after it
        return not ours

    def unretrieved(self, record: logging.LogRecord) -> bool:
        """Drops asyncio's 'exception was never retrieved' reports of Orbax's reads and writes,
        and, after a failure, its 'Task was destroyed but it is pending!' for Orbax's tasks that
        the failed operation left waiting (a multi-process save failing on another process)."""
        text = str(record.msg)
        if self.on and self.failed and "Task was destroyed but it is pending" in text and "orbax" in text:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if not (self.on or self.lingering) or exc is None or "exception was never retrieved" not in text:
            return True
        frames = traceback.extract_tb(exc.__traceback__)
        text = str(exc)
        return not (any(w in text for w in ("tensorstore", "OCDBT", "os_error_code"))
                    or any("orbax" in f.filename for f in frames))

    def unraisable(self, u) -> None:
        """Drops the 'Event loop is closed' errors of callbacks into Orbax's closed event loop, and
        the errors of Orbax's own read and write coroutines that die with the failed operation
        ('Exception ignored in: <coroutine object _read_array_index_and_device_put ...>', one
        per array of each damaged checkpoint read: thousands when several are skipped)."""
        closed = isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
        code = getattr(u.object, "cr_code", None)
        ours = self.failed and code is not None and "orbax" in code.co_filename  # after a failure only
        if (self.on and (closed or ours)) or (self.lingering and ours):
            self.dropped += 1
        else:
            self.previous_hook(u)

    def unawaited(self, message, category, *args, **kwargs) -> None:
        """Drops 'coroutine ... was never awaited' for the writes a failed operation never started
        (after a failure only: until then such a warning is someone else's)."""
        unawaited = issubclass(category, RuntimeWarning) and "was never awaited" in str(message)
        if not (unawaited and self.failed and (self.on or (self.lingering and _orbax_coroutine(str(message))))):
            self.previous_show(message, category, *args, **kwargs)


def _orbax_coroutine(message: str) -> bool:
    """Whether "coroutine 'NAME' was never awaited" names a coroutine of Orbax's: the function
    NAME's outermost part is defined in a loaded `orbax` module (write_fragment is
    'async_serialize_from_host.<locals>.write_fragment')."""
    m = re.match(r"coroutine '([^']+)' was never awaited", message)
    if m is None:
        return False
    top = m[1].split(".")[0]
    return any(name.startswith("orbax.") and getattr(mod, top, None) is not None
               for name, mod in list(sys.modules.items()))


def _orbax_worker(thread: threading.Thread) -> bool:
    """A thread Orbax started for a read or write (its `_SignalingThread`s)."""
    cls = type(thread)
    return cls.__module__.startswith("orbax.") and cls.__name__ == "_SignalingThread"


@contextlib.contextmanager
def errors_hidden(report=None):
    """Orbax's and TensorStore's reports of a failed read or write dropped while entered; yields
    the filters (`settle()` after a failure). `report(exc)` is called with the exception of each
    error Orbax logs from its threads (a multi-process save tells its peers, `peers.Peers`)."""
    f = _Filters(sys.unraisablehook, warnings.showwarning, report)
    absl, aio = logging.getLogger("absl"), logging.getLogger("asyncio")
    absl.addFilter(f.orbax_thread_errors)
    aio.addFilter(f.unretrieved)
    sys.unraisablehook = f.unraisable
    warnings.showwarning = f.unawaited
    try:
        yield f
    finally:
        f.on = False
        absl.removeFilter(f.orbax_thread_errors)
        # After a failure its operation's tasks and coroutines may be collected later, up to the
        # interpreter's exit ('sys:1: RuntimeWarning: coroutine ... was never awaited' after the
        # one-line error): those reports stay dropped (`lingering`), the filters installed.
        f.lingering = f.failed
        if not f.lingering:
            aio.removeFilter(f.unretrieved)
        if sys.unraisablehook == f.unraisable and not f.lingering:  # else another hook was installed over it
            sys.unraisablehook = f.previous_hook
        if warnings.showwarning == f.unawaited and not f.lingering:
            warnings.showwarning = f.previous_show
