"""The neural memory's inner loop as fused Pallas kernels: `memory_forward`'s arithmetic, with
each (stream row, head) one program that walks all its chunks in one launch.

Why: `memory_forward` is a `lax.scan` over chunks whose body is a few dozen small XLA kernels
per chunk (titans_demo: thousands of launches per step, each a few microseconds of work). Here a
whole layer's inner loop is one launch forward and one backward.

- `chunk_math` is one chunk of one (row, head) on 2-D arrays: `memory.chunk_constants` and
  `memory.chunk_step` restated without batch axes and without ops that Triton cannot lower
  (cumulative sums are masked sums or products with a triangular matrix; a row or element is
  picked with a mask). The MLP memory's chunk is `_mlp_chunk`: its hidden width walked in tiles
  (`HIDDEN_TILE` units; `_tile_sums`, then the gate terms, then `_tile_step`, each tile's part
  of the sums over the width added up), the linear memory's a list of small stages (`_stages`).
  It is the only statement of the arithmetic here: the forward kernel runs these functions, and
  the backward kernel pulls them back with `jax.vjp`, so the two cannot drift apart.
- Why tiles, in loops: written out as straight-line code over the whole hidden width, the MLP
  kernels took minutes for XLA to compile on an H200 (LLVM and ptxas on a large body at 255
  registers with kilobytes of spills per thread). A tile's functions inside a `lax.fori_loop`
  (an scf.for in Triton) are compiled once, on [b, 16] tensors instead of [b, hidden].
- The state M, S (float32; the MLP memory's four [dim, hidden] matrices) is not the loop's carry:
  carried, all of it was live (registers, and a shared-memory copy of each matrix a product
  reads) for the whole chunk, which took more shared memory than an H100/H200 block has. It
  lives in the kernel's own outputs (global memory, L2-resident) between chunks, each matrix
  (MLP: each tile of it) loaded where it is used and stored at the chunk's end between two block
  barriers (`_store`: the program's threads hold different parts of it).
  docs/benchmarks/2026-11-28-memory-kernel-compile-and-shared-memory.md has the measured compile times,
  shared memory and spills.
- Forward kernel (grid: rows x heads): for each chunk, store the chunk-start state (what
  `model.remat=memory` keeps), run the chunk, store its reads and its end state (MLP: a tile at
  a time, in the second tile loop).
- Backward kernel (same grid, chunks in reverse): recompute the chunk from its saved start state,
  then pull it back piece by piece, latest first (`jax.vjp` of each piece alone; the MLP's tile
  functions inside loops over the tiles, the linear memory's stages with the large
  intermediates recomputed where used); the state's cotangent lives in the kernel's outputs as
  the state does, and the inputs' cotangents are stored per chunk.
- Exact float32 products (`jax.default_matmul_precision("highest")`) become three TF32 products
  on a GPU (`_products`): Triton has no tensor-core path for them and unrolls them per element.
- `memory_kernel` ties them with `jax.custom_vjp` (`backward="scan"`: the forward kernel with a
  reverse `lax.scan` of `chunk_math`'s vjp instead of the backward kernel: a variant to time
  against the whole kernel); `memory_forward` (the scan) and
  `memory_reference` (token by token) are the references it is tested against.

Constraints on a GPU (Triton): the tiles the kernel computes on, the chunk b, the key and value
widths and the MLP hidden width, must be powers of two (Triton's tensors) and at least 16 (its
matrix products); `gpu_unsupported` says which fails. The sequence itself is one block of any
multiple of b. On CPU the kernels run in interpret mode (any shape, slow: for tests and for
checking a whole run). Inputs may be bfloat16; everything inside is float32, as in
`memory_forward`.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nljax.models import platform
from nljax.models.memory import GELU_SLOPE, NU_FLOOR, layers
from nljax.models.tiles import dot, dot_t, t_dot, tile

_SQRT_2_PI = 0.7978845608028654  # sqrt(2 / pi), of gelu's tanh approximation (jax.nn.gelu's default)


def _gelu(x):
    """jax.nn.gelu(x) (tanh approximation) written out: jax.nn.gelu is a jitted function, and
    its derivative is needed explicitly below."""
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x)))


def _gelu_slope(x):
    """d/dx gelu(x)."""
    t = jnp.tanh(_SQRT_2_PI * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3 * 0.044715 * x * x)





def _last(x, axis: int = 0):
    """x's last entry along `axis` (a masked sum: Triton has no dynamic single-element pick)."""
    n = x.shape[axis]
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.sum(jnp.where(idx == n - 1, x, 0.0), axis=axis)


