"""Training steps compiled once, kept as files and loaded instead of compiled again
(`NLJAX_EXECUTABLES=DIR`).

A GPU session's time goes mostly to compiling its steps; `benchmarks/gpu_compile.py
--save-executables DIR` compiles them for the card on a machine without one, and a run on the
card with `NLJAX_EXECUTABLES=DIR` loads them. `StepCache` (nljax/engine/step.py) compiles every
training step through `compile_step` here:

- the variable unset: `lowered.compile()`, nothing read or written (as before);
- set: the step's key (`key`) names `DIR/<key>.xla`; a file there is loaded onto this run's
  devices; any failure to load says one line naming the file and why, and the step compiles as
  without the variable: a bad file never fails or changes a run;
- with `NLJAX_EXECUTABLES_WRITE=1` too, a step that was compiled is written there (a temporary
  file renamed into place: a reader never sees half a file).

The key is what makes a loaded step the step this run would have compiled: a digest of the
lowered program's text without its debug information and with its functions compared by
content, not by the names jax numbered them with (`canonical_names`), the jax and jaxlib versions, the
devices' platform, kinds and count, and the XLA flags that change what XLA compiles (dump and
cache locations do not; jax's persistent compilation cache leaves the same ones out). With the
variable set, steps are lowered naming nljax's files relative to the checkout
(`relative_paths`), so that a checkout at another path gives the same key; a Pallas kernel's
line numbers stay in the program, so the key is the same for the same nljax source, not across
commits that move a kernel's lines. A file holds a header (format, key, SHA-256 of the rest)
then jax's serialized executable: a truncated or corrupted file is refused by the digest before
XLA reads any of it.

Not in the key: the CUDA, cuDNN and cuBLAS libraries the executable was built against, and
XLA's autotuning choices (docs/guides/gpu.md, "Executables compiled ahead"). Loading runs
jax's unpickler on the file: only load files you wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax

# the directory holding the nljax package, as imported (code objects name their files so)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV = "NLJAX_EXECUTABLES"
WRITE_ENV = "NLJAX_EXECUTABLES_WRITE"
SUFFIX = ".xla"
MAGIC = b"nljax-executable 1\n"

# XLA flags that change where XLA writes (dumps, caches) or where it finds CUDA, not the program
# it compiles: jax's persistent compilation cache keys leave these out too (jax/_src/cache_key.py).
# The autotuning cache's directory is among them: which tiles it holds is not checked (module
# docstring).
NEUTRAL_FLAGS = ("--xla_dump_", "--xla_force_host_platform_device_count", "--xla_gpu_cuda_data_dir",
                 "--xla_gpu_per_fusion_autotune_cache_dir", "--xla_gpu_experimental_autotune_cache_mode",
                 "--xla_gpu_experimental_autotuner_cache_dir", "--xla_gpu_dump_autotune",
                 "--xla_gpu_load_autotune_results_from")


@dataclass(frozen=True)
class Store:
    """Where executables are kept: whether one found there is loaded (`read`), and whether a
    compiled one is written there (`write`)."""

    directory: Path
    write: bool = False
    read: bool = True


@dataclass(frozen=True)
class Outcome:
    """How a step came to be: `loaded` is the file it was read from, None when it was compiled;
    `written`: the file a compiled step was saved to (None: not asked, or the save failed)."""

    loaded: Path | None = None
    written: Path | None = None


def store() -> Store | None:
    """The store `NLJAX_EXECUTABLES` (and `NLJAX_EXECUTABLES_WRITE`) name; None when unset."""
    directory = os.environ.get(ENV, "")
    if not directory:
        return None
    return Store(Path(directory), os.environ.get(WRITE_ENV, "") not in ("", "0"))


def xla_flags(flags: str | None = None) -> list[str]:
    """`XLA_FLAGS` (or `flags`) without NEUTRAL_FLAGS, in the order given."""
    words = (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split()
    return [w for w in words if not w.startswith(NEUTRAL_FLAGS)]


def program_text(lowered: jax.stages.Lowered) -> str:
    """The lowered program as text, without locations (file paths, line numbers, the Python
    names of the code that wrote each operation), its functions named in order (`canonical_names`).
    A Pallas kernel's Triton IR, embedded in the program as bytes, keeps its own locations: lower
    under `relative_paths` for them to name nljax's files relative to the checkout."""
    return canonical_names(lowered.as_text(debug_info=False))


