"""`--resume=auto`: one command that starts a run and restarts it, so that a job script a
scheduler requeues after a preemption (the same command, the same run.dir) continues the run.

What run.dir holds decides, read by process 0 for all (on a shared file system the others may
see its files later; every process must take the same branch):

- a complete checkpoint in checkpoint.dir: `--resume` (`checkpoint.resume=latest`: the run's
  saved config.yaml under the command line's settings, nljax/run/resuming.py);
- nothing of a run: a new run, as without `--resume`;
- a run that left no complete checkpoint (an attempt stopped before its first save: it logged
  steps, or its first save was cut short): that run is started over in place, as with
  `run.overwrite=true`, which here replaces only that attempt's files (those its run.dir lists
  as written, nljax/runtime/runlog.py) and its partial saves; there is no complete checkpoint
  to lose, and one is never removed (it makes the run resume).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import jax

from nljax import config
from nljax.checkpoint import storage
from nljax.checkpoint.taken import inside_run_dir
from nljax.config import Config
from nljax.errors import ConfigError
from nljax.run.resuming import resumed_config, resuming
from nljax.runtime import distributed
from nljax.runtime.rundir import check_free, checkpoint_dir, logged_a_step

RESUME, NEW, OVER = "resume", "new", "over"


def _on_main(read: Callable[[], bool]) -> bool:
    """Process 0's `read()` on every process (the others do not read)."""
    return distributed.main_decides(read() if jax.process_index() == 0 else False)


def decide(cfg: Config) -> str:
    """RESUME, NEW or OVER for the run.dir and checkpoint.dir of `cfg`, as process 0 sees them;
    every process calls it at the same point (each answer is a broadcast)."""
    root = checkpoint_dir(cfg)
    # complete: what the refusal of a new run offers to continue with --resume (nljax/checkpoint/taken.py)
    if _on_main(lambda: bool(storage.committed_steps(root))):
        return RESUME
    held = _on_main(lambda: logged_a_step(Path(cfg.run.dir)) or bool(storage.leftovers(root)))
    if held:  # process 0's line on every process
        distributed.on_main(lambda: _refuse_checkpoints_elsewhere(cfg, root), elsewhere=None)
    return OVER if held else NEW


def _refuse_checkpoints_elsewhere(cfg: Config, root: Path) -> None:
    """A run.dir whose run saved its checkpoints in another checkpoint.dir than this command's
    (its config.yaml's, or the default <run.dir>/checkpoints) holds a run to resume, not an
    attempt to start over: starting over in place replaced its metrics.jsonl and config.yaml
    (the same command with checkpoint.dir changed, or added, on a restart). Refused in one line."""
    saved_file = Path(cfg.run.dir) / "config.yaml"
    theirs = Path(cfg.run.dir) / "checkpoints"
    if saved_file.is_file():
        try:
            saved = config.load(str(saved_file), [f"run.dir={cfg.run.dir}"], saved=True)
            theirs = checkpoint_dir(saved)
        except (ConfigError, OSError, ValueError):
            pass  # an unreadable config.yaml: the default checkpoint.dir is the one to look in
    theirs = theirs.absolute()
    if theirs.resolve() == root.resolve():
        return
    steps = storage.committed_steps(theirs)
    if steps:
        raise ConfigError(
            f"--resume=auto: {cfg.run.dir} holds a run whose checkpoints are in {theirs} (up to step {steps[-1]}), "
            f"not in checkpoint.dir {root}: give checkpoint.dir={theirs} to resume it, or "
            "choose another run.dir")


def configured(cfg: Config, config_file: str | Sequence[str] | None, overrides: Sequence[str],
               say: Callable[[str], None], live_refused: bool = True) -> Config:
    """The config `--resume=auto` trains with: `cfg` (the command line's, which names run.dir)
    resumed, restarted in place or as it is, `say` given one line for the last two.
    `live_refused`: a live run in run.dir is refused first (its files are no attempt to start
    over, nor its checkpoints one to resume); `--print-config`, which reads only, does not."""
    if cfg.checkpoint.resume:
        raise ConfigError(f"--resume=auto decides what the run resumes from: leave checkpoint.resume="
                          f"{cfg.checkpoint.resume} out, or give it without --resume=auto")
    if live_refused:
        check_free(cfg)  # the trainer checks again; here before a line says what this run would do there
    start = decide(cfg)
    if start == RESUME:
        return resumed_config(resuming(cfg, "latest"), config_file, overrides)
    if start == NEW:
        where = cfg.run.dir if inside_run_dir(cfg) else f"checkpoint.dir {checkpoint_dir(cfg)}"
        say(f"nljax: --resume=auto: no checkpoint in {where}, starting a new run")
        return cfg
    say(f"nljax: --resume=auto: {cfg.run.dir} holds a run with no complete checkpoint{_left(cfg)}: starting it "
        "over in place, replacing its files")
    # run.overwrite's removal, which finds no complete checkpoint to remove: process 0 saw none, and
    # the run's lock (taken before anything is removed) keeps another run from saving one meanwhile
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, overwrite=True))


def _left(cfg: Config) -> str:
    """What the run that saved no checkpoint left, as process 0 sees it (" (metrics.jsonl)"), for
    its line; "" on the other processes, which do not read."""
    if jax.process_index() != 0:
        return ""
    left = [what for what, there in (("metrics.jsonl", logged_a_step(Path(cfg.run.dir))),
                                     ("an incomplete checkpoint", storage.leftovers(checkpoint_dir(cfg)))) if there]
    return f" ({', '.join(left)})" if left else ""
