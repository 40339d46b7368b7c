"""Honest throughput: per device (an aggregate hides the slowest device), per pulse pattern (steps
where more levels fire cost more), compute vs communication.

At the end of a run every pulse pattern that occurred within `train.steps` is timed on the final
state (already saved; the timing consumes it, so no second copy has to fit beside it): after a
warm-up round, at least `throughput.reps` rounds interleaved over the patterns (so a drift of clock
or load hits all of them alike), as many as fill a second up to 200, within
`throughput.max_fraction` of the loop's time (`_time_interleaved`), medians reported. Tokens per
second are per device; the aggregate is only shown beside them.

Communication time is measured, not modelled: each pattern is also compiled as the same
per-device program on a 1-device mesh (the same rows per device, the same parameters), where
every collective runs over axes of size 1 and disappears. Its time is the compute time; the
difference to the real step is the time the step spends communicating (or waiting for it).
Caveats: emulated CPU devices share the host's cores, so there the split measures contention
more than communication; with a sharded optimizer the 1-device program updates every parameter
rather than 1/N of them, so compute is slightly overstated. That program holds the whole model
and optimizer on one device: where it does not fit (a sharded run's reason to shard), the split
is skipped and the table says why (`split_skipped`), instead of failing a run that trained.

MFU: the FLOPs of the compiled per-device program (`cost_analysis()`) per step time, over the
device's peak (`throughput.peak_tflops`, else the bf16 dense peak of known device kinds). Every
step's metrics.jsonl record has the same FLOPs over the loop's own time of that step
(`StepRates`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from nljax.engine.conductor import Conductor, pattern_name, pulse
from nljax.engine.state import TrainState
from nljax.engine.step import StepCache
from nljax.errors import ConfigError, first_line
from nljax.measure import flops as flop_count
from nljax.measure import hlo
from nljax.run.core import Run
from nljax.run.phases import compile_announcer
from nljax.runtime import runlog

# bf16 dense peak per device in TFLOP/s, matched as a substring of `device_kind` (first match).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),  # before "H100", which it contains
    ("H100", 989.0),
    ("H200", 989.0),  # GH200 too
    ("A100", 312.0),
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v6", 918.0),
)


def peak_flops(device_kind: str, override_tflops: float = 0.0) -> float | None:
    """Per-device peak FLOP/s, or None when unknown (MFU is then not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops * 1e12
    return None


def patterns_in_run(periods: tuple[int, ...], start: int, steps: int) -> dict[tuple[bool, ...], int]:
    """How often each active set fires in steps [start, steps): whole cycles counted with
    `Conductor.patterns`, only the remainder walked (cycles can be ~10^9 steps long)."""
    conductor = Conductor(periods)
    n = max(steps - start, 0)
    full, rest = divmod(n, conductor.cycle)
    counts = {a: c * full for a, c in conductor.patterns().items()} if full else {}
    first = start + full * conductor.cycle
    for s in range(first, first + rest):
        a = pulse(s, periods).active
        counts[a] = counts.get(a, 0) + 1
    return {a: c for a, c in counts.items() if c}


# Why XLA's count of a step is not given (`xla_count`), in words a table's footnote can print
LOOP = "the step runs a loop (scanned layers, micro-batches, the memory's chunks), whose body XLA's count covers once"
NO_COST_ANALYSIS = "this backend gives no cost analysis"


def xla_count(compiled: jax.stages.Compiled) -> tuple[float | None, str | None]:
    """(FLOPs of one call of a compiled (per-device) program, None) when XLA counts them exactly,
    else (None, why: `LOOP` or `NO_COST_ANALYSIS`). A program that runs a loop more than once
    (scanned layers, micro-batches, the neural memory's chunks unless `memory_unroll` unrolls them
    all) is not counted: XLA's cost analysis counts a loop's body once, which under-counts such a
    step (the analytic count, `nljax.measure.flops`, stands in)."""
    try:
        if any(trips != 1 for trips in hlo.loop_trips(compiled.as_text())):
            return None, LOOP
    except Exception:  # noqa: BLE001 - no text from this backend: then no loop to tell either
        return None, NO_COST_ANALYSIS
    try:
        ca = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None, NO_COST_ANALYSIS
    if isinstance(ca, (list, tuple)):  # older jax: one dict per program
        ca = ca[0] if ca else {}
    value = (ca or {}).get("flops")
    return (float(value), None) if value and value > 0 else (None, NO_COST_ANALYSIS)


def flops(compiled: jax.stages.Compiled) -> float | None:
    """FLOPs of one call of a compiled (per-device) program, when XLA counts them exactly
    (`xla_count`), else None."""
    return xla_count(compiled)[0]


class StepRates:
    """A training step's model TFLOP/s per device and MFU for its metrics.jsonl record and the
    trackers (`tflops_per_s_per_device`, `mfu`; no `mfu` where the peak is not known, as on a
    CPU without `throughput.peak_tflops`), as MaxText and Levanter log them each step. Its FLOPs
    are those the throughput table gives the step's variant (`report`): XLA's count of the
    compiled program where exact (a pattern where fewer levels fire then counts its smaller
    backward pass), else the analytic count of the units it processed; over the loop's time of
    that step (`step_time_s`). Host arithmetic on numbers the record has: no device work, no
    wait; XLA's count is read from the program's text once per variant."""

    def __init__(self, run: Run):
        cfg, eng = run.cfg, run.engine
        self.cache, self.xla = run.cache, {}
        self.per_unit = flop_count.analytic_flops(cfg, eng.model, eng.param_shapes)["total_per_unit"]
        self.peak = peak_flops(run.mesh.devices.flat[0].device_kind, cfg.throughput.peak_tflops)

    def __call__(self, variant, units_per_s: float, step_s: float) -> dict:
        if variant not in self.xla:
            self.xla[variant] = flops(self.cache.built(variant))
        per_s = self.xla[variant] / step_s if self.xla[variant] else self.per_unit * units_per_s
        return {"tflops_per_s_per_device": per_s / 1e12, **({"mfu": per_s / self.peak} if self.peak else {})}


def _time_interleaved(runs: dict, reps: int, min_seconds: float = 1.0, max_reps: int = 200,
                      budget_s: float | None = None, say: Callable[[str], None] = lambda text: None) -> dict:
    """runs: key -> a call that dispatches one step and returns what to wait for. One warm-up
    call each, then rounds over all keys: at least `reps`, more (up to `max_reps`) while a round
    is so short that `min_seconds` of timing would not be reached, because with millisecond
    steps a handful of samples can reorder the patterns; fewer (one at least) where `reps`
    rounds would take more than `budget_s`. The median seconds per key. Says what it times, and
    each round where rounds are slow."""
    say(f"timing {len(runs)} step variants again for the throughput table (warm-up round) ...")
    t0 = time.perf_counter()
    for call in runs.values():
        jax.block_until_ready(call())
    round_s = time.perf_counter() - t0
    reps = min(max(reps, int(min_seconds / max(round_s, 1e-9))), max(max_reps, reps))
    if budget_s is not None:
        reps = max(1, min(reps, int(budget_s / max(round_s, 1e-9))))
    if jax.process_count() > 1:  # processes must run the same number of collective steps: process 0's
        reps = int(multihost_utils.broadcast_one_to_all(np.int32(reps)))
    say(f"timing: {reps} round{'s' if reps > 1 else ''} of about {round_s * 1e3:,.0f} ms (throughput.reps, "
        "throughput.max_fraction)")
    times: dict = {k: [] for k in runs}
    said = time.perf_counter()
    for i in range(reps):
        if time.perf_counter() - said > 2.0:  # nothing silent for long
            say(f"timing: round {i + 1} of {reps}")
            said = time.perf_counter()
        for k, call in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(ts) for k, ts in times.items()}


