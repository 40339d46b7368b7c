"""What a config's forward pass keeps for its backward pass: the residuals of `jax.vjp` of the
model's loss, summed (a property of the program, the same on every backend; no compilation).

    python benchmarks/residuals.py --config titans_demo train.batch_size=128 model.dtype=bfloat16

One device's rows (`train.batch_size` as given), parameters included (they are residuals too).
`--list` prints every residual with the line of the model that made it
(`jax.ad_checkpoint.print_saved_residuals`). Peak memory adds the parameters' gradients, the
optimizer state and the backward pass's temporaries: `python -m nljax.bench` measures it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.ad_checkpoint  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from nljax import config  # noqa: E402
from nljax.models import build  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--list", action="store_true", help="print every residual and where it comes from (of the "
                   "derivative with respect to every input: the memory state's residuals are listed too)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    try:
        cfg = config.load(args.config, args.overrides)
        model = build(cfg)
    except config.ConfigError as e:
        print(f"residuals.py: error: {e}", file=sys.stderr)
        return 2
    if getattr(model, "task", "text") != "text":
        print(f"residuals.py: error: model.name={cfg.model.name} is not a language model (this script feeds it tokens)",
              file=sys.stderr)
        return 2
    rows, seq = cfg.train.batch_size, cfg.train.seq_len
    params = jax.eval_shape(model.init, jax.random.key(0))
    memory = jax.eval_shape(lambda: model.init_memory(rows))
    batch = {"tokens": jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32), "reset": jax.ShapeDtypeStruct((rows,), bool)}
    loss = lambda p, m, b: model.apply(p, m, b)[0]
    kept = jax.eval_shape(lambda p, m, b: jax.tree.leaves(jax.vjp(lambda p: loss(p, m, b), p)[1]), params, memory, batch)
    total = sum(r.size * r.dtype.itemsize for r in kept)
    n_params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(f"{' '.join(args.overrides) or '(config as is)'}: residuals {total / 2**30:.2f} GiB in {len(kept)} arrays "
          f"({n_params / 2**30:.3f} GiB of them parameters)")
    if args.list:
        jax.ad_checkpoint.print_saved_residuals(loss, params, memory, batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
