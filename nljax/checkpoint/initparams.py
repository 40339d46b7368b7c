"""`checkpoint.init_params`: a new run that starts from another checkpoint's parameters only.

What MaxText calls `load_parameters_path` (as opposed to `load_full_state_path`, which is
`checkpoint.resume=PATH` here): the run starts at step 0 with this run's fresh optimizer state,
error buffers and inner-loop memory, its own learning-rate schedule from the start, and its own
data and PRNG keys from step 0; only the parameters come from the checkpoint. Fine-tuning a
10,000-step checkpoint for 1,000 steps is `checkpoint.init_params=PATH train.steps=1000`.

PATH is a step directory, a checkpoints directory or a run directory (its checkpoint.dir, read
from its config.yaml); for the last two the newest complete checkpoint, older ones where the
newer are damaged (with a warning), as `--resume` and `nljax.load` choose. The model must be the
checkpoint's (`model.*` but what only changes how the step computes, and the number of CMS
levels, which shapes the model); the optimizer (`optim.name`), the other `cms.*` settings, the
mesh, device count and `sync.strategy` may differ. A run that continues its own checkpoints
(`--resume`) ignores the key: its config.yaml records it, and its own checkpoints win.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nljax import config
from nljax.checkpoint import storage
from nljax.checkpoint.contents import META, STATE, fmt, get, passed_over
from nljax.checkpoint.restore import RestoredParams, first_valid, restore_params
from nljax.config import Config
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError
from nljax.runtime.exportdir import is_export, not_a_checkpoint
from nljax.runtime.rundir import checkpoint_dir

KEY = "checkpoint.init_params"


def source(cfg: Config) -> Path | None:
    """What checkpoint.init_params names, refused in one line when it does not exist or comes
    with a checkpoint.resume of another run's checkpoint (two states to start from); None when
    unset, or when the run continues its own checkpoints (`--resume`: the run's own state wins,
    and its path need not exist any more). Reads the directory names only."""
    given = cfg.checkpoint.init_params
    if not given or storage.continues_own(cfg):
        return None
    if cfg.checkpoint.resume:
        raise ConfigError(
            f"{KEY}={given} and checkpoint.resume={cfg.checkpoint.resume} both name a checkpoint to start from: "
            "give one (init_params: its parameters only, from step 0; resume: its whole state, at its step)"
        )
    root = Path(given).expanduser().absolute()
    if not root.exists():
        raise ConfigError(f"{KEY}: checkpoint not found: {root}")
    if not root.is_dir():  # read on, "no complete checkpoint in FILE"
        raise ConfigError(f"{KEY}={given} is a file, not a checkpoint: give a run directory, a step directory or "
                          "a folder of checkpoints")
    if is_export(root):  # read on, "no complete checkpoint in exp"
        raise ConfigError(f"{not_a_checkpoint(f'{KEY}={given}', root)}, or its run directory")
    return root


def candidates(root: Path) -> list[Path]:
    """The step directories `root` names, best first: itself (a step directory), or the complete
    checkpoints of a checkpoints directory or of a run directory's checkpoint.dir, newest first."""
    if (root / META).is_dir() or (root / STATE).is_dir():
        return [root]
    where = root
    if not storage.complete_steps(root) and (root / "config.yaml").is_file():  # a run directory
        # saved: a config.yaml written before a key moved; run.dir where the run is now
        where = checkpoint_dir(config.load(str(root / "config.yaml"), [f"run.dir={root}"], saved=True))
    steps = storage.complete_steps(where)
    if not steps:
        raise ConfigError(f"{KEY}: no complete checkpoint in {where}")
    return [where / str(s) for s in reversed(steps)]


@dataclasses.dataclass
class Started:
    state: TrainState  # this run's state at step 0, the checkpoint's parameters in it
    path: Path  # the step directory read
    step: int  # the steps it had trained
    warnings: list[str]  # the newer checkpoints passed over (damaged)
    tokenizer: dict | None = None  # what its token ids are (`contents.data_tokenizer`)


def start_from(engine: Engine, fresh: TrainState, root: Path) -> Started:
    """`fresh` (this run's state at step 0) with the parameters of the checkpoint `root` names,
    falling back past damaged ones in a directory. One-line ConfigError on bad input."""
    paths = candidates(root)  # the newest again where a live run pruned the one read (not a step named)
    restored, skipped = first_valid(lambda path: params_of(engine, path), paths,
                                    None if paths == [root] else (lambda: candidates(root)))
    passed = [passed_over(p, why, "using") for p, why in skipped]
    state = fresh.replace(params=restored.params)
    if engine.cfg.optim.ema_decay:  # the moving average starts from the parameters the run starts from
        state = state.replace(opt_state=engine.strategy.restart_average(state.params, state.opt_state))
    return Started(state, restored.path, restored.step, passed, restored.tokenizer)


def params_of(engine: Engine, path: Path) -> RestoredParams:
    """The parameters of the checkpoint at `path`, in this run's layout (mesh, device count,
    strategy, tensor-parallel split), and the steps it had trained.

    Only the parameters are read and converted (`restore_params`): the checkpoint's optimizer
    state, error buffers and memory stay on disk, so the devices hold this run's fresh state and
    the checkpoint's parameters, nothing more. Where the checkpoint's optimizer or CMS settings
    differ from this run's, which shape that state but not the parameters, the checkpoint is
    checked against an engine built with the checkpoint's (`_source_engine`), whose parameter
    layout is this run's."""
    return restore_params(_source_engine(engine, storage.read_meta(path), path), path)


def _source_engine(engine: Engine, meta: dict, path: Path) -> Engine:
    """`engine`, or where the checkpoint's `optim.name`, `optim.momentum`, `optim.ema_decay` or
    `cms.*` differ from this run's, an engine on the same model, mesh and strategy with the checkpoint's: they shape the
    optimizer state and the error buffers, not the parameters, whose layout is the same in both. The number
    of CMS levels does shape the parameters (a model builds a chain of that many levels): it
    must match."""
    cfg, saved = engine.cfg, meta["config"]
    periods = get(saved, "cms.periods")
    if not isinstance(periods, list) or len(periods) != len(cfg.cms.periods):
        raise ConfigError(f"checkpoint {path} does not fit this run: cms.periods={fmt(periods)} there, "
                          f"{list(cfg.cms.periods)} here (another number of levels is another model)")
    here = config.to_dict(cfg)
    optim = {k: get(saved, f"optim.{k}") for k in ("name", "momentum", "ema_decay")
             if get(saved, f"optim.{k}") is not None}
    tree = {**here, "optim": {**here["optim"], **optim},
            "cms": {**here["cms"], **{k: v for k, v in saved["cms"].items() if k in here["cms"]}}}
    if tree == here:
        return engine
    try:
        src_cfg = config.from_dict(tree)
    except ConfigError as e:  # an optimizer or a CMS setting this nljax does not know
        raise ConfigError(f"checkpoint {path} does not fit this run: {e}") from None
    return Engine.create(src_cfg, engine.model, engine.mesh)
