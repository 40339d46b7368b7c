"""The training loop: builds the run from a config, steps it with the Conductor, evaluates,
logs and reports throughput. Only process 0 prints and writes files.

`train` is three stages, each a plain function: `startup_report`, `train_loop` (the steps of
`nljax.run.loop.training_steps` with hooks for evaluation, logging, checkpoints and the profiler) and
`final_report` (the final evaluation, `comm_report` and `throughput_report`, merged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from nljax.checkpoint import initparams, storage
from nljax.checkpoint.lifecycle import Checkpoints
from nljax.checkpoint.taken import inside_run_dir, refuse_anothers, refuse_taken
from nljax.config import Config
from nljax.data import imagefolder
from nljax.engine import optim
from nljax.engine.conductor import Conductor, pattern_name
from nljax.engine.core import decays_of
from nljax.engine.state import TrainState, bytes_per_device, describe_memory
from nljax.errors import ConfigError
from nljax.measure import flops
from nljax.measure.comm import comm_per_step
from nljax.models import builtin, registry
from nljax.parallel import levels
from nljax.run import harness, startup, throughput
from nljax.run.core import Run
from nljax.run.loop import Hooks, Profiler, StepResult, fires, training_steps
from nljax.run.phases import Announced, closing_lines, compile_announcer
from nljax.run.samples import TrainingSampler, sample_line
from nljax.run.trackers import Trackers, check_installed, step_scalars
from nljax.runtime import compile_cache, distributed, exportdir, preemption, runlog
from nljax.runtime.launchenv import ENV_LAUNCHER
from nljax.runtime.preemption import Notice, Preempted
from nljax.runtime.rundir import RunDir, check_free, checkpoint_dir, kept_records, logged_a_step, take_lock
from nljax.version import __version__


def is_main() -> bool:
    return jax.process_index() == 0


def _decided(cfg: Config, write):
    """`write()` on process 0 (its value); when it cannot, every process stops here, before
    the trackers' collectives (the others would wait in them until the timeout)."""
    value, error = None, None
    try:
        value = write()
    except ConfigError as e:
        error = e
    except OSError as e:  # as a ConfigError: every process leaves through the same path (cli.main)
        error = ConfigError(f"cannot write {e.filename or cfg.run.dir}: [Errno {e.errno}] {e.strerror or e}")
    if distributed.main_decides(error is not None) or error is not None:
        raise error or ConfigError("process 0 could not write the run's files (its line says why)")
    return value


@dataclasses.dataclass
class Output:
    """Where a run reports: files (process 0 only), terminal, trackers (TensorBoard, W&B)."""

    run: RunDir
    progress: runlog.Progress
    trackers: Trackers
    # A resume's settings, written to config.yaml once its first step has run (`save_config`): a
    # resume that fails before (out of memory at a larger train.batch_size) left them there, and
    # the next plain --resume failed the same way.
    config_due: Config | None = None

    @classmethod
    def create(cls, cfg: Config, start: int = 0, unit: str = "tok", resume_step: int | None = None,
               tracker_ids: dict | None = None) -> "Output":
        """`tracker_ids`: those saved in the checkpoint a resume continues (W&B's run id)."""
        run = _decided(cfg, lambda: RunDir(cfg.run.dir, cfg.run.overwrite, is_main(), resume_step))
        # The trackers open before config.yaml is written: a tracker that fails to start (W&B online
        # without an account) stopped a resume after its config.yaml had been replaced by the
        # failed attempt's settings, which the next plain --resume then ran with.
        trackers = Trackers.open(cfg, is_main(), resume_step, tracker_ids)
        # decided from the config alone: the same on every process (a collective), whatever each sees
        due = cfg if resume_step is not None and storage.continues_own(cfg) else None
        if due is None:
            try:
                _decided(cfg, lambda: run.save_config(cfg))
            except BaseException:
                with contextlib.suppress(Exception):  # W&B's finish offline, say: the line above is the one to see
                    trackers.close(failed=True)
                raise
        # after the write: its failure's line is not left under an empty progress bar
        progress = runlog.Progress(cfg.train.steps, start, cfg.train.log_every, cfg.run.quiet or not is_main(), unit)
        return cls(run, progress, trackers, due)

    def save_config(self) -> None:
        """config.yaml written with this run's settings, once (every process: process 0 writes)."""
        if self.config_due is not None:
            cfg, self.config_due = self.config_due, None
            _decided(cfg, lambda: self.run.save_config(cfg))

    def say(self, text: str) -> None:
        self.progress.say(text)

    def close(self, failed: bool = False) -> None:
        self.progress.close()
        self.trackers.close(failed)


