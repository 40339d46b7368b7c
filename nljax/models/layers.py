"""Layers shared by the language models."""

from __future__ import annotations

import functools
import math
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp

from nljax.errors import ConfigError
from nljax.parallel import tp as tplib


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def dense_dot(x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general` for a dense layer (x's trailing dims contracted with the kernel's
    leading ones, no batch dims: a drop-in `dot_general=` for `nn.Dense`) whose backward pass
    computes the kernel's gradient x^T g on the CPU with an operand transposed first
    (`kernel_grad_transposed_first`). XLA:CPU otherwise runs that product, whose left operand
    contracts its leading dim, as a plain Eigen dot at about half the core's matmul peak
    (titans_demo: 72 such dots, a fifth of its step); transposed first (a copy) it is a
    row-major product that its fast matmul path takes (docs/benchmarks/2026-11-24-cpu.md: titans_demo 1.14x
    the tokens/s, the default job 1.30-1.36x). Other backends transpose operands inside the
    matmul: no copy there. The same products, so the same gradient up to summation order.
    Reverse mode only (a `custom_vjp`): the DiT, whose MeanFlow loss takes a `jax.jvp`, keeps
    `jax.lax.dot_general`."""
    return _dense_fwd(x, kernel, dimension_numbers, precision, preferred_element_type)[0]


def _dense_fwd(x, kernel, dimension_numbers, precision, preferred_element_type):
    (lc, rc), batch = dimension_numbers
    n = len(lc)
    if tuple(map(tuple, batch)) != ((), ()) or tuple(lc) != tuple(range(x.ndim - n, x.ndim)) or tuple(rc) != tuple(range(n)):
        raise ValueError(f"dense_dot: not a dense layer's contraction: {dimension_numbers}")
    return jax.lax.dot_general(x, kernel, dimension_numbers, precision, preferred_element_type), (x, kernel)


def _dense_bwd(dimension_numbers, precision, preferred_element_type, res, g):
    x, kernel = res
    n = len(dimension_numbers[0][0])
    k = math.prod(kernel.shape[:n])
    t = jnp.promote_types(jnp.promote_types(x.dtype, kernel.dtype), g.dtype)  # as autodiff's transpose computes
    x2, g2, w2 = x.reshape(-1, k).astype(t), g.reshape(-1, math.prod(kernel.shape[n:])).astype(t), kernel.reshape(k, -1).astype(t)
    dx = jax.lax.dot_general(g2, w2, (((1,), (1,)), ((), ())), precision)
    dw = jax.lax.platform_dependent(x2, g2, cpu=functools.partial(kernel_grad_transposed_first, precision=precision),
                                    default=functools.partial(kernel_grad, precision=precision))
    return dx.reshape(x.shape).astype(x.dtype), dw.reshape(kernel.shape).astype(kernel.dtype)


def kernel_grad(x, g, precision=None):  # x [N, K], g [N, M] -> x^T g [K, M]
    return jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), precision)


def kernel_grad_transposed_first(x, g, precision=None):
    """x^T g as a row-major product: the narrower of x and g transposed first (the transpose is
    the cost: a strided copy, 5.8 ms for the default job's [2048, 512] against 0.07 ms for its
    [2048, 128]), so where g is narrower, (g^T x)^T. The barriers keep XLA from folding the
    transposes back into the product."""
    dims = (((1,), (0,)), ((), ()))
    if x.shape[1] <= g.shape[1]:
        return jax.lax.dot_general(jax.lax.optimization_barrier(x.T), g, dims, precision)
    return jax.lax.optimization_barrier(jax.lax.dot_general(jax.lax.optimization_barrier(g.T), x, dims, precision)).T


dense_dot.defvjp(_dense_fwd, _dense_bwd)


class RowDense(nn.Module):
    """`nn.Dense` (same parameters, same arithmetic) whose input is split over the tensor-parallel
    axis on its last dimension: the partial products are summed over `axis` before the bias,
    which every shard holds whole, is added."""

    features: int
    dtype: jnp.dtype = jnp.float32
    axis: str | None = None
    kernel_init: object = nn.initializers.lecun_normal()
    dot_general: object = jax.lax.dot_general  # dense_dot where only reverse mode is needed

    @nn.compact
    def __call__(self, x):  # [..., n_in / m] -> [..., features]
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return add_bias(tplib.leave(self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))), self.axis), bias)


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """`y + bias` with the float32 `bias` added in float32 and the sum rounded once to `y`'s
    dtype (no-ops in float32), so that under bfloat16 the bias's gradient sums the cotangents of
    every row in float32 (in bfloat16, 16,384 rows put RowDense's 4.5e-3 from the exact sum on a
    CPU, 2.7x a bf16 matmul's kernel gradient's error; the head's 0.0117 of its largest entry)."""
    return (y.astype(bias.dtype) + bias).astype(y.dtype)


class F32Bias(nn.Module):
    """A layer built without a bias (`layer()`: nn.Dense, nn.DenseGeneral, nn.Conv with
    use_bias=False), its product in the compute dtype, and a float32 bias of shape `features`
    added by `add_bias` (flax's bfloat16 add sums its gradient in bfloat16). The layer shares
    this module's scope, so the parameters (`kernel`, `bias`), their names and their initial
    values are flax's own."""

    layer: typing.Callable[[], nn.Module]
    features: tuple[int, ...]

    @nn.compact
    def __call__(self, inputs):
        inner = self.layer()
        nn.share_scope(self, inner)
        y = inner(inputs)
        return add_bias(y, self.param("bias", nn.initializers.zeros, self.features, jnp.float32))


def biased(layer: typing.Callable[..., nn.Module], features: int | tuple[int, ...], dtype,
           name: str | None = None, **kwargs) -> nn.Module:
    """`layer(features, dtype=dtype, **kwargs)` (nn.Dense, nn.DenseGeneral, nn.Conv) with a
    bias; under a compute dtype other than float32 an `F32Bias` (the same parameters, the bias
    added in float32). Float32 keeps flax's layer, whose program is unchanged."""
    if jnp.dtype(dtype) == jnp.float32:
        return layer(features, dtype=dtype, name=name, **kwargs)
    shape = tuple(features) if isinstance(features, (tuple, list)) else (features,)
    return F32Bias(functools.partial(layer, features, dtype=dtype, use_bias=False, **kwargs), shape, name=name)


def dense(features: int, dtype, **kwargs) -> nn.Module:
    """`nn.Dense(features, dtype=dtype, **kwargs)` with its bias added in float32 (`biased`)."""
    return biased(nn.Dense, features, dtype, **kwargs)


def recomputed(fn, on: bool):
    """`fn` (a function or a Flax module class) whose backward pass recomputes its intermediates
    from its inputs when `on`: for cheap work (activations, attention's scores) whose
    intermediates, often float32, would otherwise be kept for the backward pass, several times the
    size of the bf16 inputs they are computed from. A pure function: recomputed, the same bits."""
    if not on:
        return fn
    return nn.remat(fn) if isinstance(fn, type) else jax.checkpoint(fn)


class LayerNorm(nn.Module):
    """`nn.LayerNorm` (its parameters, and its forward arithmetic to the bit: float32 statistics,
    fast variance) with a hand-written backward pass that keeps only the input and the [..., 1]
    statistics and recomputes the normalised input from them, elementwise, instead of keeping
    two float32 [..., D] intermediates (8 bytes per feature against a bf16 input's 2). The same
    program with and without `model.remat`, so remat never changes a bit of it. Reverse mode only
    (a `jax.custom_vjp`): the DiT, whose MeanFlow loss takes a `jax.jvp`, keeps `nn.LayerNorm`."""

    dtype: jnp.dtype = jnp.float32
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x):  # [..., D]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        return layer_norm(x, scale, bias, self.epsilon).astype(self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, epsilon):
    """(x - mean) / sqrt(var + epsilon) * scale + bias over the last axis, in float32."""
    return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jax.lax.square(x32), axis=-1, keepdims=True) - jax.lax.square(mean))
    rstd = jax.lax.rsqrt(var + epsilon)
    return (x - mean) * (rstd * scale) + bias, (x, mean, rstd, scale)


def _layer_norm_bwd(epsilon, res, g):
    x, mean, rstd, scale = res
    xhat = (x.astype(mean.dtype) - mean) * rstd
    lead = tuple(range(g.ndim - 1))
    gx = g * scale  # the gradient of xhat
    dx = rstd * (gx - jnp.mean(gx, axis=-1, keepdims=True) - xhat * jnp.mean(gx * xhat, axis=-1, keepdims=True))
    # cotangents in their primals' dtypes (scale and bias share theirs: the module makes both)
    return dx.astype(x.dtype), jnp.sum(g * xhat, axis=lead).astype(scale.dtype), jnp.sum(g, axis=lead).astype(scale.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class MLP(nn.Module):
    """Pre-norm feed-forward block (one CMS level when named `cms<l>`). Under tensor parallelism
    (`tp` shards over `axis`) each shard holds 1/tp of the hidden width: `up` column-parallel,
    `down` row-parallel. `recompute`: the activation is recomputed in the backward pass
    (`recomputed`; the norm keeps little in any case: `LayerNorm`)."""

    dim: int
    hidden: int
    dtype: jnp.dtype = jnp.float32
    tp: int = 1
    axis: str | None = None
    recompute: bool = False

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        h = LayerNorm(self.dtype, name="norm")(x)
        h = dense(self.hidden // self.tp, self.dtype, dot_general=dense_dot, name="up")(tplib.enter(h, self.axis))
        h = recomputed(nn.gelu, self.recompute)(h)
        # Zero-init the output so every level starts as the identity: a level that has not
        # fired yet does not perturb the residual stream.
        return RowDense(self.dim, self.dtype, self.axis, nn.initializers.zeros, dot_general=dense_dot, name="down")(h)


class CMSChain(nn.Module):
    """k MLP levels applied in sequence, level l named `cms<l>` (its parameters fire every C_l steps)."""

    dim: int
    hidden: int
    levels: int
    dtype: jnp.dtype = jnp.float32
    tp: int = 1
    axis: str | None = None
    recompute: bool = False  # MLP.recompute

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        for l in range(self.levels):
            x = x + MLP(self.dim, self.hidden, self.dtype, self.tp, self.axis, self.recompute, name=f"cms{l}")(x)
        return x


def local_attention(q, k, v, window: int):
    """Causal sliding-window attention: token t attends to tokens t - window + 1 .. t.
    q, k, v [B, T, H, hd] -> [B, T, H, hd].

    `jax.nn.dot_product_attention(..., local_window_size=...)` masks a full [T, T] score matrix
    (its XLA form on CPU and GPU), so its cost and memory grow with T² whatever the window. Here
    the queries are cut into blocks of `window` tokens; a block's keys are its own block and the
    one before, which holds all of its reach: scores [T / window, window, 2 * window], cost and
    memory linear in T. Same masks, same float32 logits and softmax as jax's form; where T <=
    2 * window that form costs no more and is used as is."""
    b, t, h, d = q.shape
    w = window
    if t <= 2 * w:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(w - 1, 0))
    n = -(-t // w)  # blocks; the tail is padded with keys no real query can see (they lie after it)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n * w - t), (0, 0), (0, 0))).reshape(b, n, w, h, d)
    qb, kb, vb = pad(q), pad(k), pad(v)
    before = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # block j-1
    kk = jnp.concatenate([before(kb), kb], axis=2)  # [B, n, 2w, H, hd]
    vv = jnp.concatenate([before(vb), vb], axis=2)
    logits = jnp.einsum("bnqhd,bnkhd->bnhqk", qb, kk, preferred_element_type=jnp.float32) * d**-0.5
    back = (jnp.arange(w)[:, None] + w) - jnp.arange(2 * w)[None, :]  # query position - key position
    seen = (back >= 0) & (back < w)  # [w, 2w]
    first = jnp.arange(2 * w) >= w  # block 0 has no block before it
    seen = seen[None] & jnp.where(jnp.arange(n)[:, None, None] == 0, first[None, None, :], True)  # [n, w, 2w]
    logits = jnp.where(seen[None, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    y = jnp.einsum("bnhqk,bnkhd->bnqhd", probs, vv)
    return y.reshape(b, n * w, h, d)[:, :t]


def token_loss(logits, targets, mask=None, weight=None):
    """Summed next-token cross-entropy and the token count (the summed weights).  logits [B, T, V],
    targets [B, T], mask [B] (1 for real rows, 0 for padding rows of an evaluation batch), weight
    [B, T] (each target's weight; None: 1)."""
    if jnp.ndim(logits) != 3 or tuple(jnp.shape(logits))[:2] != tuple(jnp.shape(targets)):
        # a model's apply passing logits of another shape failed inside take_along_axis, a traceback
        # from the training step's trace ("indices and arr must have the same number of dimensions")
        raise ConfigError(f"token_loss: logits of shape {tuple(jnp.shape(logits))} for targets of shape "
                          f"{tuple(jnp.shape(targets))}: the logits must be [B, T, V], one row of V (the vocabulary) "
                          "per target")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    if mask is None and weight is None:
        return jnp.sum(nll), jnp.asarray(nll.size, jnp.float32)
    w = jnp.ones_like(nll) if weight is None else weight.astype(jnp.float32)
    if mask is not None:
        w = w * mask.astype(jnp.float32)[:, None]
    return jnp.sum(nll * w), jnp.sum(w)



def token_hits(logits, targets, score):
    """Greedy next-token hits at the scored positions, and how many positions were scored.
    logits [B, T, V], targets [B, T], score [B, T] (1 where the prediction counts, else 0).
    Teacher forced: position t is judged on argmax(logits[t]) whatever the model predicted before."""
    w = score.astype(jnp.float32)
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, T]
    return jnp.sum(hit * w), jnp.sum(w)
