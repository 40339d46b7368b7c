"""Experiment trackers: where a run's scalars and text samples go besides metrics.jsonl.

`run.trackers` names them, from the registry `TRACKERS`:

- `tensorboard`: event files in run.dir, written with tensorboardX (a dependency of nljax); the
  viewer comes with `pip install 'nljax[tensorboard]'`.
- `wandb`: a Weights & Biases run, offline by default (its files under run.dir/wandb, uploaded
  later by `wandb sync`); `pip install 'nljax[wandb]'`, imported only when chosen.

Each has the one interface of `Tracker`. Only process 0 opens any: the others get an empty
`Trackers`, whose calls do nothing. A resumed run continues its trackers: TensorBoard drops the
events it logged after the checkpoint's step (`purge_step`), and W&B resumes the run whose id the
checkpoint saved (`Trackers.ids`, kept in the checkpoint's metadata by `nljax.checkpoint`),
skipping the steps that run logged already.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import logging
import os
import sys
import time
import typing
from pathlib import Path
from typing import Protocol

from nljax.config import Config, to_dict
from nljax.errors import ConfigError, first_line
from nljax.runtime.distributed import on_main
from nljax.runtime.runlog import note_written
from nljax.runtime.runsettings import TrackerName


class Tracker(Protocol):
    name: str  # its key in `TRACKERS`
    run_id: str | None  # what a resume needs to continue the same run (kept in the checkpoint), if anything

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        """Log each number of `values` as `prefix/key` at `step` (other values are skipped)."""

    def text(self, tag: str, text: str, step: int) -> None:
        """Log `text` (a generated sample) under `tag` at `step`."""

    def flush(self) -> None:
        """Put what was logged so far on disk, where this process can: a checkpoint was saved, and
        a resume from it logs only the steps after it."""

    def close(self, failed: bool = False) -> None:
        """Finish; `failed`: the run stopped before its end (an error, a preemption)."""


@dataclasses.dataclass(frozen=True)
class Start:
    """What a tracker opens with."""

    cfg: Config
    path: Path  # run.dir, created already
    resume_step: int | None  # the step a resumed run continues its own files from; None: a fresh run
    ids: dict[str, str]  # tracker run ids saved in the resumed checkpoint (empty for a fresh run)


def numbers(values: dict) -> dict[str, float | int]:
    """The entries of `values` that are numbers (a bool is a flag, not a number)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@contextlib.contextmanager
def torch_hidden():
    """`import torch` refused within, where torch is installed but not imported yet: tensorboardX's
    writer imports it to name a type in its annotations (`torch.Tensor`, numpy's array without
    it), which nljax never passes. That import took 3 s of a run's start-up, and torch's teardown
    1 to 2 s at the process's exit, silent after the run's last line. Afterwards torch imports as
    ever (lm-eval's, in the same process)."""
    if "torch" in sys.modules:  # imported already (or hidden by an outer call): nothing to save
        yield
        return
    sys.modules["torch"] = None  # the import system's "not importable": `import torch` raises ImportError
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


class TensorBoard:
    """Scalars and text as TensorBoard event files in run.dir (tensorboardX)."""

    name, run_id = "tensorboard", None  # a resume continues the files in run.dir
    FLUSH_S = 30.0  # how often the file is flushed for a TensorBoard watching it

    def __init__(self, path: Path, start_step: int = 0):
        tbx = self.require()
        before = set(path.glob("events.out.tfevents.*"))
        # tensorboardX names the file by the second it opens it, and a second writer in that second
        # truncated the first's file (a resume that trained nothing, within a second of the run
        # before it): the nanosecond after it keeps each its own file, in the order they came
        self.writer = tbx.SummaryWriter(logdir=str(path), filename_suffix=f".{time.time_ns()}")
        new = sorted(set(path.glob("events.out.tfevents.*")) - before)
        for name in new:  # ours: overwrite removes it
            note_written(path, name.name)
        self.file = new[-1] if new else path
        # Written here, synchronously: tensorboardX's writer thread dies on a failed write (a full
        # disk), and the next event then blocked the run forever on its full queue.
        events = self.writer._get_file_writer().event_writer
        self._events = events._ev_writer
        events.add_event = self._write
        self._flushed = time.monotonic()
        # A session start at `start_step`, also for a fresh run (0): TensorBoard takes a run's
        # first start as its start, and each later one (a resume's) as a restart, dropping the
        # events the earlier files hold from that step on (those the resumed run writes again).
        Event, SessionLog = tbx.proto.event_pb2.Event, tbx.proto.event_pb2.SessionLog
        self.writer._get_file_writer().add_event(Event(step=start_step, session_log=SessionLog(status=SessionLog.START)))

    @contextlib.contextmanager
    def _naming_the_file(self):
        """An OSError of the event file names it (cli's one line: not the run's metrics)."""
        try:
            yield
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.file)) from None

    def _write(self, event) -> None:
        with self._naming_the_file():
            self._events.write_event(event)
            if time.monotonic() - self._flushed > self.FLUSH_S:
                self._flush()

    def _flush(self) -> None:
        self._events.flush()
        self._flushed = time.monotonic()

    def flush(self) -> None:
        # The events sit in the file's 8 KiB buffer (a dozen steps) until flushed: a run killed
        # (SIGKILL, out of host memory) lost those up to its last checkpoint, which its resume
        # does not log again, leaving a gap in every series.
        with self._naming_the_file():
            self._flush()

    @staticmethod
    def require():
        try:
            with torch_hidden():
                import tensorboardX
        except ImportError:  # a dependency of nljax: only a broken installation lacks it
            raise ConfigError("run.trackers has tensorboard, but tensorboardX is not installed: pip install "
                              "tensorboardX, or leave tensorboard out of run.trackers") from None
        # A non-finite scalar (a diverged run's loss) is logged as it is, and the run says so in its
        # own line (a skipped step); tensorboardX warned of it too, once per scalar: three lines
        # or more at every such step, between the run's.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        return tensorboardX

    @classmethod
    def open(cls, start: Start) -> "TensorBoard":
        # a resume restarts after the checkpoint's step: TensorBoard drops the events logged after
        # more steps than it had (the evaluation at its step stays: it is not redone)
        return cls(start.path, 0 if start.resume_step is None else start.resume_step + 1)

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        for k, v in numbers(values).items():
            self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def text(self, tag: str, text: str, step: int) -> None:
        # Markdown: indented lines are a code block, which keeps the sample's line breaks and spaces
        self.writer.add_text(tag, "\n".join("    " + line for line in text.split("\n")), step)

    def close(self, failed: bool = False) -> None:
        with self._naming_the_file():
            self._flush()
            self.writer.close()


