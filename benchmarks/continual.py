"""A continual-learning probe: train on corpus A, then on corpus B, and measure what is kept of A.

    python benchmarks/continual.py --steps 200 --seeds 0 1 "cms.periods=[1]" "cms.periods=[1,4,16,64]"

A is the standard library's top-level modules (Python source), B the English reference text
that ships with Python (`pydoc_data.topics`): both are written once as .txt files under
`--dir` (default runs/continual). Each variant (one string of overrides; "" is the default job)
and seed runs three `nljax.train` commands, each in its own run directory:

1. `A`: `--steps` steps on A (constant learning rate, so a phase's schedule is its own);
2. `B`: from A's last checkpoint, `--steps` more steps on B (the optimizer state carried);
3. `AA`: from B's last checkpoint, no step, A's held-out evaluation: A after B.

Printed per variant and seed, bits per byte fresh / streaming: A after A, B after B, A after B
and the forgetting, (A after B) − (A after A). Each nljax.train warns that the data changed
under its checkpoint: that change is the probe.
docs/experiments/2026-11-27-continual-learning.md reads these.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

PHASES = ("A", "B", "AA")


def write_corpora(root: Path) -> dict[str, Path]:
    """A (stdlib source) and B (pydoc topics) as one .txt file per document, written once."""
    import pydoc_data.topics

    dirs = {"A": root / "A", "B": root / "B"}
    if not (dirs["A"].is_dir() and dirs["B"].is_dir()):
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            (dirs["A"] / f"{p.stem}.txt").write_bytes(p.read_bytes())
        for name, text in sorted(pydoc_data.topics.topics.items()):
            (dirs["B"] / f"{name}.txt").write_text(text)
    return dirs


def commands(dirs: dict[str, Path], runs: Path, steps: int, seed: int, overrides: list[str]) -> dict[str, list[str]]:
    """The three nljax.train command lines of one variant and seed."""
    common = [f"seed={seed}", "optim.schedule=constant", "data.source=files", f"checkpoint.every={steps}",
              "eval.every=0", "run.plots=false", "run.trackers=[]", *overrides]
    a = [f"data.train={dirs['A']}/*.txt"]
    b = [f"data.train={dirs['B']}/*.txt", "data.eval_fraction=0.2"]  # 79 documents: hold out 16
    run = lambda phase: f"run.dir={runs / phase}"
    return {
        "A": [*common, *a, f"train.steps={steps}", run("A")],
        "B": [*common, *b, f"train.steps={2 * steps}", run("B"), f"checkpoint.resume={runs / 'A' / 'checkpoints' / str(steps)}"],
        "AA": [*common, *a, f"train.steps={2 * steps}", run("AA"),
               f"checkpoint.resume={runs / 'B' / 'checkpoints' / str(2 * steps)}"],
    }


def bpb(run_dir: Path) -> tuple[float, float]:
    s = json.loads((run_dir / "summary.json").read_text())
    return s["eval_bpb"], s["eval_bpb_stream"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="steps per phase")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--dir", default="runs/continual", help="corpora and run directories")
    p.add_argument("variants", nargs="+", help='overrides of each variant, e.g. "cms.periods=[1]" ("" for the default)')
    args = p.parse_args(argv)
    if args.steps < 1:
        print(f"continual.py: error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    root = Path(args.dir).absolute()
    dirs = write_corpora(root / "data")
    print(f"{'variant':40} {'seed':>4}  {'A after A':>13}  {'B after B':>13}  {'A after B':>13}  {'forgetting':>15}")
    for variant in args.variants:
        for seed in args.seeds:
            # named by what it runs: a later call with these settings reuses finished phases
            key = hashlib.sha256(f"{variant}|{args.steps}".encode()).hexdigest()[:10]
            runs = root / f"{key}_s{seed}"
            for phase, cmd in commands(dirs, runs, args.steps, seed, variant.split()).items():
                if (runs / phase / "summary.json").exists():
                    continue  # done by an earlier call: the probe resumes where it stopped
                p_ = subprocess.run([sys.executable, "-m", "nljax.train", "--quiet", *cmd], capture_output=True, text=True)
                if p_.returncode:
                    print(f"continual.py: error: phase {phase} of {variant!r} seed {seed} failed:\n{p_.stderr[-2000:]}",
                          file=sys.stderr)
                    return p_.returncode
            (aa, aa_s), (bb, bb_s), (ab, ab_s) = (bpb(runs / ph) for ph in PHASES)
            fmt = lambda x, y: f"{x:6.3f} / {y:5.3f}"
            print(f"{(variant or '(default)')[:40]:40} {seed:>4}  {fmt(aa, aa_s)}  {fmt(bb, bb_s)}  {fmt(ab, ab_s)}  "
                  f"{ab - aa:+7.3f} / {ab_s - aa_s:+6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
