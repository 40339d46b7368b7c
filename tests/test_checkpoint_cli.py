"""Checkpoints through the command line: `nljax.train` killed (SIGKILL, SIGTERM) at any moment
and resumed exactly, damaged checkpoints skipped or refused in one line, a full disk, and
folders in checkpoint.dir that nljax did not write. Each test runs its own subprocesses."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FULL, QUICK, SMALL, cli, data_files, run_python, subprocess_env, tree_hash, truncate

from nljax.checkpoint import storage

# ---------------------------------------------------------------------------------------------
# The command line, killed with SIGKILL or told to stop with SIGTERM

# 12 steps, a checkpoint every 4, the newest 2 kept
SAVING = [*SMALL, "cms.periods=[1,2]", "eval.every=0", "train.steps=12", "checkpoint.every=4", "checkpoint.keep=2"]

# Runs nljax.train and SIGKILLs itself: `save N` inside the save of step N, after every array is
# written and before Orbax commits it; `step N` once step N-1 is logged and checkpoint N-2 is
# complete; `kill N` once step N-1 is logged. `term N` sends itself SIGTERM instead, `int N`
# SIGINT (Ctrl-C), `int2 N` two of them. `boot 0` and `report 0` send SIGTERM as the start-up
# report, and as the final report, begin; `report-int 0` SIGINT as the final report begins. `aside 0` SIGKILLs itself as a resume of an older
# checkpoint begins to set the later ones aside.
KILLER = r"""
import os, signal, sys, time
from pathlib import Path
mode, at, ckdir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
sys.argv = ["nljax.train", *sys.argv[4:]]
if mode == "save":
    from orbax.checkpoint._src.path import atomicity
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        def patch(orig):
            async def finalize(self, *a, **k):
                if Path(self.get_final()).name == str(at):
                    os.kill(os.getpid(), signal.SIGKILL)
                return await orig(self, *a, **k)
            return finalize
        cls.finalize = patch(cls.finalize)
elif mode == "aside":
    from nljax.checkpoint import storage
    storage.set_aside = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
elif mode in ("boot", "report", "report-int"):
    from nljax.run import trainer
    name = "startup_report" if mode == "boot" else "final_report"
    orig = getattr(trainer, name)
    def noticed(*a, **k):
        os.kill(os.getpid(), signal.SIGINT if mode == "report-int" else signal.SIGTERM)
        return orig(*a, **k)
    setattr(trainer, name, noticed)
elif mode == "compile-int":  # Ctrl-C as the step loop compiles its first step (at once: no step done)
    from nljax.engine import executables
    orig = executables.compile_step
    def compiling(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return orig(*a, **k)
    executables.compile_step = compiling
else:
    from nljax.runtime import rundir
    log = rundir.RunDir.log
    def killing_log(self, record):
        log(self, record)
        if record["step"] == at - 1:  # steps 0 .. at-1 are logged; step `at` never runs
            if mode in ("term", "int", "int2"):  # a preemption notice, Ctrl-C (twice): the run saves
                for _ in range(2 if mode == "int2" else 1):  # checkpoint `at` and exits (not twice)
                    os.kill(os.getpid(), signal.SIGINT if mode.startswith("int") else signal.SIGTERM)
                return
            t = time.time()
            while mode == "step" and not (ckdir / str(at - 2)).is_dir() and time.time() - t < 60:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)  # mode "kill": wherever the saves in flight are
    rundir.RunDir.log = killing_log
from nljax.train import main
sys.exit(main())
"""


def nljax_train(*args, killer=None):
    """`python -m nljax.train *args`, or through KILLER: `killer` = [mode, step, checkpoint dir]."""
    if killer:
        return run_python("-c", KILLER, *killer, *args, check=False)
    return cli("nljax.train", *args, check=False)


def losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_during_a_save_and_during_training_then_resume(tmp_path):
    """Killed while committing checkpoint 8 (4 is complete), resumed from 4, killed again at step
    10 (8 complete), resumed from 8. Each resumed run logs the losses the run before it logged
    for the same steps, bitwise, and the final metrics.jsonl has every step once."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "2", "--quiet", *SAVING, f"run.dir={run}"]
    p = nljax_train(*base, killer=["save", "8", str(ck)])
    assert p.returncode == -9, p.stderr
    assert (ck / "4").is_dir() and not (ck / "8").exists()
    assert any(q.name.startswith("8.") for q in ck.iterdir())  # the partial save is left behind
    first = losses(run)  # steps 0..7 at least, uninterrupted
    p = nljax_train("--resume", *base, killer=["step", "10", str(ck)])
    assert p.returncode == -9, p.stderr
    assert sorted(int(q.name) for q in ck.iterdir() if q.name.isdigit()) == [4, 8]
    second = losses(run)  # 0..3 from the first run, 4..9 resumed from 4
    assert len(second) == 10 and second[:8] == first[:8]
    p = nljax_train("--resume", *base[:2], *base[3:])
    assert p.returncode == 0, p.stderr
    assert f"resumed from {ck / '8'} at step 8" in p.stdout
    steps_logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(12)) and losses(run)[:10] == second
    assert sorted(q.name for q in ck.iterdir()) == ["12", "8"]  # checkpoint.keep=2
    truncate(ck / "12")  # a damaged array file, named: one line on the real stderr, nothing changed
    before = tree_hash(run)
    p = nljax_train(*base, f"checkpoint.resume={ck / '12'}")
    assert p.returncode == 2 and p.stderr.strip().startswith(f"nljax.train: error: checkpoint {ck / '12'}: array data")
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert tree_hash(run) == before


