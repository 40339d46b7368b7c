"""Adversarial inputs, one test per class of failure (issue 41): bad input gives one clear line
and a non-zero exit, and nothing already on disk is lost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from types import SimpleNamespace

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
    whatever the listing named); the run's own samples go, and the hidden partial files a kill
    left of the run's own outputs (a user's hidden files of that form stay)."""
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    RunDir(str(tmp_path), overwrite=False, write=True)  # a run's files: claimed as it starts
    for name in ("data.txt", "notes.md", "samples_000002.png"):
        (tmp_path / name).write_text("x")
        runlog.note_written(tmp_path, name)
    partial = [".samples_000004.png.tmp-123", ".summary.json.tmp-9"]
    kept = [".data.txt.tmp-5", ".samples_000004.png.tmp-x", ".notes.tmp-1"]
    for name in partial + kept:
        (tmp_path / name).write_text("x")
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert (tmp_path / "data.txt").exists() and (tmp_path / "notes.md").exists()
    assert not (tmp_path / "samples_000002.png").exists()
    assert [n for n in partial + kept if (tmp_path / n).exists()] == kept


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


def test_a_run_dir_holding_a_live_runs_checkpoint_dir_is_refused(tmp_path):
    """A live run's checkpoint.dir that is another run.dir's default checkpoints folder: a run in
    that run.dir is refused, naming the live holder, before and after it takes its own lock (it
    ran, writing into the live run's checkpoints, and the live run died)."""
    from nljax import config
    from nljax.runtime.rundir import check_free, take_lock

    ck = tmp_path / "cc2" / "checkpoints"
    live = config.load(None, [f"run.dir={tmp_path / 'cc3'}", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    second = config.load(None, [f"run.dir={tmp_path / 'cc2'}", "checkpoint.every=2"])
    lock = take_lock(live)
    try:
        said = f"checkpoint.dir {ck} is in use by a live run \\(host .*, pid {os.getpid()}"
        with pytest.raises(config.ConfigError, match=said):
            check_free(second)
        with pytest.raises(config.ConfigError, match=said):  # the live run took its lock after the check
            take_lock(second)
        assert not (tmp_path / "cc2" / "nljax.lock").exists()  # the lock taken went back
    finally:
        lock.release()
    take_lock(second).release()  # free again


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_dangling_symlink_under_a_run_files_name_is_refused(tmp_path, name):
    """A dangling symbolic link in a fresh run.dir under a name a run writes: refused like any name
    no run listed (it was replaced by a file: `exists()` is false for it)."""
    from nljax import config
    from nljax.runtime.rundir import RunDir

    (tmp_path / name).symlink_to(tmp_path / "nonexistent")
    with pytest.raises(config.ConfigError, match=f"holds {name}, which no nljax run wrote there"):
        RunDir(str(tmp_path), overwrite=False, write=True)
    assert (tmp_path / name).is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_refused_fresh_run_creates_nothing(tmp_path):
    """A fresh run refused for a name in its way (config.yaml as a folder): run.dir is left as it
    was found (the refusal came after checkpoints/ was made)."""
    from helpers import QUICK, SMALL, cli

    run = tmp_path / "run"
    (run / "config.yaml").mkdir(parents=True)
    p = cli("nljax.train", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={run}", "train.steps=4",
            "checkpoint.every=2", check=False, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr and p.stderr.strip().splitlines()[-1] == (
        f"nljax.train: error: run.dir {run}: config.yaml is a directory, where the run writes a file of that name; "
        "move it"), p.stderr
    assert sorted(q.name for q in run.iterdir()) == ["config.yaml"]


def test_every_process_of_a_launch_stops_when_process_0_refuses_the_run_dir(tmp_path):
    """2 processes: process 0 alone looks at run.dir (metrics.jsonl is a folder there); it used
    to refuse before the broadcast the others were in, which then read its flag as "logged a
    step" and waited in a second one. Now each process stops at once, process 0 with its line."""
    import subprocess
    import sys

    from helpers import QUICK, SMALL, subprocess_env

    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "nljax.launch", "--nproc", "2", "--cpu-devices", "1", "--",
                        sys.executable, "-m", "nljax.train", *SMALL, *QUICK, f"run.dir={run}", "train.steps=2",
                        "run.compile_cache=none"], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = sorted(l for l in p.stderr.splitlines() if " error " in l and not l.startswith("nljax.launch: "))
    assert errors == [
        f"[0] nljax.train: error (process 0): run.dir {run}: metrics.jsonl is a directory, where the run writes a "
        "file of that name; move it",
        "[1] nljax.train: error (process 1): process 0 could not write the run's files (its line says why)"], p.stderr
    assert sorted(q.name for q in run.iterdir()) == ["metrics.jsonl"]


def test_a_run_lists_only_names_it_created_and_overwrite_removes_only_those(tmp_path):
    """A run without W&B or a profile listed wandb and profile as its own, and run.overwrite then
    removed a user's wandb/ made since: a name is listed as it is created."""
    from nljax import config
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    cfg = config.load(None, [f"run.dir={tmp_path}", "run.trackers=[]"])
    run = RunDir(str(tmp_path), overwrite=False, write=True)
    run.save_config(cfg)
    run.log({"step": 0, "loss": 1.0})
    run.save_summary({"loss": 1.0})
    assert runlog.written(tmp_path) == {"metrics.jsonl", "config.yaml", "summary.json"}
    assert (tmp_path / runlog.WRITTEN).read_text().splitlines() == ["metrics.jsonl", "config.yaml", "summary.json"]
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "mine.txt").write_text("u")
    with pytest.raises(config.ConfigError, match="holds wandb, which no nljax run wrote there"):
        RunDir(str(tmp_path), overwrite=True, write=True)
    assert (tmp_path / "wandb" / "mine.txt").read_text() == "u"
    (tmp_path / "wandb" / "mine.txt").rename(tmp_path / "mine.txt")
    (tmp_path / "wandb").rmdir()
    RunDir(str(tmp_path), overwrite=True, write=True)  # the run's own files go, the user's stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "mine.txt", runlog.WRITTEN]


def test_a_name_of_a_run_file_that_is_not_a_regular_file_is_said_so(tmp_path):
    """metrics.jsonl as a folder was "already holds a run"; summary.json as a FIFO: each named as
    what it is, before anything is created."""
    from nljax import config
    from nljax.runtime.rundir import RunDir

    (tmp_path / "a" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(config.ConfigError, match="metrics.jsonl is a directory, where the run writes a file"):
        RunDir(str(tmp_path / "a"), overwrite=False, write=True)
    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / "summary.json")
    with pytest.raises(config.ConfigError, match="summary.json is not a regular file, where the run writes a file"):
        RunDir(str(tmp_path / "b"), overwrite=False, write=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["metrics.jsonl"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["summary.json"]


def test_an_old_lock_that_is_not_utf8_is_stale_and_a_young_one_one_line(tmp_path):
    """A lock file that is not UTF-8 was a UnicodeDecodeError traceback once older than the
    stale limit; it is a damaged lock like any other: refused in one line while young, taken
    over when old."""
    import time

    from nljax import config
    from nljax.runtime.runlock import STALE_S, RunLock

    lock = tmp_path / "nljax.lock"
    lock.write_bytes(b"\xff")
    with pytest.raises(config.ConfigError, match="has a lock file .* that cannot be read"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_S - 60
    os.utime(lock, (old, old))
    taken = RunLock(tmp_path).acquire()
    assert lock.read_text().startswith("{")
    taken.release()
    assert not lock.exists()


def test_a_changed_setting_names_the_step_of_the_checkpoint_restored():
    """"resuming with train.steps=6 (checkpoint: 4)" after a resume fell back to step 2 read as
    the step of the damaged checkpoint: the line names the step of the one restored."""
    from nljax import config
    from nljax.checkpoint.restore import _changed_settings

    saved = config.load(None, ["train.steps=4"])
    assert _changed_settings({"config": config.to_dict(saved), "step": 2}, config.load(None, ["train.steps=6"])) == [
        "resuming with train.steps=6 (the checkpoint at step 2 was written with 4): the cosine learning-rate "
        "schedule now decays to step 6"]
    # a constant schedule: more steps change nothing already decided, and nothing is said
    saved = config.load(None, ["train.steps=4", "optim.schedule=constant"])
    assert _changed_settings({"config": config.to_dict(saved), "step": 2},
                             config.load(None, ["train.steps=6", "optim.schedule=constant"])) == []


# ---------------------------------------------------------------------------------------------
# Silent wrong results: what was written is checked where it is read


def _prepared(tmp_path):
    from nljax.prepare import main as prepare_main

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(f"document {i} " * 20 + "\n")
    out = tmp_path / "prep"
    assert prepare_main([f"data.train=[{src}/*.txt]", "data.eval_fraction=0.34", f"out={out}"]) == 0
    return out


def test_prepared_data_changed_since_prepare_is_refused(tmp_path):
    """A token file or its document starts edited in place (same size), a manifest dtype edited,
    a token id outside the vocabulary (manifest made consistent by hand): one line each, never
    trained on (they trained on other bytes or boundaries, or gave NaN steps, every one skipped,
    exit 0)."""
    import hashlib
    import json
    import shutil

    from nljax import config
    from nljax.data import prepared

    good = _prepared(tmp_path)
    prepared.load(good)

    def changed(name, change):
        d = tmp_path / name
        shutil.copytree(good, d)
        change(d)
        with pytest.raises(config.ConfigError) as e:
            prepared.load(d)
        return str(e.value)

    def flip(d):
        raw = bytearray((d / "train.bin").read_bytes())
        raw[5] ^= 1
        (d / "train.bin").write_bytes(bytes(raw))

    assert "train.bin is not the file prepared" in changed("flipped", flip)

    def moved_start(d):  # still in order, as many: a boundary elsewhere, which no other check sees
        import numpy as np

        starts = np.load(d / "train.docs.npy")
        starts[1] += 1
        np.save(d / "train.docs.npy", starts)

    assert "train.docs.npy is not the file prepared" in changed("moved", moved_start)

    def dtype(d):
        m = json.loads((d / "manifest.json").read_text())
        m["dtype"] = "int8"  # uint8 tokens read as int8: the same size
        (d / "manifest.json").write_text(json.dumps(m))

    assert "manifest.json was changed since it was written" in changed("dtype", dtype)

    def out_of_vocab(d):  # the file and its manifest edited together: sha256 and digest made to match
        raw = bytearray((d / "train.bin").read_bytes())
        raw[0] = 0xFF
        (d / "train.bin").write_bytes(bytes(raw))
        m = json.loads((d / "manifest.json").read_text())
        m["vocab_size"] = 255  # the id at the vocabulary's size: the first outside it
        m["train"]["sha256"] = hashlib.sha256(raw).hexdigest()
        content = {k: m[k] for k in ("format", "tokenizer", "vocab_size", "dtype", "train", "eval")}
        m["digest"] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
        (d / "manifest.json").write_text(json.dumps(m))

    assert "holds token id 255, outside the vocabulary of 255" in changed("vocab", out_of_vocab)

    def wrong_type(d):
        m = json.loads((d / "manifest.json").read_text())
        m["train"] = "train.bin"
        (d / "manifest.json").write_text(json.dumps(m))

    assert "manifest.json lacks" in changed("type", wrong_type)

    # prepare overwrite=true whose second rename fails (of a token file into the new directory,
    # beside DIR): DIR is the previous data, whole (it used to be a mix that no reader took)
    import unittest.mock

    from nljax.prepare import main as prepare_main

    mixed = tmp_path / "mixed"
    shutil.copytree(good, mixed)
    (tmp_path / "src" / "doc0.txt").write_text("other text altogether " * 30 + "\n")
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    with unittest.mock.patch.object(prepared.os, "replace", second_fails):
        assert prepare_main([f"data.train=[{tmp_path / 'src'}/*.txt]", "data.eval_fraction=0.34", f"out={mixed}",
                             "overwrite=true"]) != 0
    assert prepared.load(mixed).digest == prepared.load(good).digest


def test_an_export_changed_since_it_was_written_is_refused(tmp_path):
    """load_model checks the sha256 that config.json records: a flipped weight byte (logits off
    by 1e36 before) or a safetensors header whose dtype was edited is one line."""
    import json

    from helpers import TINY, saved_run

    from nljax import config, export
    from nljax.run import trained

    import jax

    saved_run(tmp_path / "run", TINY, 1, 1)
    out = export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), tmp_path / "export")
    assert json.loads((out / export.CONFIG).read_text())["sha256"].keys() == {export.WEIGHTS}
    export.load_model(out)
    weights = out / export.WEIGHTS
    raw = weights.read_bytes()
    flipped = bytearray(raw)
    flipped[-1] ^= 0x40
    weights.write_bytes(bytes(flipped))
    with pytest.raises(config.ConfigError, match="model.safetensors is not the file that was written"):
        export.load_model(out)
    weights.write_bytes(raw.replace(b'"F32"', b'"I32"', 1))
    with pytest.raises(config.ConfigError, match="model.safetensors is not the file that was written"):
        export.load_model(out)
    weights.write_bytes(raw)
    info = json.loads((out / export.CONFIG).read_text())
    info["config"]["model"]["hidden_mult"] = 3  # a setting edited: the same shapes, other logits
    (out / export.CONFIG).write_text(json.dumps(info))
    with pytest.raises(config.ConfigError, match="config.json was changed since it was written"):
        export.load_model(out)

    # a re-export whose last rename fails: the new weights beside the previous config.json
    export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), out)  # whole again
    export.load_model(out)
    real = os.replace

    def last_rename_fails(src, dst):
        if str(dst).endswith(export.CONFIG):
            raise OSError(28, "No space left on device")
        real(src, dst)

    import unittest.mock

    with unittest.mock.patch.object(export.os, "replace", last_rename_fails), pytest.raises(OSError):
        export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), out, "bfloat16")
    with pytest.raises(config.ConfigError, match="model.safetensors is not the file that was written"):
        export.load_model(out)


