"""Titans-style neural memory: the inner loop, written by gradient descent during the forward pass.

Per stream row and head, an associative memory M (`linear`: k W; `mlp`: gelu(k W1) W2) is
trained online on l_t(M) = ½ ||M(k_t) - v_t||² with data-dependent gates: step theta_t in (0, 1],
momentum eta_t in [0, 1), forgetting alpha_t in [0, 1]. Tokens come in chunks of b; every
gradient of a chunk is taken at the chunk-start memory Mhat (the Titans paper §3.2, TTT's dual
form):

    S_t = eta_t S_{t-1} - a_t grad l_t(Mhat),     a_t = theta_t (1 - eta_t) / (lambda nu_t)
    M_t = (1 - alpha_t) M_{t-1} + S_t
    y_t = M_t(q_t)                                 token t reads the memory after tokens <= t

lambda (below) bounds the curvature of the tokens it scales. The chunk's last memory, carried to
the next chunk, uses lambda over the whole chunk; the read of token t uses lambda_t over the
chunk's tokens <= t: it reads what those tokens would write as a chunk of their own, so nothing
after t reaches it (causal: generation's padding after the current token changes nothing).

Why the update is bounded whatever the chunk size, width, depth or sequence length:

- q, k (and v) are L2-normalised per head, so ||k_t|| = 1.
- nu_t bounds the token's curvature: the Jacobian J_t of M(k_t) with respect to the memory's
  weights has ||J_t||² <= nu_t (linear: nu = ||k||²; mlp: nu = ||h||² + c²||k||²||W2||_F², c =
  max gelu' ≈ 1.13, by the triangle and Cauchy–Schwarz inequalities). Dividing by nu_t is the
  normalised-LMS step: one token alone moves at most all the way to its target.
- lambda >= || sum_t J_t^T J_t / nu_t ||, the normalised Gauss–Newton curvature of its tokens, is
  Gershgorin's bound max_i sum_j ||J_i J_j^T|| / sqrt(nu_i nu_j) (linear: |k_i . k_j|; mlp:
  |h_i . h_j| + c² |k_i . k_j| ||W2||_F²), at least 1. So the chunk's preconditioned curvature
  has eigenvalues in [0, 1] for any b: lambda = b when all keys coincide (the chunk mean), 1
  when they are orthogonal (each token written in full, as with b = 1).
- the momentum is normalised (the (1 - eta) factor): a gradient's total weight over all later
  steps is theta/(lambda nu) <= 1/(lambda nu) whatever eta is, and heavy-ball with step (1 - eta) theta
  lambda <= 1 - eta < 2 (1 + eta) is stable for every eta in [0, 1) (the classic condition for
  momentum on a quadratic of curvature lambda).
- forgetting only shrinks M.

So a chunk never steps past the minimiser of its own quadratic model, and M stays of the order
of the values (unit norm) instead of growing with b, width or 1/(1 - eta).

Chunk-parallel (dual) form: because every gradient of a chunk is taken at Mhat, each token's
gradient is an outer product x_j^T d_j per layer (the layer's input and its output gradient), and
M_t is a linear combination of them with scalar weights A[t, j] built from cumulative log-gates.
A read q_t M_t therefore needs only masked [b, b] products ((q x^T) ⊙ A) d, never a per-token copy
of the memory: cost O(b² d + b d²) per chunk (plus O(b³) for the scalar weights). Chunks advance
with `lax.scan` (`memory_forward`); `memory_parallel` carries only the end states through the
loop (`end_state`, pulled back by hand: `end_pullback`) and computes every chunk's reads after
it, at once (at large batch in groups of chunks: `READ_GROUP_BYTES`). `memory_reference` is the
plain token-by-token version used by tests.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

PyTree = dict

GELU_SLOPE = 1.129  # max over x of d/dx gelu(x) (tanh approximation), at x ≈ 1.5
NU_FLOOR = 1e-3  # keeps the normaliser positive when the memory and its features are all zero


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


def layers(kind: str) -> tuple[str, ...]:
    """The memory's weight matrices, input side first."""
    return ("W",) if kind == "linear" else ("W1", "W2")


