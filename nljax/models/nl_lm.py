"""The nested-learning language model.

Token embedding; N pre-norm blocks of [causal sliding-window attention with rotary positions →
neural memory (the inner loop; only in `model.nl_lm.memory_layers`; it reads the block's
normalised stream plus, with `model.nl_lm.memory_embed` (the default), the normalised token
embeddings) → CMS MLP chain of k levels]; output head.

State lifetimes:
- outer-loop parameters (everything below, including the memory's initial value `memory0`) are
  synchronized by the engine; CMS level l is the `cms<l>` MLP of every block, the rest is level 0;
- the inner-loop state (memory M and momentum S of each memory layer) belongs to one stream
  row: it arrives as that row's ContextMemory from the previous step, is reset to `memory0` when
  the row crossed a document boundary, and leaves as the next step's. The engine keeps it in an
  array split over the data axes and stops gradients at step boundaries.

Attention sees the current step's window of `train.seq_len` tokens only (no cache across steps),
`model.nl_lm.window` of them back; what lies further back reaches a token through the memory.

`model.nl_lm.scan_layers` runs the blocks as a `lax.scan` over their repeating unit (`Unit`,
parameters stacked per unit): the same function, one compiled unit, and, with block remat, a
backward pass that holds one unit's activations at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

import nljax.models.memory as nm
import nljax.models.memory_forms as forms
from nljax.errors import ConfigError
from nljax.models.base import HIDDEN, cms_level_of, tp_divides
from nljax.models.attention import sliding_window_attention
from nljax.models.chunked_loss import chunked_token_loss
from nljax.models.embedding import Embed
from nljax.models.layers import CMSChain, LayerNorm, dense, dense_dot, recomputed, token_loss
from nljax.parallel import tp as tplib


@dataclasses.dataclass(frozen=True)
class NlLmConfig:
    """Config section `model.nl_lm`: the attention window and the neural memory. The shared
    `model.vocab_size`, `dim`, `depth`, `heads`, `hidden_mult`, `dtype` and `remat` apply too."""

    window: int = 64  # sliding-window attention: tokens each token sees, itself included
    # 0-based block indices that carry a neural memory; in the first block the default job's
    # held-out loss is lowest, in the second the recall probe's accuracy highest
    # (docs/experiments/2026-11-27-where-the-memory-goes.md)
    memory_layers: tuple[int, ...] = (0,)
    # linear: better on held-out text than mlp, and cheaper (docs/experiments/2026-11-27-does-the-memory-help.md)
    memory_kind: Literal["linear", "mlp"] = "linear"
    memory_heads: int = 4  # heads of each neural memory, each with its own state
    memory_dim: int = 32  # per-head key/value width of the memory
    memory_hidden: int = 64  # hidden width of the 2-layer MLP memory
    memory_chunk: int = 16  # mini-batch b of the chunk-parallel inner loop
    # largest inner-loop step theta, in units of the inner problem's curvature bound; <= 1
    # keeps every chunk's step inside it (stability argument: nljax/models/memory.py)
    memory_lr_max: float = 1.0
    # causal depthwise conv + SiLU on the memory's q, k, v (kernel size, at most train.seq_len); 0: off
    memory_conv: int = 4
    memory_out_norm: bool = True  # RMS-normalise each memory head's read
    memory_out_gate: bool = True  # gate the read with sigmoid(W x)
    memory_unroll: int = 1  # inner-loop chunks per loop iteration (larger: fewer, fused kernels; longer compile)
    # the inner loop: a lax.scan over chunks (scan); a scan that carries the end states alone,
    # then the chunks' reads batched, in groups of chunks at large batch (parallel: at most half
    # the remat scan's products per sequential chunk, more in all; x0.906 the scan's step in
    # nl_350m on an H200, 1.01-1.03x on a CPU); or fused Pallas kernels, one launch per layer
    # for all chunks (pallas: experimental, 3.1-3.6x slower than the scan on an H200;
    # parallel_pallas: the parallel form's loop of end states as one such kernel, the reads
    # XLA's, 1.4-1.5x slower than the scan on an H200; on a CPU both run in interpret mode:
    # slow, for checking); auto: the parallel form on a GPU, the scan elsewhere
    # (docs/concepts/memory-kernel.md)
    memory_impl: Literal["auto", "scan", "parallel", "pallas", "parallel_pallas"] = "auto"
    # the memory reads its block's normalised stream plus the normalised token embeddings: a
    # memory after the first block then learns the recall probe
    # (docs/experiments/2026-11-27-where-the-memory-goes.md)
    memory_embed: bool = True
    # lax.scan over the repeating unit of blocks (the shortest run of blocks whose memory pattern
    # repeats: memory_layers [4, 9, 14, 19] of 20 blocks -> 4 units of 5): one compiled unit, and
    # with model.remat=block a backward pass that holds one unit's activations, not all of them.
    # The same function, of parameters stacked per unit and drawn otherwise at init: the same seed
    # trains to other losses, and a checkpoint resumes only with the setting it was saved with
    scan_layers: bool = False
    # sliding-window attention's form: blocked (queries in blocks of `window`, scores kept in
    # float32; any backend) | cudnn (cuDNN's fused flash attention: CUDA GPUs, bfloat16/float16,
    # head width a multiple of 8 and <= 128) | pallas (a Pallas flash attention: GPUs, head width
    # a power of two >= 16, float32/bfloat16/float16; on a CPU in interpret mode: slow, for checking) |
    # auto (on a CUDA GPU pallas where it runs, else cudnn where it runs, else blocked; always
    # blocked on a CPU). Same outputs and gradients (nljax/models/attention.py)
    attention: Literal["auto", "blocked", "cudnn", "pallas"] = "auto"
    # the token embedding's backward pass: scatter (autodiff's scatter-add) | onehot (a one-hot
    # matmul, float32 sums; small vocabularies) | segment (sorted segment sum) | auto (scatter on
    # a CPU, onehot elsewhere for vocabularies <= 4096). Same gradient (nljax/models/embedding.py)
    embed_grad: Literal["auto", "scatter", "onehot", "segment"] = "auto"
    # training loss over chunks of this many tokens (head matmul + float32 log-softmax per chunk,
    # recomputed in the backward pass) so that no full [B, T, vocab] float32 logits are held;
    # 0: the whole batch at once (nljax/models/chunked_loss.py)
    loss_chunk: int = 0

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader
    RANGES: ClassVar[dict] = {"memory_lr_max": (0, 1, False, True)}

    def check(self) -> None:
        for key in ("window", "memory_heads", "memory_dim", "memory_hidden", "memory_chunk", "memory_unroll"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.nl_lm.{key} must be >= 1, got {getattr(self, key)}")
        if self.loss_chunk < 0:
            raise ConfigError(f"model.nl_lm.loss_chunk must be >= 0 (0: off), got {self.loss_chunk}")
        if self.window >= 2**31:  # the attention mask compares token distances with it as an int32 on the devices
            raise ConfigError(f"model.nl_lm.window must be < 2^31, got {self.window:,}")

    def check_with(self, dim: int, heads: int, depth: int) -> None:
        """Rules that apply when model.name=nl_lm, with the shared model fields."""
        if dim % heads or (dim // heads) % 2:
            raise ConfigError(f"model.dim={dim} must split into model.heads={heads} heads of even width")
        bad = [i for i in self.memory_layers if not 0 <= i < depth]
        if bad:
            raise ConfigError(f"model.nl_lm.memory_layers {bad} out of range for model.depth={depth}")
        if self.memory_conv < 0:
            raise ConfigError(f"model.nl_lm.memory_conv must be >= 0, got {self.memory_conv}")
        if self.scan_layers and unit_size(depth, self.memory_layers) == depth and depth > 1:
            raise ConfigError(
                f"model.nl_lm.scan_layers needs blocks that repeat: memory_layers={list(self.memory_layers)} "
                f"of depth {depth} have no repeating unit shorter than the whole net"
            )


def rotary(x, base: float = 10000.0):
    """Rotary position embedding over the last axis.  x [B, T, H, hd]."""
    t, hd = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, hd // 2, dtype=jnp.float32) / (hd // 2))  # [hd/2]
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs  # [T, hd/2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    """Multi-head attention; under tensor parallelism each shard holds `heads / tp` of the heads
    (qkv column-parallel, out row-parallel)."""

    dim: int
    heads: int
    window: int
    dtype: jnp.dtype = jnp.float32
    tp: int = 1
    axis: str | None = None
    recompute: bool = False  # the scores and softmax recomputed in the backward pass, not kept (blocked form)
    impl: str = "blocked"  # blocked | cudnn | pallas (nljax/models/attention.py; model.nl_lm.attention resolved)

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        b, t, _ = x.shape
        h, hd = self.heads // self.tp, self.dim // self.heads
        # kernel [D, 3, H, hd]: the head axis stands alone, so a shard is a contiguous block of it
        qkv = nn.DenseGeneral((3, h, hd), use_bias=False, dtype=self.dtype, dot_general=dense_dot, name="qkv")(tplib.enter(x, self.axis))
        q, k, v = rotary(qkv[:, :, 0]), rotary(qkv[:, :, 1]), qkv[:, :, 2]  # [B, T, h, hd]
        y = sliding_window_attention(q, k, v, self.window, self.impl, self.recompute)
        # Zero-init output, as the memory's and the CMS MLPs': every block starts as the identity
        # (the token embeddings, rms 1/sqrt(dim), are not drowned by a random mix of them: the
        # default job's held-out loss 0.2 bits per byte lower:
        # docs/experiments/2026-11-27-where-the-memory-goes.md)
        out = nn.Dense(self.dim, use_bias=False, kernel_init=nn.initializers.zeros, dtype=self.dtype,
                       dot_general=dense_dot, name="out")
        y = out(y.reshape(b, t, h * hd))
        return tplib.leave(y, self.axis)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _flat_init(init, n_lead: int):
    """`init` applied to the shape with every axis after the first `n_lead` flattened into one,
    reshaped back: the values a flat layer of the same size would start from."""
    def fn(key, shape, dtype=jnp.float32):
        return init(key, (*shape[:n_lead], math.prod(shape[n_lead:])), dtype).reshape(shape)
    return fn


class CausalConv(nn.Module):
    """Causal depthwise convolution over tokens: y_t = sum_j w_j x_{t-K+1+j} + b, per channel.
    Kernel [K, *channels] (channels [3, H, dk]: splits by head); starts as a flat depthwise
    `nn.Conv` of the same size would."""

    size: int

    @nn.compact
    def __call__(self, x):  # [B, T, *channels]
        ch = x.shape[2:]
        w = self.param("kernel", _flat_init(nn.initializers.lecun_normal(), 1), (self.size, *ch))
        bias = self.param("bias", nn.initializers.zeros, ch)
        # bfloat16 inputs: the products and sums in float32 (the parameters' dtype), rounded once,
        # so that the kernel's and bias's gradients (sums over every token) are summed in float32,
        # not bfloat16 (in bfloat16, 4096 tokens put the kernel's 2.2% and the bias's 0.64% from
        # the exact sums); float32 inputs: no-ops
        dtype, x = x.dtype, x.astype(w.dtype)
        t, k = x.shape[1], self.size
        xp = jnp.pad(x, ((0, 0), (k - 1, 0)) + ((0, 0),) * len(ch))
        return (sum(xp[:, j : j + t] * w[j] for j in range(k)) + bias).astype(dtype)


class HeadNorm(nn.Module):
    """RMS norm of each head's read over its last axis (`nn.RMSNorm`'s arithmetic), one scale
    shared by all heads: a replicated parameter inside a split region, so its gradient is summed
    over the tensor-parallel shards (`tp.enter`)."""

    axis: str | None = None

    @nn.compact
    def __call__(self, y):  # [..., dk] float32
        scale = tplib.enter(self.param("scale", nn.initializers.ones, (y.shape[-1],)), self.axis)
        return y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + 1e-6) * scale


class NeuralMemory(nn.Module):
    """Per-head associative memory written by gradient descent during the forward pass
    (the inner loop and why it is stable: `nljax.models.memory`)."""

    dim: int
    heads: int
    dk: int
    hidden: int
    kind: str
    chunk: int
    lr_max: float = 1.0  # theta in (0, lr_max]; <= 1 keeps each chunk inside its curvature bound
    conv: int = 4  # causal depthwise convolution + SiLU on q, k, v over this many tokens; 0: off
    out_norm: bool = True  # RMS-normalise each head's read
    out_gate: bool = True  # and scale it by a sigmoid gate of the block's input
    dtype: jnp.dtype = jnp.float32  # of the projections; the inner loop always runs in float32
    remat: bool = False  # recompute each chunk's internals (memory.memory_forward) and the conv in the backward pass
    unroll: int = 1  # chunks per loop iteration of the inner loop
    impl: str = "auto"  # auto | scan | parallel | pallas | parallel_pallas: the inner loop's implementation (memory_forms.inner_loop)
    tp: int = 1  # tensor-parallel shards: each holds heads / tp memory heads, their state and weights
    axis: str | None = None

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    def memory0_shapes(self) -> dict:
        h, d = self.local_heads, self.dk
        if self.kind == "linear":
            return {"W": (h, d, d)}
        return {"W1": (h, d, self.hidden), "W2": (h, self.hidden, d)}

    def memory0(self) -> dict:
        # Keys are unit vectors, so W1 ~ N(0, 1) gives O(1) hidden pre-activations; the output
        # layer (or the linear memory) starts at zero: a fresh memory reads nothing.
        inits = {"W": nn.initializers.zeros, "W1": nn.initializers.normal(1.0), "W2": nn.initializers.zeros}
        return {n: self.param(f"memory0_{n}", inits[n], shape) for n, shape in self.memory0_shapes().items()}

    def qkv(self, x):  # x [B, T, D] -> q, k, v [B, H, T, dk], unit norm
        h, d = self.local_heads, self.dk
        y = nn.DenseGeneral((3, h, d), use_bias=False, dtype=self.dtype, dot_general=dense_dot, name="qkv")(x)  # [B, T, 3, H, dk]
        if self.conv:
            # short causal mixing of neighbouring tokens before they are written (Titans §4.4)
            y = recomputed(jax.nn.silu, self.remat)(recomputed(CausalConv, self.remat)(self.conv, name="conv")(y))
        # float32 from here: the inner loop's state, gates and normalisers (see memory.py)
        y = y.astype(jnp.float32).transpose(2, 0, 3, 1, 4)  # [3, B, H, T, dk]
        return _l2norm(y[0]), _l2norm(y[1]), _l2norm(y[2])

    @nn.compact
    def __call__(self, x, state, reset):  # x [B, T, D], state leaves [B, H, ...], reset [B]
        b, t, _ = x.shape
        h, d = self.local_heads, self.dk
        x = tplib.enter(x, self.axis)  # a split region: q, k, v, gates and the state are per head
        q, k, v = self.qkv(x)
        # Step size in (0, lr_max], momentum and forgetting in (0, 1); forgetting starts slow so
        # that the memory can hold context well beyond one window.
        gate_bias = lambda key, shape, dtype=jnp.float32: jnp.tile(jnp.array([0.0, 0.0, -6.0]), shape[0] // 3)
        g = nn.Dense(3 * h, dot_general=dense_dot, name="gates", bias_init=gate_bias)(x.astype(jnp.float32)).reshape(b, t, h, 3)
        theta, eta, alpha = (jax.nn.sigmoid(g[..., i]).transpose(0, 2, 1) for i in range(3))  # [B, H, T]
        memory0 = self.memory0()
        state = nm.reset_rows(state, memory0, reset)
        inner = forms.inner_loop(self.impl, self.kind, self.chunk, d, self.hidden, remat=self.remat, unroll=self.unroll)
        y, state = inner(state, q, k, v, theta * self.lr_max, eta, alpha)
        # A row whose memory became non-finite (from non-finite inputs: the update itself is
        # bounded) restarts from memory0 instead of poisoning every later step of its stream.
        finite = [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(state)]
        bad = ~jnp.all(jnp.stack(finite), axis=0)  # [B]
        if self.axis is not None:  # a row restarts whole: any shard's heads decide for all
            bad = jax.lax.psum(bad.astype(jnp.int32), self.axis) > 0
        state = nm.reset_rows(state, memory0, bad)
        y = y.transpose(0, 2, 1, 3)  # [B, T, H, dk]
        if self.out_norm:
            y = HeadNorm(self.axis, name="out_norm")(y)
        if self.out_gate:
            y = y * jax.nn.sigmoid(dense(h * d, self.dtype, dot_general=dense_dot, name="out_gate")(x)).reshape(b, t, h, d)
        y = y.astype(self.dtype).reshape(b, t, h * d)
        out = nn.Dense(self.dim, use_bias=False, kernel_init=nn.initializers.zeros, dtype=self.dtype, dot_general=dense_dot, name="out")
        return tplib.leave(out(y), self.axis), state


def unit_size(depth: int, memory_layers) -> int:
    """Blocks in the shortest unit that, repeated, gives the net: p dividing `depth` with block i
    carrying a memory iff block i mod p does."""
    has = [i in memory_layers for i in range(depth)]
    return next(p for p in range(1, depth + 1) if not depth % p and all(has[i] == has[i % p] for i in range(depth)))


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What every block of the net shares."""

    dim: int
    hidden: int
    levels: int
    heads: int
    window: int
    memory: tuple  # NeuralMemory fields, as (name, value) pairs
    dtype: jnp.dtype
    remat: str  # none | block | memory
    memory_embed: bool  # model.nl_lm.memory_embed
    tp: int = 1  # tensor-parallel shards (nljax/parallel/tp.py)
    tp_axis: str | None = None
    attention: str = "blocked"  # blocked | cudnn | pallas (Attention.impl)


