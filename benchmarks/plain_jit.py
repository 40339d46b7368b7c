"""Engine overhead: nljax's step against a plain `jax.jit` train step of the same model.

    python benchmarks/plain_jit.py [--config FILE] [--rounds R] [--warmup W] [key=value ...]

On one device, times side by side, interleaved (plain, nljax, plain, nljax, ...; medians):

- plain: the textbook step written in a few lines: `value_and_grad` of `model.apply`'s mean
  loss, `optax.adamw` over the whole parameter tree, the inner-loop memory carried from step to
  step (gradient stopped), one `jax.jit` with donated buffers;
- nljax: the compiled step variant of the same config where every level fires (the same work:
  every parameter updated) and the one of level 0 alone (the most frequent pattern), built by
  `nljax.run.core.Run` on a 1-device mesh, as `nljax.train` runs it.

Same model, batch, optimizer hyper-parameters and memory; the ratio nljax / plain is the
engine's overhead (shard_map, per-level flat buffers, gradient checks, learning-rate schedule).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

from nljax import cli
from nljax.engine.conductor import pattern_name


def plain_step(model, cfg):
    """The few-line train step: (params, opt_state, memory, batch) -> same + loss."""
    o = cfg.optim
    tx = optax.adamw(o.lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)

    def step(params, opt_state, memory, batch):
        def loss_fn(p):
            loss_sum, count, new_memory = model.apply(p, memory, batch, jax.random.key(0))
            return loss_sum / count, new_memory

        (loss, memory), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.stop_gradient(memory), loss

    return tx, jax.jit(step, donate_argnums=(0, 1, 2))


def interleaved(calls: dict, warmup: int, rounds: int) -> dict:
    """name -> step times of `rounds` rounds over all calls, after `warmup` untimed rounds."""
    times = {k: [] for k in calls}
    for i in range(warmup + rounds):
        for k, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def _run(args, cfg) -> int:
    from nljax.run.core import Run

    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, inter=1, intra=1))
    setup = Run.create(cfg, devices=jax.devices()[:1])
    state = setup.init_state()
    batch, model = setup.batch(0), setup.engine.model
    tx, step = plain_step(model, cfg)
    params = model.init(jax.random.key(cfg.seed))
    plain = {"params": params, "opt": tx.init(params), "memory": jax.tree.map(jnp.copy, state.memory)}

    def call_plain():
        plain["params"], plain["opt"], plain["memory"], loss = step(plain["params"], plain["opt"], plain["memory"], batch)
        return loss

    for _ in range(2):  # compiles, then again for the committed shardings of its own outputs
        jax.block_until_ready(call_plain())
    every = tuple(True for _ in cfg.cms.periods)
    level0 = tuple(l == 0 for l in range(len(cfg.cms.periods)))
    chain = {"state": state}

    def call_nljax(active):
        fn = setup.cache.train_fn(active, chain["state"], batch)

        def run():
            chain["state"], metrics = fn(chain["state"], batch)
            return chain["state"], metrics

        return run

    calls = {"plain jax.jit": call_plain, f"nljax {pattern_name(every)}": call_nljax(every)}
    if level0 != every:
        calls[f"nljax {pattern_name(level0)}"] = call_nljax(level0)
    times = interleaved(calls, args.warmup, args.rounds)
    base = statistics.median(times["plain jax.jit"])
    tokens = jax.tree.leaves(batch)[0].shape[0] * setup.task.units_per_row
    print(f"{cfg.model.name}, batch {cfg.train.batch_size}, 1 {jax.devices()[0].platform} device, "
          f"{args.rounds} interleaved rounds after {args.warmup} warm-up (medians)")
    print(f"{'step':<22}{'median ms':>11}{'min ms':>9}{'max ms':>9}{setup.task.unit[:3] + '/s':>10}{'vs plain':>10}")
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"{k:<22}{med * 1e3:>11.2f}{min(ts) * 1e3:>9.2f}{max(ts) * 1e3:>9.2f}{tokens / med:>10,.0f}"
              f"{med / base:>10.3f}")
    return 0


def main(argv=None) -> int:
    p = cli.parser("benchmarks/plain_jit.py", "nljax's step against a plain jax.jit step of the same model.")
    p.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    return cli.main(_run, p, argv)


if __name__ == "__main__":
    sys.exit(main())