@pytest.mark.slow
def test_ctrl_c_in_the_final_report_says_the_training_is_saved(tmp_path):
    """Ctrl-C in the final report (its evaluation: seconds to minutes on a large held-out set),
    after the final checkpoint is saved, said only "interrupted (Ctrl-C)": the line says the
    training is kept and how to get the report, exit 130; that --resume trains nothing."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    p = nljax_train(*base, killer=["report-int", "0", str(ck)])
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip().splitlines() == [
        "nljax.train: interrupted (Ctrl-C) in the final report, after the last step: the final checkpoint (12) is "
        "saved; --resume writes the report and summary.json, evaluating it again"]
    assert "12" in [q.name for q in ck.iterdir()] and not (run / "summary.json").exists()
    p = nljax_train("--resume", *base)
    assert p.returncode == 0 and json.loads((run / "summary.json").read_text())["steps"] == 12, p.stderr


@pytest.mark.slow
def test_notice_outside_the_step_loop(tmp_path):
    """One process takes SIGTERM as a notice over the whole run, not only while it steps: during
    start-up (before compilation) the run says so at once, then stops after its first step, saved,
    with one line more and 143; after the last step the final report finishes (summary.json, exit 0). Before, both
    killed the process (-15), the lock left behind and no summary written."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    p = nljax_train(*base, killer=["boot", "0", str(ck)])
    assert p.returncode == 143, p.stderr
    assert p.stderr.strip().splitlines() == [
        "nljax: SIGTERM during start-up: the run stops after its first step, saved (SIGTERM again: at once)",
        "nljax.train: preempted (SIGTERM): stopped after step 0, checkpoint saved; continue with --resume"]
    assert sorted(q.name for q in ck.iterdir()) == ["1"] and not (run / "nljax.lock").exists()
    p = nljax_train("--resume", *base, killer=["report", "0", str(ck)])
    assert p.returncode == 0, p.stderr
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 1
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))


def test_a_second_sigterm_stops_at_once():
    """After a notice, a second SIGTERM raises `Terminated` (143) wherever the run is, unless it
    comes within `Notice.REPEAT_S` (the same notice, sent to the job and forwarded by a launcher);
    Ctrl-C outside the step loop stops at once, inside it is a notice. The signals are read by a
    thread: each takes effect within moments, not within the `os.kill` call."""
    import signal
    import time

    from nljax.runtime.preemption import Notice, Terminated

    def soon(cond):
        deadline = time.monotonic() + 5
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        return cond()

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with Notice() as notice:
        os.kill(os.getpid(), signal.SIGTERM)
        assert soon(lambda: notice.received == signal.SIGTERM) and notice.stop_after(0)
        os.kill(os.getpid(), signal.SIGTERM)  # at once: the same notice
        time.sleep(0.3)
        assert notice.stop_after(0)
        notice.received_at -= Notice.REPEAT_S  # as if that much later
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises inside it
        assert e.value.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    with Notice() as notice:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        notice.in_loop = True
        os.kill(os.getpid(), signal.SIGINT)
        assert soon(lambda: notice.received == signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before



def test_a_second_ctrl_c_in_the_loop_and_other_signals():
    """Inside the step loop a Ctrl-C after a notice (Ctrl-C's or SIGTERM's) stops at once; a signal
    that is neither (SIGUSR1 with a handler of its own, which the wakeup fd reports too) is no
    notice; on the way out the wakeup fd there was before is put back."""
    import signal
    import time

    from nljax.runtime.preemption import Notice

    def soon(cond):
        deadline = time.monotonic() + 5
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        return cond()

    for first in (signal.SIGINT, signal.SIGTERM):
        with Notice() as notice:
            notice.in_loop = True
            os.kill(os.getpid(), first)
            assert soon(lambda: notice.received == first)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
    r, w = os.pipe()
    os.set_blocking(w, False)
    before_fd = signal.set_wakeup_fd(w)
    before = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        with Notice() as notice:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)  # past Notice.GRACE_S: the reader has read it
            assert notice.received == 0 and not notice.stop_after(0)
        assert signal.set_wakeup_fd(w) == w
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.set_wakeup_fd(before_fd)
        os.close(r)
        os.close(w)


