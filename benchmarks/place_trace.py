"""A kept profile read again: where its device time goes, by where in the model.

    python benchmarks/place_trace.py DIR --steps N [--unplaced]

DIR is what `nljax.bench --profile N --profile-dir DIR` wrote: the trace (plugins/profile/...) and
the profiled program's HLO (`program.hlo.txt`), so how the profile places kernels
(`nljax/measure/traces.py`) can be checked and mended on a machine without the GPU that recorded it.
Prints the profile's summary per step (N: the steps profiled); `--unplaced` also lists the kernels
left at '?' (by kernel name, digits as N), which is what to look at when that share grows.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nljax.measure import traces  # noqa: E402  (after the path: a checkout need not be installed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--steps", type=int, required=True, help="the steps the trace holds (bench's --profile N)")
    p.add_argument("--unplaced", action="store_true", help="list the kernels placed at '?'")
    args = p.parse_args(argv)
    hlo = args.dir / "program.hlo.txt"
    if not hlo.is_file():
        p.error(f"{hlo} does not exist: DIR must be a bench --profile directory")
    text = hlo.read_text()
    s = traces.summarize(args.dir, args.steps, 0.0, hlo_text=text)
    print("\n".join(traces.format_summary(s)))
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
