"""Multi-process runs on JAX's own distributed runtime: start-up, lockstep checks, failure bounds.

Every process runs the same program over one global mesh (seed 002: SPMD, lockstep,
deterministic); each executes only its devices' part. Nothing here moves training data: the
runtime's coordination service starts the processes and watches them, XLA's collectives
(NCCL on GPUs, gloo on CPUs) do the work.

- **Start-up.** `initialize` calls `jax.distributed.initialize` when the process is one of
  several: from explicit arguments (the CLI flags `--coordinator`, `--num-processes`,
  `--process-id`, `--local-device-ids`, or their `NLJAX_*` environment variables, which
  `python -m nljax.launch` sets), or, with none given, from JAX's cluster auto-detection when a
  multi-task SLURM step or Open MPI job is present. Otherwise the run is a plain single process,
  the same program, for debugging.
- **Lockstep.** `agree` compares a SHA-256 digest of a canonical JSON record across processes
  (one small all-gather) and, when they differ, gathers the records themselves so that every
  process raises the same `ConfigError` naming the differing fields and processes. Python's
  `hash()` is never used, so nothing depends on `PYTHONHASHSEED`.
- **Failure.** `distributed.timeout_s` becomes the coordination service's heartbeat and
  shutdown timeouts: when a process dies, the service marks it failed after at most that long
  and terminates every other process, even one blocked inside a collective, instead of letting it
  hang. `abort` ends a failing process at once so that its peers are released early.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import inspect
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from nljax.config import Config, to_dict
from nljax.errors import ConfigError, first_line

# Environment fallbacks of the CLI flags, set per process by `python -m nljax.launch`.
from nljax.runtime.launchenv import ENV_COORDINATOR, ENV_LOCAL_DEVICE_IDS, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from nljax.runtime.waiting import said_while
from nljax.version import __version__

# Cluster launchers whose processes JAX's auto-detection wires up by itself: (name, variable
# present only in a launched job step, variable holding its number of tasks), as JAX's own
# SlurmCluster / OmpiCluster read them. One task is a single-process run.
CLUSTERS = (
    ("SLURM", "SLURM_STEP_NODELIST", "SLURM_NTASKS"),
    ("Open MPI", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"),
)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process run; all None means JAX auto-detects."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster: str | None = None  # the auto-detected cluster, when no argument was given
    # where the coordinator came from, as its refusals name it: the flag or NLJAX_COORDINATOR (the
    # same launch either way: not compared)
    said: str = dataclasses.field(default="--coordinator", compare=False)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer")


def parse_device_ids(text: str | None, what: str = "--local-device-ids") -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}")


def detected_cluster() -> str | None:
    """The cluster launcher that started this process as one of several tasks, if any."""
    for name, marker, tasks in CLUSTERS:
        try:
            if marker in os.environ and int(os.environ.get(tasks, "1")) > 1:
                return name
        except ValueError:
            pass
    return None


def _unread_launch() -> None:
    """Another launcher's variables when nljax has none of its own and no cluster: the process
    would train alone. torchrun (and accelerate, DeepSpeed) set WORLD_SIZE for each of several
    processes: every one trained alone, into the same run.dir. JAX_COORDINATOR_ADDRESS is half
    of a JAX launch (JAX needs the process count and id too): said, not refused."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        rank = os.environ.get("RANK", "$RANK")
        raise ConfigError(f"WORLD_SIZE={world} is set (torchrun's or another launcher's), but nljax does not read it: "
                          f"start the processes with python -m nljax.launch --nproc {world} -- <command>, or give "
                          f"each --coordinator HOST:PORT --num-processes {world} --process-id {rank}")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        print(f"nljax: warning: JAX_COORDINATOR_ADDRESS={os.environ['JAX_COORDINATOR_ADDRESS']} is set, but nljax "
              f"joins processes from --coordinator, --num-processes and --process-id ({ENV_COORDINATOR}, ...) or a "
              "SLURM / Open MPI job: this process runs alone", file=sys.stderr)


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            local_device_ids: Sequence[int] | None = None) -> Launch | None:
    """Flags, then `NLJAX_*` variables, then cluster auto-detection; None for a single process."""
    # each value's source, for the refusals below: a bad NLJAX_* variable (a launch script's) was
    # named as the flag, which the command line did not give
    said = {"--coordinator": "--coordinator" if coordinator else ENV_COORDINATOR,
            "--num-processes": "--num-processes" if num_processes is not None else ENV_NUM_PROCESSES,
            "--process-id": "--process-id" if process_id is not None else ENV_PROCESS_ID}
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if local_device_ids is None:
        local_device_ids = parse_device_ids(os.environ.get(ENV_LOCAL_DEVICE_IDS), ENV_LOCAL_DEVICE_IDS)
    if num_processes == 1:  # explicitly one process, even inside a multi-task cluster job
        if local_device_ids is not None:  # JAX takes them only when joining processes: not silently all
            raise ConfigError("--local-device-ids (NLJAX_LOCAL_DEVICE_IDS) is for one of several processes; choose "
                              "one process's devices with CUDA_VISIBLE_DEVICES")
        return None
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    ids = tuple(local_device_ids) if local_device_ids is not None else None
    if all(v is None for v in given.values()):
        cluster = detected_cluster()
        if cluster is None and ids is not None:
            raise ConfigError("--local-device-ids needs --coordinator, --num-processes and --process-id "
                              "(or a multi-task SLURM / Open MPI job)")
        # JAX fills in what is not given; under SLURM it would give each process only the device
        # of its local task id, so one process driving several GPUs names them.
        if cluster is None:
            _unread_launch()
            return None
        return Launch(local_device_ids=ids, cluster=cluster)
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(
            f"a multi-process launch needs --coordinator, --num-processes and --process-id (or {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); missing {', '.join(missing)}"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"{said['--process-id']} must be in [0, {num_processes}) and {said['--num-processes']} >= 1, "
                          f"got process id {process_id} of {num_processes}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{said['--coordinator']} must look like HOST:PORT with a port in 1-65535, "
                          f"got {coordinator!r}")
    return Launch(coordinator, num_processes, process_id, ids, said=said["--coordinator"])


