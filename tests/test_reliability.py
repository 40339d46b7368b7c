"""Adversarial inputs, one test per class of failure (issue 41): bad input gives one clear line
and a non-zero exit, and nothing already on disk is lost."""

from __future__ import annotations

import threading

import pytest

from nljax.checkpoint import quiet


def test_settle_after_a_failed_save_does_not_reraise_the_writer_threads_error():
    """The failed-save race: Orbax's writer thread still running when `settle` joins it, then
    ending with the write error. Its `join` re-raises that error, which reached the user as a
    traceback under load; `settle` waits for the thread without re-raising."""
    from orbax.checkpoint._src.futures.future import _SignalingThread

    go = threading.Event()

    def write():
        go.wait(10)
        raise ValueError("OUT_OF_RANGE: Error writing local file _sharding")

    thread = _SignalingThread(target=write, send_signals=[], receive_signals=[], timeout_secs=30)
    thread.start()
    release = threading.Timer(0.5, go.set)  # after `settle` found the thread alive
    release.start()
    with quiet.errors_hidden() as noise:
        noise.settle(quiet_s=0.05, limit_s=10.0)
    release.join()
    assert not thread.is_alive()


# ---------------------------------------------------------------------------------------------
# Data lost or overwritten: one owner per directory; a run replaces only names it wrote


def test_one_live_run_per_checkpoint_dir_too(tmp_path):
    """Two runs with other run.dirs but one checkpoint.dir: the second is refused (the lock
    guarded run.dir only, and the first run's checkpoints were replaced)."""
    from nljax import config
    from nljax.runtime.rundir import check_free, take_lock

    ck = tmp_path / "shared_ck"
    first = config.load(None, [f"run.dir={tmp_path / 'a'}", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    second = config.load(None, [f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    lock = take_lock(first)
    try:
        with pytest.raises(config.ConfigError, match=f"checkpoint.dir {ck} is in use by a live run"):
            check_free(second)
        with pytest.raises(config.ConfigError, match=f"checkpoint.dir {ck} is in use by a live run"):
            take_lock(second)
        assert not (tmp_path / "b" / "nljax.lock").exists()  # the run.dir lock taken first went back
    finally:
        lock.release()
    take_lock(second).release()  # free again
    assert not (ck / "nljax.lock").exists()


@pytest.mark.parametrize("name", ["config.yaml", "summary.json", "loss.png", "wandb", "metrics.jsonl"])
def test_a_fresh_run_refuses_a_users_file_under_a_run_files_name(tmp_path, name):
    """A user's config.yaml (the one given as --config), summary.json, loss.png, wandb/ or an empty
    metrics.jsonl in a fresh run.dir: refused in one line, never replaced or removed."""
    from nljax import config
    from nljax.runtime.rundir import RunDir

    p = tmp_path / name
    p.mkdir() if name == "wandb" else p.write_text("")
    with pytest.raises(config.ConfigError, match=f"holds {name}, which no nljax run wrote there"):
        RunDir(str(tmp_path), overwrite=True, write=True)
    assert p.exists()


def test_overwrite_removes_only_names_a_run_writes(tmp_path):
    """nljax_written.txt edited to list a user's files: run.overwrite keeps them (it deleted
    whatever the listing named); the run's own samples go."""
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    RunDir(str(tmp_path), overwrite=False, write=True)  # a run's files: claimed as it starts
    for name in ("data.txt", "notes.md", "samples_000002.png"):
        (tmp_path / name).write_text("x")
        runlog.note_written(tmp_path, name)
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert (tmp_path / "data.txt").exists() and (tmp_path / "notes.md").exists()
    assert not (tmp_path / "samples_000002.png").exists()


@pytest.mark.parametrize("where", ["checkpoints", "run.dir"])
def test_a_users_file_named_as_a_step_is_refused_before_training(tmp_path, where):
    """A user's checkpoints/4 (or run.dir/2 when checkpoint.dir is run.dir), a step the run would
    save: refused in one line before the first step, the file untouched (it was replaced, or the
    run stopped at that step)."""
    from helpers import QUICK, SMALL, cli

    run = tmp_path / "run"
    ck = run / "checkpoints" if where == "checkpoints" else run
    ck.mkdir(parents=True)
    (ck / "4").write_text("mine")
    extra = [] if where == "checkpoints" else [f"checkpoint.dir={run}"]
    p = cli("nljax.train", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={run}", "train.steps=8",
            "checkpoint.every=2", *extra, check=False, timeout=300)
    # the last line (a shared compilation cache may add JAX's warnings before it), no traceback
    assert p.returncode != 0 and "Traceback" not in p.stderr and p.stderr.strip().splitlines()[-1] == (
        f"nljax.train: error: checkpoint.dir {ck} holds 4, which nljax did not write: a checkpoint of that step "
        "would replace it; move it or choose another checkpoint.dir"), p.stderr
    assert (ck / "4").read_text() == "mine" and not (run / "metrics.jsonl").exists()
