"""Tasks: where a run's batches come from and how it is evaluated.

A model names its task (`Model.task`); the trainer asks the task for the global batch of a step
and for held-out metrics, and otherwise does not care what it trains. Every task's batch is a
pure function of (seed, step), so resumed and re-sharded runs read the same data.

| task     | data                                   | evaluation                             |
|----------|----------------------------------------|----------------------------------------|
| `text`   | ContextStream over the stdlib corpus   | held-out loss, bits per byte           |
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from nljax import mesh as meshlib
from nljax.config import Config, ConfigError
from nljax.data.text import ContextStream, eval_batches, eval_windows, stdlib_corpus


class Task(Protocol):
    unit: str  # what throughput counts: "tokens", "images"
    units_per_row: int  # units in one batch row (seq_len for text)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch of `step`, split over the data axes (each device builds its rows):
        `train.batch_size` rows, or, at the end of a data pass, fewer: a multiple of the
        micro-batch `train.batch_size / train.accum_steps` (the tail, trained, not dropped; only
        for models without inner-loop memory)."""
        ...

    def evaluate(self, cache, params, step: int) -> dict:
        """Held-out metrics as plain floats, reduced as sums and counts over all devices."""
        ...


def host_sum(x: jax.Array) -> float:
    """Sum of a per-device metric array on the host (works across processes)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return float(np.asarray(x, dtype=np.float64).sum())


class TextTask:
    """Byte-level language modelling on the standard library's source (see `nljax.data.text`)."""

    unit = "tokens"

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.units_per_row = cfg.train.seq_len
        train_bytes, self.eval_data = stdlib_corpus(cfg.data.eval_fraction)
        self.stream = ContextStream(train_bytes, cfg.train.batch_size, cfg.train.seq_len, cfg.seed)

    def batch(self, step: int) -> dict[str, jax.Array]:
        return self.stream.global_batch(step, meshlib.rows_sharding(self.mesh))

    def fingerprint(self) -> str:
        """Digest of the training and held-out bytes, compared across processes at start-up."""
        return hashlib.sha256(self.stream.data.tobytes() + b"|" + self.eval_data.tobytes()).hexdigest()

    def evaluate(self, cache, params, step: int) -> dict:
        """Held-out loss over every eval example exactly once (padded rows are masked)."""
        from nljax.step import put_batch

        rows = self.cfg.train.batch_size
        windows = eval_windows(self.eval_data, self.cfg.train.seq_len, self.cfg.eval.batches * rows)
        if len(windows) == 0:
            raise ConfigError(f"the held-out text is shorter than train.seq_len={self.cfg.train.seq_len}")
        loss = count = 0.0
        for b in eval_batches(windows, rows):
            m = cache.eval(params, put_batch(b, self.mesh))
            loss += host_sum(m["loss_sum"])
            count += host_sum(m["count"])
        mean = loss / max(count, 1.0)
        return {"eval_loss": mean, "eval_bpb": mean / math.log(2), "eval_tokens": int(count)}


TASKS: dict[str, Callable[[Config, Mesh], Task]] = {
    "text": TextTask,
}


def build(name: str, cfg: Config, mesh: Mesh) -> Task:
    try:
        make = TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task '{name}' (available: {', '.join(sorted(TASKS))})")
    return make(cfg, mesh)
