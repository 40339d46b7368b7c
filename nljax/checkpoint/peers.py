"""A save that fails on one process fails on every process, at once.

In a multi-process run each process writes its own shards in Orbax's background thread, then
waits at a barrier for the others before process 0 commits the step. A process whose write failed
(its disk full) never reaches that barrier, and Orbax's barriers wait for it until their timeouts
(20 minutes for the writes, then 5 for its bookkeeping): the whole job hung that long. Here the
failing process posts its error in the coordination service's key-value store, and the barriers
Orbax waits at (`Peers.barrier`, given to it as `AsyncOptions.barrier_sync_fn`) are built on the
same store and end as soon as a failure is posted: every process's save then fails with the same
error, naming the process and its cause, and the run stops at the same step everywhere.

The failing process learns of its failure where Orbax reports it: the error it logs, with its
traceback, from the background thread (`report`, called by `quiet.errors_hidden`'s filter), and
again where the failure reaches nljax (`Checkpoints._wait`). What this does not cover: a failure
in a save's blocking part (before the background writes start), where the others wait at
Orbax's own barriers in their main threads (or, with async saves, in the next step's
collectives), which nothing interrupts; `distributed.timeout_s` bounds those.
"""

from __future__ import annotations

import sys
import threading
import time

import jax

from nljax.runtime.distributed import waiting_for_peers

# A waiting process looks at who has arrived every POLL_MS at first, then less often (up to
# POLL_MAX_MS: thousands of processes waiting on a slow disk do not flood the coordinator).
POLL_MS, POLL_MAX_MS = 10, 1000


class PeerSaveFailed(RuntimeError):
    """A save failed on some process (this one or another): 'process <i>: <cause>'."""


class Peers:
    """The barriers and failure reports of one checkpoint writer in a multi-process run. Every
    process makes its writers in the same order, so `name` (their number) matches across them."""

    def __init__(self, name: str, describe):
        """`describe(exc) -> str`: the one-line cause of a failure (e.g. 'OSError: [Errno 28] ...')."""
        self.root = f"nljax/checkpoints/{name}"
        self.describe = describe
        self.calls: dict[str, int] = {}  # barrier key -> times this process waited at it
        self.lock = threading.Lock()  # Orbax's writer and finalizer threads both wait at barriers

    @staticmethod
    def _client():
        from jax._src import distributed  # Orbax reaches the coordination service the same way

        return distributed.global_state.client

    def report(self, exc: BaseException) -> None:
        """This process's save failed with `exc`: tell the others (the first report stands)."""
        if isinstance(exc, PeerSaveFailed):
            return  # a failure already posted, seen here
        try:
            self._client().key_value_set(f"{self.root}/failed",
                                         f"process {jax.process_index()}: {self.describe(exc)}")
        except Exception as e:  # noqa: BLE001 - in a failure's path: say so, do not replace it
            if not _status(e, "ALREADY_EXISTS"):  # (that one: another process posted first)
                print(f"nljax: warning: the other processes could not be told of this save's failure "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); they stop at "
                      "distributed.timeout_s", file=sys.stderr)

    def failure(self) -> str | None:
        """The failure posted, 'process <i>: <cause>', or None."""
        return self._get(f"{self.root}/failed")

    def _get(self, key: str) -> str | None:
        try:
            return self._client().key_value_try_get(key)
        except Exception as e:  # noqa: BLE001 - the client raises one type for every status
            if _status(e, "NOT_FOUND"):  # nothing posted
                return None
            raise

    def barrier(self, *, key: str, timeout_ms: int) -> None:
        """Waits until every process has called this with `key` (Orbax reuses some keys: each
        call counts), or raises `PeerSaveFailed` as soon as a failure is posted, or TimeoutError.
        Each arrival increments a counter. The barrier's outcome is one key, created once: `done`
        by the last to arrive, or `timeout` by a process whose wait ran out, whichever comes
        first; every process looks for it (one key per look, however many processes) and
        abides by it. So all pass or all fail: a late peer cannot complete the count and pass
        after another gave up, nor one give up after the others passed."""
        with self.lock:
            n = self.calls[key] = self.calls.get(key, 0) + 1
        client, here = self._client(), f"{self.root}/barrier/{key}/{n}"
        if client.key_value_increment(f"{here}/arrived", 1) == jax.process_count():
            self._decide(f"{here}/outcome", "done")
        with waiting_for_peers(f"checkpoint barrier {key}"):
            self._await(key, here, timeout_ms)

    def _await(self, key: str, here: str, timeout_ms: int) -> None:
        deadline, wait_ms = time.monotonic() + timeout_ms / 1000, POLL_MS
        while True:
            failed = self.failure()
            if failed is not None:
                raise PeerSaveFailed(failed)
            outcome = self._get(f"{here}/outcome")
            if outcome is None and time.monotonic() > deadline:
                outcome = self._decide(f"{here}/outcome", "timeout")
            if outcome == "done":
                return
            if outcome is not None:
                e = TimeoutError(f"checkpoint barrier {key} not reached by every process in {timeout_ms / 1000:g} s")
                self.report(e)
                raise e
            time.sleep(wait_ms / 1000)
            wait_ms = min(wait_ms * 1.5, POLL_MAX_MS)

    def _decide(self, key: str, value: str) -> str | None:
        """Creates `key` with `value` unless it exists; the value that stands."""
        try:
            self._client().key_value_set(key, value)
        except Exception as e:  # noqa: BLE001 - the client raises one type for every status
            if not _status(e, "ALREADY_EXISTS"):  # (that one: decided already)
                raise
        return self._get(key)


def _status(e: Exception, code: str) -> bool:
    """Whether the coordination service's error `e` has status `code` ('NOT_FOUND: key ...')."""
    return str(e).startswith(code)
