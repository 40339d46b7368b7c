"""A trained run, loaded for use (`nljax.generate`, `nljax.export`): the newest intact checkpoint
of a run directory (or the one named) restored onto this process's devices, with the model's
whole parameter tree replicated on them whatever strategy and mesh trained it.

The run's own `config.yaml` (written by `nljax.train`) says what the model is; the restore is the
elastic one of `--resume` (`nljax.checkpoint.restore`) onto a 1 x n mesh under the `replicated`
strategy, one row per device, of the parameters alone (`restore_params`: the optimizer state,
error buffers and memory are neither read nor made). Reads only.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import os

from nljax import config
from nljax.checkpoint import storage
from nljax.checkpoint.contents import Damaged, check_tokenizer, data_tokenizer, fmt, get, passed_over
from nljax.checkpoint.restore import first_valid, restore_params
from nljax.data import tokenization
from nljax.data.prepared import tokenization_of
from nljax.errors import ConfigError
from nljax.models import meanflow, registry
from nljax.models.builtin import for_this_backend
from nljax.run import startup
from nljax.run.core import Run
from nljax.runtime.exportdir import is_export
from nljax.runtime.rundir import DATA_PATHS, checkpoint_dir

# config keys outside any section (`seed`): a tool passes them on as overrides, like dotted ones

# `params=`: which of a run's parameters a tool reads. Under optim.ema_decay the run keeps two
# sets: the optimizer's own (`trained`) and their moving average (`average`, the default there, as
# the run's own evaluation reads it); without it, one (`trained`, the default)
PARAMS = ("average", "trained")


@dataclasses.dataclass(frozen=True, eq=False)
class Trained:
    cfg: config.Config  # the run's config as this tool runs it (1 x n mesh, one row per device)
    trained_cfg: config.Config  # the run's config as it trained (with the tool's config overrides)
    run: Run  # on a 1 x n mesh, replicated strategy
    # the model's parameter tree (under optim.ema_decay its moving average unless params=trained),
    # replicated over run.mesh
    params: Any
    step: int  # optimizer steps the checkpoint had taken
    path: Path  # the step directory read
    skipped: tuple = ()  # (path, why) of the newer checkpoints that were damaged
    incomplete: tuple = ()  # (path, what it lacks) of newer step directories that are not whole checkpoints
    # lines on overrides that make this use differ from the run's own: another sampler, another
    # held-out split (`_sampler_against_the_run`, `_split_against_the_run`)
    unlike_the_run: tuple = ()
    average: bool = False  # params are the moving average (`params=`, `reads_average`)

    @property
    def params_read(self) -> str:
        """`params=`'s name for the parameters read, as results and exports record it."""
        return "average" if self.average else "trained"

    @property
    def which(self) -> str:
        """Which parameters were read, for a tool's line about the checkpoint: empty where the run
        keeps one set."""
        if not self.trained_cfg.optim.ema_decay:
            return ""
        return (f", the parameters' moving average (optim.ema_decay={self.trained_cfg.optim.ema_decay:g})"
                if self.average else ", the trained parameters (params=trained: not their moving average)")

    def warnings(self, tool: str) -> list[str]:
        return [*(f"{tool}: warning: checkpoint {p} is incomplete, using an older one ({why})"
                  for p, why in self.incomplete),
                *(f"{tool}: warning: {passed_over(p, why, 'using')}" for p, why in self.skipped),
                *(f"{tool}: warning: {line}" for line in self.unlike_the_run)]

    @property
    def model(self):
        return self.run.engine.model


def config_of(run_dir: str | Path, checkpoint: str | int = "latest", overrides: Sequence[str] = (),
              n: int = 1, evaluates: bool = False) -> config.Config:
    """The run's config as `load` uses it on n devices (read before anything is restored, so a
    tool can check its settings against the model first). `evaluates`: the run's rows
    (train.batch_size, which n must divide) and evaluation settings are kept, as its own
    evaluation read the held-out data (`nljax.evaluate`); else one row per device."""
    placed = placed_settings(overrides, n, evaluates, "the checkpoint", " (checkpoint= chooses which one)")
    checkpoint = checkpoint_path(run_dir, checkpoint, overrides)
    cfg = trained_config(run_dir, [*overrides, f"checkpoint.resume={checkpoint}", *placed])
    return used_here(cfg, overrides, evaluates)


