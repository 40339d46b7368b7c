"""What nljax's Pallas kernels ask of a Hopper GPU, found on a machine without one.

    pip install triton      # once, beside nljax (the GPU machine has it with torch)
    python benchmarks/triton_resources.py --config nl_350m [--config titans_demo] [--warps 4,8] [--out F.json]
                                          [--precision highest]
    python benchmarks/triton_resources.py --config nl_350m --capture-only DIR   # the Triton modules only

For each kernel of a packaged config (the memory kernel's forward and backward at the config's
memory shapes, the Pallas attention's forward, dK/dV and dQ at its attention shapes, in
model.dtype) this captures the Triton module Pallas lowers (what XLA would compile on the GPU),
compiles it with the `triton` package for sm_90 (H100, H200) at each number of warps, and
assembles it with `ptxas -v`: shared memory per block (an H100 or H200 gives one block at most
227 KiB: a kernel over it does not launch, and XLA refuses it), registers per thread (255 at
most) and bytes spilled to local memory per thread (each spill is a round trip to L1/L2 in the
kernel's inner loop), and how long each phase of the compilation took on this machine: Triton's
MLIR passes (ttir, ttgir), LLVM IR (llir), PTX (ptx), ptxas (cubin). XLA runs the same phases on
the GPU's host before the first step, so a kernel that takes minutes here stalls a run's start.
Exits 1, naming each kernel (forward or backward, its config) whose shared memory is over
227 KiB (232,448 bytes): a check to run by hand before a GPU session, with and without
`--precision highest`. `--precision highest` captures the kernels as they are traced under
`jax.default_matmul_precision("highest")` (benchmarks/memory_kernel.py's check compiles them so).

An estimate, not the GPU's own compilation: jaxlib's XLA compiles the same module with the Triton
it was built with, which may place tensors differently from the `triton` installed here. It is
what can be known before a GPU session; `auto` still compiles a kernel on the GPU before it
takes it (nljax/models/compiles.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

HOPPER_SHARED_BYTES = 227 * 1024  # the opt-in shared memory of one block on an H100 or H200


def captured_modules(fn, args) -> list[tuple[str, int, int]]:
    """(Triton module text, num_warps, num_stages) of each kernel Pallas lowers while `fn(*args)`
    is lowered for CUDA; the settings are those the kernel's pallas_call asks XLA for."""
    from jax._src.pallas.triton import lowering  # private: where Pallas builds the Triton module

    from nljax.models.platform import cuda_lowering

    texts, original = [], lowering.lower_jaxpr_to_triton_module

    def grab(*a, **k):
        result = original(*a, **k)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = grab
    try:
        with cuda_lowering():
            hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    settings = {m.group(1): (int(m.group(3)), int(m.group(2))) for m in
                re.finditer(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo)}
    return [(t, *settings[re.match(r"module @(\S+)", t).group(1)]) for t in texts]


def kernels(config: str, precision: str | None = None) -> dict[str, tuple[str, int, int]]:
    """name -> (Triton module, warps, stages) of every Pallas kernel `config` trains with on a GPU,
    traced under `jax.default_matmul_precision(precision)` (None: JAX's default)."""
    with jax.default_matmul_precision(precision):
        return _kernels(config)


def _kernels(config: str) -> dict[str, tuple[str, int, int]]:
    from nljax import config as configuration
    from nljax.models import attention_kernel as ak
    from nljax.models import memory_kernel as mk
    from nljax.models import memory_loop_kernel as ml

    cfg = configuration.load(config, [])
    m, nl = cfg.model, cfg.model.nl_lm
    dtype = jnp.dtype(m.dtype)
    out = {}
    if nl.memory_layers:
        d, hid, b, kind = nl.memory_dim, nl.memory_hidden, nl.memory_chunk, nl.memory_kind
        shapes = {"W": (d, d)} if kind == "linear" else {"W1": (d, hid), "W2": (hid, d)}
        state = {p: {n: jnp.zeros((1, 1, *s), jnp.float32) for n, s in shapes.items()} for p in "MS"}
        xs = [jnp.zeros((1, 1, 2 * b, d), dtype)] * 3 + [jnp.full((1, 1, 2 * b), 0.5, dtype)] * 3
        at = f"({kind}, chunk {b}, dim {d}, hidden {hid})"
        for name, kernel in (("memory", mk.memory_kernel), ("memory loop", ml.memory_parallel_kernel)):
            fn = functools.partial(kernel, kind=kind, chunk=b, interpret=False)
            grad = jax.grad(lambda a, fn=fn: sum(x.astype(jnp.float32).sum() for x in jax.tree.leaves(fn(*a))))
            fwd, bwd = captured_modules(grad, ((state, *xs),))  # the backward pass runs the forward kernel too
            out |= {f"{name} forward {at}": fwd, f"{name} backward {at}": bwd}
    hd = m.dim // m.heads
    if why := ak.gpu_unsupported(dtype, hd):  # then auto takes cuDNN's attention or the blocked form
        print(f"{config}: no Pallas attention ({why})")
        return out
    t = max(256, 2 * nl.window)
    x = jnp.zeros((1, t, 1, hd), dtype)
    attn = functools.partial(ak.flash_attention, window=nl.window, interpret=False)
    grad = jax.grad(lambda a: attn(*a).astype(jnp.float32).sum())
    names = ["attention forward", "attention dK/dV", "attention dQ"]
    out |= {f"{n} (head {hd}, window {nl.window})": text for n, text in zip(names, captured_modules(grad, ((x, x, x),)))}
    return out


