"""`python -m nljax.launch`, the local multi-process launcher, with plain shell commands for
workers: the environment it gives each process, prefixed output, the exit code and the process
named after a failure, SIGINT, a launcher killed with SIGKILL, a command that cannot start."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import alive, subprocess_env

LAUNCH = [sys.executable, "-m", "nljax.launch"]


def test_launcher_prefixes_lines_sets_env_and_propagates_failure():
    script = ('echo "$NLJAX_PROCESS_ID/$NLJAX_NUM_PROCESSES $NLJAX_COORDINATOR $JAX_NUM_CPU_DEVICES"; '
              'if [ "$NLJAX_PROCESS_ID" = 1 ]; then echo bad >&2; exit 3; fi; exec sleep 60')
    t0 = time.monotonic()
    p = subprocess.run([*LAUNCH, "--nproc", "3", "--cpu-devices", "2", "--grace", "1", "--", "sh", "-c", script],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and time.monotonic() - t0 < 30, p.stderr
    lines = sorted(l for l in p.stdout.splitlines())
    coord = re.search(r"coordinator (127\.0\.0\.1:\d+)", p.stderr)[1]
    assert lines == [f"[{i}] {i}/3 {coord} 2" for i in range(3)]
    assert "[1] bad" in p.stderr.splitlines()
    assert "process 1 " in p.stderr and "exited with code 3" in p.stderr
    pids = [int(x) for x in re.search(r"pids ([\d ]+)$", p.stderr, re.M)[1].split()]
    assert not any(alive(x) for x in pids)


def test_a_worker_ended_by_sigterm_is_said_as_such_and_ended_workers_are_not_stopped():
    """SIGTERM to the workers themselves (a scheduler's notice; a run saves a checkpoint, exits
    143): the line said "exited with code 143; stopping the others", a crash's words, for workers
    that had all ended."""
    script = 'kill -TERM $$; sleep 5'
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--grace", "5", "--", "sh", "-c", script],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    said = [line for line in p.stderr.splitlines() if "exited with code" in line]
    assert len(said) == 1 and said[0].endswith("exited with code 143 (SIGTERM: a run saves a checkpoint first)"), said


def test_launcher_names_the_killed_worker_not_the_peer_that_failed_because_of_it():
    """The CI race: worker 1 is SIGKILLed and worker 0, whose collective then fails, exits 1; the
    launcher may see worker 0's exit first (a killed process's teardown can lag its closed sockets).
    Here worker 0 exits 0.1 s before the kill is visible: the cause reported is still the kill."""
    script = ('if [ "$NLJAX_PROCESS_ID" = 1 ]; then sleep 0.4; kill -9 $$; fi; '
              'sleep 0.3; exit 1')
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--grace", "5", "--", "sh", "-c", script],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGKILL, p.stderr
    assert "process 1 " in p.stderr and "exited with code 137" in p.stderr
    assert "exit codes by process: 1, 137" in p.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_launcher_stops_everything_on_sigint(sig):
    """Ctrl-C, or the terminal closing (SIGHUP), reaches every process as SIGTERM (the script's
    trap says so: its notice, not the parent-death kill)."""
    script = 'trap "echo noticed; exit 143" TERM; echo up; sleep 60 & wait'
    # --save-grace 10: a signal that reaches a shell before it has forked its `sleep` leaves that
    # sleep running (a loaded machine's race in this script, not in the launcher); it is killed then
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--save-grace", "10", "--", "sh", "-c", script], env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().endswith("up\n") and p.stdout.readline().endswith("up\n")
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig and out.count("noticed") == 2, err
    pids = [int(x) for x in re.search(r"pids ([\d ]+)$", err, re.M)[1].split()]
    assert not any(alive(x) for x in pids)


def test_launcher_reports_a_worker_that_did_not_stop_cleanly_after_sigterm():
    """SIGTERM to the launcher is passed on; a worker that then fails (here: exits 2, as a run
    whose preemption save failed) is the exit code, not the 143 of a clean preemption."""
    script = ('trap "exit $((NLJAX_PROCESS_ID == 1 ? 2 : 143))" TERM; echo up; sleep 60 & wait')
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--save-grace", "10", "--", "sh", "-c", script], env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().endswith("up\n") and p.stdout.readline().endswith("up\n")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and "exit codes by process: 143, 2" in err, err


def test_a_signal_reaches_what_a_shell_wrapper_started_and_its_last_lines_are_written():
    """The command is a shell that ran a child (as `bash -c 'python ...; echo'` does): SIGTERM ends
    the shell at once, while the child, which takes 1 s to "save", is waited for (it used to be
    left running, and its last line lost, when the launcher returned with the shell's exit)."""
    inner = 'trap "sleep 1; echo saved; exit 143" TERM; echo up $$; sleep 60 & wait'
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--save-grace", "20", "--", "sh", "-c", f"sh -c '{inner}'; echo after"],
                         env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(p.stdout.readline().split()[-1]) for _ in range(2)]
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 143, err
    assert sorted(out.split("\n")[:-1]) == ["[0] saved", "[1] saved"], out
    assert not any(alive(x) for x in pids)


