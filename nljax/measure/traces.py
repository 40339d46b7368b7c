"""Where a step's device time goes, read from a jax.profiler trace.

A benchmark that misses its target should say why (issue 17). `record` runs a few steps under
`jax.profiler` with a Perfetto trace; `summarize` reads that trace and gives, per step and
device:

- `ops`: XLA op executions (on a GPU: kernels), and their median duration;
- `busy_s`: the time during which at least one of them runs (the union of their intervals), and
  `busy_fraction` = busy / the measured step time. A device busy for a small part of its step is
  waiting on kernel launches, host round trips (a `while` loop's predicate) or the input, not
  computing: that step is latency-bound, and larger kernels, not faster ones, are the fix. The
  profiler slows the host's side (on a GPU, each launch), so the step it measures can be much
  longer than the step without it (titans_demo on an H200: 46.9 against 21.8 ms): given
  `timed_step_s`, the step without the profiler, the summary shows both. For `record`'s and
  `trace`'s steps, each marked (`STEP_EVENT`, below), the measured step time is the marks' mean,
  not the wall clock around the recording, which can hold the profiler's own start
  (`wall_step_s` keeps that);
- `by_category`: op time in matmuls, collectives, copies, control flow (XLA:CPU's `while`), and
  the rest (fusions), by op and kernel names (`CATEGORIES`);
- `top`: the ops that take the most time, and `top_kinds` the same by kind of op (the name
  without XLA's numeric suffix: all `fusion.N` together);
- `idle`, for a trace whose steps the host marked (`STEP_EVENT`, from the step's dispatch to its
  result: `record`, and a training run's steps; a training step dispatched ahead of the next,
  until the next one's dispatch): where the device waited during each: before its first op (the
  host's dispatch of the step, the first launch; not while an op of the step before still
  runs), between its ops (by gap length: a launch's latency is a few microseconds, a host round
  trip tens), after its last op (the result's way back), and the longest gaps with the ops on
  either side. titans_demo on an H200
  was idle 8.6 ms of a 27.8 ms step with 1,475 kernels per step: not launch gaps alone;
- `by_scope`, given the compiled program's HLO text: op time by where in the model it was
  written, read from each instruction's `op_name` metadata (JAX's name stack): the pass
  (forward: `jvp(...)`, backward: `transpose(...)`, or `step`: the loss's reduction, the
  optimizer, collectives outside the model) and the model's modules (`mem1` -> `mem`,
  `block0/cms1` -> `block/cms`). A kernel inside a CUDA command buffer, which the profiler tags
  with the buffer and its kernel name only, is found by that name or, for a library kernel
  (cuBLAS, memcpy, Pallas), by the HLO schedule (`place`); an op XLA made up (a copy of loop
  state) takes its users' or its loop's; `?` where nothing identifies the op.

Op events are those the runtime tags with `args.hlo_op`: XLA:GPU's kernels on the device's
stream lanes, XLA:CPU's thunks on its worker threads. A GPU device process also has derived
lanes ("XLA Ops", "XLA Modules") that repeat the same time per HLO op; when a process has lanes
named "Stream ...", only those count. On a CPU, ops of one program may run on several threads at
once (intra-op parallelism), and a loop's `while` op there spans part of its body's ops, so op
time may exceed busy time.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import jax

from nljax.measure.hlo import OPCODE  # an instruction's opcode, after its shape

# The compiled module of the train step (nljax.engine.step names its function train_step): a profile of
# training steps counts its ops only, not those of evaluation, checkpoints or sampling between them.
TRAIN_MODULE = "jit_train_step"

# The host's mark around each profiled step (`record`): the window whose idle time `idle` splits.
STEP_EVENT = "nljax_step"
# Idle gaps between a step's ops, by length (microseconds): up to a launch's latency, up to a few
# launches or a short host round trip, and longer.
GAP_BUCKETS_US = (5.0, 50.0)

# Op name fragments, lower case, first match wins (XLA:GPU kernel and HLO names; XLA:CPU thunks).
CATEGORIES = (
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "nccl")),
    ("matmul", ("dot", "gemm", "cublas", "convolution", "nvjet", "cutlass", "xnn", "ynn")),
    ("control", ("while", "conditional")),
    ("copy", ("copy", "memcpy", "memset", "transpose", "dynamic-update-slice", "dynamic-slice", "concatenate")),
)


# JAX's structural names in a name stack, and nljax's container of scanned layers (`units`): not
# modules of the model
STRUCTURAL = {"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation", "remat", "scan", "pjit",
              "custom_jvp_call", "custom_vjp_call", "branch_0_fun", "branch_1_fun", "eval_jaxpr", "shard_map", "units"}
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+)\s+=\s.*?metadata=\{[^}]*?op_name="([^"]*)"', re.M)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata, from a compiled program's text (`as_text()`)."""
    return {m.group(1): m.group(2) for m in _INSTRUCTION.finditer(hlo_text)}


