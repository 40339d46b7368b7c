"""Model registry: config `model.name` -> constructor. Explicit, no import-by-string."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax.numpy as jnp

from nljax.data.images import load
from nljax.errors import ConfigError
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP
from nljax.models.dit import DiT, DiTNet
from nljax.models.nl_lm import NLLM, NLNet

if TYPE_CHECKING:  # nljax.config imports this package's sections: no import of it at run time
    from nljax.config import Config


def _cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


def _nl_lm(cfg: Config) -> Model:
    m, nl = cfg.model, cfg.model.nl_lm
    memory = dict(heads=nl.memory_heads, dk=nl.memory_dim, hidden=nl.memory_hidden, kind=nl.memory_kind,
                  chunk=nl.memory_chunk, lr_max=nl.memory_lr_max, conv=nl.memory_conv, out_norm=nl.memory_out_norm,
                  out_gate=nl.memory_out_gate, unroll=nl.memory_unroll)
    return NLLM(NLNet(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods), m.heads, nl.window,
                      tuple(nl.memory_layers), memory, jnp.dtype(m.dtype), m.remat, memory_embed=nl.memory_embed,
                      scan=nl.scan_layers))


def _dit(cfg: Config) -> Model:
    data = load(cfg.images)  # the data decides the image shape and the label count
    return dit(cfg, data.shape, data.num_classes)


def dit(cfg: Config, shape: tuple[int, int, int], num_classes: int) -> Model:
    """The DiT of `cfg` for images of `shape` (H, W, C) with `num_classes` labels (0: none), as
    its data decide them (an export records them: `nljax.load_model` reads no data)."""
    m = cfg.model
    h, w, _ = shape
    patch = m.dit.patch_size
    if h % patch or w % patch:
        raise ConfigError(f"model.dit.patch_size={patch} does not divide the {h}x{w} images")
    mf = cfg.meanflow
    classes = num_classes if mf.class_cond else 0
    if not classes and (mf.cfg_omega != 1.0 or mf.cfg_kappa != 0.0):
        why = "meanflow.class_cond=false" if not mf.class_cond else "the images have no labels"
        raise ConfigError(f"meanflow.cfg_omega={mf.cfg_omega}, cfg_kappa={mf.cfg_kappa} guide by labels, and {why}: "
                          "leave them at 1, 0")
    return DiT(DiTNet(tuple(shape), patch, m.dim, m.depth, m.heads, m.dim * m.hidden_mult, classes,
                      dtype=jnp.dtype(m.dtype), remat=m.remat), mf, cfg.seed)


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
