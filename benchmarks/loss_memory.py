"""Temporary memory of the compiled loss and gradients, full against chunked cross-entropy
(`model.nl_lm.loss_chunk`, nljax/models/chunked_loss.py). Compiles only: nothing runs, so the
shapes may be larger than the machine's memory.

    python benchmarks/loss_memory.py [--chunk 512] [TOKENSxVOCABxDIM ...]   (default: 4096x8192x64 16384x32768x1024)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402  (after the path: a checkout need not be installed)
import jax.numpy as jnp  # noqa: E402

from nljax.models.chunked_loss import chunked_token_loss  # noqa: E402
from nljax.models.layers import dense_dot, token_loss  # noqa: E402


def full_loss(x, kernel, bias, targets):
    return token_loss(dense_dot(x, kernel.astype(x.dtype), (((2,), (0,)), ((), ()))) + bias.astype(x.dtype), targets)


def temp_bytes(loss, tokens: int, vocab: int, dim: int) -> int:
    args = (jax.ShapeDtypeStruct((1, tokens, dim), jnp.bfloat16), jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((vocab,), jnp.float32), jax.ShapeDtypeStruct((1, tokens), jnp.int32))
    grad = jax.jit(jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("shapes", nargs="*", default=["4096x8192x64", "16384x32768x1024"])
    args = p.parse_args(argv)
    print(f"{jax.devices()[0].platform}: temporaries of the compiled loss + gradients (bfloat16 head input)")
    for shape in args.shapes:
        tokens, vocab, dim = map(int, shape.split("x"))
        full = temp_bytes(full_loss, tokens, vocab, dim)
        chunked = temp_bytes(lambda x, k, b, y: chunked_token_loss(x, k, b, y, chunk=args.chunk), tokens, vocab, dim)
        print(f"  {tokens:,} tokens x {vocab:,} ids, dim {dim}: full {full / 2**20:,.1f} MiB, "
              f"loss_chunk={args.chunk} {chunked / 2**20:,.1f} MiB ({full / chunked:.1f}x less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