def _coefficients(k, theta, eta, alpha, hh=None, hsq=None, w2=None, *, start=0):
    """The chunk's gate and step-size terms (`memory.chunk_constants`): A [t, j] (the reads'
    scores' weights), c, s [t], a_end, w [j], c_end, s_end, s_decay (scalars). The MLP memory's
    normaliser uses its hidden layer h's sums over the hidden width (`_tile_sums`: hh = h h^T,
    hsq = |h_i|^2) and w2 = |W2|^2; the linear memory's only the keys. `start`: the chunk's first
    token (any integer gives the same result; a loop index keeps the kernels' masks per chunk)."""
    b = k.shape[0]
    # the masks from positions in the sequence (`start`: a loop index in the kernels), not
    # constants: the 0/1 triangle `mine` that a product takes (and its transpose in the backward)
    # was hoisted by Triton out of the chunk loop with its shared-memory copies (two each under
    # tf32x3), 64 KiB alive for the whole backward kernel at chunk 64
    row = jax.lax.broadcasted_iota(jnp.int32, (b, b), 0) + start
    col = jax.lax.broadcasted_iota(jnp.int32, (b, b), 1) + start
    lower = row >= col  # [i, j]: i >= j
    mine = row <= col  # [j, t]: j <= t

    log_eta = jnp.log(jnp.maximum(eta, 1e-30))
    log_keep = jnp.log(jnp.maximum(1.0 - alpha, 1e-30))
    le = jnp.sum(jnp.where(lower, log_eta[None, :], 0.0), axis=1)  # cumulative sums  [b]
    la = jnp.sum(jnp.where(lower, log_keep[None, :], 0.0), axis=1)

    def decay(lc):  # [i, j] = exp(lc_i - lc_j) for i >= j, else 0
        return jnp.where(lower, jnp.exp(jnp.where(lower, lc[:, None] - lc[None, :], 0.0)), 0.0)

    mom, keep = decay(le), decay(la)
    keep_mom = dot(keep, mom)  # [t, j]
    le_end = jnp.sum(log_eta)
    s = jnp.sum(keep * jnp.exp(le)[None, :], axis=1)  # [t]
    c = jnp.exp(la)
    mom_last = jnp.exp(le_end - le)  # [j]: mom's last row
    s_decay = jnp.exp(le_end)
    kk = jnp.sum(k * k, axis=1)
    inner = jnp.abs(dot_t(k, k))  # |k_i . k_j|
    if hh is None:
        nu = kk + NU_FLOOR
    else:
        nu = hsq + GELU_SLOPE**2 * kk * w2 + NU_FLOOR
        inner = jnp.abs(hh) + GELU_SLOPE**2 * inner * w2
    rs = jax.lax.rsqrt(nu)
    rows = dot(inner * rs[:, None] * rs[None, :], mine.astype(jnp.float32))  # [i, t]: row i summed over j <= t
    lam = jnp.maximum(jnp.max(jnp.where(mine, rows, 0.0), axis=0), 1.0)  # [t], over rows i <= t

    a = theta * (1.0 - eta) / nu  # [j]
    A = keep_mom * a[None, :] / lam[:, None]  # [t, j]
    return A, c, s, _last(A, 0), a * mom_last / _last(lam), _last(c), _last(s), s_decay


def _errors_linear(k, v, W):
    """The linear memory's surprise at the chunk-start state: k W - v [b, dv]."""
    return (dot(k, W) - v,)


HIDDEN_TILE = 16  # the MLP memory's hidden width is walked in tiles of this many units (the whole width if narrower)


def _tile_sums(k, W1, W2):
    """One tile of the MLP memory's hidden units (W1 [dk, th] its columns, W2 [th, dv] its rows):
    its part of the sums over the hidden width that the chunk needs before its reads: h h^T
    [b, b], |h_i|^2 [b], |W2|^2 and h W2 [b, dv], h = gelu(k W1) the hidden layer at the keys."""
    h = _gelu(dot(k, W1))
    return dot_t(h, h), jnp.sum(h * h, axis=1), jnp.sum(W2 * W2), dot(h, W2)


def _tile_step(q, k, e, qka, c, s, a_end, w, c_end, s_end, s_decay, W1, S1, W2, S2):
    """One tile of hidden units (W1, S1 [dk, th] its columns; W2, S2 [th, dv] its rows) through
    the rest of the chunk: its part of the second layer's reads (the chunk-start weight's and
    momentum's terms and the scores r h^T [b, b], each summed over tiles by the caller) and its
    state at the chunk's end. e [b, dv]: the surprise h W2 - v; qka = (q k^T) * A."""
    pre = dot(k, W1)
    h = _gelu(pre)
    d0 = _gelu_slope(pre) * dot_t(e, W2)  # the surprise pulled back to the first layer's output
    r1 = c[:, None] * dot(q, W1) + s[:, None] * dot(q, S1) - dot(qka, d0)  # the first layer's reads
    g = _gelu(r1)
    coefs = (a_end, w, c_end, s_end, s_decay)
    return (dot(g, W2), dot(g, S2), dot_t(g, h), *_update(W1, S1, k, d0, *coefs), *_update(W2, S2, h, e, *coefs))