class Features:
    """What the curvature bounds and the gradients of a chunk read from the memory at the chunk
    start: the keys' squared norms and Gram matrix (memory-independent: `chunk_constants` computes
    them for every chunk before the loop) and, for the MLP memory, its hidden features h = gelu(k
    W1) with gelu's vjp and ||W2||_F², computed once per chunk."""

    def __init__(self, M: PyTree, k: jax.Array, kind: str, kk=None, k_gram=None):
        self.kind, self.k = kind, k
        self.kk = jnp.sum(k * k, axis=-1) if kk is None else kk  # [B, H, b]
        self.k_gram = k_gram  # [B, H, b, b], computed by `inner` when not given
        if kind == "mlp":
            self.z = jnp.einsum("bhnd,bhdf->bhnf", k, M["W1"])  # [B, H, b, hidden]
            self.h, self.gelu_vjp = jax.vjp(jax.nn.gelu, self.z)
            self.w2 = jnp.sum(jnp.square(M["W2"]), axis=(-2, -1))  # [B, H]

    def normaliser(self) -> jax.Array:
        if self.kind == "linear":
            return self.kk + NU_FLOOR
        return jnp.sum(self.h * self.h, axis=-1) + GELU_SLOPE**2 * self.kk * self.w2[..., None] + NU_FLOOR

    def inner(self) -> jax.Array:
        """[B, H, i, j]: the bound on ||J_i J_j^T|| (module docstring) before the normalisers."""
        inner = self.k_gram if self.k_gram is not None else jnp.abs(jnp.einsum("bhid,bhjd->bhij", self.k, self.k))
        if self.kind == "mlp":
            inner = (jnp.abs(jnp.einsum("bhif,bhjf->bhij", self.h, self.h))
                     + GELU_SLOPE**2 * inner * self.w2[..., None, None])
        return inner

    def _curvature(self, nu: jax.Array) -> jax.Array:
        """[B, H, i, j]: ||J_i J_j^T|| / sqrt(nu_i nu_j), bounded as in the module docstring."""
        rs = jax.lax.rsqrt(nu)
        return self.inner() * rs[..., :, None] * rs[..., None, :]

    def chunk_scale(self, nu: jax.Array) -> jax.Array:
        rows = jnp.cumsum(self._curvature(nu), axis=-1)  # [B, H, i, t]: row i over j <= t
        b = rows.shape[-1]
        mine = jnp.arange(b)[:, None] <= jnp.arange(b)[None, :]  # row i is one of the tokens <= t
        return jnp.maximum(jnp.max(jnp.where(mine, rows, 0.0), axis=-2), 1.0)  # [B, H, t]

    def pieces(self, M: PyTree, v: jax.Array):
        """Per layer, each token's gradient of l_t at M as (input x [B,H,b,n_in], output grad d
        [B,H,b,n_out]): grad_W l_t = x_t^T d_t."""
        if self.kind == "linear":
            return [(self.k, read(M, self.k, self.kind) - v)]
        e = jnp.einsum("bhnf,bhfe->bhne", self.h, M["W2"]) - v  # [B, H, b, dv]
        (d1,) = self.gelu_vjp(jnp.einsum("bhne,bhfe->bhnf", e, M["W2"]))
        return [(self.k, d1), (self.h, e)]


def normaliser(M: PyTree, k: jax.Array, kind: str) -> jax.Array:
    """nu_t >= ||J_t||²: a bound on the curvature of l_t at M (see the module docstring).  [B, H, n]"""
    return Features(M, k, kind).normaliser()


def chunk_scale(M: PyTree, k: jax.Array, nu: jax.Array, kind: str) -> jax.Array:
    """lambda_t >= ||sum_{j <= t} J_j^T J_j / nu_j||, Gershgorin's bound on the normalised
    curvature of the chunk's tokens up to t (module docstring), at least 1; the last is the whole
    chunk's.  k [B, H, b, dk], nu [B, H, b] -> [B, H, b]"""
    return Features(M, k, kind).chunk_scale(nu)


def chunk_constants(k, eta, alpha) -> dict:
    """What a chunk's step needs that does not depend on the memory, for all chunks at once (one
    batched computation before the loop instead of one per chunk inside it).  k [..., b, dk],
    eta, alpha [..., b] (leading axes: rows, heads, chunks) ->
      keep_mom [..., t, j]: the weight of -grad l_j in M_t, divided by a_j (the step, which depends
                            on the memory); s [..., t]: of S_0 in M_t; c [..., t]: of M_0 in M_t;
      mom_last [..., j]: of -grad l_j in S_b, divided by a_j; s_decay [...]: of S_0 in S_b;
      kk [..., b] and k_gram [..., b, b]: the keys' squared norms and |k_i . k_j| (`Features`)."""
    # log-space cumulative products; tiny floors keep log finite for gates at 0 or 1
    le = jnp.cumsum(jnp.log(jnp.maximum(eta, 1e-30)), axis=-1)
    la = jnp.cumsum(jnp.log(jnp.maximum(1.0 - alpha, 1e-30)), axis=-1)
    b = le.shape[-1]
    lower = jnp.arange(b)[:, None] >= jnp.arange(b)[None, :]  # [i, j]: i >= j

    def decay(lc):  # [..., i, j] = exp(lc_i - lc_j) for i >= j, else 0
        return jnp.where(lower, jnp.exp(jnp.where(lower, lc[..., :, None] - lc[..., None, :], 0.0)), 0.0)

    mom, keep = decay(le), decay(la)  # momentum carried j -> i; memory kept i -> t
    return {
        "keep_mom": jnp.einsum("...ti,...ij->...tj", keep, mom),
        "s": jnp.einsum("...ti,...i->...t", keep, jnp.exp(le)),
        "c": jnp.exp(la),
        "mom_last": mom[..., -1, :],
        "s_decay": jnp.exp(le[..., -1]),
        "kk": jnp.sum(k * k, axis=-1),
        "k_gram": jnp.abs(jnp.einsum("...id,...jd->...ij", k, k)),
    }


