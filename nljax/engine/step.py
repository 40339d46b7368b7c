"""The train and eval steps: pure functions run under `shard_map` over the mesh (the data axes,
and `model` where the local model is a tensor-parallel shard, `nljax/parallel/tp.py`).

One step variant is compiled per distinct Pulse active set (a static argument) and cached. In a
variant, frozen levels appear in no collective at all: their gradients go to the rank-local
error buffer (`accumulate`) or are never computed (`skip`), so they move zero bytes (under
`fsdp` every level's parameters are still gathered for the forward pass). Where parameters and
optimizer state live, and how a synchronized gradient updates them, is `eng.strategy`
(`nljax/engine/strategy.py`, built once per run with the rest of the `Engine`, `nljax/engine/core.py`); the
step itself has no strategy branches.

`shard_map` runs with `check_vma=False`: gradients of replicated parameters must stay
device-local until `sync.reduce` decides what crosses devices. (With varying-axis checking on,
JAX would insert its own all-reduce in the transpose of every replicated parameter.)
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nljax.config import ConfigError
from nljax.engine import executables, frozen, optim
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.models import registry
from nljax.models.base import checked_apply
from nljax.models.layers import token_hits, token_loss
from nljax.parallel.hostdev import put
from nljax.parallel.mesh import DATA_AXES, REPLICATED, ROWS

PyTree = Any
Active = tuple[bool, ...]


def device_key(seed: int, step: jax.Array) -> jax.Array:
    """This device's PRNG key for `step`: a function of (seed, step, global device index), so it
    differs between devices and reproduces on a rerun with the same seed and mesh."""
    index = jax.lax.axis_index(DATA_AXES)  # inter-major, the order of ROWS
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), index)


def unread_empty(tree: PyTree) -> PyTree:
    """`tree` with each zero-size array replaced by a constant of its shape and dtype, so that
    the step reads none of them. A level no parameter is in (a model that puts every parameter
    in level 0) still has state: a zero-size error buffer, and under zero1 and fsdp zero-size
    flat parameters and moments. They hold nothing, so nothing is lost; `frozen.fold` then skips
    the level, which has nothing to buffer, synchronize or update. Why the step must not read
    them: XLA in jaxlib 0.11.2 crashes (a segmentation fault in Shardy's canonicalizer,
    ManualComputationUnusedInputsPattern) compiling a shard_map whose outputs depend on a
    zero-size input (docs/getting-started.md has a reproduction); jaxlib 0.10 compiles it.
    Read or not, the arrays and the results are the same."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if x.size == 0 else x, tree)


def apply_model(eng: Engine, params: PyTree, memory: PyTree, batch: dict, key: jax.Array, train: bool) -> tuple:
    """The run's model on a batch (`checked_apply`: loss_sum, count, new_memory); a plugin's
    `apply` raising while it is traced is one line naming the model (`registry.plugin_code`)."""
    name = eng.cfg.model.name
    with registry.plugin_code(name, "apply", who=f"model '{name}'"):
        return checked_apply(name, eng.local_model, params, memory, batch, key, train=train)


def local_grads(eng: Engine, active: Active, parts: tuple, memory: PyTree, batch: dict, key: jax.Array):
    """Gradients (one subtree per level, None where not computed) of the mean loss of `batch`,
    with the summed loss, the token count and the memory after the batch."""
    accumulate = eng.cfg.cms.frozen_grads == "accumulate"
    # `skip`: frozen levels are not differentiated at all, so XLA never computes their gradients.
    wrt = tuple(p if (active[l] or accumulate) else None for l, p in enumerate(parts))
    # Weighted targets (`weight`, `mask`) may leave a device's rows with none: its mean is then
    # 0, not 0/0, whose NaN gradient would skip every level's update, the other devices' gradients
    # with it. Unweighted batches keep the plain division (the shipped steps' program).
    weighted = "weight" in batch or "mask" in batch

    def loss_fn(diff):
        full = tuple(d if d is not None else p for d, p in zip(diff, parts))
        params = eng.levels.merge(full)
        loss_sum, count, new_memory = apply_model(eng, params, memory, batch, key, train=True)
        return loss_sum / (jnp.where(count > 0, count, 1.0) if weighted else count), (loss_sum, count, new_memory)

    grads, (loss_sum, count, memory) = jax.grad(loss_fn, has_aux=True)(wrt)
    return grads, loss_sum, count, memory


