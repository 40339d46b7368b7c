"""A new run pointed at a run.dir (or checkpoint.dir) that holds an earlier run is refused in one
line, from the directories alone: before the model is built, its parameters initialized or
anything compiled, on every process of a launch, and with nothing on disk changed
(nljax/checkpoint/taken.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import QUICK, TINY, lock, saved_run, subprocess_env, tree_hash

from nljax.run import trainer

ARGS = [*TINY, *QUICK, "train.steps=4", "run.compile_cache=none"]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """An earlier run: config.yaml, a metrics.jsonl with two steps, checkpoint 2 under
    runs/default/checkpoints (and the same run with its checkpoint.dir elsewhere); a run dir
    `partial` whose only checkpoint is a save cut short."""
    root = tmp_path_factory.mktemp("earlier")
    saved_run(root / "runs" / "default", [], 1, 1)
    saved_run(root / "elsewhere" / "run", [f"checkpoint.dir={root / 'elsewhere' / 'ckpt'}"], 1, 1)
    for run in (root / "runs" / "default", root / "elsewhere" / "run"):
        (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n{"step": 1, "loss": 5.4}\n')
    (root / "partial" / "checkpoints" / "2.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a first save cut short
    # what other commands wrote: an export (nljax.export), prepared data (nljax.prepare)
    (root / "exported").mkdir()
    (root / "exported" / "config.json").write_text(json.dumps({"config": {}, "step": 2, "dtype": "float32",
                                                               "checkpoint": "x"}))
    (root / "exported" / "model.safetensors").write_bytes(b"weights")
    (root / "data" / "mine").mkdir(parents=True)
    (root / "data" / "mine" / "manifest.json").write_text(json.dumps({"format": "nljax-text-1"}))
    (root / "data" / "mine" / "train.bin").write_bytes(b"tokens")
    return root


@pytest.fixture
def no_building(monkeypatch):
    """The run must not be built: building it fails the test."""
    def built(*a, **k):
        raise AssertionError("the run was built before the refusal")
    monkeypatch.setattr(trainer.Run, "create", built)


CASES = {
    # the README's quickstart run, then the quickstart again
    "checkpoints": ([], "nljax.train: error: run.dir runs/default already holds a run (checkpoints up to step 2): "
                        "continue it with --resume, choose another run.dir, or set run.overwrite=true to replace it"),
    # checkpoint.every=0 saves nothing, and is refused all the same: the run dir holds a run
    "no saving": (["checkpoint.every=0"], "nljax.train: error: run.dir runs/default already holds a run "
                  "(checkpoints up to step 2): continue it with --resume, choose another run.dir, or set "
                  "run.overwrite=true to replace it"),
    # a checkpoint.dir the user chose is named as such
    "checkpoint.dir": (["run.dir=elsewhere/new", "checkpoint.dir={root}/elsewhere/ckpt"],
                       "nljax.train: error: checkpoint.dir {root}/elsewhere/ckpt already holds checkpoints (up to step "
                       "2): continue that run with --resume, choose another checkpoint.dir, or set run.overwrite=true "
                       "to replace them"),
    # a run that logged steps but saved no checkpoint: nothing to resume
    "metrics only": (["run.dir=elsewhere/run", "checkpoint.dir={root}/elsewhere/none"],
                     "nljax.train: error: run.dir elsewhere/run already holds a run (metrics.jsonl, no checkpoint): "
                     "choose another run.dir, or set run.overwrite=true to replace it"),
    # a run killed in its first save
    "partial save": (["run.dir=partial"], "nljax.train: error: run.dir partial already holds a run (an incomplete "
                     "checkpoint): choose another run.dir, or set run.overwrite=true to replace it"),
    # another command's directory: the run's files went in beside its files, overwrite or not (the
    # export then read as the export alone; a later export or prepare into it was refused)
    "an export": (["run.dir=exported"], "nljax.train: error: run.dir exported is an export directory (nljax.export "
                  "wrote it): a run's files would mix with it; choose another run.dir"),
    "prepared data": (["run.dir=data/mine", "run.overwrite=true"], "nljax.train: error: run.dir data/mine holds "
                      "prepared data (nljax.prepare wrote it): a run's files would mix with them; choose another "
                      "run.dir (to train on them: data.prepared=DIR)"),
    # a fresh run in (or under) an earlier run's folder of checkpoints: its files beside the step
    # folders, which a resume of that run stops at
    "a run's checkpoints": (["run.dir=runs/default/checkpoints"], "nljax.train: error: run.dir "
                            "runs/default/checkpoints holds a run's checkpoints: this run's files would mix with them "
                            "(a resume of that run stops at folders it did not write); choose another run.dir"),
    "a step folder of a run's checkpoints": (["run.dir=elsewhere/ckpt/9", "run.overwrite=true"], "nljax.train: error: "
                                             "run.dir elsewhere/ckpt/9 is inside {root}/elsewhere/ckpt, which holds a "
                                             "run's checkpoints: this run's files would mix with them (a resume of "
                                             "that run stops at folders it did not write); choose another run.dir"),
    # a new run from another run's checkpoint into a checkpoint.dir holding a run's: refused even
    # saving nothing (checkpoint.every=0), as a later --resume would continue that run's checkpoints
    "started elsewhere": (["run.dir=elsewhere/new", "checkpoint.dir={root}/elsewhere/ckpt", "checkpoint.every=0",
                           "checkpoint.resume={root}/runs/default/checkpoints/2"],
                          "nljax.train: error: checkpoint.dir {root}/elsewhere/ckpt already holds another run's "
                          "checkpoints; choose another run.dir or checkpoint.dir, or set run.overwrite=true to replace "
                          "them"),
    # ... or into a run.dir holding a run: --resume would continue that run, not offered to this one
    "started elsewhere into a run": (["checkpoint.resume={root}/elsewhere/ckpt/2"], "nljax.train: error: run.dir "
                                     "runs/default already holds a run (checkpoints up to step 2): choose another "
                                     "run.dir, or set run.overwrite=true to replace it"),
    # --resume of a run that is not there
    "nothing to resume": (["--resume", "run.dir=nowhere"], "nljax.train: error: checkpoint not found: "
                          "{root}/nowhere/checkpoints (--resume continues a run that saved checkpoints there; to "
                          "start this run, leave --resume out, or give --resume=auto, which starts it or continues "
                          "it)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_taken_run_dir_is_refused_before_the_run_is_built(earlier, tmp_path, monkeypatch, capfd, no_building, case):
    from nljax import train

    shutil.copytree(earlier, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    before = tree_hash(tmp_path)
    extra, line = CASES[case]
    capfd.readouterr()
    assert train.main([*ARGS, *(a.format(root=tmp_path) for a in extra)]) == 2
    out, err = capfd.readouterr()
    assert err.splitlines() == [line.format(root=tmp_path)], err
    assert "building the run" not in out, out
    assert tree_hash(tmp_path) == before  # nothing written, moved or removed


def test_every_process_of_a_launch_refuses_before_building(earlier, tmp_path):
    """2 processes x 4 devices on the default run dir that holds a run: each process stops with
    the same line, exit 2, before the slow start-up; nothing written."""
    shutil.copytree(earlier, tmp_path, dirs_exist_ok=True)
    before = tree_hash(tmp_path)
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "nljax.launch", "--nproc", "2", "--cpu-devices", "4", "--",
                        sys.executable, "-m", "nljax.train", *ARGS], cwd=tmp_path, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = sorted(l for l in p.stderr.splitlines() if not l.startswith("nljax.launch: "))
    line = ("run.dir runs/default already holds a run (checkpoints up to step 2): continue it with --resume, "
            "choose another run.dir, or set run.overwrite=true to replace it")
    assert lines == [f"[{i}] nljax.train: error (process {i}): {line}" for i in (0, 1)], p.stderr
    assert "building the run" not in p.stdout and "initializing" not in p.stdout, p.stdout
    assert tree_hash(tmp_path) == before
    assert time.monotonic() - t < 120  # JAX's start and the processes' joining only (a few seconds)


def test_overwrite_and_resume_are_not_refused(earlier, tmp_path, monkeypatch, no_building):
    """run.overwrite=true and --resume go on to build the run (here: the test's stand-in refuses)."""
    from nljax import train

    shutil.copytree(earlier, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    # checkpoint.dir=run.dir (the steps beside the run's files): the run's own folder of checkpoints;
    # not a step folder of one: a folder below another run's checkpoints named otherwise, or a
    # folder of numbered runs (not steps); a folder this user cannot look into holds none
    (tmp_path / "numbered" / "122" / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "numbered" / "122" / "checkpoints" / "2" / "state").mkdir()
    for extra in (["run.overwrite=true"], ["--resume"], ["run.dir=runs/default/checkpoints",
                                                         "checkpoint.dir=runs/default/checkpoints", "run.overwrite=true"],
                  ["run.dir=elsewhere/ckpt/new"], ["run.dir=numbered/123"]):
        with pytest.raises(AssertionError, match="the run was built"):
            train.main([*ARGS, *extra])
    from nljax.checkpoint import taken

    assert taken.checkpoints_around(tmp_path / "runs" / "default" / "checkpoints" / "7") == (
        tmp_path / "runs" / "default" / "checkpoints").resolve()
    with monkeypatch.context() as m:  # its step folders private to another user
        m.setattr(Path, "exists", lambda self: (_ for _ in ()).throw(PermissionError(13, "denied")))
        assert taken.checkpoints_around(tmp_path / "runs" / "default" / "checkpoints" / "7") is None


def test_a_checkpoint_dir_that_cannot_be_made_is_refused_before_the_run_is_built(tmp_path, monkeypatch, capfd,
                                                                                  no_building):
    """A checkpoint.dir under a file: refused only once the model was built and its parameters
    initialized ('cannot be created: Not a directory'), with the new run.dir left behind, empty."""
    from nljax import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.md").write_text("mine")
    capfd.readouterr()
    assert train.main([*ARGS, "run.dir=run", f"checkpoint.dir={tmp_path / 'notes.md' / 'ck'}"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        f"nljax.train: error: checkpoint.dir {tmp_path / 'notes.md' / 'ck'}: {tmp_path / 'notes.md'} is a file, "
        "not a directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


def test_a_run_dir_in_a_folder_that_cannot_be_written_is_refused_before_the_run_is_built(tmp_path, monkeypatch,
                                                                                           capfd, no_building):
    """A run.dir, or a checkpoint.dir, in a folder this process cannot write (its permissions, a
    read-only mount): one line and exit 2 before the run is built, nothing written."""
    from nljax import train

    locked = tmp_path / "locked"
    locked.mkdir()
    lock(locked, monkeypatch)
    try:
        for extra, said in (([f"run.dir={locked / 'run'}"], f"run.dir {locked / 'run'}: {locked}"),
                            ([f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={locked}"], f"checkpoint.dir {locked}")):
            capfd.readouterr()
            assert train.main([*ARGS, *extra]) == 2
            assert capfd.readouterr().err.splitlines() == [f"nljax.train: error: {said} is not writable"]
        assert list(locked.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["locked"]
    finally:
        locked.chmod(0o755)


def test_only_a_runs_checkpoints_folder_is_that_runs(tmp_path):
    """`other_runs`: a checkpoint.dir is another run's when it is that run directory's
    `checkpoints/` (its nljax_written.txt says a run wrote there), not any folder beside its files."""
    from nljax import config
    from nljax.checkpoint.taken import other_runs

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "nljax_written.txt").write_text("metrics.jsonl\n")
    cfg = config.load(None, [f"run.dir={tmp_path / 'new'}"])
    assert other_runs(cfg, tmp_path / "old" / "checkpoints") == tmp_path / "old"
    assert other_runs(cfg, tmp_path / "old" / "mine") is None
    assert other_runs(config.load(None, [f"run.dir={tmp_path / 'old'}"]), tmp_path / "old" / "checkpoints") is None
