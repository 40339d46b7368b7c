"""A kept profile read again: where its device time goes, by where in the model.

    python benchmarks/place_trace.py DIR --steps N [--unplaced] [--extract FILE.json.gz]

DIR is what `nljax.bench --profile N --profile-dir DIR` wrote: the trace (plugins/profile/...) and
the profiled program's HLO (`program.hlo.txt`), so how the profile places kernels
(`nljax/measure/traces.py`) can be checked and mended on a machine without the GPU that recorded it.
Prints the profile's summary per step (N: the steps profiled); `--unplaced` also lists the kernels
left at '?' (by kernel name, digits as N), which is what to look at when that share grows.
`--extract` writes the first step's op events and the HLO's scheduled computations, cut to what
placing reads, as one small file (`tests/data/h200_nl350m_profile.json.gz`; `profile_events`
turns it back into trace events).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nljax.measure import traces  # noqa: E402  (after the path: a checkout need not be installed)


_KEEP = re.compile(r'custom_call_target="[^"]*"|\b(?:calls|body|condition|to_apply)=%?[\w.\-]+|branch_computations=\{[^}]*\}')


def small_hlo(text: str) -> str:
    """The scheduled computations, each instruction cut to its opcode, operands, callees,
    library call and op_name/deduplicated_name (shapes and backend configs dropped)."""
    comps = traces.computations(text)
    fused = traces.fused_computations(comps)
    lines = ["HloModule jit_train_step, is_scheduled=true"]
    for comp, ins in comps.items():
        if comp in fused:
            continue
        lines.append(f"%{comp} () -> () {{")
        for name, rest in ins:
            opcode = traces.OPCODE.search(rest)
            operands = sorted(set(re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])))
            line = f"  %{name} = t {opcode.group(1) if opcode else 'unknown'}({', '.join('%' + o for o in operands)})"
            line += "".join(", " + m.group(0) for m in _KEEP.finditer(rest))
            meta = re.findall(r'(?:op_name|deduplicated_name)="[^"]*"', rest)
            lines.append(line + (", metadata={" + " ".join(meta) + "}" if meta else ""))
        lines.append("}")
    return "\n".join(lines) + "\n"


def extract(directory: Path, hlo_text: str, steps: int, out: Path) -> None:
    """The first of `steps` steps' op events of the first device, as columns (time: the events'
    order; durations in 0.1 us), with `small_hlo`, in one gzip'd JSON file."""
    per_device = traces.op_events(traces.load_events(directory))
    ops = sorted(per_device[sorted(per_device)[0]], key=lambda e: e["ts"])
    ops = [e for e in ops if e["args"].get("hlo_module") == traces.TRAIN_MODULE] or ops
    ops = ops[:len(ops) // steps]
    table = lambda values: sorted(set(values))
    kernels, hlo_ops, op_names = (table(e["name"] for e in ops), table(e["args"]["hlo_op"] for e in ops),
                                  table(e["args"].get("name", "") for e in ops))
    index = lambda values: {v: i for i, v in enumerate(values)}
    ki, hi, ni = index(kernels), index(hlo_ops), index(op_names)
    data = {"hlo": small_hlo(hlo_text), "kernels": kernels, "hlo_ops": hlo_ops, "op_names": op_names,
            "stream": [e["tid"] for e in ops], "dur": [round(e.get("dur", 0.0) * 10) for e in ops],
            "kernel": [ki[e["name"]] for e in ops], "hlo_op": [hi[e["args"]["hlo_op"]] for e in ops],
            "op_name": [ni[e["args"].get("name", "")] for e in ops],
            "graph": [int("cuda_graph_id" in e["args"]) for e in ops],
            "run": [int(e["args"].get("correlation_id", 0)) for e in ops]}
    with gzip.open(out, "wt", compresslevel=9) as f:
        json.dump(data, f, separators=(",", ":"))


def profile_events(data: dict) -> list[dict]:
    """`extract`'s columns back as trace events of one GPU, each stream a lane "Stream #N"."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    events += [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": f"Stream #{t}"}}
               for t in sorted(set(data["stream"]))]
    for n, (tid, dur, k, h, o, g, run) in enumerate(zip(data["stream"], data["dur"], data["kernel"], data["hlo_op"],
                                                        data["op_name"], data["graph"], data["run"])):
        args = {"hlo_op": data["hlo_ops"][h], "hlo_module": traces.TRAIN_MODULE, "correlation_id": str(run),
                **({"cuda_graph_id": "1"} if g else {}), **({"name": data["op_names"][o]} if data["op_names"][o] else {})}
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": n, "dur": dur / 10, "name": data["kernels"][k], "args": args})
    return events


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--steps", type=int, required=True, help="the steps the trace holds (bench's --profile N)")
    p.add_argument("--unplaced", action="store_true", help="list the kernels placed at '?'")
    p.add_argument("--extract", type=Path, metavar="FILE", help="write the first step, cut down, to FILE (.json.gz)")
    args = p.parse_args(argv)
    hlo = args.dir / "program.hlo.txt"
    if not hlo.is_file():
        p.error(f"{hlo} does not exist: DIR must be a bench --profile directory")
    text = hlo.read_text()
    s = traces.summarize(args.dir, args.steps, 0.0, hlo_text=text)
    print("\n".join(traces.format_summary(s)))
    if args.extract:
        extract(args.dir, text, args.steps, args.extract)
        print(f"wrote {args.extract} ({args.extract.stat().st_size:,} bytes)")
    if args.unplaced:
        ops = [e for e in traces.op_events(traces.load_events(args.dir))[s["device"]]
               if s["module"] is None or e["args"].get("hlo_module") == s["module"]]
        left: dict[str, list] = {}
        for e, where in zip(ops, traces.place(ops, traces.Program(text))):
            if where == "?":
                acc = left.setdefault(re.sub(r"\d+", "N", e["name"])[:60], [0.0, 0])
                acc[0] += e.get("dur", 0.0) * 1e-6 / args.steps
                acc[1] += 1 / args.steps
        print("kernels placed at '?', per step:")
        for name, (sec, calls) in sorted(left.items(), key=lambda kv: -kv[1][0]):
            print(f"  {sec * 1e3:9.3f} ms  {calls:8.1f} x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
