"""Restoring a checkpoint onto this run: read and check it, then convert what depends on the
device count, the global batch or the strategy (`nljax.checkpoint.elastic`): the whole state
(`restore`, a resume) or the parameters alone (`restore_params`, a use of the model and
`checkpoint.init_params`). Reads only; bad input raises ConfigError (`Damaged` for files that
cannot be read) with one line."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

from nljax.checkpoint import elastic, storage
from nljax.checkpoint.contents import (
    RESHAPED,
    SILENT,
    Damaged,
    check_arrays,
    check_built,
    check_fits,
    check_tokenizer,
    data_digest,
    data_eval_sets,
    data_tokenizer,
    differences,
    fingerprint,
    fmt,
    named_arrays,
    of_params,
    per_device,
    rows_of,
    tracker_ids,
)
from nljax.config import Config, to_dict
from nljax.data.documents import absolute
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError
from nljax.models import registry
from nljax.parallel.hostdev import replica
from nljax.parallel.mesh import MODEL, replicated
from nljax.runtime import distributed
from nljax.runtime.rundir import DATA_PATHS


# added to `check_built`'s line on resume: training on other images is a new run
RESUME_ON_OTHER_DATA = ("; a resume continues the run on its own data (a new run may start from its parameters: "
                        "checkpoint.init_params)")


@dataclasses.dataclass
class Restored:
    state: TrainState
    step: int  # optimizer steps done: the run continues at this step
    path: Path
    fresh_rows: bool  # every row's memory restarted: the first step resets every row
    warnings: list[str]
    trackers: dict[str, str] = dataclasses.field(default_factory=dict)  # the tracker run ids it saved
    data_digest: str | None = None  # of the data it was trained on (None: saved before it was recorded)
    tokenizer: dict | None = None  # what its token ids are (`data_tokenizer`; None: images, or not recorded)
    eval_sets: dict[str, str] = dataclasses.field(default_factory=dict)  # its data.eval_sets digests (`data_eval_sets`)


def restore(engine: Engine, template: TrainState, path: Path, digest: str | None = None) -> Restored:
    """Read the checkpoint at `path` onto `engine`'s mesh (which may differ from the one that
    saved it) with the shardings of `template` (a fresh state of this run, `Run.init_state`),
    check it, and convert what depends on the device count, the global batch or the strategy.
    Reads only; raises ConfigError with one line on bad input. `digest`: this run's data digest;
    where it is the checkpoint's, the data paths spelled otherwise (relative, absolute, from
    another directory) are the same data."""
    cfg = engine.cfg
    meta = storage.read_meta(path)
    target = named_arrays(template)
    # what the data built (a DiT's image shape, class names): a resume goes on training the run
    # it continues, on its data; before the parameters' shapes, which another channel count changes
    check_built(path, meta, registry.record(engine.model, cfg.model.name), RESUME_ON_OTHER_DATA)
    check_fits(path, meta, engine)
    same_data = digest is not None and data_digest(meta) == digest
    rows_warning: list[str] = []
    fresh_rows = _rows_restart(meta, cfg, target, rows_warning, same_data, digest)
    # a batch size that restarts the rows is said by that warning; otherwise by its own
    warnings = (_changed_settings(meta, cfg, same_data, ("train.batch_size",) if fresh_rows else ()) + rows_warning
                + _changed_forms(meta, cfg, registry.forms_of(engine.model)))

    arrays, meta, saved = _read(engine, path, meta, target)
    if saved is not None:
        arrays = elastic.convert_layout(meta, engine, template, arrays, saved)
    out = elastic.to_this_run(arrays, target, engine, int(meta["mesh"]["devices"]), fresh_rows, saved)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    assert len(leaves) == len(target)
    state = jax.tree_util.tree_unflatten(treedef, [out[name] for name in target])
    return Restored(state, meta["step"], path, fresh_rows, warnings, tracker_ids(meta), data_digest(meta),
                    data_tokenizer(meta), data_eval_sets(meta))


@dataclasses.dataclass
class RestoredParams:
    params: Any  # the model's parameters in the run's layout (`Strategy.state_layout`'s)
    step: int  # optimizer steps the checkpoint had taken
    path: Path
    tokenizer: dict | None = None  # what its token ids are (`data_tokenizer`)


def restore_params(engine: Engine, path: Path, tokenizer: dict | None = None, built: dict | None = None,
                   average: bool = False) -> RestoredParams:
    """The parameters alone of the checkpoint at `path`, on `engine`'s mesh in its layout: what
    `restore` gives as `state.params`, bit for bit, without reading or making anything else. Only
    the `params/...` arrays and the step are read (the optimizer state, error buffers and memory
    stay on disk), into shapes that allocate nothing (`Strategy.state_layout`), and only they are
    converted where the checkpoint's layout differs (`elastic.convert_params`): the devices hold
    the parameters once, or twice during a conversion, never the training state. The checks are
    `restore`'s (the model fits, the metadata is sealed, the arrays read match their checksums);
    `Damaged` and one-line ConfigErrors alike. `tokenizer`: what a loading run's token ids are
    now, checked first (another tokenizer's size would be said as a model.vocab_size misfit).
    `built`: what the run's data now build the model for (`registry.record`: a DiT's image size,
    which no parameter's shape shows), checked against the checkpoint's (`check_built`); None:
    not checked (checkpoint.init_params may fine-tune on images of another size). `average`: the
    parameters' moving average instead where the checkpoint holds one (optim.ema_decay, kept with
    the optimizer state: then that state is read too, and converted as a resume converts it)."""
    meta = storage.read_meta(path)
    check_tokenizer(path, data_tokenizer(meta), tokenizer, "the run's data now use")
    if built is not None:  # before the parameters' shapes: images of another channel count change one
        check_built(path, meta, built)
    check_fits(path, meta, engine)
    average = average and bool(engine.cfg.optim.ema_decay)  # the checkpoint's too: check_fits matched them
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(engine.mesh))
    params, opt_state = engine.strategy.state_layout()
    layout = TrainState(step, params, opt_state if average else (), (), {})
    target = named_arrays(layout)
    reads = lambda n: n == "step" or of_params(n) or (average and n.startswith("opt_state/"))
    meta = {**meta, "arrays": {n: a for n, a in meta["arrays"].items() if reads(n)}}
    arrays, meta, saved = _read(engine, path, meta, target, partial=True)
    if saved is not None:
        arrays = (elastic.convert_layout(meta, engine, layout, arrays, saved) if average
                  else elastic.convert_params(engine, arrays, saved))
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(layout), [arrays[n] for n in target])
    params = engine.strategy.average_params(restored.params, restored.opt_state) if average else restored.params
    return RestoredParams(params, meta["step"], path, data_tokenizer(meta))


def _read(engine: Engine, path: Path, meta: dict, target: dict[str, Any], partial: bool = False):
    """The arrays `meta` lists, read with `target`'s shardings (`elastic.read_shardings`) and
    checked against their checksums, reshaped where a parameter changed shape (`_reshaped`); the
    metadata saying so; and an engine laid out as the checkpoint is where that is not this run's
    layout (None: every array was read into place). `partial`: `meta` lists some of the stored
    arrays, the others are not read."""
    abstract = elastic.read_shardings(meta, target, engine.mesh)
    arrays, sums = storage.read_arrays(path, abstract, partial)
    check_arrays(path, meta, sums, int(replica(arrays["step"])))

    arrays, meta = _reshaped(arrays, target, meta, engine)
    by_rows = lambda name: per_device(name) or rows_of(name)  # one row per device or stream row
    if int(meta["mesh"].get(MODEL, 1)) != engine.tp or not engine.strategy.same_layout(
            meta.get("strategy", "replicated"), meta["arrays"], target, by_rows):
        return arrays, meta, elastic.saved_engine(meta, engine)
    return arrays, meta, None


def _reshaped(arrays: dict[str, jax.Array], target: dict[str, jax.Array], meta: dict, engine: Engine):
    """Arrays of a parameter whose shape changed but not its values (`RESHAPED`: a checkpoint
    saved before the qkv kernels took their head axis), the parameter itself or an optimizer
    moment of it, reshaped to the parameter's shape today, and the metadata saying so."""
    shapes = {k: tuple(v[0]) for k, v in fingerprint(engine.model).items()}
    out, listed = dict(arrays), copy.deepcopy(meta["arrays"])
    for name, x in arrays.items():
        keys = [k for k in shapes if RESHAPED.search(name) and (name == k or name.endswith("/" + k))]
        if not keys:
            continue
        shape = shapes[max(keys, key=len)]
        if x.shape == shape or x.size != math.prod(shape):
            continue
        t = target.get(name)
        out[name] = jax.device_put(x.reshape(shape), t.sharding) if t is not None and t.shape == shape else x.reshape(shape)
        listed[name]["shape"] = list(shape)
    return out, {**meta, "arrays": listed}