_FUNCTION = re.compile(r"^  func\.func (?:public |private )?@([\w$.-]+)")
_SYMBOL = re.compile(r"@([\w$.-]+)")


def canonical_names(text: str) -> str:
    """`text`, a lowered module, with its functions compared by content, not by name: jax names
    a module's private functions (`_where_4`, `_where_12`) and shares one between identical call
    sites by what the process did before (seen with jax 0.11.2: the same step lowered after a
    loaded executable defined one `_where` twice where a fresh process defined it once), so the
    same program can be two texts. Here each function becomes its content's digest (its
    callees' digests in place of their names), functions of the same digest are one, and they
    follow the public ones in order of first call, named `<name less its numeric suffix>#<k>`.
    Other symbols (custom-call targets, the mesh) keep their names. The result is for digests,
    not for MLIR's parser."""
    lines = text.split("\n")
    starts = [n for n, line in enumerate(lines) if _FUNCTION.match(line)]
    if not starts:
        return text
    blocks: dict[str, list[str]] = {}
    order: list[str] = []  # as defined; the public ones are where calls start
    outside, n = [], 0  # the module's other lines (its attributes, the mesh), in order
    for start in starts:
        outside += lines[n:start]
        n = next(m for m in range(start + 1, len(lines)) if lines[m] == "  }") + 1
        name = _FUNCTION.match(lines[start]).group(1)
        blocks[name] = lines[start:n]
        order.append(name)
    outside += lines[n:]

    def callees(name: str) -> list[str]:
        body = "\n".join(blocks[name])
        return [c for c in dict.fromkeys(_SYMBOL.findall(body)) if c in blocks and c != name]

    digests: dict[str, str] = {}

    def digest(name: str, seen: frozenset = frozenset()) -> str:
        if name not in digests:
            if name in seen:  # recursion (jax lowers none): its name stands for it
                return name
            inner = {c: digest(c, seen | {name}) for c in callees(name)}
            body = _SYMBOL.sub(lambda m: "@" + ("SELF" if m.group(1) == name else inner.get(m.group(1), m.group(1))),
                               "\n".join(blocks[name]))
            digests[name] = hashlib.sha256(body.encode()).hexdigest()
        return digests[name]

    names: dict[str, str] = {}  # digest -> canonical name
    count: dict[str, int] = {}
    out, done = list(outside), set()
    queue = [n for n in order if " public " in blocks[n][0]]  # main; the calls start there
    # then any function no call reaches (jax lowers none), in an order of their own
    for pending in (queue, sorted(order, key=digest)):
        k = 0
        while k < len(pending):
            name, k = pending[k], k + 1
            if digest(name) in done:
                continue
            done.add(digest(name))
            for c in [name, *callees(name)]:
                if digest(c) not in names:
                    base = re.sub(r"_\d+$", "", c)
                    names[digest(c)] = f"{base}#{count.get(base, 0)}"
                    count[base] = count.get(base, 0) + 1
            pending += [c for c in callees(name) if digest(c) not in done]
            out += [_SYMBOL.sub(lambda m: "@" + names[digest(m.group(1))] if m.group(1) in blocks else m.group(0),
                                line) for line in blocks[name]]
    return "\n".join(out)


def relative_paths(where: Store | None) -> contextlib.AbstractContextManager:
    """Where steps are kept (`where` not None): lowering inside names nljax's source files from
    the checkout's root (nljax/models/memory_kernel.py), not by their absolute paths. A Pallas
    kernel's Triton IR keeps them in the program as bytes, which `as_text(debug_info=False)`
    does not remove (checked: titans_demo with memory_impl=parallel_pallas lowered for an H200
    held /work/wt/aot/nljax/models/memory_kernel.py), so that another checkout path would be
    another key. Through jax's own setting for this (`jax_hlo_source_file_canonicalization_regex`),
    for this lowering only; nothing changes where nothing is kept."""
    from jax._src import config as jax_config

    state = getattr(jax_config, "hlo_source_file_canonicalization_regex", None)
    if where is None or state is None:
        return contextlib.nullcontext()
    roots = dict.fromkeys((_ROOT, os.path.realpath(_ROOT)))
    return state("^(" + "|".join(re.escape(r + os.sep) for r in roots) + ")")