@pytest.mark.parametrize("text", ["train:\n  steps: 5\n  steps: 7\n", "train:\n  steps: 5\noptim:\n  lr: 0.1\ntrain:\n  seed: 1\n"])
def test_a_key_or_section_given_twice_is_one_line(tmp_path, text):
    """YAML keeps the last of a key given twice silently: refused, naming the key and line."""
    from nljax import config

    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(config.ConfigError, match="is given twice in one mapping"):
        config.load(str(tmp_path / "c.yaml"))


# ---------------------------------------------------------------------------------------------
# Inexact resume: the same data under another spelling of its paths


def test_the_same_data_spelled_otherwise_or_from_another_directory_resumes_exactly(tmp_path, monkeypatch):
    """A run on data.train given relative, resumed with the path absolute from another working
    directory: the content digest is the checkpoint's, so no row restarts (every row's memory
    restarted: 'data changed')."""
    from helpers import TINY_NL, make, train

    from nljax.checkpoint import storage
    from nljax.checkpoint.restore import restore
    from nljax.run.startup import data_fingerprint

    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text(f"the same text {i}, read twice over " * 40)
    files = ["data.source=files", "data.eval_fraction=0.5", f"checkpoint.dir={tmp_path / 'ck'}"]
    monkeypatch.chdir(tmp_path)
    setup = make([*TINY_NL, *files, "data.train=[text/*.txt]"], 1, 2)
    _, state = train(setup, 1)
    m = storage.writer(setup.cfg)
    storage.save(m, setup.engine, 1, state, data_digest=data_fingerprint(setup.run.task))
    m.wait_until_finished()
    m.close()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = make([*TINY_NL, *files, f"data.train=[{tmp_path / 'text'}/*.txt]"], 1, 2)
    digest = data_fingerprint(again.run.task)
    assert restore(again.engine, again.state, tmp_path / "ck" / "1").fresh_rows  # paths alone: "data changed"
    r = restore(again.engine, again.state, tmp_path / "ck" / "1", digest)
    assert not r.fresh_rows and r.warnings == [], r.warnings
    # the same paths and settings over edited files: every row's offset moved, so every row restarts
    (tmp_path / "text" / "0.txt").write_text("other text, appended since " * 60)
    monkeypatch.chdir(tmp_path)
    edited = make([*TINY_NL, *files, "data.train=[text/*.txt]"], 1, 2)  # as the checkpoint's run wrote it
    r = restore(edited.engine, edited.state, tmp_path / "ck" / "1", data_fingerprint(edited.run.task))
    assert r.fresh_rows and any(w.startswith("the data's content changed") and "every row's memory restarts" in w
                                for w in r.warnings), r.warnings


