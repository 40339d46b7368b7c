"""Can the neural memory learn associative recall on its own? An isolation study for the probe.

    python benchmarks/recall_isolated.py [--net memory|nl_lm] [--steps N] [--pairs K] [--chunk B]
                                         [--no-attention] [--seed S]

Trains with a plain optax loop (AdamW 3e-3, batch 32, fresh documents every step, memory reset
per document) on recall documents of 1-letter keys and 1-digit values (`nljax.data.recall`,
8-byte gap, 128 tokens), and prints the accuracy on the queried digits (chance 0.1):

- `--net memory`: embedding -> one `NeuralMemory` layer (the trainer's module, linear kind) ->
  an MLP -> logits: the memory alone;
- `--net nl_lm`: the trainer's model (`nljax.models.build`) at depth 1, window 4, memory chunk 4;
  `--no-attention` replaces its attention by zero.

Separates "the memory cannot learn recall" from "the model around it keeps it from learning".
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from nljax import config
from nljax.data.recall import document
from nljax.models import build, nl_lm
from nljax.models import memory as nm

T, B, D = 129, 32, 64  # document bytes (128 inputs + the last target), batch, model width


class MemoryNet(nn.Module):
    chunk: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(256, D)(tokens)
        mem = nl_lm.NeuralMemory(dim=D, heads=2, dk=32, hidden=64, kind="linear", chunk=self.chunk)
        state = nm.init_state({n: jnp.zeros(s) for n, s in mem.memory0_shapes().items()}, tokens.shape[0])
        y, _ = mem(nn.LayerNorm()(x), state, jnp.ones(tokens.shape[0], bool))
        x = x + y
        x = x + nn.Dense(D)(jax.nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
        return nn.Dense(256)(nn.LayerNorm()(x))


class ZeroAttention(nn.Module):
    dim: int
    heads: int
    window: int
    dtype: jnp.dtype = jnp.float32

    def __call__(self, x):
        return jnp.zeros_like(x)


def logits_fn(args):
    """(init(key) -> params, logits(params, tokens [B, T-1]) -> [B, T-1, 256])."""
    if args.net == "memory":
        net = MemoryNet(args.chunk)
        return (lambda key: net.init(key, jnp.zeros((B, T - 1), jnp.int32)),
                lambda p, tok: net.apply(p, tok))
    if args.no_attention:
        nl_lm.Attention = ZeroAttention  # NLNet looks the class up when it is called
    cfg = config.load(None, ["model.name=nl_lm", "model.dim=64", "model.depth=1", "model.heads=2", f"model.nl_lm.window={args.window}",
                             "model.nl_lm.memory_layers=[0]", "model.nl_lm.memory_heads=2", "model.nl_lm.memory_dim=32",
                             f"model.nl_lm.memory_chunk={args.chunk}", "cms.periods=[1]"])
    model = build(cfg)
    memory = model.init_memory(B)
    batch = lambda tok: {"tokens": jnp.concatenate([tok, tok[:, -1:]], 1), "reset": jnp.ones(B, bool)}
    return model.init, lambda p, tok: model.logits(p, memory, batch(tok))[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--net", choices=["memory", "nl_lm"], default="memory")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--window", type=int, default=4, help="nl_lm's attention window (>= --chunk)")
    p.add_argument("--gap", type=int, default=8, help="filler bytes between the pairs and the queries (>= window)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss", choices=["all", "values"], default="all",
                   help="train on every next byte, or only on the queried value bytes (as MQAR does)")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)

    def batch():
        docs, scores = zip(*[document(rng, T, args.pairs, args.gap, 1, 1, 1) for _ in range(B)])
        return np.frombuffer(b"".join(docs), np.uint8).reshape(B, T).astype(np.int32), np.stack(scores)

    init, logits = logits_fn(args)
    params = init(jax.random.key(args.seed))
    opt = optax.adamw(3e-3)
    opt_state = opt.init(params)

    def loss_fn(params, tok, score):
        lg = logits(params, tok[:, :-1])
        nll = optax.softmax_cross_entropy_with_integer_labels(lg, tok[:, 1:])
        loss = nll.mean() if args.loss == "all" else (nll * score[:, 1:]).sum() / score[:, 1:].sum()
        hits = (lg.argmax(-1) == tok[:, 1:]) * score[:, 1:]
        return loss, hits.sum() / score[:, 1:].sum()

    @jax.jit
    def step(params, opt_state, tok, score):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, tok, score)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    accs, t0 = [], time.time()
    for i in range(args.steps):
        params, opt_state, loss, acc = step(params, opt_state, *batch())
        accs.append(float(acc))
        if (i + 1) % 125 == 0:
            print(f"step {i + 1:5d}  loss {float(loss):.3f}  recall accuracy (last 100 steps) "
                  f"{np.mean(accs[-100:]):.3f}  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