def key(lowered: jax.stages.Lowered, devices: Sequence[Any], flags: str | None = None) -> str:
    """The step's key (module docstring): 32 hexadecimal digits."""
    import jaxlib

    h = hashlib.sha256()
    for part in (f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}",
                 "platform " + ",".join(sorted({d.platform for d in devices})),
                 "devices " + ",".join(d.device_kind for d in devices),
                 "xla_flags " + " ".join(xla_flags(flags)), program_text(lowered)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def path(directory: Path, step_key: str) -> Path:
    return directory / f"{step_key}{SUFFIX}"


def encode(step_key: str, payload: bytes) -> bytes:
    """A file's bytes: MAGIC, the key, the payload's SHA-256 (a line each), the payload."""
    return MAGIC + step_key.encode() + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def decode(data: bytes, step_key: str) -> bytes:
    """The payload of a file's `data` for `step_key`; ValueError saying what is wrong."""
    if not data.startswith(MAGIC):
        raise ValueError("not an nljax executable file (or another format version)")
    head, _, rest = data[len(MAGIC):].partition(b"\n")
    digest, _, payload = rest.partition(b"\n")
    if head.decode(errors="replace") != step_key:
        raise ValueError(f"it holds the step keyed {head.decode(errors='replace')[:40]}, not {step_key}")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("its content does not match its digest (truncated or corrupted)")
    return payload


def serialize(compiled: jax.stages.Compiled, step_key: str) -> bytes:
    """`compiled` as a file's bytes (jax's serialized executable behind the header)."""
    from jax.experimental import serialize_executable

    payload, _, _ = serialize_executable.serialize(compiled)
    return encode(step_key, payload)


def load(file: Path, step_key: str, lowered: jax.stages.Lowered, devices: Sequence[Any]) -> jax.stages.Compiled:
    """The executable in `file` on `devices` (their order: the program's device assignment), with
    `lowered`'s argument and result structure (pytree definitions are not kept in the file)."""
    from jax.experimental import serialize_executable

    payload = decode(file.read_bytes(), step_key)
    return serialize_executable.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree,
                                                     backend=devices[0].client, execution_devices=list(devices))


def write(file: Path, data: bytes) -> None:
    """`data` into `file`, atomically: a temporary file beside it, renamed into place."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def warn(line: str) -> None:
    print(f"nljax: {line}", file=sys.stderr, flush=True)


def reason(e: BaseException) -> str:
    """An exception in one short line (XLA's messages run to many)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def compile_step(lowered: jax.stages.Lowered, devices: Sequence[Any],
                 where: Store | None) -> tuple[jax.stages.Compiled, Outcome]:
    """`lowered` compiled for `devices` (the program's device assignment, in order), or loaded
    from `where` (None: compiled, nothing read or written), and how (`Outcome`)."""
    if where is None:
        return lowered.compile(), Outcome()
    if jax.process_count() > 1:  # each process holds its own devices' executable: not kept here
        warn(f"{ENV} is not used in a run of {jax.process_count()} processes; compiling")
        return lowered.compile(), Outcome()
    step_key = key(lowered, devices)
    file = path(where.directory, step_key)
    if where.read and file.exists():
        try:
            return load(file, step_key, lowered, devices), Outcome(loaded=file)
        except Exception as e:  # noqa: BLE001 - whatever stops the load, the step compiles
            warn(f"{file}: not loaded ({reason(e)}); compiling")
    compiled = lowered.compile()
    if not where.write:
        return compiled, Outcome()
    try:
        write(file, serialize(compiled, step_key))
    except Exception as e:  # noqa: BLE001 - a step that cannot be saved still trains
        warn(f"{file}: not written ({reason(e)})")
        return compiled, Outcome()
    return compiled, Outcome(written=file)

