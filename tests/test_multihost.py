"""Multi-process runs: 2 processes x 4 CPU devices (gloo collectives) under `nljax.launch`,
checked against 1 process x 8 devices; lockstep errors; a killed or hung worker; a preemption
notice; a save failing on one process; how a process learns it is one of several. (The launcher itself: tests/test_launch.py.)

The launches are subprocesses (JAX import and compile per process), so there are few of them
and the model is tiny.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import FULL, QUICK, TINY, alive, subprocess_env

from nljax import config
from nljax.checkpoint import storage
from nljax.config import ConfigError
from nljax.parallel.mesh import resolve_shape
from nljax.runtime import distributed

ARGS = [*TINY, "cms.periods=[1,2,4]", "eval.batches=1", "sync.reduce=hierarchical"]
WORKER = str(Path(__file__).parent / "multihost_worker.py")
LAUNCH = [sys.executable, "-m", "nljax.launch"]


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("model", [2], ids=["tensor"])
def test_two_processes_train_like_one_process_with_eight_devices(tmp_path, model):
    """2 x 4 devices over gloo == 1 x 8 devices, step for step, with different PYTHONHASHSEEDs;
    `inter` spans the processes; each process builds only its own rows. Each process's 4 devices
    hold 2 data slots x 2 tensor-parallel shards (mesh 2 x 2 x 2): the per-level sync crosses the
    processes, tensor parallelism stays inside each. (`model=1`, pure data parallelism, passes
    too; it is left out for the suite's time: the other multi-process tests run it.)"""
    common = ["train.steps=6", "distributed.check_every=2", *ARGS, f"mesh.model={model}"]
    ref_dir, mp_dir = tmp_path / "one", tmp_path / "two"
    ref = subprocess.Popen(
        [sys.executable, "-m", "nljax.train", "--cpu-devices", "8", "--quiet", f"run.dir={ref_dir}", "mesh.inter=2",
         *common], env=subprocess_env(PYTHONHASHSEED="7"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    # Default mesh (inter=-1, intra=-1): one inter slot per process.
    inner = f"PYTHONHASHSEED=$((NLJAX_PROCESS_ID + 1)) exec {sys.executable} {WORKER} run.dir={mp_dir} {' '.join(common)}"
    mp = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "4", "--", "sh", "-c", inner],
                        env=subprocess_env(), capture_output=True, text=True, timeout=600)
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    assert mp.returncode == 0, mp.stdout + mp.stderr

    one, two = losses(ref_dir), losses(mp_dir)
    assert [r["step"] for r in two] == list(range(6))
    assert [r["active_levels"] for r in two] == [r["active_levels"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    # the gradients too: Adam's steps barely move when every gradient is scaled alike (a sum over
    # devices instead of their mean gives the same losses), their norms do not
    for key in sorted({k for r in one for k in r if k.startswith("grad_norm")}):
        np.testing.assert_allclose([r.get(key, 0.0) for r in two], [r.get(key, 0.0) for r in one], rtol=1e-4,
                                   err_msg=key)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (ref_dir, mp_dir))
    assert s2["mesh"] == {"inter": 2, "intra": 4 // model, "model": model} and s2["devices"] == 8
    np.testing.assert_allclose(s2["eval_loss"], s1["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(s2["eval_loss_stream"], s1["eval_loss_stream"], rtol=1e-5)
    # The same collectives were compiled: hierarchical reduce-scatter / all-reduce / all-gather.
    assert s2["communication"] == s1["communication"]

    text = mp.stdout
    assert re.search(r"^\[0\] lockstep: 2 processes agree on config, versions, mesh and data \(sha256 \w+\); "
                     r"mesh axes: inter across processes, intra within a process, model within a process$",
                     text, re.M), text
    assert re.search(r"^\[0\] step +5 ", text, re.M) and not re.search(r"^\[1\] step", text, re.M)
    rows = {int(m[1]): json.loads(m[2]) for m in re.finditer(r"^\[(\d)\] rows built: (.*)$", text, re.M)}
    assert rows == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_config_mismatch_is_reported_on_every_process(tmp_path):
    inner = f"exec {sys.executable} -m nljax.train run.dir={tmp_path}/r train.steps=$((3 + NLJAX_PROCESS_ID)) {' '.join(ARGS)}"
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", "sh", "-c", inner],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    for i in (0, 1):
        assert (f"[{i}] nljax.train: error (process {i}): processes disagree on the resolved config: "
                f"train.steps: process 0 = 3, process 1 = 4\n") in p.stderr
    assert not (tmp_path / "r").exists()


def test_a_flag_given_to_one_process_only_is_one_line_on_every_process(tmp_path):
    """--resume=auto on process 1 alone: the processes took different start-up steps (process 1
    reading run.dir with process 0 deciding, process 0 not), and their collectives crashed in gloo
    ("Received data size doesn't match expected size", a native abort) or waited, before the
    config was compared. Now the flags are compared first: one line naming the flag, exit 2."""
    inner = (f"exec {sys.executable} -m nljax.train run.dir={tmp_path}/r train.steps=2 {' '.join(ARGS)} "
             '$([ "$NLJAX_PROCESS_ID" = 1 ] && echo --resume=auto)')
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "1", "--grace", "20", "--", "sh", "-c", inner],
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)  # it waited 300 s and more
    assert p.returncode == 2, p.stdout + p.stderr
    for i in (0, 1):
        assert (f"[{i}] nljax.train: error (process {i}): processes disagree on the command line: resume_auto: "
                "process 0 = false, process 1 = true\n") in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()


def test_bench_joined_by_hand_compares_the_flags_alike_on_every_process(monkeypatch):
    """nljax.bench keeps its whole command line (`argv`), which holds each process's own
    --process-id: bench joined by hand (--coordinator ... --process-id I) was refused on every
    process, 'processes disagree on the command line: argv'. Its paths written (--out,
    --profile-dir) may differ by host, as config paths may; its other flags are compared."""
    from nljax import bench, cli

    parsers = []
    monkeypatch.setattr(cli, "main", lambda run, p, argv: parsers.append((p, argv)) or 0)
    flags = lambda i, *more: ["--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", str(i),
                              "--out", f"/local/{i}.json", "--profile", "1", "--profile-dir", f"/local/p{i}", *more,
                              *TINY]
    for argv in (flags(0), flags(1), flags(1, "--steps", "3")):
        assert bench.main(argv) == 0
    p0, p1, other = (cli.same_flags(p.parse_args(argv)) for p, argv in parsers)
    assert p0 == p1 and p0 != other


def test_the_source_digest_reads_files_alone(tmp_path):
    """An editor's lock file beside a file being edited (Emacs: `.#trainer.py`, a symbolic link to
    nothing) stopped every start of a multi-process run with a FileNotFoundError traceback; it is
    no source. A file's edit or a file added changes the digest."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer.py").write_text("x = 1\n")
    before = distributed.source_digest(tmp_path)
    (tmp_path / "run" / ".#trainer.py").symlink_to("user@host.1234:1700000000")
    assert distributed.source_digest(tmp_path) == before
    (tmp_path / "run" / "trainer.py").write_text("x = 2\n")
    edited = distributed.source_digest(tmp_path)
    (tmp_path / "new.py").write_text("")
    assert len({before, edited, distributed.source_digest(tmp_path)}) == 3


@pytest.mark.slow
def test_another_nljax_checkout_of_the_same_version_on_one_process_is_one_line(tmp_path):
    """Process 1 runs a copy of this checkout with one comment added (a host left on another
    commit: the same nljax version). The versions agreed, and the two ran different code in
    lockstep; now the start-up check names nljax's source, on every process, exit 2, nothing written."""
    import shutil

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "nljax", tmp_path / "other" / "nljax", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "other" / "nljax" / "train.py", "a") as f:
        f.write("# an edit on one host\n")
    # from tmp_path: `python -m` puts the working directory first on the path
    inner = (f'if [ "$NLJAX_PROCESS_ID" = 1 ]; then export PYTHONPATH={tmp_path}/other; fi; cd {tmp_path} && '
             f"exec {sys.executable} -m nljax.train run.dir={tmp_path}/r train.steps=2 {' '.join(ARGS)}")
    _refused_at_startup(inner, r"versions\.nljax_source", tmp_path / "r")


@pytest.mark.slow
def test_an_eval_set_of_other_text_on_one_process_is_one_line_on_every_process(tmp_path):
    """data.eval_sets held=held.txt, relative: each process reads the copy in its own directory
    (as hosts without a shared file system read their own), one of other text. The config agrees;
    the start-up check compares each set's content digest and names the set, on every process,
    exit 2, nothing written (each process would score other text as the same set)."""
    for i, text in enumerate(("the same words, read by one process " * 8, "other words, read by the other one " * 8)):
        (tmp_path / f"p{i}").mkdir()
        (tmp_path / f"p{i}" / "held.txt").write_text(text)
    inner = (f"cd {tmp_path}/p$NLJAX_PROCESS_ID && exec {sys.executable} -m nljax.train run.dir={tmp_path}/r "
             f"train.steps=2 'data.eval_sets=[held=held.txt]' {' '.join(ARGS)}")
    _refused_at_startup(inner, r"data\.eval_sets\.held", tmp_path / "r")


def _refused_at_startup(inner: str, key: str, run_dir: Path) -> None:
    """`inner` (a shell command) launched as 2 processes x 2 devices stops at the start-up check
    with one line on every process naming `key` (a regex) as what differs; exit 2, `run_dir`
    never made."""
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", "sh", "-c", inner],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    for i in (0, 1):
        assert re.search(rf"^\[{i}\] nljax\.train: error \(process {i}\): processes disagree on the start-up state "
                         rf"\(config, versions, mesh, data\): {key}: process 0 = \"\w+…, "
                         r"process 1 = \"\w+…$", p.stderr, re.M), p.stderr
    assert not run_dir.exists()


def test_unequal_device_counts_are_reported_on_every_process(tmp_path):
    """1 CPU device in process 0, 2 in process 1: one line from each, exit 2, no traceback (the
    lockstep all-gather used to fail in a reshape and the peer in a C++ check)."""
    inner = (f"exec {sys.executable} -m nljax.train --cpu-devices $((1 + NLJAX_PROCESS_ID)) run.dir={tmp_path}/r "
             f"train.steps=2 {' '.join(ARGS)}")
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--grace", "20", "--", "sh", "-c", inner],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [l for l in p.stderr.splitlines() if not l.startswith("nljax.launch: ")]
    assert sorted(lines) == [f"[{i}] nljax.train: error (process {i}): processes drive unequal numbers of devices "
                             "(process 0 = 1, process 1 = 2); give every process the same number (--cpu-devices, "
                             "--local-device-ids or the visible accelerators)" for i in (0, 1)], p.stderr
    assert not (tmp_path / "r").exists()


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(), re.M)
        if m:
            return m
        assert proc.poll() is None, path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{path.read_text()}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)], ids=["killed", "hung"])
