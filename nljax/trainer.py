"""The training loop: builds the run from a config, steps it with the Conductor, evaluates,
logs and reports throughput. Only process 0 prints and writes files.

`train` is three stages, each a plain function so that a hook (checkpoints, lockstep checks,
memory reports) is one call in one place: `startup_report`, `train_loop`, `final_report`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax
import yaml

from nljax import __version__, budget, distributed, levels, mesh as meshlib, optim, runlog, tasks, throughput
from nljax.checkpoint import Checkpoints
from nljax.comm import account
from nljax.conductor import Conductor, pattern_name
from nljax.config import Config, ConfigError, to_dict
from nljax.models import build
from nljax.runlock import RunLock
from nljax.state import TrainState, bytes_per_device, describe_memory
from nljax.step import Engine, StepCache
from nljax.tasks import Task, host_sum


def is_main() -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass
class Setup:
    """Everything a run is made of, built the same way by `train`, `comm` and the tests."""

    cfg: Config
    mesh: jax.sharding.Mesh
    engine: Engine
    cache: StepCache
    state: TrainState
    task: Task

    @classmethod
    def create(cls, cfg: Config, devices=None) -> "Setup":
        mesh = meshlib.make_mesh(cfg.mesh.inter, cfg.mesh.intra, devices)
        rows = meshlib.check_batch(cfg.train.batch_size, mesh)
        if rows % cfg.train.accum_steps:
            raise ConfigError(
                f"train.accum_steps={cfg.train.accum_steps} does not divide the {rows} rows each device holds "
                f"(train.batch_size={cfg.train.batch_size} over {meshlib.data_size(mesh)} devices)"
            )
        # Refused before anything is allocated (nljax/budget.py): from the config alone first, so
        # that an absurd size never reaches Flax or XLA, then from the exact shapes.
        local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        available = budget.available_bytes(local)
        budget.check(budget.config_floor(cfg, meshlib.data_size(mesh)), available)
        model = build(cfg)
        engine = Engine.create(cfg, model, mesh)
        budget.check(budget.engine_terms(cfg, engine), available)
        state = engine.init_state(jax.random.key(cfg.seed), cfg.train.batch_size)
        task = tasks.build(getattr(model, "task", "text"), cfg, mesh)
        return cls(cfg, mesh, engine, StepCache(engine), state, task)

    def batch(self, step: int) -> dict:
        return self.task.batch(step)

    def evaluate(self, params, step: int = 0) -> dict:
        return self.task.evaluate(self.cache, params, step)


class RunDir:
    """The files of one run. Refuses to overwrite an earlier run unless told to (or resuming it);
    when told to, removes the earlier run's outputs first so that none of them outlives it."""

    OUTPUTS = ("metrics.jsonl", "summary.json", "config.yaml", "loss.png", "step_time.png", "events.out.tfevents.*",
               "profile")  # and the files the run noted (runlog.note_written: samples_*.png)

    def __init__(self, path: str, overwrite: bool, write: bool, resume_step: int | None = None):
        self.path = Path(path)
        self.write = write
        self.kept: list[dict] = []
        metrics = self.path / "metrics.jsonl"
        # Process 0 decides: on a shared file system the others could see its fresh metrics.jsonl.
        if distributed.main_decides(metrics.exists()) and not overwrite and resume_step is None:
            raise ConfigError(
                f"run.dir {path} already holds a run; choose another run.dir, resume it with --resume or set "
                "run.overwrite=true"
            )
        if write:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"run.dir {path} cannot be created: {e.strerror or e}") from None
            if resume_step is None and overwrite:  # never delete a file nobody asked to replace
                for pattern in self.OUTPUTS:
                    for old in self.path.glob(pattern):
                        shutil.rmtree(old) if old.is_dir() else old.unlink()
                runlog.remove_written(self.path)
            self.kept = [] if resume_step is None else kept_records(metrics, resume_step)
            tmp = self.path / "metrics.jsonl.tmp"  # replaced in one rename: a kill leaves old or new
            tmp.write_text("".join(runlog.strict_json(r) + "\n" for r in self.kept))
            tmp.replace(metrics)

    def save_config(self, cfg: Config) -> None:
        if self.write:
            (self.path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def log(self, record: dict) -> None:
        if self.write:
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(runlog.strict_json(record) + "\n")

    def save_summary(self, summary: dict) -> None:
        if self.write:
            (self.path / "summary.json").write_text(runlog.strict_json(summary, indent=1))


def kept_records(path: Path, step: int) -> list[dict]:
    """The records of an earlier metrics.jsonl for steps before `step`: a resumed run rewrites the
    steps from its checkpoint on, so the file ends up as the uninterrupted run's."""
    if not path.exists():
        return []
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            if record["step"] < step:
                # null stands for a non-finite number (runlog.strict_json): NaN again in memory
                keep.append({k: float("nan") if v is None else v for k, v in record.items()})
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill
    return keep


@dataclasses.dataclass
class Output:
    """Where a run reports: files (process 0 only), terminal, TensorBoard."""

    run: RunDir
    progress: runlog.Progress
    board: runlog.Board

    @classmethod
    def create(cls, cfg: Config, start: int = 0, unit: str = "tok", resume_step: int | None = None) -> "Output":
        main = is_main()
        run = RunDir(cfg.run.dir, cfg.run.overwrite, main, resume_step)
        run.save_config(cfg)
        progress = runlog.Progress(cfg.train.steps, start, cfg.train.log_every, cfg.run.quiet or not main, unit)
        # purge_step: TensorBoard drops the events a resumed run writes again
        board = runlog.Board(run.path if main and cfg.run.tensorboard else None, purge_step=resume_step)
        return cls(run, progress, board)

    def say(self, text: str) -> None:
        self.progress.say(text)

    def close(self) -> None:
        self.progress.close()
        self.board.close()


class Profiler:
    """A jax.profiler trace of steps [train.profile_start, + train.profile_steps) into
    run.dir/profile (TensorBoard's profile plugin or Perfetto read it); process 0 only."""

    def __init__(self, cfg: Config, path: Path, enabled: bool):
        self.first, self.n = cfg.train.profile_start, cfg.train.profile_steps if enabled else 0
        self.path, self.on = path / "profile", False

    def before(self, step: int) -> None:
        if self.n and step == self.first:
            jax.profiler.start_trace(str(self.path))
            self.on = True

    def after(self, step: int, last: bool) -> None:
        if self.on and (step == self.first + self.n - 1 or last):
            jax.profiler.stop_trace()
            self.on = False


def units_per_device(setup: Setup, batch: dict) -> int:
    """Tokens (or the task's unit) one device processes in a step on `batch`."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    return rows // setup.engine.n_devices * setup.task.units_per_row


def startup_report(setup: Setup, say) -> None:
    """Devices and mesh, model size, batch sizes (global, per device, micro, effective), the
    learning rate after batch scaling, and the parameters of each level."""
    cfg, eng, mesh = setup.cfg, setup.engine, setup.mesh
    n_dev, t = eng.n_devices, cfg.train
    rows_per_dev = t.batch_size // n_dev
    n_params = sum(n for n, _ in levels.level_sizes(eng.param_shapes, eng.level_tree, eng.n_levels))
    unit, per_row = setup.task.unit, setup.task.units_per_row
    say(f"nljax {__version__}: {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({jax.devices()[0].device_kind}), mesh inter={mesh.shape['inter']} x intra={mesh.shape['intra']}, "
        f"{jax.process_count()} process(es)")
    say(f"model {cfg.model.name}: {n_params:,} parameters")
    say(f"batch: global {t.batch_size} rows ({t.batch_size * per_row:,} {unit}) per optimizer step; per device "
        f"{rows_per_dev} rows in {t.accum_steps} micro-batch(es) of {rows_per_dev // t.accum_steps}; "
        f"effective batch {rows_per_dev // t.accum_steps} x {t.accum_steps} x {n_dev} devices = {t.batch_size} rows")
    lr = optim.peak_lr(cfg.optim, t.batch_size)
    scaled = "" if cfg.optim.lr_scaling == "none" else (
        f" (optim.lr {cfg.optim.lr:g} x {cfg.optim.lr_scaling} {t.batch_size}/{cfg.optim.base_batch_size})")
    say(f"optimizer {cfg.optim.name}: peak lr {lr:.4g}{scaled}, {cfg.optim.schedule} schedule, "
        f"{cfg.optim.warmup_steps} warm-up steps")
    say(levels.describe(eng.param_shapes, eng.level_tree, cfg.cms.periods))
    say(describe_memory(bytes_per_device(setup.state), eng.strategy.name))


@dataclasses.dataclass
class History:
    records: list = dataclasses.field(default_factory=list)
    skipped: int = 0  # steps whose gradients failed sync.check_grads

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None
    wall_s: float = 0.0  # the loop, compilation and evaluations included


def check_skipped(in_a_row: int, step: int, limit: int) -> None:
    """Stop a run that trains nothing: every one of the last `train.max_skipped` steps skipped.
    The flag is the same on every device, so every process stops at the same step."""
    if limit and in_a_row >= limit:
        raise ConfigError(
            f"stopped after step {step}: the last {in_a_row} steps were all skipped (gradient not finite or above "
            f"sync.max_grad_norm); lower optim.lr or check the data (train.max_skipped={limit}, 0: never stop)"
        )


def train_loop(setup: Setup, state: TrainState, conductor: Conductor, out: Output,
               ckpt: Checkpoints | None = None) -> tuple[TrainState, History]:
    """Steps from `conductor.step` to `train.steps`, saving checkpoints through `ckpt`. The next
    batch is built while the device runs the current step; the step time runs from dispatch
    until its loss is on the host."""
    cfg, steps = setup.cfg, setup.cfg.train.steps
    key = f"{setup.task.unit}_per_s_per_device"
    # A resumed run's plots and summary cover the whole run: the earlier steps come from the
    # metrics.jsonl records it kept.
    kept = out.run.kept
    hist = History(records=list(kept), skipped=sum(bool(r.get("skipped")) for r in kept))
    seen, t_start = set(), time.perf_counter()
    in_a_row = len(kept) - next((i + 1 for i in reversed(range(len(kept))) if not kept[i].get("skipped")), 0)
    profiler = Profiler(cfg, out.run.path, out.run.write)
    batch = setup.batch(conductor.step) if conductor.step < steps else None
    if ckpt is not None and batch is not None:
        batch = ckpt.first_batch(conductor.step, batch)  # after a resume that restarted every row
    for i in range(max(steps - conductor.step, 0)):
        p = conductor.pulse
        distributed.check_step(i, p, cfg.distributed.check_every)
        last = p.step == steps - 1
        variant = setup.cache.variant(p.active, batch)
        compiled = variant not in seen  # the first call of a variant includes its compilation
        seen.add(variant)
        units = units_per_device(setup, batch)
        profiler.before(p.step)
        t0 = time.perf_counter()
        state, m = setup.cache.train(p.active, state, batch)
        batch = None if last else setup.batch(p.step + 1)  # overlaps the step on the device
        loss = host_sum(m["loss_sum"]) / host_sum(m["count"])  # waits for the step
        dt = time.perf_counter() - t0
        profiler.after(p.step, last)
        was_skipped = bool(m["skipped"].addressable_data(0))  # the same on every device
        norms, lskip = (m[k].addressable_data(0).tolist() for k in ("level_grad_norm", "level_skipped"))  # per level
        skipped_levels = [l for l in p.active_levels if lskip[l]]
        if was_skipped:
            hist.skipped += 1
            out.say(f"warning: step {p.step}: levels {skipped_levels} skipped (gradient norm not finite or above "
                    f"sync.max_grad_norm)")
        stalled = len(skipped_levels) == len(p.active_levels)  # nothing trained this step
        in_a_row = in_a_row + 1 if stalled else 0
        conductor = conductor.advance()  # after the step's synchronization
        rec = {
            "step": p.step,
            "loss": loss,
            "active_levels": p.active_levels,
            "pattern": p.name,
            "step_time_s": dt,
            key: units / dt,
            "compiled": compiled,
            "skipped": was_skipped,
            **{f"grad_norm_l{l}": float(norms[l]) for l in p.active_levels}, "skipped_levels": skipped_levels,
        }
        if variant != p.active:
            rec["micro_batches"] = variant[1]  # a tail batch that ends a data pass
        evaluated = {}
        if cfg.eval.every and (p.step + 1) % cfg.eval.every == 0 and not last:
            evaluated = setup.evaluate(state.params, p.step + 1)
            rec.update(evaluated)
        out.run.log(rec)
        if ckpt is not None:
            ckpt.maybe_save(p.step + 1, state)  # copies off the devices before the next step donates
        out.board.scalars("train", {"loss": loss, "step_time_s": dt, key: units / dt}, p.step)
        out.board.scalars("eval", evaluated, p.step + 1)
        out.progress.update(rec, units / dt, last, runlog.format_metrics(evaluated))
        hist.records.append(rec)
        check_skipped(in_a_row, p.step, cfg.train.max_skipped)
    hist.wall_s = time.perf_counter() - t_start
    out.progress.close()
    return state, hist


def final_report(setup: Setup, state: TrainState, hist: History, out: Output,
                 resumed_from: int | None = None) -> dict:
    """Final evaluation, the throughput table, communication from the HLO, summary.json and the
    plots."""
    cfg, eng = setup.cfg, setup.engine
    final_eval = setup.evaluate(state.params, cfg.train.steps)
    out.board.scalars("eval", final_eval, cfg.train.steps)
    batch = setup.batch(0)
    comm = account(setup.cache, state, batch)  # reads the executables that trained
    wire = {v["active"]: v["wire_bytes"] for v in comm["variants"]}
    counts = throughput.patterns_in_run(cfg.cms.periods, 0, cfg.train.steps)
    measured = throughput.measure(setup, state, batch, list(counts), cfg.throughput.reps, cfg.throughput.split)
    device_kind = jax.devices()[0].device_kind
    table = throughput.report(
        measured, counts, Conductor(cfg.cms.periods).patterns(), wire, units_per_device(setup, batch),
        eng.n_devices, throughput.peak_flops(device_kind, cfg.throughput.peak_tflops), setup.task.unit,
    )
    key = f"{setup.task.unit}_per_s_per_device"
    steady = [r for r in hist.records if not r["compiled"]]
    if steady:  # what the loop itself achieved, compilation excluded
        units = sum(r[key] * r["step_time_s"] for r in steady)
        table["measured_in_loop"] = {"steps": len(steady), key: units / sum(r["step_time_s"] for r in steady)}
    table["device_kind"] = device_kind
    if jax.devices()[0].platform == "cpu" and eng.n_devices > 1:
        table["note"] = "CPU devices share the host's cores: comm_ms measures contention more than communication"
    summary = {
        "nljax_version": __version__,
        "steps": cfg.train.steps,
        "resumed_from_step": resumed_from,
        "devices": eng.n_devices,
        "mesh": dict(setup.mesh.shape),
        "final_loss": hist.final_loss,
        **final_eval,
        "throughput": table,
        "communication": {
            "mean_wire_bytes_per_step": comm["mean_wire_bytes_per_step"],
            "ddp_wire_bytes_per_step": comm["ddp_wire_bytes_per_step"],
            "ratio_vs_ddp": comm["ratio_vs_ddp"],
            "wire_bytes_per_pattern": wire,
        },
        "wall_time_s": hist.wall_s,
        "skipped_steps": hist.skipped,
        "memory_bytes_per_device": bytes_per_device(state),
        "strategy": eng.strategy.name,
    }
    out.run.save_summary(summary)
    if out.run.write and cfg.run.plots:
        runlog.plot(out.run.path, hist.records, table["per_pattern"], final_eval)
    out.say(f"final eval: {runlog.format_metrics(final_eval)}")
    out.say(throughput.format_table(table))
    every = tuple(True for _ in cfg.cms.periods)  # all levels fire: the expected worst case
    if every in measured.step_s and table["worst_pattern"] != pattern_name(every):
        out.say(f"note: {table['worst_pattern']} timed slower than {pattern_name(every)}, where all levels fire: "
                f"their difference is within the timing noise")
    if comm["ratio_vs_ddp"] is not None:
        out.say(f"communication per device per step (HLO): {comm['mean_wire_bytes_per_step']:,.0f} B, "
                f"{comm['ratio_vs_ddp']:.3f} x a DDP all-reduce of every parameter")
    return summary


def take_lock(cfg: Config) -> RunLock:
    """Process 0 locks run.dir (nljax/runlock.py); every process raises when it is refused."""
    lock, error = RunLock(cfg.run.dir), None
    if is_main():
        try:
            lock.acquire()
        except ConfigError as e:
            error = e
    if distributed.main_decides(error is not None):
        raise error or ConfigError(f"run.dir {cfg.run.dir} is in use by a live run (see process 0)")
    return lock


def train(cfg: Config) -> dict:
    setup = Setup.create(cfg)
    say = print if is_main() and not cfg.run.quiet else (lambda *a: None)
    distributed.check_startup(setup, say)
    ckpt = Checkpoints(setup, say)  # reads and checks a checkpoint to resume before anything is written
    lock = take_lock(cfg)  # before the first write: a live run in run.dir refuses this one
    try:
        out = Output.create(cfg, ckpt.start, runlog.short_unit(setup.task.unit), ckpt.resume_step)
    except BaseException:
        lock.release()
        raise
    ckpt.open()
    try:
        startup_report(setup, out.say)
        state, hist = train_loop(setup, ckpt.state, Conductor(cfg.cms.periods, ckpt.start), out, ckpt)
        ckpt.finish(cfg.train.steps, state)  # the final save; waits until every save is on disk
        summary = final_report(setup, state, hist, out, ckpt.start if ckpt.restored else None)
    finally:
        ckpt.close()  # a run stopped by an error keeps the saves it started
        out.close()
        lock.release()
    setup.state = state
    return summary