def test_stop_messages_name_the_signal_and_what_was_saved():
    """The stop lines and exit codes: Ctrl-C (130) and SIGTERM (143) named as such, a run that saves
    nothing (checkpoint.every=0) not told to --resume."""
    import signal

    from nljax.runtime.preemption import Preempted, Unreported

    term, ctrl_c = Preempted(7), Preempted(7, signal.SIGINT, saved=False)
    assert str(term).startswith("preempted (SIGTERM): stopped after step 7") and "--resume" in str(term)
    assert term.exit_code == 143
    assert str(ctrl_c).startswith("interrupted (Ctrl-C): stopped after step 7") and "--resume" not in str(ctrl_c)
    assert "nothing saved" in str(ctrl_c) and ctrl_c.exit_code == 130
    assert "(7) is saved" in str(Unreported(7, True)) and "no checkpoint saved" in str(Unreported(7, False))
    assert Unreported(7, True).exit_code == 130


def test_the_line_names_only_nljaxs_own_commands(monkeypatch):
    """The reader's own line is `nljax.train: ...` under `python -m nljax.train`, and `nljax: ...`
    under a module of another package whose name merely starts with nljax."""
    import importlib.machinery
    import types

    from nljax.runtime import preemption

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    for name, prog in (("nljax.train", "nljax.train"), ("nljax_sweeps.run", "nljax"), ("nljaxtools", "nljax")):
        main.__spec__ = importlib.machinery.ModuleSpec(name, None)
        assert preemption._prog() == prog
    main.__spec__ = None  # python -c, a script
    assert preemption._prog() == "nljax"


RESENT_THEN_AGAIN = r"""
import hashlib, os, signal, threading, time
from nljax.runtime.preemption import Notice
Notice.STUCK_S = 60  # the reader waits for the C call to return, however slow the machine
with Notice() as notice:
    for i in range(2):
        try:
            if i == 0:  # in a C call past GRACE_S: the reader decides, and re-sends SIGINT to the main thread
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
                hashlib.pbkdf2_hmac("sha256", b"x", b"y", 1_500_000)
            else:  # a sleep: the main thread's handler takes it
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(3)
            print("missed", flush=True)
        except KeyboardInterrupt:
            print("stopped", flush=True)
"""


def test_a_signal_after_one_the_reader_re_sent_still_counts():
    """The reader re-sends a decision to the main thread as the signal itself, and passes over
    those re-sent ones when they come back: only those. A Ctrl-C after one taken in a C call still
    stops at once."""
    p = subprocess.run([sys.executable, "-c", RESENT_THEN_AGAIN], capture_output=True, text=True,
                       env=subprocess_env(), timeout=60)
    assert (p.returncode, p.stdout) == (0, "stopped\nstopped\n"), p.stderr


IN_A_LONG_C_CALL = r"""
import hashlib, sys
from nljax.runtime.preemption import Notice
with Notice():
    print("ready", flush=True)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 200_000_000)  # minutes in C, as an XLA compilation is
print("returned", flush=True)
"""


IN_A_NOTEBOOKS_C_CALL = r"""
import hashlib, sys, time, types
sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: object())  # as in a Jupyter kernel
from nljax.runtime.preemption import Notice
Notice.STUCK_S = 0.2
try:
    with Notice():
        print("ready", flush=True)
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 4_000_000)  # seconds in C, as an XLA compilation is
        print("missed", flush=True)
except KeyboardInterrupt:
    print("stopped when the call returned", flush=True)
"""


