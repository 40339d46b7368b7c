"""A gated-delta-rule memory language model, written only against nljax's public model API.

Why this model. The delta rule is the inner loop a nested-learning researcher reaches for next
after Titans' gradient memory: one step of online gradient descent on the associative loss
l_t(S) = 1/2 ||S^T k_t - v_t||^2 with learning rate beta_t (Widrow-Hoff; DeltaNet, Schlag et al.
2021, Yang et al. 2024), and a forgetting gate alpha_t in front of it turns it into Gated DeltaNet
(Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR
2025, arXiv:2412.06464). The Nested Learning paper (Behrouz et al. 2025) reads exactly this
update as an associative memory trained by its own optimizer, the level below the outer
parameters: the memory state S is the inner-loop state nljax keeps per stream row.

The recurrence (the paper's eq. 10, with S stored as [dk, dv] so that a read is q^T S):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = q_t^T S_t

k_t, q_t are L2-normalised per head (||k|| = 1), beta_t = sigmoid(w_b . x_t) in (0, 1), alpha_t =
sigmoid(w_a . x_t + decay_bias) in (0, 1) (the paper uses Mamba2's exp(-softplus(...) exp(A))
parametrisation; a sigmoid is the same range with one bias to set how long the memory holds).
Stable by construction: with ||k|| = 1, I - beta k k^T has eigenvalues 1 - beta and 1, so
||S_t|| <= alpha_t ||S_{t-1}|| + beta_t ||v_t||: the state stays of the order of the values.

Each block is the paper's hybrid: causal sliding-window attention (`nljax.models.blocks.Attention`),
the gated delta memory (here), then a CMS MLP chain (`CMSChain`: level l named `cms<l>`), all
pre-norm and residual. The memory's state S of every block is the model's inner-loop memory:
`init_memory(rows)` returns {"block<i>": {"S": [rows, H, dk, dv]}}, the engine carries it per row
from step to step, resets a row when its stream crosses a document boundary (`batch["reset"]`),
and splits it over the data axes with the rows; under tensor parallelism the heads (and their
state) are split over the model axis.

The recurrence runs token by token (`lax.scan` over T): the plain, exact form. The chunkwise
WY form of the paper is what a GPU kernel would use; it computes the same S_t.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from nljax.errors import ConfigError
from nljax.models.blocks import (Attention, CMSChain, LayerNorm, RowDense, cms_level_of, token_loss, tp_divides,
                                 tp_enter, tp_leave)


@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
    """Config section `model.gated_delta`: the attention window and the delta-rule memory. The
    shared `model.vocab_size`, `dim`, `depth`, `heads`, `hidden_mult` and `dtype` apply too."""

    window: int = 64  # sliding-window attention: tokens each token sees, itself included; 0: no attention
    memory_heads: int = 4  # delta-rule memory heads per block
    memory_dim: int = 32  # per-head key and value width: each head's state is [memory_dim, memory_dim]
    # initial logit of the forgetting gate alpha: sigmoid(4) = 0.982, a memory of ~50 tokens at
    # the start of training (learnt per token afterwards)
    decay_bias: float = 4.0

    def check(self) -> None:
        for key in ("memory_heads", "memory_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.gated_delta.{key} must be >= 1, got {getattr(self, key)}")
        if self.window < 0:
            raise ConfigError(f"model.gated_delta.window must be >= 0, got {self.window}")


def _unit(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def delta_rule(state, q, k, v, alpha, beta):
    """The gated delta rule over T tokens, token by token.  state [B, H, dk, dv]; q, k [B, T, H, dk]
    (unit norm); v [B, T, H, dv]; alpha, beta [B, T, H] -> (o [B, T, H, dv], final state)."""

    def step(s, inp):  # s [B, H, dk, dv]
        qt, kt, vt, at, bt = inp  # [B, H, dk], [B, H, dk], [B, H, dv], [B, H], [B, H]
        ks = jnp.einsum("bhk,bhkv->bhv", kt, s)  # k^T S: what the memory says for k now
        s = at[..., None, None] * (s - bt[..., None, None] * kt[..., :, None] * ks[..., None, :])
        s = s + bt[..., None, None] * kt[..., :, None] * vt[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", qt, s)

    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), (q, k, v, alpha, beta))  # time first
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


class GatedDeltaMemory(nn.Module):
    """x [B, T, D], state {"S": [B, H/tp, dk, dv]}, reset [B] -> (y [B, T, D], new state). Under
    tensor parallelism each shard holds heads / tp heads: q, k, v, gates, norm and output gate
    are split by head (column-parallel), the output projection row-parallel."""

    dim: int
    heads: int
    dk: int
    decay_bias: float = 4.0
    dtype: jnp.dtype = jnp.float32
    tp: int = 1
    axis: str | None = None

    @nn.compact
    def __call__(self, x, state, reset):
        b, t, _ = x.shape
        h, d = self.heads // self.tp, self.dk
        x = tp_enter(x, self.axis)  # a split region: every head's projections, gates and state are its own
        qkv = nn.DenseGeneral((3, h, d), use_bias=False, dtype=self.dtype, name="qkv")(x)  # [B, T, 3, h, d]
        qkv = jax.nn.silu(qkv.astype(jnp.float32))
        q, k, v = _unit(qkv[:, :, 0]), _unit(qkv[:, :, 1]), qkv[:, :, 2]
        # flax asks for the flattened [h * 2] bias: (beta, alpha) per head
        bias = lambda key, shape, dtype=jnp.float32: jnp.tile(jnp.array([0.0, self.decay_bias]), shape[0] // 2)
        gates = nn.DenseGeneral((h, 2), bias_init=bias, name="gates")(x.astype(jnp.float32))  # [B, T, h, 2]
        beta, alpha = jax.nn.sigmoid(gates[..., 0]), jax.nn.sigmoid(gates[..., 1])
        s = jnp.where(reset[:, None, None, None], 0.0, state["S"])  # a row that starts a document forgets
        o, s = delta_rule(s, q, k, v, alpha, beta)  # o [B, T, h, d]
        # a row whose state became non-finite (from non-finite inputs) restarts empty
        bad = ~jnp.all(jnp.isfinite(s), axis=(1, 2, 3))
        if self.axis is not None:
            bad = jax.lax.psum(bad.astype(jnp.int32), self.axis) > 0
        s = jnp.where(bad[:, None, None, None], 0.0, s)
        scale = self.param("norm_scale", nn.initializers.ones, (h, d))
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-6) * scale  # per-head RMS norm
        o = o * jax.nn.silu(nn.DenseGeneral((h, d), dtype=self.dtype, name="gate")(x)).astype(jnp.float32)
        out = RowDense(self.dim, self.dtype, self.axis, nn.initializers.zeros, name="out")
        return out(o.astype(self.dtype).reshape(b, t, h * d)), {"S": s}


class GatedDeltaNet(nn.Module):
    vocab: int
    dim: int
    hidden: int
    depth: int
    levels: int
    heads: int
    window: int
    memory_heads: int
    memory_dim: int
    decay_bias: float
    dtype: jnp.dtype = jnp.float32
    tp: int = 1
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, tokens, memory, reset):  # tokens [B, T], memory {block<i>: {"S": ...}}, reset [B]
        dt = self.dtype
        x = nn.Embed(self.vocab, self.dim, dtype=dt, name="embed")(tokens)  # [B, T, D]
        new = {}
        for i in range(self.depth):
            if self.window:
                attn = Attention(self.dim, self.heads, self.window, dt, self.tp, self.tp_axis, name=f"attn{i}")
                x = x + attn(LayerNorm(dt, name=f"norm_a{i}")(x))
            mem = GatedDeltaMemory(self.dim, self.memory_heads, self.memory_dim, self.decay_bias, dt, self.tp,
                                   self.tp_axis, name=f"mem{i}")
            y, new[f"block{i}"] = mem(LayerNorm(dt, name=f"norm_m{i}")(x), memory[f"block{i}"], reset)
            x = x + y
            x = CMSChain(self.dim, self.hidden, self.levels, dt, self.tp, self.tp_axis, name=f"block{i}")(x)
        x = LayerNorm(dt, name="norm")(x)
        return nn.Dense(self.vocab, dtype=dt, name="head")(x), new


@dataclasses.dataclass(frozen=True)
class GatedDeltaLM:
    """The engine's view of `GatedDeltaNet` (`nljax.Model`)."""

    net: GatedDeltaNet

    def init(self, key):
        tokens = jnp.zeros((1, 4), jnp.int32)
        return self.net.init(key, tokens, self.init_memory(1), jnp.ones((1,), bool))["params"]

    def level_of(self, path: str) -> int:
        # the CMS chains' `cms<l>` MLPs are the slow levels; attention, the memory's projections
        # and gates, embedding and head are level 0 (they must see every step: the memory is
        # written with them at every token)
        return cms_level_of(path)

    def init_memory(self, rows: int):
        # one state per block and row, [rows, heads / tp, dk, dv]: zeros, the empty memory (the
        # first step resets every row anyway)
        n = self.net
        shape = (rows, n.memory_heads // n.tp, n.memory_dim, n.memory_dim)
        return {f"block{i}": {"S": jnp.zeros(shape, jnp.float32)} for i in range(n.depth)}

    def tensor_parallel(self, m: int, axis: str | None) -> "GatedDeltaLM":
        """The shard over `m` devices: attention heads, memory heads (and their state) and every
        CMS MLP's hidden width split; embedding, norms and head replicated."""
        n = self.net
        widths = [("model.gated_delta.memory_heads", n.memory_heads), ("the MLP hidden width", n.hidden)]
        tp_divides(m, widths + ([("model.heads", n.heads)] if n.window else []))
        return GatedDeltaLM(dataclasses.replace(n, tp=m, tp_axis=axis))

    def logits(self, params, memory, batch, key=None):
        """Next-token logits [B, T, V] of batch["tokens"] [B, T+1], and the memory after them."""
        return self.net.apply({"params": params}, batch["tokens"][:, :-1], memory, batch["reset"])

    def apply(self, params, memory, batch, key=None):  # deterministic: key unused
        logits, memory = self.logits(params, memory, batch, key)
        loss_sum, count = token_loss(logits, batch["tokens"][:, 1:], batch.get("mask"), batch.get("weight"))
        return loss_sum, count, memory


def build(cfg) -> GatedDeltaLM:
    """The model of an nljax config (`model.name=gated_delta`)."""
    m, g = cfg.model, cfg.model.gated_delta
    return GatedDeltaLM(GatedDeltaNet(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods),
                                      m.heads, g.window, g.memory_heads, g.memory_dim, g.decay_bias,
                                      jnp.dtype(m.dtype)))


def check(cfg) -> None:
    """Rules that tie the section to the shared model keys (run when model.name=gated_delta)."""
    m, g = cfg.model, cfg.model.gated_delta
    if g.window and (m.dim % m.heads or (m.dim // m.heads) % 2):
        raise ConfigError(f"model.dim={m.dim} must split into model.heads={m.heads} heads of even width "
                          "(rotary positions), or set model.gated_delta.window=0")