def startup_report(run: Run, state: TrainState, say) -> None:
    """Devices and mesh, model size, batch sizes (global, per device, micro, effective), the
    learning rate after batch scaling, and the parameters of each level."""
    cfg, eng, mesh = run.cfg, run.engine, run.mesh
    n_dev, t = eng.n_devices, cfg.train
    rows_per_dev = t.batch_size // n_dev
    n_params = sum(n for n, _ in levels.level_sizes(eng.param_shapes, eng.level_tree, eng.n_levels))
    unit, per_row = run.task.unit, run.task.units_per_row
    say(f"nljax {__version__}: {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({jax.devices()[0].device_kind}), mesh inter={mesh.shape['inter']} x intra={mesh.shape['intra']} "
        f"x model={eng.tp}, "
        f"{jax.process_count()} process(es)")
    say(f"model {cfg.model.name}: {n_params:,} parameters")
    for note in builtin.interpreted(cfg, eng.model):  # a GPU kernel asked for on a CPU: trained by, slowly
        say(note)
    d = run.task.describe() if hasattr(run.task, "describe") else {}
    if "train_images" in d:  # a MeanFlow run's images
        # a folder's class names, label 0 first (torchvision's class_to_idx): which folder is which label
        names = f" ({imagefolder.short_list(d['classes'])})" if "classes" in d else ""
        say(f"images {d['source']}: {d['train_images']:,} training and {d['eval_images']:,} held-out, "
            f"{'x'.join(map(str, d['shape']))}, classes {d['num_classes']}"
            f"{' (unconditional)' if not d['num_classes'] else names}, digest {d['digest'][:12]}")
    elif d:  # text: tokens
        say(f"data {d['source']}: {d['train_tokens']:,} training and {d['eval_tokens']:,} held-out tokens, "
            f"vocabulary {d['vocab_size']:,}, digest {d['digest'][:12]}")
        if d.get("eval_sets"):  # data.eval_sets: scored at every evaluation as eval_loss/<name>, ...
            digests = d.get("eval_set_digests", {})  # what a resume or the other processes compare
            say("held-out sets (data.eval_sets): " + ", ".join(
                f"{k} {n:,} tokens" + (f" (digest {digests[k][:12]})" if k in digests else "")
                for k, n in d["eval_sets"].items()))
    say(f"batch: global {t.batch_size} rows ({t.batch_size * per_row:,} {unit}) per optimizer step; per device "
        f"{rows_per_dev} rows in {t.accum_steps} micro-batch(es) of {rows_per_dev // t.accum_steps}; "
        f"effective batch {rows_per_dev // t.accum_steps} x {t.accum_steps} x {n_dev} devices = {t.batch_size} rows")
    lr = optim.peak_lr(cfg.optim, t.batch_size)
    scaled = "" if cfg.optim.lr_scaling == "none" else (
        f" (optim.lr {cfg.optim.lr:g} x {cfg.optim.lr_scaling} {t.batch_size}/{cfg.optim.base_batch_size})")
    o = cfg.optim
    rule = (f"sgd with {'Nesterov ' if o.nesterov else ''}momentum {o.momentum:g}" if o.name == "sgd" and o.momentum
            else o.name)
    average = f"; evaluation and the tools read the moving average (optim.ema_decay={o.ema_decay:g})" if o.ema_decay else ""
    say(f"optimizer {rule}: peak lr {lr:.4g}{scaled}, {o.schedule} schedule, {o.warmup_steps} warm-up "
        f"steps{weight_decay(cfg, eng)}{average}")
    say(levels.describe(eng.param_shapes, eng.level_tree, cfg.cms.periods))
    say(describe_memory(bytes_per_device(state), eng.strategy.name))


@dataclasses.dataclass
class History:
    """What the run's end reads of its steps (the summary, the loop's own throughput), counted as
    they come: not the records, which a long run would hold without bound (1.6 KB a step; the
    plots read metrics.jsonl back). A resumed run's counts start from the records it kept."""
    unit_key: str  # the records' rate: tokens_per_s_per_device, images_per_s_per_device
    steps: int = 0  # records counted, a resume's kept ones included
    final_loss: float | None = None
    skipped: int = 0  # steps where a level's update was skipped (sync.check_grads, sync.max_grad_norm)
    stalled_in_a_row: int = 0  # the latest steps in a row where every active level skipped
    # the steps not compiled: their count, units (per device) and seconds
    steady_steps: int = 0
    steady_units: float = 0.0
    steady_s: float = 0.0
    wall_s: float = 0.0  # the loop, compilation and evaluations included
    # train.target_eval_loss met: (the steps done when the run stopped, that evaluation's metrics)
    target_met: tuple[int, dict] | None = None

    def add(self, record: dict) -> None:
        self.steps += 1
        self.final_loss = record.get("loss")
        self.skipped += bool(record.get("skipped"))
        s = stalled(record)
        self.stalled_in_a_row = self.stalled_in_a_row + 1 if s else self.stalled_in_a_row if s is None else 0
        if record.get("compiled") is False and self.unit_key in record:  # what the loop achieved, compiling excluded
            self.steady_steps += 1
            self.steady_units += record[self.unit_key] * record["step_time_s"]
            self.steady_s += record["step_time_s"]

    def end(self, steps: int) -> int:
        """The steps done at the run's end: `steps` (train.steps), or fewer where the target was met."""
        return self.target_met[0] if self.target_met else steps