def ctrl_c_inside(code: str, after_s: float, timeout: float):
    """(the process, its stdout, its stderr) of `python -c code` sent a Ctrl-C `after_s` seconds
    after it printed "ready" (inside its long C call)."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=subprocess_env())
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(after_s)  # inside the call
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return p, out, err


def test_ctrl_c_in_a_notebook_does_not_end_its_kernel_inside_a_compilation():
    """A notebook's interrupt (Ctrl-C) while `nljax.train.main` compiles: the reader thread ended
    the process (os._exit), so the notebook's kernel died with everything it held. In a session
    the user types into, the Ctrl-C is said at once and raised when the call returns."""
    p, out, err = ctrl_c_inside(IN_A_NOTEBOOKS_C_CALL, 0.3, 60)
    assert (p.returncode, out) == (0, "stopped when the call returned\n"), err
    assert err.strip().splitlines() == ["nljax: Ctrl-C: stopping when the compilation in progress returns (it cannot "
                                        "be interrupted)"]


@pytest.mark.parametrize("signals, code, line", [
    (["SIGINT"], 130, "nljax: interrupted (Ctrl-C) (inside a compilation, which was not waited for)"),
    (["SIGTERM", "SIGTERM"], 143, "nljax: terminated (a second SIGTERM): stopped at once; the checkpoints already "
     "on disk are kept (inside a compilation, which was not waited for)"),
])
def test_stopping_at_once_does_not_wait_for_a_compilation(signals, code, line):
    """Ctrl-C outside the step loop, or a second SIGTERM, while the main thread is inside a long C
    call (Python runs its handlers only between bytecodes): the process ends within seconds, with
    the line and the exit code it would have given, and the first SIGTERM's notice is said at once."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", IN_A_LONG_C_CALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=subprocess_env())
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(0.5)  # inside the call
        t0 = time.monotonic()
        for i, name in enumerate(signals):
            if i:
                time.sleep(2.5)  # past Notice.REPEAT_S: not the same notice again
            p.send_signal(getattr(signal, name))
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == code, err
    assert time.monotonic() - t0 < 2.5 * (len(signals) - 1) + 10  # not the call's minutes
    assert err.strip().splitlines()[-1] == line and "returned" not in out
    if len(signals) == 2:
        assert err.strip().splitlines()[0].startswith("nljax: SIGTERM during start-up")


DECIDED_AFTER_THE_NOTICE_CLOSED = r"""
import hashlib, os, signal, threading, time
from nljax.runtime.preemption import Notice
gate = threading.Event()
Notice.STUCK_S = STUCK_S
late = getattr(Notice, LATE)
def late_call(self, *args):  # the reader thread's decision, or its handing over, comes after the Notice has closed
    if threading.current_thread() is not threading.main_thread():
        gate.wait()
    return late(self, *args)
setattr(Notice, LATE, late_call)
with Notice() as notice:
    notice.received, notice.received_at = signal.SIGTERM, time.monotonic() - 10  # a notice long ago
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 1_500_000)  # in a C call past GRACE_S: the reader takes it
gate.set()
time.sleep(1.5)  # Notice.STUCK_S and more
print("alive", flush=True)
"""


@pytest.mark.parametrize("late, stuck_s", [("_take", 1.0), pytest.param("_hand_over", 1.0, marks=pytest.mark.slow),
                                            pytest.param("_hand_over", 0.0, marks=pytest.mark.slow)])
def test_the_reader_sends_nothing_once_the_notice_has_closed(late, stuck_s):
    """A signal the reader thread took as the run ended is decided (`_take`), or handed over
    (`_hand_over`: decided just before), after `__exit__` restored the handlers: it must not
    re-send it to the main thread (SIGTERM's default handler would kill the process) nor end the
    process itself (STUCK_S 0: the reader's wait for the main thread over at once)."""
    script = f"LATE, STUCK_S = {late!r}, {stuck_s}\n" + DECIDED_AFTER_THE_NOTICE_CLOSED
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert p.returncode == 0 and p.stdout == "alive\n", (p.returncode, p.stderr)


STANDARD_ERROR_GONE = r"""
import hashlib, os, signal, threading
from nljax.runtime.preemption import Notice
os.dup2(os.open(os.devnull, os.O_RDONLY), 2)  # a standard error that cannot be written (EBADF)
with Notice() as notice:
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 1_500_000)  # in a C call: the reader takes it, says the notice
    print("noticed" if notice.received else "missed", flush=True)
    notice.received_at -= Notice.REPEAT_S  # as if that much later
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 30_000_000)  # seconds in a C call: the reader ends the process
print("returned", flush=True)
"""


def test_signals_still_count_when_standard_error_is_gone():
    """The notice's line cannot be written (a closed terminal, a `| tee` that the same Ctrl-C
    ended): the notice still counts and the reader thread lives on, so a second SIGTERM inside a
    C call still ends the process at once (143). The failed write had ended the reader, closing
    its socket: every later signal was lost and the run could not be stopped but by SIGKILL."""
    p = subprocess.run([sys.executable, "-c", STANDARD_ERROR_GONE], capture_output=True, text=True,
                       env=subprocess_env(), timeout=60)
    assert (p.returncode, p.stdout) == (143, "noticed\n")