@functools.lru_cache(maxsize=None)  # per distinct op_name, not per profiled op (tens of thousands per step)
def scope(op_name: str | None) -> str:
    """'forward mem', 'backward block/cms', 'step' ...: the pass and the model's (first two)
    modules an op was written in; '?' for none. The name stack is transforms (`jvp(NLNet)`,
    `vmap(...)`), the model's own name, its module path, and the primitive last."""
    if not op_name:
        return "?"
    pass_ = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "step"
    if pass_ == "step":
        return pass_
    # modules are plain identifiers: not a method's scope ("NLNet.scanned"), nor the equation
    # jnp.einsum names its scope after ("bhti,bhio->bhto"); a remat'd module repeats its name
    modules = []
    for p in op_name.split("/")[:-1]:
        if "(" not in p and p not in STRUCTURAL and re.fullmatch(r"[A-Za-z_]\w*", p):
            m = re.sub(r"_?\d+$", "", p)
            if not modules or modules[-1] != m:
                modules.append(m)
    return " ".join([pass_, "/".join(modules[:2])]).strip()


_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s+=\s+(.*)$")
_CALLED = re.compile(r"(?:to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSED = re.compile(r"\bcalls=%?([\w.\-]+)")  # a fusion's computation: one kernel, not scheduled


def _callees(rest: str):
    """The computations an instruction runs as loops, calls or branches (not fusions: `_FUSED`)."""
    for c in _CALLED.finditer(rest):
        yield from [c.group(1)] if c.group(1) else re.findall(r"%?([\w.\-]+)", c.group(2))


def fused_computations(comps: dict) -> set[str]:
    """The computations that fusions call (`computations`' keys), which are kernels' bodies."""
    return {m for ins in comps.values() for _, rest in ins for m in _FUSED.findall(rest)}


def computations(hlo_text: str) -> dict[str, list[tuple[str, str]]]:
    """Computation -> its instructions (name, the rest of the line), in the text's order: in a
    scheduled module (`is_scheduled=true`, what a compiled program prints), the execution order.
    A computation's header starts its line (instructions are indented) and ends in `{`."""
    comps: dict[str, list[tuple[str, str]]] = {}
    lines_of: list[tuple[str, str]] | None = None
    for line in hlo_text.splitlines():
        if line[:1] not in (" ", "}", "") and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            lines_of = comps.setdefault(re.match(r"(?:ENTRY\s+)?%?([^\s(]+)", line).group(1), [])
        elif lines_of is not None and (m := _LINE.match(line)):
            lines_of.append(m.groups())
    return comps


def command_buffers(hlo_text: str) -> dict[str, list[tuple[str, str]]]:
    """Command buffer -> (category, op_name) of each instruction with metadata that it runs.

    XLA:GPU outlines runs of kernels into a computation `command_buffer...` called once as a CUDA
    graph; the profiler tags every kernel inside with the buffer's name, so neither the HLO op
    nor, for library kernels (cuBLAS's `nvjet_*`, `memcpy*`), the kernel's name finds the
    instruction. The buffer is known by its computation's name and by its call instruction's,
    each also with `_N` for `.N` (the profiler's spelling); loops and conditionals inside it
    count with it (the called computations, not the fused ones: a fusion carries its own
    metadata)."""
    comps = computations(hlo_text)

    def contents(comp: str, seen: set) -> list[tuple[str, str]]:
        if comp in seen or comp not in comps:
            return []
        seen.add(comp)
        out = []
        for name, rest in comps[comp]:
            if m := _OP_NAME.search(rest):  # its category by its name, opcode and library call
                opcode, target = OPCODE.search(rest), _TARGET.search(rest)
                what = f"{name} {opcode.group(1) if opcode else ''} {target.group(1) if target else ''}"
                out.append((category(what), m.group(1)))
            for callee in _callees(rest):
                out += contents(callee, seen)
        return out

    inside = {c: contents(c, set()) for c in comps if c.startswith("command_buffer")}
    found: dict[str, list[tuple[str, str]]] = {}
    for comp, ops in inside.items():  # by the computation's name, in both spellings
        found[comp] = found[re.sub(r"\.(\d+)$", r"_\1", comp)] = ops
    for lines in comps.values():  # and by the names of the instructions that call it
        for name, rest in lines:
            if (c := re.search(r"\bcall\(.*to_apply=%?(command_buffer[\w.\-]*)", rest)) and c.group(1) in inside:
                found[name] = found[name.replace(".", "_")] = inside[c.group(1)]
    return found


def op_scope(names: dict[str, str], hlo_op: str, kernel: str,
             buffers: dict[str, list[tuple[str, str]]] | None = None) -> str:
    """The scope of a profiled op: by its HLO op, else by the kernel's name (XLA:GPU names a
    fusion's kernel after it, `_` for `.`), else, for a kernel inside a command buffer
    (`command_buffers`), by the buffer's instructions of the kernel's category (a cuBLAS kernel:
    its matmuls; a memcpy: its copies): their one scope, or theirs joined by ` | ` when the
    buffer runs ops of several (the kernel is one of them, the profile cannot say which)."""
    for n in (hlo_op, kernel, re.sub(r"_(\d+)$", r".\1", kernel)):
        if n in names:
            return scope(names[n])
    inside = (buffers or {}).get(hlo_op)
    if not inside:
        return "?"
    cat = category(kernel)
    same = [op for c, op in inside if c == cat] or [op for _, op in inside]
    return " | ".join(sorted({scope(op) for op in same}))


# What a kernel with no HLO name of its own runs, by its name: the kind of instruction to look for
def kernel_kind(kernel: str) -> str:
    """'memset' (cuBLAS clears its workspace before a matmul), 'copy' (a memcpy kernel or node),
    'fusion' (XLA names a fusion's kernel after it: `loop_add_fusion_3`, `wrapped_transpose`,
    `gemm_fusion_dot_2`), 'gemm' (cuBLAS's own kernels) or 'custom' (any other: a Pallas kernel
    is named after its function, `attention_dq`)."""
    low = kernel.lower()
    if low.startswith("memset"):
        return "memset"
    if "memcpy" in low:
        return "copy"
    if re.search(r"(^|_)fusion(_|$)", low) or low.startswith("wrapped_"):
        return "fusion"
    return "gemm" if any(k in low for k in ("nvjet", "cutlass", "gemm", "cublas", "xmma")) else "custom"


def _kind(opcode: str, target: str) -> str:  # an instruction's, in kernel_kind's terms
    if opcode == "custom-call":
        return "gemm" if "cublas" in target.lower() else "custom"
    # an async dynamic-(update-)slice fusion is a memcpy (a MemcpyD2D thunk, or memcpy kernels in a buffer)
    return {"copy": "copy", "copy-start": "copy", "fusion-start": "copy", "fusion": "fusion"}.get(opcode, "")


class Program:
    """A compiled program's scheduled computations (the fused ones left out: a fusion is one
    kernel), to place the kernels the profile cannot name.

    `named`: kernel name -> its instructions' places (computation, index): an instruction's name,
    also with `_N` for `.N` (XLA:GPU's kernel names), and the `deduplicated_name` of instructions
    that share another's kernel (XLA compiles identical fusions once). `op_name(c, i)`: the
    instruction's metadata, or, for one without, its users' or its caller's."""

    def __init__(self, hlo_text: str):
        comps = computations(hlo_text)
        self.names = op_names(hlo_text)
        self.buffers = command_buffers(hlo_text) if "command_buffer" in hlo_text else {}
        fused = fused_computations(comps)
        self.code: dict[str, list[tuple[str, str, str | None]]] = {}  # computation -> (name, kind, op_name)
        self.named: dict[str, list[tuple[str, int]]] = {}
        self._caller: dict[str, tuple[str, int]] = {}  # computation -> the instruction calling it
        self._users: dict[str, dict[int, list[int]]] = {}  # computation -> instruction -> its users
        self._naming: dict[str, list[tuple[str, int]]] = {}
        for comp, lines in comps.items():
            if comp in fused:
                continue
            code, users, index = self.code.setdefault(comp, []), self._users.setdefault(comp, {}), {}
            for i, (name, rest) in enumerate(lines):
                index[name] = i
                for operand in set(re.findall(r"%([\w.\-]+)", rest)):
                    if operand in index:
                        users.setdefault(index[operand], []).append(i)
                opcode, target, op = OPCODE.search(rest), _TARGET.search(rest), _OP_NAME.search(rest)
                code.append((name, _kind(opcode.group(1) if opcode else "", target.group(1) if target else ""),
                             op.group(1) if op else None))
                dedup = re.search(r'deduplicated_name="([^"]*)"', rest)
                for n in {name, name.replace(".", "_"), *((dedup.group(1), dedup.group(1).replace(".", "_"))
                                                          if dedup else ())}:
                    self.named.setdefault(n, []).append((comp, i))
                for callee in _callees(rest):
                    self._caller[callee] = (comp, i)

    def naming(self, kernel: str) -> list[tuple[str, int]]:
        """The Pallas/custom calls whose op_name names `kernel` (Pallas names both after the function)."""
        if kernel not in self._naming:
            self._naming[kernel] = [(c, j) for c, code in self.code.items() for j, (_, k, op) in enumerate(code)
                                    if k == "custom" and f"/{kernel}/" in (op or "")]
        return self._naming[kernel]

    def op_name(self, comp: str, i: int) -> str | None:
        """The instruction's op_name; for one without (XLA's own: copies of loop state, the zeros
        a loop's buffers start from), that of the nearest of its users (in its computation) with
        one, else that of the loop or call running its computation."""
        code, seen, todo = self.code[comp], {i}, [i]
        for j in todo:  # breadth first through the users
            if code[j][2] is not None:
                return code[j][2]
            todo += [u for u in self._users[comp].get(j, ()) if u not in seen and not seen.add(u)]
        return self.op_name(*self._caller[comp]) if comp in self._caller else None

    def step(self, at: tuple[str, int], kind: str, kernel: str, by: int) -> tuple[str, int] | None:
        """The next instruction of `kind` after `at` in its computation's execution order (`by` 1;
        -1: the one before); of Pallas/custom calls, the nearest whose op_name names the kernel,
        if one does."""
        comp, i = at
        code = self.code[comp]
        span = range(i + 1, len(code)) if by > 0 else range(i - 1, -1, -1)
        for named in ((True, False) if kind == "custom" else (False,)):
            j = next((j for j in span if code[j][1] == kind
                      and (not named or f"/{kernel}/" in (code[j][2] or ""))), None)
            if j is not None:
                return comp, j
        return None


def _walk(program: Program, events: list[dict], by: int) -> list[list[tuple[str, int]]]:
    """The places of one command-buffer execution's kernels (in time order, `by` 1; reversed, -1):
    a named kernel's, the one nearest after the last placed one (in that direction) when several
    share its name; an unnamed kernel's, the nearest instruction of its kind after that."""
    out, last = [], None
    for e in events:
        kernel = e["name"]
        places = program.named.get(kernel)  # `named` holds both spellings, `.N` and `_N`
        hlo_op = e["args"]["hlo_op"]
        if not places and "cuda_graph_id" not in e["args"] and hlo_op not in program.buffers:
            places = program.named.get(hlo_op)  # a thunk of its own: its instruction
        if places and last:
            places = [p for p in places if p[0] == last[0] and (p[1] - last[1]) * by > 0][::by][:1] or places
        elif not places and last and (k := kernel_kind(kernel)) != "memset":
            places = [p] if (p := program.step(last, k, kernel, by)) else []
        elif not places and kernel_kind(kernel) == "custom":  # none placed yet: a Pallas call names it
            places = program.naming(kernel)
        if len(places or ()) == 1:
            last = places[0]
        out.append(places or [])
    return out


def place(ops: list[dict], program: Program) -> list[str]:
    """The scope of each op event (in the order given). In turn: the op's HLO instruction; the
    profiler's own op_name (`args.name`, given for ops outside command buffers); the kernel's name
    (an instruction's, or the `deduplicated_name` of those sharing the kernel: the one next in the
    schedule, else all their scopes); and for a kernel with no such name inside a CUDA command
    buffer (cuBLAS's, a memcpy, a Pallas kernel), the schedule: a buffer runs consecutive
    instructions of one computation in their order, so the next instruction of the kernel's kind
    after the last placed kernel of this execution of the buffer (or, before the first, the one
    before the first placed). A memset takes the place of the kernel after it (cuBLAS clears its
    workspace before a matmul). Failing all, `op_scope` (a buffer's computation in older XLAs), else '?'."""
    names, out = program.names, ["?"] * len(ops)
    runs: dict = {}  # an execution of a command buffer (else the op itself) -> its events, in time order
    for n in sorted(range(len(ops)), key=lambda n: ops[n]["ts"]):
        args = ops[n]["args"]
        if args["hlo_op"] in names or "name" in args:
            out[n] = scope(names.get(args["hlo_op"]) or args["name"])
        else:
            runs.setdefault((args["hlo_op"], args.get("correlation_id")) if "cuda_graph_id" in args else n, []).append(n)
    for run in runs.values():
        events = [ops[n] for n in run]
        ahead, back = _walk(program, events, 1), _walk(program, events[::-1], -1)[::-1]
        for j, n in enumerate(run):
            # one instruction found either way (a shared kernel's name can give several), else any
            if (places := next((p for p in (ahead[j], back[j]) if len(p) == 1), ahead[j] or back[j])):
                out[n] = " | ".join(sorted({scope(program.op_name(*p)) for p in places}))
            elif kernel_kind(ops[n]["name"]) != "memset":
                out[n] = op_scope(names, ops[n]["args"]["hlo_op"], ops[n]["name"], program.buffers)
        for j, n in list(enumerate(run))[-2::-1]:  # a memset: the kernel after it
            if kernel_kind(ops[n]["name"]) == "memset":
                out[n] = out[run[j + 1]]
    return out


def category(name: str) -> str:
    low = name.lower().replace("_", "-")  # XLA:CPU writes dynamic_update_slice, XLA:GPU dynamic-update-slice
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def record(step: Callable, state, batch, n: int, directory: Path):
    """Runs `step` n times under the profiler into `directory`, each step waited for; returns
    (state, seconds per step)."""

    def steps(state):
        for i in range(n):
            with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=i):  # `idle`'s window
                state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
        return state

    return trace(steps, state, n, directory)