def meets_target(evaluated: dict, target: float) -> bool:
    """Whether an evaluation's eval_loss (the main held-out text's) is at or below
    train.target_eval_loss (0: off). Every process decides alike with no exchange: the loss is
    the same bits on each, its sums gathered whole to every process and added in one order
    there (`hostdev.host_sum`), so all of them stop after the same step."""
    return bool(target) and evaluated.get("eval_loss", math.inf) <= target


def check_skipped(in_a_row: int, step: int, limit: int) -> None:
    """Stop a run that trains nothing: every one of the last `train.max_skipped` steps skipped.
    The flag is the same on every device, so every process stops at the same step."""
    if limit and in_a_row >= limit:
        raise ConfigError(
            f"stopped after step {step}: the last {in_a_row} steps were all skipped (gradient not finite or above "
            f"sync.max_grad_norm); lower optim.lr or check the data (train.max_skipped={limit}, 0: never stop)"
        )


def stalled(record: dict) -> bool | None:
    """True: every active level's update was skipped at this step; False: one trained; None: no
    level was active (level 0 with a period above 1), so nothing could be skipped and the count
    of stalled steps in a row goes on unchanged."""
    active = record.get("active_levels", ())
    return len(record.get("skipped_levels", ())) == len(active) if active else None


def resumed(kept: Iterable[dict], unit_key: str) -> History:
    """The history of a resumed run's kept records (none for a fresh run), with the stalled steps at
    its end the same on every process (process 0 alone has the records: it tells the others, which
    would otherwise count from 0 and go on into a step after process 0 stopped)."""
    hist = History(unit_key)
    for r in kept:
        hist.add(r)
    if jax.process_count() > 1:
        hist.stalled_in_a_row = int(multihost_utils.broadcast_one_to_all(np.int32(hist.stalled_in_a_row)))
    return hist


def train_loop(run: Run, state: TrainState, conductor: Conductor, out: Output,
               ckpt: Checkpoints | None = None, notice: Notice | None = None) -> tuple[TrainState, History]:
    """Steps from `conductor.step` to `train.steps` (`loop.training_steps`) with the hooks of
    `loop_hooks`, saving checkpoints through `ckpt`; stops a run whose steps all skip, and
    after a preemption notice (`nljax.runtime.preemption`; `notice`: one opened before, by `train`, else
    the loop's own) saves and raises `Preempted`. After an evaluation that meets
    `train.target_eval_loss` it stops, saved, and returns (`History.target_met`); a resume with
    that target evaluates its checkpoint first, and one that meets it trains no step."""
    if notice is None:
        with Notice() as notice:
            return train_loop(run, state, conductor, out, ckpt, notice)
    # A resumed run's plots and summary cover the whole run: the earlier steps come from the
    # metrics.jsonl records it kept.
    hist = resumed(out.run.kept(), f"{run.task.unit}_per_s_per_device")  # process 0's records
    t_start = time.perf_counter()
    target, steps = run.cfg.train.target_eval_loss, run.cfg.train.steps
    if target and ckpt is not None and ckpt.restored and conductor.step < steps:  # a run that stopped on it, say
        with Announced(out.say)(f"evaluating the checkpoint (step {conductor.step}) against train.target_eval_loss"):
            params = run.model_params(state)  # computed once: the harness reads it too
            # the held-out sets alone, no harness tasks (minutes)
            evaluated = run.task.evaluate(run.cache, params, conductor.step)
        if not meets_target(evaluated, target):
            out.say(f"the checkpoint's eval_loss {evaluated['eval_loss']:.4f} is above train.target_eval_loss="
                    f"{target:g}: training on")
        else:
            if run.harness is not None:  # this evaluation is the final report's: its harness scores too
                evaluated.update(run.harness.evaluate(params))
            hist.target_met = conductor.step, evaluated
            # the final report's scores: sent unless the trackers hold an evaluation at this step
            # already (a checkpoint between evaluations: a preemption's, or eval.every set on resume)
            if not out.run.evaluated_at(conductor.step):
                out.trackers.scalars("eval", evaluated, conductor.step)
            out.say(f"the checkpoint's eval_loss {evaluated['eval_loss']:.4f} is at or below train.target_eval_loss="
                    f"{target:g}: no step trained (set it lower, or 0, to train on to train.steps={steps})")
            out.progress.close()
            return state, hist
    hooks, profiler = loop_hooks(run, out, ckpt)
    if conductor.step < run.cfg.train.steps:
        profiler.start(conductor.step)
    # after a resume that restarted every row's memory, the first batch resets every row
    reset_first = ckpt is not None and ckpt.rows_restarted and conductor.step == ckpt.start
    keep = lambda step: hooks.keeps(step) or profiler.keeps(step)  # the step's state is read after it
    preempted = False

    def stop(step: int) -> bool:
        nonlocal preempted
        preempted = notice.stop_after(step)  # asked at every step, on every process
        return preempted or hist.target_met is not None

    # Ctrl-C is a notice once a step of this process is done: before, as the first step compiles (a
    # minute on a CPU, several on a GPU), there is nothing to save, and it stops at once
    notice.looped = True
    try:
        r = None
        for r in training_steps(run, state, conductor, reset_first, keep, stop):
            state = r.state if r.state is not None else state  # None: dispatched ahead, donated
            notice.in_loop = True
            _after_step(r, run, hist, hooks, out)
            if meets_target(r.evaluated, target):  # the loop stops after this step (`stop`)
                hist.target_met = r.step + 1, r.evaluated
        if r is not None and not r.last and not preempted:  # train.target_eval_loss met
            profiler.end(r.step)  # a profile window it stopped inside ends with it
            out.say(f"step {r.step:6d}  eval_loss {r.evaluated['eval_loss']:.4f} is at or below "
                    f"train.target_eval_loss={target:g}: the run stops after {r.step + 1} of {steps} steps")
        elif r is not None and not r.last:  # a notice stopped the loop: save at this step boundary and stop
            # the save first: the trace's end and summary (seconds for a large trace) after it,
            # within the notice's grace period
            saved = ckpt is not None and ckpt.save_now(r.step + 1, r.state)
            profiler.end(r.step)
            out.progress.close()
            raise Preempted(r.step, notice.received or signal.SIGTERM, saved)
    finally:
        notice.in_loop = False
    hist.wall_s = time.perf_counter() - t_start
    out.progress.close()
    return state, hist


