"""Model registry: config `model.name` -> constructor. Explicit, no import-by-string."""

from __future__ import annotations

from typing import Callable

from nljax.config import Config, ConfigError
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP


def _cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


MODELS: dict[str, Callable[[Config], Model]] = {
    "cms_mlp": _cms_mlp,
}


def build(cfg: Config) -> Model:
    try:
        make = MODELS[cfg.model.name]
    except KeyError:
        raise ConfigError(f"unknown model.name '{cfg.model.name}' (available: {', '.join(sorted(MODELS))})")
    return make(cfg)