# ---------------------------------------------------------------------------------------------
# Hangs: inputs bounded before work starts, waits that say what they wait for


ALIASES = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 10)}]\n" for p, k in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("setting, said", [
    ("throughput.reps=1000000000", "throughput.reps must be <= 1,000"),
    ("train.sample_tokens=1000000000", "train.sample_tokens must be <= 65,536"),
    ("cms.periods=[" + ",".join(["1"] * 2000) + "]", "cms.periods has 2,000 levels, more than the 64"),
    ("meanflow.sample_steps=1000000000", "meanflow.sample_steps must be in [1, 1000]"),
    ("data.train=" + "[" * 5000 + "]" * 5000, "nested deeper than 32 levels"),
    ("images.toy_points=2000000000", "images.toy_points must be <= 10,000,000"),
    ('run.dir="a\\0b"', "a value holds a NUL character"),
])
def test_an_absurd_count_is_one_line_before_any_work(setting, said):
    """Each took minutes or hours (or never ended) with nothing printed; now refused as the config
    is read, within a second."""
    import time

    from nljax import config

    extra = ["model.name=dit", "images.source=moons", "cms.periods=[1]"] if setting.startswith(("meanflow", "images")) else []
    t0 = time.monotonic()
    with pytest.raises(config.ConfigError, match=re.escape(said)):
        config.load(None, [*extra, setting])
    assert time.monotonic() - t0 < 30


def test_yaml_aliases_expanding_past_the_limit_are_one_short_line(tmp_path):
    """A few hundred bytes of aliases standing for 10^9 values (in run.dir, or a list key: the
    'one line' error was 312 MB)."""
    from nljax import config

    (tmp_path / "c.yaml").write_text(ALIASES + "run:\n  dir: *i\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(str(tmp_path / "c.yaml"))
    assert "expands to more than 100,000 values" in str(e.value) and len(str(e.value)) < 300


def test_cpu_devices_and_a_fifo_as_data_are_refused(tmp_path):
    from nljax import cli, config
    from nljax.data import documents

    with pytest.raises(config.ConfigError, match=r"--cpu-devices must be in \[1, 1024\]"):
        cli.setup_devices(10**9)
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(config.ConfigError, match="is not a regular file"):
        documents.expand([str(tmp_path / "pipe.txt")], "data.train")


def test_a_process_waiting_for_its_peers_says_what_for(monkeypatch, capsys):
    """A worker whose coordinator nobody serves was silent for its whole join timeout; a process
    at a lockstep check or a checkpoint barrier whose peer stalls was silent until the timeout."""
    import time

    import jax

    from nljax.checkpoint import peers
    from nljax.runtime import distributed, waiting

    monkeypatch.setattr(waiting, "FIRST_S", 0.2)
    monkeypatch.setattr(waiting, "EVERY_S", 0.2)
    # the join: JAX's initialize blocks (stood in for by a sleep) while the line is said
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: time.sleep(1.5))
    monkeypatch.setattr(distributed, "_check_resolves", lambda coordinator, said: None)
    assert distributed.initialize(distributed.Launch("10.0.0.1:1234", 2, 1), 60)
    err = capsys.readouterr().err.splitlines()
    assert len(err) >= 2 and err[0] == ("nljax: process 1 has waited 0 s for the run's 2 processes to join at "
                                        "coordinator 10.0.0.1:1234; still waiting"), err
    # a checkpoint barrier: its wait is said with the barrier's name, and the saying stops with it
    barrier = peers.Peers.__new__(peers.Peers)
    monkeypatch.setattr(barrier, "_await", lambda key, here, timeout_ms: time.sleep(1.5), raising=False)
    barrier.lock, barrier.calls, barrier.root = threading.Lock(), {}, "x"
    monkeypatch.setattr(barrier, "_client", lambda: type("C", (), {"key_value_increment": lambda self, k, n: 1})(),
                        raising=False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(barrier, "_decide", lambda *a: "done", raising=False)
    barrier.barrier(key="commit", timeout_ms=1000)
    time.sleep(0.3)
    err = capsys.readouterr().err.splitlines()
    said = r"nljax: process 0 has waited \d+ s for the other 1 process\(es\) at checkpoint barrier commit; still waiting"
    assert err and all(re.fullmatch(said, line) for line in err), err


# ---------------------------------------------------------------------------------------------
# Tracebacks: user-controlled bytes and environment, each one line


def test_user_bytes_and_files_in_the_way_are_one_line(tmp_path):
    """A non-UTF-8 sample prompt or generate prompt (argv bytes arrive as lone surrogates), a
    run.dir name over 255 bytes, summary.json existing as a directory, a lock file missing a
    field, zero-size images, a label past the class limit: ConfigError each (tracebacks before)."""
    import json
    import socket

    import numpy as np

    from nljax import config
    from nljax.data import images
    from nljax.run.sampling import Settings
    from nljax.runtime import runlock
    from nljax.runtime.rundir import RunDir, check_free

    with pytest.raises(config.ConfigError, match="train.sample_prompt is not UTF-8 text"):
        config.load(None, ["train.sample_prompt=caf\udce9"])
    with pytest.raises(config.ConfigError, match="prompt= is not UTF-8 text"):
        Settings(prompt="caf\udce9").check()
    with pytest.raises(config.ConfigError, match="cannot be used: File name too long"):
        check_free(config.load(None, [f"run.dir={tmp_path / ('x' * 300)}"]))
    (tmp_path / "summary.json").mkdir()
    with pytest.raises(config.ConfigError, match="summary.json is a directory"):
        RunDir(str(tmp_path), overwrite=False, write=True, resume_step=4)
    lock = tmp_path / "locked" / runlock.NAME
    lock.parent.mkdir()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))  # no "started"
    with pytest.raises(config.ConfigError, match="is in use by a live run"):
        runlock.refuse_if_live(lock.parent)
    np.save(tmp_path / "empty.npy", np.zeros((10, 0, 4), np.uint8))
    with pytest.raises(config.ConfigError, match="of at least one pixel"):
        images._file(str(tmp_path / "empty.npy"))
    np.savez(tmp_path / "labels.npz", x=np.zeros((10, 4, 4), np.uint8), y=np.full(10, 2**31 - 2))
    with pytest.raises(config.ConfigError, match="labels must be < 1,048,576"):
        images.load(config.load(None, ["images.source=file", f"images.path={tmp_path / 'labels.npz'}"]).images)


