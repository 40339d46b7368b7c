"""Variants of one config side by side: their all-levels train steps interleaved in one process.

    python benchmarks/ab.py --config titans_demo --rounds 6 "model.remat=none" "model.remat=memory"

Each argument after the options is one variant's overrides (space-separated; "" is the config as
is). Every variant's step is compiled, then the rounds run each variant's step in turn, so a
change of clock or load hits all of them alike. Printed per variant: median and min step time,
the ratio of medians to the first variant, compile time, peak memory (the compiled program's
`memory_analysis`: arguments + outputs + temporaries - donated), and with `--profile N` the XLA ops per step and the
device's busy share from N profiled steps (`nljax/measure/traces.py`). `--out FILE.json` keeps it all,
with the XLA flags the process ran under (`xla_flags`: XLA_FLAGS less where XLA writes dumps and caches).

`--loop K`: a round runs K all-levels steps of each variant through the training loop itself
(`nljax.run.loop.training_steps`, no hook keeping a state), and its time is the K steps' wall time
over K: what the trainer gets, with `train.dispatch_ahead` as the variant sets it, e.g.

    python benchmarks/ab.py --config titans_demo --loop 8 "train.dispatch_ahead=true" "train.dispatch_ahead=false"

Without it each step is waited for before the next is dispatched (the step alone). Variants that
differ in train.dispatch_ahead alone share one compiled step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nljax import cli, config  # noqa: E402  (after the path: a checkout need not be installed)
from nljax.engine import executables  # noqa: E402
from nljax.measure import hostmem, traces  # noqa: E402
from nljax.runtime import resultfile  # noqa: E402

RESULT_KEYS = frozenset({"config", "rounds", "loop", "rows"})  # an earlier result, which --out may replace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu-devices", type=int, default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--loop", type=int, default=0, metavar="K",
                   help="time rounds of K steps through the training loop (train.dispatch_ahead applies)")
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("variants", nargs="+", help='overrides of each variant, e.g. "model.remat=none"')
    args = p.parse_args(argv)
    try:
        return run(args)
    except config.ConfigError as e:
        print(f"ab.py: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.rounds < 1 or args.warmup < 0 or args.profile < 0 or args.loop < 0:
        raise config.ConfigError("--rounds must be >= 1, --warmup, --profile and --loop >= 0")
    if args.out:  # else its traceback came after every variant had compiled and run
        resultfile.check(Path(args.out), f"--out {args.out}", "ab.py", RESULT_KEYS)
    cli.setup_devices(args.cpu_devices)
    hostmem.retain()  # as nljax's commands do, before JAX starts (nljax/measure/hostmem.py)

    import jax

    from nljax.bench import built as how_built
    from nljax.bench import compile_variants, peak_memory, say, unevaluated
    from nljax.models.registry import forms_of
    from nljax.run.core import Run

    # Every variant's config, mesh and data checked before the first step compiles (minutes
    # each): a second variant whose mesh did not fit the devices was refused only after the first
    # had compiled.
    print(f"ab.py: building the run of {len(args.variants)} variant{'s' * (len(args.variants) > 1)} ...",
          file=sys.stderr, flush=True)  # the data read, the models built: seconds before the first compile
    runs = []
    for v in args.variants:
        try:
            cfg = unevaluated(config.load(args.config, v.split()))
            same = next((r for r in runs if same_step(r[1].cfg, cfg)), None)
            # a variant that differs only in how the loop runs shares the step compiled for the first
            runs.append((v, dataclasses.replace(same[1], cfg=cfg) if same else Run.create(cfg), same and same[0]))
        except config.ConfigError as e:
            raise config.ConfigError(f"variant \"{v}\": {e}") if len(args.variants) > 1 else e from None
    built = []
    for v, run, shared in runs:  # shared: the variant whose step this one runs, or None
        say(f"{v or '(config)'}: initializing the parameters and the optimizer state ...")  # seconds: its init compiles
        batch, state = run.batch(0), run.init_state()
        every = tuple(True for _ in run.cfg.cms.periods)
        fns, compile_s = compile_variants(run.cache, [every], state, batch)
        built.append({"variant": v, "run": run, "step": 0, "fn": fns[every], "state": state, "batch": batch,
                      "compile_s": compile_s[every],
                      # compile_s of a loaded step is its load
                      "executable": f"shared with {shared or '(config)'}" if shared is not None else
                      how_built(run.cache, every, batch),
                      "memory_bytes": peak_memory(fns)["compiled_peak_bytes"], "times": []})
    for i in range(args.warmup + args.rounds):  # a round runs every variant's step once
        for b in built:
            t0 = time.perf_counter()
            if args.loop:
                b["state"] = in_the_loop(b, args.loop)
            else:
                b["state"], metrics = b["fn"](b["state"], b["batch"])  # donates the state
                jax.block_until_ready((b["state"], metrics))
            if i >= args.warmup:
                b["times"].append((time.perf_counter() - t0) / max(args.loop, 1))
    base = statistics.median(built[0]["times"])
    rows = []
    for b in built:
        row = {"variant": b["variant"] or "(config)", "median_ms": statistics.median(b["times"]) * 1e3,
               "min_ms": min(b["times"]) * 1e3, "ratio": statistics.median(b["times"]) / base,
               "compile_s": b["compile_s"], "executable": b["executable"], "memory_bytes": b["memory_bytes"]}
        row["forms"] = forms_of(b["run"].engine.model)
        if args.profile:
            with tempfile.TemporaryDirectory() as tmp:
                if args.loop:  # the loop marks its steps itself
                    b["state"], step_s = traces.trace(lambda state: in_the_loop(b, args.profile, state), b["state"],
                                                      args.profile, Path(tmp))
                else:
                    b["state"], step_s = traces.record(b["fn"], b["state"], b["batch"], args.profile, Path(tmp))
                s = traces.summarize(Path(tmp), args.profile, step_s, hlo_text=b["fn"].as_text(),
                                     timed_step_s=row["median_ms"] / 1e3, from_marks=True)
            row.update(ops_per_step=s["ops"], busy_s=s["busy_s"], profiled_step_s=s["step_s"],
                       busy_fraction=s["busy_fraction"], by_category_s=s["by_category_s"],
                       by_scope_s=s["by_scope_s"], **({"idle": s["idle"]} if "idle" in s else {}))
        rows.append(row)
    how = f"rounds of {args.loop} steps in the training loop" if args.loop else "each step waited for"
    print(f"{args.config or '(default config)'}: {args.rounds} interleaved rounds after {args.warmup} warm-up, "
          f"all-levels step ({how}), {jax.device_count()} x {jax.devices()[0].device_kind}")
    for r in rows:
        mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:,.0f} MiB"
        busy = "-" if r.get("busy_fraction") is None else f"{100 * r['busy_fraction']:.0f}%"
        ops = f"  {r['ops_per_step']:,.0f} ops/step, busy {busy}" if "ops_per_step" in r else ""
        print(f"  {r['variant']:<40} median {r['median_ms']:9.1f} ms  min {r['min_ms']:9.1f} ms  x{r['ratio']:.3f}  "
              f"{built_how(r)}  memory {mem}{ops}")
        if r.get("idle"):  # where the device waited in the profiled steps
            print("\n".join(f"      {line}" for line in traces.format_idle(r["idle"])))
    if args.out:  # whole or not at all, checked before anything ran
        # the XLA flags every variant compiled and ran under (XLA_FLAGS is the process's; where XLA
        # writes dumps and caches left out): the GPU suite's command-buffer part runs one process per set
        resultfile.write(Path(args.out), {"config": args.config, "rounds": args.rounds, "warmup": args.warmup,
                                          "loop": args.loop, "xla_flags": executables.xla_flags(), "rows": rows})
    return 0


def built_how(row: dict) -> str:
    how = row["executable"]
    if how.startswith("shared"):
        return f"step {how}"
    return f"{'compile' if how == 'compiled' else 'load'} {row['compile_s']:5.1f} s"


def same_step(a, b) -> bool:
    """Whether configs `a` and `b` differ in train.dispatch_ahead at most: the same compiled step."""
    return dataclasses.replace(a, train=dataclasses.replace(a.train, dispatch_ahead=b.train.dispatch_ahead)) == b


def in_the_loop(b: dict, k: int, state=None):
    """K all-levels steps of variant `b` through the training loop (`nljax.bench.loop_steps`, all
    levels firing every step, so that its compiled step is the one timed). Returns the state
    after them."""
    from nljax.bench import loop_steps, only

    run, start = b["run"], b["step"]
    every = tuple(True for _ in run.cfg.cms.periods)
    state = loop_steps(run, b["state"] if state is None else state, only(every, start, k), k,
                       {run.cache.variant(every, b["batch"])})
    b["step"] = start + k
    return state


if __name__ == "__main__":
    sys.exit(main())