def block(spec: BlockSpec, i: int, x, state, reset, embedded):
    """Block i: attention, the neural memory when `state` is given, the CMS chain. Called inside
    a module's compact method, whose scope its sub-modules join; `embedded` is the net's token
    embeddings [B, T, D]. Returns (x, the new state)."""
    dt = spec.dtype
    # jax.checkpoint around each sub-block: the backward pass recomputes its activations from
    # its input. Every sub-block is a pure function, so the recomputation is exact.
    wrap = nn.remat if spec.remat == "block" else (lambda cls: cls)
    # With model.remat=memory only the work whose intermediates outweigh the inputs they come
    # from is recomputed: activations, attention's scores, the memory's conv (`recomputed`).
    # Inside a recomputed sub-block too: measured, titans_demo's block-remat step took 0.87x the
    # time and 6% less memory with it than without (CPU, interleaved, docs/benchmarks/2026-11-24-cpu.md).
    again = spec.remat != "none"
    x = x + wrap(Attention)(spec.dim, spec.heads, spec.window, dt, spec.tp, spec.tp_axis, again, spec.attention,
                            name=f"attn{i}")(LayerNorm(dt, name=f"norm_a{i}")(x))
    if state is not None:
        # inside a recomputed block too: the recomputation then keeps only each chunk's carried
        # state, not every chunk's intermediates (0.87x the step time at nl_350m's shapes on CPU)
        mem = wrap(NeuralMemory)(dim=spec.dim, **dict(spec.memory), dtype=dt, remat=again,
                                 tp=spec.tp, axis=spec.tp_axis, name=f"mem{i}")
        x_in = LayerNorm(dt, name=f"norm_m{i}")(x)
        if spec.memory_embed:
            # The tokens themselves beside the stream: after the first block the stream can be
            # mostly what every position shares (the CMS MLPs learn a large constant output),
            # which leaves the keys alike and the writes weak; a memory in block 1 stayed at
            # chance on the recall probe without this (docs/experiments/2026-11-27-where-the-memory-goes.md).
            x_in = x_in + LayerNorm(dt, name=f"norm_e{i}")(embedded)
        y, state = mem(x_in, state, reset)
        x = x + y
    chain = wrap(CMSChain)(spec.dim, spec.hidden, spec.levels, dt, spec.tp, spec.tp_axis, again, name=f"block{i}")
    return chain(x), state