def test_a_metrics_line_that_is_not_utf8_is_a_warning_on_resume(tmp_path, capsys):
    from nljax.runtime.rundir import kept_records

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0, "loss": 1.0}\n\xff\xfe{"step": 1}\n{"step": 2, "loss": 3.0}\n')
    assert [r["step"] for r in kept_records(tmp_path / "metrics.jsonl", 5)] == [0, 2]
    assert "line 2 not a record" in capsys.readouterr().err


def test_a_newest_checkpoint_that_cannot_be_looked_into_is_nljaxs_and_damaged(tmp_path, monkeypatch):
    """Permissions on checkpoints/4 (stat of what it holds raises EACCES): a traceback before;
    now taken for nljax's, so a resume finds it damaged and falls back to an older one."""
    from pathlib import Path

    from nljax.checkpoint import storage

    (tmp_path / "4" / "nljax").mkdir(parents=True)
    real = Path.is_file

    def denied(self):
        if "4" in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", denied)
    monkeypatch.setattr(Path, "exists", denied)
    assert storage.is_nljax_step(tmp_path / "4")
    assert storage.leftovers(tmp_path) == [tmp_path / "4"]


def test_a_backend_that_cannot_start_is_one_line():
    """JAX_PLATFORMS=cuda on a machine without a GPU: an AssertionError deep in JAX before."""
    from helpers import cli

    p = cli("nljax.train", "train.steps=1", "run.dir=unused", check=False, env={"JAX_PLATFORMS": "cuda"}, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "nljax.train: error: JAX could not start a backend for JAX_PLATFORMS=cuda"), p.stderr


def test_a_device_plugin_that_cannot_start_is_one_line(tmp_path):
    """JAX's CUDA plugin on a machine without a GPU, JAX_PLATFORMS unset: JAX logged why it could
    not start as a traceback of some 25 lines before every command's output, then went on with
    the CPU. A plugin whose initialize() fails alike stands in for it (JAX_PLATFORMS='': JAX's
    default, every plugin started; a real CUDA plugin may add its own line)."""
    from helpers import ROOT, cli

    plugin = tmp_path / "jax_plugins" / "broken"  # jax_plugins: the namespace JAX's plugins live in
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("def initialize():\n    raise RuntimeError('Unable to load cuPTI. Is it "
                                        "installed?')\n")
    p = cli("nljax.train", "mesh.inter=3", f"run.dir={tmp_path / 'r'}", check=False, timeout=300,
            env={"JAX_PLATFORMS": "", "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert ("nljax: warning: JAX's device plugin jax_plugins.broken did not start (RuntimeError: Unable to load "
            "cuPTI. Is it installed?): JAX goes on without its devices (python -c 'import jax; jax.devices()' "
            "shows JAX's traceback)") in lines, p.stderr
    assert all(line.startswith("nljax: warning: JAX's device plugin ") for line in lines[:-1]), p.stderr
    assert lines[-1].startswith("nljax.train: error: mesh.inter=3 does not divide the 1 available devices"), p.stderr


# ---------------------------------------------------------------------------------------------
# Misleading lines


def test_a_dangling_symlink_as_run_dir_is_named_as_such(tmp_path):
    """mkdir said only 'File exists'."""
    from nljax import config
    from nljax.runtime.runlock import make_run_dir

    (tmp_path / "run").symlink_to(tmp_path / "gone")
    with pytest.raises(config.ConfigError, match=f"run.dir {tmp_path / 'run'} is a symbolic link to "
                                                 f"{tmp_path / 'gone'}, which does not exist"):
        make_run_dir(tmp_path / "run")


def test_a_path_the_file_system_cannot_take_is_one_line(tmp_path, monkeypatch, capsys):
    """run.dir or prepare's out= a loop of symbolic links (a -> b -> a): Path.resolve's
    RuntimeError ('Symlink loop from ...', Python 3.11 and 3.12) was a traceback; so was a
    --config or bench --out whose name is over 255 bytes (OSError ENAMETOOLONG from a stat)."""
    from nljax import bench
    from nljax import prepare, train

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "t.txt").write_text("text " * 100)
    monkeypatch.chdir(tmp_path)
    for tool, main, args in (("nljax.train", train.main, ["--resume", f"run.dir={tmp_path / 'a'}"]),
                             ("nljax.prepare", prepare.main, [f"data.train={tmp_path / 't.txt'}", f"out={tmp_path / 'a'}"])):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"{tool}: error: {tmp_path / 'a'} is a loop of symbolic links", err
    long = tmp_path / ("x" * 300)
    for tool, main, args, name in (("nljax.train", train.main, ["--config", f"{long}.yaml"], f"{long}.yaml"),
                                   ("nljax.bench", bench.main, ["--out", f"{long}.json"], f"{long}.json")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"{tool}: error: {name} is longer than the file system takes (255 bytes a name, 4,096 a path)"


def test_an_export_onto_a_full_disk_is_an_oserror(tmp_path):
    """safetensors reports a failed write as its own error type ('I/O error: ... (os error 28)'):
    a traceback before; now the OSError that the export command reports in one line."""
    from nljax import export

    def full(tensors, path):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        export._save_weights(full, {}, tmp_path / "w")
    assert e.value.errno == 28 and e.value.filename == str(tmp_path / "w")


@pytest.mark.parametrize("command", ["train", "bench", "comm", "evaluate", "export"])
def test_a_jax_environment_variable_jax_cannot_read_is_one_line(command):
    """bench, comm, evaluate and export imported JAX before nljax.cli caught this: a traceback
    (found by a newcomer). Bad input: exit 2 and the command's name, as every other refusal (it
    was `nljax: error:`, exit 1)."""
    from helpers import cli

    p = cli(f"nljax.{command}", check=False, env={"JAX_NUM_CPU_DEVICES": "two"}, timeout=300)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"nljax.{command}: error: JAX's environment variables: Invalid value \"two\" for JAX flag "
        "jax_num_cpu_devices"), p.stderr


