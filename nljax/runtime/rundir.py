"""The run directory (`run.dir`) and the checkpoint directory inside it (`checkpoint.dir`).

`RunDir` owns the files a run writes there (config.yaml, metrics.jsonl, summary.json, plots,
profile, the lock); `checkpoint_dir` says where its checkpoints live, which `nljax.checkpoint`
reads and writes. A run refuses to overwrite an earlier run unless told to (or resuming it).
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from nljax.config import Config, to_dict
from nljax.data.documents import absolute
from nljax.data.settings import eval_sets
from nljax.errors import ConfigError
from nljax import writable
from nljax.runtime import distributed, exportdir, runlog
from nljax.runtime.runlock import RunLock, make_run_dir, refuse_if_live


def checkpoint_dir(cfg: Config) -> Path:
    """`checkpoint.dir`, by default `<run.dir>/checkpoints`."""
    # absolute: Orbax's TensorStore writer rejects relative paths (the default run.dir is one)
    return Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints").absolute()


# The user's data, named by paths that may be relative to where the run was started: config.yaml
# records them (and checkpoint.dir) absolute, so that a tool reading the run (nljax.generate,
# nljax.export) finds them from any directory. The run's own config (and its checkpoints') keeps what the user wrote.
DATA_PATHS = (("data", "train"), ("data", "eval"), ("data", "tokenizer"), ("data", "prepared"), ("images", "path"),
              ("eval", "harness_include"))


def recorded(cfg: Config) -> dict:
    """`cfg` as config.yaml records it: the data paths (globs included, data.eval_sets' too),
    checkpoint.dir and checkpoint.init_params made absolute (the config.yaml reused from another
    folder, `--config run/config.yaml`, names the same files)."""
    tree = to_dict(cfg)
    for key in ("dir", "init_params"):
        if getattr(cfg.checkpoint, key):
            tree["checkpoint"][key] = absolute(getattr(cfg.checkpoint, key))
    for section, key in DATA_PATHS:
        value = tree[section][key]
        if isinstance(value, list):
            tree[section][key] = [absolute(p) for p in value]
        elif value:
            tree[section][key] = absolute(value)
    # data.eval_sets: name=glob, the glob made absolute (a malformed entry was refused before)
    tree["data"]["eval_sets"] = [f"{name}={absolute(glob)}" for name, glob in eval_sets(cfg.data.eval_sets)]
    return tree


def logged_a_step(run_dir: Path) -> bool:
    """Whether `run_dir` holds an earlier run: a metrics.jsonl with something in it. An attempt
    that logged no step (it stopped in its start-up) is no run to keep (`RunDir`)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def holds_a_run(run_dir, held: str, resumable: bool) -> str:
    """The one line refusing a new run in a run.dir that holds an earlier run, `held` saying what
    is there ("checkpoints up to step 200"); `resumable`: --resume would continue it."""
    resume = "continue it with --resume, " if resumable else ""
    return (f"run.dir {run_dir} already holds a run ({held}): {resume}choose another run.dir, or set "
            "run.overwrite=true to replace it")


class RunDir:
    """The files of one run. Refuses to overwrite an earlier run unless told to (or resuming it);
    when told to, removes the earlier run's outputs first so that none of them outlives it."""

    # and the files the run noted (runlog.note_written: samples_*.png, TensorBoard event files)
    FILES = ("metrics.jsonl", "summary.json", "config.yaml", "loss.png", "step_time.png")  # files, not folders
    OUTPUTS = ("metrics.jsonl", "summary.json", "config.yaml", "loss.png", "step_time.png", "profile", "wandb")

    def __init__(self, path: str, overwrite: bool, write: bool, resume_step: int | None = None):
        self.path = Path(path)
        self.write = write
        self.resume_step = resume_step
        self.last_kept: dict | None = None  # the latest record a resume kept (`kept`)
        self._cut_due = False  # a resume's metrics.jsonl is cut back at `begin_log`
        metrics = self.path / "metrics.jsonl"
        # Every refusal before anything is created (check first, then create): a refused run
        # leaves run.dir as it found it.
        refused = None
        if write:
            try:
                self._refuse_not_files()
            except ConfigError as e:
                refused = e
        # An earlier attempt that logged no step (it stopped in its start-up: a tracker that could
        # not start, the first compilation) is no run to keep: its files are replaced, as by
        # run.overwrite (a live one holds the lock, checked before). Process 0 decides: on a
        # shared file system the others could see its fresh metrics.jsonl. Every process takes
        # part in that decision, process 0 also when it refuses (raised after it: the others then
        # stop with it at `Output.create`, rather than wait in a collective it never joins).
        logged = distributed.main_decides(refused is None and logged_a_step(self.path))
        if refused is not None:
            raise refused
        if logged and not overwrite and resume_step is None:
            # found by `nljax.checkpoint.taken` before the run was built; here for a run made otherwise
            raise ConfigError(holds_a_run(path, "metrics.jsonl", resumable=False))
        if write:
            if resume_step is None and self.path.is_dir():
                self._refuse_foreign()
            make_run_dir(self.path)
            # never delete a file nobody asked to replace, nor one no run wrote (`runlog.written`)
            if resume_step is None and (overwrite or metrics.exists()):
                runlog.remove_written(self.path)
                exportdir.remove(self.path / exportdir.DEFAULT)  # the earlier run's nljax.export
            # each name noted as it is first written (`runlog.note_written`): an overwrite removes
            # only what a run made, never a folder (wandb/, profile/) this run did not create
            runlog.note_written(self.path, "metrics.jsonl")
            self._cut_due = resume_step is not None
            if self._cut_due:
                runlog.note_written(self.path, self._cut.name)  # an overwrite removes one a kill left
                self.last_kept = write_records(self._cut, kept_records(metrics, resume_step))
            else:
                replace_text(metrics, "")

    @property
    def _cut(self) -> Path:
        """A resume's log cut back to its step, written as the run directory is taken (where a bad
        line is said) and renamed over metrics.jsonl at `begin_log`."""
        return self.path / "metrics.jsonl.tmp"

    def kept(self) -> Iterator[dict]:
        """The records a resume keeps, the steps before the one it resumes, read one at a time: a
        long run's (a million steps) would take gigabytes of memory held at once. Process 0's: the
        others, which write no file, keep none."""
        if not self.write or self.resume_step is None:
            return iter(())
        return kept_records(self._cut if self._cut_due else self.path / "metrics.jsonl", self.resume_step)

    def begin_log(self) -> None:
        """A resume's metrics.jsonl cut back to the records before the step it resumes (`kept`), the
        run's steps from there on being logged again. Called once the checkpoints after that step are
        set aside, not as the run directory is taken: a run killed in between left them in
        checkpoint.dir and the log cut, and the next --resume took the newest of them, whose steps
        the log had lost. Once; a fresh run's log was made empty as it was taken."""
        if self.write and self._cut_due:
            self._cut_due = False
            self._cut.replace(self.path / "metrics.jsonl")

    def _refuse_not_files(self) -> None:
        """Refuses a run.dir holding, under the name of a file the run writes, something that is
        not a regular file (a folder, a FIFO): found at the end of training before, as a traceback."""
        for name in self.FILES:
            p = self.path / name
            if p.exists() and not p.is_file():
                kind = "a directory" if p.is_dir() else "not a regular file"
                raise ConfigError(f"run.dir {self.path}: {name} is {kind}, where the run writes a file of that "
                                  "name; move it")

    def _refuse_foreign(self) -> None:
        """Refuses a run.dir holding, under a name a run writes, a file, folder or symbolic link
        (dangling ones too) no run wrote there (a user's config.yaml, summary.json, wandb/): a
        fresh run would replace it."""
        ours = runlog.written(self.path)
        theirs = sorted(p.name for p in self.path.iterdir()  # not glob: it skips a dangling link
                        if any(fnmatch.fnmatchcase(p.name, n) for n in self.OUTPUTS) and p.name not in ours)
        if theirs:
            raise ConfigError(
                f"run.dir {self.path} holds {', '.join(theirs)}, which no nljax run wrote there (not listed in "
                f"{runlog.WRITTEN}): a run would replace {'them' if len(theirs) > 1 else 'it'}; move "
                f"{'them' if len(theirs) > 1 else 'it'} or choose another run.dir"
            )

    def save_config(self, cfg: Config) -> None:
        if self.write:
            runlog.note_written(self.path, "config.yaml")
            replace_text(self.path / "config.yaml", yaml.safe_dump(recorded(cfg), sort_keys=False))

    def log(self, record: dict) -> None:
        if self.write:
            self.begin_log()
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(runlog.strict_json(record) + "\n")

    def evaluated_at(self, steps: int) -> bool:
        """Whether this run's trackers hold an evaluation after `steps` steps, the step it resumed
        from: one during training (the last kept record's: the log is in step order) or the final
        one of an earlier attempt that ended there (its summary.json, written as soon as that
        evaluation was logged: `trainer.final_report`)."""
        evaluated = lambda d: any(k.startswith("eval_") for k in d)  # a text's eval_loss, a MeanFlow run's eval_mse
        last = self.last_kept
        if last is not None and last.get("step") == steps - 1 and evaluated(last):
            return True
        try:
            ended = json.loads((self.path / "summary.json").read_text())
        except (OSError, ValueError):  # none, or cut short: no evaluation known
            return False
        return isinstance(ended, dict) and ended.get("steps") == steps and evaluated(ended)

    def save_summary(self, summary: dict) -> None:
        if self.write:
            runlog.note_written(self.path, "summary.json")
            replace_text(self.path / "summary.json", runlog.strict_json(summary, indent=1))


def replace_text(path: Path, text: str) -> None:
    """`path` replaced in one rename: a run killed while writing leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def kept_records(path: Path, step: int | float) -> Iterator[dict]:
    """The records of an earlier metrics.jsonl for steps before `step`, read as they are iterated
    (a resumed run rewrites the steps from its checkpoint on, so the file ends up as the
    uninterrupted run's; `math.inf`: every record). A line that is no record is said once, after
    the last, and dropped."""
    if not path.exists():
        return iter(())
    if not path.is_file():  # a FIFO would block the read for ever
        raise ConfigError(f"{path} is not a regular file: it cannot be the run's log to resume")
    return _records_before(path, step)


def _records_before(path: Path, step: int | float) -> Iterator[dict]:
    dropped, n_dropped = [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace")  # a line not UTF-8 (edited, damaged): dropped, said
            try:
                record = json.loads(line) if "\ufffd" not in line else None
                kept = record["step"] < step
            except (ValueError, KeyError, TypeError):
                if line.strip():  # a line cut short by a kill, or edited: said, not kept
                    n_dropped += 1
                    dropped += [n] if len(dropped) < 5 else []
                continue
            if kept:  # null stands for a non-finite number (runlog.strict_json): NaN again in memory
                yield {k: float("nan") if v is None else v for k, v in record.items()}
    if dropped:
        print(f"nljax: warning: {path}: line{'s' if n_dropped > 1 else ''} {', '.join(map(str, dropped))}"
              f"{', ...' if n_dropped > 5 else ''} not a record (cut short by a kill?): dropped from the "
              "resumed log", file=sys.stderr)


def write_records(path: Path, records: Iterable[dict]) -> dict | None:
    """`records` as metrics.jsonl lines at `path` (replaced), one at a time; returns the last."""
    last = None
    with open(path, "w") as f:
        for last in records:
            f.write(runlog.strict_json(last) + "\n")
    return last


def _in_use_elsewhere(cfg: Config) -> str:
    return f"run.dir {cfg.run.dir} is in use by a live run (see process 0)"


def locked_dirs(cfg: Config) -> list[tuple[str, Path]]:
    """The directories a run writes, each with the setting naming it: run.dir, and checkpoint.dir
    when it is outside run.dir (two runs with other run.dirs but one checkpoint.dir would replace
    each other's checkpoints). One owner each: a lock file in each."""
    run_dir = Path(cfg.run.dir).absolute()
    out = [("run.dir", run_dir)]
    ck = checkpoint_dir(cfg)
    if (cfg.checkpoint.every or cfg.run.overwrite) and run_dir.resolve() not in (ck.resolve(), *ck.resolve().parents):
        out.append(("checkpoint.dir", ck))
    return out


def written_dirs(cfg: Config) -> list[tuple[str, Path]]:
    """Every directory a run writes, with the setting naming it: `locked_dirs`, and checkpoint.dir
    inside run.dir too (this run's run.dir lock covers it, but it may be another live run's
    checkpoint.dir, whose lock is in it). Each is checked against live locks before anything is
    written."""
    out = locked_dirs(cfg)
    ck = checkpoint_dir(cfg)
    if (cfg.checkpoint.every or cfg.run.overwrite) and all(p != ck for _, p in out):
        out.append(("checkpoint.dir", ck))
    return out


def _exists(what: str, path: Path) -> bool:
    """Whether `path` exists; one line where the name cannot be a path (over 255 bytes, say)."""
    try:
        return path.exists()
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be used: {e.strerror or e}") from None


def check_free(cfg: Config) -> None:
    """Refuses (every process) a run.dir or checkpoint.dir a live run holds, or one that is a file,
    before anything is read or written."""
    for what, path in written_dirs(cfg):
        if _exists(what, path) and not path.is_dir():  # not "checkpoint.dir ... cannot be created"
            raise ConfigError(f"{what} {path} is a file, not a directory")
        for p in (path, *path.parents):  # mkdir would say only "File exists"
            if writable.dangling(p):
                raise ConfigError(f"{what} {path}: {writable.broken_link(p)}")
    distributed.on_main(lambda: _refuse_live(cfg), _in_use_elsewhere(cfg))
    distributed.on_main(lambda: _refuse_unwritable(cfg), elsewhere=None)  # process 0 makes run.dir


def _refuse_unwritable(cfg: Config) -> None:
    """Refuses a run.dir or checkpoint.dir that cannot be made or written (under a file, on a
    read-only file system): found only once the model was built and its parameters initialized,
    with the new run.dir left behind, empty."""
    for what, path in written_dirs(cfg):
        writable.refuse_unwritable(f"{what} {path}", path)


def _refuse_live(cfg: Config, held: tuple[Path, ...] = ()) -> None:
    """Refuses each directory of `written_dirs` that a live run holds, or that is inside one a
    live run holds (another run's run.dir: its checkpoints folder is covered by that run's lock
    only), but for this run's own (`locked_dirs`). `held`: the locks this run took already."""
    own = {p.resolve() for _, p in locked_dirs(cfg)}
    for what, path in written_dirs(cfg):
        if path not in held:
            refuse_if_live(path, what)
        for parent in path.resolve().parents:
            if parent in own:
                continue
            try:
                refuse_if_live(parent)
            except ConfigError as e:
                raise ConfigError(f"{what} {path} is inside {parent}: {e}") from None


class RunLocks:
    """The locks of `locked_dirs`, taken in order and released in reverse."""

    def __init__(self, cfg: Config):
        self.locks = [RunLock(path, what) for what, path in locked_dirs(cfg)]

    def acquire(self) -> "RunLocks":
        taken = []
        try:
            for lock in self.locks:
                taken.append(lock.acquire())
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        return self

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def take_lock(cfg: Config) -> RunLocks:
    """Process 0 locks run.dir and checkpoint.dir (nljax/runtime/runlock.py), then checks again
    what `check_free` checked (a run may have taken its lock since, in a directory this run writes
    but does not lock); every process raises when it is refused."""
    lock = RunLocks(cfg)

    def acquire() -> None:
        lock.acquire()
        try:
            _refuse_live(cfg, tuple(p for _, p in locked_dirs(cfg)))
        except BaseException:
            lock.release()
            raise

    distributed.on_main(acquire, _in_use_elsewhere(cfg))
    return lock
