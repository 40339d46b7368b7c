"""Causal sliding-window flash attention as Pallas kernels (`model.nl_lm.attention=pallas`): what
`layers.local_attention` (the blocked form) computes, q, k, v [B, T, H, hd] -> [B, T, H, hd],
logits scaled by hd ** -0.5, token t seeing t - window + 1 .. t, without any [T, T] or
[T, window] score matrix in memory.

Why: cuDNN's fused attention refuses float32 and head widths above 128 (`attention.cudnn_refusal`);
there the blocked form keeps its float32 scores [T / window, window, 2 * window] for the
backward pass. This kernel keeps only the output and the log-sum-exp [B, H, T].

Adapted from jax's reference (jax/experimental/pallas/ops/gpu/attention.py, `mha` with
`causal=True`), the window's lower bound added to every loop:

- Forward (grid B x H x T / block_q): one query tile, an online softmax (float32 running max,
  sum and output) over only the key tiles its window touches, tiles floor(max(q0 - window + 1,
  0) / block_k) .. floor((q0 + block_q - 1) / block_k): cost O(T * (window + block)), not O(T^2).
  Stores the output and the log-sum-exp.
- Backward, flash-attention-2 style, as two kernels: `_dkv_kernel` (grid over key tiles, each
  looping over the query tiles that see it: k0 / block_q .. (k0 + block_k - 1 + window - 1) /
  block_q) and `_dq_kernel` (grid over query tiles, the forward's loop). Both recompute the
  probabilities from the saved log-sum-exp; delta = rowsum(o * dO) is one fused XLA op. Two
  kernels rather than jax's one fused kernel: the same arithmetic (the fused kernel also
  recomputes the probabilities in each half), each grid the shape of what it writes, so the
  query and key tiles need not split T into equally many blocks; one extra launch per layer.
- `flash_attention` ties them with `jax.custom_vjp`; it pads T up to a multiple of the tiles
  (the padded keys lie after every real query, so no real query sees them; the padded queries'
  cotangents are zero) and slices the result.

Tiles are powers of two (Triton's tensors), at least 16 on a GPU (its matrix products): the
requested `block_q` and `block_k` (default 64) are clamped to T and, for keys, to the window
(a window of 8 reads 16-key tiles, not 64), never below 16. Each kernel may take its own tiles,
warps and pipeline stages, and split its loop so that only the tiles at the window's edges are
masked (`Tuning`, one `Tiles` per kernel; `benchmarks/attention_tiles.py` times them on a GPU);
the default is jax's reference's choice for every kernel, one masked loop. Inputs may be
float32, bfloat16 or float16; scores, softmax statistics and accumulators are float32, and the probabilities
meet v (and the score gradients meet q and k) in the inputs' dtype, as in the blocked form.
On a GPU, float32 inputs meet in TF32 matrix products (Triton's default, as XLA's default
precision is there; `jax.default_matmul_precision` does not reach inside the kernel).
`gpu_unsupported` says which shapes the compiled kernel cannot take; on a CPU the kernels run in
interpret mode (any head width, slow: for tests and for checking a run).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from nljax.models import platform
from nljax.models.tiles import dot, dot_t, t_dot, tile

MIN_TILE = 16  # Triton's smallest matrix-product dimension
# A finite mask: a query tile's first key tile may hold no key that some of its rows see; with
# -inf their running max would be -inf and exp(s - max) NaN. Corrected away (factor exp(NEG -
# real max) = 0) once the row meets a key it sees, and every row sees itself.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def gpu_unsupported(dtype, head_dim: int) -> str | None:
    """Why the compiled (Triton) kernel cannot take q, k, v of `dtype` with heads of `head_dim`,
    or None when it can. T and the window may be anything (T is padded to the tiles)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Pallas attention kernel takes float32, bfloat16 or float16 inputs, not {jnp.dtype(dtype).name}"
    if head_dim < MIN_TILE or head_dim & (head_dim - 1):
        return (f"the Pallas attention kernel needs a head width that is a power of two >= {MIN_TILE} on a GPU, "
                f"not {head_dim} (model.dim / model.heads)")
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tiles(t: int, window: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(query tile, key tile, padded T): the requested tiles clamped to T (keys: and to the
    window), never below MIN_TILE by clamping; T padded to a multiple of both."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two, got {b}")
    bq = min(block_q, max(MIN_TILE, _pow2_at_least(t)))
    bk = min(block_k, max(MIN_TILE, _pow2_at_least(min(t, window))))
    step = max(bq, bk)  # powers of two: a multiple of the larger is one of both
    return bq, bk, -(-t // step) * step


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel's launch: its query and key tiles (tokens, powers of two; the forward and dQ
    kernels' grid walks query tiles and their loops key tiles, the dK/dV kernel's the other way
    round), Triton's warps (0: 4 for heads up to 64 wide, else 8) and pipeline stages, and
    `split`: the loop in three, the window's mask computed on its edge tiles only (as
    FlashAttention masks only the causal diagonal; at a window of 512 in 64-token tiles, 2 of
    a query tile's 9 key tiles)."""

    block_q: int = 64
    block_k: int = 64
    warps: int = 0
    stages: int = 2
    split: bool = False

    def __str__(self) -> str:
        split = " split" if self.split else ""
        return f"q{self.block_q} k{self.block_k} w{self.warps or 'auto'} s{self.stages}{split}"

    def resolved(self, t: int, window: int, head_dim: int) -> "Tiles":
        """The tiles clamped as `tiles` clamps them, the warps chosen."""
        bq, bk, _ = tiles(t, window, self.block_q, self.block_k)
        return Tiles(bq, bk, self.warps or (4 if head_dim <= 64 else 8), self.stages, self.split)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The three kernels' launches (`Tiles`): forward, dK/dV and dQ."""

    forward: Tiles = Tiles()
    dkv: Tiles = Tiles()
    dq: Tiles = Tiles()

    @classmethod
    def uniform(cls, block_q: int = 64, block_k: int = 64) -> "Tuning":
        return cls(*(Tiles(block_q, block_k),) * 3)

    def resolved(self, t: int, window: int, head_dim: int) -> tuple["Tuning", int]:
        """(every kernel's tiles clamped as `tiles` clamps them and its warps chosen, T padded to a
        multiple of every tile)."""
        out = {f.name: getattr(self, f.name).resolved(t, window, head_dim) for f in dataclasses.fields(self)}
        step = max(max(k.block_q, k.block_k) for k in out.values())  # powers of two: a multiple of all
        return Tuning(**out), -(-t // step) * step


def _scores(q, k, q0, k0, window: int, masked: bool = True):
    """Scaled logits of a query tile starting at q0 against a key tile starting at k0, float32
    [bq, bk], NEG where the key lies outside the query's window (`masked`: a tile some of whose
    keys some query does not see; unmasked, one every query sees whole)."""
    s = dot_t(q, k) * q.shape[1] ** -0.5
    if not masked:
        return s
    back = (q0 + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], k.shape[0]), 0)) - (
        k0 + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], k.shape[0]), 1))  # query - key position
    return jnp.where((back >= 0) & (back < window), s, NEG)