def test_dead_or_hung_worker_stops_the_run_within_the_bound(tmp_path, sig):
    """SIGKILL one worker mid-training: the survivor exits on its own (its collective fails) well
    before the launcher's grace period. SIGSTOP one worker (alive, silent, its socket open, as a
    hung GPU process): the coordination service misses its heartbeats for distributed.timeout_s
    and terminates the survivor; the launcher then kills the stopped one. Either way the launcher
    exits non-zero within the bound and no process is left."""
    log = tmp_path / "log.txt"
    grace = 60 if sig == signal.SIGKILL else 2
    cmd = [*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--grace", str(grace), "--", sys.executable, "-m",
           "nljax.train", f"run.dir={tmp_path}/r", "train.steps=100000", "train.log_every=1",
           "distributed.timeout_s=8", *ARGS, "cms.periods=[1]"]
    with open(log, "w") as f:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        pids = [int(x) for x in _wait_for(log, r"pids (\d+) (\d+)$", launcher, 60).groups()]
        _wait_for(log, r"^\[0\] step +2 ", launcher, 300)  # compiled and training
        t0 = time.monotonic()
        os.kill(pids[1], sig)
        rc = launcher.wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    text = log.read_text()
    assert not any(alive(p) for p in pids)
    if sig == signal.SIGKILL:
        assert rc == 128 + signal.SIGKILL, text
        assert elapsed < 25, (elapsed, text)  # the 60 s grace was not needed
        assert f"process 1 (pid {pids[1]}) exited with code 137" in text
        assert "killing the processes still running" not in text
        # the survivor's collective failed ("Connection reset by peer"): its one line names the cause,
        # with no Python traceback of its own (or JAX's coordination service ended it first, 134)
        assert "Traceback (most recent call last)" not in text, text
    else:
        # Process 0 is ended by JAX (abort, 134) after missing heartbeats; process 1 by the launcher.
        assert rc == 134 and "exit codes by process: 134, 137" in text, text
        assert "Terminating process because the JAX distributed service detected fatal errors" in text
        assert 2 <= elapsed < 8 + grace + 15, (elapsed, text)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["workers", "launcher"])
