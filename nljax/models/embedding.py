"""The token embedding with a chosen backward pass (`model.nl_lm.embed_grad`).

The forward pass of an embedding is a gather; its gradient, left to autodiff, is a scatter-add of
the [B·T, D] cotangent into the [V, D] table. On a GPU its atomic adds collide on the rows that
many tokens share (a byte vocabulary: 16,384 rows into 256): 8% of nl_350m's step on an H200
(docs/benchmarks/2026-11-27-h200.md). Two other forms of the same sum:

- `onehot`: one_hot(ids)^T @ g, a [V, N] x [N, D] matmul on the tensor cores, accumulated in
  float32; it costs 2·N·V·D FLOPs and a [N, V] one-hot, so it is for small vocabularies
  (`ONEHOT_MAX_VOCAB`: at nl_350m's widths 4096 rows add 0.4% to the step's FLOPs);
- `segment`: the cotangent rows sorted by token id and summed per id
  (`jax.ops.segment_sum(..., indices_are_sorted=True)`), for any vocabulary;
- `scatter`: flax's `nn.Embed` (autodiff's scatter-add); under a compute dtype other than the
  table's (bfloat16) the rows are gathered from the float32 table and then cast, the same bits,
  so that the scatter-add sums in float32 as the other two forms do.

`auto` is `scatter` on a CPU (the default job's program unchanged) and `onehot` on other
backends when the vocabulary is at most `ONEHOT_MAX_VOCAB`, `scatter` above it. The GPU timings
that would confirm the choice are pending (benchmarks/gpu_suite.sh measures them).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from nljax.errors import ConfigError

CHOICES = ("auto", "scatter", "onehot", "segment")
ONEHOT_MAX_VOCAB = 4096


def resolve(choice: str, vocab: int, backend: str) -> str:
    """scatter | onehot | segment for the config's `choice`, a vocabulary of `vocab` token ids
    and the platform's `backend` (`platform.backend()`)."""
    if choice not in CHOICES:
        raise ConfigError(f"model.nl_lm.embed_grad must be one of {', '.join(CHOICES)}, got '{choice}'")
    if choice != "auto":
        return choice
    return "onehot" if backend != "cpu" and vocab <= ONEHOT_MAX_VOCAB else "scatter"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embed_lookup(table, ids, dtype, grad: str):
    """table[ids] in `dtype` (table [V, D] float32, ids [...] int -> [..., D]), the same bits as
    `nn.Embed`'s forward; the table's gradient by `grad` (onehot | segment), in float32."""
    return _lookup_fwd(table, ids, dtype, grad)[0]


def _lookup_fwd(table, ids, dtype, grad):
    return jnp.take(table.astype(dtype), ids, axis=0), (ids, table)  # the table: for its shape (a parameter: held anyway)


def _lookup_bwd(dtype, grad, res, g):
    ids, table = res
    vocab = table.shape[0]
    flat, g2 = ids.reshape(-1), g.reshape(-1, g.shape[-1])  # [N], [N, D]
    if grad == "onehot":
        hot = jax.nn.one_hot(flat, vocab, dtype=g2.dtype)  # [N, V]: exact in any float dtype
        # float32 products summed in float32: HIGHEST keeps a GPU from rounding float32 inputs to TF32
        table_grad = jax.lax.dot_general(hot, g2, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)
    elif grad == "segment":
        order = jnp.argsort(flat)
        table_grad = jax.ops.segment_sum(g2[order].astype(jnp.float32), flat[order], num_segments=vocab,
                                         indices_are_sorted=True)
    else:
        raise ValueError(f"embed_lookup: grad must be onehot or segment, got '{grad}'")
    return table_grad, None


embed_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nn.Embed):
    """`nn.Embed` (its parameter `embedding`, its forward pass) whose table gradient is computed
    as `grad` says (scatter: flax's own; onehot, segment: `embed_lookup`)."""

    grad: str = "scatter"

    def __call__(self, inputs):
        dtype = jnp.dtype(self.dtype or self.param_dtype)
        if self.grad == "scatter" and self.num_embeddings > 1 and dtype != self.embedding.dtype:
            # gathered from the float32 table, then cast: nn.Embed's forward bits (a gather
            # commutes with an elementwise cast), but autodiff's scatter-add then sums the
            # cotangents in float32, not in bfloat16 (16,384 tokens into 256 rows: 0.98% of the
            # exact sum in bfloat16, 2.6% at 131,072; float32's: 4e-9)
            return jnp.take(self.embedding, inputs, axis=0).astype(dtype)
        if self.grad == "scatter" or self.num_embeddings == 1:
            return super().__call__(inputs)
        return embed_lookup(self.embedding, inputs, jnp.dtype(self.dtype or self.param_dtype), self.grad)