def _after_step(r: StepResult, run: Run, hist: History, hooks: Hooks, out: Output) -> None:
    """Account one step (skips, stalls), run the hooks, record it; stops a run whose steps all skip."""
    skipped_levels = r.record["skipped_levels"]
    if r.record["skipped"]:
        hist.skipped += 1
        out.say(f"warning: step {r.step}: levels {skipped_levels} skipped (gradient norm not finite or above "
                f"sync.max_grad_norm)")
    out.save_config()  # a resume's settings, now that a step ran with them (before a save names them)
    hooks.run(r)
    hist.add(r.record)
    check_skipped(hist.stalled_in_a_row, r.step, run.cfg.train.max_skipped)


def loop_hooks(run: Run, out: Output, ckpt: Checkpoints | None) -> tuple[Hooks, Profiler]:
    """What runs between steps, in this order: the profiler's stop, evaluation every
    `eval.every` steps (not after the last: `final_report` evaluates), the step's model FLOP/s
    and MFU (`throughput.StepRates`), the metrics.jsonl record, the checkpoint, the trackers and
    the progress bar, a text sample every `train.sample_every` steps, the trackers flushed at a
    checkpoint's step and the last, the profiler's start."""
    cfg, key = run.cfg, f"{run.task.unit}_per_s_per_device"
    n_levels = len(cfg.cms.periods)
    profiler = Profiler(cfg.train.profile_start, cfg.train.profile_steps, out.run.path, out.say, here=out.run.write)
    hooks = Hooks()
    hooks.add(profiler.stop)

    evaluating, saving = Announced(out.say), Announced(out.say)

    def evaluate(r: StepResult) -> None:
        if not r.last:
            with evaluating(f"step {r.step:6d}  evaluating after {r.step + 1} steps"):  # as loss.png places it
                try:
                    r.evaluated = run.evaluate(run.model_params(r.state), r.step + 1)
                except Exception:
                    keep_steps_of_a_failed_evaluation(r)
                    raise
            r.record.update(r.evaluated)

    def keep_steps_of_a_failed_evaluation(r: StepResult) -> None:
        """An evaluation that raises (lm-eval on a task it cannot run, a broken eval file) ends the
        run; the steps since the last checkpoint are saved first, with their record, so that
        `--resume` goes on from here. One process only: a save is collective, and a failure on
        one process of several would leave the others out of it."""
        if ckpt is None or jax.process_count() > 1:
            return
        out.run.log(r.record)
        if ckpt.save_now(r.step + 1, r.state):
            out.say(f"step {r.step:6d}  the evaluation failed; checkpoint {r.step + 1} saved (resume with --resume)")

    def save(r: StepResult) -> None:
        with saving(f"step {r.step:6d}  saving checkpoint {r.step + 1}"):
            ckpt.maybe_save(r.step + 1, r.state)

    def report(r: StepResult) -> None:
        rec = r.record
        # at the number of steps done, as evaluations, samples and checkpoints count them
        out.trackers.scalars("train", step_scalars(rec, n_levels, key), r.step + 1)
        out.trackers.scalars("eval", r.evaluated, r.step + 1)
        out.progress.update(rec, r.units_per_s, r.last, runlog.format_metrics(r.evaluated))

    sampler = TrainingSampler(run) if cfg.train.sample_every else None

    sampling = Announced(out.say)

    def sample(r: StepResult) -> None:  # every process: the sampler runs on the whole mesh
        with sampling(f"step {r.step:6d}  sampling"):
            text, why = sampler.sample(run.model_params(r.state))
        out.say(sample_line(r.step, text, why))
        # after the step's scalars: W&B takes steps in increasing order
        out.trackers.text("train/sample", text, r.step + 1)

    rates = throughput.StepRates(run)
    hooks.add(evaluate, every=cfg.eval.every, reads_state=True)
    hooks.add(lambda r: r.record.update(rates(r.variant, r.units_per_s, r.record["step_time_s"])))
    hooks.add(lambda r: out.run.log(r.record))
    if ckpt is not None:  # copies off the devices before the next step donates the state
        hooks.add(save, every=cfg.checkpoint.every, reads_state=True)
    hooks.add(report)
    hooks.add(sample, every=cfg.train.sample_every, reads_state=True)

    def flush(r: StepResult) -> None:
        # a resume from this step's checkpoint logs only the steps after it: the trackers' steps
        # up to it go on disk with it (the final one's: the last step), not only at the run's end
        if r.last or (ckpt is not None and fires(cfg.checkpoint.every, r.step)):
            out.trackers.flush()

    hooks.add(flush)
    hooks.add(profiler.start_next)
    return hooks, profiler