def test_preemption_notice_saves_the_same_step_on_every_process(tmp_path, to):
    """SIGTERM to every worker (as SLURM sends it) or to the launcher (Kubernetes: the container's
    first process), which passes it on: JAX's preemption service agrees on a step, every process
    saves it and exits 143 with one line; --resume then continues from it. Each step dispatched
    ahead of the one before's result (train.dispatch_ahead=true, a GPU's default): the notice is
    asked before the next dispatch, on every process in the same order."""
    log = tmp_path / "log.txt"
    args = [f"run.dir={tmp_path}/r", "train.log_every=1", "checkpoint.every=1000", *ARGS, "cms.periods=[1]",
            "train.dispatch_ahead=true"]
    cmd = [*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--grace", "60", "--", sys.executable, "-m",
           "nljax.train", "train.steps=100000", *args]
    with open(log, "w") as f:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        pids = [int(x) for x in _wait_for(log, r"pids (\d+) (\d+)$", launcher, 60).groups()]
        _wait_for(log, r"^\[0\] step +2 ", launcher, 300)
        for p in pids if to == "workers" else [launcher.pid]:
            os.kill(p, signal.SIGTERM)
        rc = launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text()
    assert rc == 143, text
    assert to == "launcher" or "exit codes by process: 143, 143" in text, text
    stopped = re.findall(r"^\[(\d)\] nljax.train: preempted \(SIGTERM\): stopped after step (\d+), checkpoint saved", text, re.M)
    assert sorted(i for i, _ in stopped) == ["0", "1"] and stopped[0][1] == stopped[1][1], text
    saved = int(stopped[0][1]) + 1
    assert (tmp_path / "r" / "checkpoints" / str(saved)).is_dir()
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", sys.executable, "-m", "nljax.train",
                        "--resume", f"train.steps={saved + 2}", *args], env=subprocess_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and f"at step {saved}" in p.stdout, p.stderr
    # its closing resume line goes through the launcher, with as many processes and devices
    assert ("[0]   resume:  python -m nljax.launch --nproc 2 --cpu-devices 2 -- python -m nljax.train --resume "
            f"run.dir={tmp_path / 'r'} train.steps=") in p.stdout, p.stdout