def initialize(launch: Launch | None, timeout_s: int) -> bool:
    """Starts JAX's distributed runtime for `launch` (before any JAX computation); True if started.

    `timeout_s` bounds how long a dead peer goes unnoticed (heartbeats) and how long a process
    waits for the others when it exits (shutdown barrier)."""
    if launch is None:
        return False
    if not getattr(jax.config, "jax_cpu_collectives_implementation", "gloo"):
        # CPU processes need a cross-process collective library; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if launch.cluster is None:
        _check_resolves(launch.coordinator, launch.said)
        if launch.process_id == 0:  # the process that serves the coordinator
            _check_port_free(launch.coordinator, launch.said)
        kwargs = dict(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                      process_id=launch.process_id)
    if launch.local_device_ids is not None:
        kwargs["local_device_ids"] = list(launch.local_device_ids)
    # The timeout arguments exist in jax 0.10; pass only those the installed version accepts.
    accepted = inspect.signature(jax.distributed.initialize).parameters
    for name in ("heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
        if name in accepted:
            kwargs[name] = int(timeout_s)
    where = launch.cluster or f"coordinator {launch.coordinator}"
    who = "this process" if launch.process_id is None else f"process {launch.process_id}"
    count = f" {launch.num_processes}" if launch.num_processes else ""
    # a coordinator nobody serves: JAX is silent until its join timeout, minutes
    try:
        with said_while(lambda s: f"{who} has waited {s:.0f} s for the run's{count} processes to join at {where}"):
            jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"jax.distributed.initialize failed ({where}): {first_line(e)}")
    return True


def waiting_for_peers(what: str):
    """A context in which this process waits for the others at `what`, said after 10 s
    (`waiting.said_while`): a peer still compiling, stopped or stuck shows as a named wait."""
    return said_while(lambda s: f"process {jax.process_index()} has waited {s:.0f} s for the other "
                                f"{jax.process_count() - 1} process(es) at {what}")


def _check_resolves(coordinator: str, said: str = "--coordinator") -> None:
    """A host name that does not resolve is one line now; JAX would wait out its join timeout (minutes)
    and abort with a native stack. A temporary lookup failure is left to JAX's retries."""
    host, _, port = coordinator.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except socket.gaierror as e:
        if e.errno == socket.EAI_NONAME:
            raise ConfigError(f"{said} {coordinator}: host {host!r} does not resolve ({e.strerror})") from None