@dataclasses.dataclass
class Measured:
    step_s: dict  # active set -> median step time
    compute_s: dict  # active set -> median time without collectives (empty when not split)
    flops: dict  # active set -> FLOPs per device per step (or None)
    split_skipped: str | None = None  # why compute_s is empty although the split was asked for


def measure(cache: StepCache, state: TrainState, batch: dict, active_sets, reps: int, split: bool,
            local: Callable[[], Run], budget_s: float | None = None,
            say: Callable[[str], None] = lambda text: None) -> Measured:
    """Time every active set with `batch`, threading `state` through them (consumed: each variant
    donates its input) and, with `split`, the same per-device program on one device without
    collectives (`local()` builds it, `Run.local`), unless that does not fit; the timing rounds
    within `budget_s` (`_time_interleaved`), said with `say`."""
    chain = _Chain(state)
    fns = {a: cache.train_fn(a, chain.state, batch) for a in active_sets}
    runs = {("step", a): chain.call(fns[a], batch) for a in active_sets}
    n_devices = cache.eng.mesh_devices
    skipped = None
    if split and n_devices > 1:
        try:
            runs.update(_local_runs(local, active_sets, say if cache.announce else None))
        except (ConfigError, jax.errors.JaxRuntimeError) as e:
            if not isinstance(e, ConfigError) and "RESOURCE_EXHAUSTED" not in str(e):
                raise
            skipped = f"the one-device program does not fit ({first_line(e)[:160]})"
    medians = _time_interleaved(runs, reps, budget_s=budget_s, say=say)
    step_s = {a: medians[("step", a)] for a in active_sets}
    if not split or skipped:
        compute_s = {}
    elif n_devices == 1:
        compute_s = dict(step_s)  # the 1-device program has no collectives to remove
    else:
        compute_s = {a: medians[("compute", a)] for a in active_sets}
    return Measured(step_s, compute_s, {a: flops(fns[a]) for a in active_sets}, skipped)