@pytest.mark.parametrize("failing, async_save", [(1, "true"), (0, "false")], ids=["process1-async", "process0-sync"])
def test_save_failing_on_one_process_stops_every_process_with_its_cause(tmp_path, failing, async_save):
    """One process's disk fills during the save of step 8: every process stops at that save
    within seconds with the same line, naming the process and its error, and checkpoint 4 stays
    the newest complete one. Orbax's barriers used to wait for the failed process until their
    timeouts (20 minutes, then 5), the whole job hung. Process 1 fails on its own shards;
    process 0 (which commits the step) with checkpoint.async_save=false."""
    run, ck = tmp_path / "r", tmp_path / "r" / "checkpoints"
    args = [*ARGS, "cms.periods=[1]", "train.steps=12", "eval.every=0", "checkpoint.every=4", "checkpoint.keep=2",
            f"checkpoint.async_save={async_save}", *QUICK, f"run.dir={run}", "--quiet"]
    t0 = time.monotonic()
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", sys.executable, "-c", FULL, str(ck),
                        "6000", *args], env=subprocess_env(FULL_ON_PROCESS=str(failing)), capture_output=True,
                       text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2 and "exit codes by process: 2, 2" in p.stderr, p.stdout + p.stderr
    assert p.stdout == "", p.stdout  # --quiet: nothing, gloo's "connected to 1 peer ranks" lines included
    errors = [l for l in p.stderr.splitlines() if not l.startswith("nljax.launch: ") and "Gloo" not in l]
    assert sorted(errors) == [f"[{i}] nljax.train: error (process {i}): checkpoint {ck / '8'} could not be saved "
                              f"(process {failing}: OSError: [Errno 27] File too large); the newest complete "
                              f"checkpoint is {ck / '4'}" for i in (0, 1)], p.stderr
    assert elapsed < 240, elapsed  # start, compile and 8 steps (~10 s idle); the hang was over 20 minutes
    assert storage.committed_steps(ck) == [4]


def test_a_run_file_failing_on_one_process_is_its_one_line(tmp_path):
    """Process 0's disk fills after step 5 (metrics.jsonl can grow no more): it stops with the
    single-process run's line naming the file (it printed a traceback and a line without it)."""
    run = tmp_path / "r"
    args = [*ARGS, "cms.periods=[1]", "train.steps=12", "eval.every=0", "checkpoint.every=0", *QUICK,
            f"run.dir={run}", "--quiet"]
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", sys.executable, "-c", FULL, "-", "1",
                        *args], env=subprocess_env(FULL_ON_PROCESS="0"), capture_output=True, text=True, timeout=300)
    mine = [l for l in p.stderr.splitlines() if l.startswith("[0] ") and "Gloo" not in l]
    assert mine == [f"[0] nljax.train: error (process 0): cannot write {run / 'metrics.jsonl'}: [Errno 27] File too "
                    "large"], p.stderr
    assert p.returncode == 1, p.stderr


# nljax.train, but on process 1 Orbax's read of checkpoint 8's arrays fails (as a damaged chunk
# only it reads would make it), the other process reads them intact.
DAMAGED_ON_ONE = r"""
import os, sys
sys.argv = ["nljax.train", *sys.argv[1:]]
import orbax.checkpoint as ocp
restore = ocp.StandardCheckpointHandler.restore
def failing(self, directory, *args, **kwargs):
    if directory.parent.name == "8" and os.environ["NLJAX_PROCESS_ID"] == "1":
        raise ValueError("OUT_OF_RANGE: Error reading a chunk of process 1's")
    return restore(self, directory, *args, **kwargs)
ocp.StandardCheckpointHandler.restore = failing
from nljax.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_checkpoint_damaged_for_one_process_is_skipped_by_every_process(tmp_path):
    """--resume with the newest checkpoint damaged where only process 1 reads: every process
    skips it (one warning naming the process), resumes from the one before, and the later one is
    set aside. Before, process 1 left Orbax's restore before its closing barrier, process 0 went
    on with step 8, and the job hung in mismatched collectives until the coordination service
    killed it (214 s, no line saying why)."""
    run, ck = tmp_path / "r", tmp_path / "r" / "checkpoints"
    args = [*ARGS, "cms.periods=[1]", "eval.every=0", "checkpoint.every=4", *QUICK, f"run.dir={run}"]
    first = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", sys.executable, "-m", "nljax.train",
                            "train.steps=8", *args], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--", sys.executable, "-c", DAMAGED_ON_ONE,
                        "--resume", "train.steps=10", *args], env=subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (f"[0] nljax: warning: checkpoint {ck / '8'} (step 8) is damaged (as process 1 reads it): array data "
            "unreadable; resuming from an older one -- ValueError: OUT_OF_RANGE: Error reading a chunk of process "
            "1's\n") in p.stderr, p.stderr
    assert f"[0] resumed from {ck / '4'} at step 4" in p.stdout, p.stdout
    assert (ck / "set_aside" / "8").is_dir() and storage.committed_steps(ck) == [4, 8, 10]


@pytest.mark.slow
def test_a_resumed_run_whose_steps_all_skip_stops_on_every_process(tmp_path):
    """The count of skipped steps in a row continues from the kept records, which process 0
    alone reads: before, process 1 counted from 0, process 0 stopped alone and process 1 hung in
    the next step's collective until the coordination service aborted it (exit 134, 69 s)."""
    run = tmp_path / "r"
    args = [*ARGS, "eval.every=0", "checkpoint.every=3", "sync.max_grad_norm=1e-12", *QUICK, f"run.dir={run}"]
    launch = lambda *a: subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "1", "--", sys.executable, "-m",
                                        "nljax.train", "--quiet", *args, *a], env=subprocess_env(),
                                       capture_output=True, text=True, timeout=300)
    first = launch("train.steps=3", "train.max_skipped=0")  # steps 0-2 all skipped, saved at 3
    assert first.returncode == 0, first.stderr
    p = launch("--resume", "train.steps=10", "train.max_skipped=4")
    assert "exit codes by process: 2, 2" in p.stderr, p.stderr
    for i in (0, 1):  # the 3 kept steps and step 3 make 4
        assert f"[{i}] nljax.train: error (process {i}): stopped after step 3: the last 4 steps" in p.stderr, p.stderr