class WandB:
    """A Weights & Biases run, resumed (`resume="allow"`) under the id the checkpoint saved."""

    name = "wandb"

    def __init__(self, run, logged: Path):
        self.run = run
        self.run_id = run.id
        # A resumed run starts again after the checkpoint's step, which may be before the last
        # step logged: online W&B refuses (with a warning each) the steps logged again, and
        # offline they were written a second time, for `wandb sync` to refuse. The run is
        # deterministic, so they would repeat the values logged; they are skipped. Online W&B
        # says where its run is (run.step); offline, `logged`, a file beside the run's files,
        # holds the last step of this run id that W&B has written (at `close`, after W&B's
        # finish: after a hard kill it stays at the session before, whose steps are then logged
        # again rather than lost).
        self.logged = logged
        self.last = last_logged(logged)
        self.first_step = max(run.step or 0, self.last + 1)

    @staticmethod
    def require():
        try:
            import wandb  # only when chosen: it starts slowly and is an optional dependency
        except ImportError:
            raise ConfigError("run.trackers has wandb, which is not installed: pip install 'nljax[wandb]' (or wandb), "
                              "or leave wandb out of run.trackers") from None
        env_mode = os.environ.get("WANDB_MODE")
        if env_mode:  # refused here, before the run writes anything (a resume's config.yaml was rewritten)
            try:
                wandb.Settings(mode=env_mode)
            except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: its line listing the modes
                said = next((line.strip().split(" [type=")[0] for line in str(e).splitlines()
                             if "Input should be" in line), first_line(e))
                raise ConfigError(f"WANDB_MODE={env_mode!r} is not a W&B mode ({said}); it overrides run.wandb_mode: "
                                  "unset it, or set WANDB_MODE=offline") from None
        return wandb

    @classmethod
    def open(cls, start: Start) -> "WandB":
        wandb = cls.require()
        r = start.cfg.run
        env_mode = os.environ.get("WANDB_MODE")
        mode = env_mode or r.wandb_mode
        resumed = start.ids.get("wandb") if start.resume_step is not None else None
        # console="off": nljax's own lines are what the run logs; W&B's capture of the terminal
        # would wrap stdout and stderr, under the progress bar and a launcher's pipes.
        offline = mode in ("offline", "dryrun")
        # W&B's own lines offline advised `wandb online`, which the mode given here overrides: the
        # run says where the records are and how to go online itself (below)
        settings = wandb.Settings(console="off", quiet=True, silent=r.quiet or offline)
        try:
            note_written(start.path, "wandb")  # before wandb.init makes it: an overwrite removes it
            run = wandb.init(
                project=r.wandb_project, name=r.wandb_name or Path(r.dir).resolve().name, dir=str(start.path),
                id=resumed, resume="allow",  # id None: a new run, its id chosen by W&B
                mode=mode, config=to_dict(start.cfg), settings=settings,
            )
        except Exception as e:  # noqa: BLE001 - e.g. online without an account or a network
            # WANDB_MODE wins over run.wandb_mode: where it is set, pointing at run.wandb_mode
            # would not help (WANDB_MODE=bogus was blamed on no setting of the run's)
            where, fix = ((f"mode {mode}, from the environment variable WANDB_MODE", "unset WANDB_MODE, or set "
                           "WANDB_MODE=offline: offline needs neither account nor network") if env_mode else
                          (f"mode {mode}", "run.wandb_mode=offline needs neither account nor network"))
            raise ConfigError(f"W&B could not start a run ({where}): {type(e).__name__}: {first_line(e)}; "
                              f"{fix}") from None
        (start.path / "wandb").mkdir(exist_ok=True)
        if offline and not r.quiet:
            records = Path(run.dir).parent  # run.dir: the run's files/ folder, in the folder `wandb sync` takes
            # WANDB_MODE wins over run.wandb_mode: where it made the run offline, run.wandb_mode=online does not
            online = ("WANDB_MODE=online, which overrides run.wandb_mode," if env_mode else
                      "run.wandb_mode=online, or WANDB_MODE=online,")
            print(f"W&B run {run.id} offline, its records in {records}: wandb sync {records} uploads them "
                  f"({online} logs online)", flush=True)
        return cls(run, start.path / "wandb" / f"nljax-last-step-{run.id}")

    def _log(self, values: dict, step: int) -> None:
        if step >= self.first_step:
            self.run.log(values, step=step)
            self.last = max(self.last, step)

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        values = numbers(values)
        if values:
            self._log({f"{prefix}/{k}": v for k, v in values.items()}, step)

    def text(self, tag: str, text: str, step: int) -> None:
        import wandb

        self._log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step)

    def flush(self) -> None:
        pass  # W&B's own process writes its records; the library has no call to wait for them

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        if self.last >= 0:
            tmp = self.logged.with_suffix(".tmp")
            tmp.write_text(str(self.last))
            os.replace(tmp, self.logged)  # whole or not at all: a torn number would skip wrong steps