def test_a_jax_environment_variable_jax_cannot_read_is_the_importers_to_handle():
    """Imported by a program of the user's (nljax.load imports nljax.export), nljax leaves JAX's
    ValueError to it rather than exit the program."""
    from helpers import run_python

    p = run_python("-c", "import nljax.export", check=False, env={"JAX_NUM_CPU_DEVICES": "two"}, timeout=300)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("ValueError: Invalid value"), p.stderr


def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """--resume on a read-only run.dir: the lock is its first write (EACCES as a user; the suite
    may run as root, so the refusal is simulated)."""
    from nljax import config
    from nljax.runtime import runlock

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(runlock.os, "open", read_only)
    with pytest.raises(config.ConfigError, match=f"run.dir {tmp_path} cannot be written .its lock .*Permission denied"):
        runlock.RunLock(tmp_path).acquire()


def test_a_checkpoint_dir_inside_a_live_runs_directory_is_refused(tmp_path):
    """Run b with checkpoint.dir=a/checkpoints while run a (run.dir=a) is live: a's lock covers
    its own checkpoints folder only through run.dir, so b checks the directories above its own."""
    from nljax import config
    from nljax.runtime.rundir import check_free, take_lock

    a = config.load(None, [f"run.dir={tmp_path / 'a'}"])
    b = config.load(None, [f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}"])
    lock = take_lock(a)
    try:
        with pytest.raises(config.ConfigError, match=f"checkpoint.dir {tmp_path / 'a' / 'checkpoints'} is inside "
                                                     f"{tmp_path / 'a'}: run.dir {tmp_path / 'a'} is in use"):
            check_free(b)
    finally:
        lock.release()
    check_free(b)


@pytest.mark.parametrize("args, said", [
    (["--nproc", "100000"], "--nproc must be at most 256, got 100000"),
    (["--nproc", "2", "--cpu-devices", "1000000"], "--cpu-devices must be at most 1024, got 1000000"),
    (["--nproc", "1", "--grace", "1e9"], "--grace must be at most 3600 s, got 1000000000.0"),
])
def test_the_launcher_bounds_its_counts(args, said, capsys):
    """--nproc 100000 started that many processes."""
    from nljax import launch

    assert launch.main([*args, "--", "true"]) == 2
    assert capsys.readouterr().err.strip() == f"nljax.launch: error: {said}"


def test_a_failed_writes_task_collected_after_the_scope_reports_nothing(caplog):
    """The async save's race: a task of the failed write garbage-collected after the scope ended
    (its event loop's last reference went later) logged 'Task exception was never retrieved' with
    a traceback after the one-line error. After a failure, those reports stay dropped."""
    import logging

    aio = logging.getLogger("asyncio")
    error = ValueError("OUT_OF_RANGE: Error writing \"x/0\" in OCDBT database: File too large [os_error_code='27']")
    with quiet.errors_hidden() as noise:
        noise.fail()
    aio.error("Task exception was never retrieved\nfuture: <Task finished>", exc_info=(ValueError, error, None))
    aio.error("Task exception was never retrieved", exc_info=(KeyError, KeyError("someone else's"), None))
    said = [str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio"]
    assert said == ['"someone else\'s"'], said


def test_a_failed_writes_coroutine_collected_at_exit_reports_nothing(monkeypatch):
    """The same race at the interpreter's exit: 'sys:1: RuntimeWarning: coroutine
    'async_serialize_from_host.<locals>.write_fragment' was never awaited' after the one line.
    Someone else's unawaited coroutine is still shown."""
    import sys
    import warnings

    import orbax.checkpoint._src.serialization.serialization  # noqa: F401 - where write_fragment is

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # put back after the test
    with quiet.errors_hidden() as noise:
        noise.fail()
    for name in ("async_serialize_from_host.<locals>.write_fragment", "mine"):
        warnings.showwarning(f"coroutine '{name}' was never awaited", RuntimeWarning, "sys", 1)
    assert shown == ["coroutine 'mine' was never awaited"]


# ---------------------------------------------------------------------------------------------
# The fresh-eyes round's finds (each failed before its fix)


def test_a_float_setting_past_float32_is_one_line():
    """optim.lr=1e300 is finite in Python and inf on the device: the run trained NaN, exit 0."""
    from nljax import config

    with pytest.raises(config.ConfigError, match="'optim.lr' must be a finite number within float32's range"):
        config.load(None, ["optim.lr=1e300"])
    assert config.load(None, ["optim.lr=1e30"]).optim.lr == 1e30


def test_generate_bounds_its_token_count():
    """max_new_tokens=99999999999 streamed until killed."""
    from nljax import config
    from nljax.run.sampling import MAX_NEW_TOKENS, Settings

    with pytest.raises(config.ConfigError, match="max_new_tokens must be <= 65,536"):
        Settings(max_new_tokens=99999999999).check()
    assert Settings(max_new_tokens=MAX_NEW_TOKENS).check().max_new_tokens == MAX_NEW_TOKENS


def test_export_refuses_a_folder_holding_other_files(tmp_path):
    """out= a user's folder (or the run directory itself) got model.safetensors beside its files."""
    from nljax import config
    from nljax.export import check_out

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("mine")
    with pytest.raises(config.ConfigError, match="holds notes.md, which an export does not write"):
        check_out(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.md").read_text() == "mine"
    check_out(tmp_path / "new")  # a new or empty directory is fine
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    # hidden files are a user's too: out=~ (a home directory of dotfiles) took model.safetensors
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("mine")
    with pytest.raises(config.ConfigError, match=r"holds \.bashrc, which an export does not write"):
        check_out(tmp_path / "home")
    # an earlier export with the temporaries of one killed part-way: replaced
    (tmp_path / "empty" / ".model.safetensors.tmp-1234").write_bytes(b"cut short")
    check_out(tmp_path / "empty")
    # an earlier export that a desktop or a notebook left a hidden file in: replaced all the same
    import json

    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "config.json").write_text(json.dumps({"config": {}, "step": 2, "dtype": "float32",
                                                               "checkpoint": "x"}))
    (tmp_path / "done" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "done" / ".DS_Store").write_bytes(b"desktop")
    check_out(tmp_path / "done")


def test_a_dangling_symlink_on_the_way_to_a_run_dir_is_named_before_anything_is_made(tmp_path):
    """The command made checkpoint.dir (inside run.dir) first, and said 'File exists'."""
    from nljax import config
    from nljax.runtime.rundir import check_free

    (tmp_path / "run").symlink_to(tmp_path / "gone")
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(config.ConfigError, match=f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"):
        check_free(cfg)
    assert not (tmp_path / "gone").exists()


def test_training_text_shorter_than_a_window_is_one_line(tmp_path):
    """Three bytes of training text were trained on as 128-token rows, exit 0."""
    from nljax import config
    from nljax.parallel.mesh import make_mesh
    from nljax.run.tasks import TextTask

    (tmp_path / "train.txt").write_text("hi\n")
    (tmp_path / "eval.txt").write_text("held-out text " * 200)
    cfg = config.load(None, ["data.source=files", f"data.train={tmp_path / 'train.txt'}",
                             f"data.eval={tmp_path / 'eval.txt'}"])
    with pytest.raises(config.ConfigError, match=r"the training text \(\d+ tokens\) is shorter than train.seq_len\+1"):
        TextTask(cfg, make_mesh(1, 1, devices=__import__("jax").devices()[:1]))


def test_an_abbreviated_flag_is_not_taken_for_another(capsys):
    """argparse's prefix matching took `--resum` for `--resume`."""
    from nljax import train

    assert train.main(["--resum", "--print-config"]) == 2
    assert "unrecognized arguments: --resum" in capsys.readouterr().err


def test_the_closing_commands_paste_into_a_shell_as_printed():
    """A run.dir with a space or a newline printed unquoted: the pasted command split there."""
    import shlex

    from nljax.run.phases import closing_lines

    for run_dir in ("runs/plain", "runs/with space", "runs/new\nline"):
        resume = closing_lines(run_dir, 10, True, f"{run_dir}/export")[1].split("resume:", 1)[1]
        assert shlex.split(resume)[3:5] == ["--resume", f"run.dir={run_dir}"]


def test_a_launched_runs_resume_goes_through_its_launcher():
    """A run of several processes started by nljax.launch resumes with as many: its resume line
    is the launcher's command (NLJAX_LAUNCHER, which it sets) before the train command; sampling
    and exporting are one process's. As printed (`python -m nljax.train --resume` alone resumed
    on one process, an elastic resume on another setup)."""
    import shlex

    from nljax.launch import child_env
    from nljax.run.phases import closing_lines
    from nljax.runtime.launchenv import ENV_LAUNCHER

    launcher = child_env({}, 1, 2, "127.0.0.1:1", 4, None)[ENV_LAUNCHER]
    assert launcher == "python -m nljax.launch --nproc 2 --cpu-devices 4"
    assert child_env({}, 0, 3, "c", None, 2)[ENV_LAUNCHER] == "python -m nljax.launch --nproc 3 --devices-per-proc 2"
    lines = closing_lines("runs/a b", 10, True, "runs/a b/export", launcher=launcher)
    assert shlex.split(lines[1].split("resume:", 1)[1]) == [*shlex.split(launcher), "--", "python", "-m", "nljax.train",
                                                            "--resume", "run.dir=runs/a b", "train.steps=20"]
    assert lines[2].split("sample:", 1)[1].split()[:3] == ["python", "-m", "nljax.generate"]


def test_the_closing_lines_say_where_checkpoints_elsewhere_are(tmp_path):
    """checkpoint.dir outside the run dir: the closing line said the checkpoints were in run.dir."""
    from nljax import config
    from nljax.run.trainer import closing

    run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), engine=SimpleNamespace(model=SimpleNamespace(logits=None)))
    own = closing(config.load(None, [f"run.dir={tmp_path}/r"]), run)[0]
    assert own == f"run directory: {tmp_path}/r (config.yaml, metrics.jsonl, summary.json, plots, checkpoints)"
    away = closing(config.load(None, [f"run.dir={tmp_path}/r", f"checkpoint.dir={tmp_path}/ck"]), run)[0]
    assert away == (f"run directory: {tmp_path}/r (config.yaml, metrics.jsonl, summary.json, plots; checkpoints in "
                    f"{tmp_path}/ck)")


def test_minor_misreadings_are_named(tmp_path):
    """An empty config file (the defaults ran with no word), a folder named config.yaml in a run
    directory ('not found'). (`--config` given twice, which silently replaced the first, now
    layers the second on the first: tests/test_config_layers.py.)"""
    from nljax import config
    from nljax.run import resuming, trained

    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(config.ConfigError, match="empty.yaml holds no settings"):
        config.load(str(tmp_path / "empty.yaml"))
    (tmp_path / "run" / "config.yaml").mkdir(parents=True)
    with pytest.raises(config.ConfigError, match="config.yaml is not a regular file"):
        trained.trained_config(tmp_path / "run")
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "checkpoint.resume=latest"])
    with pytest.raises(config.ConfigError, match="config.yaml is not a regular file"):
        resuming.saved_config_file(cfg)


