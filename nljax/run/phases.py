"""What a run says around its long phases, so that none longer than ~2 s is silent (process 0,
not under --quiet): each step variant's compilation (which of how many, its pulse pattern, its
seconds), evaluations, checkpoint saves, the end-of-run timing.

A compilation can take minutes on a CPU and every pulse pattern of a CMS cycle is its own
executable (nljax/engine/step.py), so each one is said before it starts and timed after; the
persistent compile cache makes the second start fast (nljax/runtime/compile_cache.py).
"""

from __future__ import annotations

import contextlib
import shlex
import time
from pathlib import Path
from typing import Callable, Sequence

from nljax.engine.conductor import Conductor, pattern_name
from nljax.runtime import compile_cache

SLOW_S = 2.0  # a phase that took this long is said again the next time


def compile_announcer(periods: tuple[int, ...], say: Callable[[str], None],
                      label: str = "step variant") -> Callable[..., None]:
    """`StepCache.announce` for a run with CMS `periods`: "building step variant i of n (pattern
    L0+1) ..." before a variant is lowered, then how it came to be and its seconds: "compiled", or
    "loaded" and from where (an executable file, NLJAX_EXECUTABLES, or the compile cache); n is
    the cycle's distinct patterns (a tail batch that ends a data pass is one more variant of its
    pattern). The first line cannot say which: the executable file's key is the lowered
    program's, and a cache hit is known once compiling is asked; lowering alone can take seconds,
    too long to say nothing. `label`: what is built, where it is not the run's own step (the
    throughput split's one-device programs)."""
    total = len(Conductor(periods).patterns())
    order: dict = {}
    hits_before = [0]

    def announce(key, seconds: float | None, loaded: Path | None = None) -> None:
        active, tail = (key[0], f", tail batch of {key[1]} micro-batches") if isinstance(key[0], tuple) else (key, "")
        i = order.setdefault(key, len(order) + 1)
        what = f"{label} {i} of {total} (pattern {pattern_name(active)}{tail})"
        if seconds is None:
            hits_before[0] = compile_cache.hits()
            say(f"building {what} ...")  # not "compiling": it may be loaded (the docstring)
        elif loaded is not None:
            say(f"loaded {what} from {loaded} in {seconds:.1f} s")
        elif compile_cache.hits() > hits_before[0]:
            say(f"loaded {what} from the compile cache in {seconds:.1f} s")
        else:
            say(f"compiled {what} in {seconds:.1f} s")

    return announce


class Announced:
    """A phase that may take long (an evaluation, a checkpoint save): said before it runs the
    first time (it compiles then) and whenever the one before took over `SLOW_S`, with its
    seconds after when it did."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.last_s: float | None = None

    @contextlib.contextmanager
    def __call__(self, what: str):
        loud = self.last_s is None or self.last_s > SLOW_S
        if loud:
            self.say(f"{what} ...")
        t0 = time.perf_counter()
        yield
        self.last_s = time.perf_counter() - t0
        if loud and self.last_s > SLOW_S:
            self.say(f"{what}: {self.last_s:.1f} s")


def closing_lines(run_dir: str, steps: int, text: bool, exported: str, checkpoints: str | None = None,
                  samples: bool = True, script: Sequence[str] | None = None,
                  registered_by: str | None = None, more: str | None = None,
                  launcher: str | None = None) -> list[str]:
    """Where a finished run's outputs are and the commands that continue, sample and export it;
    `checkpoints`: their directory where it is not the run directory's own; `samples`: whether
    `nljax.generate` can sample the model (a text model without `logits()` cannot); `script`: the
    command that runs the file that registered the run's model in its own process (`python
    my_model.py` or `./my_model`), followed by the command (`SCRIPT COMMAND ...`,
    examples/smallest_model.py's form): `python -m nljax.generate` would not know the model;
    `registered_by`: the module that registered it in this process where no such script can be
    named (a notebook, a module the script imported): the commands are Python calls to make where
    the model is registered; `more`: the resume's override that trains on (default: twice the
    steps; a run stopped at train.target_eval_loss: that target off, or its resume stops at once);
    `launcher`: the `nljax.launch` command the run's processes were started by, which its resume
    goes through too (sampling and exporting are one process's)."""
    saved = f"plots; checkpoints in {checkpoints}" if checkpoints else "plots, checkpoints"
    head = f"run directory: {run_dir} (config.yaml, metrics.jsonl, summary.json, {saved})"
    more = more or f"train.steps={2 * steps or 1}"
    resume = ["--resume", f"run.dir={run_dir}", more]
    sample = [f"run.dir={run_dir}", *(["prompt=The "] if text else [])]
    if registered_by:
        calls = [("resume", "train", resume), *([("sample", "generate", sample)] if samples else []),
                 ("export", "export", [f"run.dir={run_dir}"])]
        return [head, f"  (model registered by {registered_by} in this process only, which `python -m` cannot "
                      "load: the calls to make where it is registered, each module imported)",
                *(f"  {what}:  nljax.{module}.main({args!r})" + (f"   (to {exported})" if what == "export" else "")
                  for what, module, args in calls)]
    d = shlex.quote(f"run.dir={run_dir}")  # pasted into a shell as printed, spaces and all

    def command(name: str) -> str:
        return f"{shlex.join(script)} {name}" if script else f"python -m nljax.{name}"

    prompt = " prompt='The '" if text else ""
    launched = f"{launcher} -- " if launcher else ""
    return [head,
            f"  resume:  {launched}{command('train')} --resume {d} {more}",
            *([f"  sample:  {command('generate')} {d}{prompt}"] if samples else []),
            f"  export:  {command('export')} {d}   (to {exported})"]