def _bcast(c: jax.Array, x: jax.Array) -> jax.Array:
    """Per-(row, head[, token]) scalars c broadcast against x."""
    return c.reshape(c.shape + (1,) * (x.ndim - c.ndim))


def _end_state(M: PyTree, S: PyTree, pieces, a_end, w, c, s, s_decay, kind: str, stacked: bool) -> PyTree:
    """The chunk's end state (what the next chunk starts from) from its chunk-start state, its
    tokens' gradient pieces (`Features.pieces`) and their weights in M's update (a_end [B, H, j],
    A[b - 1, j]) and S's (w), with the chunk's scalars c, s, s_decay [B, H] (the weights of M_0 and
    S_0 in M, of S_0 in S). `stacked`: each layer's two updates as one matrix product with the
    weights stacked. The scan keeps two, its operations (and forward values) as they were before
    the parallel form existed."""
    new_m, new_s = {}, {}
    for name, (x, d) in zip(layers(kind), pieces):
        if stacked:
            coef = jnp.stack([a_end, w], axis=-2)[..., None]  # [B, H, 2, j, 1]
            dm, ds = jnp.moveaxis(jnp.einsum("bhcji,bhjo->bhcio", coef * x[:, :, None], d), 2, 0)
        else:
            dm = jnp.einsum("bhji,bhjo->bhio", x * a_end[..., None], d)
            ds = jnp.einsum("bhji,bhjo->bhio", x * w[..., None], d)
        new_m[name] = _bcast(c, M[name]) * M[name] + _bcast(s, S[name]) * S[name] - dm
        new_s[name] = _bcast(s_decay, S[name]) * S[name] - ds
    return {"M": new_m, "S": new_s}


def end_inputs(theta, eta, const: dict) -> dict:
    """What a chunk's end state takes besides k and v that does not depend on the memory, from its
    gates and `chunk_constants` (any leading axes): the steps before the normaliser theta (1 - eta)
    [..., j], the last rows of the weights (`keep_last`: of -grad l_j in M_b over a_j, `mom_last`:
    in S_b) [..., j], the chunk's scalars `c_end`, `s_end`, `s_decay` [...], the keys' `kk` [..., j]
    and `k_gram` [..., j, j]."""
    return dict(step=theta * (1.0 - eta), keep_last=const["keep_mom"][..., -1, :], mom_last=const["mom_last"],
                c_end=const["c"][..., -1], s_end=const["s"][..., -1], s_decay=const["s_decay"],
                kk=const["kk"], k_gram=const["k_gram"])


class EndTerms:
    """A chunk's end-state terms at its chunk-start memory, shared by `end_state` and
    `end_pullback`: the features, the gradient pieces, nu, the curvature rows over j and their
    bound lambda (Gershgorin's over the whole chunk, at least 1), the steps a and the update
    weights alpha (M's) and omega (S's)."""

    def __init__(self, M: PyTree, k, v, ends: dict, kind: str):
        self.f = f = Features(M, k, kind, ends["kk"], ends["k_gram"])
        self.pieces = f.pieces(M, v)
        self.nu = f.normaliser()  # [B, H, j]
        self.r = jax.lax.rsqrt(self.nu)
        self.inner = f.inner()  # [B, H, i, j]
        self.rows = jnp.sum(self.inner * self.r[..., :, None] * self.r[..., None, :], axis=-1)  # [B, H, i]
        self.lam_raw = jnp.max(self.rows, axis=-1)
        self.lam = jnp.maximum(self.lam_raw, 1.0)[..., None]
        self.a = ends["step"] / self.nu
        self.alpha = ends["keep_last"] * self.a / self.lam
        self.omega = ends["mom_last"] * self.a / self.lam


def end_state(state: PyTree, k, v, ends: dict, kind: str) -> PyTree:
    """One chunk's end state from its start state, k, v and `end_inputs`: the step of
    `memory_parallel`'s sequential loop."""
    t = EndTerms(state["M"], k, v, ends, kind)
    return _end_state(state["M"], state["S"], t.pieces, t.alpha, t.omega, ends["c_end"], ends["s_end"],
                      ends["s_decay"], kind, stacked=True)


def chunk_end(state: PyTree, k, v, theta, eta, const: dict, kind: str) -> PyTree:
    """One chunk's end state alone: `chunk_step` without its reads (no queries, no running
    curvature bounds, no [b, b] read weights), from its gates and `chunk_constants`. The tests'
    reference for one chunk; `memory_parallel`'s loop runs `end_state` with `end_inputs` computed
    for all chunks before it."""
    return end_state(state, k, v, end_inputs(theta, eta, const), kind)


def _gelu_slopes(z):
    """gelu's first and second derivatives at z, elementwise."""
    ones = jnp.ones_like(z)
    slope = lambda u: jax.jvp(jax.nn.gelu, (u,), (ones,))[1]
    return jax.jvp(slope, (z,), (ones,))