def _key_tiles(q0, bq: int, bk: int, window: int):
    """The key tiles that queries q0 .. q0 + bq - 1 see, [lo, hi), and [a, b): those each of them
    sees whole (keys j * bk .. j * bk + bk - 1 within q - window + 1 .. q for every q; may be empty)."""
    lo = jax.lax.div(jnp.maximum(q0 - window + 1, 0), bk)
    a = jax.lax.div(jnp.maximum(q0 + bq - window, 0) + bk - 1, bk)  # first key within the last query's window
    return lo, jax.lax.div(q0 + bq + bk - 1, bk), a, jax.lax.div(q0 + 1, bk)  # last key <= the first query


def _query_tiles(k0, bq: int, bk: int, window: int, n: int):
    """The query tiles (of `n`) that see some of keys k0 .. k0 + bk - 1, [lo, hi), and [a, b): those
    each of whose queries sees every one of them (may be empty): the dK/dV kernel's loop."""
    lo = jax.lax.div(k0, bq)
    hi = jnp.minimum(jax.lax.div(k0 + bk - 1 + window - 1 + bq, bq), n)
    # the first query at or after the last key, the last query within the window of the first key
    return lo, hi, jax.lax.div(k0 + bk - 1 + bq - 1, bq), jax.lax.div(k0 + window, bq)