def micro_batches(eng: Engine, local_rows: int) -> int:
    """Micro-batches in a device's `local_rows` rows: `train.accum_steps` for a full batch, fewer
    for the partial accumulation that ends a data pass."""
    return local_rows * eng.n_devices * eng.cfg.train.accum_steps // eng.cfg.train.batch_size


def accumulated_grads(eng: Engine, active: Active, parts: tuple, memory: PyTree, batch: dict, key: jax.Array):
    """`local_grads` over the micro-batches of this device's rows (`train.accum_steps`, or fewer in
    a tail batch), accumulated locally (one `lax.scan`, no communication) and averaged over the
    micro-batches present: the same gradient as one pass over all rows, with 1/accum_steps of the
    activation memory. Each row's memory stays with its row."""
    m = micro_batches(eng, jax.tree.leaves(batch)[0].shape[0])
    if m == 1:
        return local_grads(eng, active, parts, memory, batch, key)
    split = lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:])  # [m, rows/m, ...]
    join = lambda x: x.reshape((-1,) + x.shape[2:])  # [rows, ...]

    def body(acc, xs):
        mb, mem, i = xs
        g, loss_sum, count, mem = local_grads(eng, active, parts, mem, mb, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, acc, (g, loss_sum, count)), mem

    first = lambda tree: jax.tree.map(lambda x: split(x)[0], tree)
    shapes = jax.eval_shape(lambda: local_grads(eng, active, parts, first(memory), first(batch), key)[:3])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    xs = (jax.tree.map(split, batch), jax.tree.map(split, memory), jnp.arange(m))
    (grads, loss_sum, count), memory = jax.lax.scan(body, zeros, xs)
    return jax.tree.map(lambda g: g / m, grads), loss_sum, count, jax.tree.map(join, memory)


def keep_grads(eng: Engine, norms: jax.Array, written: jax.Array) -> jax.Array:
    """Which of a level's synchronized gradients update it ([K] bool), from their norms (the same
    on every device, so all decide alike without another collective): a NaN or Inf anywhere
    makes a norm non-finite; `sync.max_grad_norm` adds a threshold; `written` drops slots no step
    wrote. Per level: one level's bad gradient never stops another level's update. The threshold
    stands on its own: `check_grads=false` turns off the finiteness check only."""
    c = eng.cfg.sync
    ok = written & jnp.isfinite(norms) if c.check_grads else written
    return ok & (norms <= c.max_grad_norm) if c.max_grad_norm > 0 else ok


def update_levels(eng: Engine, state: TrainState, stored: tuple, synced: dict, total_steps: jax.Array):
    """Each active level updated from its own synchronized gradients, clipped by their own norms
    and skipped on their own; `total_steps` (train.steps, an input of the compiled step) is the
    learning-rate schedule's length. Returns (new stored params per level, new optimizer states,
    per-level metrics: [L] norms of the current step's gradient, [L] skipped-gradient counts)."""
    cfg = eng.cfg
    norms = eng.strategy.level_norms(synced)
    scales = optim.level_scales(cfg.optim, eng.n_levels)
    lr = optim.schedule(cfg.optim, total_steps, cfg.train.batch_size)
    new_stored, opt_state = list(stored), list(state.opt_state)
    norm_out, skipped = jnp.zeros((eng.n_levels,)), jnp.zeros((eng.n_levels,))
    for l, g in synced.items():
        steps = frozen.steps_of(state.step, g.shape[0])  # [K]
        ok = keep_grads(eng, norms[l], steps >= 0)
        g = optim.clip(g, norms[l], cfg.optim.clip_norm)
        # step + 1: with warm-up the schedule is 0 at step 0, the one step where every level
        # fires, so a level that fires only then would never train.
        lrs = jnp.broadcast_to(lr(steps + 1), steps.shape) * scales[l]  # a constant schedule gives a float
        new_stored[l], opt_state[l] = eng.strategy.update(l, g, stored[l], state.opt_state[l], lrs, ok)
        norm_out = norm_out.at[l].set(norms[l][-1])
        skipped = skipped.at[l].set(jnp.sum((steps >= 0) & ~ok))
    return new_stored, tuple(opt_state), {"level_grad_norm": norm_out, "level_skipped": skipped}