def end_pullback(state: PyTree, k, v, ends: dict, kind: str, d_end: PyTree):
    """`end_state`'s pull-back written out (what `jax.vjp` of it computes, within float32
    rounding; tests/test_memory_parallel.py): d_end, the end state's cotangent ->
    (d_state, d_k, d_v, d_ends). The chunk's terms are recomputed from its start state. Why by
    hand: it is the body of the parallel form's backward loop, which a GPU runs chunk after chunk
    as a few dozen small kernels; written out, it runs fewer (41 against 54 per chunk at
    titans_demo's shapes, compiled for an H200, 38 with the loop's outputs packed:
    docs/benchmarks/2026-11-30-parallel-form-and-loop-kernel.md). jnp.max and
    jnp.maximum's ties split the cotangent evenly and jnp.abs's slope at 0 is +1, as JAX's are."""
    M, S, dM_end, dS_end = state["M"], state["S"], d_end["M"], d_end["S"]
    t = EndTerms(M, k, v, ends, kind)
    tot = lambda x: jnp.sum(x, axis=(-2, -1))
    d_m = {n: _bcast(ends["c_end"], x) * x for n, x in dM_end.items()}
    d_s = {n: _bcast(ends["s_end"], x) * x + _bcast(ends["s_decay"], dS_end[n]) * dS_end[n] for n, x in dM_end.items()}
    d_ends = dict(c_end=sum(tot(dM_end[n] * M[n]) for n in M), s_end=sum(tot(dM_end[n] * S[n]) for n in M),
                  s_decay=sum(tot(dS_end[n] * S[n]) for n in M))
    # each layer's updates -(x^T (alpha d)) and -(x^T (omega d)), pulled back to x, d, alpha, omega
    d_alpha = d_omega = 0.0
    d_x, d_d = [], []
    for name, (x, d) in zip(layers(kind), t.pieces):
        xa, xb = (jnp.einsum("bhji,bhio->bhjo", x, g[name]) for g in (dM_end, dS_end))
        d_d.append(-(t.alpha[..., None] * xa + t.omega[..., None] * xb))
        d_x.append(-(jnp.einsum("bhjo,bhio->bhji", t.alpha[..., None] * d, dM_end[name])
                     + jnp.einsum("bhjo,bhio->bhji", t.omega[..., None] * d, dS_end[name])))
        d_alpha = d_alpha - jnp.sum(xa * d, axis=-1)
        d_omega = d_omega - jnp.sum(xb * d, axis=-1)
    # alpha = keep a / lambda, omega = mom a / lambda, a = step / nu
    d_a = (ends["keep_last"] * d_alpha + ends["mom_last"] * d_omega) / t.lam
    d_ends.update(keep_last=t.a * d_alpha / t.lam, mom_last=t.a * d_omega / t.lam, step=d_a / t.nu)
    d_lam = -jnp.sum(t.alpha * d_alpha + t.omega * d_omega, axis=-1) / t.lam[..., 0]
    d_lam_raw = d_lam * jnp.where(t.lam_raw > 1.0, 1.0, jnp.where(t.lam_raw == 1.0, 0.5, 0.0))
    top = (t.rows == t.lam_raw[..., None]).astype(t.rows.dtype)
    d_rows = d_lam_raw[..., None] * top / jnp.sum(top, axis=-1, keepdims=True)  # [B, H, i]
    # rows_i = r_i sum_j inner_ij r_j, inner symmetric
    d_inner = (d_rows * t.r)[..., :, None] * t.r[..., None, :]
    d_r = (d_rows * jnp.sum(t.inner * t.r[..., None, :], axis=-1)
           + jnp.sum(t.inner * (d_rows * t.r)[..., None, :], axis=-1))
    d_nu = -0.5 * d_r * t.r**3 - d_a * t.a / t.nu
    if kind == "linear":  # nu = kk + floor, inner = k_gram, e = k W - v
        d_ends.update(kk=d_nu, k_gram=d_inner)
        (d_e,) = d_d
        d_m["W"] = d_m["W"] + jnp.einsum("bhjd,bhje->bhde", k, d_e)
        d_k = d_x[0] + jnp.einsum("bhje,bhde->bhjd", d_e, M["W"])
        return {"M": d_m, "S": d_s}, d_k, -d_e, d_ends
    # mlp: nu = |h|^2 + c^2 kk w2 + floor, inner = |h h^T| + c^2 k_gram w2, e = h W2 - v,
    # the first layer's d = gelu'(z) (e W2^T), h = gelu(z), z = k W1
    f, (_, e) = t.f, t.pieces[1]
    h, w2, W1, W2 = f.h, f.w2, M["W1"], M["W2"]
    c2 = GELU_SLOPE**2
    d_ends.update(kk=c2 * w2[..., None] * d_nu, k_gram=c2 * w2[..., None, None] * d_inner)
    d_w2 = c2 * (tot(d_inner * ends["k_gram"]) + jnp.sum(ends["kk"] * d_nu, axis=-1))
    slope, curve = _gelu_slopes(f.z)
    g = jnp.einsum("bhje,bhfe->bhjf", e, W2)  # the errors pulled back to h
    d_g = d_d[0] * slope
    d_e = d_d[1] + jnp.einsum("bhjf,bhfe->bhje", d_g, W2)
    # |hh|'s slope: -1 or +1, +1 at 0 as JAX's abs has it (a zero key's row of hh is 0), not sign's 0
    d_hh = jnp.where(jnp.einsum("bhif,bhjf->bhij", h, h) >= 0.0, d_inner, -d_inner)
    d_h = (jnp.einsum("bhij,bhjf->bhif", d_hh + jnp.swapaxes(d_hh, -1, -2), h) + 2.0 * d_nu[..., None] * h
           + d_x[1] + jnp.einsum("bhje,bhfe->bhjf", d_e, W2))
    d_z = d_d[0] * g * curve + d_h * slope
    d_m["W2"] = (d_m["W2"] + jnp.einsum("bhjf,bhje->bhfe", d_g, e) + jnp.einsum("bhjf,bhje->bhfe", h, d_e)
                 + 2.0 * _bcast(d_w2, W2) * W2)
    d_m["W1"] = d_m["W1"] + jnp.einsum("bhjd,bhjf->bhdf", k, d_z)
    d_k = d_x[0] + jnp.einsum("bhjf,bhdf->bhjd", d_z, W1)
    return {"M": d_m, "S": d_s}, d_k, -d_e, d_ends


