"""The output head and its cross-entropy over chunks of tokens (`model.nl_lm.loss_chunk`).

`layers.token_loss` takes the whole [B, T, V] logits and upcasts them to float32 for the
log-softmax: the step then holds the logits, their float32 copy and the log-probabilities (and
their cotangents in the backward pass), 4·B·T·V bytes each in float32. At a byte vocabulary
that is small (nl_350m, 8 x 2048 tokens: 16 MiB); with a tokenizer's vocabulary it is not
(32k ids: 2 GiB per copy at the same batch). `chunked_token_loss` computes the head's matmul,
the float32 log-softmax and the summed loss one chunk of tokens at a time in a `lax.scan`
whose body is `jax.checkpoint`ed: the forward pass keeps only each chunk's input rows (slices of
the head's input, which is held anyway), and the backward pass recomputes one chunk's logits at
a time. Same matmul per token as the head (`nn.Dense` with `dense_dot`) followed by
`token_loss`, the bias added in float32 as the head adds it (`layers.dense`), the logits kept in
float32 where the head rounds them to the compute dtype; sums in another order, so equal up to
float rounding.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nljax.models.layers import dense_dot


def token_weights(shape, mask=None, weight=None):
    """Each target's weight [B, T] float32: `weight` (None: 1) times the row's `mask` [B]."""
    w = jnp.ones(shape, jnp.float32) if weight is None else weight.astype(jnp.float32)
    return w if mask is None else w * mask.astype(jnp.float32)[:, None]


def _chunk_nll(kernel, bias, x, y, w):
    """Summed weighted cross-entropy of one chunk: x [c, D] (compute dtype), y [c] ids, w [c]."""
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=x.dtype)  # the matmul as nn.Dense(dtype=x.dtype)
    # the bias added in float32: its gradient is then a float32 sum of the chunk's cotangents (in
    # bf16, per-chunk sums of 4096 rounded cotangents: the H200's check of 2026-11-28 failed, the
    # worst gradient 6.5x the full head's error; the same check on a CPU put the bias at 0.0117
    # of its largest entry, 5e-5 summed in float32: docs/benchmarks/2026-11-28-h200.md)
    logits = dense_dot(x, kernel, (((1,), (0,)), ((), ()))).astype(jnp.float32) + bias.astype(jnp.float32)  # [c, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * w)


def chunked_token_loss(x, kernel, bias, targets, mask=None, weight=None, chunk: int = 1024):
    """`token_loss(head(x), targets, mask, weight)` with the head applied `chunk` tokens at a time.
    x [B, T, D] (the head's input, in the compute dtype), kernel [D, V], bias [V] (the head's
    float32 parameters), targets [B, T]; mask [B], weight [B, T] as `token_loss` takes them.
    Returns (summed loss, token count). The B·T tokens are cut into ceil(B·T / chunk) chunks, the
    last padded with tokens of weight 0."""
    b, t, d = x.shape
    n = b * t
    c = min(chunk, n)
    pieces = -(-n // c)
    w = token_weights((b, t), mask, weight)
    pad = lambda a: jnp.pad(a.reshape(n, *a.shape[2:]), ((0, pieces * c - n),) + ((0, 0),) * (a.ndim - 2))
    xs = pad(x).reshape(pieces, c, d)  # [pieces, c, D]
    ys, ws = pad(targets).reshape(pieces, c), pad(w).reshape(pieces, c)
    piece = jax.checkpoint(_chunk_nll)  # the backward pass recomputes one chunk's logits at a time

    def body(total, chunk_in):
        return total + piece(kernel, bias, *chunk_in), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ys, ws))
    count = jnp.asarray(n, jnp.float32) if mask is None and weight is None else jnp.sum(w)
    return total, count
