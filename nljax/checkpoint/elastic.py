"""A checkpoint read onto another mesh, device count, global batch or strategy.

Arrays are read with the new mesh's shardings where the layout is unchanged (`read_shardings`),
each row's memory moving with its row. Per-device error buffers are redistributed so that the
next reduction is unchanged (`redistribute_err_buf`). A different global batch gives every row a
new stream, so every row's memory restarts (`fresh_memory`). A different optimizer-state layout
goes through one hook (`convert_layout`; `convert_params` for a restore of the parameters alone,
`restore.restore_params`). A different `mesh.model` changes what each device's
level vectors hold: the state is read through an engine laid out for the saved tensor-parallel
degree (`saved_engine`), and each error buffer is regrouped through the global pytree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from nljax.checkpoint.contents import empty_array, is_empty, named_arrays, per_device, rows_of
from nljax.config import from_dict
from nljax.engine import frozen
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError
from nljax.parallel import mesh as meshlib
from nljax.parallel import tp


def read_shardings(meta: dict, target: dict[str, jax.Array], mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """How to read each saved array: with the target's sharding where its shape is unchanged,
    rows split over the new mesh where they divide, replicated otherwise (then converted)."""
    n_new = meshlib.data_size(mesh)
    rows_sh, rep = meshlib.rows_sharding(mesh), meshlib.replicated(mesh)
    abstract = {}
    for name, info in meta["arrays"].items():
        shape, dtype = tuple(info["shape"]), jnp.dtype(info["dtype"])
        t = target.get(name)
        if t is not None and tuple(t.shape) == shape:
            sharding = t.sharding
        elif (per_device(name) or rows_of(name)) and shape and shape[0] % n_new == 0:
            sharding = rows_sh
        else:
            sharding = rep
        abstract[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return abstract


def fresh_memory(engine: Engine, rows: int) -> dict[str, jax.Array]:
    """Every row's memory at its initial value, by name, split over rows."""
    memory = engine.strategy.put_memory(engine.model.init_memory(rows))  # rows, and heads over `model`
    return {f"memory/{k}": x for k, x in named_arrays(memory).items()}


def saved_engine(meta: dict, engine: Engine) -> Engine:
    """An engine for this mesh laid out as the checkpoint's state is: its config (strategy,
    levels) and its tensor-parallel degree."""
    try:
        saved_cfg = from_dict(meta["config"])
    except ConfigError as e:
        raise ConfigError(f"checkpoint's config cannot be read by this nljax: {e}") from None
    saved_cfg = dataclasses.replace(saved_cfg, mesh=engine.cfg.mesh)
    return Engine.create(saved_cfg, engine.model, engine.mesh, tp_shards=int(meta["mesh"].get(meshlib.MODEL, 1)))


def to_this_run(arrays: dict[str, jax.Array], target: dict[str, jax.Array], engine: Engine, n_old: int,
                fresh_rows: bool, saved: Engine | None = None) -> dict[str, jax.Array]:
    """The saved arrays (parameters and optimizer state already in this run's layout) with the
    error buffers redistributed over this run's devices (and regrouped from the tensor-parallel
    shards of `saved`, an engine of the saved layout, when they differ) and, when `fresh_rows`,
    every row's memory restarted; in the order and with the names of `target`."""
    cfg, n_new = engine.cfg, meshlib.data_size(engine.mesh)
    fresh = fresh_memory(engine, cfg.train.batch_size) if fresh_rows else {}
    out = {}
    for name, t in target.items():
        x = arrays[name]
        regroup = None
        if per_device(name) and saved is not None and saved.tp != engine.tp:
            l = int(name.split("/")[1])
            old, new, k = saved.strategy.shards[l], engine.strategy.shards[l], max(frozen.slots(engine, l) - 1, 1)
            regroup = lambda v, old=old, new=new, k=k: tp.regroup(v, old, new, k)
        if is_empty(t):  # an empty level's buffer: nothing to spread
            x = empty_array(t)
        elif per_device(name) and (n_old != n_new or regroup is not None):
            x = redistribute_err_buf(x, n_old, n_new, cfg.sync.mean, t.sharding, regroup)
        elif rows_of(name) and fresh_rows:
            x = fresh[name]
        out[name] = x
    return out


