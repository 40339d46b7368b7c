"""Reads collectives out of compiled HLO text: op kind, replica groups, mesh axes, bytes.

The compiled program, not the Python that produced it, is the source of truth for what crosses
devices: XLA may combine, split or drop collectives.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# `%name = <result type> <op>(` where op may carry an async `-start` suffix.
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# jax 0.11's XLA prints a shard_map collective's groups by mesh axes: `replica_groups=mesh['inter'=2,
# 'intra'=4] {'intra'}` (the program's mesh, in its logical device order, then the axes a group spans)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


# A computation's header: `%name (params) -> type {`, the entry one prefixed with ENTRY.
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<kind>calls|to_apply|body|condition|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    dtype: str
    groups: tuple[tuple[int, ...], ...]
    axes: tuple[str, ...]  # mesh axes spanned by one group
    bytes: int  # full (unsharded) buffer per device: what is reduced or gathered
    wire_bytes: float  # bytes each device sends with ring algorithms
    count: int = 1  # times one call of the program runs it: the trip counts of the loops around it

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1


def _shapes(type_text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array shape in an HLO type, tuples flattened."""
    out = []
    for dt, dims in _SHAPE.findall(type_text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((dt, n * DTYPE_BYTES[dt]))
    return out


def _result(op: str, is_start: bool, type_text: str) -> tuple[str, int]:
    """dtype and bytes of a collective's result. Async `-start` ops of all-gather and
    collective-permute return (operands..., results..., [context]): keep the results only."""
    shapes = _shapes(type_text)
    if is_start and len(shapes) > 1:  # async context scalars (u32[]/s32[]) are not data
        shapes = [x for x in shapes if not (x[0] in ("u32", "s32") and x[1] == 4)] or shapes
    if is_start and op in ("all-gather", "reduce-scatter", "all-to-all") and len(shapes) > 1:
        shapes = shapes[len(shapes) // 2 :]
    elif is_start and op == "collective-permute" and len(shapes) > 1:
        shapes = shapes[1:2]
    return (shapes[-1][0] if shapes else "f32"), sum(b for _, b in shapes)


def _mesh_groups(line: str) -> tuple[tuple[tuple[int, ...], ...], dict[str, int]] | None:
    """The groups of a collective whose groups are printed by mesh axes (`_GROUPS_MESH`), as
    logical device ids of that mesh, and the mesh's shape; None for the other forms."""
    m = _GROUPS_MESH.search(line)
    if not m:
        return None
    shape = {name: int(n) for name, n in re.findall(r"'([^']*)'=(\d+)", m.group(1))}
    over = [n for n in re.findall(r"'([^']*)'", m.group(2)) if n in shape]
    names = list(shape)
    order = [names.index(n) for n in names if n not in over] + [names.index(n) for n in over]
    ids = np.arange(int(np.prod(list(shape.values())))).reshape(list(shape.values())).transpose(order)
    size = int(np.prod([shape[n] for n in over]))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size)), shape


def _groups(line: str, n_devices: int) -> tuple[tuple[int, ...], ...]:
    m = _GROUPS_IOTA.search(line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(x) for x in m.group(2).split(",")]))).reshape(
            [int(x) for x in m.group(2).split(",")]
        )
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    m = _GROUPS_LIST.search(line)
    if m and m.group(1).strip():
        return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
    m = _PAIRS.search(line)
    if m:
        return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1)))
    return (tuple(range(n_devices)),)