def test_stopping_at_once_inside_a_c_call_says_the_commands_own_line():
    """`python -m nljax.train` says `nljax.train: terminated ...` when it stops (nljax.cli); the
    reader's line, when the main thread is inside a C call, is that line too, not `nljax: ...`."""
    as_train = IN_A_LONG_C_CALL.replace(
        "import hashlib, sys", "import hashlib, importlib.util, sys\n"
        "sys.modules['__main__'].__spec__ = importlib.util.find_spec('nljax.train')  # as python -m nljax.train")
    p, out, err = ctrl_c_inside(as_train, 0.5, 30)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == \
        "nljax.train: interrupted (Ctrl-C) (inside a compilation, which was not waited for)"


def noticed(stderr: str, at: int) -> int:
    """The step a run noticed a SIGTERM sent once step `at` - 1 was logged stopped after, from its
    one line: `at` - 1, or `at` where that step was already dispatched (train.dispatch_ahead)."""
    *_, line = stderr.strip().splitlines()
    m = re.fullmatch(r"nljax\.train: preempted \(SIGTERM\): stopped after step (\d+), checkpoint saved; "
                     r"continue with --resume", line)
    assert m and int(m[1]) in (at - 1, at), stderr
    return int(m[1])


@pytest.mark.slow
def test_preemption_and_kills_at_random_steps_resume_exactly(tmp_path):
    """Fault injection: SIGTERM (a preemption notice), SIGKILL, SIGTERM at seeded random steps,
    each followed by --resume. A notice saves at the next step boundary and exits 143 with one
    line; a kill loses what is not yet committed. The final metrics.jsonl equals an uninterrupted
    run's: the same steps once each, the same losses bitwise."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    ck = run / "checkpoints"
    assert nljax_train("--cpu-devices", "2", "--quiet", *SAVING, f"run.dir={ref}").returncode == 0
    # dispatched ahead (train.dispatch_ahead's auto: on a GPU, not on a CPU), as a GPU run would
    base = ["--cpu-devices", "2", "--quiet", *SAVING, "train.dispatch_ahead=true", f"run.dir={run}"]
    rng = random.Random(1)
    t1 = rng.randint(1, 5)
    t2 = rng.randint(t1 + 2, 9)
    t3 = rng.randint(t2 + 1, 11)
    p = nljax_train(*base, killer=["term", str(t1), str(ck)])
    assert p.returncode == 143, p.stderr
    assert (ck / str(noticed(p.stderr, t1) + 1)).is_dir()
    p = nljax_train("--resume", *base, killer=["kill", str(t2), str(ck)])
    assert p.returncode == -9, p.stderr
    p = nljax_train("--resume", *base, killer=["term", str(t3), str(ck)])
    assert p.returncode == 143 and (ck / str(noticed(p.stderr, t3) + 1)).is_dir(), p.stderr
    p = nljax_train("--resume", *base)
    assert p.returncode == 0, p.stderr
    steps_logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(12)), (t1, t2, t3)
    assert losses(run) == losses(ref), (t1, t2, t3)


def test_ctrl_c_saves_the_step_and_a_second_one_stops_at_once(tmp_path):
    """One Ctrl-C at a terminal: the step finishes, is saved, one line, exit 130; --resume goes on.
    Two: the run stops at once, unsaved, in one line (no traceback)."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    # Ctrl-C once step 2 is logged: dispatched ahead (auto: not on a CPU), step 3 runs already
    p = nljax_train(*base, "train.dispatch_ahead=true", killer=["int", "3", str(ck)])
    assert p.returncode == 130 and p.stderr.strip().splitlines() == [
        "nljax: Ctrl-C: stopping after this step (Ctrl-C again: at once, unsaved)",
        "nljax.train: interrupted (Ctrl-C): stopped after step 3, checkpoint saved; continue with --resume"], p.stderr
    assert (ck / "4").is_dir()
    p = nljax_train("--resume", *base, killer=["int2", "6", str(ck)])
    assert p.returncode == 130 and p.stderr.strip().splitlines()[-1] == "nljax.train: interrupted (Ctrl-C)", p.stderr
    assert "Traceback" not in p.stderr and not (ck / "6").exists()
    p = nljax_train("--resume", *base)
    assert p.returncode == 0 and json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 11, p.stderr
    # train.dispatch_ahead=auto, off on a CPU: each step read before the next is dispatched, so
    # step 3 has not begun
    p = nljax_train(*base, f"run.dir={tmp_path / 'unsaved'}", "checkpoint.every=0", killer=["int", "3", str(ck)])
    assert p.returncode == 130 and p.stderr.strip().splitlines()[-1] == \
        "nljax.train: interrupted (Ctrl-C): stopped after step 2, nothing saved (checkpoint.every=0)", p.stderr
    # Ctrl-C while the loop compiles its first step (a minute on a CPU, several on a GPU): no step
    # of this process is done, nothing to save, so it stops at once (it waited for the compilation
    # and the step, then saved that step)
    fresh = tmp_path / "fresh"
    p = nljax_train(*base, f"run.dir={fresh}", killer=["compile-int", "0", str(ck)])
    assert p.returncode == 130 and p.stderr.strip().splitlines() == ["nljax.train: interrupted (Ctrl-C)"], p.stderr
    assert not (fresh / "checkpoints").exists() or not storage.complete_steps(fresh / "checkpoints")


