"""The step loop as a generator of step results, and hooks called on them every N steps.

`training_steps` only steps: it dispatches each step, builds the next batch while the device
runs it, times it until its loss is on the host, and yields a `StepResult`. What happens between
steps (evaluation, logging, checkpoints, the profiler) is a hook (`Hooks.add(fn, every=n)`), run
in the order added. On a GPU it dispatches the next step before it reads a step's loss
(`train.dispatch_ahead`), so that the hooks that only log run while the device works; after a
step whose hooks read the state (`reads_state=True`) it waits for the step first.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from nljax.engine.conductor import Conductor, Pulse
from nljax.engine.state import TrainState
from nljax.errors import ConfigError
from nljax.measure import traces
from nljax.parallel.hostdev import mean_loss, replica
from nljax.run.core import Run
from nljax.runtime import distributed
from nljax.runtime.runlog import note_written


@dataclasses.dataclass
class StepResult:
    pulse: Pulse
    state: TrainState  # after the step; the next step donates it
    record: dict  # the step's line of metrics.jsonl; hooks may add to it (evaluation)
    last: bool  # the run's last step
    units_per_s: float  # tokens (or the task's unit) per second per device
    evaluated: dict = dataclasses.field(default_factory=dict)  # held-out metrics after this step
    variant: object = None  # the step's compiled variant (`StepCache.variant`)

    @property
    def step(self) -> int:
        return self.pulse.step


class Hooks:
    """Callbacks on step results: `add(fn, every=n)` calls fn after every step s with
    (s + 1) % n == 0, i.e. once n, 2n, ... optimizer steps are done; n = 0 never. A hook that
    reads the step's state (`reads_state=True`: evaluation, a checkpoint, a sample) makes its
    steps keep it (`keeps`): the next step is not dispatched ahead of them (`training_steps`)."""

    def __init__(self):
        self._hooks: list[tuple[Callable[[StepResult], None], int, bool]] = []

    def add(self, fn: Callable[[StepResult], None], every: int = 1, reads_state: bool = False) -> None:
        self._hooks.append((fn, every, reads_state))

    def run(self, result: StepResult) -> None:
        for fn, every, _ in self._hooks:
            if fires(every, result.step):
                fn(result)

    def keeps(self, step: int) -> bool:
        """Whether a hook that reads the state runs after `step`."""
        return any(reads and fires(every, step) for _, every, reads in self._hooks)


def fires(every: int, step: int) -> bool:
    """Whether something done every `every` steps (0: never) is done after `step`."""
    return bool(every) and (step + 1) % every == 0


def step_record(pulse: Pulse, m: dict, loss: float, dt: float, units: int, key: str, compiled: bool,
                variant, lr: float) -> dict:
    """The step's metrics.jsonl record, from its metrics on the devices; `lr`: the schedule's
    value at this step (before `optim.level_lr_scale`)."""
    norms, lskip = (replica(m[k]).tolist() for k in ("level_grad_norm", "level_skipped"))  # per level
    rec = {
        "step": pulse.step,
        "loss": loss,
        "active_levels": pulse.active_levels,
        "pattern": pulse.name,
        "step_time_s": dt,
        key: units / dt,
        "compiled": compiled,
        "skipped": bool(replica(m["skipped"])),  # the same on every device
        "lr": lr,
        "grad_norm": float(replica(m["grad_norm"])),  # of the fired levels' gradients together
        **{f"grad_norm_l{l}": float(norms[l]) for l in pulse.active_levels},
        "skipped_levels": [l for l in pulse.active_levels if lskip[l]],
    }
    if variant != pulse.active:
        rec["micro_batches"] = variant[1]  # a tail batch that ends a data pass
    return rec


def dispatches_ahead(setting: bool | str, platform: str) -> bool:
    """`train.dispatch_ahead` on devices of `platform`: "auto" is on except on a CPU, whose
    device is the host's own cores: there the overlap only shares them (measured: the default
    job's step 1.5% slower in median, equal at the minimum; 2026-11-30)."""
    return platform != "cpu" if setting == "auto" else bool(setting)


