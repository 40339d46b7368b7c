"""Watch a training command's process over a long run: RSS, open file descriptors, threads and
the run directory's size, sampled every `--every` seconds against the step the run has logged.

    python benchmarks/long_run.py --out samples.csv --run-dir runs/soak -- \
        python -m nljax.train run.dir=runs/soak train.steps=5000 ...

Writes one CSV row per sample (seconds, step, rss_mb, fds, threads, run_dir_bytes,
metrics_bytes), then prints the median step time per window of `--window` steps read from
the run's metrics.jsonl (docs/benchmarks/2026-12-02-long-runs.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # removed while walked (a pruned checkpoint)
                pass
    return total


def status(pid: int) -> tuple[float, int, int]:
    """RSS in MB, open file descriptors and threads of `pid`, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


def last_step(metrics: Path) -> int:
    """The last step in metrics.jsonl (-1: none yet), read from its tail."""
    try:
        with metrics.open("rb") as f:
            f.seek(max(f.seek(0, 2) - 4096, 0))
            lines = f.read().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue
    return -1


def windows(metrics: Path, window: int) -> list[tuple[int, float, int]]:
    """(first step, median step_time_s in ms, steps) per window of steps, compiled steps left out."""
    by: dict[int, list[float]] = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if not r.get("compiled"):
            by.setdefault(r["step"] // window * window, []).append(r["step_time_s"] * 1e3)
    return [(k, statistics.median(v), len(v)) for k, v in sorted(by.items())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--log", default=None, help="the command's output (default: beside --out)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    run_dir = Path(a.run_dir)
    metrics = run_dir / "metrics.jsonl"
    log = open(a.log or f"{a.out}.log", "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["s", "step", "rss_mb", "fds", "threads", "run_dir_bytes", "metrics_bytes"])
        while p.poll() is None:
            try:
                rss, fds, threads = status(p.pid)
            except (OSError, KeyError):
                break
            size = tree_bytes(run_dir) if run_dir.exists() else 0
            mb = metrics.stat().st_size if metrics.exists() else 0
            w.writerow([f"{time.time() - t0:.1f}", last_step(metrics), f"{rss:.1f}", fds, threads, size, mb])
            f.flush()
            time.sleep(a.every)
    rc = p.wait()
    print(f"exit {rc} after {time.time() - t0:.0f} s; samples in {a.out}")
    if metrics.exists():
        for first, ms, n in windows(metrics, a.window):
            print(f"steps {first:6d}-{first + a.window - 1:6d}: median {ms:7.2f} ms over {n} steps")
    sys.exit(rc)


if __name__ == "__main__":
    main()
