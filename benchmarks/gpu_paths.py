"""The GPU-only paths of nl_lm against their reference paths, on the device this runs on, and each
pair's time (issue 44): the first part of benchmarks/gpu_suite.sh.

    python benchmarks/gpu_paths.py [--dry-run] [--out FILE.json]

- attention: cuDNN's fused sliding-window attention (`model.nl_lm.attention=cudnn`) against the
  blocked form, outputs and gradients of q, k, v, both in bfloat16 and each compared with the
  blocked form in float32 (the reference): cuDNN passes when its error is at most twice the
  bfloat16 blocked form's, plus a small floor;
- pallas attention: the Pallas flash attention (`model.nl_lm.attention=pallas`) against the same
  float32 reference, in bfloat16 (passes as cuDNN does) and in float32 (which cuDNN refuses: at
  most twice the error of the blocked form in float32 at the default matmul precision, plus the
  same floor); timed beside cuDNN and the blocked form. Compiled through Triton on a GPU,
  interpreted elsewhere (the dry run); an error (a Triton compile failure) is recorded, not raised;
- embedding: the table's gradient by one-hot matmul and by sorted segment sum against
  autodiff's scatter-add, all from the same bfloat16 cotangent, compared with the exact float64 sum;
- cross-entropy: the chunked loss (`model.nl_lm.loss_chunk`) against the full one, loss and
  gradients, and the compiled programs' temporary memory (`memory_analysis`).

Shapes are nl_350m's (8 x 2048 tokens, dim 1024, 16 heads of 64, window 512, vocabulary 256;
the loss also at a 32k vocabulary). Times: median of `--reps` calls of the jitted forward and
backward, after one untimed call. `--dry-run`: tiny shapes, and on a machine without CUDA the
cuDNN form's arguments run through XLA's implementation (`fused_local_attention(...,
implementation="xla")`): the script's own test on a CPU. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402  (after the path: a checkout need not be installed)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nljax.models import attention, attention_kernel, embedding, platform  # noqa: E402
from nljax.models.chunked_loss import chunked_token_loss  # noqa: E402
from nljax.models.layers import dense_dot, local_attention, token_loss  # noqa: E402

FULL = {"batch": 8, "seq": 2048, "heads": 16, "head_dim": 64, "window": 512, "dim": 1024, "vocab": 256,
        "big_vocab": 32768, "chunk": 4096}
DRY = {"batch": 2, "seq": 96, "heads": 2, "head_dim": 16, "window": 32, "dim": 32, "vocab": 64,
       "big_vocab": 1024, "chunk": 64}


def timed(fn, *args, reps: int) -> float:
    """Median seconds of `reps` calls of the jitted `fn`, after one untimed call (the compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_err(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def fwd_bwd(attend):
    """Outputs and the gradients of sum(y * ct) for q, k, v (ct: a fixed random cotangent)."""
    def f(q, k, v, ct):
        y, pull = jax.vjp(attend, q, k, v)
        return y, pull(ct.astype(y.dtype))
    return jax.jit(f)


def attention_case(s: dict):
    """q, k, v and an output cotangent (float32) at the shapes `s`, and the reference: the blocked
    form's outputs and gradients in float32 at full precision."""
    shape = (s["batch"], s["seq"], s["heads"], s["head_dim"])
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    with jax.default_matmul_precision("highest"):  # a GPU's float32 matmuls are TF32 otherwise
        ref = fwd_bwd(lambda q, k, v: local_attention(q, k, v, s["window"]))(q, k, v, ct)
    return (q, k, v, ct), ref


def check_attention(s: dict, cuda: bool, reps: int) -> dict:
    w = s["window"]
    shape = (s["batch"], s["seq"], s["heads"], s["head_dim"])
    (q, k, v, ct), ref = attention_case(s)
    impl = "cudnn" if cuda else "xla"  # off CUDA: the same arguments through XLA (the dry run)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    blocked_fn = fwd_bwd(lambda q, k, v: local_attention(q, k, v, w))
    fused_fn = fwd_bwd(lambda q, k, v: attention.fused_local_attention(q, k, v, w, implementation=impl))
    blocked, fused = blocked_fn(*bf, ct), fused_fn(*bf, ct)
    e_blocked, e_fused = max_err(blocked, ref), max_err(fused, ref)
    ok = e_fused <= 2 * e_blocked + 1e-2
    return {"implementation": impl, "shape_BTHD": list(shape), "window": w, "ok": ok,
            "max_err_vs_float32": {"fused": e_fused, "blocked_bf16": e_blocked},
            "fwd_bwd_ms": {"fused": 1e3 * timed(fused_fn, *bf, ct, reps=reps),
                           "blocked": 1e3 * timed(blocked_fn, *bf, ct, reps=reps)}}


def check_pallas_attention(s: dict, reps: int) -> dict:
    w = s["window"]
    (q, k, v, ct), ref = attention_case(s)
    interpret = jax.default_backend() != "gpu"  # the dry run on a CPU
    out = {"interpret": interpret, "window": w, "ok": False}
    try:
        pallas_fn = fwd_bwd(lambda q, k, v: attention_kernel.flash_attention(q, k, v, w, interpret=interpret))
        blocked_fn = fwd_bwd(lambda q, k, v: local_attention(q, k, v, w))
        errs, ms = {}, {}
        for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
            x = [a.astype(dtype) for a in (q, k, v)]
            errs[name] = {"pallas": max_err(pallas_fn(*x, ct), ref), "blocked": max_err(blocked_fn(*x, ct), ref)}
            ms[f"pallas_{name}"] = 1e3 * timed(pallas_fn, *x, ct, reps=reps)
        ms["blocked_float32"] = 1e3 * timed(blocked_fn, q, k, v, ct, reps=reps)  # bfloat16's: check_attention's
    except Exception as e:  # noqa: BLE001  (a Triton compile failure: recorded, the other checks still run)
        out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        return out
    out["ok"] = all(e["pallas"] <= 2 * e["blocked"] + 1e-2 for e in errs.values())
    return {**out, "max_err_vs_float32": errs, "fwd_bwd_ms": ms}


def check_embedding(s: dict, reps: int) -> dict:
    v, d = s["vocab"], s["dim"]
    ids = jax.random.randint(jax.random.key(1), (s["batch"], s["seq"]), 0, v)
    table = jax.random.normal(jax.random.key(2), (v, d), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), (s["batch"], s["seq"], d), jnp.float32).astype(jnp.bfloat16)
    exact = np.zeros((v, d))
    np.add.at(exact, np.asarray(ids).reshape(-1), np.asarray(ct, np.float64).reshape(-1, d))

    def grad_fn(how):
        if how == "scatter":  # flax's nn.Embed: take of the bfloat16 table, autodiff's scatter-add
            look = lambda t: jnp.take(t.astype(jnp.bfloat16), ids, axis=0)
        else:
            look = lambda t: embedding.embed_lookup(t, ids, jnp.bfloat16, how)
        return jax.jit(lambda t, ct: jax.vjp(look, t)[1](ct)[0])

    out = {"vocab": v, "tokens": int(ids.size), "dim": d}
    for how in ("scatter", "onehot", "segment"):
        fn = grad_fn(how)
        out[how] = {"max_err_vs_exact": max_err(fn(table, ct), exact), "bwd_ms": 1e3 * timed(fn, table, ct, reps=reps)}
    # bfloat16 sums (the scatter-add's) against float32 sums: ours may only be closer to the exact sum
    out["ok"] = all(out[h]["max_err_vs_exact"] <= out["scatter"]["max_err_vs_exact"] + 1e-3 for h in ("onehot", "segment"))
    return out


def check_loss(s: dict, vocab: int, reps: int) -> dict:
    b, t, d, c = s["batch"], s["seq"], s["dim"], s["chunk"]
    keys = jax.random.split(jax.random.key(4), 4)
    x = (jax.random.normal(keys[0], (b, t, d)) / 4).astype(jnp.bfloat16)
    kernel, bias = jax.random.normal(keys[1], (d, vocab)) * d**-0.5, jnp.zeros((vocab,))
    targets = jax.random.randint(keys[2], (b, t), 0, vocab)

    def full(x, kernel, bias):
        xx, kk, bb = x, kernel.astype(x.dtype), bias.astype(x.dtype)
        return token_loss(dense_dot(xx, kk, (((2,), (0,)), ((), ()))) + bb, targets)[0]

    chunked = lambda x, kernel, bias: chunked_token_loss(x, kernel, bias, targets, chunk=c)[0]
    fns = {n: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))) for n, f in (("full", full), ("chunked", chunked))}
    with jax.default_matmul_precision("highest"):  # the reference: float32 throughout (no TF32 on a GPU)
        (l0, g0) = jax.jit(jax.value_and_grad(full, argnums=(0, 1, 2)))(x.astype(jnp.float32), kernel, bias)
    (l1, g1), (l2, g2) = fns["full"](x, kernel, bias), fns["chunked"](x, kernel, bias)
    # each gradient's error relative to its largest entry, against the float32 reference
    rel = lambda g: max(max_err(a, b) / float(jnp.max(jnp.abs(b))) for a, b in zip(g, g0))
    errs = {"full_bf16": rel(g1), "chunked": rel(g2)}
    loss_rel = abs(float(l2) - float(l1)) / abs(float(l1))
    temp = {n: f.lower(x, kernel, bias).compile().memory_analysis().temp_size_in_bytes for n, f in fns.items()}
    return {"vocab": vocab, "tokens": b * t, "chunk": c, "ok": loss_rel < 1e-4 and errs["chunked"] <= 2 * errs["full_bf16"] + 1e-3,
            "loss_rel_diff": loss_rel, "grad_rel_err_vs_float32": errs, "temp_bytes": temp,
            "fwd_bwd_ms": {n: 1e3 * timed(f, x, kernel, bias, reps=reps) for n, f in fns.items()}}