def training_steps(run: Run, state: TrainState, conductor: Conductor, reset_first: bool = False,
                   keep: Callable[[int], bool] = lambda step: True,
                   stop: Callable[[int], bool] = lambda step: False,
                   built_before: Iterable = ()) -> Iterator[StepResult]:
    """Steps from `conductor.step` to `train.steps`. `reset_first`: the first batch starts every
    row from a fresh memory (after a resume that restarted every row).

    With `train.dispatch_ahead` on (`auto`: on a GPU or TPU), the next step is dispatched before
    a step's metrics are read, so that the host's work between steps (reading the loss, writing
    the record, the hooks that only log, passing hundreds of state arrays to the next call)
    overlaps the device's work instead of leaving it idle; that step's result then has `state`
    None (donated to the next step). Not where `keep(step)` says a hook reads the step's state
    (evaluation, a checkpoint, a sample), at the last step, or before a step whose variant
    compiles (its compilation is then timed with its own step). `stop(step)`, asked once per
    step in order (after the step's hooks where it kept its state, else right before the next
    dispatch: as late as the step allows), ends the loop after that step, its state kept (a
    preemption notice). `built_before`: the variant keys (`StepCache.variant`) already called
    before this loop (a benchmark's rounds of steps): none of them is taken for a compilation.

    `step_time_s`: from the step's dispatch, or from the previous step's result where the host
    read that later, until its loss is on the host: the time the loop spent on it alone."""
    cfg, steps = run.cfg, run.cfg.train.steps
    dispatch_ahead = dispatches_ahead(cfg.train.dispatch_ahead, run.mesh.devices.flat[0].platform)
    key = f"{run.task.unit}_per_s_per_device"
    seen: set = set(built_before)
    batch = run.batch(conductor.step, reset_all=reset_first) if conductor.step < steps else None
    n = max(steps - conductor.step, 0)
    # Each step's learning rate for its record, as the step computes it (step.update_levels: the
    # schedule at step + 1), in one computation here rather than a device round trip per step.
    lrs = np.broadcast_to(np.asarray(run.engine.lr(jnp.arange(conductor.step + 1, steps + 1))), (n,))
    pending = None  # the step before, dispatched ahead of this one, its metrics not yet read
    read_at = 0.0  # when the host last had a step's loss

    def built(active, batch) -> bool:
        """Whether the step of `active` on `batch` is compiled already. A batch the step refuses
        (a tail of the wrong size) is refused by its own dispatch, after this step's record."""
        try:
            return run.cache.variant(active, batch) in seen
        except ConfigError:
            return False

    def result(d: dict, state) -> StepResult:
        nonlocal read_at
        loss = mean_loss(d["m"])  # waits for the step
        done = time.perf_counter()
        dt, read_at = done - max(d["t0"], read_at), done
        rec = step_record(d["pulse"], d["m"], loss, dt, d["units"], key, d["compiled"], d["variant"], d["lr"])
        if d["compiled"]:
            rec["compile_s"] = run.cache.compile_s.get(d["variant"])
        return StepResult(d["pulse"], state, rec, d["last"], d["units"] / dt, variant=d["variant"])

    for i in range(n):
        p = conductor.pulse
        distributed.check_step(i, p, cfg.distributed.check_every)
        last = p.step == steps - 1
        d = {"pulse": p, "last": last, "units": run.units_per_device(batch), "lr": float(lrs[i])}
        # The mark a profile's idle time is split by (traces.idle_summary; costs nothing
        # unprofiled): from the step's dispatch until its loss is read or, dispatched ahead of
        # the next, until the next one's dispatch, so that such steps' marks tile the time.
        with jax.profiler.StepTraceAnnotation(traces.STEP_EVENT, step_num=p.step):
            d["t0"] = time.perf_counter()
            state, d["m"], d["variant"] = run.cache.train(p.active, state, batch)
            d["compiled"] = d["variant"] not in seen  # its first call includes its compilation
            seen.add(d["variant"])
            batch = None if last else run.batch(p.step + 1)  # overlaps the step on the device
            conductor = conductor.advance()
            if pending is not None:  # read, and its hooks run, while this step runs on the device
                previous, pending = result(pending, None), None
                yield previous
            ahead = dispatch_ahead and not last and not keep(p.step) and built(conductor.pulse.active, batch)
            stopping = ahead and stop(p.step)  # as late as a step dispatched ahead allows
            mine = result(d, state) if stopping or not ahead else None
        if mine is None:
            pending = d
            continue
        yield mine
        if not ahead:
            stopping = stop(p.step)  # after the step's hooks
        if stopping and not last:
            return


