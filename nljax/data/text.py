"""Text read as a ContextStream, and the byte-level corpus present offline on every Python installation.

The corpus is the standard library's own top-level modules (`*.py` in the stdlib directory),
sorted by name, one document per file, documents separated by a NUL byte (which never occurs
in Python source). Every `round(1 / eval_fraction)`-th file is held out for evaluation.

ContextStream: the training text is read as G parallel streams, one per global batch row. Row r
starts at a fixed offset and at step s receives the next contiguous chunk of T+1 bytes (inputs
and shifted targets). Which bytes a row gets is a pure function of (seed, step, row), so a
resumed or re-sharded run reads exactly the same data, and each device builds only its own rows.
The stream reads any array of token ids the same way: the user's files (`data.source=files`,
data/prepared.py) come as a memory-mapped array of ids, with their document ends beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import sysconfig
from pathlib import Path

import jax
import numpy as np

from nljax.errors import ConfigError
from nljax.parallel.hostdev import rows_batch

SEPARATOR = 0  # document boundary byte


@functools.lru_cache(maxsize=4)
def stdlib_corpus(eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train bytes, eval bytes) as uint8 arrays."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < 10:
        raise ConfigError(f"data.source=stdlib: found only {len(files)} modules in {root}")
    every = round(1 / eval_fraction)  # >= 2: data.eval_fraction is in [1e-9, 0.5]
    train, held = [], []
    for i, f in enumerate(files):
        doc = f.read_bytes().replace(b"\0", b"")
        (held if i % every == every - 1 else train).append(doc)
    join = lambda docs: np.frombuffer(b"\0".join(docs) + b"\0", dtype=np.uint8)
    return join(train), join(held)


@dataclasses.dataclass(frozen=True)
class ContextStream:
    data: np.ndarray  # [N] token ids: uint8 bytes, or any unsigned ids (a memmap of prepared files)
    rows: int  # G, the global batch
    seq_len: int  # T
    seed: int = 0
    reset_prob: float = 0.0  # chance that a row also starts a step from a fresh memory
    align: int = 1  # row starts are multiples of this (documents of a fixed length: each window one document)
    # float32 [N] or None: each byte's weight as a target of the training loss (the recall probe
    # trains on its queried values only); batches then carry it per target position, `weight` [R, T]
    weight: np.ndarray | None = None
    # int64 [D] sorted, or None: the last token of each document (the user's files, whose token
    # ids may take any value); None: a document ends at each SEPARATOR byte (stdlib, recall)
    ends: np.ndarray | None = None

    def offsets(self) -> np.ndarray:
        """Start of each row's stream: evenly spaced, shifted by the seed.  [G]"""
        n = len(self.data)
        shift = (self.seed * 2654435761) % n
        starts = (np.arange(self.rows, dtype=np.int64) * n // self.rows + shift) % n
        return starts // self.align * self.align

    def rows_at(self, step: int, rows: slice | np.ndarray) -> dict[str, np.ndarray]:
        """Chunk of `rows` at `step`: tokens [R, T+1] int32, reset [R] bool (and weight [R, T]).

        `reset` marks rows whose previous chunk contained a document boundary (or step 0): the
        row's inner-loop memory is dropped before this chunk, so a new document never reads the
        memory written by the previous one across a step boundary.
        """
        n, t = len(self.data), self.seq_len
        start = self.offsets()[rows] + step * t  # [R]
        idx = (start[:, None] + np.arange(t + 1)) % n  # [R, T+1]
        tokens = self.data[idx].astype(np.int32)
        if step == 0:
            reset = np.ones(len(start), bool)
        elif self.ends is not None:
            reset = self.ends_within(start - t, t)
        else:
            prev = (start[:, None] - t + np.arange(t)) % n  # the previous chunk's input tokens
            reset = (self.data[prev] == SEPARATOR).any(axis=1)
        if self.reset_prob > 0:  # one draw per (seed, step) for all rows: the same on any mesh
            draw = np.random.default_rng([self.seed, step, 1]).random(self.rows)
            reset |= draw[np.arange(self.rows)[rows]] < self.reset_prob
        out = {"tokens": tokens, "reset": reset}
        if self.weight is not None:
            out["weight"] = self.weight[idx[:, 1:]]  # of the targets
        return out

    def ends_within(self, lo: np.ndarray, t: int) -> np.ndarray:
        """Whether a document ends among the `t` tokens from each `lo` [R] (cyclic): bool [R].
        Counted from the sorted ends by bisection, so no per-token array is needed."""
        n = len(self.data)
        lo = lo % n
        hi = lo + t  # <= 2n: the part past n wraps to [0, hi - n)
        count = np.searchsorted(self.ends, np.minimum(hi, n)) - np.searchsorted(self.ends, lo)
        count += np.searchsorted(self.ends, np.maximum(hi - n, 0))
        return count > 0

    def global_batch(self, step: int, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
        """The step's global batch as arrays sharded over rows; each device builds only its rows."""
        shapes = {"tokens": (self.rows, self.seq_len + 1), "reset": (self.rows,)}
        if self.weight is not None:
            shapes["weight"] = (self.rows, self.seq_len)
        return rows_batch(shapes, sharding, lambda which: self.rows_at(step, which))


def eval_windows(data: np.ndarray, seq_len: int, limit: int) -> np.ndarray:
    """Non-overlapping windows of T+1 bytes from the held-out text, at most `limit`.  [E, T+1]"""
    n = (len(data) - 1) // seq_len
    n = min(n, limit) if limit > 0 else n
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return data[idx].astype(np.int32)


def eval_batches(windows: np.ndarray, rows: int):
    """Batches of `rows` examples; the last one is padded with masked rows so that every example
    is counted exactly once whatever the device count."""
    for i in range(0, len(windows), rows):
        chunk = windows[i : i + rows]
        mask = np.zeros(rows, np.float32)
        mask[: len(chunk)] = 1
        if len(chunk) < rows:
            chunk = np.concatenate([chunk, np.zeros((rows - len(chunk), chunk.shape[1]), np.int32)])
        yield {"tokens": chunk, "reset": np.ones(rows, bool), "mask": mask}


@dataclasses.dataclass(frozen=True)
class HeldOutStream(ContextStream):
    """The held-out text read the way training reads its text, for the streaming evaluation:
    row r reads consecutive windows from offset r * span (span: the text split evenly over the
    rows, a multiple of T, so that windows start at multiples of T), and `reset` marks the rows
    whose previous window held a document boundary, exactly as `ContextStream.rows_at`.

    `score` (float32 [N], optional) marks held-out bytes whose prediction is scored (the recall
    probe's value bytes); a batch then carries it per target position as `score` [R, T]."""

    score: np.ndarray | None = None

    @property
    def span(self) -> int:
        return (len(self.data) - 1) // self.rows // self.seq_len * self.seq_len

    def offsets(self) -> np.ndarray:
        return np.arange(self.rows, dtype=np.int64) * self.span  # [G]

    def rows_at(self, step: int, rows: slice | np.ndarray) -> dict[str, np.ndarray]:
        out = super().rows_at(step, rows)
        if self.score is not None:
            start = self.offsets()[rows] + step * self.seq_len  # [R]
            out["score"] = self.score[start[:, None] + 1 + np.arange(self.seq_len)]  # [R, T], targets
        return out

    def check_fits(self, steps: int) -> None:
        """`steps` windows per row fit in the held-out text (else one line, before training)."""
        if steps * self.seq_len > self.span:
            raise ConfigError(
                f"eval.stream_steps={steps} windows of train.seq_len={self.seq_len} tokens per row do not fit in "
                f"the held-out text ({len(self.data)} tokens over train.batch_size={self.rows} rows): hold out more "
                "text, or lower eval.stream_steps (0: off)"
            )

    def batches(self, steps: int):
        """The host batches of `steps` consecutive windows of every row; each held-out byte is
        read at most once."""
        self.check_fits(steps)
        for step in range(steps):
            yield self.rows_at(step, np.arange(self.rows))