def final_report(run: Run, state: TrainState, hist: History, out: Output,
                 resumed_from: int | None = None) -> dict:
    """summary.json, the plots and the printed report: the final evaluation, the communication
    read from the HLO and the throughput table, merged."""
    cfg, eng = run.cfg, run.engine
    end, final_eval = hist.target_met or (cfg.train.steps, None)  # that evaluation's: of the final state
    if final_eval is None:
        with Announced(out.say)("evaluating the final state"):
            final_eval = run.evaluate(run.model_params(state), cfg.train.steps)
    out.say(f"final eval: {runlog.format_metrics(final_eval)}")  # before the timing's minute
    # Not where a target was met at an evaluation (the trackers hold it already), nor on a resume
    # with nothing left to run whose trackers hold it: an earlier attempt's summary.json says so.
    # One cut in its final evaluation (Ctrl-C) wrote none, and its resume logs it; it was never
    # logged there.
    if not hist.target_met and (resumed_from != cfg.train.steps or not out.run.evaluated_at(cfg.train.steps)):
        out.trackers.scalars("eval", final_eval, cfg.train.steps)
        out.trackers.flush()
        # summary.json at once, its evaluation alone: a report cut after this (Ctrl-C in the timing,
        # a minute) leaves it, and its resume does not log the evaluation a second time
        # (checkpoint.every=0: a run cut there has no checkpoint to resume, and its report stays so)
        rest = "from its --resume" if cfg.checkpoint.every else "never, with checkpoint.every=0 (no checkpoint)"
        out.run.save_summary({"steps": end, "resumed_from_step": resumed_from, **final_eval,
                              "incomplete": f"the rest of the final report comes as it ends (a run cut before: "
                                            f"{rest})"})
    batch = run.batch(0)
    comm = comm_report(run, state, batch)
    held = bytes_per_device(state)  # before the timing, which consumes the state
    if cfg.throughput.reps and end:
        table, measured = throughput_report(run, state, batch, hist, comm["wire_bytes_per_pattern"], out.say)
    else:  # a quick run: no pattern compiled again for its timing, no table (of zeros) printed;
        # train.steps=0 (the initial parameters saved) runs no pattern: its table was a header
        # alone, after "timing 0 step variants" and "200 rounds of about 0 ms"
        why = "throughput.reps=0" if not cfg.throughput.reps else "train.steps=0"
        table, measured = {"skipped": why}, None
        out.say(f"timing skipped ({why}): summary.json has no throughput table")
    summary = {
        "nljax_version": __version__,
        "steps": end,
        **({"stopped_at_target_eval_loss": cfg.train.target_eval_loss} if hist.target_met else {}),
        "resumed_from_step": resumed_from,
        "devices": eng.mesh_devices,
        "mesh": dict(run.mesh.shape),
        "final_loss": hist.final_loss,
        **final_eval,
        "throughput": table,
        "communication": comm,
        "wall_time_s": hist.wall_s,
        "skipped_steps": hist.skipped,
        "memory_bytes_per_device": held,
        "strategy": eng.strategy.name,
    }
    describe = getattr(run.task, "describe", None)  # source, tokens or images, digest
    if describe is not None:
        summary["data"] = describe()
    out.run.save_summary(summary)
    if measured is not None:
        out.say(throughput.format_table(table))
    if measured is not None and (note := throughput.noisy_worst(
            table["worst_pattern"], [pattern_name(a) for a in measured.step_s], len(cfg.cms.periods),
            "throughput.reps")):
        out.say(note)
    if comm["ratio_vs_ddp"] is not None:
        tp = comm["mean_model_axis_wire_bytes_per_step"]
        out.say(f"per-level sync per device per step (HLO, mean over a cycle): "
                f"{comm['mean_wire_bytes_per_step'] - tp:,.0f} B, {comm['ratio_vs_ddp']:.3f} x a DDP all-reduce of "
                "every parameter" + (f"; tensor-parallel activations {tp:,.0f} B" if tp else ""))
    # drawn after the report's lines (matplotlib's import and drawing take ~2 s, which came
    # silently before the throughput table); the closing lines follow
    if out.run.write and cfg.run.plots:
        from nljax.measure import plots  # matplotlib: loaded only to draw

        for name in plots.NAMES if hist.steps else ():  # before they are made: an overwrite removes them
            runlog.note_written(out.run.path, name)
        records = plots.thinned(kept_records(out.run.path / "metrics.jsonl", math.inf), hist.steps)
        # a text task's bits per byte in a nat per token (the log's eval_bpb): loss.png shows both
        plots.write(out.run.path, records, table.get("per_pattern", {}), final_eval,
                    getattr(run.task, "bpb_per_nat", None))
    return summary