def test_second_round_misreadings_are_one_line(tmp_path, capsys):
    """From the second adversarial round: an absurd model.depth (minutes building, no line), an
    .npz naming its images twice, --peak-tflops nan (the measured peak used silently), export to a
    dangling link ('File exists'), a dotted key or an empty section in a config file (blamed on
    something else), argparse's usage block before its error, --resume without the run's
    config.yaml (the defaults taken for the run's settings with no word)."""
    import numpy as np

    from nljax import bench, config, export, train
    from nljax.data import images
    from nljax.run import resuming

    with pytest.raises(config.ConfigError, match="model.depth=100000 is past the limit of 512 blocks"):
        config.load(None, ["model.depth=100000"])
    np.savez(tmp_path / "both.npz", x=np.zeros((4, 4, 4), np.uint8), images=np.ones((4, 4, 4), np.uint8))
    with pytest.raises(config.ConfigError, match="holds both 'x' and 'images': keep one of them"):
        images.load(config.load(None, ["images.source=file", f"images.path={tmp_path / 'both.npz'}"]).images)
    assert bench.main(["--peak-tflops", "nan"]) == 2
    assert "invalid peak_tflops value: 'nan'" in capsys.readouterr().err
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(config.ConfigError, match="is a symbolic link to .*nowhere, which does not exist"):
        export.check_out(tmp_path / "link")
    for text, said in (("train.steps: 3\n", "a config file nests its keys"),
                       ("train:\nmodel:\n  dim: 8\n", "section 'train' is empty"),
                       ("train: {}\n", "holds no settings")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(config.ConfigError, match=said):
            config.load(str(tmp_path / "c.yaml"), ["train.batch_size=4"])
    assert train.main(["--bogus"]) == 2  # a code, as every refusal's: argparse's SystemExit ended a script
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nljax.train: error: unrecognized arguments: --bogus (--help lists the options)"]
    (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "checkpoint.resume=latest"])
    assert resuming.resumed_config(cfg, None, []) == cfg
    assert "config.yaml is missing: resuming with the defaults and the command line's settings" in \
        capsys.readouterr().err


def test_an_export_record_without_its_seal_and_a_fifo_config_are_refused(tmp_path):
    """An export's config.json with its sha256 record but the digest removed (then anything in it
    could be edited) loaded unchecked; a FIFO as its config.json blocked nljax.load for ever."""
    import json

    from nljax import config
    from nljax.runtime import exportdir, filedigest

    info = {"config": {}, "sha256": {"model.safetensors": "0" * 64}}
    with pytest.raises(config.ConfigError, match="has its files' sha256 record but not the digest sealing it"):
        filedigest.check_seal(tmp_path / "config.json", info)
    (tmp_path / "e").mkdir()
    os.mkfifo(tmp_path / "e" / "config.json")
    assert not exportdir.is_export(tmp_path / "e")  # returns at once, without opening the FIFO
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text(json.dumps({"config": {}, "step": 1, "dtype": "float32", "checkpoint": "x"}))
    assert exportdir.is_export(tmp_path / "f")