def _reads(M: PyTree, S: PyTree, pieces, q, a, lam, const: dict, kind: str):
    """A chunk's reads [B, H, b, dv] from its chunk-start state: token t reads the memory its
    chunk's tokens <= t write, with lambda over them (`lam` [B, H, t], `Features.chunk_scale`)."""
    A = const["keep_mom"] * a[..., None, :] / lam[..., :, None]  # [B, H, t, j]: read t's weights
    s, c = const["s"], const["c"]
    r = q  # the query's input to the current layer  [B, H, b, n_in]
    for i, (name, (x, d)) in enumerate(zip(layers(kind), pieces)):
        if i:
            r = jax.nn.gelu(r)
        # r W_t = c_t r W + s_t r S - sum_j A[t, j] (r_t . x_j) d_j
        scores = jnp.einsum("bhti,bhji->bhtj", r, x) * A  # [B, H, t, j]
        r = (_bcast(c, r) * jnp.einsum("bhti,bhio->bhto", r, M[name])
             + _bcast(s, r) * jnp.einsum("bhti,bhio->bhto", r, S[name])
             - jnp.einsum("bhtj,bhjo->bhto", scores, d))
    return r


def _chunk_terms(state: PyTree, k, v, theta, eta, const: dict, kind: str):
    """What a chunk's end state and its reads share, at its chunk-start memory: the features, each
    token's gradient pieces, nu and the steps a before lambda."""
    M = state["M"]
    f = Features(M, k, kind, const["kk"], const["k_gram"])
    nu = f.normaliser()  # [B, H, b]
    return f, f.pieces(M, v), nu, theta * (1.0 - eta) / nu


def chunk_reads(state: PyTree, q, k, v, theta, eta, const: dict, kind: str):
    """One chunk's reads alone (`chunk_step` without its end state).  [B, H, b, dv]"""
    f, pieces, nu, a = _chunk_terms(state, k, v, theta, eta, const, kind)
    return _reads(state["M"], state["S"], pieces, q, a, f.chunk_scale(nu), const, kind)


def chunk_step(state: PyTree, q, k, v, theta, eta, const: dict, kind: str):
    """One chunk: (end state, reads [B, H, b, dv]).  q, k [B, H, b, dk], v [B, H, b, dv], gates
    [B, H, b], `const`: this chunk's `chunk_constants`."""
    M, S = state["M"], state["S"]
    f, pieces, nu, a = _chunk_terms(state, k, v, theta, eta, const, kind)
    lam = f.chunk_scale(nu)  # [B, H, t]: over the tokens <= t; the last over the whole chunk
    r = _reads(M, S, pieces, q, a, lam, const, kind)
    a_end = const["keep_mom"][..., -1, :] * a / lam[..., -1:]  # A[b - 1, j]
    w = a * const["mom_last"] / lam[..., -1:]
    return _end_state(M, S, pieces, a_end, w, const["c"][..., -1], const["s"][..., -1], const["s_decay"], kind,
                      stacked=False), r


def _chunks(q, k, v, theta, eta, alpha, chunk: int):
    """The inputs as chunks for `lax.scan`: ((q, k, v, theta, eta), `chunk_constants`), leaves
    [n, B, H, b, ...]."""
    t = q.shape[2]
    if t % chunk:
        raise ValueError(f"sequence length {t} is not a multiple of the memory chunk {chunk}")
    n = t // chunk

    def split(x):  # [B, H, T, ...] -> [B, H, n, b, ...]
        return x.reshape(x.shape[:2] + (n, chunk) + x.shape[3:])

    const = chunk_constants(split(k), split(eta), split(alpha))  # leaves [B, H, n, ...]
    return jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), (tuple(split(x) for x in (q, k, v, theta, eta)), const))


def _unchunk(ys, q):
    """Reads [n, B, H, b, dv] -> [B, H, T, dv]."""
    return jnp.moveaxis(ys, 0, 2).reshape(q.shape[:3] + ys.shape[-1:])


