"""Checkpoints on disk: Orbax managers, saving and reading the two items of a step directory,
and finding, pruning and moving nljax's step directories under `checkpoint.dir`.

A step directory nljax committed is `<step>` holding Orbax's step metadata and nljax's item;
Orbax writes it as `<step>.orbax-checkpoint-tmp-<n>` and renames it once complete. Nothing else a
user keeps in `checkpoint.dir` (a folder `7`, notes) is ever read, refused or removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import jax

from nljax.checkpoint.contents import (
    DETAIL,
    META,
    STATE,
    Damaged,
    empty_array,
    is_empty,
    check_well_formed,
    checksums,
    metadata,
    named_arrays,
    nest,
    unnest,
)
from nljax.checkpoint.peers import Peers, PeerSaveFailed
from nljax.checkpoint.quiet import errors_hidden, metadata_errors_hidden, warnings_hidden
from nljax.config import Config, migrate
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError, first_line
from nljax.runtime import distributed
from nljax.runtime.exportdir import is_export, not_a_checkpoint
from nljax.runtime.rundir import checkpoint_dir

ORBAX_META = "_CHECKPOINT_METADATA"  # Orbax's step metadata, in every step directory it committed
ITEMS = (META, STATE, ORBAX_META)  # what a committed step directory holds
SET_ASIDE = "set_aside"  # <checkpoint.dir>/set_aside/<step>: checkpoints moved out of a resumed run's way


def manager(root: Path, write: bool = False, cfg: Config | None = None, peers: Peers | None = None):
    """An Orbax CheckpointManager on `root`: read-only, or writing as `cfg.checkpoint` says, its
    barriers `peers`' (a multi-process run: a failure on one process ends them, see `peers`)."""
    import orbax.checkpoint as ocp

    if not write:
        with warnings_hidden(), metadata_errors_hidden():  # a read-only manager warns that it is one
            return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    opts = ocp.CheckpointManagerOptions(
        # Orbax would prune any folder with a number for a name, a user's too: nljax prunes its
        # own steps itself (`prune`)
        max_to_keep=None,
        # Always Orbax's background writer; checkpoint.async_save=false waits for it after each save
        # (`Checkpoints.save`): its barriers are the ones a failure can end (`peers`).
        enable_async_checkpointing=True,
        cleanup_tmp_directories=True,  # partial saves of a killed run; never a complete step
        create=True,
        async_options=ocp.AsyncOptions(barrier_sync_fn=peers.barrier) if peers else None,
    )
    with metadata_errors_hidden():  # a damaged step is nljax's to report (`damage`)
        return ocp.CheckpointManager(root, options=opts)


def writer(cfg: Config, peers: Peers | None = None):
    """An Orbax CheckpointManager writing to `checkpoint.dir` in the background."""
    return manager(checkpoint_dir(cfg), write=True, cfg=cfg, peers=peers)


def save(mngr, engine: Engine, step: int, state: TrainState, trackers: dict[str, str] | None = None,
         data_digest: str | None = None, tokenizer: dict | None = None, eval_sets: dict[str, str] | None = None
         ) -> None:
    """Save `state` after `step` optimizer steps, with the run's `trackers` ids, the digest of
    its data, what its token ids are (`tokenizer`) and the digest of each data.eval_sets set
    (`eval_sets`, by name). Returns once the
    arrays are copied off the devices (the next step may donate `state`); the files are written
    in the background."""
    import orbax.checkpoint as ocp

    arrays = named_arrays(state)
    meta = metadata(engine, step, arrays, trackers, data_digest, tokenizer, eval_sets)
    stored = {k: x for k, x in arrays.items() if not is_empty(x)}
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(nest(stored)), META: ocp.args.JsonSave(meta)})
    mngr.save(step, args=args, force=True)


def _cut(e: BaseException) -> str:
    """The first line of `e` without the TensorStore spec Orbax appends (a repr that spans dozens
    of lines)."""
    return re.sub(r"\.?\s*See full TensorStore details:.*", "", first_line(e))


