"""What XLA:GPU's thunk sequence of one compiled program (XLA_FLAGS=--xla_dump_to=DIR:
DIR/module_*.thunk_sequence_after_thunk_passes.txt) asks of the host per call: command buffers
(CUDA graphs) and their launches, thunks left outside them, async starts and dones; a while loop
of known trip count (all of titans_demo's: 16) runs its body's thunks that many times from the
host (xla/backends/gpu/runtime/while_thunk.cc), so its body counts 16 times.

    python thunks.py DIR/module_NNNN.jit_train_step.thunk_sequence_after_thunk_passes.txt
"""

import collections
import re
import sys

THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
TRIP = 16  # every loop of titans_demo's step (the HLO's known_trip_count)
GROUPS = ("kAsyncStart", "kAsyncDone", "kSequential", "kDynamicSliceFusion", "kCommandBuffer")


def parse(path):
    """The thunks as a tree by indentation; a while's children are its body (its condition, which
    a loop of known trip count does not run, is dropped)."""
    root = dict(kind="root", children=[], indent=-1)
    stack, in_condition = [root], False
    for line in open(path):
        word = line.strip()
        if word in ("condition:", "body:"):
            in_condition = word == "condition:"
            continue
        m = THUNK.match(line)
        if not m:
            continue
        node = dict(kind=m[3], children=[], indent=len(m[1]))
        while stack[-1]["indent"] >= node["indent"]:
            stack.pop()
        if not (in_condition and stack[-1]["kind"] == "kWhile"):
            stack[-1]["children"].append(node)
        stack.append(node)
    return root["children"]


def leaves(seq):
    """Kernels, copies and library calls in `seq` per call (loops counted TRIP times)."""
    n = 0
    for t in seq:
        k = t["kind"]
        n += leaves(t["children"]) if k in GROUPS else TRIP * leaves(t["children"]) if k == "kWhile" else 1
    return n


def host(seq, times, acc, in_loop=False):
    for t in seq:
        k = t["kind"]
        if k == "kCommandBuffer":
            acc["graph launches"] += times
            acc["kernels inside graphs"] += times * leaves(t["children"])
            acc["command buffers" + (" in loop bodies" if in_loop else " at the top level")] += 1
            acc["command buffers holding a loop"] += any(c["kind"] == "kWhile" for c in t["children"])
        elif k == "kWhile":
            acc["while loops run by the host"] += 1
            host(t["children"], times * TRIP, acc, True)
        elif k == "kAsyncStart":
            acc["async starts"] += times
            host(t["children"], times, acc, in_loop)
        elif k == "kAsyncDone":
            acc["async dones"] += times
        elif k in ("kDynamicSliceFusion", "kSequential"):
            host(t["children"], times, acc, in_loop)
        else:
            acc["launches outside graphs"] += times
            acc[f"  of which {k}" + (" in loop bodies" if in_loop else "")] += times
    return acc


if __name__ == "__main__":
    for key, value in sorted(host(parse(sys.argv[1]), 1, collections.Counter()).items()):
        print(f"{key}: {value:,}")