def _changed(meta: dict, cfg: Config, same_data: bool = False) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's) for each setting that differs, the data paths
    compared absolute: a resume from run.dir/config.yaml (which records them absolute) reads the
    same files as the checkpoint's config, which keeps them as written. `same_data`: the data's
    content digest is the checkpoint's, so the data paths are not compared (a relative path
    resolves against the directory a command starts in, which may be another one)."""
    out = differences(_absolute_paths(meta["config"]), _absolute_paths(to_dict(cfg)), "")
    paths = {f"{section}.{key}" for section, key in DATA_PATHS}
    return [d for d in out if not (same_data and d[0] in paths)]


def _absolute_paths(tree: dict) -> dict:
    tree = copy.deepcopy(tree)
    for section, key in DATA_PATHS:
        node = tree.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value:
            node[key] = absolute(value)
        elif isinstance(value, list):
            node[key] = [absolute(p) if isinstance(p, str) else p for p in value]
    return tree


def _changed_settings(meta: dict, cfg: Config, same_data: bool = False, said=()) -> list[str]:
    """A warning for each setting that differs from the checkpoint's and may change the result,
    naming the checkpoint's step: the one restored, which may be older than the newest (a damaged
    one skipped). train.steps, the documented way to train on, changes the result only through a
    decaying schedule, which then decays to the new end: said so; with a constant one, nothing.
    `said`: keys another warning names."""
    which = f"the checkpoint at step {meta['step']}" if "step" in meta else "the checkpoint"
    out = []
    for k, a, b in _changed(meta, cfg, same_data):
        if _under(k, SILENT) or k in said or k == "train.steps" and cfg.optim.schedule == "constant":
            continue
        if a is None and b == _default(k):
            # a key added since the checkpoint was written, at its default: what the code did then
            # (a key whose default changes that is read as the old value, `config.ADDED`)
            continue
        why = f": the {cfg.optim.schedule} learning-rate schedule now decays to step {b}" if k == "train.steps" else ""
        out.append(f"resuming with {k}={fmt(b)} ({which} was written with {fmt(a)}){why}")
    return out


def _default(key: str) -> Any:
    """The default of the dotted config `key` (None where there is none)."""
    node: Any = to_dict(Config())
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _changed_forms(meta: dict, cfg: Config, forms: dict | None) -> list[str]:
    """One warning naming the forms the model computes with (`registry.forms_of`: nl_lm's
    attention, inner loop, ...) that differ from those the checkpoint was written with under the
    same settings: `auto` takes the parallel form of the inner loop on a GPU and the scan on a CPU, so a
    run moved between them computes the same sums in another order, as a changed setting would
    (`_changed_settings` names those). A checkpoint saved before its forms were recorded: none."""
    saved, section = meta.get("forms") or {}, (meta["config"].get("model") or {}).get(cfg.model.name) or {}
    here = getattr(cfg.model, cfg.model.name, None)
    which = f"the checkpoint at step {meta['step']}" if "step" in meta else "the checkpoint"
    moved = []  # (setting, this run's form, the checkpoint's)
    for k, now in (forms or {}).items():
        if not hasattr(here, k):  # a form that is no setting of the model's section: nothing to name
            continue
        setting = getattr(here, k)
        if k in saved and saved[k] != now and section.get(k) == setting:
            moved.append((f"model.{cfg.model.name}.{k}={fmt(setting)}", fmt(now), fmt(saved[k])))
    if not moved:
        return []
    said = lambda i: _and([m[i] for m in moved])  # one line for all (a GPU's checkpoint on a CPU moves three)
    return [f"resuming with {said(0)} computed as {said(1)} on this {jax.default_backend()} ({which} was computed "
            f"as {said(2)}): float rounding differs"]


def _and(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _under(key: str, sections) -> bool:
    """Whether the dotted config `key` is one of `sections` or inside one."""
    return any(key == s or key.startswith(s + ".") for s in sections)


# What places a row in the data: the ContextStream reads row r at step s from (seed, s, r, seq_len)
# over the data. A change to any of them sends every row elsewhere (data.reset_prob only resets;
# data.eval_sets is scored, never read by a row).
STREAM_KEYS = ("train.batch_size", "train.seq_len", "seed", "data")
NOT_STREAM_KEYS = ("data.reset_prob", "data.eval_sets")


def _rows_restart(meta: dict, cfg: Config, target: dict, warnings: list[str], same_data: bool = False,
                  digest: str | None = None) -> bool:
    """Whether every row's memory restarts: a setting that places the rows in the data changed
    (the global batch, the window, the seed, the data), or the data's content under the same
    settings (`digest`, this run's, against the checkpoint's: files edited or appended to move
    every row's offset), so the ContextStream gives every row a new stream and a carried memory
    would read text it never wrote (with a warning in `warnings`)."""
    moved = [f"{k} changed from {fmt(a)} to {fmt(b)}" for k, a, b in _changed(meta, cfg, same_data)
             if _under(k, STREAM_KEYS) and k not in NOT_STREAM_KEYS]
    saved = data_digest(meta)
    if not moved and digest is not None and saved is not None and saved != digest:
        moved = ["the data's content changed (its digest differs from the checkpoint's)"]
    fresh_rows = bool(moved) and any(rows_of(n) for n in target)
    if fresh_rows:
        warnings.append(
            f"{'; '.join(moved)}: the ContextStream gives every row a new stream, so every row's memory restarts "
            f"from its initial value at step {meta['step']}"
        )
    return fresh_rows


def restore_first_valid(engine: Engine, template: TrainState, paths: list[Path],
                        digest: str | None = None) -> tuple[Restored, list[tuple[Path, str]]]:
    """`restore` of the first of `paths` that is not damaged, and the damaged ones skipped (path,
    reason): `first_valid`."""
    return first_valid(lambda path: restore(engine, template, path, digest), paths)


T = TypeVar("T")


def first_valid(read: Callable[[Path], T], paths: list[Path],
                relist: Callable[[], list[Path]] | None = None) -> tuple[T, list[tuple[Path, str]]]:
    """`read` (`restore`, `restore_params`) of the first of `paths` that is not damaged, and the
    damaged ones skipped (path, reason). A checkpoint that does not fit this run stops the search
    (an older one would not fit either); so does the last one's damage, with its own line.
    `relist`: `paths` listed again, for a directory another run may prune as it is read (a tool
    beside a live run, whose checkpoint.keep removes its older checkpoints as it saves): a
    checkpoint gone once its read failed was pruned, not damaged, and the search starts again
    from the newest (at most `RELISTS` times)."""
    for _ in range(RELISTS):
        skipped: list[tuple[Path, str]] = []  # a damaged one listed again is skipped again
        for i, path in enumerate(paths):
            try:
                return read(path), skipped
            except ConfigError as e:  # a pruned one is "damaged", or no step directory any more
                if relist is not None and distributed.main_decides(not path.exists()):
                    break
                if not isinstance(e, Damaged):
                    raise
                if i == len(paths) - 1:
                    if skipped:
                        raise Damaged(f"every checkpoint in {path.parent} is damaged; the oldest: {e}") from None
                    raise
                skipped.append((path, str(e)))
        else:
            raise AssertionError("no paths")  # candidates() never returns an empty list to resume from
        paths = relist()
    raise ConfigError(f"the checkpoints in {paths[0].parent} were removed {RELISTS} times as they were read (a live "
                      "run pruning them to its checkpoint.keep): give one it keeps (checkpoint=STEP), or read once "
                      "it ends")


RELISTS = 5