def trace(steps: Callable, state, n: int, directory: Path):
    """Runs `steps(state)`, n steps that mark themselves with STEP_EVENT (as `record` and the
    training loop do), under the profiler into `directory`; returns (its state, seconds per step)."""
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True)
    try:
        t0 = time.perf_counter()
        state = jax.block_until_ready(steps(state))
        seconds = (time.perf_counter() - t0) / n
    finally:
        jax.profiler.stop_trace()
    return state, seconds


def load_events(directory: Path) -> list[dict]:
    """The events of the newest Perfetto trace under `directory`."""
    found = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(found[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def op_events(events: list[dict]) -> dict[str, list[dict]]:
    """device -> its op events (complete events tagged with an HLO op), by the rules above."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    stream_procs = {pid for (pid, _), name in threads.items() if name.startswith("Stream")}
    out: dict[str, list[dict]] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        pid = e["pid"]
        if pid in stream_procs and not threads.get((pid, e.get("tid")), "").startswith("Stream"):
            continue
        name = procs.get(pid, str(pid))
        device = name if name.startswith("/device:") else f"{name} device {args.get('device_ordinal', '?')}"
        out.setdefault(device, []).append(e)
    return out


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def step_windows(events: list[dict]) -> list[tuple[float, float]]:
    """The (start, end) of each step `record` marked, in trace time, in order."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events
                  if e.get("ph") == "X" and e.get("name") == STEP_EVENT)


def idle_summary(ops: list[dict], windows: list[tuple[float, float]], scopes: list | None = None,
                 top: int = 5) -> dict | None:
    """Where the device waited in each step window (module docstring, `idle`), per step, in
    seconds; None when no window holds an op. `scopes`: each op's place in the model, for the
    longest gaps' neighbours."""
    us = 1e-6
    lead = inside = tail = 0.0
    buckets = [[0, 0.0] for _ in range(len(GAP_BUCKETS_US) + 1)]
    gaps: list[tuple[float, int, int]] = []  # (length, index of the op before, of the op after)
    order = sorted(range(len(ops)), key=lambda i: ops[i]["ts"])
    counted = 0
    for w0, w1 in windows:
        mine = [i for i in order if w0 <= ops[i]["ts"] < w1]
        if not mine:
            continue
        counted += 1
        # the device busy past the window's start with an earlier op (the step before, where the
        # next was dispatched ahead of its end: training's marks) was not waiting until it ended
        busy_until = max((ops[i]["ts"] + ops[i].get("dur", 0.0) for i in order if ops[i]["ts"] < w0), default=w0)
        lead += max(ops[mine[0]]["ts"] - max(w0, busy_until), 0.0)
        end, last = ops[mine[0]]["ts"], mine[0]  # the latest end so far, and whose it is
        for i in mine:
            s, e = ops[i]["ts"], ops[i]["ts"] + ops[i].get("dur", 0.0)
            if s > end:
                gap = s - end
                inside += gap
                b = sum(gap >= edge for edge in GAP_BUCKETS_US)
                buckets[b][0] += 1
                buckets[b][1] += gap
                gaps.append((gap, last, i))
            if e >= end:
                end, last = e, i
        tail += max(w1 - end, 0.0)
    if not counted:
        return None
    name = lambda i: ops[i]["args"]["hlo_op"] + (f" ({scopes[i]})" if scopes and scopes[i] else "")
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    return {
        "steps": counted,
        "before_first_op_s": lead * us / counted,
        "between_ops_s": inside * us / counted,
        "after_last_op_s": tail * us / counted,
        "gaps": [{"from_us": edges[k], "to_us": edges[k + 1], "per_step": n / counted, "s": total * us / counted}
                 for k, (n, total) in enumerate(buckets)],
        "longest": [{"us": g, "after": name(a), "before": name(b)} for g, a, b in sorted(gaps, reverse=True)[:top]],
    }


def kind(op: str) -> str:
    """The op's name without XLA's numeric suffixes: fusion.12.3 -> fusion."""
    parts = op.split(".")
    while len(parts) > 1 and parts[-1].isdigit():
        parts.pop()
    return ".".join(parts)


def device_summary(ops: list[dict], steps: int, step_s: float, top: int, program: Program | None = None,
                   windows: list[tuple[float, float]] = ()) -> dict:
    us = 1e-6  # trace times are in microseconds
    busy = busy_time([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ops]) * us / steps
    by_cat: dict[str, float] = {}
    by_op: dict[str, list] = {}
    by_kind: dict[str, list] = {}
    by_scope: dict[str, float] = {}
    scopes = place(ops, program) if program is not None else [None] * len(ops)
    for e, where in zip(ops, scopes):
        name = e["args"]["hlo_op"]
        dur = e.get("dur", 0.0) * us
        cat = category(f"{name} {e['name']}")  # the HLO op, and the kernel's name on a GPU
        by_cat[cat] = by_cat.get(cat, 0.0) + dur / steps
        if program is not None:
            by_scope[where] = by_scope.get(where, 0.0) + dur / steps
        for acc in (by_op.setdefault(name, [0.0, 0, {}]), by_kind.setdefault(kind(name), [0.0, 0, {}])):
            acc[0] += dur / steps
            acc[1] += 1
            acc[2][cat] = acc[2].get(cat, 0.0) + dur  # a command buffer runs kernels of several kinds
    idle = idle_summary(ops, list(windows), scopes if program is not None else None)
    # each op's category: the one holding most of its time
    ranked = lambda d: [{"op": k, "s": v[0], "calls": v[1] / steps, "category": max(v[2], key=v[2].get)}
                        for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return {
        "ops": len(ops) / steps,
        "median_op_us": statistics.median(e.get("dur", 0.0) for e in ops) if ops else 0.0,
        "busy_s": busy,
        "busy_fraction": busy / step_s if step_s > 0 else None,
        "by_category_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top": ranked(by_op),
        "top_kinds": ranked(by_kind),
        **({"by_scope_s": dict(sorted(by_scope.items(), key=lambda kv: -kv[1]))} if program is not None else {}),
        **({"idle": idle} if idle else {}),
    }


def summarize(directory: Path, steps: int, step_s: float, top: int = 8, module: str | None = TRAIN_MODULE,
              hlo_text: str | None = None, timed_step_s: float | None = None, from_marks: bool = False) -> dict:
    """Per step of the recorded `steps` (measured at `step_s` seconds each): the summary of the
    first device, and how many devices the trace holds (SPMD: each runs the same program).
    `module`: count only that compiled program's ops (all when the trace names none of them so:
    `module` in the result is then None). `hlo_text`: that program's, for `by_scope_s`;
    `timed_step_s`: the step's time measured without the profiler. `from_marks`: `step_s` is the
    wall clock around the recording (`record`, `trace`), and the steps' marks give the step time
    where every step has one; not for a training run's window, whose marks can hold a compile."""
    events = load_events(directory)
    per_device = op_events(events)
    if not per_device:
        raise ValueError(f"the trace under {directory} holds no XLA op events")
    first = sorted(per_device)[0]
    ops = [e for e in per_device[first] if e["args"].get("hlo_module") == module]
    if not ops:
        ops, module = per_device[first], None
    windows = step_windows(events)
    wall = {}
    if from_marks and len(windows) == steps and step_s:
        # the steps' own marks, not the wall time around them: that held the profiler's start on
        # the card (the first of ab.py's variants, H200 2026-11-30: 449 ms a step by the wall
        # clock, 44 ms by its marks, its device "busy 3%")
        wall, step_s = {"wall_step_s": step_s}, sum(w1 - w0 for w0, w1 in windows) * 1e-6 / steps
    return {"device": first, "devices": len(per_device), "module": module, "steps": steps, "step_s": step_s,
            **wall, **({"timed_step_s": timed_step_s} if timed_step_s else {}),
            **device_summary(ops, steps, step_s, top, Program(hlo_text) if hlo_text else None, windows)}


def format_summary(s: dict) -> list[str]:
    ms = lambda x: f"{x * 1e3:,.2f} ms"
    frac = "-" if s["busy_fraction"] is None else f"{100 * s['busy_fraction']:.0f}%"
    cats = ", ".join(f"{k} {ms(v)}" for k, v in s["by_category_s"].items())
    lines = [f"profile ({s['steps']} steps, {s['device']}, 1 of {s['devices']} devices): per step "
             f"{s['ops']:,.0f} ops (median {s['median_op_us']:,.1f} us), device busy {ms(s['busy_s'])}"
             + (f" of {ms(s['step_s'])} ({frac})" if s["step_s"] else "")  # a kept trace read again: no step time
             + (f" (the step without the profiler: {ms(s['timed_step_s'])})" if s.get("timed_step_s") else "")
             + f"; op time: {cats}"]
    row = lambda t: f"  {t['s'] * 1e3:9.3f} ms  {t['calls']:8.1f} x  {t['category']:<10}  {t['op']}"
    lines += ["top ops, per step:", *map(row, s["top"]), "top kinds of op, per step:", *map(row, s["top_kinds"])]
    if "idle" in s:
        lines += format_idle(s["idle"])
    if "by_scope_s" in s:  # where in the model, the first dozen
        lines += ["op time by where in the model, per step:",
                  *(f"  {v * 1e3:9.3f} ms  {k}" for k, v in list(s["by_scope_s"].items())[:12])]
    return lines


def format_idle(idle: dict) -> list[str]:
    """`idle`'s lines: where the device waited in a step, then its longest gaps."""
    ms = lambda x: f"{x * 1e3:,.2f} ms"
    span = lambda g: (f"{g['from_us']:g} us or more" if g["to_us"] == float("inf") else
                      f"under {g['to_us']:g} us" if not g["from_us"] else f"{g['from_us']:g}-{g['to_us']:g} us")
    count = lambda n: f"{n:,.0f}" if n >= 10 else f"{n:.1f}"
    gaps = ", ".join(f"{count(g['per_step'])} of {span(g)}: {ms(g['s'])}" for g in idle["gaps"] if g["per_step"])
    total = idle["before_first_op_s"] + idle["between_ops_s"] + idle["after_last_op_s"]
    lines = [f"device idle per step {ms(total)}: before the first op {ms(idle['before_first_op_s'])} (the step's "
             f"dispatch), between ops {ms(idle['between_ops_s'])}" + (f" ({gaps})" if gaps else "")
             + f", after the last op {ms(idle['after_last_op_s'])}"]
    if idle["longest"]:
        lines += ["longest gaps between ops:",
                  *(f"  {g['us']:9.1f} us  after {g['after']}, before {g['before']}" for g in idle["longest"])]
    return lines