def _loops(body, lo, hi, a, b, split: bool, carry):
    """`body(j, carry, masked)` over tiles lo .. hi - 1 in order: masked throughout, or (`split`)
    without the mask on the tiles [a, b) that every query sees whole (the same values: the mask
    there keeps every score) and with it on the edges before and after."""
    if not split:
        return jax.lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    a = jnp.clip(a, lo, hi)
    b = jnp.clip(b, a, hi)
    for start, stop, masked in ((lo, a, True), (a, b, False), (b, hi, True)):
        carry = jax.lax.fori_loop(start, stop, functools.partial(body, masked=masked), carry)
    return carry


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, window: int, bk: int, split: bool):
    """One query tile of one (row, head): online softmax over the key tiles its window touches.
    q_ref [bq, hd]; k_ref, v_ref [T, hd] (the whole sequence); o_ref [bq, hd]; lse_ref [bq]."""
    bq, hd = q_ref.shape
    q0 = pl.program_id(2) * bq
    q = q_ref[...]

    def body(j, carry, masked):
        acc, m, l = carry  # [bq, hd], running max [bq], running sum [bq]
        s = _scores(q, k_ref[tile(j, bk), :], q0, j * bk, window, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        fix = jnp.exp(m - m_new)  # rescales what was summed under the old max
        v = v_ref[tile(j, bk), :]
        return fix[:, None] * acc + dot(p.astype(v.dtype), v), m_new, fix * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, hd), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = _loops(body, *_key_tiles(q0, bq, bk, window), split, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, window: int, bq: int,
                split: bool):
    """dK, dV of one key tile: over the query tiles that see it. q_ref, do_ref [T, hd],
    lse_ref, delta_ref [T] (whole sequence); k_ref, v_ref, dk_ref, dv_ref [bk, hd]."""
    bk, hd = k_ref.shape
    k0 = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]

    def body(i, carry, masked):
        dk, dv = carry
        rows = tile(i, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        p = jnp.exp(_scores(q, k, i * bq, k0, window, masked) - lse_ref[rows][:, None])  # [bq, bk]
        ds = p * (dot_t(do, v) - delta_ref[rows][:, None]) * hd**-0.5  # d(scaled logits)
        return dk + t_dot(ds.astype(q.dtype), q), dv + t_dot(p.astype(do.dtype), do)

    zeros = jnp.zeros((bk, hd), jnp.float32)
    dk, dv = _loops(body, *_query_tiles(k0, bq, bk, window, q_ref.shape[0] // bq), split, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, window: int, bk: int, split: bool):
    """dQ of one query tile: over the key tiles it sees (the forward's loop). q_ref, do_ref,
    dq_ref [bq, hd], lse_ref, delta_ref [bq]; k_ref, v_ref [T, hd] (whole sequence)."""
    bq, hd = q_ref.shape
    q0 = pl.program_id(2) * bq
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq, masked):
        k, v = k_ref[tile(j, bk), :], v_ref[tile(j, bk), :]
        p = jnp.exp(_scores(q, k, q0, j * bk, window, masked) - lse[:, None])
        ds = p * (dot_t(do, v) - delta[:, None]) * hd**-0.5
        return dq + dot(ds.astype(k.dtype), k)

    dq = _loops(body, *_key_tiles(q0, bq, bk, window), split, jnp.zeros((bq, hd), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _tile_spec(t: int, hd: int | None):
    """One (row, head)'s tile i of `t` rows of an array [B, T, H, hd] (hd None: of one [B, H, T])."""
    if hd is None:
        return pl.BlockSpec((None, None, t), lambda b, h, i: (b, h, i))
    return pl.BlockSpec((None, t, None, hd), lambda b, h, i: (b, i, h, 0))


def _whole_spec(t: int, hd: int | None):
    """One (row, head)'s whole sequence, whatever the tile."""
    if hd is None:
        return pl.BlockSpec((None, None, t), lambda b, h, i: (b, h, 0))
    return pl.BlockSpec((None, t, None, hd), lambda b, h, i: (b, 0, h, 0))


def _call(kernel, args, specs, outs, out_specs, tiles_: int, launch: Tiles, interpret: bool, name: str):
    b, t, h, _ = args[0].shape
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        params["compiler_params"] = pltriton.CompilerParams(num_warps=launch.warps, num_stages=launch.stages)
    return pl.pallas_call(kernel, out_shape=outs, grid=(b, h, t // tiles_), in_specs=specs, out_specs=out_specs,
                          interpret=interpret, name=name, **params)(*args)


def _forward(q, k, v, window, launch: Tiles, interpret):
    """(y [B, T, H, hd], lse [B, H, T] float32) for T a multiple of the tiles."""
    b, t, h, hd = q.shape
    bq = launch.block_q
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)]
    return _call(functools.partial(_forward_kernel, window=window, bk=launch.block_k, split=launch.split), [q, k, v],
                 [_tile_spec(bq, hd), _whole_spec(t, hd), _whole_spec(t, hd)], outs,
                 [_tile_spec(bq, hd), _tile_spec(bq, None)], bq, launch, interpret, "attention_forward")


def backward_delta(y, dy):
    """rowsum(o * dO) [B, H, T] float32: what both backward kernels subtract (one fused XLA op)."""
    return jnp.einsum("bthd,bthd->bht", y.astype(jnp.float32), dy.astype(jnp.float32))


def _dkv(q, k, v, dy, lse, delta, window, launch: Tiles, interpret):
    """(dK, dV) by the dK/dV kernel: its grid over key tiles, its loop over query tiles."""
    t, hd = q.shape[1], q.shape[3]
    bk, whole = launch.block_k, _whole_spec(t, hd)
    kernel = functools.partial(_dkv_kernel, window=window, bq=launch.block_q, split=launch.split)
    return _call(kernel, [q, k, v, dy, lse, delta],
                 [whole, _tile_spec(bk, hd), _tile_spec(bk, hd), whole, *[_whole_spec(t, None)] * 2],
                 [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                 [_tile_spec(bk, hd)] * 2, bk, launch, interpret, "attention_dkv")


def _dq(q, k, v, dy, lse, delta, window, launch: Tiles, interpret):
    """dQ by the dQ kernel: its grid over query tiles, its loop over key tiles (the forward's)."""
    t, hd = q.shape[1], q.shape[3]
    bq, whole = launch.block_q, _whole_spec(t, hd)
    kernel = functools.partial(_dq_kernel, window=window, bk=launch.block_k, split=launch.split)
    return _call(kernel, [q, k, v, dy, lse, delta],
                 [_tile_spec(bq, hd), whole, whole, _tile_spec(bq, hd), *[_tile_spec(bq, None)] * 2],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype)], [_tile_spec(bq, hd)], bq, launch, interpret,
                 "attention_dq")[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, window, tuning: Tuning, interpret):
    return _forward(q, k, v, window, tuning.forward, interpret)[0]


def _flash_fwd(q, k, v, window, tuning, interpret):
    y, lse = _forward(q, k, v, window, tuning.forward, interpret)
    return y, (q, k, v, y, lse)


def _flash_bwd(window, tuning, interpret, res, dy):
    q, k, v, y, lse = res
    dy = dy.astype(q.dtype)
    args = (q, k, v, dy, lse, backward_delta(y, dy), window)
    dk, dv = _dkv(*args, tuning.dkv, interpret)
    return _dq(*args, tuning.dq, interpret), dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)


def prepare(q, window: int, tuning: Tuning, interpret: bool | None):
    """(pad: [B, T, ...] -> [B, padded T, ...], the tuning resolved for q's shape, interpret)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    tuning, tp = tuning.resolved(q.shape[1], window, q.shape[3])
    if interpret is None:
        interpret = platform.backend() != "gpu"
    for f in dataclasses.fields(tuning):
        k = getattr(tuning, f.name)
        if not interpret and min(k.block_q, k.block_k) < MIN_TILE:
            raise ValueError(f"{f.name} tiles {k.block_q} x {k.block_k}: the compiled kernel needs tiles >= {MIN_TILE}")
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, 0))) if tp > x.shape[1] else x
    return pad, tuning, interpret


def flash_attention(q, k, v, window: int, *, block_q: int = 64, block_k: int = 64, tuning: Tuning | None = None,
                    interpret: bool | None = None):
    """Causal sliding-window attention, q, k, v [B, T, H, hd] -> [B, T, H, hd] (the blocked
    form's semantics), differentiable (hand-written backward kernels). Tiles: `block_q` and
    `block_k` for every kernel, or `tuning`'s per kernel. `interpret`: run the kernels as plain
    JAX (any backend, slow); None: on all but GPUs."""
    pad, tuning, interpret = prepare(q, window, tuning or Tuning.uniform(block_q, block_k), interpret)
    return _flash(pad(q), pad(k), pad(v), window, tuning, interpret)[:, :q.shape[1]]


def flash_forward(q, k, v, window: int, *, block_q: int = 64, block_k: int = 64, tuning: Tuning | None = None,
                  interpret: bool | None = None):
    """The forward kernel alone: (y [B, T, H, hd], log-sum-exp of each query's scaled logits
    over its window [B, H, T], float32), what the backward pass starts from. Not differentiable."""
    pad, tuning, interpret = prepare(q, window, tuning or Tuning.uniform(block_q, block_k), interpret)
    y, lse = _forward(pad(q), pad(k), pad(v), window, tuning.forward, interpret)
    return y[:, :q.shape[1]], lse[:, :, :q.shape[1]]