def test_files_of_a_run_or_a_preparation_that_are_not_regular_files_are_one_line(tmp_path):
    """A FIFO in place of a prepared directory's manifest or of a run's metrics.jsonl blocked the
    read for ever (SIGTERM did not end it); an empty documents file was an EOFError traceback."""
    import shutil

    from nljax import config
    from nljax.data import prepared
    from nljax.runtime.rundir import kept_records

    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(config.ConfigError, match="metrics.jsonl is not a regular file"):
        kept_records(tmp_path / "metrics.jsonl", 4)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"d{i:02d}.txt").write_text(f"document {i} " * 200)
    cfg = config.load(None, ["data.source=files", f"data.train={corpus}/*.txt"])
    prepared.build(cfg.data, tmp_path / "p", workers=1)
    # a documents file that is not a .npy file (empty, or text): NumPy's line for the text offered
    # to load it as a pickle ("If you trust the file you can load it unsafely")
    not_npy = "is not the .npy file prepared (damaged or replaced since): prepare again"
    for i, (name, damage, said) in enumerate((
            ("manifest.json", os.mkfifo, "manifest.json is not a regular file"),
            ("train.docs.npy", lambda p: p.write_bytes(b""), f"train.docs.npy {not_npy}"),
            ("eval.docs.npy", lambda p: p.write_text("garbage\n"), f"eval.docs.npy {not_npy}"))):
        q = tmp_path / f"q{i}_{name}"
        shutil.copytree(tmp_path / "p", q)
        (q / name).unlink()
        damage(q / name)
        with pytest.raises(config.ConfigError) as e:
            prepared.load(q)
        assert str(e.value).startswith(f"data.prepared={q}: {said}"), e.value


@pytest.mark.parametrize("command", ["prepare", "lm_eval"])
def test_every_commands_argparse_refusal_is_one_line(command, capsys):
    """nljax.prepare and nljax.lm_eval kept argparse's usage block before the error (the other
    commands' refusals are one line since cli.Parser)."""
    import importlib

    main = importlib.import_module(f"nljax.{command}").main
    assert main(["--cpu-devices", "x"] if command == "lm_eval" else ["--bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    said = "argument --cpu-devices: invalid int value: 'x'" if command == "lm_eval" else \
        "unrecognized arguments: --bogus"
    assert err == [f"nljax.{command}: error: {said} (--help lists the options)"]


def test_a_tilde_name_of_no_user_is_a_path_as_typed_not_a_traceback(tmp_path, monkeypatch, capsys):
    """pathlib's expanduser raises RuntimeError for `~name` when no user has that name:
    nljax.prepare out=~typo/dir (and nljax.load, a --config, data.prepared) ended in a traceback.
    Read as a shell reads it: a name of no user stays as typed."""
    import nljax
    from nljax import config
    from nljax.prepare import main as prepare_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text to prepare " * 20)
    (tmp_path / "b.txt").write_text("more text, held out " * 20)
    typo = "~nljax_no_such_user_26"
    assert prepare_main([f"data.train={tmp_path / 'a.txt'}", f"data.eval={tmp_path / 'b.txt'}",
                         f"out={typo}/prepared"]) == 0
    assert (tmp_path / typo / "prepared" / "manifest.json").is_file()
    capsys.readouterr()
    with pytest.raises(config.ConfigError, match=f"config file not found: {typo}/c.yaml"):
        config.load(f"{typo}/c.yaml")
    with pytest.raises(config.ConfigError, match=f"^{typo}/run is neither an export directory "):  # as typed
        nljax.load(f"{typo}/run")


def test_a_failing_evaluation_keeps_the_steps_since_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """An evaluation that raises ends the run, but its steps are saved first (with their record):
    --resume goes on from the step it failed at, not from the last scheduled checkpoint."""
    from nljax.run import core
    from nljax.train import main as train_main

    def broken(self, params, step=0):
        raise RuntimeError("the evaluation broke")

    run_dir = tmp_path / "run"
    args = ["model.dim=32", "model.heads=2", "model.depth=1", "model.nl_lm.memory_layers=[]", "train.batch_size=8",
            "train.seq_len=32", "eval.every=3", "checkpoint.every=100", "train.steps=8", f"run.dir={run_dir}"]
    monkeypatch.setattr(core.Run, "evaluate", broken)
    with pytest.raises(RuntimeError, match="the evaluation broke"):
        train_main(args)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    assert "the evaluation failed; checkpoint 3 saved (resume with --resume)" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2  # the failed step's record (steps count from 0), written before the save


def test_the_closing_commands_of_a_model_registered_by_its_script_go_through_it(monkeypatch, tmp_path):
    """A model registered by the script run (examples/smallest_model.py): `python -m nljax.generate`
    does not know it, and the closing lines printed that command."""
    import shlex

    from nljax import config, register_model
    from nljax.models import specs
    from nljax.run.trainer import closing

    def build(cfg):
        raise AssertionError("not built")

    build.__module__ = "__main__"  # as a function defined in the script `python my model.py` runs
    register_model("scripted", build)
    monkeypatch.chdir(tmp_path)
    run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), engine=SimpleNamespace(model=SimpleNamespace(logits=None)))
    try:
        assert _script_closing_commands(monkeypatch, tmp_path / "my model.py", "scripted") == [
            ["python", "my model.py", "train"], ["python", "my model.py", "generate"],
            ["python", "my model.py", "export"]]
        # no `.py` (run as `python my_model`): the same form (the python calls of a notebook's model before)
        (tmp_path / "my model").write_text("")
        monkeypatch.setattr(sys, "argv", ["my model", "train"])
        monkeypatch.setattr(sys.modules["__main__"], "__file__", str(tmp_path / "my model"), raising=False)
        lines = closing(config.load(None, ["model.name=scripted", "run.dir=r"]), run)
        assert [shlex.split(l.split(":", 1)[1])[:3] for l in lines[1:]] == [
            ["python", "my model", "train"], ["python", "my model", "generate"], ["python", "my model", "export"]]
        python_m = [["python", "-m", f"nljax.{c}"] for c in ("train", "generate", "export")]
        own = closing(config.load(None, ["run.dir=r"]), run)  # nljax's own model: python -m
        assert [shlex.split(l.split(":", 1)[1])[:3] for l in own[1:]] == python_m
        # a notebook: its kernel's launcher is argv[0], and __main__ has no file; `python -m` would not
        # know the model (a fresh process): the calls to make where it is registered
        monkeypatch.setattr(sys, "argv", ["/venv/lib/ipykernel_launcher.py", "-f", "kernel.json"])
        monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
        lines = closing(config.load(None, ["model.name=scripted", "run.dir=r"]), run)
        assert "registered by __main__ in this process only" in lines[1]
        assert lines[2:] == ["  resume:  nljax.train.main(['--resume', 'run.dir=r', 'train.steps=400'])",
                             "  sample:  nljax.generate.main(['run.dir=r', 'prompt=The '])",
                             "  export:  nljax.export.main(['run.dir=r'])   (to r/export)"]
    finally:
        specs.unregister("scripted")
    # a module the script imported registered it: the same calls, naming the module
    build.__module__ = "my_models"
    register_model("imported", build)
    try:
        monkeypatch.setattr(sys, "argv", ["my model.py", "train"])
        monkeypatch.setattr(sys.modules["__main__"], "__file__", str(tmp_path / "my model.py"), raising=False)
        lines = closing(config.load(None, ["model.name=imported", "run.dir=r"]), run)
        assert "registered by my_models in this process only" in lines[1]
        assert lines[2] == "  resume:  nljax.train.main(['--resume', 'run.dir=r', 'train.steps=400'])"
    finally:
        specs.unregister("imported")