def _surprise(eh, v):
    """The MLP memory's surprise at the chunk-start state, e = h W2 - v, from h W2 summed over tiles."""
    return eh - v


def _scores_weights(q, k, A):
    """(q k^T) * A [t, j]: the first layer's reads' scores, weighted."""
    return dot_t(q, k) * A


def _tail(rw, rs, rh, A, e, c, s):
    """The second layer's reads (the chunk's reads y) from their parts summed over tiles: rw = g W2,
    rs = g S2, rh = g h^T with g = gelu(the first layer's reads)."""
    return c[:, None] * rw + s[:, None] * rs - dot(rh * A, e)


def _through(r, W):
    """The linear memory's input r [t, d_in] times a matrix W [d_in, d_out]."""
    return (dot(r, W),)


def _scores(r, x, d, A):
    """The chunk's own updates' part of the linear memory's reads: ((r x^T) * A) d [t, d_out]."""
    return (dot(dot_t(r, x) * A, d),)


def _read(rw, rs, sc, c, s):
    """One layer's reads from its parts: the chunk-start weight's and momentum's and the chunk's
    own updates'."""
    return (c[:, None] * rw + s[:, None] * rs - sc,)


def _update(W, S, x, d, a_end, w, c_end, s_end, s_decay):
    """One layer's state at the chunk's end: (W, S) from its chunk-start (W, S), inputs x and
    pulled-back errors d."""
    return c_end * W + s_end * S - t_dot(x * a_end[:, None], d), s_decay * S - t_dot(x * w[:, None], d)


_INPUTS = ("q", "k", "v", "theta", "eta", "alpha")
_COEFS = ("A", "c", "s", "a_end", "w", "c_end", "s_end", "s_decay")


def _stages() -> list:
    """The linear memory's chunk as stages (fn, input names, output names) in order: names are
    the chunk's inputs (`_INPUTS`), the chunk-start state ('M/W', 'S/W'), intermediates, the
    reads 'y' and the end state ("M'/W", "S'/W"). The kernels run them with each state matrix
    read from memory where a stage uses it, and the backward kernel pulls back one stage at a
    time, so only one stage's intermediates and state matrices are live at once (shared memory).
    The MLP memory's chunk is `_mlp_chunk`."""
    update = ["a_end", "w", "c_end", "s_end", "s_decay"]
    terms = ["rw0", "rs0", "sc0"]  # the reads' three terms, each a stage
    return [
        (_coefficients, ["k", "theta", "eta", "alpha"], list(_COEFS)),
        (_errors_linear, ["k", "v", "M/W"], ["d0"]),
        (_through, ["q", "M/W"], terms[:1]),
        (_through, ["q", "S/W"], terms[1:2]),
        (_scores, ["q", "k", "d0", "A"], terms[2:]),
        (_read, [*terms, "c", "s"], ["y"]),
        (_update, ["M/W", "S/W", "k", "d0", *update], ["M'/W", "S'/W"]),
    ]


def _mlp_chunk(q, k, v, theta, eta, alpha, sums, step, start=0):
    """The MLP memory's chunk, its hidden width walked in tiles: `sums(fn)` is fn's sum over the
    tiles of `fn(W1, W2)` (`_tile_sums`), `step(fn)` the same of `fn(W1, S1, W2, S2)` (`_tile_step`'s
    parts of the reads; the caller stores each tile's end state). Returns the reads y."""
    hh, hsq, w2, eh = sums(functools.partial(_tile_sums, k))
    A, c, s, *coefs = _coefficients(k, theta, eta, alpha, hh, hsq, w2, start=start)
    e = _surprise(eh, v)
    qka = _scores_weights(q, k, A)
    rw, rs, rh = step(functools.partial(_tile_step, q, k, e, qka, c, s, *coefs))
    return _tail(rw, rs, rh, A, e, c, s)


def chunk_math(M: dict, S: dict, q, k, v, theta, eta, alpha, kind: str):
    """One chunk of one (row, head): `memory.chunk_constants` then `memory.chunk_step` (the linear
    memory as `_stages` in order, the MLP memory as `_mlp_chunk` with its whole hidden width one
    tile). M, S leaves 2-D float32 (W [dk, dv]; W1 [dk, hidden], W2 [hidden, dv]); q, k [b, dk],
    v [b, dv], gates [b] -> (new M, new S, reads y [b, dv])."""
    if kind == "mlp":
        end = {}

        def step(fn):
            rw, rs, rh, *state = fn(M["W1"], S["W1"], M["W2"], S["W2"])
            end.update(zip(("M/W1", "S/W1", "M/W2", "S/W2"), state))
            return rw, rs, rh

        y = _mlp_chunk(q, k, v, theta, eta, alpha, lambda fn: fn(M["W1"], M["W2"]), step)
        return {n: end[f"M/{n}"] for n in ("W1", "W2")}, {n: end[f"S/{n}"] for n in ("W1", "W2")}, y
    env = dict(zip(_INPUTS, (q, k, v, theta, eta, alpha)))
    env |= {f"M/{n}": x for n, x in M.items()} | {f"S/{n}": x for n, x in S.items()}
    for fn, ins, outs in _stages():
        env |= dict(zip(outs, fn(*[env[n] for n in ins])))
    return {"W": env["M'/W"]}, {"W": env["S'/W"]}, env["y"]