def memory_forward(state: PyTree, q, k, v, theta, eta, alpha, *, kind: str, chunk: int, remat: bool = False,
                   unroll: int = 1):
    """Chunk-parallel inner loop over T tokens: (y [B, H, T, dv], final state).

    `remat`: keep only each chunk's carried state for the backward pass and recompute from it what
    depends on it (the steps, per-token pieces and reads; a pure function: the recomputation is
    exact). The memory-independent `chunk_constants` ([b, b] weights included) are computed for
    all chunks before the loop and kept: 2 B H T b floats per layer.
    `unroll`: chunks per loop iteration (XLA fuses across them; fewer, larger kernels).
    Inputs are taken as float32, as every form of the inner loop takes them (bfloat16 q, k, v or
    gates: the same result as on their values upcast; their cotangents come back in their dtype)."""
    f32 = lambda x: x.astype(jnp.float32)
    xs = _chunks(*map(f32, (q, k, v, theta, eta, alpha)), chunk)
    state = jax.tree.map(f32, state)

    def body(carry, inp):
        return chunk_step(carry, *inp[0], inp[1], kind)

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    state, ys = jax.lax.scan(body, state, xs, unroll=_loop_unroll(unroll, xs))
    return _unchunk(ys, q), state


def _loop_unroll(unroll: int, xs) -> int:
    """`unroll` chunks per loop iteration, at most the chunks there are."""
    return min(unroll, xs[0][0].shape[0])


