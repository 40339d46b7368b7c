"""A new user's first runs: each step variant's compilation is said as it happens and the second
start with another train.steps loads every variant from the compile cache (the step takes
train.steps as an input); a few hundred KB of one's own text trains with the defaults (the
streaming evaluation reads what the held-out text holds, said once); the closing lines name the
run directory and the commands that continue it."""

from __future__ import annotations

import random
from pathlib import Path

import jax
from helpers import QUICK, SMALL, cli

from nljax import config
from nljax.parallel import mesh as meshlib
from nljax.run import tasks
from nljax.version import __version__


def test_another_train_steps_loads_every_step_variant_from_the_compile_cache(tmp_path):
    cache = tmp_path / "cache"
    # every executable is written to the cache, however fast it compiled (JAX's default: >= 1 s)
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    common = ["--cpu-devices", "2", *SMALL, *QUICK, "eval.every=0", "checkpoint.every=0", f"run.compile_cache={cache}"]
    first = cli("nljax.train", *common, "train.steps=4", f"run.dir={tmp_path / 'a'}", env=env).stdout
    steps = lambda: sorted(p.name for p in cache.iterdir() if p.name.startswith("jit_train_step"))
    cached = steps()
    assert len(cached) == 3, cached  # cms.periods=[1,2,4]: L0+1+2, L0, L0+1
    for i, pattern in enumerate(["L0+1+2", "L0", "L0+1"], 1):
        assert f"building step variant {i} of 3 (pattern {pattern}) ...\ncompiled step variant {i} of 3" in first, first
    second = cli("nljax.train", *common, "train.steps=7", f"run.dir={tmp_path / 'b'}", env=env).stdout
    assert steps() == cached  # no new executable: the step does not depend on train.steps
    for i, pattern in enumerate(["L0+1+2", "L0", "L0+1"], 1):
        assert (f"building step variant {i} of 3 (pattern {pattern}) ...\nloaded step variant {i} of 3 (pattern "
                f"{pattern}) from the compile cache in ") in second, second  # never "compiling" what it loads
    assert "run directory: " in second and "python -m nljax.train --resume" not in second  # no checkpoint


def write_corpus(root: Path) -> int:
    """~400 KB of text in 40 .txt files (one document each); the held-out ones (every 20th with
    data.eval_fraction=0.05) are small, 2 KB each, as a user's files may well be. Bytes written."""
    rng = random.Random(0)
    words = "the a memory level stream token window model learns reads writes data file line of and".split()
    root.mkdir()
    total = 0
    for i in range(40):
        size = 2_000 if i % 20 == 19 else 10_500
        text = ""
        while len(text) < size:
            text += " ".join(rng.choice(words) for _ in range(12)) + ".\n"
        (root / f"doc{i:02d}.txt").write_text(text)
        total += len(text)
    return total


def test_a_small_corpus_trains_with_the_default_evaluation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert 380_000 < write_corpus(tmp_path / "corpus") < 440_000
    cfg = tasks.resolve(config.load(None, ["data.source=files", "data.train=corpus/*.txt"]))
    task = tasks.TextTask(cfg, meshlib.make_mesh(1, 2, jax.devices()[:2]))
    assert cfg.eval.stream_steps == 4 and task.stream_steps == 1  # 4 windows x 16 rows do not fit ~4 KB
    assert len(task.notes) == 1 and task.notes[0].startswith("note: eval.stream_steps=4 windows of train.seq_len=128")
    # the first own-data example, a small model on one device: the note once, the run to its end
    p = cli("nljax.train", "--cpu-devices", "1", "data.source=files", "data.train=corpus/*.txt", "model.name=cms_mlp",
            "model.dim=16", "model.depth=1", "cms.periods=[1]", "train.steps=2", *QUICK, "run.dir=runs/mine",
            cwd=tmp_path)
    assert p.stdout.count("note: eval.stream_steps=4") == 1, p.stdout
    # the text read and tokenized at start is said, with what does it once
    assert (f"nljax {__version__}: building the run (model cms_mlp, data files) ...\nreading and tokenizing "
            "data.train into memory (at every start: python -m nljax.prepare does it once) ...\n") in p.stdout, p.stdout
    assert "eval_loss_stream" in p.stdout
    # the final evaluation's numbers as soon as it ran, before the throughput timing's rounds
    out = p.stdout
    assert out.index("evaluating the final state") < out.index("final eval: eval_loss") < out.index("timing")
    assert p.stdout.rstrip().splitlines()[-4:] == [
        "run directory: runs/mine (config.yaml, metrics.jsonl, summary.json, plots, checkpoints)",
        "  resume:  python -m nljax.train --resume run.dir=runs/mine train.steps=4",
        "  sample:  python -m nljax.generate run.dir=runs/mine prompt='The '",
        "  export:  python -m nljax.export run.dir=runs/mine   (to runs/mine/export)"]


def test_launch_keeps_gloo_connection_lines_out_of_the_output():
    """gloo's "[Gloo] Rank x is connected to 1 peer ranks" (written by workers' native code, 24 of
    them in a CPU run) are dropped, two of them interleaved too (a process's two devices' notes, as
    2 x 2 launches printed them), and JAX's native note of a SIGTERM each process takes as a
    preemption notice; every other line of the workers passes, prefixed (a bare number too)."""
    import subprocess
    import sys

    from helpers import subprocess_env

    note = "is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    script = (f'echo "[Gloo] Rank $NLJAX_PROCESS_ID {note}"; echo "[Gloo] Rank [Gloo] Rank 1 {note}"; echo "0 {note}"; '
              f'echo "[Gloo] Rank 0 is connected to 1 peer ranks. [Gloo] Rank 1 {note}"; '
              'echo "Expected number of connected peer ranks is : 1"; echo 12; echo "[Gloo] something else"; '
              'echo "W1202 05:12:09.413211   25945 preemption_notifier.cc:90] SIGTERM caught at 2026-12-02T05:12" >&2;'
              ' '
              'echo "step $NLJAX_PROCESS_ID"')
    p = subprocess.run([sys.executable, "-m", "nljax.launch", "--nproc", "2", "--", "sh", "-c", script],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SIGTERM caught" not in p.stderr, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[0] 12", "[0] [Gloo] something else", "[0] step 0", "[1] 12",
                                             "[1] [Gloo] something else", "[1] step 1"]


def test_the_end_of_run_timing_stays_within_its_budget():
    """`throughput.max_fraction`: the rounds stop short of `throughput.reps` where they would take
    longer than the budget (one round at least), and the timing says what it does."""
    import time

    from nljax.run import throughput

    calls, said = [], []
    runs = {k: (lambda k=k: calls.append(k) or time.sleep(0.02)) for k in "ab"}  # a round: ~40 ms
    medians = throughput._time_interleaved(runs, reps=5, budget_s=0.1, say=said.append)
    assert set(medians) == {"a", "b"} and 1 <= len(calls) // 2 - 1 <= 2, calls  # warm-up, then 1-2 rounds
    assert said[0].startswith("timing 2 step variants again") and said[1].startswith("timing: ")
    calls.clear()
    throughput._time_interleaved(runs, reps=3, budget_s=None)
    assert len(calls) >= 2 * (1 + 3)  # unbounded: reps at least (more for short rounds)
