"""Adversarial inputs, one test per class of failure (issue 41): bad input gives one clear line
and a non-zero exit, and nothing already on disk is lost."""

from __future__ import annotations

import threading

import pytest

from nljax.checkpoint import quiet


def test_settle_after_a_failed_save_does_not_reraise_the_writer_threads_error():
    """The failed-save race: Orbax's writer thread still running when `settle` joins it, then
    ending with the write error. Its `join` re-raises that error, which reached the user as a
    traceback under load; `settle` waits for the thread without re-raising."""
    from orbax.checkpoint._src.futures.future import _SignalingThread

    go = threading.Event()

    def write():
        go.wait(10)
        raise ValueError("OUT_OF_RANGE: Error writing local file _sharding")

    thread = _SignalingThread(target=write, send_signals=[], receive_signals=[], timeout_secs=30)
    thread.start()
    release = threading.Timer(0.5, go.set)  # after `settle` found the thread alive
    release.start()
    with quiet.errors_hidden() as noise:
        noise.settle(quiet_s=0.05, limit_s=10.0)
    release.join()
    assert not thread.is_alive()
