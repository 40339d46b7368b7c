"""Command-line plumbing shared by `nljax.train`, `nljax.comm` and friends.

`--cpu-devices N` and the host allocator's settings (nljax/measure/hostmem.py) must take effect before
JAX creates its backends, and a multi-process run must join JAX's distributed runtime before any
computation, so all three happen here, before any module touches `jax.devices()`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
import traceback
from typing import Callable, NoReturn, Sequence

try:  # the commands' first import of JAX, which reads its environment as it is imported
    import jax
except ValueError as e:  # JAX_NUM_CPU_DEVICES=abc, ...: a traceback before
    # bad input like any other, so named by the command and exit 2 (it was `nljax: error:`, exit 1);
    # `python -m nljax.train` runs with its module's name in __main__.__spec__ (runpy sets it first)
    _prog = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) or ""
    if not _prog.startswith("nljax."):  # imported by a program of the user's (nljax.load): theirs to handle
        raise
    print(f"{_prog}: error: JAX's environment variables: {str(e).splitlines()[0]}", file=sys.stderr)
    sys.exit(2)

from nljax import config, configdoc
from nljax.errors import first_line
from nljax.measure import hostmem
from nljax.models import registry
from nljax.runtime import distributed
from nljax.runtime.preemption import Stopped, check_in


class PluginFailed(logging.Filter):
    """JAX's report of a device plugin that failed to start, a traceback of some 25 lines before
    the command's own output (JAX's CUDA plugin on a machine without a GPU: 'Unable to load
    cuPTI'), as one line; JAX goes on with the devices it found. A report worded otherwise
    passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        if e is not None and str(record.msg).startswith("Jax plugin configuration error: Exception when calling"):
            plugin = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = ("nljax: warning: JAX's device plugin %s did not start (%s: %s): JAX goes on without "
                          "its devices (python -c 'import jax; jax.devices()' shows JAX's traceback)")
            record.args, record.exc_info, record.exc_text = (plugin, type(e).__name__, first_line(e)), None, None
        return True


logging.getLogger("jax._src.xla_bridge").addFilter(PluginFailed())  # where JAX starts its plugins


class Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line (`prog: error: ...`), not its usage block
    first: a mistyped flag reads like every other refusal of nljax's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def print_help(self, file=None):
        if not launched_other():
            super().print_help(file)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, intermixed: bool = True):
    """`p`'s arguments of `argv`, or the exit code of argparse's refusal (its line printed) or of
    --help (the help printed). A command's `main([...])` called from Python (a notebook, a script:
    `nljax.train.main`) returns it as it returns every other refusal's code; argparse's SystemExit
    ended a script there, and showed in a notebook's cell as "SystemExit: 2". From Python, a
    path (`--config`, Path("my.yaml")) is taken as its str; a str for the whole list was read letter
    by letter ("override 't' must look like key=value"), a number raised argparse's TypeError."""
    argv = listed(argv)  # a generator read once, into the list checked and parsed
    if not_listed(p.prog, argv):
        return 2
    argv = [os.fspath(a) for a in argv]
    try:
        return p.parse_intermixed_args(argv) if intermixed else p.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2


def command_line() -> list[str]:
    """The arguments of a command's `main()` called without any: this process's (sys.argv's),
    but none in a Jupyter kernel, whose own (`-f kernel-1234.json`) are not the command's: they
    were refused as "unrecognized arguments: -f"."""
    if "ipykernel" in sys.modules and "ipykernel" in (sys.argv[0] if sys.argv else ""):
        return []
    return sys.argv[1:]


def not_listed(prog: str, argv: Sequence[str]) -> bool:
    """Whether `argv`, given to a command's `main` from Python, is not a list of str (or paths):
    then said in one line."""
    bad = argv if isinstance(argv, str) else next((a for a in argv if not isinstance(a, (str, os.PathLike))), None)
    if bad is not None:
        print(f"{prog}: error: main takes the command's arguments as a list of str, one each (shlex.split "
              f"of a command line gives it), got {type(bad).__name__} {bad!r:.60}", file=sys.stderr)
    return bad is not None


def listed(argv: Sequence[str] | None):
    """A command's `main(argv)` as the list it records: sys.argv's when None, a path as its str;
    a str or a number stays for `parse` to refuse (list() of a str gave its letters)."""
    if argv is None:
        return command_line()
    if isinstance(argv, str):
        return argv
    return [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]


def launched_other() -> bool:
    """Whether this is a process other than 0 that `nljax.launch` started: what every process would
    print alike before joining (--help, --print-config) is printed by process 0 alone, not
    interleaved line by line with the others' copies."""
    return os.environ.get(distributed.ENV_PROCESS_ID, "") not in ("", "0")


