"""`nljax.train --resume=auto`: the same command starts a run, continues it from its newest
checkpoint, and starts over in place a run that saved none (nljax/run/autoresume.py); plain
`--resume` is unchanged. In-process runs of a tiny model, a few steps each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QUICK, TINY, subprocess_env

from nljax import cli, train
from nljax.errors import ConfigError
from nljax.run import autoresume
from nljax.runtime import distributed

# constant learning rate (TINY): a run of 4 steps continued to 6 trains as one of 6 straight through
ARGS = [*TINY, *QUICK, "--quiet", "cms.periods=[1,2]", "eval.every=0", "eval.batches=1"]
SAVING = [*ARGS, "checkpoint.every=2"]


def stop_here(cfg):
    raise ConfigError("stop here")


def losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]


def steps(run: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """The losses of 6 steps straight through."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert train.main([*SAVING, "train.steps=6", f"run.dir={run}"]) == 0
    return losses(run)


def test_a_new_run_dir_starts_and_the_same_command_continues_it(straight, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert train.main(["--resume=auto", *SAVING, "train.steps=4", "run.dir=runs/x"]) == 0
    assert "nljax: --resume=auto: no checkpoint in runs/x, starting a new run" not in capfd.readouterr().err  # --quiet
    assert sorted(p.name for p in Path("runs/x/checkpoints").iterdir()) == ["2", "4"]
    # the command again (with more steps) resumes from checkpoint 4, with the run's config.yaml (checkpoint.every=2)
    assert train.main(["--resume=auto", *ARGS, "train.steps=6", "run.dir=runs/x"]) == 0
    err = capfd.readouterr().err
    assert "--resume=auto" not in err and "error" not in err, err
    assert steps(tmp_path / "runs/x") == list(range(6))
    assert losses(tmp_path / "runs/x") == straight  # bitwise: the uninterrupted run's
    assert sorted(p.name for p in Path("runs/x/checkpoints").iterdir()) == ["2", "4", "6"]
    # --print-config shows the config the command would resume with, and says nothing else
    assert train.main(["--resume=auto", "--print-config", "run.dir=runs/x"]) == 0
    out, err = capfd.readouterr()
    assert {"  steps: 6", "  resume: latest"} <= set(out.splitlines()) and err == "", (out, err)


def test_the_decision_is_said_in_one_line(tmp_path, monkeypatch, capfd):
    """Without --quiet: a new run says it starts (stderr), before anything is built."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "setup_processes", lambda args, cfg: False)
    monkeypatch.setattr(distributed, "check_config", stop_here)
    args = [a for a in ARGS if a != "--quiet"]
    assert train.main(["--resume=auto", *args, "run.dir=runs/x"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "nljax: --resume=auto: no checkpoint in runs/x, starting a new run", "nljax.train: error: stop here"]
    assert not Path("runs").exists()


def test_a_run_that_saved_no_checkpoint_starts_over_in_place(straight, tmp_path, monkeypatch, capfd):
    """A first attempt stopped before its first save (it logged steps; its save was cut short):
    --resume=auto starts the run over in place, replacing that attempt's files and its partial
    save, and leaves a file of the user's; the run trains as a new one."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs/x"
    assert train.main([*ARGS, "train.steps=3", "checkpoint.every=0", "optim.lr=0.5", "run.dir=runs/x"]) == 0
    partial = run / "checkpoints" / "2.orbax-checkpoint-tmp-1"
    partial.mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    capfd.readouterr()
    args = [a for a in ARGS if a != "--quiet"]
    assert train.main(["--resume=auto", *args, "checkpoint.every=2", "train.steps=4", "run.dir=runs/x"]) == 0
    err = capfd.readouterr().err.splitlines()
    assert err[0] == ("nljax: --resume=auto: runs/x holds a run with no complete checkpoint (metrics.jsonl, an "
                      "incomplete checkpoint): starting it over in place, replacing its files"), err
    assert steps(run) == list(range(4)) and losses(run) == straight[:4]  # optim.lr=0.5 was the other attempt's
    assert not partial.exists() and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    assert (run / "notes.txt").read_text() == "mine"


def test_a_run_whose_checkpoints_are_in_another_checkpoint_dir_is_not_started_over(tmp_path, monkeypatch, capfd):
    """The restart's command names another checkpoint.dir than the one the run saved to: the run
    is one to resume, not an attempt to start over; starting over in place replaced its
    metrics.jsonl and config.yaml. One line, nothing changed."""
    from helpers import tree_hash

    monkeypatch.chdir(tmp_path)
    assert train.main([*SAVING, "train.steps=2", "run.dir=runs/x"]) == 0
    before = tree_hash(tmp_path)
    capfd.readouterr()
    assert train.main(["--resume=auto", *SAVING, "train.steps=4", "run.dir=runs/x", "checkpoint.dir=ck"]) == 2
    err = capfd.readouterr().err.splitlines()
    assert err == [f"nljax.train: error: --resume=auto: runs/x holds a run whose checkpoints are in "
                   f"{tmp_path / 'runs/x/checkpoints'} (up to step 2), not in checkpoint.dir {tmp_path / 'ck'}: give "
                   f"checkpoint.dir={tmp_path / 'runs/x/checkpoints'} to resume it, or choose another run.dir"], err
    assert tree_hash(tmp_path) == before


def test_a_live_run_is_refused_before_anything_is_decided(tmp_path, monkeypatch, capfd):
    """A run live in run.dir (its lock held: here by pytest's parent process) that logged steps and
    saved nothing: --resume=auto refuses in the lock's one line, saying nothing of starting over,
    and changes nothing."""
    import os
    import socket

    from helpers import tree_hash

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    (run / "nljax.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "now"}))
    before = tree_hash(tmp_path)
    args = [a for a in ARGS if a != "--quiet"]
    assert train.main(["--resume=auto", *args, f"run.dir={run}"]) == 2
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"nljax.train: error: run.dir {run} is in use by a live run (host "), err
    assert tree_hash(tmp_path) == before


def test_process_0_decides_for_every_process(tmp_path, monkeypatch):
    """A process other than 0 does not read run.dir: it takes what process 0 saw (here: a
    checkpoint, then nothing, where this process would see a run without one)."""
    import jax

    from nljax import config

    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    seen, main = [], {}
    monkeypatch.setattr(distributed, "main_decides", lambda flag: seen.append(flag) or main.get("says", flag))
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    main["says"] = True  # process 0 saw a checkpoint
    assert autoresume.decide(cfg) == autoresume.RESUME and seen == [False]  # this process read nothing
    main["says"] = False  # process 0 saw nothing
    assert autoresume.decide(cfg) == autoresume.NEW and seen == [False] * 3
    seen.clear(), main.clear()
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert autoresume.decide(cfg) == autoresume.OVER and seen == [False, True]


# Process 1 of a launch sees no checkpoint (a file system that shows it late): it must follow process 0.
BLIND = """
import os, sys
if os.environ["NLJAX_PROCESS_ID"] == "1":
    from nljax.checkpoint import storage
    storage.committed_steps = lambda root: []
sys.argv = ["nljax.train", *sys.argv[1:]]
from nljax.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_every_process_of_a_launch_takes_process_0s_decision(tmp_path):
    """2 processes x 2 devices: --resume=auto starts the run, then continues it on both
    processes although process 1 sees no checkpoint (left to itself, it would start a new run and
    the processes would disagree on the config)."""
    run = tmp_path / "run"
    common = ["--resume=auto", *SAVING, f"run.dir={run}"]
    for n in (2, 4):
        p = subprocess.run([sys.executable, "-m", "nljax.launch", "--nproc", "2", "--cpu-devices", "2", "--",
                            sys.executable, "-c", BLIND, *common, f"train.steps={n}"],
                           env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    assert steps(run) == list(range(4))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def test_the_step_told_to_the_preemption_service_is_the_resumed_one(tmp_path, monkeypatch):
    """In a multi-process launch JAX's preemption service is told, once the processes joined,
    the step the run resumes from: --resume=auto decides before that."""
    d = tmp_path / "run"
    assert train.main([*SAVING, "train.steps=2", f"run.dir={d}"]) == 0
    calls = []
    monkeypatch.setattr(distributed, "initialize", lambda launch, timeout_s: True)  # one of "several"
    monkeypatch.setattr(cli, "check_in", lambda first_step: calls.append(("check_in", first_step())))
    monkeypatch.setattr(distributed, "check_config", stop_here)
    assert train.main(["--resume=auto", *ARGS, "train.steps=4", f"run.dir={d}"]) == 2
    assert calls == [("check_in", 2)]


@pytest.mark.parametrize("argv, line", [
    # what to do instead is said: a first start, or --resume=auto
    (["--resume", "run.dir=runs/x"], "nljax.train: error: checkpoint not found: {root}/runs/x/checkpoints (--resume "
                                     "continues a run that saved checkpoints there; to start this run, leave --resume "
                                     "out, or give --resume=auto, which starts it or continues it)"),
    (["--resume", "--resume=auto"],
     "nljax.train: error: argument --resume=auto: not allowed with argument --resume (--help lists the options)"),
    (["--resume=auto", "checkpoint.resume=latest"],
     "nljax.train: error: --resume=auto decides what the run resumes from: leave checkpoint.resume=latest out, "
     "or give it without --resume=auto"),
])
def test_plain_resume_is_unchanged_and_misuse_is_one_line(tmp_path, monkeypatch, capfd, argv, line):
    """Plain --resume still refuses a run.dir with nothing to resume; nothing is written."""
    monkeypatch.chdir(tmp_path)
    assert train.main([*ARGS, *argv]) == 2
    assert capfd.readouterr().err.splitlines() == [line.format(root=tmp_path)]
    assert list(tmp_path.iterdir()) == []