def _axes(group: tuple[int, ...], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array([np.unravel_index(i, sizes) for i in group])
    return tuple(n for k, n in enumerate(names) if len(set(coords[:, k])) > 1)


def _computations(hlo_text: str) -> tuple[str | None, dict[str | None, list[str]]]:
    """(the entry computation's name, each computation's instruction lines; under None the lines
    before any header, e.g. a single instruction given alone)."""
    entry, comps, current = None, {None: []}, None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h["name"]
            comps[current] = []
            entry = current if h["entry"] else entry
        else:
            comps[current].append(line)
    return entry, comps


def _runs(entry: str | None, comps: dict[str | None, list[str]]) -> dict[str | None, int]:
    """How many times one call of the program runs each computation: a while loop's body runs
    its known trip count (XLA's `known_trip_count`; 1 where it is not known) times per run of
    the computation holding the loop; any other callee once per call."""
    callers: dict[str | None, list[tuple[str | None, int]]] = {c: [] for c in comps}
    for comp, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            callees = [(m["name"], int(trip[1]) if trip and m["kind"] == "body" else 1) for m in _CALLEE.finditer(line)]
            branches = _BRANCHES.search(line)
            callees += [(n, 1) for n in re.findall(r"%?([\w.\-]+)", branches[1])] if branches else []
            for callee, times in callees:
                if callee in callers:
                    callers[callee].append((comp, times))
    runs: dict[str | None, int] = {}

    def count(comp: str | None) -> int:  # HLO's call graph has no cycles
        if comp not in runs:
            runs[comp] = 1 if comp == entry or not callers[comp] else sum(count(c) * t for c, t in callers[comp])
        return runs[comp]

    for comp in comps:
        count(comp)
    return runs


def loop_trips(hlo_text: str) -> list[int | None]:
    """The trip count of every while loop in the program (None where XLA does not know it)."""
    return [int(t[1]) if (t := _TRIP.search(line)) else None
            for line in hlo_text.splitlines() if re.search(r"\swhile\(", line)]


def collectives(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective in `hlo_text` that moves data (groups of one device are dropped), with
    the number of times one call runs it (`count`: inside loops, their trip counts)."""
    n_devices = int(np.prod(list(mesh_shape.values())))
    entry, comps = _computations(hlo_text)
    runs = _runs(entry, comps)
    out = []
    for comp, line in ((c, l) for c, lines in comps.items() for l in lines):
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group("op")
        groups, shape = _mesh_groups(line) or (_groups(line, n_devices), mesh_shape)
        g = len(groups[0]) if groups else 1
        if g <= 1:
            continue
        dtype, result = _result(op, bool(m.group("start")), m.group("type"))
        if op == "reduce-scatter":
            full, wire = result * g, result * (g - 1)
        elif op == "all-gather":
            full, wire = result, result * (g - 1) / g
        elif op == "all-reduce":
            full, wire = result, 2 * result * (g - 1) / g
        elif op == "all-to-all":
            full, wire = result, result * (g - 1) / g
        else:  # collective-permute: every device sends its buffer once
            full, wire = result, result
        out.append(Collective(op, dtype, groups, _axes(groups[0], shape), int(full), float(wire), runs[comp]))
    return out


def ring_all_reduce_bytes(nbytes: int, n: int) -> float:
    """Per-device bytes sent by a ring all-reduce of `nbytes` over `n` devices."""
    return 2 * nbytes * (n - 1) / n if n > 1 else 0.0


# Instructions that launch nothing on a GPU: they name, group or reinterpret buffers, or run other
# computations (whose instructions are counted there); an async operation's `-done` (and
# `-update`) waits for what its `-start` launched.
_NO_LAUNCH = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
    "add-dependency", "partition-id", "replica-id", "domain", "while", "conditional", "call",
}  # fmt: skip
_COPIES = ("copy", "copy-start", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "transpose", "pad")
# an instruction's opcode: the first `name(` after its result's type (`%x = f32[2]{0} add(...)`)
OPCODE = re.compile(r"(?:^|[\s)\]}])([a-z][\w\-]*)\(")


def opcode(line: str) -> str | None:
    """The opcode of an instruction line (`%x = f32[2]{0} add(...)`), None for any other line."""
    _, eq, rest = line.partition(" = ")
    m = OPCODE.search(rest) if eq else None
    return m.group(1) if m else None


def _run_on_device(line: str) -> list[str]:
    """The computations an instruction has the device run instruction by instruction: a loop's
    body and condition, a conditional's branches, a call's target (not a fusion's body, a kernel,
    nor a reduction's or sort's scalar function, also named `to_apply`)."""
    kinds = ("body", "condition", "true_computation", "false_computation")
    names = [m["name"] for m in _CALLEE.finditer(line)
             if m["kind"] in kinds or m["kind"] == "to_apply" and opcode(line) == "call"]
    return names + (re.findall(r"%?([\w.\-]+)", b[1]) if (b := _BRANCHES.search(line)) else [])


def launching(hlo_text: str):
    """(kind, times, instruction line) of each kernel launch one call of a compiled XLA:GPU
    program makes, read from its scheduled HLO: every instruction of a computation the device
    runs (from the entry down, `_run_on_device`; not loop conditions, see 'loop') that does more
    than name buffers (`_NO_LAUNCH`), `times` the runs of its computation (the known trip counts
    of the loops around it). Kinds: 'fusion' (XLA's own kernels, also its Triton matmuls),
    'library' (custom calls: cuBLAS, cuDNN, a Pallas kernel), 'copy' (copies, unfused slices and
    transposes), 'collective' (also an async start wrapping one), 'other' (any other unfused
    instruction) and 'loop': a loop of unknown trip count, whose condition is a kernel and a copy
    of its predicate to the host per iteration (counted once, as one iteration; XLA:GPU runs a
    loop of known trip count without its condition). In the text's order of computations."""
    entry, comps = _computations(hlo_text)
    runs = _runs(entry, comps)
    executed, conditions, todo = {entry}, set(), [entry]
    while todo:
        for line in comps.get(todo.pop(), ()):
            conditions.update(m["name"] for m in _CALLEE.finditer(line) if m["kind"] == "condition")
            new = [n for n in _run_on_device(line) if n in comps and n not in executed]
            executed.update(new)
            todo += new
    for comp in [c for c in comps if c in executed and c not in conditions]:
        for line in comps[comp]:
            op = opcode(line)
            if op == "while" and not _TRIP.search(line):
                yield "loop", 2 * runs[comp], line
            if op is None or op in _NO_LAUNCH or op.endswith(("-done", "-update")):
                continue
            if op == "async-start":  # the op it wraps decides the kind
                wrapped = next((m["name"] for m in _CALLEE.finditer(line) if m["kind"] == "calls"), None)
                inner = {opcode(l) for l in comps.get(wrapped, ())}
                op = next((o for o in inner if o and o.removesuffix("-start") in _OPS), "async-start")
            kind = ("fusion" if op == "fusion" else "library" if op == "custom-call"
                    else "collective" if op.removesuffix("-start") in _OPS
                    else "copy" if op in _COPIES else "other")
            yield kind, runs[comp], line


def launches(hlo_text: str) -> dict[str, int]:
    """Kernels one call of a compiled XLA:GPU program launches, by kind (`launching`).

    An estimate of the kernels the profiler counts (`nljax.measure.traces`, `ops`): a library
    call may launch more than one kernel (cuBLAS's workspace memset, a split reduction), a
    conditional runs one branch where this counts all. Read it as a comparison between programs
    compiled by the same XLA."""
    out = {"fusion": 0, "library": 0, "copy": 0, "collective": 0, "other": 0, "loop": 0}
    for kind, times, _ in launching(hlo_text):
        out[kind] += times
    return out