def _scan(body, carry, xs, reverse: bool = False, unroll: int = 1):
    """`jax.lax.scan(body, carry, xs, reverse=reverse, unroll=unroll)`, with its slices of xs and
    ys at an offset XLA does not read as the loop's counter (`min(i, n - 1)`, which it does not
    simplify), so that they compile to kernels that read the offset on the device.

    Why (XLA:GPU of jax 0.11.2, compiled for an H200 offline, 2026-12-01): a slice at the counter's
    own offset that is a plain copy (the forward loop storing the chunk-start states, the backward
    reading one of them) becomes a dynamic-slice fusion whose offset the host computes each
    iteration; a loop body holding one is a graph XLA records again before each of its launches,
    and `--xla_gpu_enable_command_buffer=+WHILE` leaves such a loop to the host. Here the same
    kernels per chunk and no such fusion: with `+WHILE` titans_demo's whole step is one graph
    launch where it was 103 (docs/concepts/memory-kernel.md).

    `unroll` > 1 that divides n (below n): blocks of `unroll` steps, each block's inputs and
    outputs one slice a leaf, as `lax.scan` unrolls (a slice a step cost titans_demo's step 222
    kernels at 4); otherwise `fori_loop`'s unrolling (n itself: no loop, the offsets constants).
    Values: `lax.scan`'s at unroll 1 (bit for bit where checked on a CPU; `lax.scan`'s own unrolling
    not dividing n, or n, rounds some sums otherwise)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    if 1 < unroll < n and n % unroll == 0:
        order = range(unroll - 1, -1, -1) if reverse else range(unroll)

        def block(carry, x):  # x: leaves [unroll, ...] -> ys [unroll, ...]
            ys = [None] * unroll
            for k in order:
                carry, ys[k] = body(carry, jax.tree.map(lambda a: a[k], x))
            return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

        carry, ys = _scan(block, carry, jax.tree.map(lambda a: a.reshape((n // unroll, unroll) + a.shape[1:]), xs),
                          reverse)
        return carry, jax.tree.map(lambda a: a.reshape((n,) + a.shape[2:]), ys)
    _, y = jax.eval_shape(body, carry, jax.tree.map(lambda x: x[0], xs))
    ys = jax.tree.map(lambda y: jnp.zeros((n,) + y.shape, y.dtype), y)

    def step(i, c):
        carry, ys = c
        j = jnp.maximum(n - 1 - i, 0) if reverse else jnp.minimum(i, n - 1)
        carry, y = body(carry, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), xs))
        return carry, jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, j, 0), ys, y)

    return jax.lax.fori_loop(0, n, step, (carry, ys), unroll=unroll)


def _starts(state: PyTree, xs, kind: str, unroll: int):
    """The sequential part: (final state, every chunk's start state, leaves [n, B, H, ...])."""
    (_, k, v, theta, eta), const = xs

    def body(carry, inp):
        return end_state(carry, *inp, kind), carry

    return _scan(body, state, (k, v, end_inputs(theta, eta, const)), unroll=_loop_unroll(unroll, xs))


def _pack(tree: PyTree) -> jax.Array:
    """Leaves [B, H, ...] as one array [B, H, total]: a loop's per-chunk outputs stored in one
    store per chunk, not one per leaf (on a GPU each store is a kernel, run once per chunk)."""
    return jnp.concatenate([x.reshape(x.shape[:2] + (-1,)) for x in jax.tree.leaves(tree)], axis=-1)


def _unpack(packed: jax.Array, like: PyTree) -> PyTree:
    """`_pack`'s inverse for leaves stacked along a leading axis: [..., B, H, total] -> like's tree."""
    leaves, tree = jax.tree.flatten(like)
    sizes = [x.size // (x.shape[0] * x.shape[1]) for x in leaves]
    parts = jnp.split(packed, list(itertools.accumulate(sizes))[:-1], axis=-1)
    return jax.tree.unflatten(tree, [p.reshape(p.shape[:-1] + x.shape[2:]) for p, x in zip(parts, leaves)])


# The most bytes (`read_bytes`' count) the parallel form's reads may hold for one group of chunks
# computed at once. All chunks at once, titans_demo's step at batch 128 x 512 held 24.3 GB against
# the scan's 18.4 (compiled for an H200 offline, jax 0.11.2, 2026-12-01): the reads' pull-back held
# every chunk's intermediates, start states and their cotangents together (~0.3 GB a chunk and
# memory layer there). 1.25 GiB is above nl_350m's whole sequence at batch 8 (1.24 GB by this
# count) and titans_demo's up to batch 32, which stay one group, the computation unchanged (the
# same program and peak as before the groups: nl_350m's step peaks where the reads are not).
# titans_demo at batch 128 gets 4 groups of 4 chunks (1.0 GB each): 19.4 GB. Smaller groups would
# hold less (8 groups: 18.8 GB, 16: 18.5) but no byte budget that leaves nl_350m's batch 8 as it
# was gives them: a group of 4 there counts as much (docs/benchmarks/2026-12-01-parallel-form-read-groups.md).
READ_GROUP_BYTES = 5 * 2**28


def read_bytes(state: PyTree, q, chunk: int) -> int:
    """A rough count of what one chunk adds to the bytes the parallel form's reads hold when its
    group's chunks are computed at once, in float32 (`READ_GROUP_BYTES`), as XLA held them (CPU and
    H200, titans_demo's memory shapes): per row and head, three chunk-start states (M and S: the
    group's copy of it, its cotangent and one of partial sums) and, per token, its [b] row of read
    weights and two values per memory layer's input and output width."""
    rows_heads = q.shape[0] * q.shape[1]
    state_floats = sum(x.size for x in jax.tree.leaves(state)) // rows_heads
    widths = sum(sum(w.shape[-2:]) for w in state["M"].values())
    return 4 * rows_heads * (3 * state_floats + chunk * (chunk + 2 * widths))


def read_groups(n: int, per_chunk: int, budget: int = READ_GROUP_BYTES) -> int:
    """How many groups the parallel form computes its n chunks' reads in, one after another: the
    fewest that divides n with each group's chunks at most `budget` bytes (`read_bytes` each); n
    (one chunk a group) if none does."""
    return next(g for g in range(1, n + 1) if n % g == 0 and (n // g) * per_chunk <= budget or g == n)


def _in_groups(groups: int, tree):
    """Leaves [n, ...] -> [groups, n / groups, ...]."""
    return jax.tree.map(lambda x: x.reshape((groups, x.shape[0] // groups) + x.shape[1:]), tree)


def _merged(tree):
    """Leaves [groups, g, ...] -> [groups * g, ...]."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def _all_reads(starts: PyTree, xs, kind: str, groups: int = 1):
    """Every chunk's reads from its start state: [n, B, H, b, dv]. The chunks of a group at once
    (the chunk axis one more batch axis of `chunk_reads`' products), the groups one after another."""
    reads = lambda st, x: jax.vmap(lambda st, *a: chunk_reads(st, *a, kind))(st, *x[0], x[1])
    if groups == 1:
        return reads(starts, xs)
    return _merged(_scan(lambda c, a: (c, reads(*a)), (), _in_groups(groups, (starts, xs)))[1])


def _parallel_fwd(state, xs, kind, unroll, groups):
    final, starts = _starts(state, xs, kind, unroll)
    return (_all_reads(starts, xs, kind, groups), final), (starts, xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _parallel(state, xs, kind, unroll, groups):
    return _parallel_fwd(state, xs, kind, unroll, groups)[0]


def _parallel_bwd(kind, unroll, groups, res, cotangents):
    """Group by group in reverse (`read_groups`; one group: all chunks at once): the group's
    reads pulled back at once (recomputed from the saved start states), then its end states chunk
    by chunk in reverse (`end_pullback`), each chunk's start-state cotangent its end state's pulled
    back plus what its reads gave, then what `end_inputs` computed from the group's gates and
    constants, for all its chunks at once. So one group's read intermediates, start-state
    cotangents and cotangents of the loop's inputs are live at a time, and the group leaves one
    set of its inputs' cotangents, both paths' summed. The loop's per-chunk cotangents leave it in
    two arrays, one store each per chunk: k's and v's side by side, and those of `end_inputs`'
    eight leaves packed (`_pack`). Compiled for an H200 (jax 0.11.2, offline), packing all of
    them in one array saved one more kernel per chunk at nl_350m's shapes (none at titans_demo's)
    and held 0.85 GB more in nl_350m's step."""
    starts, xs = res
    dys, d_final = cotangents

    def body(d_end, inp):
        start, k, v, e, d_read = inp
        d_start, d_k, d_v, d_e = end_pullback(start, k, v, e, kind, d_end)
        return jax.tree.map(jnp.add, d_start, d_read), (jnp.concatenate([d_k, d_v], axis=-1), _pack(d_e))

    def group(d_end, inp):  # d_end: the cotangent of the group's end state -> of its start state
        starts, xs, dys = inp
        d_starts, d_xs_reads = jax.vjp(lambda st, x: _all_reads(st, x, kind), starts, xs)[1](dys)
        (_, k, v, theta, eta), consts = xs  # q reaches the reads alone
        ends, pull_ends = jax.vjp(end_inputs, theta, eta, consts)
        d_end, (d_kv, packed) = _scan(
            body, d_end, (starts, k, v, ends, d_starts), reverse=True, unroll=_loop_unroll(unroll, xs))
        dk_loop, dv_loop = jnp.split(d_kv, [k.shape[-1]], axis=-1)
        d_ends = _unpack(packed, jax.tree.map(lambda x: x[0], ends))
        d_theta, d_eta, d_consts = pull_ends(d_ends)
        (dq, dk, dv, d_theta_reads, d_eta_reads), d_consts_reads = d_xs_reads
        return d_end, ((dq, dk + dk_loop, dv + dv_loop, d_theta + d_theta_reads, d_eta + d_eta_reads),
                       jax.tree.map(jnp.add, d_consts_reads, d_consts))

    if groups == 1:
        return group(d_final, (starts, xs, dys))
    d_state, d_xs = _scan(group, d_final, _in_groups(groups, (starts, xs, dys)), reverse=True)
    return d_state, _merged(d_xs)


_parallel.defvjp(_parallel_fwd, _parallel_bwd)


def memory_parallel(state: PyTree, q, k, v, theta, eta, alpha, *, kind: str, chunk: int, unroll: int = 1,
                    groups: int | None = None):
    """`memory_forward`'s result with the reads taken out of the loop: a `lax.scan` of
    `end_state` (the end states alone) carries the memory from chunk to chunk, then every chunk's
    reads are computed from their start states, all chunks as one batched computation (at large
    batch in groups of chunks, one group after another: `groups`). The loop, whose
    length is what a GPU runs one chunk after another, has at most half the matrix products per
    chunk of the scan with `remat` and no [b, b] read weights; the reads compute the per-token
    features a second time (about 1.3x the scan's matrix-product FLOPs, forward and backward).
    The backward pass keeps only the chunk-start states (as `memory_forward(remat=True)`): group by
    group in reverse, the group's reads are pulled back at once, then its end states chunk by chunk
    by `end_pullback` (`jax.custom_vjp`, reverse mode only). Inputs are taken as float32 (the
    cotangents of both paths are added in float32).
    `groups`: how many groups of chunks the reads (forward and backward) are computed in; it must
    divide the chunk count. Default: `read_groups`' choice, one group unless all chunks at once
    would hold more than `READ_GROUP_BYTES`."""
    f32 = lambda x: x.astype(jnp.float32)
    xs = _chunks(*map(f32, (q, k, v, theta, eta, alpha)), chunk)
    n = xs[0][0].shape[0]
    if groups is None:
        groups = read_groups(n, read_bytes(state, q, chunk))
    elif groups < 1 or n % groups:
        raise ValueError(f"memory_parallel: {groups} groups do not divide the {n} chunks")
    ys, final = _parallel(jax.tree.map(f32, state), xs, kind, unroll, groups)
    return _unchunk(ys, q), final


def memory_reference(state: PyTree, q, k, v, theta, eta, alpha, *, kind: str, chunk: int):
    """Token-by-token definition (tests only): gradients at the chunk-start memory; token t reads
    the memory its chunk's tokens <= t write as a chunk of their own (lambda over them); the
    whole chunk's memory is carried to the next."""
    M, S = state["M"], state["S"]
    loss = lambda m, kt, vt: 0.5 * jnp.sum(jnp.square(read(m, kt[:, :, None], kind) - vt[:, :, None]))
    ys = []
    for c0 in range(0, q.shape[2], chunk):
        m_hat, s_hat = M, S
        kc = k[:, :, c0 : c0 + chunk]
        lam = chunk_scale(m_hat, kc, normaliser(m_hat, kc, kind), kind)  # [B, H, b]
        for i in range(kc.shape[2]):
            M, S = m_hat, s_hat  # write tokens c0 .. c0 + i again, with their own lambda
            for t in range(c0, c0 + i + 1):
                g = jax.grad(loss)(m_hat, k[:, :, t], v[:, :, t])  # rows and heads are independent
                nu = normaliser(m_hat, k[:, :, t : t + 1], kind)[..., 0]
                step = (theta[:, :, t] * (1 - eta[:, :, t]) / (lam[..., i] * nu))[:, :, None, None]
                S = jax.tree.map(lambda s, gi: s * eta[:, :, t, None, None] - step * gi, S, g)
                M = jax.tree.map(lambda m, s: m * (1 - alpha[:, :, t, None, None]) + s, M, S)
            ys.append(read(M, q[:, :, c0 + i : c0 + i + 1], kind))
    return jnp.concatenate(ys, axis=2), {"M": M, "S": S}
