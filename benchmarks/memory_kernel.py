"""The fused Pallas memory kernels and the parallel-reads form against the scan, alone (issue 44:
a kernel's forward + backward >= 3x the scan's at titans_demo's and nl_350m's memory shapes).

    python benchmarks/memory_kernel.py [--shapes titans_demo,nl_350m] [--variant V ...] [--rounds R]
                                       [--warmup W] [--interpret] [--out FILE.json]

Variants (--variant, repeated; default all): kernel (memory_impl=pallas), "kernel, scan backward" (its
forward with a reverse scan of the chunk's vjp), loop kernel (memory_impl=parallel_pallas: the
parallel form's loop of end states as a kernel, the reads XLA's), parallel (memory_impl=parallel)
and "parallel, JAX's pull-back" (the parallel form with its backward loop pulling each chunk back
through `jax.vjp` of `memory.end_state`, as before `memory.end_pullback` was written out: what
the hand-written one gains, side by side).

For each packaged config named in --shapes (or `tiny`: a few chunks of small heads, for a CPU
smoke test with --interpret), at its memory shapes (train.batch_size rows x memory_heads, seq_len
tokens, memory_kind/dim/hidden/chunk; one memory layer):

- check: each variant's reads, final state and gradients (w.r.t. q, k,
  v, the gates and the initial state) against `memory_forward`'s, under `jax.default_matmul_precision("highest")`
  (Triton and XLA would otherwise both take TF32 on a GPU, each rounding its own way): the
  scan's products full float32, the kernel's three TF32 products each (`memory_kernel._products`:
  Triton's exact float32 products are unrolled per element, and took the backward kernel minutes
  to compile), as the largest difference over each leaf's largest entry;
- timing: forward and forward + backward of each, compiled at the default precision (as the model
  runs them), interleaved rounds, medians; the scan
  as the model runs it with model.remat=memory (chunk internals recomputed in the backward pass).

Writes one JSON object (per shape: the shapes, the check, the times, the ratios) to --out.

`--launches h200` (or h100) runs nothing: it compiles each variant's forward + backward for that
card on a machine without one (XLA:GPU's compiler, `pip install "jax[cuda13]==<jax's version>"`, as
benchmarks/gpu_compile.py does) and counts the kernels one call launches
(`nljax.measure.hlo.launching`): `total`, and `per_chunk`, those of the loops' bodies (forward and
backward together: the kernels a GPU runs once per chunk, one chunk after another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from nljax import config
from nljax.models import memory as nm
from nljax.models import memory_kernel as mk
from nljax.models import memory_loop_kernel as ml

TINY = dict(batch=1, heads=2, seq=64, kind="mlp", dim=16, hidden=16, chunk=16)
TARGET = 3.0  # the kernel's forward + backward against the scan's


def shapes_of(name: str) -> dict:
    """One memory layer's shapes in the packaged config `name` (or TINY)."""
    if name == "tiny":
        return dict(TINY)
    cfg = config.load(name)
    nl = cfg.model.nl_lm
    return dict(batch=cfg.train.batch_size, heads=nl.memory_heads, seq=cfg.train.seq_len, kind=nl.memory_kind,
                dim=nl.memory_dim, hidden=nl.memory_hidden, chunk=nl.memory_chunk)


def inputs(s: dict, seed: int = 0):
    """A state (memory0 as NeuralMemory starts it, non-zero momentum) and unit-norm q, k, v with
    gates in (0, 1): what the model feeds the inner loop."""
    b, h, t, d = s["batch"], s["heads"], s["seq"], s["dim"]
    ks = jax.random.split(jax.random.key(seed), 9)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = (unit(jax.random.normal(ks[i], (b, h, t, d))) for i in range(3))
    gates = [jax.nn.sigmoid(jax.random.normal(ks[3 + i], (b, h, t)) + bias) for i, bias in enumerate((0.0, 0.0, -6.0))]
    shapes = {"W": (h, d, d)} if s["kind"] == "linear" else {"W1": (h, d, s["hidden"]), "W2": (h, s["hidden"], d)}
    m0 = {n: jax.random.normal(ks[6 + i], sh) * (1.0 if n == "W1" else 0.1) for i, (n, sh) in enumerate(shapes.items())}
    state = nm.init_state(m0, b)
    state["S"] = jax.tree.map(lambda x: 0.01 * jax.random.normal(ks[8], x.shape), state["S"])
    return state, (q, k, v, *gates)


KERNELS = ("kernel", "kernel, scan backward", "loop kernel")  # the fused kernels, against "scan" (the target is theirs)
JAX_PULLBACK = "parallel, JAX's pull-back"
VARIANTS = (*KERNELS, "parallel", JAX_PULLBACK)  # each checked against the scan and timed
FWD, FWD_BWD = "forward", "forward+backward"


