"""Checkpoints: save, validate and restore a run's state with Orbax.

A checkpoint is one Orbax step directory `<checkpoint.dir>/<step>` (step = optimizer steps done)
holding two items:

- `state`: every array of the TrainState as a nested dict keyed by its path (`params/...`,
  `opt_state/<level>/...`, `err_buf/<level>`, `memory/...`, `step`), each a global jax.Array
  saved with the sharding it trained with. Orbax writes each shard once (replica 0 of it), so a
  replicated parameter is written once, not once per device or process, and each row's memory
  is written by the device that holds the row. Plain Orbax reads it back
  (`CheckpointManager(dir).restore(step)`).
- `nljax`: JSON metadata. The Conductor, the ContextStream and the PRNG keys are pure functions
  of (seed, step[, row or device]), so the step and the seed are their whole state; with them:
  the resolved config, the nljax version, mesh, strategy and device count, and the shape, dtype
  and checksum of every array. Nothing is pickled, on save or on restore.

Orbax writes a step into a temporary directory and renames it once every item is complete, so a
process killed at any moment, during a save too, leaves the earlier checkpoints intact, and a
resume only ever sees complete ones. A resume reads before anything is written: a bad checkpoint
stops the run with one line and leaves every file as it was, except that `latest` skips damaged
checkpoints for the newest intact one (with a warning). Checkpoints later than the one resumed
are moved to `<checkpoint.dir>/set_aside/` before the run saves, never deleted. A save that fails
(e.g. the disk is full) stops the run with one line; the earlier checkpoints stay intact.

A resume may use another mesh or device count: arrays are read with the new mesh's shardings,
each row's memory moves with its row, and per-device error buffers are redistributed so that the
next reduction is unchanged (`redistribute_err_buf`). A different global batch gives every row a
new stream, so every row's memory restarts (with a warning). A different optimizer-state layout
goes through one hook (`convert_layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from nljax import __version__
from nljax import mesh as meshlib
from nljax.conductor import Conductor
from nljax.config import Config, from_dict, to_dict
from nljax.errors import ConfigError, first_line
from nljax.hostdev import replica, reset_all_rows
from nljax.state import TrainState
from nljax.step import Engine

FORMAT = 1
STATE, META = "state", "nljax"  # item names inside a step directory
SET_ASIDE = "set_aside"  # <checkpoint.dir>/set_aside/<step>: checkpoints moved out of a resumed run's way


class Damaged(ConfigError):
    """A checkpoint whose files cannot be read, or do not match their checksums (as opposed to
    one that does not fit this run's config): `--resume` skips it for an older one."""

# Config sections that decide the shapes and meaning of the saved arrays: a checkpoint only
# fits a run that agrees on them. Everything else may change on resume: settings that do not
# change the result silently, the rest (strategy included) with a warning.
MUST_MATCH = ("model", "cms", "optim.name")
SILENT = ("run", "checkpoint", "mesh", "eval", "train.log_every", "train.batch_size", "train.profile_steps",
          "train.profile_start", "throughput", "distributed")


def checkpoint_dir(cfg: Config) -> Path:
    # absolute: Orbax's TensorStore writer rejects relative paths (the default run.dir is one)
    return Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints").absolute()


# ---------------------------------------------------------------------------------------------
# The state as named arrays


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_arrays(state: TrainState) -> dict[str, Any]:
    """Every leaf of `state` by its path, e.g. 'opt_state/1/0/mu/block0/cms1/Dense_0/kernel'."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {"/".join(_key_name(k) for k in path): x for path, x in leaves}


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, x in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return tree


def _unnest(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_unnest(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the bits of `x`, modulo 2^32. Integer addition is associative, so
    the value is exact whatever the sharding and the reduction order: a checkpoint restored onto
    another mesh checks against the sum computed when it was saved."""
    if x.dtype == jnp.bool_ or x.dtype.itemsize not in _UINT:
        u = x.astype(jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    weight = jnp.arange(u.size, dtype=jnp.uint32).reshape(u.shape) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(u * weight, dtype=jnp.uint32)


@jax.jit
def _checksums(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: _leaf_checksum(x) for k, x in arrays.items()}


def checksums(arrays: dict[str, jax.Array]) -> dict[str, int]:
    out = _checksums(arrays)
    # replicated scalars: read this process's copy (works when other processes hold the rest)
    return {k: int(replica(v)) for k, v in out.items()}


def _rows_of(name: str) -> bool:
    return name.startswith("memory/")


def _per_device(name: str) -> bool:
    return name.startswith("err_buf/")


# ---------------------------------------------------------------------------------------------
# Metadata


_fingerprints: dict[int, tuple[Any, dict]] = {}  # id(model) -> (model, fingerprint); models need not be hashable


def fingerprint(model) -> dict[str, list]:
    """The model's parameters by path, with shape and dtype, as `model.init` makes them: the same
    whatever the strategy stores (a checkpoint of another model differs here). Traced once per
    model: tracing `init` costs more than the rest of a save's blocking part."""
    hit = _fingerprints.get(id(model))
    if hit is None or hit[0] is not model:
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        hit = _fingerprints[id(model)] = (model, {k: [list(x.shape), str(x.dtype)] for k, x in named_arrays(shapes).items()})
    return hit[1]


def metadata(engine: Engine, step: int, arrays: dict[str, jax.Array]) -> dict:
    cfg, mesh = engine.cfg, engine.mesh
    sums = checksums(arrays)
    return {
        "format": FORMAT,
        "nljax_version": __version__,
        "step": step,
        "conductor": Conductor(cfg.cms.periods, step).state_dict(),
        # ContextStream row r at step s: a pure function of (seed, step, row) -> nothing else to save
        "data": {"step": step, "seed": cfg.seed, "rows": cfg.train.batch_size, "seq_len": cfg.train.seq_len},
        "rng": {"seed": cfg.seed, "device_key": "fold_in(fold_in(key(seed), step), global device index)"},
        "mesh": {**{k: int(v) for k, v in mesh.shape.items()}, "devices": meshlib.data_size(mesh),
                 "processes": jax.process_count()},
        "strategy": cfg.sync.strategy,
        "config": to_dict(cfg),
        "model": fingerprint(engine.model),
        "arrays": {
            k: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": sums[k]} for k, x in arrays.items()
        },
    }


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _differences(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """Dotted keys where the plain config trees `a` (saved) and `b` (this run) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [(prefix, a, b)]


def _fmt(v: Any) -> str:
    return "(absent)" if v is None else repr(v) if isinstance(v, str) else str(v)


# ---------------------------------------------------------------------------------------------
# Finding a checkpoint


@contextlib.contextmanager
def quiet_orbax():
    """Orbax logs routine warnings through absl (e.g. for every read-only manager); the user
    should see nljax's one line, not those."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _manager(root: Path, write: bool = False, cfg: Config | None = None):
    import orbax.checkpoint as ocp

    if not write:
        with quiet_orbax():  # a read-only manager warns that it is one
            return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    opts = ocp.CheckpointManagerOptions(
        # Orbax would prune any folder with a number for a name, a user's too: nljax prunes its
        # own steps itself (`prune`)
        max_to_keep=None,
        enable_async_checkpointing=cfg.checkpoint.async_save,
        cleanup_tmp_directories=True,  # partial saves of a killed run; never a complete step
        create=True,
    )
    return ocp.CheckpointManager(root, options=opts)


def _is_nljax_step(p: Path) -> bool:
    """A step directory nljax committed: a numeric name, Orbax's step metadata and nljax's item.
    Only these are resumed from or pruned; a user's folder `checkpoints/7` is neither."""
    return p.name.isdigit() and (p / META / "metadata").is_file() and (p / "_CHECKPOINT_METADATA").is_file()


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete nljax checkpoint under `root` (partial saves and folders nljax did
    not write excluded)."""
    if not root.is_dir():
        return []
    ours = {int(p.name) for p in root.iterdir() if _is_nljax_step(p)}
    # the manager is opened on every process whatever this host sees: opening it syncs processes
    return sorted(ours & set(_manager(root).all_steps()))


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete nljax checkpoints under `root` (process 0).
    Every process calls it: listing the steps opens an Orbax manager, which syncs processes."""
    steps = complete_steps(root)
    if jax.process_index() != 0:
        return
    for step in steps[:-keep]:
        shutil.rmtree(root / str(step), ignore_errors=True)


def _leftovers(root: Path) -> list[Path]:
    """nljax's step directories and partial saves under `root`."""
    if not root.is_dir():
        return []
    # `<step>` holding an nljax item, and `<step>.orbax-checkpoint-tmp-<n>` (a save cut short);
    # nothing else a user keeps there is ever refused or removed.
    return [p for p in root.iterdir()
            if p.is_dir() and ((p.name.isdigit() and (p / META).is_dir())
                               or re.fullmatch(r"\d+\.orbax-checkpoint-tmp(-\d+)?", p.name))]


def candidates(cfg: Config) -> list[Path]:
    """The step directories a resume may use, best first: the one `checkpoint.resume` names, or
    for `latest` (or a checkpoint directory) its complete checkpoints, newest first (an older one
    is used when the newer ones are damaged). Empty for a fresh run."""
    resume = cfg.checkpoint.resume
    if not resume:
        return []
    root = checkpoint_dir(cfg) if resume == "latest" else Path(resume).absolute()
    if not root.exists():
        raise ConfigError(f"checkpoint not found: {root}")
    if (root / META).is_dir() or (root / STATE).is_dir():
        return [root]  # a step directory
    steps = complete_steps(root)
    if not steps:
        raise ConfigError(f"no complete checkpoint in {root} to resume from")
    return [root / str(s) for s in reversed(steps)]


def locate(cfg: Config) -> Path | None:
    """The step directory a resume tries first, or None for a fresh run."""
    paths = candidates(cfg)
    return paths[0] if paths else None


def restore_first_valid(engine: Engine, template: TrainState, paths: list[Path]) -> tuple[Restored, list[tuple[Path, str]]]:
    """`restore` of the first of `paths` that is not damaged, and the damaged ones skipped (path,
    reason). A checkpoint that does not fit this run stops the search (an older one would not fit
    either); so does the last one's damage, with its own line."""
    skipped: list[tuple[Path, str]] = []
    for i, path in enumerate(paths):
        try:
            return restore(engine, template, path), skipped
        except Damaged as e:
            if i == len(paths) - 1:
                if skipped:
                    raise Damaged(f"every checkpoint in {path.parent} is damaged; the oldest: {e}") from None
                raise
            skipped.append((path, str(e)))
    raise AssertionError("no paths")  # candidates() never returns an empty list to resume from


# ---------------------------------------------------------------------------------------------
# Restore


@dataclasses.dataclass
class Restored:
    state: TrainState
    step: int  # optimizer steps done: the run continues at this step
    path: Path
    fresh_rows: bool  # every row's memory restarted: the first step resets every row
    warnings: list[str]


def _read_meta(path: Path) -> dict:
    import orbax.checkpoint as ocp

    if not path.is_dir() or not path.name.isdigit():
        raise ConfigError(f"{path} is not a checkpoint step directory")
    try:
        meta = _manager(path.parent).restore(int(path.name), args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # noqa: BLE001 - whatever Orbax raises, the user sees one line
        raise Damaged(f"checkpoint {path}: metadata unreadable ({_error_line(e)})") from None
    if not _well_formed(meta):
        raise Damaged(f"checkpoint {path}: metadata is not an nljax checkpoint of format {FORMAT}")
    return meta


def _well_formed(meta: Any) -> bool:
    """Every field `restore` reads is there, with its type."""
    try:
        arrays_ok = all(
            isinstance(a["shape"], list) and all(isinstance(d, int) for d in a["shape"])
            and isinstance(a["dtype"], str) and np.dtype(a["dtype"]) is not None and isinstance(a["checksum"], int)
            for a in meta["arrays"].values()
        )
        return (
            meta["format"] == FORMAT and isinstance(meta["step"], int) and arrays_ok and "step" in meta["arrays"]
            and isinstance(meta["mesh"]["devices"], int) and isinstance(meta["config"]["train"]["batch_size"], int)
            # the device count divides the error buffers on resume: it must be their first dimension
            and all(a["shape"][:1] == [meta["mesh"]["devices"]] for k, a in meta["arrays"].items() if _per_device(k))
            and all(isinstance(v, list) and len(v) == 2 for v in meta["model"].values())
        )
    except (KeyError, TypeError, AttributeError):
        return False


def _error_line(e: BaseException) -> str:
    """'<type>: <first line>' of whatever Orbax or TensorStore raised."""
    return f"{type(e).__name__}: {first_line(e)}"[:300]


def _check_fits(path: Path, meta: dict, engine: Engine) -> None:
    """One-line errors for a checkpoint of another model or an incompatible config."""
    here = to_dict(engine.cfg)
    for key in MUST_MATCH:
        for k, a, b in _differences(_get(meta["config"], key), _get(here, key), key):
            raise ConfigError(f"checkpoint {path} does not fit this run: {k}={_fmt(a)} there, {_fmt(b)} here")
    saved, mine = meta["model"], fingerprint(engine.model)
    for name in sorted(set(saved) | set(mine)):
        if name not in saved:
            raise ConfigError(f"checkpoint {path} is from another model: it has no parameter '{name}'")
        if name not in mine:
            raise ConfigError(f"checkpoint {path} is from another model: parameter '{name}' has no place here")
        if saved[name] != mine[name]:
            (s1, d1), (s2, d2) = saved[name], mine[name]
            raise ConfigError(
                f"checkpoint {path} is from another model: parameter '{name}' is {d1}{tuple(s1)} there, "
                f"{d2}{tuple(s2)} here"
            )


def restore(engine: Engine, template: TrainState, path: Path) -> Restored:
    """Read the checkpoint at `path` onto `engine`'s mesh (which may differ from the one that
    saved it) with the shardings of `template` (a fresh state of this run, `Run.init_state`),
    check it, and convert what depends on the device count, the global batch or the strategy.
    Reads only; raises ConfigError with one line on bad input."""
    import orbax.checkpoint as ocp

    cfg, mesh = engine.cfg, engine.mesh
    meta = _read_meta(path)
    target = named_arrays(template)
    _check_fits(path, meta, engine)
    same_layout = engine.strategy.same_layout(meta.get("strategy", "replicated"), meta["arrays"], target,
                                              lambda name: _per_device(name) or _rows_of(name))
    saved_cfg = meta["config"]
    warnings = [
        f"resuming with {k}={_fmt(b)} (checkpoint: {_fmt(a)})"
        for k, a, b in _differences(saved_cfg, to_dict(cfg), "")
        if not any(k == s or k.startswith(s + ".") for s in SILENT)
    ]
    n_old, n_new = int(meta["mesh"]["devices"]), meshlib.data_size(mesh)
    rows_old, rows_new = int(_get(saved_cfg, "train.batch_size")), cfg.train.batch_size
    fresh_rows = rows_old != rows_new and any(_rows_of(n) for n in target)
    if fresh_rows:
        warnings.append(
            f"train.batch_size changed from {rows_old} to {rows_new}: the ContextStream gives every row a new "
            f"stream, so every row's memory restarts from its initial value at step {meta['step']}"
        )

    # Saved arrays are read with the target's sharding where the layout is unchanged, rows split
    # over the new mesh where they divide, replicated otherwise (then converted below).
    rows_sh, rep = meshlib.rows_sharding(mesh), meshlib.replicated(mesh)
    abstract = {}
    for name, info in meta["arrays"].items():
        shape, dtype = tuple(info["shape"]), jnp.dtype(info["dtype"])
        t = target.get(name)
        if t is not None and tuple(t.shape) == shape:
            sharding = t.sharding
        elif (_per_device(name) or _rows_of(name)) and shape and shape[0] % n_new == 0:
            sharding = rows_sh
        else:
            sharding = rep
        abstract[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    _ignore_closed_loop_callbacks()
    try:
        loaded = _manager(path.parent).restore(
            int(path.name), args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(_nest(abstract))})
        )[STATE]
        arrays = _unnest(loaded)
        if set(arrays) != set(abstract):
            raise ValueError(f"arrays {sorted(set(abstract) ^ set(arrays))[:3]} missing or unexpected")
        sums = checksums(arrays)
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file, whatever the reader raises
        logging.getLogger("asyncio").addFilter(_unretrieved_read_errors)
        raise Damaged(f"checkpoint {path}: array data unreadable ({_error_line(e)})") from None
    for name, info in meta["arrays"].items():
        if sums[name] != info["checksum"]:
            raise Damaged(f"checkpoint {path}: array '{name}' does not match its checksum (corrupted)")
    if int(replica(arrays["step"])) != meta["step"]:
        raise Damaged(f"checkpoint {path}: state step disagrees with its metadata")

    if not same_layout:
        arrays = convert_layout(meta, engine, template, arrays)
    fresh = {}
    if fresh_rows:
        memory = jax.device_put(engine.model.init_memory(rows_new), rows_sh)
        fresh = {f"memory/{k}": x for k, x in named_arrays(memory).items()}
    out = {}
    for name, t in target.items():
        x = arrays[name]
        if _per_device(name) and n_old != n_new:
            x = redistribute_err_buf(x, n_old, n_new, cfg.sync.mean, t.sharding)
        elif _rows_of(name) and fresh_rows:
            x = fresh[name]  # see the policy above
        out[name] = x
    leaves, treedef = jax.tree_util.tree_flatten(template)
    state = jax.tree_util.tree_unflatten(treedef, [out[name] for name in target])
    assert len(leaves) == len(target)
    return Restored(state, meta["step"], path, fresh_rows, warnings)


def _ignore_closed_loop_callbacks() -> None:
    """When a read fails, TensorStore completes the reads still in flight and calls back into
    Orbax's event loop, which is closed by then, possibly before the error reaches us; each
    callback would print a traceback over the one-line error. Those (and only those) are
    dropped, from before the read on."""
    hook = sys.unraisablehook
    if getattr(hook, "nljax_filter", False):
        return

    def filtered(u):
        if not (isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)):
            hook(u)

    filtered.nljax_filter = True
    sys.unraisablehook = filtered


def _unretrieved_read_errors(record: logging.LogRecord) -> bool:
    """Drops asyncio's 'exception was never retrieved' reports of the other reads or writes of a
    failed restore or save (logged when they are garbage-collected, often at exit); the error
    was reported."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None or "exception was never retrieved" not in str(record.msg):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    text = str(exc)
    return not (any(w in text for w in ("tensorstore", "OCDBT", "os_error_code"))
                or any("orbax" in f.filename for f in frames))


def redistribute_err_buf(e: jax.Array, n_old: int, n_new: int, mean: bool, sharding: NamedSharding) -> jax.Array:
    """Error buffers [n_old, N] -> [n_new, N] so that the next reduction is unchanged.

    When the level fires, the engine reduces Σ_d (g_d + e_d) over devices, divided by the device
    count n under `sync.mean`. With S = Σ_d e_d saved from n_old devices, giving each of the
    n_new devices e' = S / n_old keeps the mean: (1/n_new) Σ_d' (g'_d' + e') = mean(g) + S / n_old,
    the uninterrupted run's value. Under sums, e' = S / n_new keeps Σ_d' e' = S.
    """
    divisor = n_old if mean else n_new

    @jax.jit
    def spread(e):
        total = jnp.sum(e, axis=0, keepdims=True) / divisor  # [1, N]
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(total, (n_new, e.shape[1])), sharding)

    return spread(e)


def convert_layout(meta: dict, engine: Engine, template: TrainState,
                   arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Parameters and optimizer state saved in another layout (another `sync.strategy`, or a
    sharded layout padded for another mesh), converted to this run's.

    `arrays` holds the saved layout, named as `named_arrays` names it, on the new mesh (arrays
    whose shape differs from this run's are read replicated). They are put back into the
    structure of the saved strategy's state (an engine built from the saved config on this mesh
    gives it; padding lengths do not matter, the conversion drops padding by size), taken to the
    strategy-independent layout and from there to this run's:
    `engine.strategy.import_state(saved_engine.strategy.export_state(saved_state))`. Error
    buffers, memory and the step are returned as saved (the caller redistributes them)."""
    try:
        saved_cfg = from_dict(meta["config"])
    except ConfigError as e:
        raise ConfigError(f"checkpoint's config cannot be read by this nljax: {e}") from None
    saved_cfg = dataclasses.replace(saved_cfg, mesh=engine.cfg.mesh)
    saved_eng = Engine.create(saved_cfg, engine.model, engine.mesh)
    params, opt_state = saved_eng.strategy.layout_shapes()
    here = template
    saved_template = TrainState(here.step, params, opt_state, here.err_buf, here.memory)
    names = list(named_arrays(saved_template))
    missing = [n for n in names if n not in arrays]
    if missing or len(names) != len(arrays):
        raise ConfigError(
            f"checkpoint does not fit this run: its arrays do not form a sync.strategy={saved_cfg.sync.strategy} "
            f"state (e.g. '{(missing or sorted(set(arrays) - set(names)))[0]}')"
        )
    treedef = jax.tree_util.tree_structure(saved_template)
    saved = jax.tree_util.tree_unflatten(treedef, [arrays[n] for n in names])
    canonical = saved_eng.strategy.export_state(saved)
    # This run's own (fresh) error buffers and memory ride along: import_state places them by
    # rows, which the saved ones may not divide into; the caller takes those from `arrays`.
    converted = engine.strategy.import_state(canonical.replace(err_buf=here.err_buf, memory=here.memory))
    out = {n: x for n, x in arrays.items() if not n.startswith(("params/", "opt_state/"))}
    out.update({n: x for n, x in named_arrays(converted).items() if n.startswith(("params/", "opt_state/"))})
    return out


# ---------------------------------------------------------------------------------------------
# Save, and the trainer's view


def _os_error(e: BaseException) -> str:
    """'OSError: [Errno 28] No space left on device' for an error that TensorStore or Python
    reports with an operating-system error code, else the error's first line."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"OSError: [Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        m = re.search(r"os_error_code='?(\d+)", str(seen))
        if m:
            code = int(m[1])
            return f"OSError: [Errno {code}] {os.strerror(code)}"
        seen = seen.__cause__ or seen.__context__
    return _error_line(e)


def _quiet_failed_saves() -> None:
    """When a save fails (e.g. the disk is full), Orbax's writer threads log the error with a
    traceback, and TensorStore's writes still in flight call back into a closed event loop (a
    traceback each): `Checkpoints` reports the error in one line instead."""
    _ignore_closed_loop_callbacks()
    logging.getLogger("asyncio").addFilter(_unretrieved_read_errors)
    log = logging.getLogger("absl")
    if not any(f is _orbax_thread_errors for f in log.filters):
        log.addFilter(_orbax_thread_errors)


def _orbax_thread_errors(record: logging.LogRecord) -> bool:
    """Drops Orbax's error reports that carry a traceback: the exception itself reaches
    `Checkpoints`, which reports it."""
    return not (record.exc_info and "orbax" in record.pathname)


def writer(cfg: Config):
    """An Orbax CheckpointManager writing to `checkpoint.dir` (asynchronous unless
    checkpoint.async_save=false, keeping the newest `checkpoint.keep`)."""
    _quiet_failed_saves()
    return _manager(checkpoint_dir(cfg), write=True, cfg=cfg)


def save(manager, engine: Engine, step: int, state: TrainState) -> None:
    """Save `state` after `step` optimizer steps. Returns once the arrays are copied off the
    devices (the next step may donate `state`); the files are written in the background."""
    import orbax.checkpoint as ocp

    arrays = named_arrays(state)
    meta = metadata(engine, step, arrays)
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(_nest(arrays)), META: ocp.args.JsonSave(meta)})
    manager.save(step, args=args, force=True)


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    n, out = 0, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}.{n}")
    return out


class Checkpoints:
    """A run's checkpoints: resolves and restores a resume (reading only), then, once `open`ed,
    saves every `checkpoint.every` steps and at the end.

    In the loop: `ckpt = Checkpoints(engine, run.init_state())` (the state and step to start from
    are `ckpt.state`, `ckpt.start`), then create the run directory, `ckpt.open()`,
    `ckpt.first_batch(step, batch)` and `ckpt.maybe_save(step + 1, state)` around each step,
    `ckpt.finish(steps_done, state)`."""

    def __init__(self, engine: Engine, fresh: TrainState, say=print):
        """`fresh`: this run's state at step 0, where a run starts when it resumes nothing, and
        the layout a restored state is read into."""
        self.cfg, self.engine = engine.cfg, engine
        self.dir = checkpoint_dir(self.cfg)
        self.manager = None
        self.last_saved: int | None = None
        self.writing: int | None = None  # the step of the save in flight
        self.restored: Restored | None = None
        self.set_aside: list[Path] = []  # step directories moved to <dir>/set_aside/ by `open`
        paths = candidates(self.cfg)
        path = paths[0] if paths else None
        # Resuming this run (its own checkpoint.dir) continues its files; a checkpoint from
        # elsewhere starts a new run from that state, which may not take over existing files.
        self.own = path is not None and self.dir.resolve() in path.resolve().parents
        if path is not None and not self.own and _leftovers(self.dir) and not self.cfg.run.overwrite:
            raise ConfigError(
                f"checkpoint.dir {self.dir} already holds another run's checkpoints; choose another run.dir or "
                "checkpoint.dir, or set run.overwrite=true to replace them"
            )
        if path is not None:
            self.restored, skipped = restore_first_valid(engine, fresh, paths)
            path = self.restored.path
            warnings = [f"checkpoint {p} is damaged, resuming from an older one "
                        f"({why.removeprefix(f'checkpoint {p}: ')})" for p, why in skipped]
            self.last_saved = self.restored.step
            if self.restored.step > self.cfg.train.steps:
                raise ConfigError(
                    f"checkpoint {path} is at step {self.restored.step}, past train.steps={self.cfg.train.steps}"
                )
            if self.own and self.cfg.checkpoint.every:
                # This run saves the steps after the one resumed: the later checkpoints (damaged
                # ones included) are moved out of its way, never deleted.
                self.set_aside = sorted((p for p in _leftovers(self.dir)
                                         if p.name.isdigit() and int(p.name) > self.restored.step),
                                        key=lambda p: int(p.name))
                if self.set_aside:
                    warnings.append(
                        f"checkpoint.dir {self.dir} holds later checkpoints than the one resumed ({path}): step"
                        f"{'s' if len(self.set_aside) > 1 else ''} {', '.join(p.name for p in self.set_aside)} "
                        f"will be moved to {self.dir / SET_ASIDE}"
                    )
            for w in [*warnings, *self.restored.warnings]:
                if jax.process_index() == 0:
                    print(f"nljax: warning: {w}", file=sys.stderr)
        elif self.cfg.checkpoint.every and _leftovers(self.dir) and not self.cfg.run.overwrite:
            raise ConfigError(
                f"checkpoint.dir {self.dir} already holds checkpoints; resume with --resume, or set "
                "run.overwrite=true to replace them"
            )
        if self.cfg.checkpoint.every:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"checkpoint.dir {self.dir} cannot be created: {e.strerror or e}") from None
        self.state = self.restored.state if self.restored else fresh
        self.start = self.restored.step if self.restored else 0
        if self.restored:
            say(f"resumed from {path} at step {self.start}")

    @property
    def resume_step(self) -> int | None:
        """The step this run continues its own files from (None: a fresh run, or a new run
        started from another run's checkpoint)."""
        return self.restored.step if self.restored and self.own else None

    def open(self) -> None:
        """Start writing (after the run directory was accepted). A fresh run with
        run.overwrite=true removes the earlier run's checkpoints here."""
        fresh = self.restored is None or not self.own
        if fresh and self.cfg.run.overwrite and jax.process_index() == 0:
            for p in _leftovers(self.dir):
                shutil.rmtree(p)
        if self.set_aside and jax.process_index() == 0:
            for p in self.set_aside:
                dest = _free_name(self.dir / SET_ASIDE / p.name)
                dest.parent.mkdir(exist_ok=True)
                p.rename(dest)
        if not self.cfg.checkpoint.every:
            return
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("nljax checkpoint dir ready")
        self.manager = writer(self.cfg)

    def first_batch(self, step: int, batch: dict) -> dict:
        """The batch of `step`, with every row reset when this is the first step after a resume
        that restarted every row's memory."""
        if self.restored is not None and self.restored.fresh_rows and step == self.start:
            return reset_all_rows(batch)  # after a change of the global batch, see `restore`
        return batch

    def save(self, step: int, state: TrainState) -> None:
        # The previous save is finished first (Orbax would wait for it too) so that a failure is
        # reported with the step it belongs to.
        self._wait()
        # The saves before this one that are complete count against checkpoint.keep; this one,
        # still being written, does not: until it is committed one more stays on disk.
        prune(self.dir, self.cfg.checkpoint.keep)
        self.writing = step
        try:
            save(self.manager, self.engine, step, state)
        except Exception as e:  # noqa: BLE001 - the blocking part of a save (e.g. the disk is full)
            raise self._failed(e) from None
        self.last_saved = step

    def save_now(self, step: int, state: TrainState) -> None:
        """Save unless `step` was just saved (the final step, or a preemption, at a checkpoint step)."""
        if self.manager is not None and self.last_saved != step:
            self.save(step, state)

    def _wait(self) -> None:
        if self.manager is not None and self.writing is not None:
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001 - whatever the background writer raised
                raise self._failed(e) from None
            self.writing = None

    def _failed(self, e: BaseException) -> ConfigError:
        """The one line for a save that failed: the step directory, the OSError, and what is left.
        The checkpoint being written stays a partial save (`<step>.orbax-checkpoint-tmp-*`), which
        a resume never reads; the complete ones before it are untouched."""
        step, self.writing = self.writing, None
        kept = sorted(int(p.name) for p in self.dir.iterdir() if _is_nljax_step(p)) if self.dir.is_dir() else []
        left = f"the newest complete checkpoint is {self.dir / str(kept[-1])}" if kept else "no complete checkpoint"
        return ConfigError(f"checkpoint {self.dir / str(step)} could not be saved ({_os_error(e)}); {left}")

    def maybe_save(self, step: int, state: TrainState) -> None:
        """`step` = optimizer steps done (the state's step)."""
        if self.manager is not None and step % self.cfg.checkpoint.every == 0:
            self.save(step, state)

    def finish(self, step: int, state: TrainState) -> None:
        """Save the final state (unless just saved) and wait until every save is on disk."""
        if self.manager is None:
            return
        self.save_now(step, state)
        self.close()
        prune(self.dir, self.cfg.checkpoint.keep)

    def close(self) -> None:
        """Wait until the saves in flight are on disk (a run stopped by an error keeps them)."""
        if self.manager is not None:
            try:
                self._wait()
            finally:
                manager, self.manager = self.manager, None
                with contextlib.suppress(Exception):  # a failed save was reported (`_failed`)
                    manager.close()
