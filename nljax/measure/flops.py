"""Training FLOPs per unit (token; image for the DiT) from the config and the parameter shapes:
the analytic count that `nljax.bench` reports beside XLA's count of the compiled program."""

from __future__ import annotations

import jax
import numpy as np

from nljax.config import Config
from nljax.models import registry
from nljax.parallel import levels


def matmul_params(param_shapes) -> tuple[int, int]:
    """(all parameters, those a unit multiplies by): the token embedding is a table lookup and
    `memory0_*` is the inner loop's initial state, not a weight applied to every token."""
    lookup = lambda name: name == "embed/embedding" or name.split("/")[-1].startswith("memory0_")
    return count_params(param_shapes), count_params(param_shapes, lambda name: not lookup(name))


def count_params(param_shapes, keep=lambda name: True) -> int:
    return sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes)
               if keep(levels.path_str(path)))


def analytic_flops(cfg: Config, model, param_shapes) -> dict:
    """Training FLOPs per unit (token; image for the DiT), standard formulas:

    - outer: 6 N (forward 2 N, backward 4 N), N = parameters a token multiplies by (the DiT's
      conditioning MLPs, adaLN and time/label embeddings, count once per image);
    - attention: 12 L C D per token (QK^T and AV, 2 x 2 C D forward, x3 with backward), C the
      context a token attends to: min(window, seq_len) for nl_lm (an upper bound: the causal
      mask halves it inside the first window), all N_p patches for the DiT;
    - inner (nl_lm's neural memory, an estimate): per token and memory layer the chunk reads
      M(q) and evaluates M(k) at the chunk-start memory (2 x 4 H d h for the MLP memory), and
      one vector-Jacobian product for its gradient (~2x that): 16 H d h forward, x3 with the
      outer backward: 48 H d h (linear memory: 24 H d^2).
    MeanFlow's JVP adds about one forward pass on top; XLA's count includes it."""
    m = cfg.model
    n_total, n = matmul_params(param_shapes)
    out = {"params": n_total, "matmul_params": n, "outer_per_token": 6.0 * n}  # matmul_params: per token
    # the model's own terms (`ModelSpec.flops`): the context a token attends to, its inner loop,
    # and for a denoiser the tokens per image and the parameters applied once per image
    terms = registry.spec(m.name).flops
    terms = terms(cfg, model, param_shapes) if terms is not None else {}
    ctx, per_unit = terms.get("context", 0), terms.get("tokens_per_unit", 1)
    out["inner_memory_per_token"] = float(terms.get("inner_memory_per_token", 0.0))
    if "per_unit_param" in terms:
        per_image = count_params(param_shapes, terms["per_unit_param"])
        out["matmul_params"], out["per_image_params"] = n - per_image, per_image
        out["outer_per_token"] = 6.0 * (n - per_image)
        out["outer_per_image_conditioning"] = 6.0 * per_image
    out["attention_per_token"] = 12.0 * m.depth * ctx * m.dim
    out["tokens_per_unit"] = per_unit
    per_token = out["outer_per_token"] + out["attention_per_token"] + out["inner_memory_per_token"]
    out["total_per_unit"] = per_token * per_unit + out.get("outer_per_image_conditioning", 0.0)
    return out
