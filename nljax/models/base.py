"""What the engine needs from a model.

A model is a frozen dataclass (hashable, so it can be a static argument of a jitted step) with:

- `init(key) -> params`
- `level_of(path) -> int`: the CMS level of a parameter path (non-CMS parameters are level 0)
- `init_memory(rows) -> pytree`: inner-loop state, leading axis = stream rows ({} if none)
- `apply(params, memory, batch, key) -> (loss_sum, count, new_memory)` on the rows a device owns;
  `key` is this device's PRNG key for the step (and micro-batch), derived from (seed, step, global
  device index): different on every device, the same on a rerun with the same seed and mesh. A
  model whose randomness must not depend on the mesh (so that N devices match 1) derives
  per-example keys from global example indices carried in the batch instead.
- `logits(params, memory, batch, key) -> (logits [B, T, V], new_memory)` (language models): the
  predictions `apply` scores, for metrics beyond the loss (the recall probe's accuracy)
- `task`: the `nljax.run.tasks` registry key of its data and evaluation (default "text")
- `tensor_parallel(m, axis) -> Model` (optional): the model's shard over `m` devices of the mesh
  axis `axis` (`nljax.parallel.tp`): its `init` gives one shard's parameter shapes, its `apply` runs on one
  shard and sums (or gathers) over `axis` where a split region ends (axis None: shapes only, no
  collective); refused with a ConfigError when `m` does not divide the widths it splits

Losses are returned as a sum and a count so that callers reduce sums and counts, never averages
of averages.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import jax

from nljax.errors import ConfigError

PyTree = Any


class Model(Protocol):
    def init(self, key: jax.Array) -> PyTree: ...

    def level_of(self, path: str) -> int: ...

    def init_memory(self, rows: int) -> PyTree: ...

    def apply(self, params: PyTree, memory: PyTree, batch: dict, key: jax.Array) -> tuple[jax.Array, jax.Array, PyTree]: ...


_CMS_LEVEL = re.compile(r"(?:^|/)cms(\d+)(?:/|$)")


def cms_level_of(path: str) -> int:
    """Level from a `cms<l>` module name in the path; everything else is level 0."""
    m = _CMS_LEVEL.search(path)
    return int(m.group(1)) if m else 0


HIDDEN = "the MLP hidden width (model.dim x model.hidden_mult)"  # as tensor parallelism's refusals name it


def tp_divides(m: int, widths) -> None:
    """One line naming the first of `widths` ((name, value) pairs) that `mesh.model=m` does not divide."""
    for name, value in widths:
        if value % m:
            raise ConfigError(f"mesh.model={m} does not divide {name}={value}: tensor parallelism splits it")
