"""The config a resumed run trains with: the run's own, not the command line's defaults.

A run directory's config.yaml (written by `nljax.train`, read by `nljax.generate` and
`nljax.export` too) records every setting the run trained with, the overrides it was started
with included. `--resume` (or `checkpoint.resume`) that continues this run's own checkpoints
starts from it; `--config FILE` and `key=value` overrides given with the resume are applied on
top, key by key. What may change on a resume (train.steps, logging, evaluation, trackers,
checkpoint cadence, the mesh and strategy, which the elastic restore converts) changes; a change
to what the checkpoint holds (`MUST_MATCH`: the model, cms, optim.name, optim.momentum) is refused
here, in one line naming the key, before anything is built.

A resume from another run's checkpoint (`checkpoint.resume=DIR` outside this run's
checkpoint.dir) starts a new run: its config is the command line's, as before.

The mesh (`mesh.*`) is the launch's, not the run's: a saved mesh that does not fit the devices
of this launch gives way to the defaults, which fit any (`fit_mesh`, once the processes have
joined and the devices are known); a mesh the command line sets is kept, and refused where it
does not fit, naming where it was set.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import jax

from nljax import config
from nljax.checkpoint.contents import HOW_COMPUTED, MUST_MATCH, differences, fmt, get
from nljax.checkpoint.storage import continues_own, step_checkpoint
from nljax.config import Config
from nljax.errors import ConfigError
from nljax.parallel.mesh import resolve_shape
from nljax.run import tasks
from nljax.runtime.rundir import checkpoint_dir

# Settings of this command, not of the run: taken from the command line, never from config.yaml
# (a run started with --quiet resumes talking unless told again; a saved overwrite is not re-applied).
THIS_COMMAND = (("run", "quiet"), ("run", "overwrite"), ("checkpoint", "resume"))


def saved_config_file(cfg: Config) -> Path | None:
    """run.dir/config.yaml when `cfg` continues this run and the run wrote one, else None."""
    path = Path(cfg.run.dir) / "config.yaml"
    if not continues_own(cfg):
        return None
    if path.exists() and not path.is_file():  # a folder in its place: not a run's config to go on from
        raise ConfigError(f"{path} is not a regular file: it cannot be the run's saved config")
    return path if path.is_file() else None


def _has_steps(root: Path) -> bool:
    """Whether `root` holds a step directory of a run (a numeric name)."""
    return root.is_dir() and any(p.name.isdigit() and p.is_dir() for p in root.iterdir())


def step_resume(cfg: Config, config_file: str | Sequence[str] | None, overrides: Sequence[str]) -> Config:
    """`resumed_config`, where `checkpoint.resume=STEP` (digits naming no path here) is this run's
    checkpoint at that step, `<checkpoint.dir>/<STEP>`, as `checkpoint=STEP` reads in
    nljax.evaluate, generate and export (a bare step was "checkpoint not found: $PWD/400"); refused
    in one line naming the run's steps when it has none there. The run's checkpoint.dir is its
    config.yaml's (read as for `latest`): the command line's alone named <run.dir>/checkpoints for a
    run whose checkpoints are elsewhere."""
    text = cfg.checkpoint.resume
    if not text.isdigit() or Path(text).exists():
        return resumed_config(cfg, config_file, overrides)
    resumed = resumed_config(resuming(cfg, "latest"), config_file, overrides)
    path = step_checkpoint(checkpoint_dir(resumed), int(text), f"checkpoint.resume={text}", cfg.run.dir)
    return resuming(resumed, str(path))


def resuming(cfg: Config, resume: str) -> Config:
    """`cfg` with checkpoint.resume=`resume` (`--resume` is "latest")."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))