SCRIPTED = """#!/usr/bin/env python
from types import SimpleNamespace

import nljax
from nljax import config
from nljax.run.trainer import closing


def build(cfg):
    raise AssertionError("not built")


nljax.register_model("scripted", build)
model = SimpleNamespace(logits=None)
run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), engine=SimpleNamespace(model=model))
print("\\n".join(closing(config.load(None, ["model.name=scripted", "run.dir=r"]), run)))
"""


def test_the_closing_commands_of_a_script_run_by_its_path_are_its_own_command(tmp_path):
    """A script executed by its path (a shebang, `./my_model train ...`, with or without `.py`)
    closed with `python ...` only where argv[0] ended in `.py`; `./my_model` got the Python calls
    of a notebook's model. Its closing commands are the ones it was run with: `./my_model`,
    `./my_model.py`; by hand, `python my_model.py`. Whether the shebang's command is this
    process's: `run_by_shebang`, below without a subprocess."""
    import shlex
    import stat
    import subprocess

    from helpers import subprocess_env

    for name in ("my_model", "my_model.py"):
        (tmp_path / name).write_text(SCRIPTED)
        (tmp_path / name).chmod((tmp_path / name).stat().st_mode | stat.S_IXUSR)
    # `#!/usr/bin/env python` finds this python (the venv's) first on the PATH
    env = subprocess_env(PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    python = sys.executable  # typed by hand as a path: not the `python` the shebang's env runs
    argvs = {"./my_model": ["./my_model"], "./my_model.py": ["./my_model.py"],
             "python my_model.py": ["python", "my_model.py"]}
    runs = {said: subprocess.Popen([*(argv if argv[0] != "python" else [python, *argv[1:]]), "train"], cwd=tmp_path,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for said, argv in argvs.items()}
    for said, p in runs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (said, out, err)
        lines = [line.split(":", 1) for line in out.splitlines()[1:]]
        assert [what.strip() for what, _ in lines] == ["resume", "sample", "export"], out
        want = [[*argvs[said], command] for command in ("train", "generate", "export")]
        assert [shlex.split(command)[:len(argvs[said]) + 1] for _, command in lines] == want, (said, out)

    from nljax.run.trainer import run_by_shebang

    script = str(tmp_path / "my_model")
    assert run_by_shebang(script, ["python", script, "train"])  # `#!/usr/bin/env python`
    assert not run_by_shebang(script, [python, script, "train"])  # another python typed by hand
    assert not run_by_shebang(script, ["python", "-u", script, "train"])
    with contextlib.chdir(tmp_path):  # a bare name: PATH's, not this one (the executable my_model here)
        assert not run_by_shebang("my_model", ["python", "my_model", "train"])
    (tmp_path / "my_model").write_text(f"#!{python} -u\n")
    assert run_by_shebang(script, [python, "-u", script])
    assert not run_by_shebang(script, [python, script])
    (tmp_path / "my_model").write_text("#! /usr/bin/env -S python -X dev\n")
    assert run_by_shebang(script, ["python", "-X", "dev", script])
    (tmp_path / "my_model").chmod(0o644)  # not executable: `./my_model` would be refused
    assert not run_by_shebang(script, ["python", "-X", "dev", script])
    (tmp_path / "my_model.py").write_text("print()\n")  # no shebang: the shell would run it
    assert not run_by_shebang(str(tmp_path / "my_model.py"), ["python", str(tmp_path / "my_model.py")])


def _script_closing_commands(monkeypatch, script, model: str) -> list[list[str]]:
    """The first three words of each closing command of a run of `model` that `script` started
    (`python SCRIPT train`), the script an empty file."""
    import shlex

    from nljax import config
    from nljax.run.trainer import closing

    script.write_text("")
    monkeypatch.setattr(sys, "argv", [script.name, "train"])
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), engine=SimpleNamespace(model=SimpleNamespace(logits=None)))
    lines = closing(config.load(None, [f"model.name={model}", "run.dir=r"]), run)
    return [shlex.split(line.split(":", 1)[1])[:3] for line in lines[1:]]


def test_a_script_that_registers_an_imported_build_gets_its_own_closing_commands(monkeypatch, tmp_path):
    """The script run registers the model itself with a `build` it imported from its own module (a
    launcher beside the model's file): its process knows the model exactly as when `build` is
    defined in the script, so the closing commands go through the script, not `nljax.train.main`."""
    from nljax.models import specs

    def build(cfg):
        raise AssertionError("not built")

    build.__module__ = "my_models"  # imported by the script from its own module
    # the call made at the script's top level: its frame's module is __main__
    exec("register_model('launched', build)", {"__name__": "__main__", "register_model": specs.register_model,
                                                "build": build})
    monkeypatch.chdir(tmp_path)
    try:
        assert _script_closing_commands(monkeypatch, tmp_path / "launch.py", "launched") == [
            ["python", "launch.py", "train"], ["python", "launch.py", "generate"], ["python", "launch.py", "export"]]
    finally:
        specs.unregister("launched")


def test_a_script_not_run_with_the_command_first_closes_with_the_calls(monkeypatch, tmp_path):
    """A script that registers its model and passes its own arguments to `nljax.train.main` (the
    guide's script without a package: `python my_run.py run.dir=...`) closed with `python my_run.py
    train --resume ...`, the form of examples/smallest_model.py, which it refuses ("override
    'train' must look like key=value"). Only a script run with the command first takes that form;
    this one gets the calls to make where the model is registered."""
    from nljax import config
    from nljax.models import specs
    from nljax.run.trainer import closing

    def build(cfg):
        raise AssertionError("not built")

    exec("register_model('own_args', build)", {"__name__": "__main__", "register_model": specs.register_model,
                                                "build": build})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_run.py").write_text("")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(tmp_path / "my_run.py"), raising=False)
    run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), engine=SimpleNamespace(model=SimpleNamespace(logits=None)))
    try:
        for argv in (["my_run.py", "run.dir=r"], ["my_run.py", "--resume", "run.dir=r"], ["my_run.py"]):
            monkeypatch.setattr(sys, "argv", argv)
            lines = closing(config.load(None, ["model.name=own_args", "run.dir=r"]), run)
            assert "registered by __main__ in this process only" in lines[1], (argv, lines)
            assert lines[2] == "  resume:  nljax.train.main(['--resume', 'run.dir=r', 'train.steps=400'])", lines
    finally:
        specs.unregister("own_args")