def _local_runs(local: Callable[[], Run], active_sets, say: Callable[[str], None] | None = None) -> dict:
    """The 1-device program's calls, each run once here, so that one that does not fit fails
    now (refused by the budget, or out of memory) rather than inside the timing; its
    compilations said with `say` as the one-device programs they are (as the run's own step
    variants, they read as the run's compiled again)."""
    one = local()
    if say is not None:
        one.cache.announce = compile_announcer(one.cfg.cms.periods, say, "one-device step variant")
    lbatch = one.batch(0)
    lchain = _Chain(one.init_state())
    runs = {("compute", a): lchain.call(one.cache.train_fn(a, lchain.state, lbatch), lbatch) for a in active_sets}
    for call in runs.values():
        jax.block_until_ready(call())
    return runs


class _Chain:
    """One state threaded through calls of several compiled variants (each donates its input)."""

    def __init__(self, state):
        self.state = state

    def call(self, fn, batch):
        def run():
            self.state, metrics = fn(self.state, batch)
            return self.state, metrics

        return run


def report(
    m: Measured,
    counts: dict,
    cycle_counts: dict,
    wire_bytes: dict,
    units_per_device_step: int,
    n_devices: int,
    peak: float | None,
    unit: str = "tokens",
    analytic_flops: float | None = None,
) -> dict:
    """The throughput table as a JSON-ready dict: one row per pattern, a run-weighted mean row
    and the worst-case row (the slowest pattern). A pattern's FLOPs are XLA's count where it is
    exact (`flops`), else `analytic_flops` (per device step, `nljax.measure.flops`); `flops_source` says which."""

    def row(step_s, compute_s, fl, **extra):
        source = "xla" if fl else "analytic" if analytic_flops else None
        fl = fl or analytic_flops
        r = {
            **extra,
            "step_time_ms": step_s * 1e3,
            "compute_ms": compute_s * 1e3 if compute_s is not None else None,
            "comm_ms": max(step_s - compute_s, 0.0) * 1e3 if compute_s is not None else None,
            f"{unit}_per_s_per_device": units_per_device_step / step_s,
            "flops_per_device_step": fl,
            "flops_source": source,
            "mfu": fl / step_s / peak if (fl and peak) else None,
        }
        return r

    rows = {}
    for a in sorted(m.step_s, key=lambda a: (sum(a), a)):
        name = pattern_name(a)
        rows[name] = row(
            m.step_s[a], m.compute_s.get(a), m.flops.get(a),
            steps_per_cycle=cycle_counts.get(a, 0), steps_in_run=counts.get(a, 0),
            wire_bytes=wire_bytes.get(name),
        )
    out = {"unit": unit, "devices": n_devices, "peak_flops_per_device": peak, "per_pattern": rows}
    if m.split_skipped:
        out["split_skipped"] = m.split_skipped
    if not rows:
        return out
    actives = list(m.step_s)
    weight = {a: counts.get(a, 0) or 1 for a in actives}
    total = sum(weight.values())
    wmean = lambda f: sum(weight[a] * f(a) for a in actives) / total
    mean_step = wmean(lambda a: m.step_s[a])
    mean_compute = wmean(lambda a: m.compute_s[a]) if m.compute_s else None
    fl = [m.flops.get(a) for a in actives]
    mean_flops = wmean(lambda a: m.flops[a]) if all(fl) else None
    mean_wire = [wire_bytes.get(pattern_name(a)) for a in actives]
    out["mean"] = row(mean_step, mean_compute, mean_flops, steps_in_run=sum(counts.get(a, 0) for a in actives),
                      wire_bytes=wmean(lambda a: wire_bytes[pattern_name(a)]) if all(w is not None for w in mean_wire)
                      else None)
    worst = max(actives, key=lambda a: m.step_s[a])
    out["worst_pattern"] = pattern_name(worst)
    out["worst"] = {"pattern": pattern_name(worst), **rows[pattern_name(worst)]}
    key = f"{unit}_per_s_per_device"
    out[f"{key}_mean"] = out["mean"][key]
    out[f"{key}_worst"] = out["worst"][key]
    out[f"{unit}_per_s_aggregate"] = out["mean"][key] * n_devices
    return out


