"""Models: the contract (`base.Model`), the registry (`registry`: `model.name` -> spec, nljax's own
and the plugins' alike; `specs.register_model`), the building blocks (`blocks`) and nljax's own
models (`builtin`)."""

from __future__ import annotations

from nljax.models.builtin import dit
from nljax.models.registry import build, spec
from nljax.models.specs import register_model

__all__ = ["build", "dit", "register_model", "spec"]
