"""Model registry: config `model.name` -> constructor. Explicit, no import-by-string."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from nljax.config import Config
from nljax.data.images import load
from nljax.errors import ConfigError
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP
from nljax.models.dit import DiT, DiTNet
from nljax.models.nl_lm import NLLM, NLNet


def _cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


def _nl_lm(cfg: Config) -> Model:
    m = cfg.model
    memory = dict(heads=m.memory_heads, dk=m.memory_dim, hidden=m.memory_hidden, kind=m.memory_kind,
                  chunk=m.memory_chunk, lr_max=m.memory_lr_max, conv=m.memory_conv, out_norm=m.memory_out_norm,
                  out_gate=m.memory_out_gate, unroll=m.memory_unroll)
    return NLLM(NLNet(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods), m.heads, m.window,
                      tuple(m.memory_layers), memory, jnp.dtype(m.dtype), m.remat))


def _dit(cfg: Config) -> Model:
    m, data = cfg.model, load(cfg.images)  # the data decides the image shape and the label count
    h, w, _ = data.shape
    if h % m.patch_size or w % m.patch_size:
        raise ConfigError(f"model.patch_size={m.patch_size} does not divide the {h}x{w} images")
    classes = data.num_classes if cfg.meanflow.class_cond else 0
    return DiT(DiTNet(data.shape, m.patch_size, m.dim, m.depth, m.heads, m.dim * m.hidden_mult, classes),
               cfg.meanflow, cfg.seed)


MODELS: dict[str, Callable[[Config], Model]] = {
    "cms_mlp": _cms_mlp,
    "nl_lm": _nl_lm,
    "dit": _dit,
}


def build(cfg: Config) -> Model:
    try:
        make = MODELS[cfg.model.name]
    except KeyError:
        raise ConfigError(f"unknown model.name '{cfg.model.name}' (available: {', '.join(sorted(MODELS))})")
    return make(cfg)