def _check_port_free(coordinator: str, said: str = "--coordinator") -> None:
    """Process 0 serves the coordination service on [::]:PORT. A port another run's coordinator
    already serves is one line now: gRPC binds with SO_REUSEPORT, so a second coordinator on the
    same port (two launches given the same fixed port, or two processes both given
    --process-id 0) started without error and both runs waited out JAX's 300 s join timeout,
    the kernel handing each joining process to either. A probe bound without SO_REUSEPORT fails
    against any listener on the port; SO_REUSEADDR lets it pass connections left in TIME_WAIT
    by an earlier run."""
    port = int(coordinator.rpartition(":")[2])
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: the IPv4 wildcard then
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                try:  # dual stack, as gRPC's [::] listener: conflicts with an IPv4 listener too
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                except OSError:
                    pass
            try:
                probe.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{said} {coordinator}: port {port} is already in use on this host (another run's "
                        f"coordinator, or two processes given --process-id 0?); choose another port") from None
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 present but not configured: the IPv4 wildcard then
                return  # anything else is left to JAX to report
        return


def abort(message: str, code: int = 1) -> None:
    """Ends this process now, skipping the shutdown barrier: its peers, possibly blocked in a
    collective that waits for it, see it gone instead of waiting for it."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


# --- lockstep -------------------------------------------------------------------------------


def canonical(record: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, so equal records give equal bytes everywhere."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(record: Any) -> str:
    return hashlib.sha256(canonical(record)).hexdigest()


def _allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    with waiting_for_peers("a lockstep check"):
        return np.asarray(multihost_utils.process_allgather(x))  # [P, ...]


def _allgather_bytes(payload: bytes) -> list[bytes]:
    lengths = _allgather(np.array([len(payload)], np.int32))[:, 0]
    buf = np.zeros(int(lengths.max()), np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    rows = _allgather(buf)
    return [rows[p, : lengths[p]].tobytes() for p in range(len(lengths))]


def first_failure(line: str | None) -> str | None:
    """Every process calls this at the same point with its own failure (a line), or None: returns
    the first failing process's line with ' (process <i>)' appended, the same on every process,
    or None when none failed. What each process read for itself (its shards of a checkpoint) is
    then judged alike everywhere: no process goes on with what another found damaged."""
    if jax.process_count() == 1:
        return line
    lines = _allgather_bytes(b"-" if line is None else b"+" + line.encode())
    for i, got in enumerate(lines):
        if got.startswith(b"+"):
            return f"{got[1:].decode()} (process {i})"
    return None


def _flatten(record: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(record, dict):
        out = {}
        for k, v in record.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: record}


def explain(records: list[Any], limit: int = 4) -> str:
    """'key: process 0 = a, process 1 = b; ...' for the fields whose values differ."""
    flat = [_flatten(r) for r in records]
    keys = sorted(set().union(*flat))
    parts = []
    for key in keys:
        values = [canonical(f.get(key, "<missing>")).decode() for f in flat]
        if len(set(values)) == 1:
            continue
        groups: dict[str, list[int]] = {}
        for p, v in enumerate(values):
            groups.setdefault(v, []).append(p)
        # 60 characters of each, from a little before where they start to differ (long paths
        # that differ at their end must not look the same)
        start = max(len(os.path.commonprefix(list(groups))) - 20, 0)
        cut = lambda v: ("…" if start else "") + v[start : start + 60] + ("…" if len(v) > start + 60 else "")
        shown = ", ".join(f"process{'es' if len(ps) > 1 else ''} {','.join(map(str, ps))} = {cut(v)}"
                          for v, ps in groups.items())
        parts.append(f"{key}: {shown}")
    more = f"; and {len(parts) - limit} more" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


def agree(what: str, record: Any) -> str:
    """Checks that every process holds the same `record`; returns its digest.

    All processes must call this at the same point. On a mismatch every process raises the same
    `ConfigError`, naming the fields that differ and which processes hold which value."""
    payload = canonical(record)
    d = hashlib.sha256(payload).digest()
    if jax.process_count() == 1:
        return d.hex()
    digests = _allgather(np.frombuffer(d, np.uint8))  # [P, 32]
    if (digests == digests[0]).all():
        return d.hex()
    # Every process saw the same digests, so every process takes this branch together.
    records = [json.loads(b) for b in _allgather_bytes(payload)]
    raise ConfigError(f"processes disagree on the {what}: {explain(records)}")


def mesh_layout(mesh: jax.sharding.Mesh) -> dict[str, str]:
    """For each mesh axis, whether stepping along it crosses processes."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = {}
    for k, name in enumerate(mesh.axis_names):
        crosses = (np.diff(procs, axis=k) != 0).any() if procs.shape[k] > 1 else False
        out[name] = "across processes" if crosses else "within a process"
    return out