CONFIG_HELP = ("YAML config file, or a packaged config's name (nl_default, nl_gpu, meanflow_digits, ...); "
               "given again, each file updates the ones before it key by key; defaults apply to keys none sets")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = Parser(allow_abbrev=False, prog=prog, description=description)
    p.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU (per process)")
    g = p.add_argument_group(
        "multi-process runs",
        f"one process of several (see nljax.launch); each flag falls back to ${distributed.ENV_COORDINATOR}, "
        f"${distributed.ENV_NUM_PROCESSES}, ${distributed.ENV_PROCESS_ID}, ${distributed.ENV_LOCAL_DEVICE_IDS}; "
        "with none set, a multi-task SLURM step or Open MPI job is detected by JAX",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0 <= I < N")
    g.add_argument("--local-device-ids", metavar="0,1,...", help="devices this process drives (default: all visible)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. train.steps=50")
    return p


MAX_CPU_DEVICES = 1024


def setup_devices(cpu_devices: int | None) -> None:
    if cpu_devices is not None:
        if not 1 <= cpu_devices <= MAX_CPU_DEVICES:  # each one a thread pool and a copy of the state
            raise config.ConfigError(f"--cpu-devices must be in [1, {MAX_CPU_DEVICES}], got {cpu_devices}")
        if hostmem.backends_started():  # a second command in one Python process (a notebook), or JAX used before
            _started_as(cpu_devices)
            return
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def _started_as(cpu_devices: int) -> None:
    """--cpu-devices N once JAX's backends have started: JAX fixes a process's devices when it
    starts them, so N emulated CPU devices are what it has already, or a line saying how to get
    them. JAX's own refusal read as a backend that could not start ("check that the device and its
    JAX plugin are installed"), and `jax_platforms` was left set to cpu on the way."""
    have = jax.devices()
    if have[0].platform == "cpu" and len(have) == cpu_devices:
        return
    # on an accelerator, --cpu-devices of any N is refused again: leaving it out is the way to them
    same = f"give --cpu-devices {len(have)} or leave it out" if have[0].platform == "cpu" else "leave it out"
    raise config.ConfigError(
        f"--cpu-devices {cpu_devices}: JAX has already started in this Python process, with {len(have)} "
        f"{have[0].platform} device(s) (an earlier command or JAX call here), and JAX sets a process's devices once: "
        f"{same} to use those, or start a new process (a notebook: restart its kernel) for {cpu_devices}")


def setup_processes(args: argparse.Namespace, cfg: config.Config) -> bool:
    """Joins a multi-process run if this process is one of several (True)."""
    launch = distributed.resolve(args.coordinator, args.num_processes, args.process_id,
                                 distributed.parse_device_ids(args.local_device_ids))
    if launch is not None and launch.local_device_ids is not None and jax.config.jax_platforms == "cpu":
        # JAX applies them to GPUs alone: on the CPU each process silently drove all its devices
        raise config.ConfigError("--local-device-ids (NLJAX_LOCAL_DEVICE_IDS) chooses GPUs, but this process runs on "
                                 "the CPU (--cpu-devices or JAX_PLATFORMS=cpu): leave it out (--cpu-devices N gives "
                                 "each process N devices)")
    return distributed.initialize(launch, cfg.distributed.timeout_s)


# Flags that differ by process (each its id, its devices: the device counts are checked apart), and
# the config files and overrides, whose resolved config is compared (a path may differ by host);
# bench's whole command line (`argv`: its --process-id too) and the paths it writes to.
PER_PROCESS = frozenset({"coordinator", "num_processes", "process_id", "local_device_ids", "cpu_devices", "config",
                         "overrides", "argv", "out", "profile_dir"})


def same_flags(args: argparse.Namespace) -> dict:
    """The flags every process must be given alike: one process given --resume and the other not
    took different start-up steps, and their collectives crashed in gloo ("Received data size
    doesn't match expected size", exit 250) before the config was compared."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in PER_PROCESS}


def backend_failed(e: BaseException) -> str | None:
    """The one line for JAX failing to start its backend (JAX_PLATFORMS=cuda on a machine without
    the GPU or its plugin: an AssertionError or RuntimeError deep in JAX), or None."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames or not frames[-1].filename.endswith("xla_bridge.py"):
        return None
    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "(JAX's default)"
    return (f"JAX could not start a backend for JAX_PLATFORMS={platforms} ({type(e).__name__}: "
            f"{first_line(e) or 'no message'}); check that the device and its JAX plugin are installed "
            "(pip install 'nljax[cuda]' for GPUs), or unset JAX_PLATFORMS")


def out_of_memory(e: BaseException) -> str | None:
    """The one line for an allocation that failed although the budget check passed (its
    activations term is only a floor, see nljax/measure/budget.py), or None for any other error."""
    text = str(e)
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text:
        first = first_line(e) or type(e).__name__
        return (f"out of memory ({first[:200]}); make the model, train.batch_size or train.seq_len smaller, "
                "raise train.accum_steps or use more devices")
    return None


def unusable_path(e: BaseException) -> str | None:
    """The one line for a path the user gave that the file system cannot take, anywhere a command
    reads or makes one, or None: a loop of symbolic links (a -> b -> a: an OSError ELOOP, or
    Path.resolve's RuntimeError on Python 3.11, 3.12), a name over 255 bytes or a path over 4,096
    (ENAMETOOLONG). Both were tracebacks where no check of the path's own came first."""
    loop = "is a loop of symbolic links"
    if isinstance(e, OSError) and e.errno in (errno.ELOOP, errno.ENAMETOOLONG):
        name = e.filename
        why = loop if e.errno == errno.ELOOP else "is longer than the file system takes (255 bytes a name, 4,096 a path)"
    elif isinstance(e, RuntimeError) and str(e).startswith("Symlink loop from "):
        name, why = str(e).removeprefix("Symlink loop from ").strip("'\""), loop
    else:
        return None
    return f"{name} {why}" if name else f"a path {why} ({first_line(e)})"


def write_failed(e: BaseException) -> str | None:
    """The one line for a file that could not be written (a full disk, a quota, a file-size
    limit, a read-only file system), or None for any other error."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        name = e.filename or _open_file_of(e)
        where = f"cannot write {name}" if name else "a write failed"
        return f"{where}: [Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
    return None


def cannot_write(what, e: OSError) -> str:
    """The one line for an output (`what`: a file, or words naming it) that could not be
    written: the OS's reason, and the file it failed on when `what` does not name it."""
    if line := write_failed(e):
        return line
    on = f" ({e.filename})" if e.filename and str(e.filename) not in str(what) else ""
    return f"cannot write {what}: {e.strerror or e}{on}"


def _open_file_of(e: BaseException) -> str | None:
    """The name of the file a failed `write` was writing (an OSError from `write` carries no
    file name): the open file object in the innermost frame that holds one."""
    import io

    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for v in frame.f_locals.values():
            if isinstance(v, io.IOBase) and isinstance(getattr(v, "name", None), str):
                return v.name
    return None


@contextlib.contextmanager
def stdout_silenced(silence: bool):
    """`--quiet` for what native libraries write to file descriptor 1 behind Python's back (gloo's
    "[Gloo] Rank 0 is connected to 1 peer ranks" lines in a multi-process CPU run): fd 1 points
    at /dev/null while the block runs. Errors go to stderr, which stays."""
    try:
        saved = os.dup(1) if silence else None
    except OSError:  # no fd 1 (closed by the caller): nothing to silence
        saved = None
    if saved is None:
        yield
        return
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def stdout_to_devnull() -> None:
    """After a failed write to standard output (a closed pipe: `| head`): the text still
    buffered would fail again as Python exits (a traceback)."""
    if sys.stdout is not None:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def interrupted(prog: str, then: str = "", sig: int = signal.SIGINT) -> int:
    """Ctrl-C in a one-process tool (generate, export, prepare), or SIGTERM where it takes that
    as Ctrl-C (`sigterm_as_ctrl_c`): one line, after whatever it was printing (`then`: what to do
    next), and the shell's 128 + the signal."""
    what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "stopped (SIGTERM)"
    print(f"\n{prog}: {what}{then}", file=sys.stderr)
    return 128 + sig


class SigtermStop(KeyboardInterrupt):
    """SIGTERM in a tool that takes it as Ctrl-C: raised where the process is, as Ctrl-C is."""


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """While the block runs, SIGTERM (a batch job's time limit, `kill`) stops this process as
    Ctrl-C does: its cleanup runs and `tool` says it in one line. By default it ended the process
    with no word. The handler before is put back after (a caller's own, in a test's process)."""

    def stop(signum, frame):
        raise SigtermStop

    try:
        before = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: signals are not this thread's to take
        yield
        return
    try:
        yield
    finally:  # None: a handler not installed from Python (signal.signal refuses None back)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def traceback_if_asked(e: config.ConfigError) -> None:
    """With NLJAX_TRACEBACK set (not "" or 0), the traceback of a one-line error, before its line:
    where nljax raised it and, when it stands for an exception of a model's own code (a plugin's
    `build` raising: `registry.plugin_code`), that exception's traceback first."""
    if os.environ.get(registry.TRACEBACK, "") not in ("", "0"):
        traceback.print_exception(e, file=sys.stderr)


# how to run a one-process tool as one task of a cluster launcher (`one_process`)
ONE_TASK = {"SLURM": "srun --ntasks 1", "Open MPI": "mpirun -n 1"}


def one_process(prog: str) -> None:
    """A one-process tool started as one of several (`nljax.launch --nproc 2 -- python -m
    nljax.evaluate ...`) is refused: it does not join them, so each copy ran the whole job alone,
    printing its result once per process and writing the same files at once (two `nljax.prepare`
    into one directory). The line is the same on every process: the launcher shows it once."""
    n = os.environ.get(distributed.ENV_NUM_PROCESSES, "")
    if n.isdigit() and int(n) > 1:
        # a job script may export it for train's joining by hand (docs/guides/multi-host.md), then
        # run a tool once: "without nljax.launch" alone left the user nothing to change
        raise config.ConfigError(f"{prog} runs as one process, but {distributed.ENV_NUM_PROCESSES}={n} makes this one "
                                 f"of {n} (nljax.launch or a job script sets it): run it once, without nljax.launch "
                                 f"and with {distributed.ENV_NUM_PROCESSES} unset")
    # the tasks of a job step train would join (`srun -N 2 python -m nljax.prepare ...` ran two
    # copies writing one directory), and torchrun's (refused by train too: `_unread_launch`)
    if (cluster := distributed.detected_cluster()) is not None:
        tasks = next(t for name, _, t in distributed.CLUSTERS if name == cluster)
        raise config.ConfigError(f"{prog} runs as one process, but {tasks}={os.environ[tasks]} makes this one of the "
                                 f"{cluster} job's tasks: run it as one task ({ONE_TASK[cluster]})")
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise config.ConfigError(f"{prog} runs as one process, but WORLD_SIZE={world} (torchrun's or another "
                                 "launcher's) makes this one of several: run it once, without the launcher")


def tool(prog: str, body: Callable[[], int], after_os_error: Callable[[], None] = lambda: None,
         after_ctrl_c: str = "") -> int:
    """`body()`'s exit code for a one-process tool (generate, export, lm_eval, prepare), a user's
    problem as one line: a ConfigError (2), Ctrl-C (130; `after_ctrl_c`: what to do next), an
    OSError (a full disk, a closed standard output, permissions) or JAX failing to start its
    backend (1); `after_os_error` then tidies up."""
    try:
        one_process(prog)
        return body()
    except config.ConfigError as e:
        traceback_if_asked(e)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line, as every other way the tool stops
        return interrupted(prog, after_ctrl_c, signal.SIGTERM if isinstance(e, SigtermStop) else signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - OSErrors, JAX failing to start its backend (JAX_PLATFORMS=cuda without a GPU)
        if line := unusable_path(e):  # a path the user gave: exit 2, as a ConfigError
            print(f"{prog}: error: {line}", file=sys.stderr)
            return 2
        if isinstance(e, OSError):
            print(f"{prog}: error: {write_failed(e) or e}", file=sys.stderr)
            after_os_error()
            return 1
        line = backend_failed(e)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1


def leave(code: int) -> NoReturn:
    """`sys.exit(code)` for a command run as a program (`python -m nljax.train`), past its last line:
    a Ctrl-C or SIGTERM during the interpreter's teardown (JAX's clean-up at exit, a second or so)
    ends it at once with the same code, the command's outcome being said. The default handlers
    printed a KeyboardInterrupt traceback from JAX's atexit callback there (Ctrl-C twice, the
    first one saved and said), or ended the process by the signal with no line (SIGTERM)."""
    for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
        with contextlib.suppress(Exception):
            stream.flush()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: os._exit(code))
    sys.exit(code)


def main(run: Callable[[argparse.Namespace, config.Config], int | None], p: argparse.ArgumentParser,
         argv: Sequence[str] | None = None,
         quiet: Callable[[argparse.Namespace, config.Config], bool] = lambda args, cfg: False,
         configure: Callable[[argparse.Namespace, config.Config], config.Config] = lambda args, cfg: cfg,
         first_step: Callable[[config.Config], int] = lambda cfg: 0,
         settle: Callable[[argparse.Namespace, config.Config], config.Config] = lambda args, cfg: cfg,
         resumes: Callable[[argparse.Namespace], bool] = lambda args: False) -> int:
    """Parse, configure devices, load the config (then `configure(args, cfg)`: the tool's own
    flags) and call `run`; user errors become one line. With `quiet(args, cfg)` standard output
    is silenced from the processes' joining on. `settle(args, cfg)`: the config once the
    processes joined, from what process 0 decides for all (reading run.dir, say).
    `first_step(cfg)`: the step a run counts from (its resume step), told to JAX's preemption
    service as the processes join. `resumes(args)`: the command line continues a run whose saved
    config `configure` or `settle` puts under it, so its settings are checked together only
    then (`--resume data.prepared=NEW` alone: the defaults' data.source=stdlib would refuse it)."""
    args = parse(p, argv)
    if isinstance(args, int):  # refused, or --help
        return args
    multiprocess = False
    try:
        setup_devices(args.cpu_devices)
        hostmem.retain()  # before JAX's backends start (nljax/measure/hostmem.py)
        printing = getattr(args, "print_config", False)  # nljax.train --print-config: the config, nothing built
        cfg = configure(args, config.load(args.config, args.overrides, check=not resumes(args) and not printing))
        if printing:
            cfg = settle(args, cfg)
            if launched_other():  # process 0 prints it, and its note
                return 0
            print(configdoc.to_yaml(cfg), end="")
            # a config that does not train as it is (data.source=files before data.train is chosen)
            # is still the one to look at: printed, and what it lacks said (a wrong key or value
            # stopped config.load before, in one line)
            try:
                config.validate(cfg)
            except config.ConfigError as e:
                print(f"{p.prog}: note: this config does not train as it is: {e}", file=sys.stderr)
            return 0
        with stdout_silenced(quiet(args, cfg)):  # gloo prints at the first collective: the checks'
            multiprocess = setup_processes(args, cfg)
            if multiprocess:  # before settle and first_step, whose collectives the flags choose
                distributed.check_devices()  # first: the all-gather assumes equal counts
                distributed.agree("command line", same_flags(args))
            cfg = settle(args, cfg)  # decided by process 0: once joined
            config.validate(cfg)  # see `resumes`
            if multiprocess:  # at once: first_step may open checkpoints, which starts JAX (nljax.runtime.preemption)
                check_in(lambda: first_step(cfg))  # a notice from here on stops the run at a step it reaches
            distributed.check_config(cfg)  # before anything is built from it
            return run(args, cfg) or 0
    except Stopped as e:  # preempted: every process saved the same step; the scheduler restarts the job
        print(f"{p.prog}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, or a second one inside it
        line = f"{p.prog}: interrupted (Ctrl-C)"
        if multiprocess:
            distributed.abort(f"{line} (process {jax.process_index()})", 128 + signal.SIGINT)
        print(line, file=sys.stderr)
        return 128 + signal.SIGINT
    except config.ConfigError as e:
        # In a multi-process run every process raises it together (lockstep checks) or the
        # others are released by the shutdown barrier's timeout (distributed.timeout_s).
        where = f" (process {jax.process_index()})" if multiprocess else ""
        traceback_if_asked(e)
        print(f"{p.prog}: error{where}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if (loop := unusable_path(e)) and not multiprocess:  # a path the user gave: exit 2, as a ConfigError
            print(f"{p.prog}: error: {loop}", file=sys.stderr)
            return 2
        line = out_of_memory(e) or write_failed(e) or backend_failed(e) or loop
        if line and not multiprocess:
            print(f"{p.prog}: error: {line}", file=sys.stderr)
            return 1
        if not multiprocess:
            raise
        # Peers may be blocked in a collective that waits for this process: leave at once.
        if line:  # a user's problem (a full disk, out of memory): its one line, no traceback
            distributed.abort(f"{p.prog}: error (process {jax.process_index()}): {line}")
        first = first_line(e) or type(e).__name__
        # a collective whose peer went away (gloo: "Connection closed by peer"): the cause is that
        # process's, named by the launcher; this one's traceback (50 lines) says nothing of it
        peer_gone = isinstance(e, jax.errors.JaxRuntimeError) and " by peer" in first
        if not peer_gone or os.environ.get(registry.TRACEBACK, "") not in ("", "0"):
            traceback.print_exc()
        hint = " (another process probably died)" if isinstance(e, jax.errors.JaxRuntimeError) else ""
        distributed.abort(f"{p.prog}: error (process {jax.process_index()}): {type(e).__name__}{hint}: {first}")
        return 1  # not reached
