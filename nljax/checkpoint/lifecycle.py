"""`Checkpoints`: a run's checkpoints from the resume it starts from to its last save."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import sys
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from nljax.checkpoint import initparams, storage
from nljax.checkpoint.contents import check_tokenizer, passed_over
from nljax.checkpoint.peers import Peers
from nljax.checkpoint.quiet import errors_hidden
from nljax.checkpoint.restore import Restored, restore_first_valid
from nljax.checkpoint.taken import refuse_taken
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError, few
from nljax.runtime import distributed
from nljax.runtime.rundir import checkpoint_dir

# Writers made by this process, numbered: every process makes them in the same order, so the
# number names the same writer everywhere (its barriers, `Peers`).
_writers = itertools.count()


class Checkpoints:
    """A run's checkpoints: the resume it starts from (read before anything is written), then,
    once `open`ed, a save every `checkpoint.every` steps and at the end.

    In the trainer: `ckpt = Checkpoints.resolve(engine, run.init_state())` (the state and step to
    start from are `ckpt.state`, `ckpt.start`), then create the run directory, `ckpt.open()`,
    `ckpt.maybe_save(step + 1, state)` after each step, `ckpt.finish(steps_done, state)`, and
    `ckpt.close()` whatever happened."""

    def __init__(self, engine: Engine, fresh: TrainState, restored: Restored | None = None, own: bool = False,
                 later: list[Path] | None = None, params_from: Path | None = None, tokenizer: dict | None = None):
        """`fresh`: this run's state at step 0, where it starts when `restored` is None. `own`:
        `restored` is from this run's checkpoint.dir (the run continues its files). `later`: step
        directories after the restored one, which `open` moves to `<dir>/set_aside/`.
        `params_from`: the checkpoint whose parameters `fresh` holds (checkpoint.init_params).
        `tokenizer`: what the run's token ids are, saved with every checkpoint (`resolve`)."""
        self.cfg, self.engine = engine.cfg, engine
        self.dir = checkpoint_dir(self.cfg)
        self.restored, self.own, self.params_from = restored, own, params_from
        self.set_aside: list[Path] = list(later or [])
        self.state = restored.state if restored else fresh
        self.start = restored.step if restored else 0
        # the step this run's checkpoint.dir holds already: a new run from another run's checkpoint
        # holds none there, so its final save writes one even at the step it started from (a run
        # started from a checkpoint at train.steps has a checkpoint of its own to resume or export)
        self.last_saved: int | None = restored.step if restored and own else None
        # tracker name -> run id (W&B's), saved with every checkpoint: read from the one resumed
        # when this run continues its own files, then set by the trainer once its trackers are open
        self.trackers: dict[str, str] = dict(restored.trackers) if restored and own else {}
        self.data_digest: str | None = None  # of the run's data, saved with every checkpoint (`check_data`)
        self.eval_sets: dict[str, str] = {}  # of each data.eval_sets set, by name, saved likewise
        self.tokenizer = tokenizer  # what the data's token ids are, saved likewise
        self.manager = None
        self.writing: int | None = None  # the step of the save in flight
        # Orbax's reports of a failed save come from its writer threads, at any time between the
        # save and the wait for it (async saves), so they are hidden from `open` to `close`
        # rather than around each call.
        self._quiet = contextlib.ExitStack()
        self._noise = None  # the filters, while open
        self._save_failed = False
        self._peers: Peers | None = None  # a multi-process run's: a failed save ends every process's

    @classmethod
    def resolve(cls, engine: Engine, fresh: TrainState, say=print, digest: str | None = None,
                tokenizer: dict | None = None) -> "Checkpoints":
        """The run's checkpoints: the resume `checkpoint.resume` asks for, restored (falling back
        past damaged checkpoints, with a warning), or a fresh start, with the parameters of
        `checkpoint.init_params` where it names a checkpoint (`nljax.checkpoint.initparams`). Reads only (checkpoint.dir is
        made by `open`, once the run directory was accepted: a refused run leaves none); refuses
        (ConfigError) a checkpoint.dir holding checkpoints this run may not take over. `digest`:
        the run's data digest (the same data under another spelling of its paths is no change).
        `tokenizer`: what its token ids are (`nljax.data.tokenization.identity`, None without
        text), saved with every checkpoint: a checkpoint trained on another tokenizer's ids, whose
        embedding rows would stand for other text, is refused; a new run from its parameters alone
        (checkpoint.init_params) may change it deliberately: warned."""
        cfg = engine.cfg
        root, paths = checkpoint_dir(cfg), storage.candidates(cfg)
        # Resuming this run (its own checkpoint.dir) continues its files; a checkpoint from
        # elsewhere starts a new run from that state, which may not take over existing files.
        own = bool(paths) and root.resolve() in paths[0].resolve().parents
        # the trainer checked before building the run (`refuse_taken`, run.dir's metrics.jsonl too);
        # checked again here, the checkpoint to resume known
        refuse_taken(cfg, continues=bool(paths) and own, logged=False)
        restored, later, params_from = None, [], None
        init_root = initparams.source(cfg)  # None when resuming this run's own checkpoints
        if init_root is not None:
            started = initparams.start_from(engine, fresh, init_root)
            fresh, params_from = started.state, started.path
            try:
                check_tokenizer(started.path, started.tokenizer, tokenizer)
            except ConfigError as e:
                started.warnings.append(f"{e} (checkpoint.init_params takes its parameters all the same)")
            for w in started.warnings:
                if jax.process_index() == 0:
                    print(f"nljax: warning: {w}", file=sys.stderr)
            say(f"parameters from {started.path} (trained {started.step} steps); this run starts at step 0 with a "
                "fresh optimizer state")
        if paths:
            restored, warnings = _restore(engine, fresh, paths, digest)
            check_tokenizer(restored.path, restored.tokenizer, tokenizer)
            if own:  # with checkpoint.every=0 too: a later --resume must not take the abandoned branch
                later = storage.later_steps(root, restored.step)
                warnings += [f"checkpoint {p} is incomplete ({why}), resuming from an older one"
                             for p, why in storage.incomplete(later)]
                warnings += _set_aside_warning(root, restored.path, later)
            for w in [*warnings, *restored.warnings]:
                if jax.process_index() == 0:
                    print(f"nljax: warning: {w}", file=sys.stderr)
        # the steps this run may save: after the one it continues, or from the one it starts at (a new
        # run from another run's checkpoint saves that step too when it is train.steps)
        after = (restored.step if own else restored.step - 1) if restored else 0
        theirs = storage.foreign_steps(root, after, cfg.train.steps) if cfg.checkpoint.every else []
        if theirs:
            raise ConfigError(
                f"checkpoint.dir {root} holds {few(p.name for p in theirs)}, which nljax did not write: "
                "a checkpoint of that step would replace it; move it or choose another checkpoint.dir"
            )
        if restored:
            say(f"resumed from {restored.path} at step {restored.step}")
        return cls(engine, fresh, restored, own, later, params_from, tokenizer)

    @property
    def resume_step(self) -> int | None:
        """The step this run continues its own files from (None: a fresh run, or a new run
        started from another run's checkpoint)."""
        return self.restored.step if self.restored and self.own else None

    @property
    def rows_restarted(self) -> bool:
        """Whether the resume restarted every row's memory (another global batch): the first step
        then resets every row."""
        return self.restored is not None and self.restored.fresh_rows

    def open(self) -> None:
        """Start writing (after the run directory was accepted). A fresh run with
        run.overwrite=true removes the earlier run's checkpoints here."""
        fresh = self.restored is None or not self.own

        def clear() -> None:  # process 0's
            try:
                if fresh and self.cfg.run.overwrite:
                    for p in storage.leftovers(self.dir):
                        shutil.rmtree(p)
                if self.set_aside:
                    storage.set_aside(self.dir, self.set_aside)
            except OSError as e:  # e.g. a file named set_aside, a read-only checkpoint.dir
                where = f": {e.filename}" if e.filename else ""
                raise ConfigError(f"cannot clear checkpoint.dir {self.dir} for this run: {e.strerror or e}{where}") from None

        # every process stops with process 0's line, rather than wait for it at the barrier below
        distributed.on_main(clear, elsewhere=None)
        if not self.cfg.checkpoint.every:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"checkpoint.dir {self.dir} cannot be created: {e.strerror or e}") from None
        if jax.process_count() > 1:
            with distributed.waiting_for_peers("the checkpoint directory's set-up"):
                multihost_utils.sync_global_devices("nljax checkpoint dir ready")
            self._peers = Peers(str(next(_writers)), storage.os_error)
        self._noise = self._quiet.enter_context(errors_hidden(self._peers.report if self._peers else None))
        self.manager = storage.writer(self.cfg, self._peers)

    def check_data(self, digest: str, eval_sets: dict[str, str] | None = None, say=print) -> None:
        """Record the digest of the run's data and of each data.eval_sets set (`eval_sets`, by
        name; saved with every checkpoint) and warn when the checkpoint resumed was trained on
        other data: the stream is a pure function of (seed, step, row) over the data, so with
        other files the resumed run is not the one it continues. A set of the same name whose
        content changed is warned of too (it trains nothing, but its scores after the resume are
        of other text than the ones before it). A set left out trains nothing either, but its
        curve in metrics.jsonl stops here, which a user who did not mean to drop it would not
        see: a warning naming it; a set added is meant, and only noted (`say`) where its curve
        starts."""
        self.data_digest, self.eval_sets = digest, dict(eval_sets or {})
        if self.restored is None or jax.process_index() != 0:
            return
        saved, path = self.restored.data_digest, self.restored.path
        if saved is not None and saved != digest:
            print(f"nljax: warning: checkpoint {path} was trained on other data (digest {saved[:12]} "
                  f"there, {digest[:12]} here): the resumed run reads other data than the run it continues",
                  file=sys.stderr)
        step = self.restored.step
        for name, here in self.eval_sets.items():
            there = self.restored.eval_sets.get(name)
            if there is None:
                say(f"note: data.eval_sets {name} is new since checkpoint {path}: eval_loss/{name} and its other "
                    f"scores in metrics.jsonl start at this resume (step {step})")
            elif there != here:
                print(f"nljax: warning: data.eval_sets {name} changed since checkpoint {path} (digest {there[:12]} "
                      f"there, {here[:12]} here): eval_loss/{name} and its other scores before and after this resume "
                      "are not comparable", file=sys.stderr)
        for name in [n for n in self.restored.eval_sets if n not in self.eval_sets]:  # in the order saved
            print(f"nljax: warning: data.eval_sets {name} was scored by checkpoint {path} but is no longer in "
                  f"data.eval_sets: eval_loss/{name} and its other scores in metrics.jsonl stop at this resume "
                  f"(step {step})", file=sys.stderr)

    def save(self, step: int, state: TrainState) -> None:
        # The previous save is finished first (Orbax would wait for it too) so that a failure is
        # reported with the step it belongs to.
        self._wait()
        # The saves before this one that are complete count against checkpoint.keep; this one,
        # still being written, does not: until it is committed one more stays on disk.
        storage.prune(self.dir, self.cfg.checkpoint.keep, self.cfg.checkpoint.keep_every)
        self.writing = step
        error = None
        try:
            storage.save(self.manager, self.engine, step, state, self.trackers, self.data_digest, self.tokenizer,
                         self.eval_sets)
        except Exception as e:  # noqa: BLE001 - the blocking part of a save (e.g. the disk is full)
            error = self._failed(e)
        if error is not None:  # raised outside `except`: see `_failed`
            raise error
        if not self.cfg.checkpoint.async_save:
            self._wait()
        self.last_saved = step

    def save_now(self, step: int, state: TrainState) -> bool:
        """Save unless `step` was just saved (the final step, or a preemption, at a checkpoint step);
        whether `step` is saved (False without a writer: checkpoint.every=0)."""
        if self.manager is None:
            return False
        if self.last_saved != step:
            self.save(step, state)
        return True

    def maybe_save(self, step: int, state: TrainState) -> None:
        """`step` = optimizer steps done (the state's step)."""
        if self.manager is not None and step % self.cfg.checkpoint.every == 0:
            self.save(step, state)

    def _wait(self) -> None:
        if self.manager is not None and self.writing is not None:
            error = None
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001 - whatever the background writer raised
                error = self._failed(e)
            if error is not None:
                raise error
            self.writing = None

    def _failed(self, e: BaseException) -> ConfigError:
        """The one line for a save that failed: the step directory, the OSError, and what is left.
        The checkpoint being written stays a partial save (`<step>.orbax-checkpoint-tmp-*`), which
        a resume never reads; the complete ones before it are untouched. The caller raises it
        outside its `except`: as the context of this error, Orbax's exception would keep the
        failed writes' futures alive past `close`, whose reports would then reach the user."""
        step, self.writing = self.writing, None
        self._save_failed = True
        if self._noise is not None:
            self._noise.fail()  # the failed writes' reports may arrive before `close` settles them
        if self._peers is not None:
            # the others may be waiting for this save (posted already where Orbax logged a
            # failure of its writer; the first report stands)
            self._peers.report(e)
        kept = storage.committed_steps(self.dir)
        left = f"the newest complete checkpoint is {self.dir / str(kept[-1])}" if kept else "no complete checkpoint"
        # In a multi-process run, the failure every process was told of: the same line everywhere
        cause = (self._peers.failure() if self._peers else None) or storage.os_error(e)
        return ConfigError(f"checkpoint {self.dir / str(step)} could not be saved ({cause}); {left}")

    def finish(self, step: int, state: TrainState) -> None:
        """Save the final state (unless just saved) and wait until every save is on disk."""
        if self.manager is None:
            return
        self.save_now(step, state)
        self.close()
        storage.prune(self.dir, self.cfg.checkpoint.keep, self.cfg.checkpoint.keep_every)

    def close(self) -> None:
        """Wait until the saves in flight are on disk (a run stopped by an error keeps them)."""
        try:
            if self.manager is not None:
                try:
                    self._wait()
                finally:
                    with contextlib.suppress(Exception):  # a failed save was reported (`_failed`)
                        self.manager.close()
                    # no reference left: `settle` collects the failed writes the manager held
                    self.manager = None
        finally:
            if self._save_failed and self._noise is not None:
                self._noise.settle()  # the failed save's writes still in flight, see `quiet`
            self._noise = None
            self._quiet.close()


def _restore(engine: Engine, fresh: TrainState, paths: list[Path], digest: str | None = None) -> tuple[Restored, list[str]]:
    """The first of `paths` that is not damaged, restored, and a warning for each one skipped;
    refuses one past train.steps."""
    restored, skipped = restore_first_valid(engine, fresh, paths, digest)
    if restored.step > engine.cfg.train.steps:
        raise ConfigError(
            f"checkpoint {restored.path} is at step {restored.step}, past train.steps={engine.cfg.train.steps}"
        )
    return restored, [passed_over(p, why, "resuming from") for p, why in skipped]


def _set_aside_warning(root: Path, resumed: Path, later: list[Path]) -> list[str]:
    if not later:
        return []
    return [f"checkpoint.dir {root} holds later checkpoints than the one resumed ({resumed}): step"
            f"{'s' if len(later) > 1 else ''} {', '.join(p.name for p in later)} will be moved to "
            f"{root / storage.SET_ASIDE}"]
