"""The documents of a corpus cut into chunks and tokenized, by worker processes or in this one,
the results handed back in the order the chunks were read.

A chunk is the consecutive documents of one split's files (data.train's or data.eval's, never
both) up to the one with which their UTF-8 text reaches `chunk_bytes` (so at most `chunk_bytes`
plus one document), with the position after it (data/documents.py: file, record), which is where
a resumed prepare starts reading again. Whatever the worker count and the
order in which workers finish, chunk k's tokens come out k-th, so the files written are the same.

Memory is bounded: at most 2 x workers chunks are in flight (their text on its way to a worker,
their tokens on their way back), plus the one being read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from nljax.data import documents, tokenization


@dataclasses.dataclass(frozen=True)
class Chunk:
    texts: list[str]
    split: int  # 0: data.train's files, 1: data.eval's
    end: tuple[int, int, int]  # (split, file index, records of that file read): where the next chunk starts
    nbytes: int  # its texts' UTF-8 bytes (the progress bar's bytes)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A chunk's tokens: ids back to back [N], each document's token count [D] (0: the tokenizer
    gave none) and UTF-8 bytes + 1 [D]."""

    split: int
    end: tuple[int, int, int]
    ids: np.ndarray
    lengths: np.ndarray
    nbytes: np.ndarray


utf8_bytes = documents.utf8_bytes  # what prepare.chunk_bytes counts


def read(sources: Sequence[Sequence[Path]], text_key: str, chunk_bytes: int,
         start: tuple[int, int, int] = (0, 0, 0)) -> Iterator[Chunk]:
    """The chunks of `sources` (train files, eval files) from position `start`. A chunk ends at
    the document with which its text reaches `chunk_bytes` (one larger is a chunk of its own): the
    lists read end there too (documents.read's max_bytes), so no chunk holds more than
    chunk_bytes plus one document, whatever the documents' sizes."""
    for split in range(start[0], len(sources)):
        at = start[1:] if split == start[0] else (0, 0)
        texts: list[str] = []
        nbytes, end = 0, (split, *at)
        yielded = end  # where the last chunk ended
        # documents per list read, at most: one per KiB of chunk (1 to BATCH); the lists end at
        # chunk_bytes besides, so this bounds only the rows a Parquet or Arrow read converts at once
        batch = min(documents.BATCH, max(1, chunk_bytes >> 10))
        for docs, index, done in documents.read(sources[split], text_key, at, batch, max_bytes=chunk_bytes):
            texts += docs
            nbytes += sum(map(utf8_bytes, docs))
            end = (split, index, done)
            if nbytes >= chunk_bytes:  # the list ended at the document that reached it
                yield Chunk(texts, split, end, nbytes)
                texts, nbytes, yielded = [], 0, end
        if texts or end != yielded:  # the records read since the last chunk, text or none
            yield Chunk(texts, split, end, nbytes)


_TOKENIZER = None  # a worker's tokenization, built once by `_start`


def _start(spec: tuple, parent: int) -> None:
    """A worker: one thread (workers are the parallelism), Ctrl-C left to the parent process,
    gone when the parent is (a killed prepare leaves no process behind)."""
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the `tokenizers` batch encoder's own threads
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool; no traceback per worker
    # the parent's pid as it gave it: one killed while this worker started is noticed too
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _TOKENIZER = tokenization.from_spec(spec)


def _exit_with(parent: int) -> None:
    """Exit once `parent` is gone. A killed parent closes no pipe a worker reads (every worker
    holds a copy of the task queue's write end), so the worker would wait for work forever."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode(texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _TOKENIZER.encode_flat(texts, dtype)


class WorkerDied(RuntimeError):
    """A worker process ended without its chunk (killed, out of memory): not bad data, so the
    work done is kept and a run again resumes."""


def encoded(chunks: Iterator[Chunk], tok, dtype: np.dtype, workers: int) -> Iterator[tuple[Chunk, Encoded]]:
    """Each chunk (its texts dropped) with its tokens, in order. workers=0: in this process."""
    if workers == 0:
        for c in chunks:
            yield _light(c), Encoded(c.split, c.end, *tok.encode_flat(c.texts, dtype))
        return
    ctx = multiprocessing.get_context("spawn")  # not fork: the parent may hold JAX's threads
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start,
                               initargs=(tok.spec(), os.getpid()))
    pending: collections.deque = collections.deque()
    try:
        with _plain_main():  # every worker started now, without the command's own imports
            for f in [pool.submit(os.getpid) for _ in range(workers)]:
                f.result()
        for c in chunks:
            pending.append((_light(c), pool.submit(_encode, c.texts, dtype)))
            while len(pending) >= 2 * workers:  # the bound on chunks in flight
                light, future = pending.popleft()
                yield light, Encoded(light.split, light.end, *future.result())
        while pending:
            light, future = pending.popleft()
            yield light, Encoded(light.split, light.end, *future.result())
    except BrokenProcessPool:
        raise WorkerDied(f"a worker process ended before its chunk was tokenized (killed, or out of memory): run "
                         f"again to resume, with fewer prepare.workers (now {workers}) or a smaller "
                         "prepare.chunk_bytes") from None
    except BaseException:  # Ctrl-C, an error in the reader, the caller's close: no chunk in flight is wanted
        _terminate(pool)  # else shutdown waited for each worker to finish its chunk (seconds each at 8 MB)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Stop `pool`'s workers now, their chunks dropped (the parent records only chunks it has)."""
    if hasattr(pool, "terminate_workers"):  # Python 3.14
        pool.terminate_workers()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()


@contextlib.contextmanager
def _plain_main():
    """Spawned workers import the parent's __main__ (`python -m nljax.prepare` imports the config
    and JAX: 300 MB and seconds per worker); hidden while they start, they import only this
    module and the tokenization."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__.pop(k) for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    try:
        yield
    finally:
        del main.__spec__
        main.__dict__.update(saved)


def _light(c: Chunk) -> Chunk:
    return dataclasses.replace(c, texts=[])


def default_workers() -> int:
    """All the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
