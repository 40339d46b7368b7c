"""The command lines as a user runs them, in subprocesses (their own device counts)."""

import json
import os

import pytest
from helpers import QUICK, SMALL, cli, default_emitters, subprocess_env

from nljax.measure.traces import TRAIN_MODULE


def test_train_writes_run_dir_and_loss_falls(tmp_path):
    """A run's outputs: metrics, summary with the throughput table, plots, TensorBoard events, a
    profiler trace. A second, shorter run with the same seed and mesh under another
    PYTHONHASHSEED logs identical losses (eval included). The first dispatches each step ahead of
    the one before's result (train.dispatch_ahead=true, a GPU's default), the second does not (a
    CPU's): the same bits either way."""
    d = tmp_path / "run"
    common = ["--cpu-devices", "2", "--quiet", "optim.lr=0.01", *SMALL, "optim.schedule=constant", "eval.every=3"]
    cli("nljax.train", *common, f"run.dir={d}", "train.steps=30", "train.profile_steps=2", "train.profile_start=4",
        "throughput.split=true", "train.dispatch_ahead=true", env={"PYTHONHASHSEED": "1"})  # split: off by default
    recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(30))
    for key in ("loss", "active_levels", "step_time_s", "tokens_per_s_per_device"):
        assert key in recs[0]
    assert recs[0]["active_levels"] == [0, 1, 2] and recs[1]["active_levels"] == [0]
    assert sum(r["loss"] for r in recs[-5:]) / 5 < recs[0]["loss"] - 1.0
    summary = json.loads((d / "summary.json").read_text())
    assert summary["eval_bpb"] < 8 and summary["devices"] == 2
    tp = summary["throughput"]
    assert set(tp["per_pattern"]) == {"L0", "L0+1", "L0+1+2"}  # L0+1+2 timed although it fired in few steps
    assert tp["worst_pattern"] in tp["per_pattern"]
    for row in tp["per_pattern"].values():
        assert row["step_time_ms"] > 0 and row["compute_ms"] > 0 and row["flops_per_device_step"] > 0
        assert row["comm_ms"] == pytest.approx(max(row["step_time_ms"] - row["compute_ms"], 0), abs=1e-9)
    assert [tp["per_pattern"][k]["steps_in_run"] for k in ("L0", "L0+1", "L0+1+2")] == [15, 7, 8]
    assert tp["tokens_per_s_aggregate"] == pytest.approx(2 * tp["tokens_per_s_per_device_mean"])
    for f in ("loss.png", "step_time.png"):
        assert (d / f).read_bytes().startswith(b"\x89PNG")
    assert list(d.glob("events.out.tfevents.*")), "TensorBoard event file"
    comm = summary["communication"]
    assert set(comm["wire_bytes_per_pattern"]) == {"L0", "L0+1", "L0+1+2"}
    assert 0 < comm["mean_wire_bytes_per_step"] < comm["ddp_wire_bytes_per_step"]
    assert (d / "config.yaml").read_text().startswith("seed: 0")
    assert list((d / "profile").rglob("*.xplane.pb")), "profiler trace"
    prof = json.loads((d / "profile" / "summary.json").read_text())  # where the 2 steps' device time went
    assert prof["steps"] == 2 and prof["devices"] == 2 and prof["ops"] > 10 and 0 < prof["busy_fraction"] <= 1.05
    assert prof["module"] == TRAIN_MODULE  # evaluation (eval.every=3) between the steps not counted
    idle = prof["idle"]  # each profiled step marked: where its device waited
    # step 5 is dispatched ahead of step 4's result: on a loaded CPU (the host's own cores) step 4's
    # ops can all start after step 5's mark and count in its window (seen once in the fast tier)
    assert idle["steps"] in (1, 2)
    assert min(idle[k] for k in ("before_first_op_s", "between_ops_s", "after_last_op_s")) >= 0

    d2 = tmp_path / "rerun"
    cli("nljax.train", *common, f"run.dir={d2}", "train.steps=6", *QUICK, env={"PYTHONHASHSEED": "2"})
    again = [json.loads(l) for l in (d2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in recs[:6]]
    assert [r.get("eval_loss") for r in again[:5]] == [r.get("eval_loss") for r in recs[:5]]
    assert "eval_loss" in again[2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.stepz=3"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        (["mesh.inter=3"], "mesh.inter=3 does not divide the 4 available devices"),
        (["mesh.inter=2", "mesh.intra=4"], "mesh inter=2 x intra=4 = 8 devices, but 4 are available"),
        (["train.batch_size=6"], "train.batch_size=6 does not divide over 4 data-parallel devices"),
        (["--config", "/nonexistent.yaml"], "config file not found: /nonexistent.yaml"),
        (["--config", "/dev/null"], "config file /dev/null is not a regular file"),
        (["optim.lr=nan"], "config key 'optim.lr' must be a finite number, got nan"),
        (["model.dim=1000000000"], "the run needs at least"),  # from the config: never built
        (["train.seq_len=1048576", "train.batch_size=4096"], "the run needs at least"),  # TBs on any host
        (["data.eval_fraction=0.0001"], "the held-out text (1 bytes from data.eval_fraction=0.0001) is shorter than train.seq_len+1=129"),
        (["model.vocab_size=10"], "model.vocab_size=10 is smaller than the 256 byte values of the text data"),
        (["seed=18446744073709551616"], "seed must be in [0, 2^32), got 18446744073709551616"),  # no OverflowError
        (["model.window=8"], "model.window moved to model.nl_lm.window"),  # a key from before the split
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    p = cli("nljax.train", "--cpu-devices", "4", f"run.dir={tmp_path}/r", *args, check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nljax.train: error: {message}")
    assert not (tmp_path / "r").exists()


def test_existing_run_is_not_overwritten(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text("precious\n")
    p = cli("nljax.train", "--cpu-devices", "1", f"run.dir={d}", *SMALL, check=False)
    assert p.returncode == 2 and "already holds a run" in p.stderr
    assert (d / "metrics.jsonl").read_text() == "precious\n"


@pytest.mark.slow
def test_comm_cli_json():
    p = cli("nljax.comm", "--cpu-devices", "8", "--json", "mesh.inter=2", *SMALL)
    r = json.loads(p.stdout)
    assert r["mesh"] == {"inter": 2, "intra": 4, "model": 1}
    assert {v["active"] for v in r["variants"]} == {"L0", "L0+1", "L0+1+2"}
    l0 = next(v for v in r["variants"] if v["active"] == "L0")
    assert [(c["op"], c["axes"]) for c in l0["collectives"]] == [
        ("reduce-scatter", ["intra"]), ("all-reduce", ["inter"]), ("all-gather", ["intra"])]
    assert 0 < r["ratio_vs_ddp"] < 1
    text = cli("nljax.comm", "--cpu-devices", "8", "mesh.inter=2", *SMALL).stdout
    assert "ratio nljax / DDP" in text and "reduce-scatter" in text
    # each level's bytes with its thousands separated, the levels by semicolons (a list of commas misread)
    by_level = "; ".join(f"L{i} {b:,}" for i, b in enumerate(r["param_bytes_per_level"]))
    assert f"parameter bytes per level: {by_level}\n" in text, text


@pytest.mark.slow
def test_default_model_trains_end_to_end(tmp_path):
    """The nested-learning LM through the CLI on 2 devices: memory, eval in bits per byte."""
    d = tmp_path / "nl"
    cli("nljax.train", "--cpu-devices", "2", "--quiet", f"run.dir={d}", "train.steps=12", "train.batch_size=4",
        "train.seq_len=32", "model.dim=32", "model.depth=2", "model.nl_lm.memory_chunk=8", "model.nl_lm.window=8",
        "cms.periods=[1,4]", "eval.batches=1", "optim.lr=0.01", "optim.warmup_steps=0",
        *QUICK)  # the end-of-run report is tested above; here it would only add compilations of the big model
    recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["eval_bpb"] < 8


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_run_that_skips_every_step_stops(tmp_path):
    """max_skipped steps in a row skipped: one line, exit 2, the steps done are logged."""
    d = tmp_path / "r"
    p = cli("nljax.train", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={d}", "train.steps=10",
            "sync.max_grad_norm=1e-9", "train.max_skipped=3", "checkpoint.every=0", "eval.every=0", check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nljax.train: error: stopped after step 2: the last 3 steps"), p.stderr
    recs = [_strict(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2] and all(r["skipped"] for r in recs)
    assert not (d / "nljax.lock").exists()  # released on the way out


def test_a_run_that_reaches_its_target_eval_loss_stops_saved_and_its_resume_says_so(tmp_path):
    """train.target_eval_loss (MaxText's target_eval_loss): the first evaluation (every 5 steps)
    whose eval_loss is at or below it (here the one after 15 steps: 5.01, 4.48, 4.19) ends the
    run there: one line, the checkpoint at that step, the final report, exit 0. A --resume with
    the target trains no step: it evaluates the checkpoint first and says so; one with a lower
    target trains on, and stops at its next evaluation that meets it (4.04 after 20 steps),
    ending the profile window it stopped inside (its trace was left open)."""
    d = tmp_path / "r"
    run = lambda *a: cli("nljax.train", "--cpu-devices", "1", *SMALL, *QUICK, f"run.dir={d}", "train.steps=40",
                         "cms.periods=[1,2]", "eval.every=5", "eval.stream_steps=0", "optim.lr=0.01", *a)
    p = run("train.target_eval_loss=4.3")
    assert "step     14  eval_loss 4.1" in p.stdout and "is at or below train.target_eval_loss=4.3: the run stops " \
        "after 15 of 40 steps" in p.stdout, p.stdout
    steps = lambda: [json.loads(l)["step"] for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps() == list(range(15)) and sorted(c.name for c in (d / "checkpoints").iterdir()) == ["15"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["steps"] == 15 and summary["stopped_at_target_eval_loss"] == 4.3 and summary["eval_loss"] <= 4.3
    # its resume line turns the target off to train on (train.steps doubled, the target kept, stopped at once)
    assert f"--resume run.dir={d} train.target_eval_loss=0\n" in p.stdout, p.stdout
    assert sum(r["steps_in_run"] for r in summary["throughput"]["per_pattern"].values()) == 15
    p = run("--resume")
    assert "the checkpoint's eval_loss 4.1" in p.stdout and "is at or below train.target_eval_loss=4.3: no step " \
        "trained (set it lower, or 0, to train on to train.steps=40)" in p.stdout, p.stdout
    assert steps() == list(range(15)) and sorted(c.name for c in (d / "checkpoints").iterdir()) == ["15"]
    p = run("--resume", "train.target_eval_loss=4.1", "train.profile_start=18", "train.profile_steps=5")
    assert "the checkpoint's eval_loss 4.1" in p.stdout and "is above train.target_eval_loss=4.1: training on" \
        in p.stdout and "the run stops after 20 of 40 steps" in p.stdout, p.stdout
    assert steps() == list(range(20)) and (d / "checkpoints" / "20").is_dir()
    assert "profile: 2 of the train.profile_steps=5 steps from step 18 recorded: the run ends at step 19" in p.stdout
    assert f"profile: the trace in {d / 'profile'} (TensorBoard's profile tab" in p.stdout, p.stdout
    assert list((d / "profile").rglob("*.trace.json.gz")), "the Perfetto file the line names"
    assert json.loads((d / "profile" / "summary.json").read_text())


def test_a_step_where_no_level_fires_is_not_a_skipped_step():
    """Level 0 with a period above 1 leaves steps where nothing is active: nothing could be
    skipped there (a run with cms.periods=[25, 50] stopped at step 20, "all skipped")."""
    from nljax.run.trainer import resumed, stalled

    stalled_in_a_row = lambda kept: resumed(kept, "tokens_per_s_per_device").stalled_in_a_row

    fired = lambda *skipped: {"active_levels": [0, 1], "skipped_levels": list(skipped)}
    idle = {"active_levels": [], "skipped_levels": []}
    assert stalled(idle) is None and stalled(fired()) is False and stalled(fired(0, 1)) is True
    assert stalled_in_a_row([fired(), *[idle] * 30]) == 0
    assert stalled_in_a_row([fired(), fired(0, 1), idle, fired(0, 1), idle]) == 2


def test_metrics_and_summary_are_strict_json(tmp_path, capsys):
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir, kept_records

    run_dir = RunDir(str(tmp_path), overwrite=False, write=True)
    run_dir.log({"step": 0, "loss": float("nan"), "x": [float("inf"), 1.0]})
    run_dir.save_summary({"final_loss": float("-inf"), "nested": {"a": float("nan")}})
    rec = _strict((tmp_path / "metrics.jsonl").read_text())
    assert rec == {"step": 0, "loss": None, "x": [None, 1.0]}
    assert _strict((tmp_path / "summary.json").read_text()) == {"final_loss": None, "nested": {"a": None}}
    kept = list(kept_records(tmp_path / "metrics.jsonl", 1))  # a resumed run reads null back as NaN
    assert kept[0]["loss"] != kept[0]["loss"]
    assert runlog.strict_json({"a": 1.5}) == '{"a": 1.5}'
    with open(tmp_path / "metrics.jsonl", "a") as f:  # an edited line, then one cut short by a kill
        f.write('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    assert [r["step"] for r in kept_records(tmp_path / "metrics.jsonl", 9)] == [0, 1, 2]
    assert capsys.readouterr().err == (f"nljax: warning: {tmp_path / 'metrics.jsonl'}: lines 3, 5 not a record (cut "
                                       "short by a kill?): dropped from the resumed log\n")




def test_the_target_and_the_skipped_steps_limit_at_their_edges():
    """train.target_eval_loss is met at or below it, never by a step without an evaluation nor
    when 0; train.max_skipped stops the run at that many stalled steps in a row, never when 0; a
    step where one active level of two trained is no stalled step."""
    from nljax.config import ConfigError
    from nljax.run.trainer import check_skipped, meets_target, stalled

    assert meets_target({"eval_loss": 2.0}, 2.0) and meets_target({"eval_loss": 1.5}, 2.0)
    assert not meets_target({"eval_loss": 2.5}, 2.0) and not meets_target({}, 2.0)
    assert not meets_target({"eval_loss": 2.0}, 0.0)
    check_skipped(2, 9, 3)
    check_skipped(500, 9, 0)
    with pytest.raises(ConfigError, match="stopped after step 9: the last 3 steps were all skipped"):
        check_skipped(3, 9, 3)
    assert stalled({"active_levels": [0, 1], "skipped_levels": [1]}) is False


def test_a_resumed_run_dir_keeps_the_steps_before_its_checkpoint(tmp_path, capsys):
    """A resume of a run.dir that holds a run (its metrics.jsonl, no list of the names it wrote:
    an older run's) is taken, not refused: its log keeps the records of the steps before the
    step resumed (cut back when the log begins), blank lines passed over without a warning; an
    evaluation is known after the steps it followed, from a kept record or an earlier attempt's
    summary.json."""
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    records = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.5, "eval_loss": 2.7}, {"step": 2, "loss": 2.0},
               {"step": 3, "loss": 1.5, "eval_loss": 1.7}, {"step": 4, "loss": 1.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in records))
    (tmp_path / "loss.png").write_bytes(b"an earlier attempt's")
    assert not (tmp_path / runlog.WRITTEN).exists()
    written = (tmp_path / "metrics.jsonl").read_bytes()
    run_dir = RunDir(str(tmp_path), overwrite=False, write=True, resume_step=4)
    assert list(run_dir.kept()) == records[:4] and capsys.readouterr().err == ""
    assert (tmp_path / "loss.png").exists()
    assert run_dir.evaluated_at(4)  # after step 3's evaluation
    assert (tmp_path / "metrics.jsonl").read_bytes() == written  # cut only when the log begins
    run_dir.begin_log()
    assert [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records[:4]
    assert list(run_dir.kept()) == records[:4]
    run_dir = RunDir(str(tmp_path), overwrite=False, write=True, resume_step=3)
    assert not run_dir.evaluated_at(3)  # none after step 2
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3, "eval_loss": 1.9}))
    assert run_dir.evaluated_at(3) and not run_dir.evaluated_at(4)


def test_an_overwrite_that_saves_no_checkpoints_still_holds_its_checkpoint_dir(tmp_path):
    """run.overwrite=true with checkpoint.every=0 removes the earlier run's checkpoints from a
    checkpoint.dir outside run.dir: it is that run's while it runs, and a second run using it
    is refused."""
    from nljax import config
    from nljax.runtime.rundir import check_free, take_lock

    ck = tmp_path / "ck"
    first = config.load(None, [f"run.dir={tmp_path / 'a'}", f"checkpoint.dir={ck}", "checkpoint.every=0",
                               "run.overwrite=true"])
    second = config.load(None, [f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    lock = take_lock(first)
    try:
        with pytest.raises(config.ConfigError, match=f"checkpoint.dir {ck} is in use by a live run"):
            check_free(second)
    finally:
        lock.release()


def test_a_live_run_in_run_dir_refuses_another(tmp_path):
    """The lock names the live holder (here: this test process), also to a --resume; nothing in
    run.dir changes."""
    import socket

    d = tmp_path / "r"
    d.mkdir()
    lock = d / "nljax.lock"
    held = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"})
    lock.write_text(held)
    for resume in ([], ["--resume"]):  # --resume too, though the live run has saved no checkpoint yet
        p = cli("nljax.train", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={d}", "train.steps=2",
                *resume, check=False)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is in use by a live run (host {socket.gethostname()}, pid {os.getpid()}" in lines[0]
    assert lock.read_text() == held and not [q for q in d.rglob("*") if q.is_file() and q != lock]
    from nljax import config
    from nljax.runtime import runlock

    lock.write_text("{not json")  # a lock being written, or damaged: named as such, not as a run of host '?'
    with pytest.raises(config.ConfigError, match=f"has a lock file {lock} that cannot be read, written less than 5 "
                                                 "minutes ago: a run may be starting there; if none is, remove"):
        runlock.refuse_if_live(d)


@pytest.mark.slow
def test_compile_cache_makes_the_second_start_faster(tmp_path):
    """A resumed run loads its step variants from run.compile_cache instead of compiling them
    again: nothing new is written there, and the reported compile times drop (another train.steps
    loads them too: tests/test_first_hour.py)."""
    d, cache = tmp_path / "run", tmp_path / "cache"
    common = ["--cpu-devices", "2", *SMALL, *QUICK, f"run.dir={d}", f"run.compile_cache={cache}", "checkpoint.every=4",
              "eval.every=0", "train.steps=8"]
    times = lambda p: [float(l.split(" in ")[-1].split()[0]) for l in p.stdout.splitlines()
                       if l.startswith(("compiled step variant", "loaded step variant"))]
    # Every program is cached, however fast it compiled: with JAX's default 1 s floor, a program
    # compiled just under it in the first run and just over it (on a loaded machine) in the
    # second would be written then, and look like a step variant compiled again.
    env = default_emitters(subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))  # a user's compile times
    first = times(cli("nljax.train", *common, env=env))
    entries = set(os.listdir(cache))
    second = times(cli("nljax.train", *common, f"checkpoint.resume={d}/checkpoints/4", env=env))
    assert len(first) == len(second) == 3 and entries  # L0+1+2, L0, L0+1 in either run
    new = set(os.listdir(cache)) - entries  # the restore's own small programs may be new, no step is
    assert not [e for e in new if e.startswith(TRAIN_MODULE)], new
    assert sum(second) < 0.7 * sum(first), (first, second)


def test_python_m_nljax_lists_the_commands_and_runs_one():
    """`python -m nljax` (it was "No module named nljax.__main__") lists every command with one
    line and the version; `python -m nljax COMMAND ...` is `python -m nljax.COMMAND ...`, its
    output and exit code; an unknown command is one line with the nearest name, exit 2."""
    from nljax import __version__
    from nljax.refdoc import COMMANDS

    p = cli("nljax")
    listed = [l.split()[0] for l in p.stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert listed == list(COMMANDS) and f"nljax {__version__}" in p.stdout
    assert cli("nljax", "--version").stdout == f"nljax {__version__}\n"
    for name in COMMANDS:  # each names a command module with a main
        assert callable(__import__(f"nljax.{name}", fromlist=["main"]).main)
    args = ["--print-config", "train.steps=3"]
    assert cli("nljax", "train", *args).stdout == cli("nljax.train", *args).stdout
    bad, direct = cli("nljax", "train", "--bad", check=False), cli("nljax.train", "--bad", check=False)
    assert (bad.returncode, bad.stderr) == (direct.returncode, direct.stderr) == (2, direct.stderr), bad.stderr
    p = cli("nljax", "trian", check=False)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "nljax: error: unknown command 'trian' (did you mean train?); the commands: " + ", ".join(COMMANDS)]


# A command run as a program whose teardown is slow (as JAX's clean-up at exit is), past its line
SLOW_TEARDOWN = r"""
import atexit, runpy, sys, time
atexit.register(time.sleep, 30)
sys.argv = ["nljax.evaluate", "run.dir=nowhere"]
runpy.run_module("nljax.evaluate", run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_commands_last_line_ends_it_with_its_code(tmp_path, sig):
    """Ctrl-C (or SIGTERM) again while the interpreter tears down, the command's outcome said: its
    exit code at once, nothing more printed. A second Ctrl-C after a run's `interrupted (Ctrl-C):
    ... checkpoint saved` printed a KeyboardInterrupt traceback from JAX's atexit callback; a
    second SIGTERM ended the process by the signal."""
    import signal
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-c", SLOW_TEARDOWN], cwd=tmp_path, env=subprocess_env(),
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        time.sleep(0.3)
        p.send_signal(getattr(signal, sig))
        rest = p.stderr.read()
        code = p.wait(timeout=20)
    finally:
        p.kill()
    assert line.startswith("nljax.evaluate: error: ") and "config.yaml not found" in line, line
    assert (code, rest) == (2, ""), (code, rest)