def implementations(s: dict, interpret: bool) -> dict:
    """The scan as the model runs it with remat, the kernel, the kernel's forward with the
    fallback backward (a reverse scan of the chunk's vjp), the scan of end states with the reads
    taken out of the loop (`memory_parallel`) and that loop as a kernel (`memory_parallel_kernel`)."""
    kw = dict(kind=s["kind"], chunk=s["chunk"])
    return {"scan": lambda st, a: nm.memory_forward(st, *a, remat=True, **kw),
            "kernel": lambda st, a: mk.memory_kernel(st, *a, interpret=interpret, **kw),
            "kernel, scan backward": lambda st, a: mk.memory_kernel(st, *a, interpret=interpret, backward="scan", **kw),
            "loop kernel": lambda st, a: ml.memory_parallel_kernel(st, *a, interpret=interpret, **kw),
            "parallel": lambda st, a: nm.memory_parallel(st, *a, **kw),
            JAX_PULLBACK: lambda st, a: parallel_jax_pullback(st, *a, **kw)}


def parallel_jax_pullback(state, q, k, v, theta, eta, alpha, *, kind: str, chunk: int):
    """`memory.memory_parallel` whose backward loop takes `jax.vjp` of `memory.end_state` per chunk
    in place of `memory.end_pullback` (the same values within float32 rounding)."""
    f32 = lambda x: x.astype(jnp.float32)
    xs = nm._chunks(*map(f32, (q, k, v, theta, eta, alpha)), chunk)

    fwd = lambda state, xs: nm._parallel_fwd(state, xs, kind, 1, 1)  # the same forward loop, one group of reads

    def bwd(res, cotangents):
        starts, xs = res
        dys, d_final = cotangents
        d_starts, d_xs = jax.vjp(lambda st, x: nm._all_reads(st, x, kind), starts, xs)[1](dys)
        (_, k, v, theta, eta), consts = xs
        ends, pull_ends = jax.vjp(nm.end_inputs, theta, eta, consts)

        def body(d_end, inp):
            start, ins, d_read = inp
            d_start, *d_ins = jax.vjp(lambda st, *i: nm.end_state(st, *i, kind), start, *ins)[1](d_end)
            return jax.tree.map(jnp.add, d_start, d_read), d_ins

        d_state, (dk, dv, d_ends) = jax.lax.scan(body, d_final, (starts, (k, v, ends), d_starts), reverse=True)
        d_theta, d_eta, d_consts = pull_ends(d_ends)
        (dq, *rest), d_consts_reads = d_xs
        return d_state, ((dq, *(a + b for a, b in zip(rest, (dk, dv, d_theta, d_eta)))),
                         jax.tree.map(jnp.add, d_consts_reads, d_consts))

    loop = jax.custom_vjp(lambda state, xs: fwd(state, xs)[0])
    loop.defvjp(fwd, bwd)
    ys, final = loop(jax.tree.map(f32, state), xs)
    return nm._unchunk(ys, q), final


def loss_and_outputs(fn):
    def f(state, args):
        y, st = fn(state, args)
        return jnp.sum(jnp.sin(3 * y)) + sum(jnp.sum(jnp.cos(x)) for x in jax.tree.leaves(st)), (y, st)
    return f


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


