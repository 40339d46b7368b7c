"""Whether a run may write where it is pointed: a run.dir or checkpoint.dir that holds an earlier
run is refused (unless `run.overwrite=true`, or the run continues it with `--resume`).

Read from the directories alone (names, Orbax's step metadata files, the size of metrics.jsonl),
so that the trainer refuses before the slow start-up: building the model, initializing the
parameters and the optimizer state, compiling. `Checkpoints.resolve` checks again once the
checkpoint to resume is read, with the same lines.
"""

from __future__ import annotations

from pathlib import Path

from nljax.checkpoint import storage
from nljax.config import Config
from nljax.data.outdir import is_prepared
from nljax.errors import ConfigError
from nljax.runtime.exportdir import is_export
from nljax.runtime.rundir import checkpoint_dir, holds_a_run


def refuse_anothers(cfg: Config, continues: bool) -> None:
    """Refuses (one line) a new run whose run.dir is what another command wrote: an export
    (nljax.export) or prepared data (nljax.prepare), run.overwrite=true or not (it replaces a
    run's files, never those). The run's files went in beside theirs: the export then read as
    the export alone (nljax.generate, nljax.load), and a later export or prepare into it was
    refused for the run's files. `continues`: --resume of a run already there, left as it is."""
    if continues:
        return
    run_dir = Path(cfg.run.dir)
    if is_export(run_dir):
        raise ConfigError(f"run.dir {run_dir} is an export directory (nljax.export wrote it): a run's files would "
                          "mix with it; choose another run.dir")
    if is_prepared(run_dir):
        raise ConfigError(f"run.dir {run_dir} holds prepared data (nljax.prepare wrote it): a run's files would mix "
                          "with them; choose another run.dir (to train on them: data.prepared=DIR)")
    own = checkpoint_dir(cfg).resolve()  # checkpoint.dir=run.dir: the run's own, refuse_taken's to judge
    if (holder := checkpoints_around(run_dir)) and holder != own:
        raise ConfigError(f"run.dir {run_dir} {where(run_dir, holder)} a run's checkpoints: this run's files would mix "
                          "with them (a resume of that run stops at folders it did not write); choose another run.dir")


def where(path: Path, holder: Path) -> str:
    """How `path` stands to `holder`, the folder of checkpoints `checkpoints_around` found."""
    return "holds" if path.absolute().resolve() == holder else f"is inside {holder}, which holds"


def checkpoints_around(path: Path) -> Path | None:
    """The folder of a run's checkpoints that `path` is, or that `path` would be a step folder
    of (a numeric name directly in it, which that run's resume stops at: "holds 6, which nljax did
    not write"), or None. Only there: a folder further down is no step of its, and the folders
    above are not listed (a cluster's /scratch of job ids, slow to list over NFS)."""
    path = path.absolute().resolve()
    if _holds_steps(path):
        return path
    return path.parent if path.name.isdigit() and _holds_steps(path.parent) else None


def _holds_steps(folder: Path) -> bool:
    """Whether `folder` holds a step folder nljax wrote that this user can look into; one it cannot
    (another user's private folder named by a job id) is not taken for one."""
    def step(p: Path) -> bool:
        try:
            return p.is_dir() and any((p / n).exists() for n in storage.ITEMS)
        except OSError:
            return False

    try:
        return any(p.name.isdigit() and step(p) for p in folder.iterdir())
    except OSError:  # not there, not a folder, or not readable
        return False


def refuse_taken(cfg: Config, continues: bool, logged: bool) -> None:
    """Refuses (ConfigError, one line) a run that would replace an earlier run's files: a fresh
    run whose checkpoint.dir holds checkpoints (when it saves any), a new run started from another
    run's checkpoint (`checkpoint.resume` elsewhere) into a checkpoint.dir that holds some, and
    either one in a run.dir holding a run (`logged`: its metrics.jsonl logged a step,
    `logged_a_step`, as process 0 sees it). `continues`: the run resumes its own checkpoints
    (`--resume`), whose files it goes on with."""
    if continues:
        return
    root = checkpoint_dir(cfg)
    theirs = other_runs(cfg, root)
    if cfg.run.overwrite and theirs is not None and storage.leftovers(root):
        # run.overwrite replaces this run's files: never another run directory's checkpoints
        raise ConfigError(f"checkpoint.dir {root} holds the checkpoints of the run in {theirs}: run.overwrite=true "
                          f"replaces this run's files, not another run's; choose another checkpoint.dir (to start "
                          f"that run over: run.dir={theirs} run.overwrite=true)")
    if cfg.run.overwrite:
        return
    started_elsewhere = bool(cfg.checkpoint.resume)  # a new run from another run's checkpoint
    in_the_way = bool(storage.leftovers(root)) and (started_elsewhere or cfg.checkpoint.every > 0)
    if not (in_the_way or logged):
        return
    steps = storage.committed_steps(root)
    resumable = bool(steps) and not started_elsewhere  # --resume would continue that run
    if in_the_way and not inside_run_dir(cfg):  # a checkpoint.dir the user chose: named as such
        if started_elsewhere:
            raise ConfigError(
                f"checkpoint.dir {root} already holds another run's checkpoints; choose another run.dir or "
                "checkpoint.dir, or set run.overwrite=true to replace them"
            )
        upto = f" (up to step {steps[-1]})" if steps else ""
        # another run directory's checkpoints/: that run is continued from its own run.dir (a
        # --resume from this one is refused, nljax.run.resuming), and never overwritten from here
        resume = (f"continue that run with --resume{f' run.dir={theirs}' if theirs else ''}, " if resumable else "")
        overwrite = "" if theirs else ", or set run.overwrite=true to replace them"
        raise ConfigError(f"checkpoint.dir {root} already holds checkpoints{upto}: {resume}choose another "
                          f"checkpoint.dir{overwrite}")
    raise ConfigError(holds_a_run(cfg.run.dir, _held(cfg, steps), resumable))


def other_runs(cfg: Config, root: Path) -> Path | None:
    """The run directory whose `checkpoints/` folder `root` (this run's checkpoint.dir) is, where
    that is not this run's run.dir (a run wrote it: its nljax_written.txt); else None."""
    holder = root.parent
    if root.name != "checkpoints" or not (holder / "nljax_written.txt").is_file():
        return None
    return None if holder.absolute().resolve() == Path(cfg.run.dir).absolute().resolve() else holder


def inside_run_dir(cfg: Config) -> bool:
    """Whether checkpoint.dir is the run's own, `<run.dir>/checkpoints` (the default): a refusal
    then speaks of the run dir, the one setting the user chose."""
    return checkpoint_dir(cfg).resolve() == (Path(cfg.run.dir) / "checkpoints").absolute().resolve()


def _held(cfg: Config, steps: list[int]) -> str:
    """What the earlier run left in its run.dir, as a refusal names it (`steps`: the complete
    checkpoints in checkpoint.dir)."""
    if inside_run_dir(cfg) and steps:
        return f"checkpoints up to step {steps[-1]}"
    if inside_run_dir(cfg) and storage.leftovers(checkpoint_dir(cfg)):  # partial saves, step directories
        return "an incomplete checkpoint"  # missing an item: nothing to resume
    return "metrics.jsonl" if steps else "metrics.jsonl, no checkpoint"  # steps: in a checkpoint.dir elsewhere