def test_run_files_process_0_cannot_write_stop_every_process(tmp_path):
    """Process 0 alone writes run.dir's files; when it cannot (here metrics.jsonl's temporary
    file is a directory), every process stops at once with one line. Before, such an OSError
    printed a traceback and aborted the job, and a refusal there (a ConfigError) stopped process 0
    alone while process 1 waited in the trackers' next collective until the timeout."""
    run = tmp_path / "r"
    (run / "metrics.jsonl.tmp").mkdir(parents=True)
    t = time.time()
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "1", "--", sys.executable, "-m", "nljax.train",
                        "--quiet", *ARGS, *QUICK, "train.steps=2", "distributed.timeout_s=60", f"run.dir={run}"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert "exit codes by process: 2, 2" in p.stderr, p.stderr
    assert (f"[0] nljax.train: error (process 0): cannot write {run / 'metrics.jsonl.tmp'}: [Errno 21] Is a "
            "directory") in p.stderr, p.stderr
    assert "[1] nljax.train: error (process 1): process 0 could not write the run's files" in p.stderr, p.stderr
    assert time.time() - t < 45 and not (run / "nljax.lock").exists()


class FakeStore:
    """The coordination service's key-value calls `Peers` makes, in memory."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        if key in self.kv:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def key_value_increment(self, key, by):
        self.kv[key] = str(int(self.kv.get(key, "0")) + by)
        return int(self.kv[key])


def test_peers_barrier_counts_each_call_and_ends_on_a_posted_failure(monkeypatch):
    """Process 0's view of two processes: a barrier passes once process 1 has arrived at the same
    call of that key (Orbax reuses keys), times out otherwise, and raises the first failure posted
    (process 1's; a later report, or one of the failure seen, changes nothing)."""
    from nljax.checkpoint import peers

    store = FakeStore()
    monkeypatch.setattr(peers.Peers, "_client", staticmethod(lambda: store))
    monkeypatch.setattr(peers.jax, "process_count", lambda: 2)  # this is process 0 (jax.process_index)
    monkeypatch.setattr(peers, "POLL_MAX_MS", 1)
    mine = peers.Peers("0", describe=lambda e: f"{type(e).__name__}: {e}")
    store.key_value_increment(f"{mine.root}/barrier/k/1/arrived", 1)  # process 1 reached its first call of "k"
    mine.barrier(key="k", timeout_ms=1000)
    assert store.kv[f"{mine.root}/barrier/k/1/outcome"] == "done"  # decided by the last to arrive, this process
    with pytest.raises(TimeoutError, match="checkpoint barrier k not reached by every process in 0.05 s"):
        mine.barrier(key="k", timeout_ms=50)  # the second call: process 1 is not there yet
    assert store.kv[f"{mine.root}/barrier/k/2/outcome"] == "timeout"
    # process 1 arrives late and completes the count: it abides by the outcome, it does not pass
    other = peers.Peers("0", describe=lambda e: f"{type(e).__name__}: {e}")
    other.calls["k"] = 1
    with pytest.raises(peers.PeerSaveFailed, match="TimeoutError: checkpoint barrier k not reached"):
        other.barrier(key="k", timeout_ms=10_000)
    assert store.kv.pop(f"{mine.root}/failed") == "process 0: TimeoutError: checkpoint barrier k not reached by every process in 0.05 s"
    store.key_value_set(f"{mine.root}/failed", "process 1: OSError: [Errno 28] No space left on device")
    mine.report(OSError("mine, later"))
    mine.report(peers.PeerSaveFailed("seen"))
    with pytest.raises(peers.PeerSaveFailed, match=r"^process 1: OSError: \[Errno 28\] No space left on device$"):
        mine.barrier(key="other", timeout_ms=10_000)
    assert storage.os_error(peers.PeerSaveFailed(mine.failure())) == mine.failure()


def test_peers_pass_on_coordination_errors_other_than_the_expected(monkeypatch, capsys):
    """Only 'the key exists' (another process was first) and 'not found' (nothing posted) are
    outcomes: another error of the coordination service fails the barrier instead of passing for
    one, and a failure that cannot be posted is said in a warning (the save's own error stands)."""
    from nljax.checkpoint import peers

    class Down(FakeStore):
        def key_value_try_get(self, key, value=None):
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

        key_value_set = key_value_try_get

    monkeypatch.setattr(peers.Peers, "_client", staticmethod(lambda: Down()))
    monkeypatch.setattr(peers.jax, "process_count", lambda: 1)
    mine = peers.Peers("0", describe=repr)
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        mine.barrier(key="k", timeout_ms=1000)
    mine.report(OSError("disk full"))
    assert capsys.readouterr().err == ("nljax: warning: the other processes could not be told of this save's failure "
                                       "(RuntimeError: UNAVAILABLE: failed to connect to all addresses); they stop at "
                                       "distributed.timeout_s\n")


def test_peers_barrier_all_pass_or_all_fail(monkeypatch):
    """Three processes (threads on one store) reach a barrier at random times around its timeout:
    in every trial they all pass or all fail, never some of each (before, a late process could
    complete the count and commit a step another had given up on)."""
    import random
    import threading

    from nljax.checkpoint import peers

    class LockedStore(FakeStore):  # the coordination service's calls are atomic
        def __init__(self):
            super().__init__()
            self.mu = threading.Lock()

        def key_value_set(self, key, value):
            with self.mu:
                return super().key_value_set(key, value)

        def key_value_increment(self, key, by):
            with self.mu:
                return super().key_value_increment(key, by)

    store = LockedStore()
    monkeypatch.setattr(peers.Peers, "_client", staticmethod(lambda: store))
    monkeypatch.setattr(peers.jax, "process_count", lambda: 3)
    monkeypatch.setattr(peers, "POLL_MS", 1)
    monkeypatch.setattr(peers, "POLL_MAX_MS", 2)
    rng, mixed, kinds = random.Random(0), 0, set()
    for trial in range(40):
        results = [None] * 3

        def process(i, delay, barrier=f"t{trial}"):
            time.sleep(delay)
            try:
                peers.Peers(barrier, describe=repr).barrier(key="k", timeout_ms=20)
                results[i] = "pass"
            except (TimeoutError, peers.PeerSaveFailed):
                results[i] = "fail"

        threads = [threading.Thread(target=process, args=(i, rng.uniform(0, 0.04))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mixed += len(set(results)) > 1
        kinds |= set(results)
    assert mixed == 0 and kinds == {"pass", "fail"}, (mixed, kinds)


def test_resolve_launch(monkeypatch):
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                distributed.ENV_LOCAL_DEVICE_IDS, "SLURM_STEP_NODELIST", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri",
                "WORLD_SIZE", "RANK", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.resolve() is None  # a plain single process
    assert distributed.resolve("h:1", 2, 1, (0, 1)) == distributed.Launch("h:1", 2, 1, (0, 1))
    assert distributed.resolve("h:1", 1, 0) is None  # one process: nothing to join
    with pytest.raises(ConfigError, match="is for one of several processes"):  # not silently every device
        distributed.resolve("h:1", 1, 0, (0, 1))
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "3")
    monkeypatch.setenv(distributed.ENV_LOCAL_DEVICE_IDS, "2,3")
    assert distributed.resolve() == distributed.Launch("10.0.0.1:1234", 4, 3, (2, 3))
    assert distributed.resolve(process_id=0).process_id == 0  # flags win over the environment
    monkeypatch.delenv(distributed.ENV_PROCESS_ID)
    with pytest.raises(ConfigError, match="missing --process-id"):
        distributed.resolve()
    with pytest.raises(ConfigError, match=r"--process-id must be in \[0, 4\)"):
        distributed.resolve(process_id=4)
    for bad in ("nohost", "h:abc", "h:0", "h:99999"):
        with pytest.raises(ConfigError, match="^--coordinator must look like HOST:PORT with a port in 1-65535"):
            distributed.resolve(bad, process_id=0)
    # a bad value from the environment (a launch script's) is named as the variable, not as a flag
    # the command line did not give
    with monkeypatch.context() as m:
        m.setenv(distributed.ENV_COORDINATOR, "nohost")
        with pytest.raises(ConfigError, match=f"^{distributed.ENV_COORDINATOR} must look like HOST:PORT"):
            distributed.resolve(process_id=0)
        m.setenv(distributed.ENV_PROCESS_ID, "4")
        with pytest.raises(ConfigError, match=f"^{distributed.ENV_PROCESS_ID} must be in \\[0, 4\\) and "
                                              f"{distributed.ENV_NUM_PROCESSES} >= 1, got process id 4 of 4$"):
            distributed.resolve()
    def no_such_name(host, port, *a, **k):  # what the resolver says of a misspelt host (no DNS needed here)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with monkeypatch.context() as m:
        m.setattr(socket, "getaddrinfo", no_such_name)
        with pytest.raises(ConfigError, match="^--coordinator nosuchhost:1234: host 'nosuchhost' does not resolve"):
            distributed.initialize(distributed.Launch("nosuchhost:1234", 2, 1), 5)  # not minutes of waiting, then abort
        # given by a launch script's variables, the line names the variable, not a flag nobody gave
        m.setenv(distributed.ENV_COORDINATOR, "nosuchhost:1234")
        m.setenv(distributed.ENV_NUM_PROCESSES, "2")
        m.setenv(distributed.ENV_PROCESS_ID, "1")
        with pytest.raises(ConfigError, match=f"^{distributed.ENV_COORDINATOR} nosuchhost:1234: host 'nosuchhost'"):
            distributed.initialize(distributed.resolve(), 5)
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_LOCAL_DEVICE_IDS):
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert distributed.resolve() is None  # the batch script itself, not an srun step
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-8]")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.resolve() is None
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert distributed.resolve() == distributed.Launch(cluster="SLURM")  # JAX auto-detects the rest
    assert distributed.resolve(num_processes=1) is None  # forced single process
    assert distributed.resolve(local_device_ids=(0, 1)) == distributed.Launch(local_device_ids=(0, 1), cluster="SLURM")
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ConfigError, match="--local-device-ids needs"):
        distributed.resolve(local_device_ids=(0, 1))