def comm_report(run: Run, state: TrainState, batch: dict) -> dict:
    """Bytes per step from the HLO of every pattern of a cycle, against a DDP all-reduce: on more
    than one device a pattern the run did not reach is compiled here (`comm.variant_collectives`)."""
    comm = comm_per_step(run.cache, state, batch)
    return {
        "mean_wire_bytes_per_step": comm["mean_wire_bytes_per_step"],
        "mean_model_axis_wire_bytes_per_step": comm["mean_model_axis_wire_bytes_per_step"],
        "ddp_wire_bytes_per_step": comm["ddp_wire_bytes_per_step"],
        "ratio_vs_ddp": comm["ratio_vs_ddp"],
        "wire_bytes_per_pattern": {v["active"]: v["wire_bytes"] for v in comm["variants"]},
    }


def throughput_report(run: Run, state: TrainState, batch: dict, hist: History,
                      wire: dict, say=lambda text: None) -> tuple[dict, throughput.Measured]:
    """The throughput table (every pattern of the run timed again, `nljax.run.throughput`, within
    `throughput.max_fraction` of the loop's time) with what the loop itself achieved, and the
    measurements it was made from."""
    cfg, eng = run.cfg, run.engine
    counts = throughput.patterns_in_run(cfg.cms.periods, 0, hist.end(cfg.train.steps))
    budget_s = cfg.throughput.max_fraction * hist.wall_s
    measured = throughput.measure(run.cache, state, batch, list(counts), cfg.throughput.reps, cfg.throughput.split,
                                  run.local, budget_s, say)
    device_kind = jax.devices()[0].device_kind
    units = run.units_per_device(batch)
    analytic = flops.analytic_flops(cfg, eng.model, eng.param_shapes)["total_per_unit"] * units
    table = throughput.report(
        measured, counts, Conductor(cfg.cms.periods).patterns(), wire, units,
        eng.mesh_devices, throughput.peak_flops(device_kind, cfg.throughput.peak_tflops), run.task.unit, analytic,
    )
    if hist.steady_steps:  # what the loop itself achieved, compilation excluded
        table["measured_in_loop"] = {"steps": hist.steady_steps, hist.unit_key: hist.steady_units / hist.steady_s}
    table["device_kind"] = device_kind
    if jax.devices()[0].platform == "cpu" and eng.mesh_devices > 1:
        table["note"] = "CPU devices share the host's cores: comm_ms measures contention more than communication"
    return table, measured


def resume_step_guess(cfg: Config) -> int:
    """The step a resume will most likely start from, read from the directory names alone (the
    restore may fall back to an older one, or refuse: `Checkpoints.resolve` says so later)."""
    try:
        paths = storage.candidates(cfg)
    except ConfigError:
        return 0
    return int(paths[0].name) if paths and paths[0].name.isdigit() else 0


def train(cfg: Config) -> dict:
    """One run, start to end. A preemption notice anywhere in it is a notice (`nljax.runtime.preemption`):
    one during start-up stops the run after its first step, saved."""
    with Notice() as notice:
        return _train(cfg, notice)


def _refuse_from_the_directories(cfg: Config) -> None:
    root = storage.checkpoint_dir(cfg)
    if cfg.checkpoint.resume == "latest" and not root.exists():  # a mistyped run.dir, or a first start
        raise ConfigError(f"checkpoint not found: {root} ({NOTHING_TO_RESUME})")
    storage.resume_root(cfg)
    initparams.source(cfg)  # missing, or given with another run's checkpoint.resume
    continues = storage.continues_own(cfg)
    refuse_anothers(cfg, continues)
    refuse_taken(cfg, continues, logged_a_step(Path(cfg.run.dir)))


def check_profile(cfg: Config) -> None:
    """A profile window (train.profile_start, train.profile_steps) that starts at or past
    train.steps records nothing: refused, not warned of (a warning scrolled away above the
    compilations, and --quiet hid it; the run then ended without a trace). No resume can make
    this command's window meaningful: train.steps is where this command stops, and a later resume
    that trains further takes its own train.profile_* (they may change on any resume)."""
    t = cfg.train
    if t.profile_steps and t.profile_start >= t.steps:
        raise ConfigError(f"train.profile_start={t.profile_start} is not before train.steps={t.steps}: no step of "
                          f"the train.profile_steps={t.profile_steps} window runs; set train.profile_start below "
                          f"{t.steps}, or train.profile_steps=0")


NOTHING_TO_RESUME = ("--resume continues a run that saved checkpoints there; to start this run, leave --resume out, "
                     "or give --resume=auto, which starts it or continues it")