def error_line(e: BaseException) -> str:
    """'<type>: <first line>' of whatever Orbax or TensorStore raised, without the TensorStore
    spec Orbax appends, and the first line of its cause."""
    line = _cut(e)
    cause = e.__cause__  # the error Orbax wrapped (`raise ... from`), not one merely caught before
    if cause is not None and _cut(cause) and _cut(cause) != line:
        line += f" ({type(cause).__name__}: {_cut(cause)})"
    return f"{type(e).__name__}: {line}"[:300]


DETAIL_CHARS = 120  # of the reader's own words in a damaged checkpoint's line


def damage(path: Path, kind: str, e: BaseException) -> str:
    """The line for the step directory `path` found damaged: its `kind` ("array data unreadable"),
    then after `contents.DETAIL` the reader's own words, cut to DETAIL_CHARS: the innermost error
    Orbax wrapped (the outer one says only "Encountered error while reading array index: (slice(0,
    16, 1), ..."). Orbax's whole error, traceback included, goes to the `nljax.checkpoint` logger
    at DEBUG (a warning embedded 300 characters of it once)."""
    logging.getLogger("nljax.checkpoint").debug("checkpoint %s: %s", path, kind, exc_info=e)
    inner = e
    while inner.__cause__ is not None:  # `raise ... from`: the error that was wrapped
        inner = inner.__cause__
    said = _cut(inner) or _cut(e)
    detail = f"{type(inner).__name__}: {said}" if said else type(inner).__name__
    if len(detail) > DETAIL_CHARS:
        detail = detail[:DETAIL_CHARS - 3].rstrip() + "..."
    return f"checkpoint {path}: {kind}{DETAIL}{detail}"


def os_error(e: BaseException) -> str:
    """'OSError: [Errno 28] No space left on device' for an error that TensorStore or Python
    reports with an operating-system error code, else the error's first line."""
    if isinstance(e, PeerSaveFailed):
        return str(e)  # 'process <i>: <its cause>', as that process described it
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"OSError: [Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        m = re.search(r"os_error_code='?(\d+)", str(seen))
        if m:
            code = int(m[1])
            return f"OSError: [Errno {code}] {os.strerror(code)}"
        seen = seen.__cause__ or seen.__context__
    return error_line(e)


# ---------------------------------------------------------------------------------------------
# Reading one step directory


def read_meta(path: Path) -> dict:
    """The `nljax` item of the step directory `path`, checked to be well formed, its config's
    keys where this nljax has them (`config.migrate`: a checkpoint from before a key moved).

    Every process reads it for itself; in a multi-process run they then agree (`_agreed`), so
    that none goes on with a checkpoint another could not read."""
    import orbax.checkpoint as ocp

    if not path.is_dir() or not path.name.isdigit():
        raise ConfigError(f"{path} is not a checkpoint step directory")
    error = meta = None
    try:
        # The item's handler, not a manager: a manager's restore ends at a barrier of every
        # process, which one that failed here would never reach.
        meta = ocp.JsonCheckpointHandler().restore(path / META)
    except Exception as e:  # noqa: BLE001 - whatever Orbax raises, the user sees one line
        error = damage(path, "metadata unreadable", e)
    if error is None:
        error = _orbax_meta_error(path)
    _agreed(error)
    meta = check_well_formed(path, meta)
    return {**meta, "config": migrate(meta["config"])}


def _orbax_meta_error(path: Path) -> str | None:
    """A line when Orbax's own step metadata is not JSON: Orbax logs an error for it at every later
    save and listing, so the step is damaged like one whose arrays are (a resume falls back past
    it and sets it aside)."""
    try:
        json.loads((path / ORBAX_META).read_text())
    except (OSError, ValueError) as e:
        return f"checkpoint {path}: Orbax's {ORBAX_META} is unreadable ({type(e).__name__})"
    return None