def over_limit(rows: list[dict]) -> list[str]:
    """One line per compiled kernel (a row of `compiled`, with its config and kernel name) whose
    shared memory is over what one block of an H100 or H200 may have: XLA refuses it on the GPU
    (RESOURCE_EXHAUSTED: Shared memory size limit exceeded)."""
    return [f"{r['config']}: {r['kernel']} at {r['warps']} warps asks for {r['shared_bytes']} bytes of shared "
            f"memory, over the {HOPPER_SHARED_BYTES} an H100/H200 block has" for r in rows
            if r["shared_bytes"] > HOPPER_SHARED_BYTES]


PHASES = ("ttir", "ttgir", "llir", "ptx", "cubin")  # Triton's compilation stages, in order


def _timed_stages(seconds: dict):
    """A triton `add_stages_inspection_hook` that times each stage into `seconds`, and runs the
    Triton-IR passes (ttir) that a module given as IR skips: XLA runs them on what Pallas lowers."""
    def hook(*args):
        if not args:  # asked for the compilation cache's key
            return "timed", "timed"
        stages = args[1]
        ttir = stages["ttir"]

        def timed(name, fn):
            def run(src, metadata):
                if name == "ttgir":
                    t = time.perf_counter()
                    src = ttir(src, metadata)
                    seconds["ttir"] = time.perf_counter() - t
                t = time.perf_counter()
                out = fn(src, metadata)
                seconds[name] = time.perf_counter() - t
                return out
            return run

        for name, fn in list(stages.items()):
            stages[name] = timed(name, fn)
    return hook


def compiled(text: str, warps: int, stages: int, work: Path) -> dict:
    """Shared memory, registers, spills and compile seconds (per phase) of one Triton module
    compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = work / "kernel.ttir"
    src.write_text(text)
    seconds = {}
    knobs = triton.knobs
    saved = knobs.runtime.add_stages_inspection_hook, knobs.compilation.always_compile
    knobs.runtime.add_stages_inspection_hook, knobs.compilation.always_compile = _timed_stages(seconds), True
    try:
        k = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
    finally:
        knobs.runtime.add_stages_inspection_hook, knobs.compilation.always_compile = saved
    ptx = work / "kernel.ptx"
    ptx.write_text(k.asm["ptx"])
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    report = ""
    for ptxas in sorted(bin_dir.glob("ptxas*")):  # the first that reads this PTX version
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(work / "kernel.cubin")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            report = r.stderr
            break
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"warps": warps, "stages": stages, "shared_bytes": k.metadata.shared,
            "fits": k.metadata.shared <= HOPPER_SHARED_BYTES, "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None,
            "compile_s": {p: round(seconds[p], 2) for p in PHASES if p in seconds},
            "compile_total_s": round(sum(seconds.values()), 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="a packaged config or YAML file (repeatable)")
    p.add_argument("--warps", help="numbers of warps to compile each kernel with, e.g. 4,8 (default: the "
                   "kernel's own)")
    p.add_argument("--precision", choices=("default", "highest"), default="default",
                   help="trace the kernels at JAX's default matmul precision or under "
                   "jax.default_matmul_precision('highest')")
    p.add_argument("--capture-only", metavar="DIR", help="write the Triton modules into DIR; compile nothing")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    precision = None if args.precision == "default" else args.precision
    found = {c: kernels(c, precision) for c in args.config}
    if args.capture_only:
        d = Path(args.capture_only)
        d.mkdir(parents=True, exist_ok=True)
        for c, ks in found.items():
            for i, (name, (text, _, _)) in enumerate(ks.items()):
                (d / f"{Path(c).stem}_{i}.ttir").write_text(text)
                print(f"{c}: {name} -> {d / f'{Path(c).stem}_{i}.ttir'}")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton_resources: the `triton` package is not installed (pip install triton)", file=sys.stderr)
        return 2
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for c, ks in found.items():
            for name, (text, own_warps, stages) in ks.items():
                for w in map(int, args.warps.split(",")) if args.warps else [own_warps]:
                    r = {"config": c, "kernel": name, **compiled(text, w, stages, Path(tmp))}
                    rows.append(r)
                    print(f"{c:12s} {name:58s} warps {w}, stages {stages}: shared {r['shared_bytes'] / 1024:5.0f} KiB"
                          f"{'' if r['fits'] else ' (over 227)'}, {r['registers']} registers, "
                          f"{r['spill_store_bytes']} B spilled per thread; compiled in {r['compile_total_s']:.1f} s "
                          f"({', '.join(f'{p} {t:.1f}' for p, t in r['compile_s'].items())})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": __import__("triton").__version__, "target": "sm_90a",
                                              "precision": args.precision, "jax": jax.__version__, "rows": rows},
                                             indent=1))
    over = over_limit(rows)
    for line in over:
        print(f"triton_resources: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