TOKENIZED_AT_EACH_START = "at every start: python -m nljax.prepare does it once"


def _train(cfg: Config, notice: Notice) -> dict:
    check_profile(cfg)  # from the config alone, before anything is read or built
    # before the slow start-up (nljax.runtime.preemption), unless the command did as the processes joined
    preemption.check_in(lambda: resume_step_guess(cfg))
    check_free(cfg)  # a live run in run.dir: say so, not what it has not saved yet
    # a checkpoint to resume that is not there, an earlier run in run.dir or checkpoint.dir: read
    # from the directories alone, refused before the slow start-up (the model, its parameters and
    # optimizer state, compiling), on every process
    distributed.on_main(lambda: _refuse_from_the_directories(cfg), elsewhere=None)  # process 0's line on each
    compile_cache.enable(cfg.run.compile_cache)  # before anything compiles
    check_installed(cfg)  # before anything is written
    if is_main() and not cfg.run.quiet:  # building reads the data and lays out the model: seconds
        # an image model reads images.*, a text model data.*
        text = registry.task_of(cfg) != "images"
        data = f"data {cfg.data.source}" if text else f"images {cfg.images.source}"
        print(f"nljax {__version__}: building the run (model {cfg.model.name}, {data}) ...", flush=True)
        if text and cfg.data.source == "files" and cfg.data.train and not cfg.data.prepared:
            # the longest part of a start on a corpus not prepared (33 s for 20 MB with a BPE on a
            # 2-core CPU), done again at each start: said, with what does it once
            print(f"reading and tokenizing data.train into memory ({TOKENIZED_AT_EACH_START}) ...", flush=True)
    run = Run.create(cfg)
    cfg = run.cfg  # with what the data decide (model.vocab_size of a tokenizer): config.yaml, checkpoints
    say = print if is_main() and not cfg.run.quiet else (lambda *a: None)
    startup.check_startup(cfg, run.mesh, run.task, say)
    for note in getattr(run.task, "notes", ()):  # what the task adapted to the data (nljax/run/tasks.py)
        say(note)
    if cfg.train.sample_every:  # made to check its prompt (data.prepared's tokenizer may lack an end token)
        TrainingSampler(run)  # before anything is written; the loop makes its own (compiled at its first sample)
    run = harness.attach(run)  # eval.harness_tasks: lm-eval and the tasks checked before anything is written
    # reads and checks a checkpoint to resume before anything is written
    digest = startup.data_fingerprint(run.task)  # the same data under another spelling of its paths: no change
    with Announced(say)("initializing the parameters and the optimizer state"):  # compiles the model's init
        fresh = run.init_state()
    reading = ("reading the checkpoint to resume" if cfg.checkpoint.resume else
               "reading the checkpoint's parameters" if cfg.checkpoint.init_params else None)
    with Announced(say if reading else (lambda text: None))(reading or ""):
        # another tokenizer's checkpoint is refused
        ckpt = Checkpoints.resolve(run.engine, fresh, say, digest, startup.tokenizer_identity(run.task))
    ckpt.check_data(digest, startup.eval_set_digests(run.task), say)
    lock = take_lock(cfg)  # before the first write: a live run in run.dir refuses this one
    # the cleanup, in reverse order of registration; each step runs whatever the one before raised
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(lock.release)
        out = Output.create(cfg, ckpt.start, runlog.short_unit(run.task.unit), ckpt.resume_step, ckpt.trackers)
        run.cache.announce = compile_announcer(cfg.cms.periods, out.say)  # above the progress bar
        ckpt.trackers = out.trackers.ids  # saved with every checkpoint: a resume continues the same W&B run
        failed = True  # until the summary is written: a tracker marks a run that stopped early (W&B: failed)
        cleanup.callback(lambda: out.close(failed))
        cleanup.callback(ckpt.close)  # a run stopped by an error keeps the saves it started (a failed one found here)
        ckpt.open()
        # a resume's log cut back to its step only now, the later checkpoints set aside (`begin_log`)
        _decided(cfg, out.run.begin_log)
        startup_report(run, ckpt.state, out.say)
        # a resume of a run that finished (its checkpoint at train.steps): no step, no save (the
        # checkpoint is the final one); the final evaluation and summary.json are made again, as
        # the one report of this command (the trackers hold the scores already: `final_report`)
        done = ckpt.resume_step == cfg.train.steps
        if done:
            out.say(f"nothing left to train: the checkpoint is at step {ckpt.start} = train.steps (raise "
                    "train.steps to continue); evaluating it again for summary.json")
        state, hist = train_loop(run, ckpt.state, Conductor(cfg.cms.periods, ckpt.start), out, ckpt, notice)
        out.save_config()  # a resume with no step left to run
        end = hist.end(cfg.train.steps)  # fewer where train.target_eval_loss was met
        # nothing said where the checkpoint resumed is the final one (no step ran: `done`, or the target met)
        kept_as_is = ckpt.last_saved == end == ckpt.start
        final = Announced(out.say if cfg.checkpoint.every and not kept_as_is else (lambda text: None))
        with final(f"saving the final checkpoint ({end}) to {ckpt.dir}"):
            ckpt.finish(end, state)  # the final save; waits until every save is on disk
        try:
            summary = final_report(run, state, hist, out, ckpt.start if ckpt.restored else None)
        except KeyboardInterrupt:  # the training is kept: say so (several processes: the command's abort)
            if jax.process_count() > 1:
                raise
            raise preemption.Unreported(end, bool(cfg.checkpoint.every)) from None
        failed = False
        for line in closing(cfg, run, hist.target_met is not None):
            out.say(line)
    return summary


