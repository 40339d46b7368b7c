"""The engine's first model: token embedding, a CMS chain per block, output head.

Position-wise only (no mixing across tokens): the smallest model that exercises every part of
the engine. The attention + neural-memory model is `nl_lm`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from nljax.models.base import HIDDEN, cms_level_of, tp_divides
from nljax.models.layers import CMSChain, LayerNorm, dense_dot, token_loss


class CMSMLPNet(nn.Module):
    vocab: int
    dim: int
    hidden: int
    depth: int
    levels: int
    tp: int = 1  # tensor-parallel shards of the hidden width (nljax/parallel/tp.py)
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, tokens):  # [B, T] int32
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)  # [B, T, D]
        for i in range(self.depth):
            x = CMSChain(self.dim, self.hidden, self.levels, tp=self.tp, axis=self.tp_axis, name=f"block{i}")(x)
        x = LayerNorm(name="norm")(x)
        return nn.Dense(self.vocab, dot_general=dense_dot, name="head")(x)  # [B, T, V]


@dataclasses.dataclass(frozen=True)
class CMSMLP:
    vocab: int
    dim: int
    hidden: int
    depth: int
    levels: int
    tp: int = 1
    tp_axis: str | None = None

    @property
    def net(self) -> CMSMLPNet:
        return CMSMLPNet(self.vocab, self.dim, self.hidden, self.depth, self.levels, self.tp, self.tp_axis)

    def tensor_parallel(self, m: int, axis: str | None) -> "CMSMLP":
        """This model's shard over `m` tensor-parallel devices (`nljax.parallel.tp`): the MLPs' hidden
        width split; embedding and head replicated (they are small next to the chains here)."""
        tp_divides(m, [(HIDDEN, self.hidden)])
        return dataclasses.replace(self, tp=m, tp_axis=axis)

    def init(self, key):
        return self.net.init(key, jnp.zeros((1, 8), jnp.int32))["params"]

    def level_of(self, path: str) -> int:
        return cms_level_of(path)

    def init_memory(self, rows: int):
        return {}

    def logits(self, params, memory, batch, key=None):
        """Next-token logits [B, T, V] of batch["tokens"] [B, T+1], and the (absent) memory."""
        return self.net.apply({"params": params}, batch["tokens"][:, :-1]), memory

    def apply(self, params, memory, batch, key=None):  # deterministic: key unused
        logits, memory = self.logits(params, memory, batch, key)
        loss_sum, count = token_loss(logits, batch["tokens"][:, 1:], batch.get("mask"), batch.get("weight"))
        return loss_sum, count, memory