def placed_settings(overrides: Sequence[str], n: int, evaluates: bool, what: str, which: str = "") -> list[str]:
    """The settings that read the parameters onto n devices of this process, replicated (one row
    per device unless `evaluates`: `config_of`), once `overrides` are checked not to set them
    (`what` holds the parameters, `which` says how they are chosen: for the line)."""
    rows = [] if evaluates else [f"train.batch_size={n}"]
    placed = ["mesh.inter=1", f"mesh.intra={n}", "mesh.model=1", *rows, "train.accum_steps=1", "sync.strategy=replicated"]
    given = {o.partition("=")[0].strip() for o in overrides}
    # the keys set here win over the command line's: given there, they were ignored in silence
    forced = {"checkpoint.resume", *(p.partition("=")[0] for p in placed)}
    # and the sections that hold them, given whole (mesh={model: 2}): merged in, as silently lost
    if clash := sorted(given & (forced | {k.partition(".")[0] for k in forced})):
        raise ConfigError(f"{', '.join(k + '=' for k in clash)} cannot be overridden here: {what} is read onto "
                          f"this process's devices, replicated{which}")
    return placed


def used_here(cfg: config.Config, overrides: Sequence[str], evaluates: bool, built: dict | None = None
               ) -> config.Config:
    """`cfg` (the run's, placed) as this machine computes it: the forms that run here, an image
    folder of some of the run's classes labelled as the run's (`built`: what the run recorded of its
    data; None: its newest checkpoint's record), no streaming evaluation unless `evaluates`."""
    # a run trained with GPU-only forms (cuDNN attention, the Pallas kernels) read on a CPU: the
    # forms that run here, unless the tool's overrides name them
    cfg = for_this_backend(cfg, keep={o.partition("=")[0].strip() for o in overrides})
    if registry.task_of(cfg) == "images":  # a folder of some of the run's classes: labelled as the run's
        cfg = _in_the_runs_classes(cfg, built)
    if evaluates:
        return cfg
    # used, not evaluated: the held-out text need not fit a streaming evaluation over n rows (set
    # after the load, whose checks a recall run, evaluated by streaming only, would fail)
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, stream_steps=0))


def checkpoint_path(run_dir: str | Path, checkpoint: str | int, overrides: Sequence[str] = ()) -> str:
    """`checkpoint` as `checkpoint.resume` takes it. A step number (an int, or a string of digits
    that names no existing path) is the run's checkpoint at that step, `<checkpoint.dir>/<step>`:
    `checkpoint=400` reads alike in nljax.generate, nljax.export, nljax.load and lm_eval's
    --model_args. "latest" and paths (a step directory, a checkpoints directory) are kept as given."""
    text = str(checkpoint)
    if not text.strip():  # checkpoint.resume="" is a fresh start: no checkpoint to read (an assertion's traceback)
        raise ConfigError("checkpoint= is empty: give latest (the default), a step number or a step directory")
    if text != "latest" and not text.isdigit():
        _check_names_a_checkpoint(text)
    if not text.isdigit() or (isinstance(checkpoint, str) and Path(text).exists()):
        return text
    root = checkpoint_dir(trained_config(run_dir, overrides))
    return str(storage.step_checkpoint(root, int(text), f"checkpoint={text}", run_dir))