# ---------------------------------------------------------------------------------------------
# Folders nljax did not write


@pytest.mark.slow
def test_pruning_and_resume_skip_folders_nljax_did_not_write(tmp_path):
    """checkpoint.keep prunes only nljax's own steps, and --resume never picks a user's folder
    with a number for a name (Orbax's max_to_keep deleted them; '7' became 'latest')."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for name in ("0", "7"):
        (ck / name).mkdir(parents=True)
        (ck / name / "notes").write_text("mine")
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}", "checkpoint.every=2",
            "checkpoint.keep=1", "checkpoint.async_save=false"]
    p = nljax_train(*base, "train.steps=4")
    assert p.returncode == 0, p.stderr
    assert sorted(q.name for q in ck.iterdir()) == ["0", "4", "7"]
    assert storage.complete_steps(ck) == [4]
    p = nljax_train("--resume", *base[:2], *base[3:], "train.steps=6")
    assert p.returncode == 0, p.stderr
    assert f"resumed from {ck / '4'} at step 4" in p.stdout
    assert sorted(q.name for q in ck.iterdir()) == ["0", "6", "7"]
    assert (ck / "0" / "notes").read_text() == (ck / "7" / "notes").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# A damaged newest checkpoint, an older one named, a full disk


def test_resume_falls_back_past_damaged_checkpoints_and_sets_later_ones_aside(tmp_path):
    """`--resume` with the two newest checkpoints damaged resumes from the newest intact one, with
    a warning naming each damaged one (and no report of Orbax's failed reads: they once printed
    thousands of tracebacks), which are moved to checkpoints/set_aside/ (not deleted). An older
    checkpoint named explicitly is resumed too: the later ones are set aside the same way."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}", "checkpoint.keep=3"]
    p = nljax_train(*base)
    assert p.returncode == 0, p.stderr
    assert storage.complete_steps(ck) == [4, 8, 12]
    for s in (8, 12):  # the largest data file cut to 1 kB: most arrays unreadable
        f = max(data_files(ck / str(s)), key=lambda f: f.stat().st_size)
        f.write_bytes(f.read_bytes()[:1000])
    damaged = tree_hash(ck / "12")
    p = nljax_train("--resume", *base)
    assert p.returncode == 0, p.stderr
    for s in (12, 8):  # the step and the kind of damage, then Orbax's words cut short (300 characters once)
        line = next(w for w in p.stderr.splitlines() if w.startswith(f"nljax: warning: checkpoint {ck / str(s)} "))
        said, orbax = line.split(" -- ")
        assert said == (f"nljax: warning: checkpoint {ck / str(s)} (step {s}) is damaged: array data unreadable; "
                        "resuming from an older one") and 10 < len(orbax) <= 120, line
    assert "TensorStore details" not in p.stderr  # the spec Orbax appends to its error is cut
    assert f"steps 8, 12 will be moved to {ck / 'set_aside'}" in p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 3, p.stderr  # two damaged, one set-aside line
    assert tree_hash(ck / "set_aside" / "12") == damaged  # kept as it was
    assert storage.complete_steps(ck) == [4, 8, 12]  # 8 and 12 saved again by the resumed run
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))
    # An explicit older checkpoint: 8 and 12 are set aside (beside the damaged ones), not refused.
    p = nljax_train(*base, f"checkpoint.resume={ck / '4'}")
    assert p.returncode == 0, p.stderr
    assert f"steps 8, 12 will be moved to {ck / 'set_aside'}" in p.stderr
    assert sorted(q.name for q in (ck / "set_aside").iterdir()) == ["12", "12.1", "8", "8.1"]
    assert storage.complete_steps(ck) == [4, 8, 12]
    assert tree_hash(ck / "set_aside" / "12") == damaged