def test_ctrl_c_gives_the_save_grace_and_a_second_signal_ends_it_at_once():
    """Ctrl-C gives the processes the whole `--save-grace` to save (it used to be 5 s at most; a
    failure's `--grace`, 1 s here, does not apply); a second signal to the launcher kills them at once."""
    script = 'trap "sleep 6; echo saved; exit 143" TERM; echo up; sleep 60 & wait'
    launch = [*LAUNCH, "--nproc", "2", "--grace", "1", "--save-grace", "30", "--", "sh", "-c", script]
    p = subprocess.Popen(launch, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().endswith("up\n") and p.stdout.readline().endswith("up\n")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT and out.count("saved") == 2, err
    p = subprocess.Popen(launch, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().endswith("up\n") and p.stdout.readline().endswith("up\n")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL and time.monotonic() - t0 < 5 and "saved" not in out, err


def test_a_save_cut_short_by_the_save_grace_is_said():
    """Processes still saving when `--save-grace` ends are killed, with one line saying their
    preemption checkpoint may be incomplete."""
    script = 'trap "sleep 30; exit 143" TERM; echo up; sleep 60 & wait'
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--save-grace", "1", "--", "sh", "-c", script],
                         env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().endswith("up\n") and p.stdout.readline().endswith("up\n")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGKILL and time.monotonic() - t0 < 10, err
    assert ("killed the processes still running 1 s after the signal (--save-grace): their preemption checkpoint "
            "may be incomplete") in err, err


def test_what_a_process_leaves_running_does_not_outlive_the_launcher():
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--", "sh", "-c", "sleep 60 & echo up $!; exit 0"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "killing what the processes left running" in p.stderr, p.stderr
    assert not any(alive(int(l.split()[-1])) for l in p.stdout.splitlines())


def test_a_launcher_whose_output_is_closed_still_ends():
    """`nljax.launch ... | head -2`: the workers' output is drained (the launcher used to hang,
    its workers blocked on full pipes)."""
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--", sys.executable, "-c", "for i in range(200000): print(i)"],
                         env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=60) == 0


def test_launchers_main_returns_argparses_refusal_as_a_code(capsys):
    """`nljax.launch.main([...])` from Python: a missing or mistyped flag returns 2 and --help 0,
    as every other command's main does (argparse's SystemExit was raised)."""
    from nljax import launch

    assert launch.main(["--", "true"]) == 2
    assert "the following arguments are required: --nproc" in capsys.readouterr().err
    assert launch.main(["--nproc", "two", "--", "true"]) == 2
    assert "--nproc: invalid int value: 'two'" in capsys.readouterr().err
    assert launch.main(["--help"]) == 0 and "usage: python -m nljax.launch" in capsys.readouterr().out


def test_launcher_bad_input():
    p = subprocess.run([*LAUNCH, "--nproc", "0", "--", "true"], env=subprocess_env(), capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == "nljax.launch: error: --nproc must be >= 1, got 0"
    p = subprocess.run([*LAUNCH, "--nproc", "2"], env=subprocess_env(), capture_output=True, text=True)
    assert p.returncode == 2 and "no command given" in p.stderr
    p = subprocess.run([*LAUNCH, "--nproc", "1", "--devices-per-proc", "2", "--", "true"], env=subprocess_env(),
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--devices-per-proc is for several processes" in p.stderr
    # JAX applies device ids to GPUs alone: each process drove every emulated CPU device
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--cpu-devices", "2", "--devices-per-proc", "1", "--", "true"],
                       env=subprocess_env(), capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == (
        "nljax.launch: error: --devices-per-proc chooses GPUs, --cpu-devices emulates CPU devices: give one of them "
        "(--cpu-devices M gives each process M devices)")
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--grace", "nan", "--", "true"], env=subprocess_env(),
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == "nljax.launch: error: --grace must be >= 0, got nan"
    p = subprocess.run([*LAUNCH, "--nproc", "2", "--save-grace", "7200", "--", "true"], env=subprocess_env(),
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == "nljax.launch: error: --save-grace must be at most 3600 s, got 7200.0"


@pytest.mark.parametrize("how", ["exec", "shell"])
def test_workers_do_not_outlive_a_launcher_killed_with_sigkill(how):
    """The workers sit in their own sessions, so nothing used to stop them when the launcher was
    SIGKILLed. `exec`: the worker is the command itself (its parent-death signal ends it);
    `shell`: a shell that started a child of its own (the guard kills the whole session)."""
    script = "echo up $$; exec sleep 60" if how == "exec" else "sleep 60 & echo up $!; wait"
    p = subprocess.Popen([*LAUNCH, "--nproc", "2", "--", "sh", "-c", script], env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(p.stdout.readline().split()[-1]) for _ in range(2)]
        assert all(alive(x) for x in pids)
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(x) for x in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(x) for x in pids)
    finally:
        for x in pids:
            if alive(x):
                os.kill(x, signal.SIGKILL)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX is imported here, not in the launcher
def test_a_failed_start_stops_the_processes_already_started(monkeypatch, capsys):
    """Process 1's command cannot be started (or its output thread cannot): process 0, already
    running, is stopped, and the launcher prints one line."""
    import threading

    from nljax import launch

    started, fail = [], {"popen": True}
    popen = subprocess.Popen

    def recording_popen(cmd, *a, **k):
        worker = cmd[:2] != [sys.executable, "-c"]  # not the guard
        if worker and started and fail["popen"]:
            raise FileNotFoundError(2, "No such file or directory")
        q = popen(cmd, *a, **k)
        if worker:
            started.append(q)
        return q

    monkeypatch.setattr(launch.subprocess, "Popen", recording_popen)
    assert launch.main(["--nproc", "2", "--", "sleep", "60"]) == 2
    assert capsys.readouterr().err == "nljax.launch: error: cannot start 'sleep': No such file or directory\n"
    assert len(started) == 1 and started[0].poll() is not None

    started.clear()
    fail["popen"] = False
    calls = []
    start = threading.Thread.start

    def failing_start(self):
        calls.append(self)
        if len(calls) == 3:  # process 1's first output thread
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    assert launch.main(["--nproc", "2", "--", "sleep", "60"]) == 2
    assert capsys.readouterr().err == "nljax.launch: error: cannot start 'sleep': can't start new thread\n"
    assert len(started) == 2 and all(q.poll() is not None for q in started)


def test_the_same_refusal_from_every_process_is_shown_once():
    """Every process reads the same config and refuses a bad override alike: the user sees its one
    line once; a line that differs between processes is still shown for each."""
    script = ('echo "nljax.train: error: unknown config key: bogus"; '
              'echo "nljax.train: error: process $NLJAX_PROCESS_ID only" >&2; exit 2')
    p = subprocess.run([*LAUNCH, "--nproc", "3", "--", "sh", "-c", script],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert sum("unknown config key: bogus" in l for l in p.stdout.splitlines()) == 1, p.stdout
    assert sum(" only" in l for l in p.stderr.splitlines()) == 3, p.stderr


@pytest.mark.parametrize("tool", ["evaluate", "generate", "export", "prepare", "lm_eval"])
def test_a_one_process_tool_started_as_one_of_several_is_refused(tool, monkeypatch, capsys, tmp_path):
    """`nljax.launch --nproc 2 -- python -m nljax.evaluate ...`: the tools do not join the
    processes, so each copy ran the whole job alone (its result printed once per process, the same
    files written at once). One line, the same on every process (the launcher shows it once), exit 2,
    nothing read or written. A job script that exports NLJAX_NUM_PROCESSES to join train's
    processes by hand is told to unset it (the line named the launcher alone)."""
    import importlib

    monkeypatch.setenv("NLJAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("NLJAX_PROCESS_ID", "1")
    main = importlib.import_module(f"nljax.{tool}").main
    assert main([f"run.dir={tmp_path}/run", f"out={tmp_path}/out"]) == 2
    assert capsys.readouterr().err == (f"nljax.{tool}: error: nljax.{tool} runs as one process, but "
                                       "NLJAX_NUM_PROCESSES=2 makes this one of 2 (nljax.launch or a job script "
                                       "sets it): run it once, without nljax.launch and with NLJAX_NUM_PROCESSES "
                                       "unset\n")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("NLJAX_NUM_PROCESSES", "1")  # one process: the tool's own answer (no such run)
    assert main([f"run.dir={tmp_path}/run", f"out={tmp_path}/out"]) != 0
    assert "runs as one process" not in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["evaluate", "prepare"])
@pytest.mark.parametrize("env, line", [
    ({"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"},
     "SLURM_NTASKS=2 makes this one of the SLURM job's tasks: run it as one task (srun --ntasks 1)"),
    ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4 makes this one of the "
     "Open MPI job's tasks: run it as one task (mpirun -n 1)"),
    ({"WORLD_SIZE": "2", "RANK": "0"},
     "WORLD_SIZE=2 (torchrun's or another launcher's) makes this one of several: run it once, without the launcher"),
])
def test_a_one_process_tool_run_as_one_of_a_clusters_tasks_is_refused(tool, env, line, monkeypatch, capsys, tmp_path):
    """`srun -N 2 python -m nljax.prepare ...` (or mpirun, torchrun): each task ran the whole job,
    writing the same files at once. The job step train joins (`distributed.detected_cluster`) is
    refused as nljax.launch's processes are, in one line; one task of it is the tool's own run."""
    import importlib

    main = importlib.import_module(f"nljax.{tool}").main
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main([f"run.dir={tmp_path}/run", f"out={tmp_path}/out"]) == 2
    assert capsys.readouterr().err == f"nljax.{tool}: error: nljax.{tool} runs as one process, but {line}\n"
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(next(k for k in env if k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")), "1")
    assert main([f"run.dir={tmp_path}/run", f"out={tmp_path}/out"]) != 0
    assert "runs as one process" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "--print-config"])
def test_what_every_launched_process_prints_alike_before_joining_is_printed_by_process_0(flag, monkeypatch, capsys):
    """`nljax.launch --nproc 2 -- python -m nljax.train --help` printed the help once per process,
    interleaved line by line; so did --print-config (each process reads the same config and
    prints it before joining)."""
    from nljax import train

    def printed(process_id: str) -> str:
        monkeypatch.setenv("NLJAX_PROCESS_ID", process_id)
        assert train.main([flag, "train.steps=3"]) == 0
        return capsys.readouterr().out

    assert ("usage: nljax.train" if flag == "--help" else "steps: 3") in printed("0")
    assert printed("1") == ""


def test_a_workers_line_of_a_long_number_passes_at_once():
    """The filter of gloo's notes split a number every way (2^digits tries): a worker's line of a
    30-digit number and "connected" held the launcher's output for a minute (27 digits: seconds).
    The notes themselves are still dropped, a bare number and other lines kept."""
    from nljax.launch import NOISE

    start = time.perf_counter()
    assert not NOISE.match("1" * 27 + " connected clients")
    assert time.perf_counter() - start < 1
    assert NOISE.match("[Gloo] Rank 12 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    assert NOISE.match("0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    assert not NOISE.match("12") and not NOISE.match("[Gloo] something else")