def mesh_record(mesh: jax.sharding.Mesh) -> dict:
    devs = list(mesh.devices.flat)
    return {
        "shape": dict(mesh.shape),
        "devices": [[d.process_index, d.id] for d in devs],  # mesh order
        "platform": devs[0].platform,
        "kind": sorted({d.device_kind for d in devs}),
        "processes": jax.process_count(),
    }


def source_digest(package: Path = Path(__file__).resolve().parents[1]) -> str:
    """SHA-256 of nljax's own Python files (their paths in the package and contents): two
    checkouts of the same version that differ (a host left on another commit, an edit on one)
    would otherwise join and run different code in lockstep. About 1.4 MB, read once at start.
    Files alone: an editor's lock beside a file being edited (Emacs's `.#trainer.py`) is a
    symbolic link to nothing, which stopped the start with a traceback."""
    sha = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*.py") if p.is_file()):
        sha.update(path.relative_to(package).as_posix().encode() + b"\0")
        sha.update(hashlib.sha256(path.read_bytes()).digest())
    return sha.hexdigest()


def versions() -> dict:
    import jaxlib

    return {"nljax": __version__, "nljax_source": source_digest(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def check_devices() -> None:
    """Every process must drive the same number of devices: the lockstep checks' all-gather (and
    every mesh) assumes it. Read from the global device list, which every process holds once the
    backend is up, so the check needs no collective and every process raises the same error."""
    counts: dict[int, int] = {}
    for d in jax.devices():
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"process {p} = {n}" for p, n in sorted(counts.items()))
        raise ConfigError(f"processes drive unequal numbers of devices ({shown}); give every process the same "
                          "number (--cpu-devices, --local-device-ids or the visible accelerators)")


def check_config(cfg: Config) -> None:
    """Start-up check of the device counts and the resolved config alone, before anything is
    built from it: a mismatch here cannot make one process fail while the others wait in a
    collective."""
    if jax.process_count() > 1:
        check_devices()
        agree("resolved config", to_dict(cfg))


def check_step(iteration: int, pulse: Any, every: int) -> None:
    """Periodic lockstep check of the step and its Pulse, every `every` loop iterations of this
    run (iterations, not global steps, so processes meet here even if their steps differ)."""
    if jax.process_count() == 1 or every <= 0 or iteration % every:
        return
    agree(f"training step at loop iteration {iteration}", {"step": int(pulse.step), "active": list(pulse.active)})


def on_main(fn: Callable[[], Any], elsewhere: str | None, main: bool | None = None) -> Any:
    """`fn()` on process 0 (or where `main`), its value returned there (None elsewhere). A
    ConfigError it raises stops every process: process 0 with its own line, the others with
    `elsewhere`, or with process 0's line where `elsewhere` is None (what process 0 decides for
    all, e.g. the run directory on a file system the others may not see), instead of their
    waiting at the next collective for a process that has left. Any other exception (a bug, an
    OSError nobody turned into a line) stops them too: process 0 raises it as it is, with its
    traceback, the others a line naming it."""
    value, error = None, None
    if jax.process_index() == 0 if main is None else main:
        try:
            value = fn()
        except ConfigError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - raised again below, after the others are told
            error = e
    said = error if isinstance(error, ConfigError) or error is None else ConfigError(
        f"process 0 failed: {type(error).__name__}: {first_line(error)}")
    if elsewhere is None:
        line = str(said) if said is not None else ""
        if jax.process_count() > 1:
            line = _allgather_bytes(line.encode())[0].decode()
        if line:
            raise error or ConfigError(line)
    elif main_decides(error is not None):
        raise error or ConfigError(elsewhere)
    return value


def main_decides(flag: bool) -> bool:
    """Process 0's value of `flag` on every process (e.g. a file check on a shared file system,
    which other processes could see only after process 0 has written it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