def _check_names_a_checkpoint(text: str) -> None:
    """A `checkpoint=` path that is missing or a file, refused with what the key takes (read
    further on, `abc` was "checkpoint not found: $PWD/abc" and a file "no complete checkpoint in
    FILE", neither saying a word was taken for a path)."""
    path = Path(text).absolute()
    if path.is_dir():
        # a run's or an export's directory: said as such, named as given here (not checkpoint.resume=)
        if line := storage.not_a_checkpoint_line(f"checkpoint={text}", path):
            raise ConfigError(line)
        return
    said = "is a file" if path.exists() else f"is not latest, a step number or an existing path ({path} not found)"
    raise ConfigError(f"checkpoint={text} {said}: give latest (the default), a step number, a step directory "
                      "or a folder of checkpoints")


def trained_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> config.Config:
    """The run's config.yaml with `overrides` (run.dir where it is now)."""
    run_dir = os.path.expanduser(run_dir)  # `run.dir=~/runs/x`, which the shell leaves as typed
    cfg_file = Path(run_dir) / "config.yaml"
    if cfg_file.exists() and not cfg_file.is_file():  # a folder, a FIFO: not what nljax.train wrote
        raise ConfigError(f"{cfg_file} is not a regular file: run.dir must be a run directory written by nljax.train")
    if not cfg_file.is_file():
        if is_export(Path(run_dir)):  # nljax.export's out= given for its run.dir: "config.yaml not found" misled
            raise ConfigError(f"{run_dir} is an export directory (nljax.export wrote it), not a run directory: give "
                              "the run's directory")
        raise ConfigError(f"{cfg_file} not found: run.dir must be a run directory written by nljax.train")
    # saved: a config.yaml written before a key moved is read with it in its new place
    return config.load(str(cfg_file), [*overrides, f"run.dir={run_dir}"], saved=True)


def reads_average(params: str, cfg: config.Config | None, cfg_file: Path | None = None) -> bool:
    """Whether `params=` (empty: the default) reads the parameters' moving average of a run whose
    config is `cfg` (`PARAMS`); one line for a value it does not take, or for `average` where the
    run keeps none. `cfg` None: the value alone is checked."""
    if params not in ("", *PARAMS):
        raise ConfigError(f"params={params}: give average (the parameters' moving average, optim.ema_decay) or "
                          "trained (the optimizer's own)")
    if cfg is None:
        return params != "trained"
    if params == "average" and not cfg.optim.ema_decay:
        raise ConfigError(f"params=average: the run keeps no moving average of its parameters (optim.ema_decay=0 in "
                          f"{cfg_file}): leave params= out, or give params=trained")
    return params != "trained" and bool(cfg.optim.ema_decay)