def test_local_device_ids_on_the_cpu_are_refused(monkeypatch):
    """JAX applies --local-device-ids to GPUs alone: with --cpu-devices (JAX_PLATFORMS=cpu) every
    process silently drove all its CPU devices (--devices-per-proc 1 --cpu-devices 2: 2 each)."""
    import argparse

    import jax

    from nljax import cli

    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                distributed.ENV_LOCAL_DEVICE_IDS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "initialize", lambda launch, timeout_s: launch is not None)  # joins nothing
    assert jax.config.jax_platforms == "cpu"  # conftest's
    args = argparse.Namespace(coordinator="127.0.0.1:1234", num_processes=2, process_id=1, local_device_ids="1")
    cfg = config.load(None, [])
    with pytest.raises(ConfigError, match=r"^--local-device-ids \(NLJAX_LOCAL_DEVICE_IDS\) chooses GPUs, but this "
                                          r"process runs on the CPU"):
        cli.setup_processes(args, cfg)
    assert cli.setup_processes(argparse.Namespace(**{**vars(args), "local_device_ids": None}), cfg)


def test_a_coordinator_port_already_served_is_one_line(monkeypatch):
    """gRPC binds the coordinator with SO_REUSEPORT: a second coordinator on a port another run
    serves (the same fixed port given to two launches, or two processes both --process-id 0)
    started without error, and both runs waited out the 300 s join timeout."""
    import jax

    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)  # as gRPC's [::]:PORT server
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.bind(("::", 0))
    listener.listen()
    port = listener.getsockname()[1]
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    with listener:
        with pytest.raises(ConfigError, match=f"^--coordinator 127.0.0.1:{port}: port {port} is already in use on "
                                              "this host"):
            distributed.initialize(distributed.Launch(f"127.0.0.1:{port}", 2, 0), 5)
        # given by a launch script's variables, the line names the variable, not a flag nobody gave
        with monkeypatch.context() as m:
            m.setenv(distributed.ENV_COORDINATOR, f"127.0.0.1:{port}")
            m.setenv(distributed.ENV_NUM_PROCESSES, "2")
            m.setenv(distributed.ENV_PROCESS_ID, "0")
            with pytest.raises(ConfigError, match=f"^{distributed.ENV_COORDINATOR} 127.0.0.1:{port}: port {port} is "
                                                  "already in use"):
                distributed.initialize(distributed.resolve(), 5)
        assert not joined
        distributed.initialize(distributed.Launch(f"127.0.0.1:{port}", 2, 1), 5)  # a client: only process 0 serves
        assert len(joined) == 1
    distributed.initialize(distributed.Launch(f"127.0.0.1:{port}", 2, 0), 5)  # free again: it starts
    assert len(joined) == 2


