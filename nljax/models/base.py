"""`nljax.Model`: what the engine and the commands need from a model.

A model is an object with these methods, best a frozen dataclass (the compiled steps close over
the model a run built, so nothing in it may change afterwards; it need not be hashable); the
engine calls nothing else. Shapes: B rows of the batch this device owns (the global
batch's rows are split over the data axes), T tokens per row (`train.seq_len`), V the vocabulary.

Required:

- `init(key) -> params`: the parameter pytree (flax's `{"params": ...}` contents, or any pytree
  of float arrays: a NamedTuple, a list; a leaf's path, as `level_of` and the export name it,
  joins dict keys, field names and indices with "/"), one device's worth when the model is a
  tensor-parallel shard. Everything in it is an outer-loop parameter,
  synchronized by the engine; its initial inner-loop memory belongs here too (nl_lm's
  `memory0_*`). A function of `key` alone (`jax.random`): every process of a run calls it and
  must get the same replicas; numbers drawn at trace time (numpy's random generator, the time)
  are refused when the model is built.
- `level_of(path) -> int`: the CMS level of a parameter, by its path ("block0/cms1/up/kernel"),
  in 0 .. len(cms.periods) - 1. Level l is synchronized and updated every `cms.periods[l]`
  steps; what is not a CMS parameter (embeddings, attention, memory projections, norms, head)
  is level 0. Use `cms_level_of` (a `cms<l>` module name in the path) unless the model has its
  own rule. A level outside cms.periods is refused when the model is built.
- `init_memory(rows) -> pytree`: the inner-loop state of `rows` stream rows, every leaf
  [rows, ...] ({} if the model has none). The state belongs to a row: the engine splits it over
  the data axes with the rows, never reduces or gathers it, carries it from step to step
  (gradients stopped at the step boundary) and checkpoints it; an elastic resume moves each
  row's state with its row. A leaf without the rows axis first is refused when the model is
  built.
- `apply(params, memory, batch, key) -> (loss_sum, count, new_memory)` on this device's rows:
  loss_sum and count are float32 scalars (a sum, never a mean: callers add sums and counts over
  devices and micro-batches, so N devices compute exactly what 1 does); new_memory has
  `memory`'s structure, shapes and dtypes (checked when the step is traced: `checked_apply`). A
  text batch holds `tokens` [B, T+1] int32 (inputs and shifted targets), `reset` [B] bool (the
  row starts a new document or stream: its memory restarts), optionally `mask` [B] (0 for an
  evaluation batch's padding rows) and `weight` [B, T] (a per-target loss weight; `token_loss`
  takes both). `key` is this device's PRNG key for the step (and micro-batch), derived from
  (seed, step, global device index): a model whose randomness must not depend on the mesh
  derives per-example keys from indices in the batch.

Optional:

- `apply(..., train: bool)`: an `apply` that declares a parameter named `train` is told whether
  it trains: `train=True` in the training step, `train=False` wherever the engine scores without
  training (the run's evaluation, fresh and streaming, which `nljax.evaluate` runs too). A model
  with dropout turns it off there: flax's `nn.Dropout(rate)(x, deterministic=not train)`, with
  `rngs={"dropout": key}`. `key` is given either way (a MeanFlow loss samples its times and noise
  in evaluation too). An `apply` without the parameter is called as above (`takes_train`), so a
  model without dropout need not declare it; one that forwards `*args, **kwargs` is not told,
  and a `tensor_parallel` shard is told only if its own `apply` declares `train`.
- `logits(params, memory, batch, key) -> (logits [B, T, V], new_memory)`: the predictions `apply`
  scores, V >= model.vocab_size (every token id of the run's data). A text model needs it to be
  evaluated beyond the loss (the recall probe's accuracy), sampled from (`nljax.generate`) and
  used after `nljax.load_model`. It is for inference only, never called in training, so it
  takes no `train`: it applies no dropout. Its outputs are checked where it is traced, as
  `apply`'s are (`checked_logits`).
- `task`: "text" (the default: `nljax.run.tasks.TextTask` feeds it token windows; generate
  writes text) or "images" (a MeanFlow denoiser: `ImageTask`, a PNG grid). The registered task
  (`nljax.register_model(..., task=)`) decides; the attribute, if present, must agree.
- `decays(path) -> bool`: whether `optim.weight_decay` applies to the parameter at `path` (with
  `optim.decay_params: weights`, the default). Without it, `decays_by_name`: flax's `kernel` and
  `embedding` leaves (the weights of Dense, DenseGeneral, Conv and Embed) decay; biases, norm
  scales and a model's own parameters (an initial memory, a gain) do not.
- `tensor_parallel(m, axis) -> Model`: this model's shard over `m` devices of the mesh axis
  `axis` (`nljax.parallel.tp`): its `init` gives one shard's parameter shapes, its `apply` runs
  on one shard and sums (or gathers) over `axis` where a split region ends (axis None: shapes
  only, no collective; `tp.enter` / `tp.leave` mark the region). The engine derives which
  dimensions are split from the global and shard shapes, of the parameters and of the memory
  alike. Refuse with a ConfigError (`tp_divides`) when `m` does not divide a split width. A
  model without it trains with `mesh.model=1` only.
- `mismatch(name, there, here) -> str`: what a parameter of another shape in a checkpoint says
  in the user's terms (`there`, `here`: [shape, dtype], or None where absent), added to the
  "from another model" line (the DiT: its data's classes and channels); "" for nothing to add.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from nljax.errors import ConfigError

PyTree = Any


class Model(Protocol):
    """The contract above; `TextModel` adds `logits`. Static typing only: the registry checks a
    built model's methods, levels and memory shapes itself (`nljax.models.registry.check_model`)."""

    def init(self, key: jax.Array) -> PyTree:
        """Parameters (one tensor-parallel shard's, for a shard)."""
        ...

    def level_of(self, path: str) -> int:
        """CMS level of the parameter at `path`, in 0 .. len(cms.periods) - 1."""
        ...

    def init_memory(self, rows: int) -> PyTree:
        """Inner-loop state of `rows` rows: every leaf [rows, ...]; {} if none."""
        ...

    def apply(self, params: PyTree, memory: PyTree, batch: dict, key: jax.Array) -> tuple[jax.Array, jax.Array, PyTree]:
        """(loss_sum, count, new_memory) on this device's rows. An `apply` that also declares
        `train: bool` is called with `train=True` in training and `train=False` in evaluation
        (dropout off); one without it is called as here."""
        ...


