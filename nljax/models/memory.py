"""Titans-style neural memory: the inner loop, written by gradient descent during the forward pass.

Per stream row and head, an associative memory M (`linear`: k @ W; `mlp`: gelu(k @ W1) @ W2) is
trained online on l(M; k, v) = ||M(k) - v||^2 with data-dependent step size theta, momentum eta
and forget gate alpha:

    S_t = eta_t S_{t-1} - theta_t grad l(M; k_t, v_t)
    M_t = (1 - alpha_t) M_{t-1} + S_t

Chunk-parallel form (mini-batches of b tokens): inside a chunk every gradient is taken at the
chunk-start memory Mhat, and every token reads Mhat (y_t = Mhat(q_t)), which keeps the layer
strictly causal. Because all gradients in a chunk share Mhat, the chunk's end state is *linear*
in them:

    S_end = (prod eta) S_0 - sum_j wS_j grad l_j(Mhat)
    M_end = (prod (1-alpha)) M_0 + s S_0 - sum_j wM_j grad l_j(Mhat)

with scalar per-token weights from cumulative sums of log-gates. A weighted sum of per-token
gradients is the gradient of the weighted sum of per-token losses, i.e. one vector-Jacobian
product of the chunk's loss vector: no per-token copy of the memory weights is ever made. Chunks
advance with `lax.scan`. `memory_reference` is the plain token-by-token version used by tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PyTree = dict


def init_state(memory0: PyTree, batch: int) -> PyTree:
    """State for `batch` fresh rows: M = memory0 (leaves [H, ...]) broadcast, S = 0."""
    m = jax.tree.map(lambda w: jnp.broadcast_to(w, (batch, *w.shape)).astype(jnp.float32), memory0)
    return {"M": m, "S": jax.tree.map(jnp.zeros_like, m)}


def reset_rows(state: PyTree, memory0: PyTree, reset: jax.Array) -> PyTree:
    """Rows with reset[b] start from memory0 with zero momentum; the others are unchanged."""
    def pick(fresh, old):
        r = reset.reshape((-1,) + (1,) * (old.ndim - 1))
        return jnp.where(r, fresh.astype(old.dtype), old)

    fresh = init_state(memory0, reset.shape[0])
    return jax.tree.map(pick, fresh, state)


def read(M: PyTree, q: jax.Array, kind: str) -> jax.Array:
    """M leaves [B, H, ...], q [B, H, n, dk] -> [B, H, n, dv]."""
    if kind == "linear":
        return jnp.einsum("bhnd,bhde->bhne", q, M["W"])
    h = jax.nn.gelu(jnp.einsum("bhnd,bhdf->bhnf", q, M["W1"]))  # [B, H, n, hidden]
    return jnp.einsum("bhnf,bhfe->bhne", h, M["W2"])


def token_losses(M: PyTree, k: jax.Array, v: jax.Array, kind: str) -> jax.Array:
    """l(M; k_t, v_t) for every token.  [B, H, n]"""
    return jnp.sum(jnp.square(read(M, k, kind) - v), axis=-1)


def _scale(tree: PyTree, c: jax.Array) -> PyTree:
    """Multiply leaves [B, H, ...] by per-(row, head) scalars c [B, H]."""
    return jax.tree.map(lambda x: x * c.reshape(c.shape + (1,) * (x.ndim - 2)), tree)


def chunk_step(state: PyTree, q, k, v, theta, eta, alpha, kind: str):
    """One chunk.  q, k [B, H, b, dk], v [B, H, b, dv], gates [B, H, b]."""
    M, S = state["M"], state["S"]
    y = read(M, q, kind)  # [B, H, b, dv]: every token reads the chunk-start memory
    _, pull = jax.vjp(lambda m: token_losses(m, k, v, kind), M)

    # log-space cumulative products; tiny floors keep log finite for gates at 0 or 1
    le = jnp.cumsum(jnp.log(jnp.maximum(eta, 1e-30)), axis=-1)  # [B, H, b]
    la = jnp.cumsum(jnp.log(jnp.maximum(1.0 - alpha, 1e-30)), axis=-1)  # [B, H, b]
    b = le.shape[-1]
    later = jnp.arange(b)[None, :] >= jnp.arange(b)[:, None]  # [j, t]: t >= j
    diff = le[..., None, :] - le[..., :, None]  # [B, H, j, t] = le_t - le_j
    decay_s = jnp.where(later, jnp.exp(jnp.where(later, diff, 0.0)), 0.0)  # prod eta over (j, t]
    keep_m = jnp.exp(la[..., -1:] - la)  # [B, H, t]: prod (1 - alpha) over (t, b]

    w_s = theta * jnp.exp(le[..., -1:] - le)  # [B, H, j]
    w_m = theta * jnp.einsum("bhjt,bht->bhj", decay_s, keep_m)
    (g_s,) = pull(w_s)
    (g_m,) = pull(w_m)
    s_carry = jnp.sum(keep_m * jnp.exp(le), axis=-1)  # [B, H]

    new_s = jax.tree.map(jnp.subtract, _scale(S, jnp.exp(le[..., -1])), g_s)
    new_m = jax.tree.map(
        lambda m, s, g: m + s - g, _scale(M, jnp.exp(la[..., -1])), _scale(S, s_carry), g_m
    )
    return {"M": new_m, "S": new_s}, y


def memory_forward(state: PyTree, q, k, v, theta, eta, alpha, *, kind: str, chunk: int):
    """Chunk-parallel inner loop over T tokens: (y [B, H, T, dv], final state)."""
    t = q.shape[2]
    if t % chunk:
        raise ValueError(f"sequence length {t} is not a multiple of the memory chunk {chunk}")
    n = t // chunk

    def chunks(x):  # [B, H, T, ...] -> [n, B, H, b, ...]
        x = x.reshape(x.shape[:2] + (n, chunk) + x.shape[3:])
        return jnp.moveaxis(x, 2, 0)

    xs = tuple(chunks(x) for x in (q, k, v, theta, eta, alpha))
    state = jax.tree.map(lambda x: x.astype(jnp.float32), state)

    def body(carry, inp):
        return chunk_step(carry, *inp, kind)

    state, ys = jax.lax.scan(body, state, xs)  # ys [n, B, H, b, dv]
    y = jnp.moveaxis(ys, 0, 2).reshape(q.shape[:3] + ys.shape[-1:])
    return y, state


def memory_reference(state: PyTree, q, k, v, theta, eta, alpha, *, kind: str, chunk: int):
    """Token-by-token definition (tests only): gradients at the chunk-start memory."""
    M, S = state["M"], state["S"]
    loss = lambda m, kt, vt: jnp.sum(token_losses(m, kt[:, :, None], vt[:, :, None], kind))
    ys = []
    for t in range(q.shape[2]):
        if t % chunk == 0:
            m_hat = M
        ys.append(read(m_hat, q[:, :, t : t + 1], kind))
        g = jax.grad(loss)(m_hat, k[:, :, t], v[:, :, t])  # rows and heads are independent
        S = jax.tree.map(lambda s, gi: s * eta[:, :, t, None, None] - theta[:, :, t, None, None] * gi, S, g)
        M = jax.tree.map(lambda m, s: m * (1 - alpha[:, :, t, None, None]) + s, M, S)
    return jnp.concatenate(ys, axis=2), {"M": M, "S": S}
