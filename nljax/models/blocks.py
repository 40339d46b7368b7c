"""Building blocks for a nested-learning model: the public, stable names to compose a new model
from without copying nljax code (the repository's `examples/` holds a model written only against them).

Shapes: B rows, T tokens, D model width, H heads, hd head width, dk the memory's key/value width.

Levels
    `CMSChain(dim, hidden, levels)`: k pre-norm MLPs applied in sequence, level l a module named
    `cms<l>`, each starting as the identity (zero-initialised output). `cms_level_of(path)` is the
    naming rule the engine reads back: a parameter under a `cms<l>` module is level l, anything
    else level 0. A model that names its slow modules `cms<l>` and returns `cms_level_of` from
    `level_of` gets the CMS schedule with no rule of its own. `MLP` is one level.

Inner-loop memory (Titans-style; derivation and stability argument in `nljax.models.memory`)
    `NeuralMemory(dim, heads, dk, hidden, kind, chunk)`: a flax module,
    `(x [B, T, D], state, reset [B] bool) -> (y [B, T, D], new_state)`. It projects x to unit-norm
    q, k, v per head, writes k -> v into a per-row, per-head memory by gradient steps with learnt
    gates, and reads q. `state` is `{"M": W, "S": W}` (memory and momentum), W `{"W": [B, H, dk,
    dk]}` (kind "linear") or `{"W1": [B, H, dk, hidden], "W2": [B, H, hidden, dk]}` ("mlp"); the
    learnt initial memory is the parameter `memory0_*`. `reset[b]`: row b restarts from
    memory0 before reading its tokens (the row began a new document); a row whose state became
    non-finite restarts too. `memory_state(module, rows)` is the zeros a model's `init_memory`
    returns for it (the engine resets every row at step 0).
    `memory_forward(state, q, k, v, theta, eta, alpha, kind=, chunk=)` is the same inner loop as
    a function on q, k [B, H, T, dk], v [B, H, T, dv] and gates [B, H, T] (step, momentum,
    forgetting): (y [B, H, T, dv], new state), chunk-parallel (`memory_reference` is its
    token-by-token definition); `init_state(memory0, rows)` and `reset_rows(state, memory0,
    reset)` make and restart states.

    Rank-local: the state's leading axis is the stream row. The engine splits it over the data
    axes with the batch rows, so each device holds and updates only its rows' states (never
    reduced, gathered or replicated) and checkpoints them per row. Under tensor parallelism
    (`tp` shards over `axis`) the module holds heads / tp heads and their state, its gates and
    projections split by head: the engine reads the split from the state's shapes.

Attention
    `local_attention(q, k, v, window)`: causal sliding-window attention, q, k, v [B, T, H, hd] ->
    [B, T, H, hd], cost linear in T. `Attention(dim, heads, window)`: the module around it
    (rotary positions, qkv and zero-initialised output projections, head-split under tensor
    parallelism); its `impl="cudnn"` runs cuDNN's fused attention instead (CUDA GPUs, bf16/fp16),
    `impl="pallas"` a Pallas flash attention (`nljax.models.attention`). `rotary(x)`: rotary
    position embedding, x [B, T, H, hd].

Losses
    `token_loss(logits [B, T, V], targets [B, T], mask [B] | None, weight [B, T] | None) ->
    (sum, count)`: summed cross-entropy and the summed weights, the pair `Model.apply` returns.
    `token_hits(logits, targets, score)`: greedy hits at scored positions.

Layers and tensor parallelism
    `LayerNorm` (flax's arithmetic, a lighter backward), `dense_dot` (a `dot_general=` for
    `nn.Dense`, faster kernel gradient on CPU), `RowDense` (a row-parallel `nn.Dense`),
    `recomputed(fn, on)` (remat a cheap function or module), `CausalConv`. `tp_enter(x, axis)`
    and `tp_leave(y, axis)` mark a tensor-parallel region (identity forward; a sum over `axis` of
    the input's gradient, of the output); `tp_divides(m, [(name, width)])` refuses a split that
    does not divide.
"""

from __future__ import annotations

import jax.numpy as jnp

from nljax.models.base import Model, TextModel, cms_level_of, tp_divides
from nljax.models.layers import (MLP, CMSChain, LayerNorm, RowDense, dense_dot, local_attention, recomputed,
                                 token_hits, token_loss)
from nljax.models.memory import init_state, memory_forward, memory_reference, read, reset_rows
from nljax.models.nl_lm import Attention, CausalConv, NeuralMemory, rotary
from nljax.parallel.tp import enter as tp_enter
from nljax.parallel.tp import leave as tp_leave

__all__ = ["Attention", "CMSChain", "CausalConv", "LayerNorm", "MLP", "Model", "NeuralMemory", "RowDense",
           "TextModel", "cms_level_of", "dense_dot", "init_state", "local_attention", "memory_forward",
           "memory_reference", "memory_state", "read", "recomputed", "reset_rows", "rotary", "token_hits",
           "token_loss", "tp_divides", "tp_enter", "tp_leave"]


def memory_state(module: NeuralMemory, rows: int) -> dict:
    """Zeros of `module`'s inner-loop state for `rows` rows: {"M": W, "S": W}, each leaf
    [rows, heads / tp, ...] float32 (W as in the module docstring). What `init_memory` returns
    for it; the first step resets every row to the learnt memory0. Distinct buffers per leaf (the
    train step donates the state)."""
    zeros = lambda: {k: jnp.zeros((rows, *s), jnp.float32) for k, s in module.memory0_shapes().items()}
    return {"M": zeros(), "S": zeros()}
