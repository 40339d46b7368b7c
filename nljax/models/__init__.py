"""Model registry: config `model.name` -> constructor. Explicit, no import-by-string."""

from __future__ import annotations

from typing import Callable

from nljax.config import Config, ConfigError
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP
from nljax.models.nl_lm import NLLM, NLNet


def _cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


def _nl_lm(cfg: Config) -> Model:
    m = cfg.model
    memory = dict(heads=m.memory_heads, dk=m.memory_dim, hidden=m.memory_hidden, kind=m.memory_kind,
                  chunk=m.memory_chunk, lr_max=m.memory_lr_max)
    return NLLM(NLNet(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods), m.heads, m.window,
                      tuple(m.memory_layers), memory))


MODELS: dict[str, Callable[[Config], Model]] = {
    "cms_mlp": _cms_mlp,
    "nl_lm": _nl_lm,
}


def build(cfg: Config) -> Model:
    try:
        make = MODELS[cfg.model.name]
    except KeyError:
        raise ConfigError(f"unknown model.name '{cfg.model.name}' (available: {', '.join(sorted(MODELS))})")
    return make(cfg)