def resumed_config(cfg: Config, config_file: str | Sequence[str] | None, overrides: Sequence[str]) -> Config:
    """The config to resume with: run.dir/config.yaml, then `config_file` (or several files, in
    order: `--config A --config B`), then `overrides` (the command's, flags included as
    overrides); `cfg` is the command line's own config (it names run.dir and what to resume).
    Unchanged when there is nothing of this run to resume."""
    saved_file = saved_config_file(cfg)
    if saved_file is None:
        if continues_own(cfg):  # a run.dir of no run, resuming the checkpoints of another's
            _refuse_another_runs_checkpoints(cfg, None, cfg)
        ckpts = checkpoint_dir(cfg)
        inside = Path(cfg.run.dir).resolve() in ckpts.resolve().parents  # the run's own layout: config.yaml beside
        if continues_own(cfg) and not config.as_files(config_file) and inside and _has_steps(ckpts):
            # the defaults and the overrides alone are taken for the run's settings: said, and what the
            # checkpoint holds is still checked against them (one line if they differ)
            print(f"nljax: warning: {Path(cfg.run.dir) / 'config.yaml'} is missing: resuming with the defaults and "
                  "the command line's settings (give the run's with --config)", file=sys.stderr)
        return cfg
    overrides = [*overrides, f"run.dir={cfg.run.dir}"]  # where the run is now, as `trained_config`
    # with what the data decide (model.vocab_size of a tokenizer, left at its default): as saved
    saved = config.load(str(saved_file), [f"run.dir={cfg.run.dir}"], saved=True)
    try:
        resumed = config.load(config_file, overrides, base=str(saved_file))
    except ConfigError:
        # a change the checkpoint cannot take (model.name) is the line to give, not the check of
        # the settings together that it made fail (the saved seq_len against the new model's chunk)
        check_unchanged(saved, config.load(config_file, overrides, base=str(saved_file), check=False), saved_file,
                        config_file, overrides)
        raise
    for section, key in THIS_COMMAND:
        value = getattr(getattr(cfg, section), key)
        part = dataclasses.replace(getattr(resumed, section), **{key: value})
        resumed = dataclasses.replace(resumed, **{section: part})
    try:
        resolved = tasks.resolve(resumed)
    except ConfigError as e:
        if "model.vocab_size" not in str(e):
            raise
        # the data hold more tokens than the run's model has rows for: its advice (leave
        # model.vocab_size at its default) is a fresh run's, not a resume's
        raise ConfigError(f"{e.args[0].split(';')[0]} (the run's, {saved_file}): its model has no row for the other "
                          "tokens; resume on data of the run's tokenizer") from None
    if resolved.model.vocab_size not in (resumed.model.vocab_size, saved.model.vocab_size):
        # model.vocab_size came from the data (left at its default), not from the user: the change
        # is of the tokenization, which is the line to give (as a checkpoint of another tokenizer's
        # ids is refused), not a key the user never set
        raise ConfigError(f"the run in {cfg.run.dir} was trained on {tokens_of(saved.data)} "
                          f"(model.vocab_size={saved.model.vocab_size} in {saved_file}), this run's data use "
                          f"{tokens_of(resumed.data)} ({resolved.model.vocab_size} tokens): its token ids would "
                          "stand for other text; resume on data of the run's tokenization, or start a new run in "
                          "another run.dir")
    check_unchanged(saved, resolved, saved_file, config_file, overrides)
    _refuse_another_runs_checkpoints(cfg, saved, resumed)
    return resumed


def _refuse_another_runs_checkpoints(cfg: Config, saved: Config | None, resumed: Config) -> None:
    """A resume whose checkpoint.dir, changed from the run's own, is the `checkpoints/` folder of
    another run directory (one a run wrote: it lists its files in nljax_written.txt) would
    continue this run from that run's state: it dropped this run's metrics.jsonl records from the
    other checkpoint's step on, and its saves pruned the other run's checkpoints. Refused in one
    line. Checkpoints moved to a folder of their own (`/data/ck`) still resume. `saved` None: a
    run.dir that holds no run (no config.yaml), whose resume would continue the other run's
    checkpoints from here, its records in this run.dir and its saves in that run's folder."""
    theirs = checkpoint_dir(resumed)
    ours = checkpoint_dir(saved) if saved is not None else None
    if ours is not None and theirs.resolve() == ours.resolve():
        return
    other = theirs.parent
    if theirs.name != "checkpoints" or other.resolve() == Path(cfg.run.dir).absolute().resolve():
        return
    if (other / "nljax_written.txt").is_file():
        own = f"its checkpoint.dir is {ours}" if ours is not None else "which holds no run"
        raise ConfigError(
            f"checkpoint.dir {theirs} is the checkpoints folder of another run ({other}), not of the run in "
            f"{cfg.run.dir} ({own}): continue that run with --resume run.dir={other}, or "
            f"start a new run from one of its checkpoints with checkpoint.resume={theirs}/STEP in another run.dir")


def tokens_of(d) -> str:
    """The tokenization of data settings `d` (data.source=files) in words, as its config names it."""
    if d.tokenizer:
        return f"data.tokenizer={d.tokenizer}"
    if d.prepared:
        return f"the tokenization of data.prepared={d.prepared}"
    return "byte tokens"


