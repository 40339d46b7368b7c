"""Model registry: config `model.name` -> constructor. Explicit, no import-by-string."""

from __future__ import annotations

from typing import Callable

from nljax.config import Config, ConfigError
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP
from nljax.models.nl_lm import NLLM


def _cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


def _nl_lm(cfg: Config) -> Model:
    m = cfg.model
    return NLLM(
        vocab=m.vocab_size, dim=m.dim, hidden=m.dim * m.hidden_mult, depth=m.depth, levels=len(cfg.cms.periods),
        heads=m.heads, window=m.window, memory_layers=tuple(m.memory_layers), memory_heads=m.memory_heads,
        memory_dim=m.memory_dim, memory_hidden=m.memory_hidden, memory_kind=m.memory_kind,
        memory_chunk=m.memory_chunk, memory_lr_max=m.memory_lr_max,
    )


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