def local_train_step(eng: Engine, active: Active, state: TrainState, batch: dict, total_steps: jax.Array):
    """Per-device body. Shapes are shard-local: batch tokens [G/n, T+1], memory [G/n, ...],
    err_buf[l] [1, N_l] (or [1, (C_l − 1) N_l], `frozen.width`); params and optimizer states as
    `eng.strategy` stores them (full replicas, or flat shards); `total_steps` [] int32, train.steps."""
    cfg, strat = eng.cfg, eng.strategy
    state = unread_empty(state)
    stored = strat.split(state.params)
    parts = eng.levels.split(strat.compute_params(state.params))
    key = device_key(cfg.seed, state.step)
    grads, loss_sum, count, memory = accumulated_grads(eng, active, parts, state.memory, batch, key)
    # The inner loop's state is carried to the next step but gradients never flow across steps.
    memory = jax.lax.stop_gradient(memory)

    # A fired level's buffer is reset even when its update is skipped: the reset drops a
    # gradient sum that failed the check, which would otherwise fail it again at every firing.
    to_sync, err_buf = frozen.fold(eng, active, grads, state.err_buf, state.step)
    synced = {l: eng.strategy.sync_level(g) for l, g in to_sync.items()}
    new_stored, opt_state, level_metrics = update_levels(eng, state, stored, synced, total_steps)
    # The inner-loop memory advances even when levels are skipped: it is the streams' state, not
    # a learned parameter, and keeping a state that produced a non-finite loss would replay it at
    # every later step (the model restarts rows whose memory is non-finite).
    new_state = TrainState(state.step + 1, strat.merge(new_stored), opt_state, err_buf, memory)
    # Loss leaves as per-device sums and counts ([n_devices] globally): the host reduces them,
    # so the step's HLO holds no collective besides the gradient sync.
    metrics = {
        "loss_sum": loss_sum[None],
        "count": count[None],
        "grad_norm": jnp.sqrt(jnp.sum(jnp.square(level_metrics["level_grad_norm"]))),  # of all active levels
        "skipped": (jnp.sum(level_metrics["level_skipped"]) > 0).astype(jnp.float32),  # any level skipped
        **level_metrics,
    }
    return new_state, metrics


def local_eval_step(eng: Engine, params: PyTree, batch: dict):
    """Per-device summed loss and token count of a masked eval batch (fresh memory per row).
    `params` are stored as the strategy stores them (gathered here under fsdp)."""
    params = eng.strategy.compute_params(params)
    rows = jax.tree.leaves(batch)[0].shape[0]
    memory = eng.local_model.init_memory(rows)
    key = jax.random.key(eng.cfg.seed)
    loss_sum, count, _ = apply_model(eng, params, memory, batch, key, train=False)
    return {"loss_sum": loss_sum[None], "count": count[None]}


def local_eval_stream_step(eng: Engine, params: PyTree, memory: PyTree, batch: dict):
    """Per-device sums of one held-out window per row with the memory carried from the row's
    previous window (reset where `batch["reset"]` says, as in training), and the memory after it.
    Shard-local: tokens [G/n, T+1], reset [G/n], optional score [G/n, T], memory [G/n, ...].
    With `score` the sums include greedy hits at the scored positions, from `model.logits`."""
    params = eng.strategy.compute_params(params)
    key = jax.random.key(eng.cfg.seed)
    if "score" not in batch:
        loss_sum, count, memory = apply_model(eng, params, memory, batch, key, train=False)
        return {"loss_sum": loss_sum[None], "count": count[None]}, memory
    # [G/n, T, V]; inference only: no dropout
    logits, memory = registry.checked_logits(eng.local_model, params, memory, batch, key,
                                             vocab=eng.cfg.model.vocab_size)
    targets = batch["tokens"][:, 1:]  # [G/n, T]
    loss_sum, count = token_loss(logits, targets, batch.get("mask"))
    hits, scored = token_hits(logits, targets, batch["score"])
    return {"loss_sum": loss_sum[None], "count": count[None], "hits": hits[None], "scored": scored[None]}, memory


TRAIN_METRIC_SPECS = {
    "loss_sum": ROWS,
    "count": ROWS,
    "grad_norm": REPLICATED,
    "skipped": REPLICATED,
    "level_grad_norm": REPLICATED,  # [L]: each active level's current synchronized gradient norm, 0 if frozen
    "level_skipped": REPLICATED,  # [L]: how many of each level's synchronized gradients were skipped
}
EVAL_METRIC_SPECS = {"loss_sum": ROWS, "count": ROWS}


