"""Config section `model`: the fields every model shares, and one subsection per registered model.

`model.name` picks the model (`nljax.models.registry`); what only one model reads sits in that
model's subsection, the `settings` dataclass it was registered with, declared beside it:
`model.nl_lm.*` (`NlLmConfig`, models/nl_lm.py), `model.dit.*` (`DiTConfig`, models/dit.py), and a
plugin's `model.<name>.*`. `cms_mlp` reads only shared fields.

The section's class is `ModelConfig` with those subsections added as fields, made from the
registry (`ModelConfig.resolved()`): the config loader builds that class, so a plugin's keys are
loaded and checked like nljax's own.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from nljax.errors import ConfigError, check_at_least

MAX_DEPTH = 512  # blocks: deeper than any model here by 10x (nl_350m: 24), bounded before anything is built


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "nl_lm"  # registry key: nl_lm | cms_mlp | dit, or a plugin's model (nljax.models.registry)
    vocab_size: int = 256  # nl_lm, cms_mlp: token ids (bytes: 256)
    dim: int = 128  # model width (embedding and residual stream)
    hidden_mult: int = 4  # MLP hidden width = dim * hidden_mult
    depth: int = 2  # blocks (nl_lm, cms_mlp: each ending in one CMS chain of len(cms.periods) levels)
    heads: int = 4  # attention heads (nl_lm, dit)
    # compute dtype of nl_lm's matmuls and activations, and of the DiT's matmuls; parameters,
    # optimizer state, the inner-loop memory (state, gates, normalisers), losses and gradient
    # reductions stay float32, and so do the sums over tokens of every bias's, the embedding's and
    # the memory's conv's gradients (their adds and the conv computed in float32, rounded once);
    # cms_mlp: float32 (bfloat16 is refused)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # jax.checkpoint in nl_lm: memory (the inner loop's per-chunk internals: recomputed from each
    # chunk's carried state, not stored; 18% fewer ops and 17% less memory at titans_demo, measured)
    # | block (attention, memory and CMS sub-blocks, and inside the memory its chunks as with
    # `memory`) | none (store everything); exact, since all are pure. dit: block recomputes each
    # block, none and memory keep everything; cms_mlp: no block to recompute (block is refused)
    remat: Literal["none", "block", "memory"] = "memory"

    @classmethod
    def resolved(cls) -> type:
        """The section's class with one field per registered model's settings (`model.<name>`)."""
        from nljax.models import registry

        return _with_sections(tuple((s.name, s.settings) for s in registry.specs()))

    def check(self) -> None:
        from nljax.models import registry

        check_at_least("model", self, vocab_size=1, dim=1, depth=1)
        if self.depth > MAX_DEPTH:  # building and compiling 100,000 blocks ran for minutes, then for ever
            raise ConfigError(f"model.depth={self.depth} is past the limit of {MAX_DEPTH} blocks")
        for key in ("hidden_mult", "heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        for f in dataclasses.fields(self):  # every model's own section, selected or not
            check = getattr(getattr(self, f.name), "check", None)
            if dataclasses.is_dataclass(getattr(self, f.name)) and check is not None:
                # a plugin's section: its AttributeError or assert is one line naming it
                with registry.plugin_code(f.name, f"model.{f.name}'s check()"):
                    check()
        # the selected model's own rules read the whole config: nljax.crosschecks runs them


_CLASSES: dict[tuple, type] = {}


def _with_sections(sections: tuple) -> type:
    """`ModelConfig` plus a field per registered model with settings, `sections` ((name, settings
    class or None), ...) in registration order: one class per distinct registry content, so that
    configs loaded before and after a model came and went again compare equal."""
    if sections not in _CLASSES:
        shared = {f.name for f in dataclasses.fields(ModelConfig)}
        fields = []
        for name, settings in sections:
            if name in shared:
                raise ConfigError(f"model '{name}': its name is a shared key of the model section (model.{name}): "
                                  "register it under another")
            if settings is not None:
                fields.append((name, settings, dataclasses.field(default=settings())))
        cls = dataclasses.make_dataclass("ModelConfig", fields, bases=(ModelConfig,), frozen=True)
        cls.__module__, cls.__qualname__ = __name__, "ModelConfig"
        cls.__doc__ = ModelConfig.__doc__
        _CLASSES[sections] = cls
    return _CLASSES[sections]