class TextModel(Model, Protocol):
    """A language model: `apply`'s predictions are available for evaluation and generation."""

    def logits(self, params: PyTree, memory: PyTree, batch: dict, key: jax.Array | None = None) -> tuple[jax.Array, PyTree]:
        """(logits `[B, T, V]` of `batch["tokens"][:, :-1]`, new_memory). For inference only
        (evaluation, generation, a loaded model): no dropout."""
        ...


_CMS_LEVEL = re.compile(r"(?:^|/)cms(\d+)(?:/|$)")


def cms_level_of(path: str) -> int:
    """The level of a parameter path by the naming rule of CMS chains: a module named `cms<l>`
    anywhere in the path ("block0/cms2/up/kernel" -> 2, `nljax.models.blocks.CMSChain` names its
    levels so); everything else is level 0."""
    m = _CMS_LEVEL.search(path)
    return int(m.group(1)) if m else 0


DECAYED_NAMES = ("kernel", "embedding")  # flax's names for the weights of Dense/Conv and Embed


def decays_by_name(path: str) -> bool:
    """Whether weight decay applies to the parameter at `path` when its model does not say
    (`decays`): its last name is flax's for a weight matrix or an embedding table. Biases, norm
    scales and gains, and a model's own parameters (nl_lm's initial memory `memory0_*`) keep
    their values: decaying them toward 0 is not a regularizer but a bias of the model."""
    return path.rsplit("/", 1)[-1] in DECAYED_NAMES


HIDDEN = "the MLP hidden width (model.dim x model.hidden_mult)"  # as tensor parallelism's refusals name it


def tp_divides(m: int, widths) -> None:
    """One line naming the first of `widths` ((name, value) pairs) that `mesh.model=m` does not divide."""
    for name, value in widths:
        if value % m:
            raise ConfigError(f"mesh.model={m} does not divide {name}={value}: tensor parallelism splits it")


