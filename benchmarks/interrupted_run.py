"""A run of STEPS steps stopped by SIGTERM after a random 15 to 60 steps, again and again, each
time started again with `--resume=auto`, until it finishes; then, with `--against DIR` (the same
run uninterrupted), its final checkpoint's array checksums and its metrics.jsonl compared with
that run's (docs/benchmarks/2026-12-02-long-runs.md).

    python benchmarks/interrupted_run.py runs/s 620 --seed 1 [--against runs/ref] -- key=value ...
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def compare(a: Path, b: Path, step: int) -> None:
    arrays = [json.loads((d / f"checkpoints/{step}/nljax/metadata").read_text())["arrays"] for d in (a, b)]
    differ = [k for k in arrays[0] if arrays[0][k]["checksum"] != arrays[1].get(k, {}).get("checksum")]
    print(f"checkpoint {step}: {len(arrays[0])} arrays, {len(differ)} checksums differ {differ[:5]}")
    keys = ("step", "loss", "grad_norm", "lr", "pattern", "eval_loss", "eval_loss_stream")
    recs = [[tuple(json.loads(x).get(k) for k in keys) for x in lines(d / "metrics.jsonl")] for d in (a, b)]
    bad = [i for i, (x, y) in enumerate(zip(*recs)) if x != y]
    print(f"metrics.jsonl: {len(recs[0])} and {len(recs[1])} records, {len(bad)} differ in {keys}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # the run's overrides after `--`
    a, overrides = ap.parse_args(argv[:cut]), argv[cut + 1:]
    rng, d = random.Random(a.seed), Path(a.run_dir)
    metrics = d / "metrics.jsonl"
    for attempt in range(100):
        before = len(lines(metrics))
        stop_after = rng.randint(15, 60)
        t0, first = time.time(), None
        p = subprocess.Popen([sys.executable, "-m", "nljax.train", "--resume=auto", f"run.dir={d}",
                              f"train.steps={a.steps}", *overrides],
                             stdout=open(f"{d}.log.{attempt}", "w"), stderr=subprocess.STDOUT)
        while p.poll() is None:
            logged = lines(metrics)
            if first is None and logged and (attempt == 0 or len(logged) != before):
                first = time.time() - t0  # its first step logged (a resume cuts the log back first)
            last = json.loads(logged[-1])["step"] if logged else -1
            if first is not None and before + stop_after <= last < a.steps - 1:
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        rc = p.wait()
        if not lines(metrics):
            sys.exit(f"attempt {attempt}: exit {rc} before its first step (see {d}.log.{attempt})")
        print(f"attempt {attempt}: exit {rc}, last step {json.loads(lines(metrics)[-1])['step']}, first step "
              f"after {first or 0:.1f} s, wall {time.time() - t0:.1f} s", flush=True)
        done = (d / "summary.json").exists() and json.loads((d / "summary.json").read_text()).get("steps") == a.steps
        if rc == 0 and done:
            break
    if a.against:
        compare(d, Path(a.against), a.steps)


if __name__ == "__main__":
    main()