def redistribute_err_buf(e: jax.Array, n_old: int, n_new: int, mean: bool, sharding: NamedSharding,
                         regroup=None) -> jax.Array:
    """Error buffers [n_old, N] -> [n_new, N'] so that the next reduction is unchanged (`regroup`
    maps one row laid out for the saved tensor-parallel shards to this run's; N' = N without).

    When the level fires, the engine reduces Σ_d (g_d + e_d) over devices, divided by the device
    count n under `sync.mean`. With S = Σ_d e_d saved from n_old devices, giving each of the
    n_new devices e' = S / n_old keeps the mean: (1/n_new) Σ_d' (g'_d' + e') = mean(g) + S / n_old,
    the uninterrupted run's value. Under sums, e' = S / n_new keeps Σ_d' e' = S.
    """
    divisor = n_old if mean else n_new

    @jax.jit
    def spread(e):
        total = jnp.sum(e, axis=0) / divisor  # [N]
        if regroup is not None:
            total = regroup(total)  # [N']
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(total, (n_new, total.shape[0])), sharding)

    return spread(e)


def convert_layout(meta: dict, engine: Engine, template: TrainState,
                   arrays: dict[str, jax.Array], saved_eng: Engine) -> dict[str, jax.Array]:
    """Parameters and optimizer state saved in another layout (another `sync.strategy`, or a
    sharded layout padded for another mesh), converted to this run's.

    `arrays` holds the saved layout, named as `named_arrays` names it, on the new mesh (arrays
    whose shape differs from this run's are read replicated). They are put back into the
    structure of the saved strategy's state (an engine built from the saved config on this mesh
    gives it; padding lengths do not matter, the conversion drops padding by size), taken to the
    strategy-independent layout and from there to this run's:
    `engine.strategy.import_state(saved_engine.strategy.export_state(saved_state))`, `saved_eng`
    being `saved_engine(meta, engine)`. Error buffers, memory and the step are returned as saved
    (the caller redistributes them)."""
    here = template
    saved = _saved_state(saved_eng, arrays, TrainState(here.step, None, None, here.err_buf, here.memory))
    canonical = saved_eng.strategy.export_state(saved)
    # This run's own (fresh) error buffers and memory ride along: import_state places them by
    # rows, which the saved ones may not divide into; the caller takes those from `arrays`.
    converted = engine.strategy.import_state(canonical.replace(err_buf=here.err_buf, memory=here.memory))
    out = {n: x for n, x in arrays.items() if not n.startswith(("params/", "opt_state/"))}
    out.update({n: x for n, x in named_arrays(converted).items() if n.startswith(("params/", "opt_state/"))})
    return out


def convert_params(engine: Engine, arrays: dict[str, jax.Array], saved_eng: Engine) -> dict[str, jax.Array]:
    """`convert_layout` of the parameters alone: `arrays` holds the saved parameters and the
    step, read as `convert_layout`'s are; they are taken to the model's pytree by the saved
    layout (`gather_params`) and from there to this run's (`import_params`). `arrays` is emptied
    on the way, so that the devices hold two copies of the parameters at most, not three: the
    saved layout's is dropped once the model's pytree is made."""
    step = arrays["step"]
    saved = _saved_state(saved_eng, arrays, TrainState(step, None, (), (), {}))
    canonical = saved_eng.strategy.gather_params(saved.params)
    del saved
    arrays.clear()
    return named_arrays(TrainState(step, engine.strategy.import_params(canonical), (), (), {}))


def _saved_state(saved_eng: Engine, arrays: dict[str, jax.Array], rest: TrainState) -> TrainState:
    """The saved arrays put back into the structure of the saved strategy's state: its parameters,
    its optimizer state unless `rest` gives one (`()`: a restore of the parameters alone), and
    `rest`'s step, error buffers and memory (whose arrays `arrays` names alike). One line where
    `arrays` does not form that state."""
    params, opt_state = saved_eng.strategy.layout_shapes()
    saved_template = TrainState(rest.step, params, opt_state if rest.opt_state is None else rest.opt_state,
                                rest.err_buf, rest.memory)
    names = list(named_arrays(saved_template))
    missing = [n for n in names if n not in arrays]
    if missing or len(names) != len(arrays):
        raise ConfigError(
            f"checkpoint does not fit this run: its arrays do not form a sync.strategy={saved_eng.cfg.sync.strategy} "
            f"state (e.g. '{(missing or sorted(set(arrays) - set(names)))[0]}')"
        )
    treedef = jax.tree_util.tree_structure(saved_template)
    return jax.tree_util.tree_unflatten(treedef, [arrays[n] for n in names])