def batch_specs(batch: dict) -> dict:
    return {k: ROWS for k in batch}


class WithSteps:
    """A compiled train step called as `(state, batch)`: train.steps, its third input, is given
    here. Everything else (`as_text`, `cost_analysis`, ...) is the compiled executable's."""

    def __init__(self, compiled: jax.stages.Compiled, total_steps: Callable[[], jax.Array]):
        self.compiled, self.total_steps = compiled, total_steps

    def __call__(self, state: TrainState, batch: dict):
        return self.compiled(state, batch, self.total_steps())

    def __getattr__(self, name: str):
        return getattr(self.compiled, name)


class StepCache:
    """Compiled step variants, built on first use: one per active set, plus one per (active set,
    micro-batches) for tail batches that hold fewer than `train.accum_steps` micro-batches.

    Tail batches are for memory-less models only: a row's inner-loop state belongs to a stream
    row of the full global batch, and a tail batch has no row to carry it."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.traces: dict = {}  # variant key -> times traced
        self.compile_s: dict = {}  # variant key -> seconds to trace and compile it (or load it from the cache)
        # executables compiled ahead (NLJAX_EXECUTABLES, nljax/engine/executables.py): where they
        # are kept (None: nowhere), and variant key -> the file each loaded variant came from, or
        # each compiled one was written to
        self.executables: executables.Store | None = executables.store()
        self.loaded: dict = {}
        self.written: dict = {}
        self._train: dict = {}
        self._eval: Callable | None = None
        self._eval_stream: dict = {}  # batch keys -> jitted streaming eval step
        self._total_steps: jax.Array | None = None
        # called as (variant key, None) before a variant is lowered (then compiled or loaded: not
        # known yet) and (key, seconds, the file it was loaded from or None) after: the run says
        # so (a compilation can take minutes); None: silent
        self.announce: Callable[..., None] | None = None

    def total_steps(self) -> jax.Array:
        """train.steps as the compiled step's input (the schedule's length), replicated; placed on
        first call, so that a step can be compiled for devices this process cannot hold arrays on
        (benchmarks/gpu_compile.py compiles for a GPU on a CPU-only machine)."""
        if self._total_steps is None:
            self._total_steps = put(np.asarray(self.eng.cfg.train.steps, np.int32),
                                    NamedSharding(self.eng.mesh, REPLICATED))
        return self._total_steps

    def compiled(self, active: Active, batch: dict) -> bool:
        """Whether the variant for `active` and `batch`'s size is compiled already."""
        return self.variant(active, batch) in self._train

    def variant(self, active: Active, batch: dict):
        """Cache key of the variant for `batch`: `active` for a full batch, (active, micro-batches)
        for a tail; a batch of any other size is refused with one line."""
        cfg, rows = self.eng.cfg.train, jax.tree.leaves(batch)[0].shape[0]
        if rows == cfg.batch_size:
            return active
        micro = cfg.batch_size // cfg.accum_steps
        if not 0 < rows < cfg.batch_size or rows % micro:
            raise ConfigError(
                f"a batch of {rows} rows is neither train.batch_size={cfg.batch_size} nor a multiple of its "
                f"{micro}-row micro-batches (train.batch_size / train.accum_steps)"
            )
        if jax.tree.leaves(self.eng.model.init_memory(1)):
            raise ConfigError(f"a tail batch of {rows} rows cannot train a model with inner-loop memory "
                              f"(each memory row belongs to one of the train.batch_size={cfg.batch_size} streams)")
        return active, rows // micro

    def train_fn(self, active: Active, state: TrainState, batch: dict) -> jax.stages.Compiled:
        """The compiled variant for `active` and `batch`'s size (`state` and `batch` give shapes on
        first use)."""
        return self._compiled(self.variant(active, batch), active, state, batch)

    def built(self, key) -> jax.stages.Compiled:
        """The compiled variant of cache key `key` (`variant`), built already (a step ran it)."""
        return self._train[key]

    def _compiled(self, key, active: Active, state: TrainState, batch: dict) -> jax.stages.Compiled:
        if key not in self._train:
            self._train[key] = self._build_train(key, active, state, batch)
        return self._train[key]

    def _build_train(self, key, active: Active, state: TrainState, batch: dict) -> jax.stages.Compiled:
        def train_step(state, batch, total_steps):  # its name names the compiled module: TRAIN_MODULE in profiles
            self.traces[key] = self.traces.get(key, 0) + 1  # runs at trace time only
            return local_train_step(self.eng, active, state, batch, total_steps)

        st = self.eng.strategy.state_specs(state)
        fn = jax.shard_map(
            train_step,
            mesh=self.eng.mesh,
            in_specs=(st, batch_specs(batch), REPLICATED),
            out_specs=(st, TRAIN_METRIC_SPECS),
            check_vma=False,
        )
        # Compiled ahead of time: the executable that trains is the one whose HLO `nljax.comm`
        # and the run summary read, with no second compilation. The shardings are stated, not
        # taken from the arrays at hand: a restored state and a step's output then give the same
        # program (and the same key in the persistent compilation cache).
        named = lambda specs: jax.tree.map(lambda s: NamedSharding(self.eng.mesh, s), specs,
                                           is_leaf=lambda x: isinstance(x, P))
        shardings = dict(in_shardings=(named(st), named(batch_specs(batch)), named(REPLICATED)),
                         out_shardings=(named(st), named(TRAIN_METRIC_SPECS)))
        if self.announce is not None:
            self.announce(key, None)
        t0 = time.perf_counter()
        # train.steps is an input, not a constant: another train.steps compiles (or loads from
        # the persistent cache) the same executable
        total = jax.ShapeDtypeStruct((), jnp.int32, sharding=named(REPLICATED))
        with executables.relative_paths(self.executables):
            lowered = jax.jit(fn, donate_argnums=0, **shardings).lower(state, batch, total)
        compiled, outcome = executables.compile_step(lowered, list(self.eng.mesh.devices.flat), self.executables)
        self.compile_s[key] = time.perf_counter() - t0
        if outcome.loaded is not None:
            self.loaded[key] = outcome.loaded
        if outcome.written is not None:
            self.written[key] = outcome.written
        if self.announce is not None:
            self.announce(key, self.compile_s[key], outcome.loaded)
        return WithSteps(compiled, self.total_steps)

    def train(self, active: Active, state: TrainState, batch: dict):
        """One step: (new state, metrics, the variant that ran, `variant(active, batch)`).
        `state` is donated."""
        key = self.variant(active, batch)
        state, metrics = self._compiled(key, active, state, batch)(state, batch)
        return state, metrics, key

    def eval(self, params: PyTree, batch: dict):
        if self._eval is None:
            fn = jax.shard_map(
                functools.partial(local_eval_step, self.eng),
                mesh=self.eng.mesh,
                in_specs=(self.eng.strategy.param_specs(params), batch_specs(batch)),
                out_specs=EVAL_METRIC_SPECS,
                check_vma=False,
            )
            self._eval = jax.jit(fn)
        return self._eval(params, batch)

    def eval_memory(self) -> PyTree:
        """A fresh memory for `train.batch_size` evaluation streams, split over rows like the
        training memory but its own arrays: the training state's memory is never touched."""
        return self.eng.strategy.put_memory(self.eng.model.init_memory(self.eng.cfg.train.batch_size))

    def eval_stream(self, params: PyTree, memory: PyTree, batch: dict):
        """(metrics, memory after `batch`); `memory` is donated."""
        key = tuple(sorted(batch))
        if "score" in batch and not hasattr(self.eng.model, "logits"):
            raise ConfigError(f"model.name={self.eng.cfg.model.name} has no logits(): the scored evaluation "
                              "(data.source=recall) needs the per-position predictions")
        if key not in self._eval_stream:
            rows = self.eng.strategy.memory_specs(memory)
            outs = [*EVAL_METRIC_SPECS, *(("hits", "scored") if "score" in batch else ())]
            fn = jax.shard_map(
                functools.partial(local_eval_stream_step, self.eng),
                mesh=self.eng.mesh,
                in_specs=(self.eng.strategy.param_specs(params), rows, batch_specs(batch)),
                out_specs=({k: ROWS for k in outs}, rows),
                check_vma=False,
            )
            self._eval_stream[key] = jax.jit(fn, donate_argnums=1)
        return self._eval_stream[key](params, memory, batch)

