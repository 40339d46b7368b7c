"""What a run shows while it trains and leaves behind: progress on the terminal and PNG plots in
`run.dir` (its trackers, TensorBoard and W&B, are in nljax/run/trackers.py). Only process 0 creates
any of them."""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
import sys
from pathlib import Path

# The names a run writes in run.dir, each noted here before it is written (a fresh run claims
# config.yaml, metrics.jsonl, ... at its start; samples_000100.png, TensorBoard event files as
# they are written), so that run.overwrite=true removes the earlier run's files and nothing else,
# and a fresh run refuses a run.dir holding a user's file under one of these names.
WRITTEN = "nljax_written.txt"
# What a run may write: a name in the listing that matches none of these is not removed
OUTPUT_PATTERNS = ("metrics.jsonl", "summary.json", "config.yaml", "loss.png", "step_time.png", "profile", "wandb",
                   "samples_*.png", "events.out.tfevents.*")


def note_written(run_dir: Path, name: str) -> None:
    with open(Path(run_dir) / WRITTEN, "a") as f:
        f.write(name + "\n")


def written(run_dir: Path) -> set[str]:
    """The names noted by `note_written` that a run may write (`OUTPUT_PATTERNS`, plain names in
    `run_dir`): a name added to the listing by hand is never taken for the run's (warned)."""
    listing = Path(run_dir) / WRITTEN
    try:
        names = set(listing.read_text(errors="replace").splitlines()) if listing.is_file() else set()
    except OSError:
        return set()
    ours = {n for n in names if n and n == Path(n).name and any(fnmatch.fnmatchcase(n, p) for p in OUTPUT_PATTERNS)}
    if names - ours - {""}:
        print(f"nljax: warning: {listing} lists names a run does not write ({', '.join(sorted(names - ours - {''})[:3])}"
              "): left in place", file=sys.stderr)
    return ours


def remove_written(run_dir: Path) -> None:
    """Removes the files and folders noted by `note_written` (`written`), then the list."""
    for name in written(run_dir):
        p = Path(run_dir) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    (Path(run_dir) / WRITTEN).unlink(missing_ok=True)


def strict_json(obj, indent: int | None = None) -> str:
    """JSON that every parser reads: a non-finite float (a NaN loss) is written as null, never as
    the bare `NaN`/`Infinity` that Python's json module writes by default."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def short_unit(unit: str) -> str:
    """Column-width name of a task's unit: tokens -> tok, images -> img."""
    return {"tokens": "tok", "images": "img"}.get(unit, unit)


class Progress:
    """A progress bar (loss, throughput, ETA) on an interactive terminal; otherwise one log line
    every `every` steps. Silent when `quiet`."""

    def __init__(self, total: int, start: int, every: int, quiet: bool, unit: str = "tok"):
        self.every, self.quiet, self.unit = every, quiet, unit
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def say(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def update(self, rec: dict, rate: float, last: bool, eval_text: str = "") -> None:
        pattern = rec["pattern"]
        if rec.get("compile_s") is not None:
            self.say(f"compiled {pattern} in {rec['compile_s']:.1f} s")
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {rec['loss']:.4f}  {rate:,.0f} {self.unit}/s/device", refresh=False)
            self.bar.update(1)
            if eval_text:
                self.bar.write(f"step {rec['step']:6d}  {eval_text}")
        elif rec["step"] % self.every == 0 or last or eval_text:
            ms = rec["step_time_s"] * 1e3
            self.say(f"step {rec['step']:6d}  loss {rec['loss']:.4f}  {pattern:<10} {ms:8.1f} ms  "
                     f"{rate:10,.0f} {self.unit}/s/device{'  ' + eval_text if eval_text else ''}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_metrics(metrics: dict) -> str:
    """Whatever numbers a task's `evaluate` returns, as `key value` pairs."""
    parts = []
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        parts.append(f"{k} {v:,d}" if isinstance(v, int) else f"{k} {v:.4g}")
    return "  ".join(parts)


def plot(path: Path, records: list[dict], timed: dict, final_eval: dict | None = None) -> list[str]:
    """loss.png (training loss per step and every eval metric named *loss*, the final evaluation
    included) and step_time.png (step time per pulse pattern during training, with the medians
    timed at the end). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    steps = [r["step"] for r in records]
    if records:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [r["loss"] for r in records], lw=1, label="train loss")
        final = final_eval or {}
        for key in sorted({k for r in [*records, final] for k in r if k.startswith("eval") and "loss" in k}):
            pts = [(r["step"] + 1, r[key]) for r in records if key in r]
            pts += [(records[-1]["step"] + 1, final[key])] if key in final else []
            ax.plot(*zip(*pts), "o-", label=key)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path / "loss.png", dpi=100)
        plt.close(fig)
        written.append("loss.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        names = sorted({r["pattern"] for r in records}, key=lambda n: (n.count("+"), n))
        for i, name in enumerate(names):
            pts = [(r["step"], r["step_time_s"] * 1e3) for r in records if r["pattern"] == name and not r["compiled"]]
            color = f"C{i % 10}"
            if pts:
                ax.plot(*zip(*pts), ".", ms=3, color=color, label=f"{name} (training)")
            if name in timed:
                ax.axhline(timed[name]["step_time_ms"], color=color, ls="--", lw=1, label=f"{name} (timed, median)")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path / "step_time.png", dpi=100)
        plt.close(fig)
        written.append("step_time.png")
    return written