def test_lockstep_explain_and_digest():
    a = {"config": {"train": {"steps": 3, "seq_len": 8}}, "data": "x"}
    b = {"config": {"train": {"steps": 4, "seq_len": 8}}, "data": "x"}
    assert distributed.explain([a, a, b]) == "config.train.steps: processes 0,1 = 3, process 2 = 4"
    # long values are shown from a little before where they differ
    long = ["/shared/" + "d" * 80 + f"/shard-{i}" for i in range(2)]
    assert distributed.explain([{"train": [long[0]]}, {"train": [long[1]]}]) == (
        f'train: process 0 = …{"d" * 13}/shard-0"], process 1 = …{"d" * 13}/shard-1"]')
    # Canonical JSON: key order does not matter, and nothing depends on Python's hash().
    assert distributed.digest({"b": 1, "a": [1, 2]}) == distributed.digest({"a": [1, 2], "b": 1})
    assert distributed.digest(a) != distributed.digest(b)
    assert distributed.agree("test", a) == distributed.digest(a)  # one process: trivially agrees


def test_default_mesh_is_one_inter_slot_per_process():
    assert config.load().mesh.inter == -1
    assert resolve_shape(-1, -1, 8, n_processes=1) == (1, 8)
    assert resolve_shape(-1, -1, 8, n_processes=2) == (2, 4)
    assert resolve_shape(1, -1, 8, n_processes=2) == (1, 8)  # overridable
    with pytest.raises(ConfigError, match="distributed.timeout_s"):
        config.load(None, ["distributed.timeout_s=0"])


def test_step_check_runs_every_check_every_iterations(monkeypatch):
    from nljax.engine.conductor import pulse

    calls = []
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "agree", lambda what, record: calls.append((what, record)))
    for i in range(7):
        distributed.check_step(i, pulse(10 + i, (1, 2)), every=3)
    assert calls == [("training step at loop iteration 0", {"step": 10, "active": [True, True]}),
                     ("training step at loop iteration 3", {"step": 13, "active": [True, False]}),
                     ("training step at loop iteration 6", {"step": 16, "active": [True, True]})]
    calls.clear()
    distributed.check_step(0, pulse(0, (1,)), every=0)
    assert calls == []




