"""What must not grow with a run's length or with the runs of one process (a notebook): objects
kept per run or per load, per step or per resume (docs/benchmarks/2026-12-02-long-runs.md)."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import jax.numpy as jnp
import pytest

from nljax.checkpoint import contents


class _Model:
    """The one method `contents.fingerprint` calls."""

    def __init__(self, width: int):
        self.width = width
        self.traced = 0

    def init(self, key):
        self.traced += 1
        return {"w": jnp.zeros((2, self.width))}


def test_fingerprint_keeps_no_model_after_the_next():
    """Each run of a notebook and each nljax.load builds a new model, and a checkpoint save or
    restore fingerprints it: the cache kept every one of them alive for the process's life (one
    model more per run or load, measured with nl_lm). Only the latest is kept now, traced once."""
    first = _Model(3)
    assert contents.fingerprint(first) == {"w": [[2, 3], "float32"]}
    assert contents.fingerprint(first) == {"w": [[2, 3], "float32"]}
    assert first.traced == 1  # a run's saves trace the model once
    gone = weakref.ref(first)
    second = _Model(4)
    assert contents.fingerprint(second) == {"w": [[2, 4], "float32"]}
    del first
    gc.collect()
    assert gone() is None


def test_a_task_is_not_kept_alive_by_its_fingerprint():
    """Each run builds its task, which holds the data it read (a corpus tokenized into memory,
    the images), and its start-up asks for the data's digest. A functools.cache on the method
    kept every task of the process, with its data: one more per run in a notebook, never freed."""
    import jax

    from nljax import config
    from nljax.parallel.mesh import make_mesh
    from nljax.run import tasks

    mesh = make_mesh(1, 1, jax.devices()[:1])
    text = ["train.seq_len=32", "train.batch_size=4"]
    image = ["model.name=dit", "images.source=moons", "cms.periods=[1]", "train.batch_size=4"]
    for make, overrides in ((tasks.TextTask, text), (tasks.ImageTask, image)):
        task = make(config.load(None, overrides), mesh)
        digest = task.fingerprint()
        assert len(digest) == 64 and task.fingerprint() == digest
        gone = weakref.ref(task)
        del task
        gc.collect()
        assert gone() is None


def _records(n: int, eval_every: int = 0):
    """`n` step records as the loop logs them, made one at a time (patterns of cms.periods [1, 2])."""
    for step in range(n):
        yield {"step": step, "loss": 3.0 - step / n, "pattern": "L0+L1" if step % 2 == 0 else "L0",
               "compiled": step < 2, "step_time_s": 0.01, "tokens_per_s_per_device": 800.0,
               "active_levels": [0, 1] if step % 2 == 0 else [0], "skipped_levels": [], "skipped": False,
               **({"eval_loss": 2.0} if eval_every and step % eval_every == eval_every - 1 else {})}


def _peak_bytes(f) -> int:
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_runs_history_holds_no_record_per_step():
    """The summary's counts (steps, final loss, skips, the loop's own rate) are kept as the steps
    come: the run held every step's record for its whole length before (1.6 KB a step, 1.6 GB over
    a million steps), and a resume read every earlier record into memory."""
    from nljax.run.trainer import resumed

    n = 50_000
    peak = _peak_bytes(lambda: resumed(_records(n), "tokens_per_s_per_device"))
    assert peak < 1_000_000, peak  # a list of the records: 23 MB
    hist = resumed(_records(n), "tokens_per_s_per_device")
    assert (hist.steps, hist.final_loss, hist.steady_steps) == (n, 3.0 - (n - 1) / n, n - 2)
    assert hist.steady_units / hist.steady_s == pytest.approx(800.0)


def test_a_resume_reads_its_log_a_line_at_a_time(tmp_path, capsys):
    """A resume's log is cut back by streaming it to a file renamed over metrics.jsonl when the log
    begins: its records were read whole (the file's bytes, then every record) and held for the run."""
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    n = 50_000
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(runlog.strict_json(r) + "\n" for r in _records(n, eval_every=100))
    size = (tmp_path / "metrics.jsonl").stat().st_size
    run_dir = None

    def take():
        nonlocal run_dir
        run_dir = RunDir(str(tmp_path), overwrite=False, write=True, resume_step=n - 100)

    assert _peak_bytes(take) < size / 10, size
    assert run_dir.evaluated_at(n - 100) and run_dir.last_kept["step"] == n - 101
    run_dir.begin_log()
    assert sum(1 for _ in run_dir.kept()) == n - 100 and capsys.readouterr().err == ""


def test_the_figures_of_a_long_run_draw_a_bounded_number_of_steps():
    """Above `plots.MOST_STEPS` steps of a pattern the figures take every k-th of each pattern, every
    evaluation and the last step: a million-step run's plots were drawn from every record."""
    from nljax.measure import plots

    n = 20_000
    assert plots.thinned(_records(100, eval_every=10), 100, most=100) == list(_records(100, eval_every=10))
    drawn = plots.thinned(_records(n, eval_every=1000), n, most=500)
    steps = [r["step"] for r in drawn]
    assert steps == sorted(steps) and steps[-1] == n - 1
    assert {r["pattern"] for r in drawn} == {"L0", "L0+L1"}  # every 40th step would all be one pattern's
    assert {r["step"] for r in drawn if "eval_loss" in r} == set(range(999, n, 1000))
    assert len(drawn) <= 2 * 250 + 20 + 1


@pytest.mark.slow
def test_watching_a_run_does_not_change_it(tmp_path):
    """Evaluations, text samples, checkpoints, TensorBoard, a profile window, a line per step, the
    plots, the end-of-run timing and the next step dispatched ahead read the run without changing
    it: every step's loss and gradient norm and the final evaluation bit for bit the run's without
    them (2 devices, a neural memory whose rows the evaluations and samples must not touch)."""
    import json

    from helpers import SMALL, TINY_NL, cli

    quiet = ["--cpu-devices", "2", *SMALL, *TINY_NL, "train.steps=8", "eval.every=0", "checkpoint.every=0",
             "train.sample_every=0", "run.trackers=[]", "run.plots=false", "throughput.reps=0", "--quiet"]
    watched = ["eval.every=3", "train.sample_every=3", "train.sample_tokens=4", "checkpoint.every=3",
               "run.trackers=[tensorboard]", "train.profile_start=2", "train.profile_steps=2", "train.log_every=1",
               "run.plots=true", "throughput.reps=1", "train.dispatch_ahead=true"]
    for name, extra in (("quiet", []), ("watched", watched)):
        p = cli("nljax.train", *quiet, f"run.dir={tmp_path / name}", *extra)
        assert p.returncode == 0, p.stderr[-2000:]
    read = lambda name: [(r["step"], r["loss"], r["grad_norm"])
                              for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())]
    assert read("watched") == read("quiet") and len(read("quiet")) == 8
    final = lambda name: json.loads((tmp_path / name / "summary.json").read_text())["eval_loss"]
    assert final("watched") == final("quiet")
    assert (tmp_path / "watched" / "loss.png").exists() and list((tmp_path / "watched" / "profile").iterdir())
