"""DiT denoiser for MeanFlow (Peebles & Xie's DiT, conditioned on two times).

Patch embedding (+ fixed 2-D sin-cos positions); N blocks of [attention, MLP], each modulated by
adaLN-zero from the conditioning c = emb(t) + emb(h = t - r) (+ emb(label), with one extra "null"
label for classifier-free guidance); a final adaLN layer and a linear map back to patches. The
adaLN projections and the output layer start at zero, so the network starts as u = 0.

Sizes come from `model.dim`, `model.depth`, `model.heads`, `model.hidden_mult` and
`model.dit.patch_size` (DiT-B: 768, 12, 12, 4; DiT-XL: 1152, 28, 16, 4).

CMS levels: every parameter is level 0 (a plain DiT; `cms.periods` has one entry). The blocks'
MLPs could be split into `cms<l>` levels like the LM's, but MeanFlow has no inner loop to pair
with slow levels, so the DiT keeps the engine's plain data-parallel path.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nljax.errors import ConfigError
from nljax.models import layers, meanflow
from nljax.models.base import HIDDEN, tp_divides
from nljax.models.layers import RowDense
from nljax.models.meanflow import MeanFlowConfig
from nljax.parallel import tp as tplib


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """Config section `model.dit`: what only the DiT reads; the shared `model.dim`, `depth`,
    `heads` and `hidden_mult` size it too."""

    patch_size: int = 2  # side of a square patch, in pixels

    def check_with(self, dim: int, heads: int) -> None:
        """Rules that apply when model.name=dit, with the shared model fields."""
        # one refusal each: the combined line blamed model.dim for a patch_size of 0, and named
        # model.dit.patch_size to a user who had changed model.heads
        if dim % heads:
            raise ConfigError(f"model.dim={dim} must split into model.heads={heads} heads of equal width")
        if self.patch_size < 1:
            raise ConfigError(f"model.dit.patch_size must be >= 1, got {self.patch_size}")


def time_features(t: jax.Array, dim: int = 256, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal features of t in [0, 1], at most 1 radian per unit of t.  [B, dim]

    DiT scales its timesteps to [0, 1000]; here that would put up to 1000 radians per unit of t
    into u, and the MeanFlow target v - (t - r) du/dt inherits that derivative: on the digits
    (600 steps, lr 3e-4) one-step energy distance was 0.88 with the x1000 scale, 0.25 without."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def pos_embed_2d(dim: int, gh: int, gw: int) -> np.ndarray:
    """Fixed 2-D sin-cos position embedding (half the channels per axis).  [gh * gw, dim]"""

    def one(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d // 2))
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    gy, gx = np.meshgrid(np.arange(gh, dtype=np.float64), np.arange(gw, dtype=np.float64), indexing="ij")
    d = dim // 2
    emb = np.concatenate([one(d - d % 2, gy), one(dim - d - (dim - d) % 2, gx)], axis=1)
    return np.pad(emb, ((0, 0), (0, dim - emb.shape[1]))).astype(np.float32)


def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class TimeEmbed(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, t):  # [B] -> [B, D]
        h = nn.Dense(self.dim, name="fc1")(time_features(t))
        return nn.Dense(self.dim, name="fc2")(nn.silu(h))


class Attention(nn.Module):
    """Multi-head self-attention; under tensor parallelism each shard holds `heads / tp` of the
    heads (qkv column-parallel, out row-parallel)."""

    dim: int
    heads: int
    tp: int = 1
    axis: str | None = None
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, N, D]
        b, n, _ = x.shape
        h, hd = self.heads // self.tp, self.dim // self.heads
        # kernel [D, 3, H, hd]: the head axis stands alone, so a shard is a contiguous block of it
        # bias added in float32 (layers.biased)
        qkv = layers.biased(nn.DenseGeneral, (3, h, hd), self.dtype, name="qkv")(tplib.enter(x, self.axis))  # [B, N, 3, h, hd]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        # Written out (not jax.nn.dot_product_attention) so forward-mode AD works on every backend;
        # logits and softmax in float32 whatever the compute dtype.
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
        return RowDense(self.dim, self.dtype, self.axis, name="out")(y.reshape(b, n, h * hd))


class DiTBlock(nn.Module):
    """Attention and MLP, modulated by adaLN-zero. Under tensor parallelism (`tp` shards over
    `axis`) the heads, the MLP's hidden width and the adaLN projection's outputs are split; the
    shards' modulations are gathered whole (a [B, 6D] all-gather, small next to the [B, N, D]
    sums of the two sub-blocks) because they act on the replicated residual stream."""

    dim: int
    heads: int
    hidden: int
    tp: int = 1
    axis: str | None = None
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, c):  # x [B, N, D], c [B, D]
        enter = lambda a: tplib.enter(a, self.axis)
        dense = lambda n, name, **kw: layers.dense(n, self.dtype, name=name, **kw)  # bias added in float32
        # float32 (a [B, D] x [D, 6D] product): the gates and scales multiply the float32 stream
        mod = nn.Dense(6 * self.dim // self.tp, kernel_init=nn.initializers.zeros, name="adaln")(enter(nn.silu(c)))
        mod = tplib.gather(mod, self.axis, self.tp)  # [B, 6D]
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(mod, 6, axis=-1)  # each [B, D]
        norm = lambda name: nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name=name)
        attn = Attention(self.dim, self.heads, self.tp, self.axis, self.dtype, name="attn")
        x = x + gate_a[:, None] * attn(modulate(norm("norm1")(x), shift_a, scale_a))
        h = dense(self.hidden // self.tp, "mlp_up")(enter(modulate(norm("norm2")(x), shift_m, scale_m)))
        h = RowDense(self.dim, self.dtype, self.axis, name="mlp_down")(nn.gelu(h, approximate=True))
        return x + gate_m[:, None] * h


class DiTNet(nn.Module):
    image: tuple[int, int, int]  # H, W, C
    patch: int
    dim: int
    depth: int
    heads: int
    hidden: int
    num_classes: int  # 0: unconditional; else labels 0..num_classes-1 and num_classes = null
    tp: int = 1  # tensor-parallel shards (nljax.parallel.tp): this net holds 1/tp of each block's split layers
    tp_axis: str | None = None  # the mesh axis they sum over (None: shapes only, no collective)
    # `model.dtype`: the matmuls' compute dtype. The residual stream, norms, modulation, time
    # features and softmax stay float32 (a bf16 matmul's output is promoted where it is added).
    dtype: jnp.dtype = jnp.float32
    # `model.remat=block`: the backward pass recomputes each block from its input (jax.checkpoint
    # composes with MeanFlow's jvp); none and memory keep every block's activations.
    remat: str = "none"

    @nn.compact
    def __call__(self, z, t, h, y):  # z [B, H, W, C], t [B], h [B], y [B] int32 or None
        hh, ww, ch = self.image
        p = self.patch
        b = z.shape[0]
        x = layers.biased(nn.Conv, self.dim, self.dtype, kernel_size=(p, p), strides=(p, p), padding="VALID",
                          name="patch_embed")(z)  # bias added in float32
        x = x.astype(jnp.float32)  # [B, H/p, W/p, D]
        gh, gw = hh // p, ww // p
        x = x.reshape(b, gh * gw, self.dim) + pos_embed_2d(self.dim, gh, gw)[None]  # [B, N, D]
        c = TimeEmbed(self.dim, name="t_embed")(t) + TimeEmbed(self.dim, name="h_embed")(h)  # [B, D]
        if self.num_classes:
            c = c + nn.Embed(self.num_classes + 1, self.dim, name="label_embed")(y)
        block = nn.remat(DiTBlock) if self.remat == "block" else DiTBlock
        for i in range(self.depth):
            x = block(self.dim, self.heads, self.hidden, self.tp, self.tp_axis, self.dtype, name=f"block{i}")(x, c)
        final_mod = nn.Dense(2 * self.dim, kernel_init=nn.initializers.zeros, name="final_adaln")(nn.silu(c))
        shift, scale = jnp.split(final_mod, 2, axis=-1)
        x = modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name="final_norm")(x), shift, scale)
        x = layers.dense(p * p * ch, self.dtype, kernel_init=nn.initializers.zeros, name="final")(x)
        x = x.astype(jnp.float32)  # [B, N, p*p*C]
        x = x.reshape(b, gh, gw, p, p, ch).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, hh, ww, ch)


@dataclasses.dataclass(frozen=True)
class DiT:
    """The engine's view of `DiTNet` trained with a MeanFlow or flow-matching loss.

    Batch rows: `image` [B, H, W, C] float32, `label` [B] int32, `index` [B] int32 (the row's global
    example index: every random draw of the loss is keyed by (seed, index), so a global batch gives
    the same loss and gradients on any mesh), optional `mask` [B]."""

    net: DiTNet
    loss: MeanFlowConfig
    seed: int
    task: str = "images"
    # label k's name (a folder's class subfolders, sorted): recorded with the model, not computed
    # with; None where the data do not name their labels, or the model takes none
    classes: tuple[str, ...] | None = None

    @property
    def conditional(self) -> bool:
        return self.net.num_classes > 0

    def tensor_parallel(self, m: int, axis: str | None) -> "DiT":
        """This model's shard over `m` tensor-parallel devices (`nljax.parallel.tp`): each block's heads,
        MLP hidden width and adaLN outputs split. Patch embedding, time and label embeddings, the
        final adaLN and output layer are replicated: small (the output layer maps to p*p*C
        values per patch) and outside the blocks, where every shard needs them whole."""
        n = self.net
        tp_divides(m, [("model.heads", n.heads), (HIDDEN, n.hidden)])
        return dataclasses.replace(self, net=dataclasses.replace(n, tp=m, tp_axis=axis))

    def velocity(self, params) -> meanflow.VelocityFn:
        """u(z, t, r, y) of these parameters (the network sees t and h = t - r)."""
        return lambda z, t, r, y: self.net.apply({"params": params}, z, t, t - r, y)

    def init(self, key):
        z = jnp.zeros((1, *self.net.image), jnp.float32)
        t = jnp.zeros((1,), jnp.float32)
        return self.net.init(key, z, t, t, jnp.zeros((1,), jnp.int32) if self.conditional else None)["params"]

    def level_of(self, path: str) -> int:
        return 0

    def mismatch(self, name: str, there: list | None, here: list | None) -> str:
        """What a checkpoint parameter `name` of another shape ([shape, dtype], None: absent) says
        about the data it trained on, beside the parameter (`checkpoint.contents.check_fits`):
        the label embedding's rows are the classes + the null one, the output layer's width
        patch * patch * channels."""
        if name == "label_embed/embedding":
            classes = lambda side: f"{side[0][0] - 1} classes" if side else "no labels"  # noqa: E731
            return (f"the checkpoint's model trained on {classes(there)}, these images have {classes(here)} "
                    "(images.path's labels, meanflow.class_cond)")
        if name == "final/bias" and there and here:
            c = lambda side: side[0][0] // self.net.patch**2  # noqa: E731
            return f"the checkpoint's model trained on {c(there)}-channel images, these are {c(here)}-channel"
        return ""

    def init_memory(self, rows: int):
        return {}

    def per_example_loss(self, params, batch) -> jax.Array:
        keys = meanflow.example_keys(self.seed, meanflow.TRAIN_STREAM, batch["index"])
        y = batch["label"] if self.conditional else None
        fn = meanflow.LOSSES[self.loss.loss]
        return fn(self.velocity(params), batch["image"], y, keys, self.loss, self.net.num_classes)

    def per_example_error(self, params, batch) -> jax.Array:
        """Per-example mean squared error of the loss's regression without its adaptive weight
        (meanflow.adaptive_p = 0), per image value: the weighted loss is near 1 at every step with
        the default weight, this one shows the fit (evaluated on held-out images, nljax/run/tasks.py).  [B]"""
        plain = dataclasses.replace(self, loss=dataclasses.replace(self.loss, adaptive_p=0.0))
        return plain.per_example_loss(params, batch) / math.prod(self.net.image)

    def apply(self, params, memory, batch, key=None):  # per-device key unused: draws are per example
        losses = self.per_example_loss(params, batch)  # [B]
        mask = batch.get("mask")
        if mask is None:
            return jnp.sum(losses), jnp.asarray(losses.shape[0], jnp.float32), memory
        w = mask.astype(jnp.float32)
        return jnp.sum(losses * w), jnp.sum(w), memory

    def generate(self, params, index, label, steps: int) -> jax.Array:
        """Samples from noise keyed by (seed, eval stream, index), in `steps` steps.  [B, H, W, C]"""
        keys = meanflow.example_keys(self.seed, meanflow.EVAL_STREAM, index)
        z1 = jax.vmap(lambda k: jax.random.normal(k, self.net.image))(keys)
        y = label if self.conditional else None
        return meanflow.sample(self.velocity(params), z1, y, steps, mean_flow=self.loss.loss == "meanflow")