def blocks(spec: BlockSpec, n: int, x, memory: dict, reset, embedded):
    """Blocks 0..n-1, block i with a memory iff `memory` holds f"block{i}" (its state); returns
    (x, the new states, keyed the same)."""
    new = {}
    for i in range(n):
        key = f"block{i}"
        x, state = block(spec, i, x, memory.get(key), reset, embedded)
        if key in memory:
            new[key] = state
    return x, new


class Unit(nn.Module):
    """`size` consecutive blocks: the body of the scanned net."""

    spec: BlockSpec
    size: int

    @nn.compact
    def __call__(self, x, memory, reset, embedded):  # memory {f"block{j}": state of the unit's block j}
        return blocks(self.spec, self.size, x, memory, reset, embedded)


class NLNet(nn.Module):
    vocab: int
    dim: int
    hidden: int
    depth: int
    levels: int
    heads: int
    window: int
    memory_layers: tuple[int, ...]
    memory: dict  # NeuralMemory fields
    dtype: jnp.dtype = jnp.float32  # compute dtype; parameters and optimizer state stay float32
    remat: str = "memory"  # memory (the inner loop's chunks) | block (attention, memory, CMS chains) | none
    memory_embed: bool = True  # model.nl_lm.memory_embed
    scan: bool = False  # lax.scan over repeating units of blocks (model.nl_lm.scan_layers)
    tp: int = 1  # tensor-parallel shards: heads, memory heads and MLP hidden widths split (nljax/parallel/tp.py)
    tp_axis: str | None = None  # the mesh axis they are split over (None: shapes only, no collective)
    attention: str = "blocked"  # blocked | cudnn | pallas: model.nl_lm.attention resolved for the backend
    embed_grad: str = "scatter"  # scatter | onehot | segment: model.nl_lm.embed_grad resolved
    loss_chunk: int = 0  # model.nl_lm.loss_chunk (read by NLLM.apply)

    @property
    def spec(self) -> BlockSpec:
        return BlockSpec(self.dim, self.hidden, self.levels, self.heads, self.window, tuple(self.memory.items()),
                         self.dtype, self.remat, self.memory_embed, self.tp, self.tp_axis, self.attention)

    @nn.compact
    def __call__(self, tokens, memory, reset, head: bool = True):  # tokens [B, T], memory {block: state}, reset [B]
        """(logits [B, T, V], the new memory); with `head=False` the head's input [B, T, D] in
        place of the logits (for `chunked_token_loss`, which applies the head itself)."""
        x = Embed(self.vocab, self.dim, dtype=self.dtype, grad=self.embed_grad, name="embed")(tokens)  # [B, T, D]
        x, new_memory = (self.scanned if self.scan else self.unrolled)(x, memory, reset, x)
        x = LayerNorm(self.dtype, name="norm")(x)
        if not head:
            return x, new_memory
        return dense(self.vocab, self.dtype, dot_general=dense_dot, name="head")(x), new_memory  # the loss upcasts to float32

    def unrolled(self, x, memory, reset, embedded):
        return blocks(self.spec, self.depth, x, {f"block{i}": memory[f"block{i}"] for i in self.memory_layers}, reset,
                      embedded)

    def scanned(self, x, memory, reset, embedded):
        # Parameters of unit u's block j are those of block u * p + j, stacked on a leading axis
        # of `units` (path "units/attn{j}/..."); the memory states go in stacked the same way
        # and come out as one state per block, the form the engine carries.
        p = unit_size(self.depth, self.memory_layers)
        units, at = self.depth // p, tuple(j for j in range(p) if j in self.memory_layers)
        stacked = {f"block{j}": jax.tree.map(lambda *s: jnp.stack(s), *(memory[f"block{u * p + j}"] for u in range(units)))
                   for j in at}
        scan = nn.scan(Unit, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast, nn.broadcast), length=units)
        x, out = scan(self.spec, p, name="units")(x, stacked, reset, embedded)
        return x, {f"block{u * p + j}": jax.tree.map(lambda s: s[u], out[f"block{j}"])
                   for j in at for u in range(units)}