def read_arrays(path: Path, abstract: dict[str, jax.ShapeDtypeStruct],
                partial: bool = False) -> tuple[dict[str, jax.Array], dict[str, int]]:
    """The arrays of the step directory `path`, each read as its `abstract` entry says (shape,
    dtype, sharding), and their checksums; `Damaged` if they cannot be read. `partial`: `abstract`
    names some of the stored arrays (the parameters, `restore.restore_params`); the others are
    not read at all (Orbax's partial restore), and each named one must be there.

    Each process reads its own shards; in a multi-process run they agree (`_agreed`) before the
    checksums, a computation over every process's shards."""
    import orbax.checkpoint as ocp

    error = arrays = None
    made = {k: empty_array(x) for k, x in abstract.items() if is_empty(x)}
    abstract = {k: x for k, x in abstract.items() if k not in made}
    # The error is raised once the scope has settled: the exception Orbax raised, kept as the
    # context of one raised inside, would keep the failed reads' futures alive past it.
    with errors_hidden() as noise:
        try:
            # The item's handler, not a manager: see `read_meta`.
            if partial:
                # The handler StandardCheckpointHandler wraps, which can leave arrays out
                handler = ocp.PyTreeCheckpointHandler()
                item = nest(abstract)
                args = ocp.args.PyTreeRestore(item, ocp.checkpoint_utils.construct_restore_args(item),
                                              partial_restore=True)
            else:
                handler = ocp.StandardCheckpointHandler()
                args = ocp.args.StandardRestore(nest(abstract))
            arrays = unnest(handler.restore(path / STATE, args=args))
            handler.close()
            # a partial restore hands back the abstract entry of an array it did not find
            read = {k for k, x in arrays.items() if isinstance(x, jax.Array)}
            if read != set(abstract) or set(arrays) != set(abstract):
                raise ValueError(f"arrays {sorted(set(abstract) ^ read)[:3]} missing or unexpected")
        except Exception as e:  # noqa: BLE001 - a truncated or damaged file, whatever the reader raises
            noise.fail()
            error = damage(path, "array data unreadable", e)
        if error is not None:
            noise.settle()
    _agreed(error)
    arrays = {**arrays, **made}
    return arrays, checksums(arrays)


def _agreed(error: str | None) -> None:
    """Raises `Damaged` when this process or any other found the checkpoint damaged (`error`,
    its line): one process going on with a checkpoint another found damaged would wait in a
    collective for it forever. Every process calls it at the same point."""
    agreed = distributed.first_failure(error)
    if agreed is not None:
        raise Damaged(agreed)


# ---------------------------------------------------------------------------------------------
# Finding, pruning and moving step directories