def check(impls: dict, state, args, variants=VARIANTS) -> dict:
    """Per kernel: the largest difference from the scan over each leaf's largest entry (outputs;
    gradients), or the error that stopped it (a GPU compiler refusing the kernel)."""
    grads = lambda f: jax.jit(jax.grad(loss_and_outputs(f), argnums=(0, 1), has_aux=True))(state, args)

    def worst(a, b):
        return max(float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    out = {}
    with jax.default_matmul_precision("highest"):
        g_s, out_s = grads(impls["scan"])
        for k in variants:
            try:
                g_k, out_k = grads(impls[k])
            except Exception as e:  # noqa: BLE001 - reported, the other variants go on
                out[k] = {"ok": False, "error": _error(e)}
                continue
            err = {"outputs": worst(out_k, out_s), "grads": worst(g_k, g_s)}
            out[k] = {"max_rel_err": err, "ok": err["outputs"] < 1e-4 and err["grads"] < 1e-3}
    return out


def timed(calls: dict, warmup: int, rounds: int) -> dict:
    """name -> median seconds over interleaved rounds, after `warmup` untimed ones."""
    from plain_jit import interleaved  # benchmarks/plain_jit.py: the rounds themselves

    return {k: statistics.median(v) for k, v in interleaved(calls, warmup, rounds).items()}


def bench(name: str, args) -> dict:
    s = shapes_of(name)
    state, xs = inputs(s)
    variants = args.variants
    impls = {k: f for k, f in implementations(s, args.interpret).items() if k == "scan" or k in variants}
    out = {"shapes": s, "check": check(impls, state, xs, variants), "errors": {}, "compile_s": {}}
    calls = {}
    for k, f in impls.items():
        modes = {FWD: f, FWD_BWD: jax.grad(lambda st, a, f=f: loss_and_outputs(f)(st, a)[0], argnums=(0, 1))}
        for mode, fn in modes.items():
            if mode == FWD and k == "kernel, scan backward":
                continue  # the kernel's forward
            t0 = time.perf_counter()
            try:
                compiled = jax.jit(fn).lower(state, xs).compile()
            except Exception as e:  # noqa: BLE001 - reported, the others are timed
                out["errors"][f"{k} {mode}"] = _error(e)
                continue
            out["compile_s"][f"{k} {mode}"] = time.perf_counter() - t0
            calls[f"{k} {mode}"] = lambda c=compiled: c(state, xs)
    med = timed(calls, args.warmup, args.rounds)
    out["median_ms"] = {k: v * 1e3 for k, v in med.items()}
    out["speedup"] = {k: {m: med[f"scan {m}"] / med[f"{k} {m}"] for m in (FWD, FWD_BWD)
                          if f"{k} {m}" in med and f"scan {m}" in med} for k in variants}
    out["target_met"] = any(out["check"][k]["ok"] and out["speedup"][k].get(FWD_BWD, 0) >= TARGET
                            for k in KERNELS if k in variants)
    return out


def launches(name: str, gpu: str, variants) -> dict:
    """Kernels per call of each variant's forward + backward compiled for `gpu` (module docstring)."""
    from gpu_compile import gpu_device  # benchmarks/gpu_compile.py: the card described to XLA

    from nljax.measure import hlo
    from nljax.models import platform

    device = gpu_device(gpu)
    s = shapes_of(name)
    state, xs = inputs(s)
    on_card = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    chunks = s["seq"] // s["chunk"]
    out = {"shapes": s, "launches": {}, "errors": {}}
    with platform.compiling_for("gpu", device), platform.lowering():
        impls = implementations(s, interpret=False)
        for k in ("scan", *variants):
            fn = jax.grad(lambda st, a, f=impls[k]: loss_and_outputs(f)(st, a)[0], argnums=(0, 1))
            try:
                text = jax.jit(fn).lower(*jax.tree.map(on_card, (state, xs))).compile().as_text()
            except Exception as e:  # noqa: BLE001 - reported, the others are counted
                out["errors"][k] = _error(e)
                continue
            counted = list(hlo.launching(text))
            out["launches"][k] = {"total": sum(t for _, t, _ in counted),
                                  "per_chunk": sum(1 for _, t, _ in counted if t == chunks)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/memory_kernel.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="titans_demo,nl_350m", help="packaged configs (or tiny), comma-separated")
    p.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--variant", action="append", dest="variants", choices=VARIANTS,
                   help="a variant to check and time against the scan (repeat for several; default: all)")
    p.add_argument("--interpret", action="store_true", help="run the kernel interpreted (CPU; slow)")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--launches", metavar="GPU", choices=("h100", "h200"),
                   help="count each variant's kernels compiled for this card, without one (runs nothing)")
    args = p.parse_args(argv)
    args.variants = tuple(args.variants or VARIANTS)
    if args.launches:
        res = {"gpu": args.launches, "shapes": {n: launches(n, args.launches, args.variants)
                                                for n in args.shapes.split(",")}}
        for name, r in res["shapes"].items():
            print(f"{name}: kernels per forward + backward (per chunk, one after another)")
            for k, n in r["launches"].items():
                print(f"  {k}: {n['total']:,} ({n['per_chunk']} per chunk)")
            for k, err in r["errors"].items():
                print(f"  {k}: FAILED: {err}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return 1 if any(r["errors"] for r in res["shapes"].values()) else 0
    if not args.interpret and jax.default_backend() != "gpu":
        p.error(f"the compiled kernel needs a GPU (JAX's backend here: {jax.default_backend()}); "
                "--interpret runs it here")
    res = {"device": jax.devices()[0].device_kind, "target_speedup": TARGET, "shapes": {}, "errors": {}}
    for name in args.shapes.split(","):
        try:  # a shape the GPU's compiler refuses (registers, shared memory) leaves the others measured
            res["shapes"][name] = bench(name, args)
        except Exception as e:  # noqa: BLE001 - reported in the JSON and the exit status
            res["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
            print(f"{name}: FAILED: {res['errors'][name]}")
    for name, r in res["shapes"].items():
        ms = r["median_ms"]
        print(f"{name} {r['shapes']}: scan fwd+bwd {ms.get('scan ' + FWD_BWD, float('nan')):.2f} ms")
        for k in r["check"]:
            c, sp = r["check"][k], r["speedup"][k]
            print(f"  {k}: check {'ok' if c['ok'] else 'FAILED'} {c.get('max_rel_err', c.get('error'))}; fwd+bwd "
                  f"{ms.get(f'{k} {FWD_BWD}', float('nan')):.2f} ms ({sp.get(FWD_BWD, float('nan')):.2f}x, target >= "
                  f"{TARGET}x)" + (f"; forward {sp[FWD]:.2f}x" if FWD in sp else ""))
        for what, err in r["errors"].items():
            print(f"  {what}: FAILED: {err}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    ok = not res["errors"] and all(not r["errors"] and all(c["ok"] for c in r["check"].values())
                                   for r in res["shapes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