def noisy_worst(worst: str, timed, n_levels: int, more: str) -> str | None:
    """The note under a timing whose slowest pattern is not the one where every level fires
    (which does all the others' work and more): on a loaded or shared machine the noise ranked
    them. `timed`: the names of the patterns timed; `more`: the setting that times more rounds."""
    every = pattern_name((True,) * n_levels)
    if every not in timed or worst == every:
        return None
    return (f"note: {worst} timed slower than {every}, where all levels fire: it does less work, so the timing "
            f"is noisy here (a loaded or shared machine; {more} raises the rounds)")


def format_table(t: dict) -> str:
    """The table printed at the end of a run."""
    unit = t["unit"]
    key = f"{unit}_per_s_per_device"
    head = (f"{'pattern':<16}{'steps/cycle':>12}{'in run':>8}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}"
            f"{runlog.short_unit(unit) + '/s/device':>14}{'wire B/step':>14}{'MFU':>8}")
    fmt = lambda x, f: "-" if x is None else format(x, f)
    lines = [head]

    def line(name, r, cycle=""):
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        return (f"{name:<16}{cycle:>12}{fmt(r.get('steps_in_run'), 'd'):>8}{r['step_time_ms']:>10.2f}"
                f"{fmt(r['compute_ms'], '.2f'):>12}{fmt(r['comm_ms'], '.2f'):>10}{r[key]:>14,.0f}"
                f"{fmt(r['wire_bytes'], ',.0f'):>14}{mfu:>8}")

    for name, r in t["per_pattern"].items():
        lines.append(line(name, r, str(r["steps_per_cycle"])))
    if "mean" in t:
        lines.append(line("mean (run)", t["mean"]))
        lines.append(line(f"worst {t['worst_pattern']}", t["worst"]))
        lines.append(f"{unit}/s per device: mean {t[key + '_mean']:,.0f}, worst {t[key + '_worst']:,.0f}; "
                     f"aggregate over {t['devices']} device{'' if t['devices'] == 1 else 's'} "
                     f"{t[unit + '_per_s_aggregate']:,.0f}")
    if t.get("split_skipped"):
        lines.append(f"compute/comm split skipped: {t['split_skipped']}")
    if t.get("note") and any(r["comm_ms"] is not None for r in t["per_pattern"].values()):
        lines.append(f"note: {t['note']}")  # under the figures it is about, not in summary.json alone
    if any(r.get("flops_source") == "analytic" and r["mfu"] is not None for r in t["per_pattern"].values()):
        lines.append("MFU from the analytic FLOP count (nljax.measure.flops): the step runs a loop, whose body XLA's "
                     "count covers once")
    return "\n".join(lines)