def gpu_unsupported(kind: str, chunk: int, dim: int, hidden: int) -> str | None:
    """Why the compiled (Triton) kernel cannot take these shapes, or None when it can: Triton's
    matrix products need each dimension a power of two and at least 16."""
    dims = {"memory_chunk": chunk, "memory_dim": dim}  # dim: the key and value width
    if kind == "mlp":
        dims["memory_hidden"] = hidden
    for name, n in dims.items():
        if n < 16 or n & (n - 1):
            return f"model.nl_lm.{name}={n}: the Pallas memory kernel needs powers of two >= 16 on a GPU"
    return None


def _chunk_input(refs, t, names=_INPUTS, interpret: bool | None = None):
    """name -> a reader of this chunk's rows of an input (q, k, v [b, d] or a gate [b]) from its
    [T, d] or [T] block, as float32: read where a stage uses it, not kept from stage to stage.
    With `interpret` given, each read is `_load`'s (volatile on a GPU: a second read is a new
    load, not the first one's value kept alive until then)."""
    def reader(r):
        at = r.at[t, :] if len(r.shape) == 2 else r.at[t]
        if interpret is not None:
            return lambda: _load(at, interpret).astype(jnp.float32)
        return lambda: at[...].astype(jnp.float32)
    return {name: reader(r) for name, r in zip(names, refs, strict=True)}


_FULL_FLOAT32 = ("highest", "float32", "F32_F32_F32")  # jax_default_matmul_precision's exact-float32 settings


def _products(interpret: bool):
    """The precision the kernel's matrix products are traced at: the ambient one, except that on
    a GPU full float32 (`jax.default_matmul_precision("highest")`) becomes three TF32 products per
    product (`TF32_TF32_F32_X3`, float32 to about 1e-6 relative). Triton lowers an exact float32
    product (`inputPrecision = ieee`) without tensor cores, as multiply-adds unrolled per element:
    the backward kernel alone took minutes to compile
    (docs/benchmarks/2026-11-28-memory-kernel-compile-and-shared-memory.md)."""
    if interpret or jax.config.jax_default_matmul_precision not in _FULL_FLOAT32:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("TF32_TF32_F32_X3")


def _sync(interpret: bool) -> None:
    """A block-wide barrier (__syncthreads) between one thread's stores of a state matrix in
    global memory and other threads' loads of it (or their loads and its stores): the threads
    of a program hold different parts of each tensor, in layouts Triton picks. Interpreted, a
    program is one sequential computation: nothing to order."""
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        pltriton.debug_barrier()


def _load(ref, interpret: bool, rows=None):
    """A state matrix (or its cotangent; `rows`: the chunk's in a saved [n * rows, cols] block)
    read where a stage uses it. Volatile on a GPU: two plain loads of the same address with no
    store between are one value to Triton's common-subexpression pass, which kept the first
    load's shared-memory copy alive until the second's last use."""
    if rows is not None:
        ref = ref.at[rows, :]
    if interpret:
        return ref[...]
    from jax.experimental.pallas import triton as pltriton
    return pltriton.load(ref, volatile=True)


def _store(ref, value, interpret: bool) -> None:
    """Stores a state matrix (or its cotangent) that other threads of the program read: after
    every thread's last load of the old value, and before anyone's next load."""
    _sync(interpret)
    ref[...] = value
    _sync(interpret)


def _hidden_tile(hidden: int) -> int:
    """The hidden units one tile of the MLP memory's loops takes: HIDDEN_TILE where it divides the
    width (on a GPU always: a power of two of at least 16), else the whole width (one tile)."""
    return HIDDEN_TILE if hidden % HIDDEN_TILE == 0 else hidden


