"""The benchmark command: how fast a config trains, measured the way it trains.

    python -m nljax.bench [--config FILE] [--cpu-devices N] [--steps S] [--warmup W] [--loop K]
                          [--patterns cycle|worst] [--profile N [--profile-dir DIR]]
                          [--out FILE.json] [key=value ...]

builds the run exactly as `nljax.train` does (`nljax.run.core.Run`: same mesh, engine, compiled
step variants, data) but writes no run directory and no checkpoint. Then, for every pulse
pattern (distinct active set) of one cycle of `cms.periods` (or only the one where every level
fires, `--patterns worst`):

- compile time of its step variant (lower + compile, ahead of time, as the trainer does);
- `--warmup` untimed steps, then `--steps` timed rounds interleaved over the patterns (a drift of
  clock or load hits all of them alike): median, min, max and spread of the step time, each step
  waited for;
- then `--loop K` steps of each pattern through the training loop (`nljax.run.loop.training_steps`,
  as `nljax.train` runs them: with `train.dispatch_ahead` a step is dispatched before the one
  before it has finished, which each step waited for cannot show; on a GPU titans_demo ran 1.3x
  faster so): the time per step and the units per second training gets;
- units (tokens, images) per second per device: per pattern, the mean weighted by how often each
  pattern fires in a cycle, and the worst pattern;
- FLOPs per unit: analytic (`nljax.measure.flops`: 6 N + attention for the outer loop, plus an
  estimate of the inner-loop memory), and XLA's count for the compiled per-device program (none
  for a step that runs a loop, whose body XLA counts once: a line under the table says so);
- MFU against the device's peak: the known bf16 dense peak of GPUs/TPUs (`throughput.PEAK_TFLOPS`,
  or `--peak-tflops`); on CPU a float32 matmul peak measured here and printed;
- peak memory: `memory_stats()['peak_bytes_in_use']` where the backend keeps it (GPU), else the
  compiled programs' `memory_analysis()` (arguments + outputs + temporaries - aliased);
- versions and the device kind;
- with `--profile N`: N more steps of the slowest pattern under jax.profiler, and where their
  device time goes (`nljax.measure.traces`: ops per step, device busy time against the step time, time
  per op category, the top ops); `--profile-dir` keeps the trace for TensorBoard or Perfetto.

A benchmark is a command, not a test: the suite only checks that its JSON is well formed.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# nljax.cli imports JAX first, turning an environment variable JAX cannot read into one line
from nljax import cli  # noqa: I001

import jax
import jax.numpy as jnp
import numpy as np

from nljax.config import Config, ConfigError
from nljax.engine.conductor import Conductor, pattern_name
from nljax.engine.step import StepCache
from nljax.measure import flops, hostmem, traces
from nljax.models import registry
from nljax.run import throughput
from nljax.run.core import Run
from nljax.run.loop import dispatches_ahead, training_steps
from nljax.runtime import compile_cache, resultfile
from nljax.runtime.runlog import short_unit
from nljax.version import __version__

# ---------------------------------------------------------------------------------- the device


def cpu_matmul_peak(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul on the first device, best of `reps` (a roofline for
    MFU on CPU, where no datasheet peak applies: what XLA's own dot reaches on this machine)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))  # compile
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(dot(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def device_peak(override_tflops: float) -> tuple[float, str]:
    """(per-device peak FLOP/s, where it comes from). Emulated CPU devices share the host's
    cores: each gets its share of the matmul peak measured on all of them."""
    dev = jax.devices()[0]
    known = throughput.peak_flops(dev.device_kind, override_tflops)
    if known:
        return known, "declared (--peak-tflops or throughput.peak_tflops)" if override_tflops > 0 else \
            f"bf16 dense peak of {dev.device_kind}"
    if dev.platform == "cpu":
        n = jax.local_device_count()
        share = f", shared by {n} emulated devices" if n > 1 else ""
        return cpu_matmul_peak() / n, f"measured: float32 1024x1024 jnp.dot on this CPU{share}"
    raise ConfigError(f"no known peak for device kind '{dev.device_kind}': give --peak-tflops or "
                      "throughput.peak_tflops")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    import flax
    import jaxlib
    import optax

    dev = jax.devices()[0]
    return {
        "nljax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(), "platform": dev.platform, "device_kind": dev.device_kind,
        "devices": jax.device_count(), "cpu": cpu_model(),
        "malloc": hostmem.settings(),
    }


# ---------------------------------------------------------------------------------- measuring


def bench_patterns(periods: tuple[int, ...], which: str) -> dict[tuple[bool, ...], int]:
    """active set -> steps per cycle, for the patterns to time."""
    cycle = Conductor(periods).patterns()
    if which == "worst":  # all levels fire: the slowest pattern, and the only one at step 0
        every = tuple(True for _ in periods)
        return {every: cycle[every]}
    return cycle


def say(line: str) -> None:
    """A progress line on standard error (the report goes to standard output), at once, from the
    first process: compiling a step variant takes up to minutes, which the bench never takes from
    the compile cache (it measures them)."""
    if jax.process_index() == 0:
        print(f"nljax.bench: {line}", file=sys.stderr, flush=True)


def compile_variants(cache: StepCache, actives, state, batch) -> tuple[dict, dict]:
    """(active set -> compiled step, active set -> seconds to lower and compile it, or to lower
    it and load it where `built` says it was loaded: NLJAX_EXECUTABLES)."""
    fns, seconds = {}, {}
    for i, a in enumerate(actives, 1):
        say(f"building pattern {pattern_name(a)} ({i} of {len(actives)}) ...")  # compiled or loaded: said after
        t0 = time.perf_counter()
        fns[a] = cache.train_fn(a, state, batch)
        seconds[a] = time.perf_counter() - t0
        how = built(cache, a, batch)
        say(f"{'compiled' if how == 'compiled' else 'loaded'} pattern {pattern_name(a)}"
            f"{'' if how == 'compiled' else how.removeprefix('loaded')} in {seconds[a]:.1f} s")
    return fns, seconds


def built(cache: StepCache, active, batch) -> str:
    """How the step of `active` came to be: "compiled", or "loaded from FILE" (an executable
    compiled ahead, NLJAX_EXECUTABLES): a compile time is then a load time, and says so."""
    loaded = cache.loaded.get(cache.variant(active, batch))
    return "compiled" if loaded is None else f"loaded from {loaded}"


def time_steps(fns: dict, state, batch, warmup: int, steps: int, slow_s: float = 5.0) -> tuple[dict, object]:
    """(active set -> step times (s) of `steps` rounds interleaved over the patterns, after
    `warmup` untimed rounds; the state after them). One state is threaded through every call,
    each donating it, as training does: `state` is consumed (no second copy inflates the peak).
    A round that takes `slow_s` or more is said as it ends: a large model's rounds on a CPU take
    minutes (meanflow_dit_b4: 6.9 s a step at batch 16 on the 2-core CPU), and passed without a line."""
    times = {a: [] for a in fns}
    for i in range(warmup + steps):
        r0 = time.perf_counter()
        for a, fn in fns.items():
            t0 = time.perf_counter()
            state, metrics = fn(state, batch)
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times[a].append(time.perf_counter() - t0)
        if (took := time.perf_counter() - r0) >= slow_s:
            kind = f"warm-up round {i + 1} of {warmup}" if i < warmup else f"timed round {i + 1 - warmup} of {steps}"
            say(f"{kind}: {took:.1f} s")
    return times, state


def loop_steps(run: Run, state, conductor: Conductor, k: int, built_before=()):
    """`k` steps from `conductor.step` through the training loop (`training_steps`, which keeps
    no step's state but the last); returns the state after them. `built_before`: the variant keys
    already compiled (none of them is taken for a compilation)."""
    cfg = dataclasses.replace(run.cfg, train=dataclasses.replace(run.cfg.train, steps=conductor.step + k))
    for r in training_steps(dataclasses.replace(run, cfg=cfg), state, conductor, keep=lambda step: False,
                            built_before=built_before):
        state = r.state if r.state is not None else state
    return state


def only(active: tuple[bool, ...], start: int, k: int) -> Conductor:
    """A Conductor that fires `active` at each of the `k` steps from `start` (>= 1) and nothing
    else: the active levels every step, the others at a period past the last (step 0, where
    every level fires, is before `start`)."""
    return Conductor(tuple(1 if a else start + k + 1 for a in active), start)


def time_loops(run: Run, fns: dict, state, batch, start: int, k: int,
               slow_s: float = 5.0) -> tuple[dict, object]:
    """(active set -> seconds per step of `k` steps of it alone through the training loop, from
    step `start`; the state after them), the patterns one after another. Each pattern's call
    starts with no step in flight and ends waiting for its last: about one step's host work per
    call more than a long run's loop, which a larger `k` spreads thinner. A call that takes
    `slow_s` or more is said as it ends, as `time_steps`'s rounds are: nl_default's 5 calls of
    16 steps on the 2-core CPU passed 40 s after one line."""
    built_before = {run.cache.variant(a, batch) for a in fns}

    def timed(a, what: str):
        nonlocal state, start
        t0 = time.perf_counter()
        state = loop_steps(run, state, only(a, start, k), k, built_before)
        jax.block_until_ready(state)
        start += k
        if (took := time.perf_counter() - t0) >= slow_s:
            say(f"{what}: {k} step{'s' * (k > 1)} in {took:.1f} s")
        return took

    # one untimed call first: the loop's own first call compiles what it computes outside the step
    # (the records' learning rates, for `k` steps) and starts the data's reading
    timed(next(iter(fns)), "through the training loop, warm-up")
    seconds = {a: timed(a, f"through the training loop, pattern {pattern_name(a)} ({i} of {len(fns)})") / k
               for i, a in enumerate(fns, 1)}
    return seconds, state


def spread(ts: list[float]) -> dict:
    med = statistics.median(ts)
    return {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
            "stdev_ms": statistics.stdev(ts) * 1e3 if len(ts) > 1 else 0.0,
            "spread": (max(ts) - min(ts)) / med, "samples": len(ts)}


def peak_memory(fns: dict) -> dict:
    """Peak bytes per device: the allocator's high-water mark where the backend keeps one (GPU,
    TPU), and per compiled program arguments + outputs + temporaries - aliased (donated) bytes,
    the largest over the patterns."""
    out = {"memory_stats_peak_bytes": None, "compiled_peak_bytes": None}
    stats = jax.local_devices()[0].memory_stats() or {}  # a device of this process: another's has none to read
    if "peak_bytes_in_use" in stats:
        out["memory_stats_peak_bytes"] = int(stats["peak_bytes_in_use"])
    for a, fn in fns.items():
        try:
            ma = fn.memory_analysis()
        except Exception:  # not every backend implements it
            continue
        if ma is None:
            continue
        b = {k: int(getattr(ma, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "temp", "alias")}
        total = b["argument"] + b["output"] + b["temp"] - b["alias"]
        if out["compiled_peak_bytes"] is None or total > out["compiled_peak_bytes"]:
            out["compiled_peak_bytes"], out["compiled_breakdown"] = total, {**b, "pattern": pattern_name(a)}
    out["peak_bytes"] = out["memory_stats_peak_bytes"] or out["compiled_peak_bytes"]
    return out


# ------------------------------------------------------------------------------------- report


def pattern_row(ts: list[float], compile_s: float, per_cycle: int, units: int, xla: tuple, analytic: float,
                peak: float, executable: str = "compiled", loop_s: float | None = None) -> dict:
    """`xla`: XLA's count of the step and why there is none (`throughput.xla_count`);
    `executable`: how the step came to be (`built`), what `compile_s` timed; `loop_s`: its time
    per step through the training loop (`time_loops`), where timed."""
    step = statistics.median(ts)
    xla_flops, uncounted = xla
    return {
        "loop_step_ms": None if loop_s is None else loop_s * 1e3,
        "units_per_s_per_device_in_loop": None if loop_s is None else units / loop_s,
        "steps_per_cycle": per_cycle, "compile_s": compile_s, "executable": executable, "step_time": spread(ts),
        "units_per_s_per_device": units / step,
        "xla_flops_per_device_step": xla_flops,
        "xla_flops_per_unit": xla_flops / units if xla_flops else None,
        "xla_flops_missing": uncounted,  # why XLA's count is not given (the table's "-"), or None
        "mfu": xla_flops / step / peak if xla_flops else None,
        "mfu_analytic": analytic * units / step / peak,
    }


def summarize(rows: dict, units: int) -> dict:
    """Mean weighted by steps per cycle (time per unit averaged, so slow patterns weigh in
    proportion to the time they take) and the worst (slowest) pattern."""
    weight = {k: r["steps_per_cycle"] for k, r in rows.items()}
    total = sum(weight.values())
    mean_step = sum(weight[k] * r["step_time"]["median_ms"] for k, r in rows.items()) / total / 1e3
    worst = max(rows, key=lambda k: rows[k]["step_time"]["median_ms"])
    mfu = [r["mfu"] for r in rows.values()]
    looped = all(r["loop_step_ms"] is not None for r in rows.values())
    loop_step = sum(weight[k] * r["loop_step_ms"] for k, r in rows.items()) / total / 1e3 if looped else None
    return {
        "mean_step_ms": mean_step * 1e3,
        # the same mean of each pattern's step through the training loop: what training gets
        "loop_step_ms_mean": None if loop_step is None else loop_step * 1e3,
        "units_per_s_per_device_in_loop_mean": None if loop_step is None else units / loop_step,
        "units_per_s_per_device_mean": units / mean_step,
        "units_per_s_per_device_worst": rows[worst]["units_per_s_per_device"],
        "worst_pattern": worst,
        "mfu_mean": sum(weight[k] * r["mfu"] * r["step_time"]["median_ms"] for k, r in rows.items())
        / (mean_step * 1e3 * total) if all(m is not None for m in mfu) else None,
        "mfu_analytic_mean": (mfu_an := sum(weight[k] * r["mfu_analytic"] * r["step_time"]["median_ms"]
                                            for k, r in rows.items()) / (mean_step * 1e3 * total)),
        # the same FLOPs per unit over the loop's mean step (that mean is the waited steps' over mean_step)
        "mfu_analytic_in_loop_mean": None if loop_step is None else mfu_an * mean_step / loop_step,
    }


def run_bench(run: Run, steps: int, warmup: int, which: str, peak: float, peak_source: str,
              profile: int = 0, profile_dir: Path | None = None, loop: int = 0) -> dict:
    """The whole measurement as a JSON-ready dict (see the module docstring)."""
    cfg, eng = run.cfg, run.engine
    batch = run.batch(0)
    # compiles the model's init, as training does (titans_demo: 10 s on the 2-core CPU, in silence)
    say("initializing the parameters and the optimizer state ...")
    state = run.init_state()
    units = run.units_per_device(batch)
    per_cycle = bench_patterns(cfg.cms.periods, which)
    fns, compile_s = compile_variants(run.cache, list(per_cycle), state, batch)
    say(f"timing {warmup} warm-up and {steps} timed rounds of {len(fns)} pattern{'s' * (len(fns) > 1)} ...")
    times, state = time_steps(fns, state, batch, warmup, steps)
    in_loop = {}
    if loop:
        say(f"timing {loop} step{'s' * (loop > 1)} of each pattern through the training loop ...")
        in_loop, state = time_loops(run, fns, state, batch, warmup + steps + 1, loop)
    analytic = flops.analytic_flops(cfg, eng.model, eng.param_shapes)
    rows = {pattern_name(a): pattern_row(times[a], compile_s[a], per_cycle[a], units,
                                         throughput.xla_count(fns[a]), analytic["total_per_unit"], peak,
                                         built(run.cache, a, batch), in_loop.get(a))
            for a in sorted(per_cycle, key=lambda a: (sum(a), a))}
    summary = summarize(rows, units)
    if profile:
        slowest = next(a for a in fns if pattern_name(a) == summary["worst_pattern"])
        say(f"profiling {profile} step{'s' * (profile > 1)} of pattern {summary['worst_pattern']} ...")
        _, step_s = traces.record(fns[slowest], state, batch, profile, profile_dir)
        timed = rows[summary["worst_pattern"]]["step_time"]["median_ms"] / 1e3
        hlo = fns[slowest].as_text()
        # kept beside the trace: how the profile places kernels (command buffers, scopes) can then
        # be checked and mended later on a machine without the GPU that recorded it
        (profile_dir / "program.hlo.txt").write_text(hlo)
        summary["profile"] = {"pattern": summary["worst_pattern"],
                              **traces.summarize(profile_dir, profile, step_s, hlo_text=hlo, timed_step_s=timed,
                                                 from_marks=True)}
    return {
        "config": {"model": cfg.model.name, "periods": list(cfg.cms.periods), "batch_size": cfg.train.batch_size,
                   "seq_len": cfg.train.seq_len if run.task.unit == "tokens" else None,
                   "mesh": dict(run.mesh.shape), "strategy": eng.strategy.name,
                   "forms": registry.forms_of(eng.model)},
        "environment": environment(),
        "unit": run.task.unit, "units_per_device_step": units, "devices": eng.mesh_devices,
        "warmup": warmup, "steps": steps, "patterns": which, "loop": loop,
        "dispatch_ahead": dispatches_ahead(cfg.train.dispatch_ahead, run.mesh.devices.flat[0].platform),
        "peak_flops_per_device": peak, "peak_source": peak_source,
        "flops": analytic, "per_pattern": rows, **summary,
        "memory": peak_memory(fns),
    }


def format_report(r: dict) -> str:
    env, fl, unit = r["environment"], r["flops"], r["unit"]
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"
    per_unit = "" if fl["tokens_per_unit"] == 1 else f" x {fl['tokens_per_unit']} tokens"
    lines = [
        f"nljax {env['nljax']}  jax {env['jax']}  flax {env['flax']}  optax {env['optax']}  python {env['python']}",
        f"{r['devices']} x {env['platform']} ({env['device_kind']}; {env['cpu']}), mesh {r['config']['mesh']}, "
        f"{r['units_per_device_step']:,} {unit} per device per step",
        f"peak {r['peak_flops_per_device'] / 1e9:,.1f} GFLOP/s per device ({r['peak_source']})",
        *(["computed by: " + ", ".join(f"{k} {v}" for k, v in r["config"]["forms"].items() if v is not None)]
          if r["config"].get("forms") else []),
        f"model {r['config']['model']}: {fl['params']:,} parameters ({fl['matmul_params']:,} multiplied per token"
        + (f", {fl['per_image_params']:,} once per image" if "per_image_params" in fl else "") + "); "
        f"training FLOPs per {unit[:-1]}: analytic {fl['total_per_unit']:,.0f} (outer 6N {fl['outer_per_token']:,.0f}, "
        f"attention {fl['attention_per_token']:,.0f}, inner memory ~{fl['inner_memory_per_token']:,.0f} per token"
        f"{per_unit})",
        "",
        f"{'pattern':<14}{'/cycle':>7}{'compile s':>11}{'step ms':>10}{'min':>9}{'max':>9}"
        f"{short_unit(unit) + '/s/dev':>12}{'XLA FLOP/' + short_unit(unit):>15}{'MFU':>8}{'MFU(an.)':>10}",
    ]
    for name, p in r["per_pattern"].items():
        st = p["step_time"]
        xpu = "-" if p["xla_flops_per_unit"] is None else f"{p['xla_flops_per_unit']:,.0f}"
        lines.append(f"{name:<14}{p['steps_per_cycle']:>7}{p['compile_s']:>11.2f}{st['median_ms']:>10.2f}"
                     f"{st['min_ms']:>9.2f}{st['max_ms']:>9.2f}{p['units_per_s_per_device']:>12,.0f}{xpu:>15}"
                     f"{pct(p['mfu']):>8}{pct(p['mfu_analytic']):>10}")
    loaded = [name for name, p in r["per_pattern"].items() if p.get("executable", "compiled") != "compiled"]
    if loaded:  # a load time is no compile time
        lines.append(f"compile s of {', '.join(loaded)}: the time to load an executable compiled ahead "
                     "(NLJAX_EXECUTABLES), not to compile")
    # a "-" in the XLA column (and so in MFU) said once, not left to guess: a step with a scan
    uncounted = [p.get("xla_flops_missing") for p in r["per_pattern"].values() if p["xla_flops_per_unit"] is None]
    for why in dict.fromkeys(uncounted):
        lines.append(f"XLA FLOP, MFU '-': {why or 'XLA gave no count'}; MFU(an.) is from the analytic count")
    mem = r["memory"]
    if r.get("loop_step_ms_mean") is not None:
        each = ", ".join(f"{name} {p['loop_step_ms']:.2f} ms" for name, p in r["per_pattern"].items())
        lines.append(f"through the training loop ({r['loop']} steps of each pattern, dispatched ahead: "
                     f"{'yes' if r['dispatch_ahead'] else 'no'}): {each}; {unit}/s per device: mean "
                     f"{r['units_per_s_per_device_in_loop_mean']:,.1f} (weighted by steps per cycle), MFU "
                     f"{pct(r['mfu_analytic_in_loop_mean'])} (analytic)")
    lines += [
        f"{unit}/s per device: mean {r['units_per_s_per_device_mean']:,.1f} (weighted by steps per cycle), "
        f"worst {r['units_per_s_per_device_worst']:,.1f} ({r['worst_pattern']}); MFU mean {pct(r['mfu_mean'])} "
        f"(XLA count), {pct(r['mfu_analytic_mean'])} (analytic)",
        f"peak memory per device: {_mib(mem['peak_bytes'])} "
        f"({'memory_stats' if mem['memory_stats_peak_bytes'] else 'compiled memory_analysis'})",
    ]
    note = throughput.noisy_worst(r["worst_pattern"], r["per_pattern"], len(r["config"]["periods"]), "--steps")
    lines += [note] if note else []
    if "profile" in r:
        lines += [f"{r['profile']['pattern']} " + "\n".join(traces.format_summary(r["profile"]))]
    return "\n".join(lines)


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------------ command


def synthetic_images(cfg: Config, shape: str, directory: str) -> Config:
    """`cfg` reading random uint8 images of `shape` (HxWxC, e.g. 32x32x3) with 10 classes from
    an .npz written to `directory`: the step's cost depends on shapes only, so a benchmark of a
    32x32 model needs no data set on disk (the run config keeps `images.source: file`)."""
    try:
        h, w, c = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--synthetic wants HxWxC, e.g. 32x32x3, got '{shape}'") from None
    if min(h, w, c) < 1:  # -1 was numpy's traceback, 0 a message about a temporary .npz
        raise ConfigError(f"--synthetic wants HxWxC of sizes >= 1, e.g. 32x32x3, got '{shape}'")
    n = max(4 * cfg.train.batch_size, 64)  # more than one batch after the held-out split
    rng = np.random.default_rng(cfg.seed)
    path = Path(directory) / f"synthetic_{h}x{w}x{c}.npz"
    np.savez(path, x=rng.integers(0, 256, (n, h, w, c), dtype=np.uint8), y=rng.integers(0, 10, n).astype(np.int32))
    return dataclasses.replace(cfg, images=dataclasses.replace(cfg.images, source="file", path=str(path)))


def unevaluated(cfg: Config) -> Config:
    """`cfg` for a benchmark, which evaluates nothing: the streaming evaluation's held-out
    windows need not fit `train.batch_size` rows (at batch 128 they would not)."""
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, stream_steps=0))


# Keys every result has (`run_bench`, then `_run`): a JSON file with them is an earlier result
RESULT_KEYS = frozenset({"config", "environment", "per_pattern", "command"})


def check_profile_dir(d: Path) -> None:
    """Before anything is measured: `--profile-dir` is a directory or can become one (the profiler
    and the program's HLO are written there after the timing, which a file would throw away)."""
    if why := resultfile.not_a_directory(d.absolute()):
        raise ConfigError(f"--profile-dir {d}: {why}")
    if where := resultfile.unwritable(d.absolute()):  # /proc, a read-only disk: else the profiler's traceback
        raise ConfigError(f"--profile-dir {d}: {where} is not writable")


def _run(args, cfg: Config) -> int:
    for flag, low in (("steps", 1), ("warmup", 0), ("profile", 0), ("loop", 0)):  # the one given wrong, named
        if getattr(args, flag) < low:
            raise ConfigError(f"--{flag} must be >= {low}, got {getattr(args, flag)}")
    if args.out:
        resultfile.check(Path(args.out), f"--out {args.out}", "nljax.bench", RESULT_KEYS)
    if args.profile_dir and not args.profile:  # it keeps the trace of --profile N: nothing was kept, in silence
        raise ConfigError(f"--profile-dir {args.profile_dir} keeps the trace of --profile N, which was not given: "
                          "add --profile N (the steps to profile, e.g. --profile 2)")
    if args.profile_dir:
        check_profile_dir(Path(args.profile_dir))
    with tempfile.TemporaryDirectory() as tmp, compile_cache.off():  # it measures compilation
        if args.synthetic and registry.task_of(cfg) != "images":
            raise ConfigError(f"--synthetic is for the images task (model.name=dit); this config's model is "
                              f"{cfg.model.name}")
        given = [o.partition("=")[0] for o in args.overrides]
        if args.synthetic and (data := [k for k in given if k in ("images.source", "images.path")]):
            # the random images replace them: they were not read, in silence
            raise ConfigError(f"--synthetic {args.synthetic} benchmarks random images in place of the data set: "
                              f"{', '.join(data)} would not be read; give --synthetic or {data[0]}=, not both")
        if args.synthetic:
            cfg = synthetic_images(cfg, args.synthetic, tmp)
        say(f"building the run ({cfg.model.name}, batch {cfg.train.batch_size}) ...")
        run = Run.create(unevaluated(cfg))
        peak, source = device_peak(args.peak_tflops or cfg.throughput.peak_tflops)
        profile_dir = Path(args.profile_dir or Path(tmp) / "profile")
        result = run_bench(run, args.steps, args.warmup, args.patterns, peak, source, args.profile, profile_dir,
                           args.loop)
    result["command"] = " ".join(["python -m nljax.bench", *(args.argv or [])])
    if jax.process_index() == 0:
        print(format_report(result))
        if args.out:
            resultfile.write(Path(args.out), result)  # whole or not at all
            print(f"wrote {args.out}")
    return 0


def peak_tflops(text: str) -> float:
    """--peak-tflops: a finite number >= 0 (nan or a negative was taken as "not given")."""
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise ValueError(text)
    return v


def main(argv=None) -> int:
    p = cli.parser("nljax.bench", "Compile time, step time, tokens/s, FLOPs, MFU and memory of a config's train step.")
    p.add_argument("--steps", type=int, default=5, help="timed rounds over the patterns (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after compilation (default 2)")
    p.add_argument("--loop", type=int, default=16, metavar="K",
                   help="then K steps of each pattern through the training loop, as training runs them "
                        "(default 16; 0: none)")
    p.add_argument("--patterns", choices=("cycle", "worst"), default="cycle",
                   help="every active set of one cycle of cms.periods, or only the one where all levels fire")
    p.add_argument("--peak-tflops", type=peak_tflops, default=0.0, help="per-device peak for MFU (default: known or measured)")
    p.add_argument("--synthetic", metavar="HxWxC", help="images task: random images of this shape, e.g. 32x32x3")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile N steps of the slowest pattern: where the device time goes")
    p.add_argument("--profile-dir", metavar="DIR", help="keep the profiler trace here (default: a temporary one)")
    p.add_argument("--out", metavar="FILE.json", help="also write the result as JSON")
    argv = cli.listed(argv)
    p.set_defaults(argv=argv)
    return cli.main(_run, p, argv)


if __name__ == "__main__":
    cli.leave(main())