def weight_decay(cfg: Config, eng) -> str:
    """The start-up line's weight decay: how many parameters it applies to (`optim.decay_params`)."""
    if not cfg.optim.weight_decay:
        return ""
    decays = decays_of(cfg, eng.model) or (lambda path: True)
    sizes = [(decays(levels.path_str(p)), math.prod(x.shape))
             for p, x in jax.tree_util.tree_flatten_with_path(eng.param_shapes)[0]]
    return (f", weight decay {cfg.optim.weight_decay:g} on {sum(n for d, n in sizes if d):,} of "
            f"{sum(n for _, n in sizes):,} parameters (optim.decay_params={cfg.optim.decay_params})")


def closing(cfg: Config, run: Run, target_met: bool = False) -> list[str]:
    """The run's closing lines: where its outputs are and how to resume, sample and export it
    (`target_met`: it stopped at train.target_eval_loss, which its resume turns off to train on)."""
    if not cfg.checkpoint.every:
        return [f"run directory: {cfg.run.dir} (no checkpoint saved, checkpoint.every=0: nothing to resume, "
                "sample or export)"]
    text, script = run.task.unit == "tokens", registering_script(cfg)
    return closing_lines(cfg.run.dir, cfg.train.steps, text, str(Path(cfg.run.dir) / exportdir.DEFAULT),
                         None if inside_run_dir(cfg) else str(checkpoint_dir(cfg)),
                         samples=not text or hasattr(run.engine.model, "logits"), script=script,
                         registered_by=None if script else registered_here(cfg),
                         more="train.target_eval_loss=0" if target_met else None,
                         launcher=os.environ.get(ENV_LAUNCHER) if jax.process_count() > 1 else None)


def registered_here(cfg: Config) -> str | None:
    """The module that registered the run's model in this process (a notebook's `__main__`, a module
    a script imported; not nljax's own models, not a package's entry point, which every process
    loads), or None."""
    origin = registry.spec(cfg.model.name).origin
    return None if origin == "nljax" or origin.startswith(("nljax.", "plugin '")) else origin


def registering_script(cfg: Config) -> list[str] | None:
    """The command that runs the script this process runs, where it registered the run's model
    itself (a build function of `__main__`, as examples/smallest_model.py's): only a process that
    registers the model knows it, so the closing commands go through that script: `./my_model`
    where the script was executed by its path (its shebang: `run_by_shebang`), else
    `python my_model.py` (with or without `.py`). None: a package's or nljax's own model, one
    registered in a notebook or by a module the script imported (`registered_here`), or a script
    not run with the command first (`my_model.py train ...`): only that form says the script takes
    nljax's command there; one that passes its arguments to `nljax.train.main` itself refused the
    printed `python my_run.py train --resume ...` ("override 'train' must look like key=value"),
    and gets the calls instead."""
    if registry.spec(cfg.model.name).origin != "__main__" or sys.argv[1:2] != ["train"]:
        return None
    script = sys.argv[0] if sys.argv else ""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)  # none in a notebook's kernel
    try:  # the script as the user typed it, where it is the file Python runs (not a kernel's launcher)
        ran = bool(main_file) and bool(script) and os.path.samefile(script, main_file)
    except OSError:
        ran = False
    if not ran:
        return None
    return [script] if run_by_shebang(script, getattr(sys, "orig_argv", [])) else ["python", script]


def run_by_shebang(script: str, orig_argv: list[str]) -> bool:
    """Whether executing `script` by its path (`./my_model train ...`) runs what this process runs:
    it is executable, typed with a directory (a bare name is looked up in PATH), and this
    process's command line (`sys.orig_argv`) is the one the kernel makes of its `#!interpreter
    [argument]` line: [interpreter, argument, script, ...], or through `/usr/bin/env` (`-S`
    too) the argument's words then the script. Typed by hand, `python ./my_model` matches as well
    where the shebang runs that same `python` (`#!/usr/bin/env python`): then both are one command."""
    if os.name != "posix" or os.sep not in script or not os.access(script, os.X_OK):
        return False
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    interpreter, argument = [*first[2:].decode(errors="replace").split(None, 1), "", ""][:2]
    argument = argument.strip()  # the kernel passes the rest of the line as one argument
    if os.path.basename(interpreter) == "env":
        words = argument.removeprefix("-S").split() if argument.startswith("-S") else [argument]
    else:
        words = [interpreter, *([argument] if argument else [])]
    return orig_argv[:len(words) + 1] == [*words, script]
