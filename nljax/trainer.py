"""The training loop: builds the run from a config, steps it with the Conductor, evaluates,
logs and reports throughput. Only process 0 prints and writes files."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from nljax import __version__, levels, mesh as meshlib
from nljax.checkpoint import Checkpoints
from nljax.comm import account
from nljax.conductor import Conductor, pattern_name
from nljax.config import Config, ConfigError, to_dict
from nljax import tasks
from nljax.models import build
from nljax.state import TrainState
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
        model = build(cfg)
        engine = Engine.create(cfg, model, mesh)
        state = engine.init_state(jax.random.key(cfg.seed), cfg.train.batch_size)
        task = tasks.build(getattr(model, "task", "text"), cfg, mesh)
        return cls(cfg, mesh, engine, StepCache(engine), state, task)

    def batch(self, step: int) -> dict:
        return self.task.batch(step)

    def evaluate(self, params, step: int = 0) -> dict:
        return self.task.evaluate(self.cache, params, step)


class RunDir:
    """The files of one run. Refuses to overwrite an earlier run unless told to."""

    def __init__(self, path: str, overwrite: bool, write: bool, resume_step: int | None = None):
        self.path = Path(path)
        self.write = write
        if (self.path / "metrics.jsonl").exists() and not overwrite and resume_step is None:
            raise ConfigError(
                f"run.dir {path} already holds a run; choose another run.dir or set run.overwrite=true"
            )
        if write:
            self.path.mkdir(parents=True, exist_ok=True)
            keep = "" if resume_step is None else kept_records(self.path / "metrics.jsonl", resume_step)
            tmp = self.path / "metrics.jsonl.tmp"
            tmp.write_text(keep)
            tmp.replace(self.path / "metrics.jsonl")

    def save_config(self, cfg: Config) -> None:
        if self.write:
            (self.path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def log(self, record: dict) -> None:
        if self.write:
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def save_summary(self, summary: dict) -> None:
        if self.write:
            (self.path / "summary.json").write_text(json.dumps(summary, indent=1))


def kept_records(path: Path, step: int) -> str:
    """The lines of an earlier metrics.jsonl for steps before `step`: a resumed run rewrites the
    steps after its checkpoint, so the file ends up as the uninterrupted run's."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] < step:
                keep.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill
    return "".join(keep)


def throughput(times: dict[str, list[float]], tokens_per_device_step: int, n_devices: int) -> dict:
    """Per-device tokens/s: mean over all timed steps and worst case over pulse patterns."""
    per_pattern = {
        name: {
            "steps": len(ts),
            "mean_step_time_s": float(np.mean(ts)),
            "tokens_per_s_per_device": tokens_per_device_step / float(np.mean(ts)),
        }
        for name, ts in sorted(times.items())
        if ts
    }
    all_times = [t for ts in times.values() for t in ts]
    if not all_times:
        return {"per_pattern": per_pattern}
    mean_tps = tokens_per_device_step * len(all_times) / sum(all_times)
    worst = max(per_pattern, key=lambda k: per_pattern[k]["mean_step_time_s"])
    return {
        "per_pattern": per_pattern,
        "tokens_per_s_per_device_mean": mean_tps,
        "tokens_per_s_per_device_worst": per_pattern[worst]["tokens_per_s_per_device"],
        "worst_pattern": worst,
        "tokens_per_s_aggregate": mean_tps * n_devices,
    }


def time_missing_patterns(setup: Setup, state: TrainState, times: dict[str, list[float]], reps: int = 2) -> None:
    """Time the variants that only ran while compiling (e.g. all levels firing once at step 0) on
    a throwaway copy of the state, so the worst case is measured rather than left out."""
    conductor = Conductor(setup.cfg.cms.periods)
    batch = setup.batch(0)
    for active in conductor.patterns():
        name = pattern_name(active)
        if times.get(name):
            continue
        probe = jax.tree.map(lambda x: x.copy(), state)
        for r in range(reps + 1):
            t0 = time.perf_counter()
            probe, m = setup.cache.train(active, probe, batch)
            jax.block_until_ready(m)
            if r:  # the first call may compile
                times.setdefault(name, []).append(time.perf_counter() - t0)