def last_logged(path: Path) -> int:
    """The step in `path` (`WandB.logged`), -1 where there is none (a fresh run, files removed)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


# name -> the class: `require()` imports its package (a missing one is a one-line ConfigError),
# `open(start)` makes the tracker
TRACKERS: dict[str, type] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
}
assert set(TRACKERS) == set(typing.get_args(TrackerName)), "run.trackers and the registry name the same trackers"


class Trackers:
    """The trackers of `run.trackers`, behind one interface; none on processes other than 0."""

    def __init__(self, trackers: typing.Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    @classmethod
    def open(cls, cfg: Config, main: bool, resume_step: int | None = None, ids: dict | None = None) -> "Trackers":
        """`ids`: the tracker run ids of the checkpoint this run resumes (`Checkpoints.trackers`).
        Every process calls it: a tracker that fails to start on process 0 (W&B online without
        a network) stops every process with its one line, not only process 0 while the others
        wait at their first collective."""
        def open_all() -> Trackers:
            opened = cls()
            try:
                start = Start(cfg, Path(cfg.run.dir), resume_step, dict(ids or {}))
                for name in cfg.run.trackers:
                    opened.trackers.append(TRACKERS[name].open(start))
            except BaseException:
                opened.close(failed=True)
                raise
            return opened

        return on_main(open_all, "run.trackers: a tracker failed to start on process 0", main) or cls()

    @property
    def ids(self) -> dict[str, str]:
        """Tracker name -> the run id a resume continues (W&B's), for the checkpoint's metadata."""
        return {t.name: t.run_id for t in self.trackers if t.run_id}

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        for t in self.trackers:
            t.scalars(prefix, values, step)

    def text(self, tag: str, text: str, step: int) -> None:
        for t in self.trackers:
            t.text(tag, text, step)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def close(self, failed: bool = False) -> None:
        for t in self.trackers:
            t.close(failed)
        self.trackers = []


def check_installed(cfg: Config) -> None:
    """A one-line ConfigError for a tracker of run.trackers whose package is missing (or, for W&B,
    whose WANDB_MODE is none of its modes), before the run writes anything (a run stopped later
    would leave a run.dir that refuses the next try). Process 0, the one that opens trackers,
    decides; the others stop with its line (a fixed one blamed a missing package for either)."""
    on_main(lambda: [TRACKERS[name].require() for name in cfg.run.trackers], None)


def step_scalars(rec: dict, n_levels: int, rate_key: str) -> dict:
    """The `train/*` scalars of a step's metrics.jsonl record: loss, the norm of the gradients
    applied (`grad_norm`, over the fired levels, and each fired level's), the learning rate,
    `skipped` (1: a level's update was skipped), `fired_l<l>` (1: level l fired: the Pulse),
    the step time, the rate, the model TFLOP/s per device and the MFU (where the peak is known)."""
    keys = ("loss", "grad_norm", "lr", "step_time_s", rate_key, "tflops_per_s_per_device", "mfu")
    out = {k: rec[k] for k in keys if k in rec}
    out["skipped"] = int(rec["skipped"])
    for l in range(n_levels):
        out[f"fired_l{l}"] = int(l in rec["active_levels"])
        if f"grad_norm_l{l}" in rec:
            out[f"grad_norm_l{l}"] = rec[f"grad_norm_l{l}"]
    return out
