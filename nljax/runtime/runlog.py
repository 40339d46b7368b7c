"""What a run shows while it trains and leaves behind: progress on the terminal and the files it
writes in `run.dir` (its plots are drawn by nljax/measure/plots.py; its trackers, TensorBoard and
W&B, are in nljax/run/trackers.py). Only process 0 creates any of them."""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
import sys
from pathlib import Path

from nljax.errors import few
from nljax.runtime.resultfile import temp_of

# The names a run writes in run.dir, each noted here right before it is first created
# (metrics.jsonl, config.yaml, summary.json, the plots, profile/ and wandb/ when made,
# samples_000100.png, TensorBoard event files), so that run.overwrite=true removes the earlier
# run's files and nothing else (never a wandb/ a run without W&B did not make), and a fresh run
# refuses a run.dir holding a user's file under one of these names.
WRITTEN = "nljax_written.txt"
# What a run may write: a name in the listing that matches none of these is not removed
OUTPUT_PATTERNS = ("metrics.jsonl", "summary.json", "config.yaml", "loss.png", "step_time.png", "profile", "wandb",
                   "samples_*.png", "events.out.tfevents.*")


def note_written(run_dir: Path, name: str) -> None:
    """Adds `name` to run_dir's listing (once): call it right before creating `name`, so that a
    run killed in between leaves a name listed, never a file no listing names."""
    listing = Path(run_dir) / WRITTEN
    try:
        if name in listing.read_text(errors="replace").splitlines():
            return
    except OSError:
        pass  # none yet (or unreadable: the append says so)
    with open(listing, "a") as f:
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
        print(f"nljax: warning: {listing} lists names a run does not write ({few(sorted(names - ours - {''}))}"
              "): left in place", file=sys.stderr)
    return ours


def remove_written(run_dir: Path) -> None:
    """Removes the files and folders noted by `note_written` (`written`), then the list, and the
    hidden `.NAME.tmp-PID` file a write of one of the run's files (NAME, an `OUTPUT_PATTERNS`
    name) left where a kill cut it short (`resultfile`, `figures.write_samples`)."""
    for name in written(run_dir):
        p = Path(run_dir) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for p in Path(run_dir).glob(".*.tmp-*"):
        name = temp_of(p.name)
        if name and p.is_file() and any(fnmatch.fnmatchcase(name, x) for x in OUTPUT_PATTERNS):
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
    every `every` steps, and at the first step (a resumed run's too: its loss beside the one
    before the interruption), an evaluation's and the last. Silent when `quiet`."""

    def __init__(self, total: int, start: int, every: int, quiet: bool, unit: str = "tok"):
        self.every, self.quiet, self.unit = every, quiet, unit
        self.start = start  # the first step of this run, printed as a fresh run's step 0 is (a resume's)
        self.last_mse = None  # the latest evaluation's eval_mse (MeanFlow), shown beside the loss
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
        pattern = rec["pattern"]  # its compilation is said as it happens (nljax/run/phases.py)
        loss = f"loss {loss_text(rec['loss'])}{self.error_text(rec)}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{loss}  {rate:,.0f} {self.unit}/s/device", refresh=False)
            self.bar.update(1)
            if eval_text:
                self.bar.write(f"step {rec['step']:6d}  {eval_text}")
        elif rec["step"] % self.every == 0 or rec["step"] == self.start or last or eval_text:
            ms = rec["step_time_s"] * 1e3
            self.say(f"step {rec['step']:6d}  {loss}  {pattern:<10} {ms:8.1f} ms  "
                     f"{rate:10,.0f} {self.unit}/s/device{'  ' + eval_text if eval_text else ''}")

    def error_text(self, rec: dict) -> str:
        """Beside an adaptively weighted loss (MeanFlow's: near 1 at every step with the default
        weight, whatever the fit): the latest held-out unweighted error (`eval_mse`, from the
        evaluations), which shows the fit."""
        if rec.get("eval_mse") is not None:
            self.last_mse = rec["eval_mse"]
        return "" if self.last_mse is None else f"  held-out mse (unweighted) {sig4(self.last_mse)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def loss_text(v: float) -> str:
    """The training loss on the log lines: four decimals (5.7505), and from 1e5 on (a diverging
    run) as `sig4` prints the evaluation's beside it (1.736e+09, not 1736104448.0000)."""
    return f"{v:.4f}" if not math.isfinite(v) or abs(v) < 1e5 else sig4(v)


def sig4(v: float) -> str:
    """A metric on the log lines: four significant digits, trailing zeros kept (2.310, not 2.31),
    so that a value keeps its width from one line to the next. From 1000 on, the rounded integer
    with thousands separators, as counts are printed (1,234 and 12,346, never '1234.' or
    1.235e+04; from 1e9 the exponent form); below 1e-4 the exponent form (1.230e-05); nan and
    inf as such."""
    if not math.isfinite(v):
        return str(float(v))
    s = f"{v:#.4g}"  # '#': the trailing zeros kept, and a point after 1234 ('1234.')
    if ("e+" in s or s.endswith(".")) and abs(v) < 1e9:  # 999.97 is '1000.' too, 9999.7 '1.000e+04'
        return f"{v:,.0f}"
    return s


# The keys a data.eval_sets set's evaluation gives (`<key>/<name>`: run/tasks.py's evaluate_set,
# and nljax.evaluate's bits per token): only these are a set's, summed up in its group.
SET_KEYS = frozenset(f"{key}{kind}" for key in ("eval_loss", "eval_bpb", "eval_tokens", "eval_bpt")
                     for kind in ("", "_stream"))


def format_metrics(metrics: dict) -> str:
    """Whatever numbers a task's `evaluate` returns, as `key value` pairs; then the data.eval_sets
    sets' (`<key>/<name>`: six keys a set, too many for one line) as one short group each,
    `name: loss/bpb` and the streaming evaluation's in brackets (a set's token counts only in
    metrics.jsonl). Any other key with a '/' (`acc/foo`, `lm_eval/hellaswag/acc`) is no set's and
    is a `key value` pair as well. metrics.jsonl keeps every key."""
    parts, sets = [], {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        base, slash, name = k.partition("/")
        if slash and base in SET_KEYS:
            sets.setdefault(name, {})[base] = v
            continue
        parts.append(f"{k} {v:,d}" if isinstance(v, int) else f"{k} {sig4(v)}")
    groups = [group for name, m in sets.items() if (group := _set_group(name, m))]
    if groups:
        parts.append("sets (loss/bpb)  " + "  ".join(groups))
    return "  ".join(parts)


def _set_group(name: str, m: dict) -> str:
    """'name: loss/bpb (stream loss/bpb)' of one set's metrics (keys without its name); '' when
    it has neither evaluation's loss and bits per byte."""
    fresh, stream = _loss_bpb(m, ""), _loss_bpb(m, "_stream")
    if not fresh and not stream:
        return ""
    return f"{name}: {fresh or '-'}" + (f" (stream {stream})" if stream else "")


def _loss_bpb(m: dict, kind: str) -> str:
    loss, bpb = m.get(f"eval_loss{kind}"), m.get(f"eval_bpb{kind}")
    return "" if loss is None or bpb is None else f"{sig4(loss)}/{sig4(bpb)}"