def train(cfg: Config) -> dict:
    setup = Setup.create(cfg)
    main = is_main()
    quiet = cfg.run.quiet or not main
    say = (lambda *a: None) if quiet else print
    ckpt = Checkpoints(setup, say)  # reads (and checks) a checkpoint to resume before writing anything
    run = RunDir(cfg.run.dir, cfg.run.overwrite, main, ckpt.resume_step)
    run.save_config(cfg)
    ckpt.open()
    eng, mesh = setup.engine, setup.mesh
    n_dev = meshlib.data_size(mesh)
    rows_per_dev = cfg.train.batch_size // n_dev
    tokens_per_device_step = rows_per_dev * setup.task.units_per_row
    n_params = sum(n for n, _ in levels.level_sizes(setup.state.params, eng.level_tree, eng.n_levels))
    say(f"nljax {__version__}: {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"mesh inter={mesh.shape['inter']} x intra={mesh.shape['intra']}, {jax.process_count()} process(es)")
    say(f"model {cfg.model.name}: {n_params:,} parameters; global batch {cfg.train.batch_size} rows x "
        f"{cfg.train.seq_len} tokens, {rows_per_dev} rows per device in {cfg.train.accum_steps} "
        f"micro-batch(es) of {rows_per_dev // cfg.train.accum_steps}")
    say(levels.describe(setup.state.params, eng.level_tree, cfg.cms.periods))

    state, conductor = ckpt.state, Conductor(cfg.cms.periods, ckpt.start)
    times: dict[str, list[float]] = {}
    seen: set = set()
    history = []
    t_start = time.perf_counter()
    for _ in range(ckpt.start, cfg.train.steps):
        p = conductor.pulse
        batch = ckpt.first_batch(p.step, setup.batch(p.step))
        t0 = time.perf_counter()
        state, m = setup.cache.train(p.active, state, batch)
        loss = host_sum(m["loss_sum"]) / host_sum(m["count"])  # blocks: step times are real
        dt = time.perf_counter() - t0
        conductor = conductor.advance()  # after the step's synchronization
        compiled = p.active not in seen
        seen.add(p.active)
        if not compiled:
            times.setdefault(p.name, []).append(dt)
        rec = {
            "step": p.step,
            "loss": loss,
            "active_levels": p.active_levels,
            "step_time_s": dt,
            "tokens_per_s_per_device": tokens_per_device_step / dt,
            "compiled": compiled,
        }
        if cfg.eval.every and (p.step + 1) % cfg.eval.every == 0 and p.step + 1 < cfg.train.steps:
            rec.update(setup.evaluate(state.params, p.step + 1))
        run.log(rec)
        ckpt.maybe_save(p.step + 1, state)
        history.append(loss)
        if p.step % cfg.train.log_every == 0 or p.step == cfg.train.steps - 1 or "eval_loss" in rec:
            extra = f"  eval_bpb {rec['eval_bpb']:.3f}" if "eval_bpb" in rec else ""
            say(f"step {p.step:6d}  loss {loss:.4f}  {p.name:<10} {dt * 1e3:8.1f} ms  "
                f"{rec['tokens_per_s_per_device']:10,.0f} tok/s/device{extra}")
    wall = time.perf_counter() - t_start
    ckpt.finish(conductor.step, state)  # the final save; waits for every save to be on disk
    final_eval = setup.evaluate(state.params, cfg.train.steps)
    time_missing_patterns(setup, state, times)
    tp = throughput(times, tokens_per_device_step, n_dev)
    comm = account(setup.cache, state, setup.batch(0))  # reads the executables that trained
    summary = {
        "nljax_version": __version__,
        "steps": cfg.train.steps,
        "resumed_from_step": ckpt.resume_step,
        "devices": n_dev,
        "mesh": dict(mesh.shape),
        "final_loss": history[-1] if history else None,
        **final_eval,
        "throughput": tp,
        "communication": {
            "mean_wire_bytes_per_step": comm["mean_wire_bytes_per_step"],
            "ddp_wire_bytes_per_step": comm["ddp_wire_bytes_per_step"],
            "ratio_vs_ddp": comm["ratio_vs_ddp"],
            "wire_bytes_per_pattern": {v["active"]: v["wire_bytes"] for v in comm["variants"]},
        },
        "wall_time_s": wall,
    }
    run.save_summary(summary)
    say(f"eval loss {final_eval['eval_loss']:.4f} ({final_eval['eval_bpb']:.3f} bits per byte)")
    if "tokens_per_s_per_device_mean" in tp:
        say(f"throughput per device: mean {tp['tokens_per_s_per_device_mean']:,.0f} tok/s, worst "
            f"{tp['tokens_per_s_per_device_worst']:,.0f} tok/s ({tp['worst_pattern']}); "
            f"aggregate {tp['tokens_per_s_aggregate']:,.0f} tok/s over {n_dev} devices")
    if comm["ratio_vs_ddp"] is not None:
        say(f"communication per device per step (HLO): {comm['mean_wire_bytes_per_step']:,.0f} B, "
            f"{comm['ratio_vs_ddp']:.3f} x a DDP all-reduce of every parameter")
    setup.state = state
    return summary