class Profiler:
    """A jax.profiler trace of steps [train.profile_start, + train.profile_steps) into
    run.dir/profile (TensorBoard's profile plugin or Perfetto read it); where `here` (process 0
    only). When it ends, where the device time went (`nljax.measure.traces`) is said and written to
    run.dir/profile/summary.json. `start(step)` before the loop, then two hooks: `stop` first
    after each step (the trace ends with the last profiled step, not with the other hooks) and
    `start_next` last (it begins right before the first profiled step)."""

    def __init__(self, first: int, n: int, path: Path, say: Callable[[str], None] = print, here: bool = True):
        self.first, self.n, self.path, self.on, self.say = first, n, path / "profile", False, say
        self.here = here
        self.steps = 0
        self.step_s: list[float] = []  # of the profiled steps that did not compile
        self.started = False  # `start` called once: the step the run starts (or resumes) at

    def start(self, step: int) -> None:
        if not (self.here and self.n):
            return
        first_call, self.started = not self.started, True
        # only where the run starts: `start_next` calls this after every step, and the trace's
        # folder appears when the window ends, so a fresh run warned at its second profiled
        # step, and a resumed one at every step
        if first_call and self.first < step and not self.path.exists():
            # a run resumed past a window it never recorded (a first run stopped before it, or a
            # window moved on resume) ended without a trace in silence; one recorded earlier is
            # in run.dir/profile, and its resumes say nothing
            self.say(f"warning: train.profile_start={self.first} is before step {step}, where this run resumes: "
                     f"nothing is profiled (train.profile_start={step} or later profiles this run)")
        if step == self.first:
            note_written(self.path.parent, "profile")  # before it is made: an overwrite removes it
            jax.profiler.start_trace(str(self.path), create_perfetto_trace=True)
            self.on = True

    def stop(self, r: StepResult) -> None:
        if not self.on:
            return
        self.steps += 1
        if not r.record["compiled"]:  # a first call's time includes its compilation
            self.step_s.append(r.record["step_time_s"])
        if r.step == self.first + self.n - 1 or r.last:
            self.end(r.step)

    def end(self, step: int) -> None:
        """Ends the trace after `step` if one is being recorded: the window's last step, the run's,
        or a stop inside the window (a preemption, train.target_eval_loss), which left it open."""
        if not self.on:
            return
        jax.profiler.stop_trace()
        self.on = False
        if self.steps < self.n:  # the run ended inside the window (train.steps, a stop): said, with the summary
            self.say(f"profile: {self.steps} of the train.profile_steps={self.n} steps from step {self.first} "
                     f"recorded: the run ends at step {step}")
        self.report()

    def report(self) -> None:
        try:
            s = traces.summarize(self.path, self.steps, sum(self.step_s) / len(self.step_s) if self.step_s else 0.0)
        except (OSError, ValueError) as e:  # a trace jax could not write or convert: the run goes on
            self.say(f"profile: no summary of the trace in {self.path} ({e})")
            return
        (self.path / "summary.json").write_text(json.dumps(s, indent=1))
        # where to open it: the summary's figures alone did not say where the trace went
        where = f"profile: the trace in {self.path} (TensorBoard's profile tab, or its .trace.json.gz in Perfetto)"
        self.say("\n".join([*traces.format_summary(s), where]))

    def keeps(self, step: int) -> bool:
        """The step before the first profiled one (the trace starts with nothing in flight) and
        the last profiled one (it stops before the next step is dispatched). On every process,
        `here` or not: a step kept on one process and dispatched ahead on another would order
        their collectives differently (the loss's gather, `distributed.check_step`), which every
        process must make in the same order."""
        return bool(self.n) and step in (self.first - 1, self.first + self.n - 1)

    def start_next(self, r: StepResult) -> None:
        if not r.last:
            self.start(r.step + 1)