@pytest.mark.slow
def test_the_command_checks_in_as_the_processes_join(tmp_path, monkeypatch):
    """`nljax.train --resume` tells JAX's preemption service the step it resumes from as soon as
    `jax.distributed.initialize` returns, before the start-up's first collective (the config
    check): a notice from then on is not lost (the test below)."""
    from nljax import cli, train

    d = tmp_path / "run"
    common = [*TINY, *QUICK, f"run.dir={d}", "--quiet"]
    assert train.main([*common, "train.steps=2", "checkpoint.every=1"]) == 0
    calls = []
    monkeypatch.setattr(distributed, "initialize", lambda launch, timeout_s: True)  # one of "several"
    monkeypatch.setattr(cli, "check_in", lambda first_step: calls.append(("check_in", first_step())))

    def check_config(cfg):
        calls.append(("check_config",))
        raise ConfigError("the test stops here")

    monkeypatch.setattr(distributed, "check_config", check_config)
    assert train.main([*common, "train.steps=4", "--resume"]) == 2
    assert calls == [("check_in", 2), ("check_config",)]


PREEMPTED_IN_STARTUP = """
import os, signal, sys, time
import jax
i, port, resumed_at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=i)
from nljax.runtime import preemption
preemption.check_in(lambda: resumed_at)  # what the trainer does first
if i == 0:
    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, during restore and compilation
time.sleep(3)
notice = preemption.Notice()
print(next((s for s in range(resumed_at, resumed_at + 200) if notice.stop_after(s) or time.sleep(0.05)), None))
"""


def test_preemption_notice_during_a_resumed_runs_startup_is_not_lost():
    """JAX's sync point is the largest step the processes reported plus one: with nothing reported
    yet it is step 1, which a run resumed at step 500 never reaches. Reported first
    (`preemption.check_in`, the trainer's first call), a notice during start-up stops every
    process at the same step."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", PREEMPTED_IN_STARTUP, str(i), str(port), "500"],
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    stopped = [o.strip().splitlines()[-1] if o.strip() else "" for o, _ in outs]
    # the same step on both, soon after the one reported (501 unless the notice took over 3 s)
    assert stopped[0] == stopped[1] and stopped[0].isdigit() and 500 < int(stopped[0]) < 700, outs


ON_MAIN_FAILS = """
from nljax.runtime import distributed
distributed.initialize(distributed.resolve(), 60)
def clear():
    raise OSError(5, "Input/output error", "/ck/7")
distributed.on_main(clear, elsewhere=None)
"""


def test_an_unexpected_error_on_process_0_alone_stops_every_process_at_once():
    """What process 0 does for all (`distributed.on_main`) raising something other than a
    ConfigError (an OSError no one turned into a line): process 0 raises it with its traceback,
    the others a line naming it, at once; they used to wait in the collective process 0 left."""
    t = time.time()
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "1", "--", sys.executable, "-c", ON_MAIN_FAILS],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "[0] OSError: [Errno 5] Input/output error: '/ck/7'" in p.stderr, p.stderr
    assert ("[1] nljax.errors.ConfigError: process 0 failed: OSError: [Errno 5] Input/output error: '/ck/7'"
            in p.stderr), p.stderr
    assert time.time() - t < 40, p.stderr


def test_another_launchers_variables_are_not_taken_for_one_process(monkeypatch, capsys):
    """torchrun (accelerate, DeepSpeed) sets WORLD_SIZE and RANK for each of its processes; nljax
    reads neither, so each trained alone into the same run.dir: refused, saying how to launch.
    JAX_COORDINATOR_ADDRESS alone (JAX's, without the process count and id) is said. nljax's own
    launch variables, given beside them, are what joins."""
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                distributed.ENV_LOCAL_DEVICE_IDS, "SLURM_STEP_NODELIST", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc 1: one process, as it is
    assert distributed.resolve() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=2 is set \(torchrun's or another launcher's\), but nljax does "
                                          r"not read it: start the processes with python -m nljax.launch --nproc 2 -- "
                                          r"<command>, or give each --coordinator HOST:PORT --num-processes 2 "
                                          r"--process-id 1$"):
        distributed.resolve()
    assert distributed.resolve("h:1", 2, 1) == distributed.Launch("h:1", 2, 1)  # nljax's own flags join
    assert distributed.resolve(num_processes=1) is None  # forced single process
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert distributed.resolve() is None
    assert capsys.readouterr().err == ("nljax: warning: JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 is set, but nljax joins "
                                       "processes from --coordinator, --num-processes and --process-id "
                                       f"({distributed.ENV_COORDINATOR}, ...) or a SLURM / Open MPI job: this "
                                       "process runs alone\n")


@pytest.mark.slow
def test_a_target_eval_loss_met_stops_every_process_after_the_same_step(tmp_path):
    """train.target_eval_loss is decided on each process from its own eval_loss, the same bits on
    each (gathered whole, summed in one order): both stop after the same evaluation, save at that
    step together and exit 0; one that went on alone would wait in the next step's collective."""
    run = tmp_path / "r"
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "1", "--", sys.executable, "-m", "nljax.train",
                        *ARGS, "cms.periods=[1,2]", "train.seq_len=16", "eval.every=5", "eval.stream_steps=0",
                        "train.steps=40", "train.target_eval_loss=4.3", *QUICK, f"run.dir={run}"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    stopped = re.search(r"eval_loss [\d.]+ is at or below train.target_eval_loss=4.3: the run stops after (\d+) of 40",
                        p.stdout)
    assert stopped, p.stdout
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [stopped[1]]
