"""Waits that say what they wait for.

A process of a multi-process run can block for minutes on its peers: joining the run, a lockstep
check, a checkpoint barrier. JAX and Orbax are silent there until a timeout. `said_while` prints,
on standard error, what the process waits for after `FIRST_S` and then every `EVERY_S` until the
wait ends, so a stalled run tells the user which step of it stalls and on whom.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator

FIRST_S = 10.0  # a wait shorter than this is not worth a line
EVERY_S = 30.0


@contextlib.contextmanager
def said_while(what: Callable[[float], str]) -> Iterator[None]:
    """Runs the body; while it runs past FIRST_S, prints `what(seconds waited)` then every
    EVERY_S ('nljax: process 1 has waited 10 s for ...; still waiting')."""
    done = threading.Event()
    thread = threading.Thread(target=_say, args=(done, what), daemon=True, name="nljax-waiting")
    thread.start()
    try:
        yield
    finally:
        done.set()


def _say(done: threading.Event, what: Callable[[float], str]) -> None:
    waited, wait = 0.0, FIRST_S
    while not done.wait(wait):
        waited += wait
        try:
            print(f"nljax: {what(waited)}; still waiting", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # standard error closed: nothing to tell
            return
        wait = EVERY_S
