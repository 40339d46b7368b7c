"""The parallel form's sequential loop as fused Pallas kernels: `memory.end_state` from chunk to
chunk, each (stream row, head) one program that walks all its chunks in one launch, forward and
backward; the reads stay batched XLA computations (`model.nl_lm.memory_impl=parallel_pallas`).

Why: in `memory.memory_parallel` the reads leave the loop (one batched computation over all
chunks, large products a GPU runs well), and what remains sequential is `end_state`: per chunk a
few small products (the MLP memory: the hidden features at the chunk-start memory, the errors
pulled back, each layer's update) and the curvature bound, which XLA runs as about 20 small
kernels per chunk forward and 40 backward, one chunk after another (compiled for an H200,
docs/benchmarks/2026-11-30-parallel-form-and-loop-kernel.md; nl_350m: 4 layers x 32 chunks; titans_demo is
launch-bound).
Here that loop is one launch per layer. It is a smaller kernel than `memory_kernel`'s whole
chunk: no queries, no [b, b] read weights, no running curvature sums, and no gate terms: what
does not depend on the memory (`loop_inputs`: the gates' weights, the keys' Gram matrix) is
computed for every chunk at once before the loop, as `memory.memory_parallel` does, and its
cotangents pulled back by JAX after it.

- `end_math` is one chunk's end state for one (row, head) on 2-D arrays: `_end_terms` (the steps
  over the whole chunk's curvature bound, `memory.EndTerms`), then each layer's update
  (`memory_kernel._update`). The MLP memory walks its hidden width in tiles as `memory_kernel`
  does (`_tile_sums`, the terms, then `_tile_end` per tile), so that each tile's arithmetic is
  compiled once and no [dim, hidden] matrix is live whole.
- Forward kernel (grid: rows x heads): for each chunk, store the chunk-start state (the reads
  need it, and the backward), then its end state, in place in the final-state outputs.
- Backward kernel (chunks in reverse): recompute the chunk's terms from its saved start state,
  pull the update back (`jax.vjp` of each piece, latest first, the MLP's tiles in loops), add
  the reads' cotangent of that start state, and carry the sum to the chunk before. The state's
  cotangent lives in the kernel's outputs as the state does, and so do the MLP memory's sums over
  tiles of k's and the errors' cotangents (this chunk's rows of k's and v's), not the loops'
  carries, where they were live through both loops.
- `memory_parallel_kernel` ties them (`jax.custom_vjp` over the loop alone) to the reads,
  `memory.chunk_reads` of the saved start states under `jax.checkpoint` (recomputed in the
  backward pass from the start states, as `memory.memory_parallel`'s backward does).

The offline resources (shared memory, registers, spills per kernel) and what each of these
choices saved: docs/benchmarks/2026-11-29-memory-loop-kernel-offline.md.

Shapes on a GPU as for `memory_kernel` (`gpu_unsupported`); on a CPU the kernels run in
interpret mode (any shape, slow: tests and checks). Everything is float32 inside.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from nljax.models import memory as nm
from nljax.models import memory_kernel as mk
from nljax.models import platform
from nljax.models.memory import GELU_SLOPE, NU_FLOOR, layers
from nljax.models.tiles import dot, dot_t, tile

# the kernels' inputs, each [T, ...] per (row, head): k, v and the memory-independent terms of
# `loop_inputs` (q reaches the reads alone)
_LOOP_INPUTS = ("k", "v", "step", "keep_last", "mom_last", "c_end", "s_end", "s_decay", "kk", "k_gram")


def _abs(x):
    """|x| as x times its float sign (+1 at 0, jnp.abs's slope there): jnp.abs's pull-back selects
    with a boolean mask of x >= 0, which the backward kernel needed in another layout than x's,
    and Triton (3.9, 8 warps, chunk 64) failed to move a 1-bit tensor through shared memory.
    Here the mask is used in x's layout only."""
    return x * jax.lax.stop_gradient(jnp.where(x >= 0, 1.0, -1.0))


def _end_terms(step, keep_last, mom_last, c_end, s_end, s_decay, kk, k_gram, hh=None, hsq=None, w2=None):
    """What a chunk's end state takes besides its errors: a_end [j] (the weight of token j's
    gradient in M at the chunk's end), w [j] (in S), c_end, s_end, s_decay (of M_0 and S_0 in M,
    of S_0 in S), from the memory-independent terms `loop_inputs` computed for every chunk before
    the loop, and the curvature bound at the chunk-start memory: the whole chunk's lambda
    (`memory.EndTerms`), the MLP memory's from its hidden layer's sums over the width
    (`memory_kernel._tile_sums`: hh = h h^T, hsq = |h_i|^2, w2 = |W2|^2). The chunk's scalars
    come repeated over its tokens (one block layout for every input): the last is taken."""
    if hh is None:
        nu, inner = kk + NU_FLOOR, k_gram
    else:
        nu = hsq + GELU_SLOPE**2 * kk * w2 + NU_FLOOR
        inner = _abs(hh) + GELU_SLOPE**2 * k_gram * w2
    rs = jax.lax.rsqrt(nu)
    lam = jnp.maximum(jnp.max(jnp.sum(inner * rs[:, None] * rs[None, :], axis=1)), 1.0)
    a = step / nu / lam  # [j]
    return keep_last * a, mom_last * a, mk._last(c_end), mk._last(s_end), mk._last(s_decay)


def _tile_end(k, e, a_end, w, c_end, s_end, s_decay, W1, S1, W2, S2):
    """One tile of the MLP memory's hidden units (W1, S1 [dk, th] its columns; W2, S2 [th, dv]
    its rows) at the chunk's end: W1', S1', W2', S2'. e [b, dv]: the surprise h W2 - v."""
    pre = dot(k, W1)
    d0 = mk._gelu_slope(pre) * dot_t(e, W2)  # the surprise pulled back to the first layer's output
    coefs = (a_end, w, c_end, s_end, s_decay)
    return (*mk._update(W1, S1, k, d0, *coefs), *mk._update(W2, S2, mk._gelu(pre), e, *coefs))


def end_math(M: dict, S: dict, k, v, terms, kind: str):
    """One chunk's end state for one (row, head), the hidden width one tile: `memory.chunk_end`
    on 2-D arrays, from the pieces the kernels assemble around their loads and stores
    (`_end_terms`, `_tile_end`, `memory_kernel._update`): their arithmetic in one function, for
    tests. M, S leaves 2-D float32; k [b, dk], v [b, dv], `terms`: the chunk's `loop_inputs` after
    k and v (each [b], k_gram [b, b]) -> (M', S')."""
    if kind == "linear":
        (d0,) = mk._errors_linear(k, v, M["W"])
        W, Sw = mk._update(M["W"], S["W"], k, d0, *_end_terms(*terms))
        return {"W": W}, {"W": Sw}
    hh, hsq, w2, eh = mk._tile_sums(k, M["W1"], M["W2"])
    W1, S1, W2, S2 = _tile_end(k, eh - v, *_end_terms(*terms, hh, hsq, w2), M["W1"], S["W1"], M["W2"], S["W2"])
    return {"W1": W1, "W2": W2}, {"W1": S1, "W2": S2}


def _state_refs(refs, kind: str) -> dict:
    """name ('M/W1', 'S/W1', ...) -> the ref of that state matrix (or its cotangent)."""
    return dict(zip((f"{p}/{name}" for p in "MS" for name in layers(kind)), refs))


def _mlp_tiles(state: dict, j, th: int, chunk_of=None):
    """Refs of tile j of the MLP memory's four matrices (W1, S1, W2, S2); `chunk_of` = (i, n):
    chunk i's in saved [n * rows, cols] blocks."""
    at = None
    if chunk_of is not None:
        i, n = chunk_of
        at = (i, state["M/W1"].shape[0] // n, state["M/W2"].shape[0] // n)
    (w1, w2), (s1, s2) = (mk._tiles(state[f"{p}/W1"], state[f"{p}/W2"], j, th, at) for p in "MS")
    return w1, s1, w2, s2


def _linear_refs(state: dict, chunk_of=None):
    """Refs of the linear memory's (W, S); `chunk_of` = (i, n): chunk i's in saved blocks."""
    refs = state["M/W"], state["S/W"]
    if chunk_of is None:
        return refs
    i, n = chunk_of
    return tuple(r.at[tile(i, r.shape[0] // n), :] for r in refs)


def _forward_chunk(load, state: dict, kind: str, interpret: bool) -> None:
    """One chunk's end state, stored in place over its start state."""
    k, v, *terms = (load[x]() for x in _LOOP_INPUTS)
    get = lambda r: mk._load(r, interpret)
    if kind == "linear":
        refs = _linear_refs(state)
        W, S = map(get, refs)
        (d0,) = mk._errors_linear(k, v, W)
        for ref, value in zip(refs, mk._update(W, S, k, d0, *_end_terms(*terms))):
            mk._store(ref, value, interpret)
        return
    hidden = state["M/W1"].shape[1]
    th = mk._hidden_tile(hidden)
    tiles = lambda j: [get(r) for r in _mlp_tiles(state, j, th)]
    hh, hsq, w2, eh = mk._tile_loop(hidden // th, lambda j: mk._tile_sums(load["k"](), *tiles(j)[::2]))
    coefs = _end_terms(*terms, hh, hsq, w2)
    e = eh - v

    def one(j, carry):
        for ref, value in zip(_mlp_tiles(state, j, th), _tile_end(load["k"](), e, *coefs, *tiles(j))):
            mk._store(ref, value, interpret)
        return carry

    jax.lax.fori_loop(0, hidden // th, one, 0)


def _backward_chunk(load, saved: dict, d_state: dict, d_reads: dict, chunk_of, kind: str, interpret: bool,
                    d_out: dict):
    """Chunk i (`chunk_of` = (i, n)) pulled back from its start state (in the saved blocks
    `saved`): `d_state` holds its end state's cotangent in and its start state's out, the
    update's pulled back plus the reads' (in the saved blocks `d_reads`). Returns the cotangents
    of `_LOOP_INPUTS`."""
    k, v = load["k"](), load["v"]()
    # the terms read again where used (volatile loads): held from the first use to the last, the
    # keys' Gram matrix alone was [b, b] live through the MLP's tile loops (offline: 3,176 B
    # spilled, 2,616 re-read)
    fresh_terms = lambda: [load[x]() for x in _LOOP_INPUTS[2:]]
    get = lambda r: mk._load(r, interpret)
    if kind == "linear":
        W, S = map(get, _linear_refs(saved, chunk_of))
        coefs, terms_pull = jax.vjp(_end_terms, *fresh_terms())
        (d0,), errors_pull = jax.vjp(mk._errors_linear, k, v, W)
        refs = _linear_refs(d_state)
        dW, dS, dk, dd0, *dcoefs = jax.vjp(mk._update, W, S, k, d0, *coefs)[1](tuple(map(get, refs)))
        dk2, dv, dW2 = errors_pull((dd0,))
        for ref, g, r in zip(refs, (dW + dW2, dS), _linear_refs(d_reads, chunk_of)):
            mk._store(ref, g + get(r), interpret)
        return dk + dk2, dv, *terms_pull(tuple(dcoefs))
    hidden = saved["M/W1"].shape[1]
    th = mk._hidden_tile(hidden)
    nt = hidden // th
    start = lambda j: [get(r) for r in _mlp_tiles(saved, j, th, chunk_of)]  # W1, S1, W2, S2
    hh, hsq, w2, eh = mk._tile_loop(nt, lambda j: mk._tile_sums(load["k"](), *start(j)[::2]))
    coefs = _end_terms(*fresh_terms(), hh, hsq, w2)
    e = eh - v
    # k's and e's cotangents [b, d] are summed over the tiles in the outputs (k's and v's rows of
    # this chunk: global memory), not in the loops' carries, where they were live through both loops
    dk_ref, de_ref = d_out["k"], d_out["v"]
    mk._store(dk_ref, jnp.zeros_like(k), interpret)
    mk._store(de_ref, jnp.zeros_like(e), interpret)

    def step_back(j):  # tile j's part of the terms' cotangents; its start state's and k's and e's stored
        _, pull = jax.vjp(_tile_end, load["k"](), e, *coefs, *start(j))
        refs = _mlp_tiles(d_state, j, th)
        dk_j, de_j, *rest = pull(tuple(map(get, refs)))
        for ref, g, r in zip(refs, rest[5:], _mlp_tiles(d_reads, j, th, chunk_of)):
            mk._store(ref, g + get(r), interpret)
        mk._store(dk_ref, get(dk_ref) + dk_j, interpret)
        mk._store(de_ref, get(de_ref) + de_j, interpret)
        return tuple(rest[:5])

    dcoefs = mk._tile_loop(nt, step_back)
    *d_terms, dhh, dhsq, dw2 = jax.vjp(_end_terms, *fresh_terms(), hh, hsq, w2)[1](tuple(dcoefs))

    def sums_back(j):  # tile j's part of k's cotangent; its W1's and W2's added
        W1, _, W2, _ = start(j)
        dk_j, dW1, dW2 = jax.vjp(mk._tile_sums, load["k"](), W1, W2)[1]((dhh, dhsq, dw2, get(de_ref)))
        for ref, g in zip(mk._tiles(d_state["M/W1"], d_state["M/W2"], j, th), (dW1, dW2)):
            mk._store(ref, get(ref) + g, interpret)
        mk._store(dk_ref, get(dk_ref) + dk_j, interpret)
        return ()

    mk._tile_loop(nt, sums_back)
    return get(dk_ref), -get(de_ref), *d_terms


def _end_forward_kernel(*refs, kind: str, chunk: int, n: int, interpret: bool):
    """One (row, head): every chunk in order, the state in the final-state outputs between
    chunks, each chunk's start state stored first."""
    ns, ni = 2 * len(layers(kind)), len(_LOOP_INPUTS)
    inputs, state_in, state, starts = refs[:ni], refs[ni:ni + ns], refs[ni + ns:ni + 2 * ns], refs[ni + 2 * ns:]
    for src, dst in zip(state_in, state):
        dst[...] = src[...].astype(jnp.float32)
    mk._sync(interpret)
    named = _state_refs(state, kind)

    def body(i, carry):
        for src, dst in zip(state, starts):
            dst[tile(i, src.shape[0]), :] = mk._load(src, interpret)
        _forward_chunk(mk._chunk_input(inputs, tile(i, chunk), _LOOP_INPUTS, interpret), named, kind, interpret)
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _end_backward_kernel(*refs, kind: str, chunk: int, n: int, interpret: bool):
    """One (row, head): chunks in reverse, the state's cotangent in the initial-state cotangent
    outputs between chunks."""
    ns, ni = 2 * len(layers(kind)), len(_LOOP_INPUTS)
    inputs, refs = refs[:ni], refs[ni:]
    starts, d_reads, d_final, d_inputs, d_state = (refs[:ns], refs[ns:2 * ns], refs[2 * ns:3 * ns],
                                                   refs[3 * ns:3 * ns + ni], refs[3 * ns + ni:])
    for src, dst in zip(d_final, d_state):
        dst[...] = src[...]
    mk._sync(interpret)
    saved, d_saved, named = (_state_refs(r, kind) for r in (starts, d_reads, d_state))

    def body(j, carry):
        i = n - 1 - j
        t = tile(i, chunk)
        d_out = {"k": d_inputs[0].at[t, :], "v": d_inputs[1].at[t, :]}
        load = mk._chunk_input(inputs, t, _LOOP_INPUTS, interpret)
        grads = _backward_chunk(load, saved, named, d_saved, (i, n), kind, interpret, d_out)
        for g, r in zip(grads, d_inputs):
            if len(r.shape) == 2:  # fenced: the MLP memory's sums over tiles were in these rows
                mk._store(r.at[t, :], g, interpret)
            else:
                r[t] = g
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _forward(leaves, xs, kind: str, chunk: int, interpret: bool):
    """(final state's leaves, every chunk's start state's leaves [B, H, n * rows, cols])."""
    n = xs[0].shape[2] // chunk
    outs = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in leaves] + [mk._saved_shape(x, n) for x in leaves]
    size = sum(math.prod(x.shape[2:]) for x in leaves)
    res = mk._call(_end_forward_kernel, [*xs, *leaves], outs, kind, chunk, n, interpret, size)
    return list(res[:len(leaves)]), list(res[len(leaves):])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _loop(leaves, xs, kind, chunk, interpret):
    return _forward(leaves, xs, kind, chunk, interpret)


def _loop_fwd(leaves, xs, kind, chunk, interpret):
    final, starts = _forward(leaves, xs, kind, chunk, interpret)
    return (final, starts), (xs, starts)


def _loop_bwd(kind, chunk, interpret, res, cotangents):
    xs, starts = res
    d_final, d_starts = cotangents
    n = xs[0].shape[2] // chunk
    f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
    outs = [f32(x) for x in xs] + [f32(x) for x in d_final]
    size = sum(math.prod(x.shape[2:]) for x in d_final)
    grads = mk._call(_end_backward_kernel, [*xs, *starts, *d_starts, *d_final], outs, kind, chunk, n, interpret, size)
    ni = len(_LOOP_INPUTS)
    return list(grads[ni:]), tuple(grads[:ni])


_loop.defvjp(_loop_fwd, _loop_bwd)


def loop_inputs(k, v, theta, eta, alpha, chunk: int):
    """The kernels' inputs (`_LOOP_INPUTS`), leaves [B, H, T, ...]: k, v, and what the end states
    take that does not depend on the memory, computed for every chunk at once before the loop (as
    `memory.memory_parallel` does): the steps before the normaliser theta (1 - eta), the last
    rows of `memory.chunk_constants`' weights, its per-chunk scalars repeated over the chunk's
    tokens, the keys' squared norms and Gram matrix (each chunk's [b, b] in its rows). Also
    returns the constants, [B, H, n, ...], for the reads."""
    batch, heads, t = k.shape[:3]
    n = t // chunk
    const = nm.chunk_constants(*(x.reshape(batch, heads, n, chunk, *x.shape[3:]) for x in (k, eta, alpha)))
    tokens = lambda x: x.reshape(batch, heads, t, *x.shape[4:])  # [B, H, n, b, ...] -> [B, H, T, ...]
    every = lambda x: tokens(jnp.broadcast_to(x[..., None], (batch, heads, n, chunk)))  # a chunk's scalar per token
    terms = (theta * (1.0 - eta), tokens(const["keep_mom"][..., -1, :]), tokens(const["mom_last"]),
             every(const["c"][..., -1]), every(const["s"][..., -1]), every(const["s_decay"]), tokens(const["kk"]),
             tokens(const["k_gram"]))
    return (k, v, *terms), const


def memory_parallel_kernel(state: dict, q, k, v, theta, eta, alpha, *, kind: str, chunk: int,
                           interpret: bool | None = None):
    """`memory.memory_parallel` with its sequential loop as the kernels above: (y [B, H, T, dv]
    float32, final state). The reads of every chunk are `memory.chunk_reads` of the start states
    the kernel saved, under `jax.checkpoint` (recomputed from them in the backward pass).
    `interpret`: run the kernels as plain JAX (any backend, slow); None: on all but GPUs."""
    if q.shape[2] % chunk:
        raise ValueError(f"sequence length {q.shape[2]} is not a multiple of the memory chunk {chunk}")
    if interpret is None:
        interpret = platform.backend() != "gpu"
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v, theta, eta, alpha = map(f32, (q, k, v, theta, eta, alpha))
    ins, const = loop_inputs(k, v, theta, eta, alpha, chunk)
    final, starts = _loop(mk._leaves(jax.tree.map(f32, state), kind), ins, kind, chunk, interpret)
    ys = jax.checkpoint(functools.partial(_reads, kind=kind))(starts, q, k, v, theta, eta, const)
    return ys, mk._unleaves(final, kind)


def _reads(starts: list, q, k, v, theta, eta, const: dict, *, kind: str):
    """Every chunk's reads from its start state (leaves [B, H, n * rows, cols], as the kernel
    saved them), as one `memory.chunk_reads` with the chunks a second head axis: [B, H, T, dv].
    `const`: `memory.chunk_constants`, leaves [B, H, n, ...]. Every reshape here is free (no
    transposes: under vmap over a chunk axis, XLA:CPU's algebraic simplifier failed on a
    transpose it folded into a product)."""
    batch, heads, t = q.shape[:3]
    n = const["c"].shape[2]
    as_heads = lambda x, per: x.reshape(batch, heads * n, per, *x.shape[3:])  # [B, H, n per, ...] -> [B, H n, per, ...]
    state = mk._unleaves([as_heads(x, x.shape[2] // n) for x in starts], kind)
    const = jax.tree.map(lambda x: x.reshape(batch, heads * n, *x.shape[3:]), const)
    ins = [as_heads(x, t // n) for x in (q, k, v, theta, eta)]
    return nm.chunk_reads(state, *ins, const, kind).reshape(*q.shape[:3], -1)