def is_nljax_step(p: Path) -> bool:
    """A step directory nljax committed: a numeric name, Orbax's step metadata and nljax's item.
    Only these are resumed from or pruned; a user's folder `checkpoints/7` is neither. One whose
    contents cannot be looked at (permissions) counts as one: a resume finds it damaged and falls
    back to an older one."""
    try:
        return p.name.isdigit() and (p / META / "metadata").is_file() and (p / ORBAX_META).is_file()
    except OSError:
        return p.name.isdigit() and p.is_dir()


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete nljax checkpoint under `root` (partial saves and folders nljax did
    not write excluded)."""
    if not root.is_dir():
        return []
    tries = 1
    while True:
        ours = {int(p.name) for p in root.iterdir() if is_nljax_step(p)}
        try:
            # the manager is opened on every process whatever this host sees: opening it syncs processes
            return sorted(ours & set(manager(root).all_steps()))
        except FileNotFoundError:
            # a step removed as Orbax listed it: a live run beside a tool pruning to its
            # checkpoint.keep (a run's own directory changes only under its lock). Listed again,
            # on one process only: with several, each opening is a collective they all take.
            if tries == LISTINGS or jax.process_count() > 1:
                raise
            tries += 1


LISTINGS = 5  # a checkpoints directory listed while a live run prunes it: tries


def committed_steps(root: Path) -> list[int]:
    """The complete steps this host sees under `root`, without opening a manager."""
    return sorted(int(p.name) for p in root.iterdir() if is_nljax_step(p)) if root.is_dir() else []


def step_checkpoint(root: Path, step: int, said: str, run_dir) -> Path:
    """`<root>/<step>`, a run's checkpoint named by its step number (one that is damaged or
    incomplete too: its restore says what is wrong with it); refused in one line listing the
    steps the run has, `said` naming the setting, when there is none."""
    path = root / str(step)
    if path.is_dir():
        return path
    steps = committed_steps(root)
    have = ", ".join(map(str, steps if len(steps) <= 8 else [*steps[:3], "...", *steps[-3:]]))
    there = f"its checkpoints are at step{'s' if len(steps) > 1 else ''} {have}" if steps else f"{root} holds none"
    raise ConfigError(f"{said}: {run_dir} has no checkpoint at step {step} ({there})")


def prune(root: Path, keep: int, keep_every: int = 0) -> None:
    """Remove all but the newest `keep` complete nljax checkpoints under `root` (process 0), and
    those whose step is a multiple of `keep_every` (> 0), which stay for good.
    Every process calls it: listing the steps opens an Orbax manager, which syncs processes."""
    steps = complete_steps(root)
    if jax.process_index() != 0:
        return
    for step in steps[:-keep]:
        if keep_every and step % keep_every == 0:
            continue
        try:
            shutil.rmtree(root / str(step))
        except OSError as e:  # permissions, a busy file on NFS: the run goes on, said each time (the disk fills)
            print(f"nljax: warning: could not remove old checkpoint {root / str(step)} (checkpoint.keep={keep}): "
                  f"{e.strerror or e}", file=sys.stderr)


def leftovers(root: Path) -> list[Path]:
    """nljax's step directories and partial saves under `root`."""
    if not root.is_dir():
        return []
    # `<step>` holding an nljax item, its state or Orbax's step metadata (one of them lost: still
    # ours, and in the way of the step's next save), and `<step>.orbax-checkpoint-tmp-<n>` (a save
    # cut short); nothing else a user keeps there is ever refused or removed.
    return [p for p in root.iterdir()
            if p.is_dir() and ((p.name.isdigit() and _holds_an_item(p))
                               or re.fullmatch(r"\d+\.orbax-checkpoint-tmp(-\d+)?", p.name))]


def _holds_an_item(p: Path) -> bool:
    """Whether the step directory `p` holds one of nljax's items (one that cannot be looked into:
    taken for nljax's, see `is_nljax_step`)."""
    try:
        return any((p / n).exists() for n in ITEMS)
    except OSError:
        return True


def foreign_steps(root: Path, after: int, last: int) -> list[Path]:
    """Files and folders under `root` named as a step in (`after`, `last`] that nljax did not write
    (a user's folder `checkpoints/4`): a save at that step would replace it or stop there."""
    if not root.is_dir():
        return []
    ours = set(leftovers(root))
    return sorted((p for p in root.iterdir() if p.name.isdigit() and after < int(p.name) <= last and p not in ours),
                  key=lambda p: int(p.name))


def incomplete(steps: list[Path]) -> list[tuple[Path, str]]:
    """Those of nljax's step directories `steps` that are not complete checkpoints, and what each
    lacks (a resume or a tool that passed over them says why)."""
    def lacks(p: Path) -> str:
        missing = [n for n in ITEMS if not (p / n).exists()]
        return f"it has no {' and no '.join(missing)}" if missing else f"its {META} item is incomplete"
    return [(p, lacks(p)) for p in steps if not is_nljax_step(p)]


def later_steps(root: Path, step: int) -> list[Path]:
    """nljax's step directories under `root` after `step` (damaged ones included), oldest first."""
    return sorted((p for p in leftovers(root) if p.name.isdigit() and int(p.name) > step), key=lambda p: int(p.name))