def test_orbax_does_not_also_log_a_step_metadata_that_nljax_reports(tmp_path, caplog):
    """A step whose _CHECKPOINT_METADATA does not parse is nljax's to report, in one line (the
    resume's warning, tests/test_checkpoint.py's error); Orbax's managers read it when they start
    and logged two absl ERROR lines with the file's content before that line."""
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / storage.ORBAX_META).write_text("garbage{")
    for write in (False, True):
        storage.manager(tmp_path, write=write).close()
    assert not [r for r in caplog.records if "Metadata file" in r.getMessage()], caplog.text


@pytest.mark.slow
def test_a_step_directory_missing_an_item_is_passed_over_with_a_warning_and_set_aside(tmp_path):
    """A newest step directory that lost its nljax item (or Orbax's step metadata) is not a
    checkpoint, but it is nljax's: a tool reading the run says it used an older one, and a resume
    sets it aside rather than failing at the end when that step is saved again."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    assert nljax_train(*base).returncode == 0  # checkpoints 8 and 12 (keep 2)
    shutil.rmtree(ck / "12" / "nljax")
    p = run_python("-m", "nljax.generate", f"run.dir={run}", "max_new_tokens=2")
    assert f"nljax.generate: warning: checkpoint {ck / '12'} is incomplete, using an older one (it has no nljax)" \
        in p.stderr, p.stderr
    p = nljax_train("--resume", *base)
    assert p.returncode == 0, p.stderr
    assert f"nljax: warning: checkpoint {ck / '12'} is incomplete (it has no nljax), resuming from an older one" \
        in p.stderr, p.stderr
    assert f"step 12 will be moved to {ck / 'set_aside'}" in p.stderr, p.stderr
    assert storage.complete_steps(ck) == [8, 12] and not (ck / "set_aside" / "12" / "nljax").exists()
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))
    (ck / "12" / storage.ORBAX_META).unlink()  # the other item a committed step has
    p = nljax_train("--resume", *base)
    assert p.returncode == 0 and "is incomplete (it has no _CHECKPOINT_METADATA)" in p.stderr, p.stderr
    assert sorted(q.name for q in (ck / "set_aside").iterdir()) == ["12", "12.1"]

@pytest.mark.slow
def test_sigkill_while_setting_later_checkpoints_aside_loses_no_logged_step(tmp_path):
    """A resume of an older checkpoint killed before the later ones are set aside leaves the log
    whole: it was cut back to the older step first, and the next --resume took the newest
    checkpoint, left in place, whose steps the log no longer held (12 steps, 8 logged)."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    assert nljax_train(*base).returncode == 0  # checkpoints 8 and 12 (keep 2)
    logged = (run / "metrics.jsonl").read_text()
    p = nljax_train(*base, f"checkpoint.resume={ck / '8'}", killer=["aside", "0", str(ck)])
    assert p.returncode == -9, p.stderr
    assert storage.complete_steps(ck) == [8, 12] and (run / "metrics.jsonl").read_text() == logged
    p = nljax_train("--resume", *base[:2], *base[3:])  # not --quiet: its line says which it resumed
    assert p.returncode == 0 and f"resumed from {ck / '12'} at step 12" in p.stdout, p.stderr
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))


# nljax.train whose checkpoint cleanup fails after its own work (as a failed save found there does)
CLOSE_FAILS = r"""
import sys
from nljax.checkpoint.lifecycle import Checkpoints
close = Checkpoints.close
def failing(self):
    close(self)
    raise OSError(28, "No space left on device")
Checkpoints.close = failing
sys.argv = ["nljax.train", *sys.argv[1:]]
from nljax.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_setting_aside_and_cleanup_failures_are_one_line_and_release_the_lock(tmp_path):
    """An older checkpoint resumed with checkpoint.every=0 sets the later ones aside too (a later
    --resume would take the abandoned branch); when they cannot be set aside, one line, the lock
    released, nothing moved; a run.dir that cannot be made is one line; a failing cleanup still
    releases the lock."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}"]
    assert nljax_train(*base).returncode == 0  # checkpoints 8 and 12 (keep 2)
    p = nljax_train(*base, f"checkpoint.resume={ck / '8'}", "checkpoint.every=0")
    assert p.returncode == 0, p.stderr
    assert f"step 12 will be moved to {ck / 'set_aside'}" in p.stderr, p.stderr
    assert storage.complete_steps(ck) == [8] and (ck / "set_aside" / "12").is_dir()
    (ck / "set_aside" / "12").rename(ck / "12")
    (ck / "set_aside").rmdir()
    (ck / "set_aside").write_text("not a directory")
    p = nljax_train(*base, f"checkpoint.resume={ck / '8'}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (f"nljax.train: error: cannot clear checkpoint.dir {ck} for this run: "
                                                 f"File exists: {ck / 'set_aside'}"), p.stderr
    assert storage.complete_steps(ck) == [8, 12] and not (run / "nljax.lock").exists()
    # nor is the log cut back to step 8 while checkpoint 12 stays the one a --resume takes
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))
    (tmp_path / "afile").write_text("")
    p = nljax_train(*base, f"run.dir={tmp_path / 'afile' / 'sub'}", "checkpoint.every=0")
    # refused with the directory checks, before the run is built (tests/test_taken_run_dir.py)
    assert p.returncode == 2 and p.stderr.strip() == (f"nljax.train: error: run.dir {tmp_path / 'afile' / 'sub'}: "
                                                      f"{tmp_path / 'afile'} is a file, not a directory"), p.stderr
    p = nljax_train(*base, f"run.dir={tmp_path / 'afile'}")
    assert p.returncode == 2 and p.stderr.strip() == f"nljax.train: error: run.dir {tmp_path / 'afile'} is a file, " \
                                                     "not a directory", p.stderr
    p = run_python("-c", CLOSE_FAILS, *base, f"run.dir={tmp_path / 'r2'}", "train.steps=4", check=False)
    assert p.returncode != 0 and "No space left on device" in p.stderr, p.stderr
    assert (tmp_path / "r2" / "metrics.jsonl").exists() and not (tmp_path / "r2" / "nljax.lock").exists()