def check_unchanged(saved: Config, resumed: Config, saved_file: Path,
                    config_file: str | Sequence[str] | None = None, overrides: Sequence[str] = ()) -> None:
    """One line for the first key of `MUST_MATCH` (what the checkpoint holds) that the resume
    changes; keys of `HOW_COMPUTED` (remat, unrolling, the compute dtype) may change. A key one of
    the `config_file`s set (itself or through its base_config) is said to be set there; one the
    command line set is plain to see there."""
    a, b = config.to_dict(saved), config.to_dict(resumed)
    for section in MUST_MATCH:
        for k, old, new in differences(get(a, section), get(b, section), section):
            if k not in HOW_COMPUTED:
                # the last word is the line's: the key itself, or a section above it (cms={periods: [1, 8]})
                on_line = any(f"{k}.".startswith(o.split("=", 1)[0].strip() + ".") for o in overrides)
                where = None if on_line else config.set_in(config_file, k)
                given = f"{k}={fmt(new)}" + (f", set in {where}," if where else "")
                held = "optimizer state" if k.startswith("optim.") else "model"
                raise ConfigError(f"{given} cannot change on resume ({fmt(old)} in {saved_file}: the checkpoint "
                                  f"holds that {held}); leave it out, or start a new run in another run.dir")


MESH_KEYS = ("inter", "intra", "model")


def mesh_given(config_file: str | Sequence[str] | None, overrides: Sequence[str]) -> dict[str, str]:
    """The mesh keys this command line sets to other than their defaults, each with where it was
    set ("on the command line", "in --config FILE": the last of several files that changed it).
    A key set to its default changes nothing a fit could change, so it need not be told apart
    from one left out."""
    files = config.as_files(config_file)
    # each key's type only: the command line's settings alone need not hold together (a resume's
    # data.prepared=NEW without data.source=files, which its saved config holds)
    layers = [config.load(files[:i], check=False).mesh for i in range(len(files) + 1)]  # the defaults, then each file
    given = config.load(files, overrides, check=False).mesh
    out = {}
    for k in MESH_KEYS:
        if getattr(given, k) != getattr(layers[-1], k):
            out[k] = "on the command line"
        elif getattr(layers[-1], k) != getattr(layers[0], k):
            last = max(i for i in range(len(files)) if getattr(layers[i + 1], k) != getattr(layers[i], k))
            out[k] = f"in --config {files[last]}"
    return out


def _misfit(mesh, n_devices: int, n_processes: int) -> str | None:
    """Why `mesh` does not fit the devices (`resolve_shape`'s line), or None where it does."""
    try:
        resolve_shape(mesh.inter, mesh.intra, n_devices, n_processes, mesh.model)
    except ConfigError as e:
        return str(e)
    return None


def fit_mesh(cfg: Config, given: dict[str, str], n_devices: int, n_processes: int = 1) -> tuple[Config, str | None]:
    """`cfg` with a mesh that fits `n_devices` over `n_processes`, and a note when it changed.

    The mesh is the launch's: a resumed run's config.yaml records the mesh it trained on, which
    may not fit this launch (8 devices then, 1 now). Those keys that do not fit and that the
    command line did not set (`given`, from `mesh_given`: what the user chose now) take their
    defaults, which fit any device count, as a fresh run's would; the note says so. A mesh the
    command line set that does not fit is refused, one line naming where it was set."""
    mesh = cfg.mesh
    if _misfit(mesh, n_devices, n_processes) is None:
        return cfg, None
    default = type(mesh)()
    # not set now and not the default: from the run's config.yaml (a fresh run has none)
    saved = [k for k in MESH_KEYS if k not in given and getattr(mesh, k) != getattr(default, k)]
    fitted = dataclasses.replace(mesh, **{k: getattr(default, k) for k in saved})
    error = _misfit(fitted, n_devices, n_processes)
    if error is None:
        on = f"{n_devices} device{'s' if n_devices > 1 else ''}" + (
            f" ({n_processes} processes)" if n_processes > 1 else "")
        was = ", ".join(f"mesh.{k}={getattr(mesh, k)}" for k in saved)
        now = ", ".join(f"mesh.{k}={getattr(fitted, k)}" for k in saved)
        note = (f"resuming on {on}: {was} from {Path(cfg.run.dir) / 'config.yaml'} "
                f"{'does' if len(saved) == 1 else 'do'} not fit, using {now} (set mesh.* to choose)")
        return dataclasses.replace(cfg, mesh=fitted), note
    where: dict[str, list[str]] = {}
    for k in MESH_KEYS:
        if k in given:
            where.setdefault(given[k], []).append(f"mesh.{k}={getattr(mesh, k)}")
    named = "; ".join(f"{', '.join(keys)} set {source}" for source, keys in where.items())
    raise ConfigError(f"{error} ({named})" if named else error)


def launch_mesh(cfg: Config, config_file: str | Sequence[str] | None, overrides: Sequence[str]) -> Config:
    """`fit_mesh` on this launch's devices (the processes joined), its note on process 0's
    standard error."""
    cfg, note = fit_mesh(cfg, mesh_given(config_file, overrides), jax.device_count(), jax.process_count())
    if note and jax.process_index() == 0:
        print(f"nljax: {note}", file=sys.stderr)
    return cfg
