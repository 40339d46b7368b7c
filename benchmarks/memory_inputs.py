"""What a trained nl_lm's neural memories read: how much of each memory's input is the same at
every position, and what that does to its keys and its step size.

    python benchmarks/memory_inputs.py runs/recall [--checkpoint 300] [--rows 16]
    python benchmarks/memory_inputs.py --init [--config FILE] [key=value ...]   # fresh parameters

On the first `--rows` held-out windows of the run's data (`train.seq_len` tokens each, a fresh
memory per window), prints for every block the rms of each sub-block's output (embedding,
attention, memory, CMS levels) and of its shared part (the mean over the window's positions:
what every position receives alike), then for each memory:

- `input shared`: ||mean_t x_t||² / mean_t ||x_t||² of the memory's input x (its block's
  normalised stream, plus the normalised embeddings with `model.nl_lm.memory_embed`; 0: every
  position different; 1: every position the same);
- `k shared`, `|k_i.k_j|`: the same for its unit keys, and their mean |cosine| inside a chunk;
- `lambda`: the chunk's curvature bound for the linear memory (Gershgorin over |k_i.k_j|, in
  [1, chunk]): every write of the chunk is divided by it, so keys that share a direction write
  their distinct parts `lambda` times more weakly (`nljax/models/memory.py`).

docs/experiments/2026-11-27-where-the-memory-goes.md reads these figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nljax import config
from nljax.errors import ConfigError  # noqa: E402
from nljax.models import build, nl_lm  # noqa: E402
from nljax.run import trained  # noqa: E402
from nljax.run.tasks import text_data  # noqa: E402

CAPTURED = ("Embed", "Attention", "NeuralMemory", "MLP", "LayerNorm", "CausalConv")


def shared_fraction(x) -> float:
    """||mean over positions||² / mean ||x_t||², averaged over rows.  x [B, T, ...]"""
    x = x.reshape(x.shape[0], x.shape[1], -1)
    return float(jnp.mean(jnp.sum(x.mean(1) ** 2, -1) / jnp.mean(jnp.sum(x * x, -1), 1)))


def rms(x) -> float:
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))


def key_stats(conv_out, chunk: int) -> tuple[float, float, float]:
    """(k shared, mean |k_i.k_j| for i != j inside a chunk, mean lambda) of the memory's keys, made
    from its conv's output [B, T, 3, H, dk] as `NeuralMemory.qkv` makes them."""
    k = nl_lm._l2norm(jax.nn.silu(conv_out[:, :, 1]))  # [B, T, H, dk]
    b, t, h, d = k.shape
    kc = k.transpose(0, 2, 1, 3).reshape(b, h, t // chunk, chunk, d)
    g = jnp.abs(jnp.einsum("bhnid,bhnjd->bhnij", kc, kc))
    off = (g.sum((-1, -2)) - jnp.trace(g, axis1=-2, axis2=-1)) / (chunk * (chunk - 1))
    return shared_fraction(k), float(off.mean()), float(g.sum(-1).max(-1).mean())


def report(cfg, model, params, rows: int) -> None:
    if cfg.model.name != "nl_lm":
        raise ConfigError(f"model.name={cfg.model.name}: this reads the memories of an nl_lm")
    t = cfg.train.seq_len
    held = text_data(cfg).held
    if len(held) < rows * t:
        raise ConfigError(f"the held-out data holds fewer than --rows {rows} windows of {t} tokens")
    tokens = jnp.asarray(np.asarray(held[: rows * t]).reshape(rows, t).astype(np.int32))
    inputs = {}  # memory name -> what it reads, as the model gives it (stream, embeddings or both)

    def record(call, args, kwargs, context):
        if isinstance(context.module, nl_lm.NeuralMemory) and context.method_name == "__call__":
            inputs[context.module.name] = args[0]
        return call(*args, **kwargs)

    with nn.intercept_methods(record):
        _, state = model.net.apply({"params": params}, tokens, model.init_memory(rows), jnp.ones(rows, bool),
                                   capture_intermediates=lambda m, name: name == "__call__" and type(m).__name__ in CAPTURED)
    out = state["intermediates"]
    first = lambda x: x[0] if isinstance(x, tuple) else x  # the memory returns (y, state)
    show = lambda name, x: print(f"  {name:14s} output rms {rms(x):7.3f}   shared part rms {rms(x.mean(1)):7.3f}")
    print(f"{'':2s}{'sub-block':14s} (rows {rows} x {t} held-out tokens)")
    show("embed", out["embed"]["__call__"][0])
    for i in range(cfg.model.depth):
        show(f"attn{i}", out[f"attn{i}"]["__call__"][0])
        if f"mem{i}" in out:
            show(f"mem{i}", first(out[f"mem{i}"]["__call__"][0]))
        for level in range(len(cfg.cms.periods)):
            show(f"block{i}/cms{level}", out[f"block{i}"][f"cms{level}"]["__call__"][0])
    for i in range(cfg.model.depth):
        if f"mem{i}" not in out:
            continue
        if "conv" not in out[f"mem{i}"]:
            print(f"mem{i}: model.nl_lm.memory_conv=0 (keys not read)")
            continue
        ks, cos, lam = key_stats(out[f"mem{i}"]["conv"]["__call__"][0], cfg.model.nl_lm.memory_chunk)
        print(f"mem{i}: input shared {shared_fraction(inputs[f'mem{i}']):.3f}  k shared {ks:.3f}  "
              f"|k_i.k_j| {cos:.3f}  lambda {lam:.2f} (chunk {cfg.model.nl_lm.memory_chunk})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", help="a run directory written by nljax.train")
    p.add_argument("--checkpoint", default="latest", help="a step of the run's checkpoints (default: the newest)")
    p.add_argument("--init", action="store_true", help="fresh parameters of --config and the overrides instead")
    p.add_argument("--config", default=None)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    try:
        if args.rows < 1:
            raise ConfigError(f"--rows must be >= 1, got {args.rows}")
        if args.init:  # the first override lands in run_dir
            cfg = config.load(args.config, [args.run_dir, *args.overrides] if args.run_dir else args.overrides)
            model = build(cfg)
            params = model.init(jax.random.key(cfg.seed))
        elif args.run_dir:
            ck = args.checkpoint if args.checkpoint == "latest" else str(Path(args.run_dir) / "checkpoints" / args.checkpoint)
            t = trained.load(args.run_dir, ck, args.overrides, devices=jax.devices()[:1])
            cfg, model, params = t.trained_cfg, t.model, jax.device_get(t.params)
            print(f"{args.run_dir}, step {t.step}")
        else:
            raise ConfigError("give a run directory, or --init")
        report(cfg, model, params, args.rows)
    except ConfigError as e:
        print(f"memory_inputs.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