@dataclasses.dataclass(frozen=True)
class NLLM:
    """The engine's view of `NLNet` (see `nljax.models.base`)."""

    net: NLNet

    def memory_module(self) -> NeuralMemory:
        return NeuralMemory(dim=self.net.dim, **self.net.memory, tp=self.net.tp)

    def forms(self) -> dict:
        """How this build computes (model.nl_lm's `auto` choices resolved for the backend), for a
        benchmark's record: attention, the inner loop, the embedding's gradient, the loss chunk."""
        n = self.net
        return {"attention": n.attention, "memory_impl": n.memory["impl"] if n.memory_layers else None,
                "embed_grad": n.embed_grad, "loss_chunk": n.loss_chunk}

    def tensor_parallel(self, m: int, axis: str | None) -> "NLLM":
        """This model's shard over `m` tensor-parallel devices (`nljax.parallel.tp`): attention heads,
        memory heads (each head's weights and per-row state M, S on the device that owns it) and
        every CMS MLP's hidden width split. Embedding, head and norms are replicated: the
        vocabulary is small next to the blocks (bytes: 256), and a vocabulary-parallel head would
        add a reduction to the loss for little memory."""
        n = self.net
        widths = [("model.heads", n.heads), (HIDDEN, n.hidden)]
        if n.memory_layers:
            widths.append(("model.nl_lm.memory_heads", n.memory["heads"]))
        tp_divides(m, widths)
        return NLLM(dataclasses.replace(n, tp=m, tp_axis=axis))

    def init(self, key):
        tokens = jnp.zeros((1, self.net.memory["chunk"]), jnp.int32)
        return self.net.init(key, tokens, self.init_memory(1), jnp.ones((1,), bool))["params"]

    def level_of(self, path: str) -> int:
        return cms_level_of(path)

    def init_memory(self, rows: int):
        """Zeros of the right shapes; step 0 (and every eval batch) resets all rows to memory0."""
        mem = self.memory_module()
        # distinct buffers for every leaf: the train step donates the state
        zeros = lambda: {k: jnp.zeros((rows, *s), jnp.float32) for k, s in mem.memory0_shapes().items()}
        return {f"block{i}": {"M": zeros(), "S": zeros()} for i in self.net.memory_layers}

    def logits(self, params, memory, batch, key=None):
        """Next-token logits [B, T, V] of batch["tokens"] [B, T+1], and the memory after them."""
        return self.net.apply({"params": params}, batch["tokens"][:, :-1], memory, batch["reset"])

    def apply(self, params, memory, batch, key=None):  # deterministic: key unused
        targets, mask, weight = batch["tokens"][:, 1:], batch.get("mask"), batch.get("weight")
        if self.net.loss_chunk:  # the head inside the chunked loss: no [B, T, V] logits held
            x, memory = self.net.apply({"params": params}, batch["tokens"][:, :-1], memory, batch["reset"], head=False)
            head = params["head"]
            loss_sum, count = chunked_token_loss(x, head["kernel"], head["bias"], targets, mask, weight, self.net.loss_chunk)
            return loss_sum, count, memory
        logits, memory = self.logits(params, memory, batch, key)
        loss_sum, count = token_loss(logits, targets, mask, weight)
        return loss_sum, count, memory