def _tiles(W1, W2, j: int | jax.Array, th: int, first_rows=None):
    """Tile j of hidden units of a [dk, hidden] and a [hidden, dv] matrix (refs): W1's columns and
    W2's rows. `first_rows`: the chunk's matrices in saved [n * rows, cols] blocks, chunk i's
    (W1's rows i * dk.., W2's rows i * hidden..) as (i, dk, hidden)."""
    if first_rows is None:
        return W1.at[:, tile(j, th)], W2.at[tile(j, th), :]
    i, dk, hidden = first_rows
    return W1.at[tile(i, dk), tile(j, th)], W2.at[tile(i * (hidden // th) + j, th), :]


def _in_loop(x, j):
    """x, tied to loop index j (a select that is always true, and that no compiler pass can prove
    so): a [b, b] matrix a loop's products take would otherwise be hoisted out of the loop by
    Triton with its shared-memory copies (under tf32x3, two per operand), alive through the loop
    and what precedes it; tied, each copy lives for one iteration's product. Same value."""
    row = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(row + j >= j, x, jnp.zeros_like(x))


def _tile_loop(n: int, fn, init=None):
    """The sum over tiles j < n of `fn(j)` (a tuple of arrays), as one loop (an scf.for in Triton:
    the tile's arithmetic is compiled once, not once per tile), from `init` (default zeros)."""
    if init is None:
        init = tuple(jnp.zeros(x.shape, x.dtype) for x in jax.eval_shape(lambda: fn(0)))
    return jax.lax.fori_loop(0, n, lambda j, total: tuple(a + b for a, b in zip(total, fn(j))), tuple(init))


def _forward_mlp(load, state, interpret: bool, start):
    """One chunk of the MLP memory (`_mlp_chunk`), its hidden width walked in tiles, each tile's
    end state stored as it is computed: the reads [b, dv]."""
    M1, S1, M2, S2 = (state[k] for k in ("M/W1", "S/W1", "M/W2", "S/W2"))
    hidden = M1.shape[1]
    th = _hidden_tile(hidden)
    nt = hidden // th

    def sums(fn):
        return _tile_loop(nt, lambda j: fn(*[_load(r, interpret) for r in _tiles(M1, M2, j, th)]))

    def step(fn):
        def one(j):
            refs = (*_tiles(M1, M2, j, th), *_tiles(S1, S2, j, th))
            W1, W2, s1, s2 = (_load(r, interpret) for r in refs)
            rw, rs, rh, *end = fn(W1, s1, W2, s2)
            for r, value in zip((refs[0], refs[2], refs[1], refs[3]), end):  # W1', S1', W2', S2'
                _store(r, value, interpret)
            return rw, rs, rh
        return _tile_loop(nt, one)

    return _mlp_chunk(*[load[x]() for x in _INPUTS], sums, step, start)


def _backward_mlp(load, fresh_load, saved, d_state, dy, i, interpret: bool):
    """One chunk of the MLP memory pulled back: recomputed from its saved start state (both tile
    loops, `_mlp_chunk`'s arithmetic), then `jax.vjp` of each of its pieces, latest first, the
    tile functions inside loops over the tiles (`_tile_step`'s in any order: the tiles are
    independent given the sums' cotangents). The state's cotangent (`d_state`: the chunk's end
    state's in, its start state's out) is read and written a tile at a time. `fresh_load(name)`:
    q or k read again (volatile) inside each loop, so that neither is live across the loops.
    Returns the cotangents of q, k, v, theta, eta, alpha."""
    q, k, v, theta, eta, alpha = (load[x]() for x in _INPUTS)
    M1, S1, M2, S2 = (saved[x] for x in ("M/W1", "S/W1", "M/W2", "S/W2"))
    dM1, dS1, dM2, dS2 = (d_state[x] for x in ("M/W1", "S/W1", "M/W2", "S/W2"))
    dk_, hidden = dM1.shape
    th = _hidden_tile(hidden)
    nt = hidden // th
    at = (i, dk_, hidden)

    def start(j):  # tile j of the chunk-start state: W1, S1, W2, S2
        (a, b), (c, d) = _tiles(M1, M2, j, th, at), _tiles(S1, S2, j, th, at)
        return tuple(_load(r, interpret) for r in (a, c, b, d))

    fresh = lambda: (fresh_load("q"), fresh_load("k"))
    hh, hsq, w2, eh = _tile_loop(nt, lambda j: _tile_sums(fresh()[1], *start(j)[::2]))
    first = i * k.shape[0]  # the chunk's first token
    coefs = _coefficients(k, theta, eta, alpha, hh, hsq, w2, start=first)
    A, c, s, *rest = coefs
    e = _surprise(eh, v)
    qka = _scores_weights(q, k, A)
    mid = (e, qka, c, s, *rest)
    tied = lambda j: (e, _in_loop(qka, j), *mid[2:])  # qka's copies per tile, not hoisted out of both loops
    rw, rs, rh = _tile_loop(nt, lambda j: _tile_step(*fresh(), *tied(j), *start(j))[:3])

    d_rw, d_rs, d_rh, dA, de, dc, ds = jax.vjp(_tail, rw, rs, rh, A, e, c, s)[1](dy)

    def step_back(j):  # tile j's part of the cotangents of `mid`; its state's stored
        _, pull = jax.vjp(_tile_step, *fresh(), *tied(j), *start(j))
        refs = (*_tiles(dM1, dM2, j, th), *_tiles(dS1, dS2, j, th))
        ends = tuple(_load(r, interpret) for r in (refs[0], refs[2], refs[1], refs[3]))  # W1', S1', W2', S2'
        *d_mid, dW1, dS1_, dW2, dS2_ = pull((d_rw, d_rs, d_rh, *ends))
        for r, g in zip((refs[0], refs[2], refs[1], refs[3]), (dW1, dS1_, dW2, dS2_)):
            _store(r, g, interpret)
        return tuple(d_mid)

    zero = lambda x: jnp.zeros(x.shape, x.dtype)
    init = (zero(q), zero(k), de, zero(qka), dc, ds, *map(zero, rest))
    dq, dk, de, dqka, dc, ds, *drest = _tile_loop(nt, step_back, init)
    dq2, dk2, dA2 = jax.vjp(_scores_weights, q, k, A)[1](dqka)
    # another start than the recomputation's (the same values): the two computations identical,
    # Triton merged them and kept a decay matrix's shared-memory copy from one to the other
    coefficients = functools.partial(_coefficients, start=first + k.shape[0])
    dk3, dtheta, deta, dalpha, dhh, dhsq, dw2 = jax.vjp(coefficients, k, theta, eta, alpha, hh, hsq, w2)[1](
        (dA + dA2, dc, ds, *drest))
    deh, dv = jax.vjp(_surprise, eh, v)[1](de)

    def sums_back(j):  # tile j's part of k's cotangent; its state's added
        W1, _, W2, _ = start(j)
        dk_j, dW1, dW2 = jax.vjp(_tile_sums, fresh()[1], W1, W2)[1]((dhh, dhsq, dw2, deh))
        for r, g in zip(_tiles(dM1, dM2, j, th), (dW1, dW2)):
            _store(r, _load(r, interpret) + g, interpret)
        return (dk_j,)

    (dk,) = _tile_loop(nt, sums_back, (dk + dk2 + dk3,))
    return dq + dq2, dk, dv, dtheta, deta, dalpha


def _forward_kernel(*refs, kind: str, chunk: int, n: int, interpret: bool):
    """One (row, head): every chunk in order. The state lives in the final-state outputs (global
    memory, L2-resident) between chunks, each matrix loaded where a stage uses it: not in the
    loop's carry, where its four MLP matrices took registers and shared memory for the whole
    chunk."""
    names = layers(kind)
    nl = len(names)
    inputs, refs = refs[:6], refs[6:]
    m_in, s_in, refs = refs[:nl], refs[nl:2 * nl], refs[2 * nl:]
    y_ref, refs = refs[0], refs[1:]
    m_out, s_out, m_start, s_start = (refs[j * nl:(j + 1) * nl] for j in range(4))
    state = dict(zip((f"{p}/{name}" for p in "MS" for name in names), (*m_out, *s_out)))
    for src, dst in zip((*m_in, *s_in), (*m_out, *s_out)):
        dst[...] = src[...].astype(jnp.float32)
    _sync(interpret)

    def body(i, carry):
        for src, dst in zip((*m_out, *s_out), (*m_start, *s_start)):  # the chunk-start state, if asked
            dst[tile(i, src.shape[0]), :] = src[...]
        t = tile(i, chunk)
        load = _chunk_input(inputs, t)
        if kind == "mlp":
            y_ref[t, :] = _forward_mlp(load, state, interpret, i * chunk)
            return carry
        env = {}

        def get(name):
            if name in load:
                return load[name]()
            return _load(state[name], interpret) if name in state else env[name]

        for fn, ins, outs in _stages():
            values = fn(*[get(x) for x in ins])
            if outs == ["y"]:
                y_ref[t, :] = values[0]
            elif outs[0].startswith("M'"):
                for name, value in zip(outs, values):
                    _store(state[name.replace("'", "")], value, interpret)
            else:
                env |= dict(zip(outs, values))
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _backward_kernel(*refs, kind: str, chunk: int, n: int, interpret: bool):
    """One (row, head): chunks in reverse; each recomputed from its saved start state and pulled
    back stage by stage (`jax.vjp` of each of `_stages`, latest first, the stage recomputed from
    its inputs), each state matrix loaded where a stage uses it. The state's cotangent lives in
    the initial-state cotangent outputs (global memory) between chunks and stages."""
    names = layers(kind)
    nl = len(names)
    inputs, refs = refs[:6], refs[6:]
    m_start, s_start, refs = refs[:nl], refs[nl:2 * nl], refs[2 * nl:]
    dy_ref, refs = refs[0], refs[1:]
    dm_in, ds_in, refs = refs[:nl], refs[nl:2 * nl], refs[2 * nl:]
    d_inputs, refs = refs[:6], refs[6:]
    dm_out, ds_out = refs[:nl], refs[nl:2 * nl]
    keys = [f"{p}/{name}" for p in "MS" for name in names]
    saved = dict(zip(keys, (*m_start, *s_start)))
    d_state = dict(zip(keys, (*dm_out, *ds_out)))
    for src, dst in zip((*dm_in, *ds_in), (*dm_out, *ds_out)):
        dst[...] = src[...]
    _sync(interpret)
    stages = _stages()
    # recomputed where used, not held from stage to stage (they took shared memory and registers):
    # the three terms of the reads [b, dv]
    again = {o: stage for stage in stages for o in stage[2] if o[:2] in ("rw", "rs", "sc")}

    def body(j, carry):
        i = n - 1 - j
        t = tile(i, chunk)
        load = _chunk_input(inputs, t)
        if kind == "mlp":
            fresh = lambda x: _load(inputs[_INPUTS.index(x)], interpret, t).astype(jnp.float32)
            grads = _backward_mlp(load, fresh, saved, d_state, dy_ref[t, :].astype(jnp.float32), i, interpret)
            for g, r in zip(grads, d_inputs):
                if len(r.shape) == 2:
                    r[t, :] = g
                else:
                    r[t] = g
            return carry
        env = {}

        def get(name):
            if name in load:
                return load[name]()
            if name in saved:
                r = saved[name]
                return _load(r, interpret, tile(i, r.shape[0] // n))
            if name in again:
                fn, ins, outs = again[name]
                return fn(*[get(x) for x in ins])[outs.index(name)]
            return env[name]

        for fn, ins, outs in stages:  # the intermediates the later stages take
            if outs != ["y"] and not outs[0].startswith("M'"):
                env |= dict(zip(outs, fn(*[get(x) for x in ins])))
        ct = {"y": dy_ref[t, :].astype(jnp.float32)}
        for fn, ins, outs in reversed(stages):
            end = outs[0].startswith("M'")  # the chunk's end state: its cotangent is in d_state
            out_ct = tuple(_load(d_state[o.replace("'", "")], interpret) if end else ct.pop(o) for o in outs)
            _, pull = jax.vjp(fn, *[get(x) for x in ins])
            for name, g in zip(ins, pull(out_ct)):
                if name in d_state:  # the chunk-start state's: the end state's first, then added
                    _store(d_state[name], g if end else _load(d_state[name], interpret) + g, interpret)
                else:
                    ct[name] = ct[name] + g if name in ct else g
        for name, r in zip(_INPUTS, d_inputs):
            if len(r.shape) == 2:
                r[t, :] = ct[name]
            else:
                r[t] = ct[name]
        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _spec(shape):
    """One (row, head)'s block of an array [B, H, ...]: the leading axes squeezed."""
    return pl.BlockSpec((None, None) + tuple(shape[2:]), lambda b, h: (b, h) + (0,) * (len(shape) - 2))


def _call(kernel, args, outs, kind: str, chunk: int, n: int, interpret: bool, state_size: int):
    """pallas_call of `kernel` over the (row, head) grid; `outs` are ShapeDtypeStructs;
    `state_size`: floats in one (row, head)'s M and S."""
    batch, heads = args[0].shape[:2]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        # 8 warps at the MLP memory's sizes: 256 threads x 255 registers is the whole register
        # file of an SM for the stages' [b, hidden] tensors (4 warps, half of it); untuned: no
        # GPU timing yet
        big = state_size > 4 * 64 * 64
        params["compiler_params"] = pltriton.CompilerParams(num_warps=8 if big else 4, num_stages=1)
    with _products(interpret):  # the kernel is traced here
        return pl.pallas_call(
            functools.partial(kernel, kind=kind, chunk=chunk, n=n, interpret=interpret),
            out_shape=outs, grid=(batch, heads),
            in_specs=[_spec(a.shape) for a in args], out_specs=[_spec(o.shape) for o in outs],
            interpret=interpret, name=f"memory_{kernel.__name__.strip('_')}", **params,
        )(*args)


def _leaves(state: dict, kind: str) -> list:
    return [state["M"][n] for n in layers(kind)] + [state["S"][n] for n in layers(kind)]


def _unleaves(leaves: list, kind: str) -> dict:
    names = layers(kind)
    return {"M": dict(zip(names, leaves[:len(names)])), "S": dict(zip(names, leaves[len(names):]))}


def _saved_shape(x, n: int):
    """A state leaf [B, H, rows, cols] saved for every chunk: [B, H, n * rows, cols]."""
    return jax.ShapeDtypeStruct((*x.shape[:2], n * x.shape[2], x.shape[3]), jnp.float32)


def _forward(state, xs, kind: str, chunk: int, interpret: bool, save: bool = True):
    """(y, final state, chunk-start states: leaves [B, H, n * rows, cols], none unless `save`)."""
    q, v = xs[0], xs[2]
    n = q.shape[2] // chunk
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    leaves = _leaves(state, kind)
    outs = [f32(v.shape)] + [f32(x.shape) for x in leaves]
    if save:  # the kernel writes what `outs` has room for
        outs += [_saved_shape(x, n) for x in leaves]
    size = sum(math.prod(x.shape[2:]) for x in leaves)
    res = _call(_forward_kernel, [*xs, *leaves], outs, kind, chunk, n, interpret, size)
    nl = len(leaves)
    return res[0], _unleaves(res[1:1 + nl], kind), res[1 + nl:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fused(state, xs, kind, chunk, interpret, backward):
    # no gradient will be taken (evaluation, generation): no chunk-start states to write
    y, final, _ = _forward(state, xs, kind, chunk, interpret, save=False)
    return y, final


def _fused_fwd(state, xs, kind, chunk, interpret, backward):
    y, final, starts = _forward(state, xs, kind, chunk, interpret)
    return (y, final), (xs, starts)


def _fused_bwd(kind, chunk, interpret, backward, res, cotangents):
    xs, starts = res
    dy, dfinal = cotangents
    pull = _backward_pallas if backward == "pallas" else _backward_scan
    d_leaves, grads = pull(xs, starts, dy.astype(jnp.float32), [x.astype(jnp.float32) for x in _leaves(dfinal, kind)],
                           kind, chunk, interpret)
    return _unleaves(list(d_leaves), kind), tuple(g.astype(x.dtype) for g, x in zip(grads, xs))


def _backward_pallas(xs, starts, dy, d_leaves, kind, chunk, interpret):
    """The backward kernel: (cotangents of the initial state's leaves, of xs), float32."""
    n = xs[0].shape[2] // chunk
    f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
    outs = [f32(x) for x in xs] + [f32(x) for x in d_leaves]
    size = sum(math.prod(x.shape[2:]) for x in d_leaves)
    res = _call(_backward_kernel, [*xs, *starts, dy, *d_leaves], outs, kind, chunk, n, interpret, size)
    return res[len(xs):], res[:len(xs)]


def _backward_scan(xs, starts, dy, d_leaves, kind, chunk, interpret):
    """The same cotangents from a reverse `lax.scan` of `chunk_math`'s vjp (vmapped over rows and
    heads) from the saved chunk-start states: XLA kernels per chunk, as `memory_forward`'s remat
    backward. The fallback if the backward kernel does not compile or pay on some GPU."""
    n = xs[0].shape[2] // chunk
    split = lambda x, rows: jnp.moveaxis(x.reshape(*x.shape[:2], n, rows, *x.shape[3:]), 2, 0)  # [n, B, H, rows, ...]
    starts = [split(x, x.shape[2] // n) for x in starts]
    step = jax.vmap(jax.vmap(functools.partial(chunk_math, kind=kind)))

    def body(carry, inp):
        leaves, x, d_y = inp
        state = _unleaves(list(leaves), kind)
        _, pull = jax.vjp(step, state["M"], state["S"], *x)
        dM, dS, *grads = pull((*_unleaves(list(carry), kind).values(), d_y))
        return _leaves({"M": dM, "S": dS}, kind), grads

    inputs = [split(x.astype(jnp.float32), chunk) for x in xs]
    d_state, grads = jax.lax.scan(body, list(d_leaves), (starts, inputs, split(dy, chunk)), reverse=True)
    return d_state, [jnp.moveaxis(g, 0, 2).reshape(x.shape) for g, x in zip(grads, xs)]


_fused.defvjp(_fused_fwd, _fused_bwd)


def memory_kernel(state: dict, q, k, v, theta, eta, alpha, *, kind: str, chunk: int, interpret: bool | None = None,
                  backward: str = "pallas"):
    """`memory.memory_forward` as fused kernels: (y [B, H, T, dv] float32, final state).
    `interpret`: run the kernels as plain JAX (any backend, slow); None: on all but GPUs.
    `backward`: pallas (the backward kernel) or scan (`_backward_scan`, after the same forward)."""
    t = q.shape[2]
    if t % chunk:
        raise ValueError(f"sequence length {t} is not a multiple of the memory chunk {chunk}")
    if backward not in ("pallas", "scan"):
        raise ValueError(f"backward must be pallas or scan, got {backward!r}")
    if interpret is None:
        interpret = platform.backend() != "gpu"
    state = jax.tree.map(lambda x: x.astype(jnp.float32), state)
    return _fused(state, (q, k, v, theta, eta, alpha), kind, chunk, interpret, backward)