@pytest.mark.slow  # an edge case of 10-15 s: the README's suite kept under 15 minutes on 2 cores (.ci/run runs it)
def test_resume_with_every_checkpoint_damaged_is_one_line(tmp_path):
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}", "train.steps=8"]
    assert nljax_train(*base).returncode == 0
    for s in (4, 8):
        truncate(ck / str(s))
    before = tree_hash(run)
    p = nljax_train("--resume", *base)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"nljax.train: error: every checkpoint in {ck} is damaged; the oldest: checkpoint "
                               f"{ck / '4'}: array data unreadable"), p.stderr
    assert tree_hash(run) == before


# the synchronous save in the slow tier: the README's suite kept under 15 minutes on 2 cores
@pytest.mark.parametrize("async_save", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["async", "sync"])
def test_failed_write_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, async_save):
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # 6000 bytes: metrics.jsonl (about 300 bytes a step) fits, a checkpoint's files do not
    p = run_python("-c", FULL, str(ck), "6000", "--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}",
                   f"checkpoint.async_save={str(async_save).lower()}", check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"nljax.train: error: checkpoint {ck / '8'} could not be saved (OSError: [Errno 27] "
                                f"File too large); the newest complete checkpoint is {ck / '4'}"), p.stderr
    assert storage.complete_steps(ck) == [4]
    assert sorted(q.name for q in ck.iterdir() if not q.name.startswith("8.")) == ["4"]
    p = nljax_train("--resume", "--cpu-devices", "1", *SAVING, *QUICK, f"run.dir={run}")  # once there is room again
    assert p.returncode == 0 and f"resumed from {ck / '4'} at step 4" in p.stdout, p.stderr
    assert storage.complete_steps(ck) == [8, 12]


def test_failed_write_of_the_run_files_is_one_line(tmp_path):
    """The same limit hit by metrics.jsonl (no checkpoints): one line naming the file."""
    run = tmp_path / "run"
    p = run_python("-c", FULL, "-", "1000", "--cpu-devices", "1", "--quiet", *SAVING, *QUICK, f"run.dir={run}",
                   "checkpoint.every=0", check=False)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == f"nljax.train: error: cannot write {run / 'metrics.jsonl'}: [Errno 27] File too large"


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm and tmpfs in a user namespace")
def test_disk_full_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path):
    """A real full disk: checkpoint.dir on a 400 KiB tmpfs holds checkpoint 4 (272 KiB), not 8."""
    run, ck = tmp_path / "run", tmp_path / "ck"
    ck.mkdir()
    command = " ".join(f"'{a}'" for a in [sys.executable, "-m", "nljax.train", "--cpu-devices", "1", "--quiet",
                                         *SAVING, *QUICK, f"run.dir={run}", f"checkpoint.dir={ck}"])
    script = f"mount -t tmpfs -o size=400k tmpfs '{ck}' && {command}; rc=$?; ls '{ck}' > '{tmp_path}/ls'; exit $rc"
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=subprocess_env(),
                       timeout=600)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"nljax.train: error: checkpoint {ck / '8'} could not be saved (OSError: [Errno 28] "
                                f"No space left on device); the newest complete checkpoint is {ck / '4'}"), p.stderr
    assert (tmp_path / "ls").read_text().split() == ["4", "8.orbax-checkpoint-tmp"]