def run(dry: bool, reps: int) -> dict:
    s = DRY if dry else FULL
    cuda = platform.on_cuda()
    dev = jax.devices()[0]
    result = {"device": f"{dev.platform} {dev.device_kind}", "dry_run": dry, "jax": jax.__version__,
              "attention": check_attention(s, cuda, reps), "attention_pallas": check_pallas_attention(s, reps),
              "embedding": check_embedding(s, reps),
              "loss": check_loss(s, s["vocab"], reps), "loss_big_vocab": check_loss(s, s["big_vocab"], reps)}
    checks = ("attention", "attention_pallas", "embedding", "loss", "loss_big_vocab")
    result["ok"] = all(result[k]["ok"] for k in checks)
    return result


def lines(r: dict) -> list[str]:
    a, e = r["attention"], r["embedding"]
    verdict = lambda ok: "ok  " if ok else "FAIL"
    rows = [f"{verdict(a['ok'])} attention {a['implementation']} vs blocked {a['shape_BTHD']} window {a['window']}: "
            f"max error vs float32 {a['max_err_vs_float32']['fused']:.3g} (blocked bf16 "
            f"{a['max_err_vs_float32']['blocked_bf16']:.3g}); fwd+bwd {a['fwd_bwd_ms']['fused']:.2f} ms vs "
            f"{a['fwd_bwd_ms']['blocked']:.2f} ms",
            pallas_line(r),
            f"{verdict(e['ok'])} embedding grad, {e['tokens']} tokens x vocab {e['vocab']} x dim {e['dim']}: "
            + ", ".join(f"{h} {e[h]['bwd_ms']:.3f} ms (error {e[h]['max_err_vs_exact']:.3g})"
                        for h in ("scatter", "onehot", "segment"))]
    for key in ("loss", "loss_big_vocab"):
        c = r[key]
        rows.append(f"{verdict(c['ok'])} chunked CE, {c['tokens']} tokens x vocab {c['vocab']}, chunk {c['chunk']}: "
                    f"loss rel diff {c['loss_rel_diff']:.2g}, grad error vs float32 {c['grad_rel_err_vs_float32']['chunked']:.3g} "
                    f"(full bf16 {c['grad_rel_err_vs_float32']['full_bf16']:.3g}); fwd+bwd {c['fwd_bwd_ms']['chunked']:.2f} ms vs full "
                    f"{c['fwd_bwd_ms']['full']:.2f} ms; temp {c['temp_bytes']['chunked'] / 2**20:,.0f} MiB vs "
                    f"{c['temp_bytes']['full'] / 2**20:,.0f} MiB")
    return rows