def load(run_dir: str | Path, checkpoint: str | int = "latest", overrides: Sequence[str] = (), devices=None,
         evaluates: bool = False, announce: Callable[[], None] | None = None, params: str = "",
         reads_data: bool | None = None) -> Trained:
    """The run in `run_dir` at its newest intact checkpoint (`checkpoint`: "latest", a step
    number, a step directory or a checkpoints directory: `checkpoint_path`), on `devices`
    (default: all of this process's). `evaluates`: as `config_of`'s, and a text model's data
    are read (to be evaluated on); otherwise only its tokenizer's file is. `announce`: called
    once the settings are checked against the run, before the slow part (building the model,
    reading its data and checkpoint: seconds), so that a refusal of the settings stays one line.
    `params`: "average", "trained" or "" (the default: the average where the run keeps one; `PARAMS`).
    `reads_data`: whether the run's data are read (None: where it `evaluates`); an image model
    not reading them is built from what its checkpoint recorded of them (`recorded_model`)."""
    devices = list(devices or jax.local_devices())
    cfg = config_of(run_dir, checkpoint, overrides, len(devices), evaluates)
    reads = evaluates if reads_data is None else reads_data
    cfg_file = Path(run_dir) / "config.yaml"
    saved, trained_cfg = trained_config(run_dir), trained_config(run_dir, overrides)
    average = reads_average(params, trained_cfg, cfg_file)
    sampler = _sampler_against_the_run(saved, trained_cfg, cfg_file)  # refused before anything is read
    if announce is not None:
        announce()
    try:
        model = None if reads or registry.task_of(cfg) != "images" else recorded_model(cfg)
        # budgeted for the parameters alone (and the optimizer state that holds their average)
        run = Run.create(cfg, devices, model, trains=False, reads_data=reads, average=average)
        # what the run's token ids are now: without its data (`tasks.LoadedText`) the first read of
        # data.tokenizer's or data.prepared's files, whose relative paths the line below explains
        identity = startup.tokenizer_identity(run.task)
    except ConfigError as e:
        if reads:
            _tokens_against_the_checkpoint(cfg)
        # only the paths config.yaml holds: one given on the command line is relative to here, not
        # to where the run started (`data.eval=held/*.txt` matching nothing was blamed on config.yaml)
        value = lambda c, sec, key: getattr(getattr(c, sec), key)
        relative = [f"{sec}.{key}" for sec, key in DATA_PATHS if _unresolved_relative(value(saved, sec, key))
                    and value(saved, sec, key) == value(cfg, sec, key)]
        if not relative:
            raise
        # a config.yaml written before the paths were recorded absolute (nljax.runtime.rundir.recorded)
        raise ConfigError(f"{e} ({', '.join(relative)} in {cfg_file} is relative to the directory the run was "
                          "started in: run from there, or give it absolute)") from None
    # the parameters alone (a model whose training state needs many devices loads on one), read
    # only if the run's tokenizer now (data.tokenizer's file, data.prepared's) is the one it trained
    # on, and its data build the model it trained (a DiT: images of its size)
    built = registry.record(run.engine.model, cfg.model.name)
    paths = storage.candidates(cfg)
    # the newest again where a live run pruned the one chosen as it was read (not a step named)
    relist = None if paths == [storage.resume_root(cfg)] else (lambda: storage.candidates(cfg))
    restored, skipped = first_valid(lambda path: restore_params(run.engine, path, identity, built, average=average),
                                    paths, relist)
    chosen = restored.path != Path(cfg.checkpoint.resume).absolute()  # among a directory's: say what was passed over
    incomplete = storage.incomplete(storage.later_steps(restored.path.parent, restored.step)) if chosen else []
    unlike = [*sampler, *_split_against_the_run(saved, trained_cfg, run.task, cfg_file)]
    return Trained(cfg, trained_cfg, run, restored.params, restored.step, restored.path, tuple(skipped),
                   tuple(incomplete), tuple(unlike), average)


def _tokens_against_the_checkpoint(cfg: config.Config) -> None:
    """The checkpoint's line (`check_tokenizer`) where the data failed to read because they use
    other token ids than it was trained on: data.tokenizer= a larger vocabulary was said as
    "model.vocab_size=N is smaller than the M tokens ...; leave it at 256", a way out that leads
    nowhere. Nothing where that cannot be told (the tokenizer unreadable, every checkpoint
    damaged): the data's own line stands."""
    try:
        here = tokenization.identity(tokenization_of(cfg.data).info())
        # the first checkpoint not damaged, as restore_params' search takes it
        (path, saved), _ = first_valid(lambda p: (p, data_tokenizer(storage.read_meta(p))), storage.candidates(cfg))
    except ConfigError:
        return
    check_tokenizer(path, saved, here, "the run's data now use")


def recorded_model(cfg: config.Config):
    """The model of an image run as its newest readable checkpoint recorded what the data decided
    (`registry.rebuild`: a DiT's image shape, labels and their names, as an export does), its
    images not read: they may have moved since (its export and nljax.load said only
    "images.path not found"). None where no checkpoint recorded it: built from the data."""
    built = _recorded(cfg)
    return registry.rebuild(cfg, built) if built else None


def _recorded(cfg: config.Config) -> dict | None:
    """What the newest readable checkpoint recorded of the data (`registry.record`), or None."""
    for path in storage.candidates(cfg):
        try:
            return storage.read_meta(path).get("built")
        except Damaged:  # the restore passes over it too (`first_valid`), and says so
            continue
    return None