def takes_train(model: Model) -> bool:
    """Whether `model.apply` declares a parameter named `train` that a keyword can give (the
    contract's optional `train`); a model without one is called as it always was."""
    try:
        p = inspect.signature(model.apply).parameters.get("train")
    except (TypeError, ValueError):  # a callable without a signature: none declared
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def checked_apply(name: str, model: Model, params: PyTree, memory: PyTree, batch: dict, key, *,
                  train: bool) -> tuple:
    """`model.apply(...)` (with `train` if it takes one: `takes_train`), its outputs checked from
    their shapes while the step is traced (free at run time): two scalar sums, and new_memory with
    `memory`'s structure, shapes and dtypes. The step carries new_memory into the next step, which
    may be another compiled variant: a leaf that changed would otherwise fail there, inside the
    model, in a message about its parameters. (A plugin's `apply` raising is one line too: the
    engine calls this inside `registry.plugin_code`, `nljax.engine.step.apply_model`.)"""
    out = model.apply(params, memory, batch, key, **({"train": train} if takes_train(model) else {}))
    who = f"model '{name}': apply"
    if not isinstance(out, tuple) or len(out) != 3:
        raise ConfigError(f"{who} must return (loss_sum, count, new_memory), got {type(out).__name__}")
    for what, x in zip(("loss_sum", "count"), out[:2]):
        if jnp.ndim(x) != 0:
            raise ConfigError(f"{who} returned {what} of shape {tuple(jnp.shape(x))}: it must be a scalar, "
                              "a sum over this device's rows (not a mean: sums add over devices)")
    _same_memory(who, memory, out[2])
    # a Python number (`count = 8`) is a scalar too: as an array, or the step's `count[None]` fails
    return jnp.asarray(out[0]), jnp.asarray(out[1]), out[2]


def checked_logits(model: Model, params: PyTree, memory: PyTree, batch: dict, *key, vocab: int) -> tuple:
    """`model.logits(params, memory, batch[, key])`, its outputs checked from their shapes while
    the caller is traced (free at run time): (logits [B, T, V] for tokens [B, T+1], V >= `vocab`
    (model.vocab_size, which holds every token id of the run's data), new_memory with `memory`'s
    structure, shapes and dtypes). `logits` is called only by evaluation, generation and the
    harness: a model returning logits alone, or [B, T] without the vocabulary, failed there deep
    inside (an unpacking error, numpy's `len()` of a float), and one with fewer than `vocab`
    entries a token scored NaN for the tokens past its end and never generated them."""
    out = model.logits(params, memory, batch, *key)
    who = f"model {type(model).__name__}: logits"
    if not isinstance(out, tuple) or len(out) != 2:
        got = f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__
        raise ConfigError(f"{who} must return (logits [B, T, V], new_memory), got {got}")
    rows, t = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
    if jnp.ndim(out[0]) != 3 or tuple(jnp.shape(out[0]))[:2] != (rows, t):
        raise ConfigError(f"{who} returned logits of shape {tuple(jnp.shape(out[0]))} for tokens "
                          f"{list(batch['tokens'].shape)}: it must be [{rows}, {t}, V], one row of V (the "
                          "vocabulary) per input token")
    if jnp.shape(out[0])[2] < vocab:
        raise ConfigError(f"{who} returned {jnp.shape(out[0])[2]} logits a token, fewer than model.vocab_size={vocab} "
                          "(the token ids of the run's data): it must score every token id, V >= model.vocab_size")
    if jax.tree.leaves(memory) or jax.tree.leaves(out[1]):  # no memory: {} or None alike
        _same_memory(who, memory, out[1])
    return out


def _same_memory(who: str, memory: PyTree, new: PyTree) -> None:
    from nljax.parallel.levels import path_str

    was = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(memory)[0]}
    now = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(new)[0]}
    if jax.tree.structure(memory) != jax.tree.structure(new):
        raise ConfigError(f"{who} returned new_memory with leaves {sorted(now) or 'none'} where the memory it was "
                          f"given has {sorted(was) or 'none'}: new_memory must keep memory's structure")
    for path, x in was.items():
        y = now[path]
        if (jnp.shape(x), jnp.result_type(x)) != (jnp.shape(y), jnp.result_type(y)):
            raise ConfigError(f"{who} returned new_memory leaf '{path}' of {_shape(y)} where the memory it was given "
                              f"has {_shape(x)}: new_memory must keep memory's shapes and dtypes")


def _shape(x) -> str:
    return f"{list(jnp.shape(x))} {jnp.result_type(x)}"