def set_aside(root: Path, paths: list[Path]) -> None:
    """Move `paths` to `<root>/set_aside/`, never over an earlier one of the same name."""
    for p in paths:
        dest = _free_name(root / SET_ASIDE / p.name)
        dest.parent.mkdir(exist_ok=True)
        p.rename(dest)


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    n, out = 0, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}.{n}")
    return out


def continues_own(cfg: Config) -> bool:
    """Whether `cfg` resumes this run's own checkpoints (`latest`, or a path inside its
    checkpoint.dir), as opposed to starting a new run from another run's."""
    resume = cfg.checkpoint.resume
    if not resume:
        return False
    if resume == "latest":
        return True
    root, target = checkpoint_dir(cfg).resolve(), Path(resume).absolute().resolve()
    return target == root or root in target.parents


def resume_root(cfg: Config) -> Path | None:
    """What `checkpoint.resume` names (a step directory or a checkpoints directory; `latest`:
    checkpoint.dir), refused in one line when it does not exist; None for a fresh run."""
    resume = cfg.checkpoint.resume
    if not resume:
        return None
    root = checkpoint_dir(cfg) if resume == "latest" else Path(resume).absolute()
    if not root.exists() and resume == "auto":  # a job script's start-or-resume is a flag, not this key's value
        raise ConfigError(f"checkpoint.resume=auto: checkpoint not found: {root}; to start the run or continue it "
                          "(a job script's restart), give --resume=auto")
    if not root.exists():
        raise ConfigError(f"checkpoint not found: {root}")
    if not root.is_dir():  # read on, "no complete checkpoint in FILE"
        raise ConfigError(f"checkpoint.resume={resume} is a file, not a checkpoint: give latest, a step directory "
                          "or a folder of checkpoints")
    return root


def candidates(cfg: Config) -> list[Path]:
    """The step directories a resume may use, best first: the one `checkpoint.resume` names, or
    for `latest` (or a checkpoint directory) its complete checkpoints, newest first (an older one
    is used when the newer ones are damaged). Empty for a fresh run."""
    root = resume_root(cfg)
    if root is None:
        return []
    if (root / META).is_dir() or (root / STATE).is_dir():
        return [root]  # a step directory
    steps = complete_steps(root)
    if not steps and cfg.checkpoint.resume != "latest":
        if line := not_a_checkpoint_line(f"checkpoint.resume={cfg.checkpoint.resume}", root):
            raise ConfigError(line)
    if not steps:
        raise ConfigError(f"no complete checkpoint in {root}")
    return [root / str(s) for s in reversed(steps)]


def not_a_checkpoint_line(given: str, root: Path) -> str | None:
    """The line refusing the directory `root`, given as `given` (`checkpoint.resume=DIR`, a tool's
    `checkpoint=DIR`) where a checkpoint is read, when it holds none but is an export or a run
    directory ("no complete checkpoint in DIR" misled: checkpoint.init_params takes a run
    directory); None otherwise."""
    if (root / META).is_dir() or (root / STATE).is_dir() or complete_steps(root):
        return None
    if is_export(root):  # as init_params says it
        return not_a_checkpoint(given, root)
    if (root / "config.yaml").is_file():
        return (f"{given} is a run directory, not a checkpoint: give the folder of its checkpoints "
                f"({runs_checkpoints(root)}: its newest) or one step of them")
    return None


def runs_checkpoints(run_dir: Path) -> Path:
    """Where the run in `run_dir` saves its checkpoints: its config.yaml's checkpoint.dir (by
    default `run_dir/checkpoints`)."""
    from nljax import config

    try:  # saved: a config.yaml written before a key moved
        return checkpoint_dir(config.load(str(run_dir / "config.yaml"), [f"run.dir={run_dir}"], saved=True))
    except ConfigError:  # a config.yaml this nljax cannot read: the default place
        return run_dir / "checkpoints"