def _in_the_runs_classes(cfg: config.Config, built: dict | None = None) -> config.Config:
    """A folder holding some of the run's classes (a test set without one of them), labelled as
    the run labelled them: `images.classes` set to the class names its checkpoint recorded (or
    `built`, an export's record). Its labels were its own subfolders' places (sorted), refused as
    another class count. Any other folder is left to the checks of the checkpoint's record
    (`check_built`)."""
    c = cfg.images
    if c.source != "file" or c.classes or not os.path.isdir(c.path):
        return cfg
    try:
        mine = {p.name for p in Path(c.path).iterdir() if p.is_dir() and not p.name.startswith(".")}
    except OSError:  # said when the images are read
        return cfg
    built = (_recorded(cfg) if built is None else built) or {}
    theirs = built.get("images", {}).get("classes") if isinstance(built.get("images"), dict) else None
    if not (isinstance(theirs, list) and mine and mine < set(theirs)):
        return cfg
    return dataclasses.replace(cfg, images=dataclasses.replace(c, classes=tuple(theirs)))


def _sampler_against_the_run(saved: config.Config, cfg: config.Config, cfg_file: Path) -> list[str]:
    """An image model's meanflow.loss overridden (the sampler and the held-out error follow it):
    a warning line, or refused where the other sampler reads what the net never learned
    (`meanflow.sampled_as`)."""
    if registry.task_of(saved) != "images":
        return []
    line = meanflow.sampled_as(saved.meanflow.loss, cfg.meanflow.loss, str(cfg_file))
    return [line] if line else []


def _split_against_the_run(saved: config.Config, cfg: config.Config, task, cfg_file: Path) -> list[str]:
    """A warning for each key that decides which examples the task holds out (its `held_out_by`:
    the split's fraction, a toy set's size) given another value than the run's: the held-out
    examples (nljax.evaluate's scores, nljax.generate's labels and reference images) are then not
    those the run was scored on. A task that reads no data (a text model loaded to sample) has
    none."""
    a, b = config.to_dict(saved), config.to_dict(cfg)
    return [f"{key}={fmt(get(b, key))} holds out other examples than the run's ({fmt(get(a, key))} in {cfg_file}): "
            "the held-out data are not those the run was scored on"
            for key, split in getattr(task, "held_out_by", dict)().items() if split(get(a, key)) != split(get(b, key))]


def _unresolved_relative(value) -> bool:
    """Whether a data path (or list of them) is relative and names nothing from this directory."""
    paths = value if isinstance(value, (list, tuple)) else [value] if value else []
    expanded = [Path(os.path.expanduser(p)) for p in paths]
    return any(not q.is_absolute() and not glob.glob(str(q)) for q in expanded)


def split_args(pairs: Sequence[str], known: dict[str, Callable[[str], Any]]) -> tuple[dict, list[str], str]:
    """A tool's `key=value` arguments as (its own settings, cast by `known`; the config overrides
    for the run; the run directory `run.dir` names, which is required)."""
    values, overrides = {}, []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {pair!r}")
        if key not in known:
            config.check_setting(key, known)
            overrides.append(pair)
            continue
        try:
            values[key] = known[key](value)
        except ConfigError:  # a check of the tool's own, with its line
            raise
        except ValueError:
            kind = {"int": "an integer", "float": "a number"}.get(known[key].__name__, f"a {known[key].__name__}")
            raise ConfigError(f"{key}={value!r} is not {kind}") from None
    run_dirs = [o.partition("=")[2] for o in overrides if o.startswith("run.dir=")]
    if not run_dirs:
        raise ConfigError("run.dir=DIR is required: the run directory nljax.train wrote")
    if not run_dirs[-1].strip():  # read as the working directory: "config.yaml not found" named no setting
        raise ConfigError("run.dir= is empty: give the run directory nljax.train wrote")
    return values, overrides, os.path.expanduser(run_dirs[-1])  # `~/runs/x`: export's out= lies under it
