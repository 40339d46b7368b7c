"""XLA's FLOP count of a config's worst-pattern training step, with the neural memory's chunk
loop as it is and unrolled: how much a loop's body, counted once, hides (docs/benchmarks/2026-11-24-cpu.md).

    python benchmarks/xla_count.py nl_default 1 8     # memory_unroll 1, then 8
"""

import sys

from nljax import cli, config

cli.setup_devices(1)

import jax  # noqa: E402 - after the device count is set

from nljax.run.core import Run  # noqa: E402

for unroll in sys.argv[2:]:
    cfg = config.load(sys.argv[1], [f"model.nl_lm.memory_unroll={unroll}", "eval.every=0"])
    run = Run.create(cfg, jax.devices()[:1])
    state, batch = run.init_state(), run.batch(0)
    fn = run.cache.train_fn(tuple(True for _ in cfg.cms.periods), state, batch)
    ca = fn.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    print(f"{sys.argv[1]} memory_unroll={unroll}: XLA FLOPs per token {ca['flops'] / run.units_per_device(batch):,.0f}")