def pallas_line(r: dict) -> str:
    p, a = r["attention_pallas"], r["attention"]
    head = f"attention pallas{' (interpreted)' if p['interpret'] else ''} vs blocked window {p['window']}"
    if "error" in p:
        return f"FAIL {head}: {p['error']}"
    e, ms = p["max_err_vs_float32"], p["fwd_bwd_ms"]
    return (f"{'ok  ' if p['ok'] else 'FAIL'} {head}: max error vs float32 bf16 {e['bfloat16']['pallas']:.3g} "
            f"(blocked {e['bfloat16']['blocked']:.3g}), float32 {e['float32']['pallas']:.3g} (blocked "
            f"{e['float32']['blocked']:.3g}); fwd+bwd bf16 {ms['pallas_bfloat16']:.2f} ms vs {a['implementation']} "
            f"{a['fwd_bwd_ms']['fused']:.2f} ms vs blocked {a['fwd_bwd_ms']['blocked']:.2f} ms; float32 "
            f"{ms['pallas_float32']:.2f} ms vs blocked {ms['blocked_float32']:.2f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes; XLA stands in for cuDNN off CUDA")
    p.add_argument("--reps", type=int, default=10, help="timed calls per path (default 10)")
    p.add_argument("--out", metavar="FILE.json")
    args = p.parse_args(argv)
    r = run(args.dry_run, args.reps)
    print(f"{r['device']}, jax {r['jax']}" + (" (dry run: tiny shapes)" if args.dry_run else ""))
    print("\n".join(lines(r)))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
