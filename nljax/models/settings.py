"""Config section `model`: the fields every model shares, and one subsection per model.

`model.name` picks the model (the registry in `nljax/models/__init__.py`); what only one model
reads sits in that model's subsection, declared beside it: `model.nl_lm.*` (`NlLmConfig`,
models/nl_lm.py) and `model.dit.*` (`DiTConfig`, models/dit.py). `cms_mlp` reads only shared fields.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from nljax.errors import ConfigError
from nljax.models.dit import DiTConfig
from nljax.models.nl_lm import NlLmConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "nl_lm"  # registry key: nl_lm | cms_mlp | dit
    vocab_size: int = 256  # nl_lm, cms_mlp: token ids (bytes: 256)
    dim: int = 128  # model width (embedding and residual stream)
    hidden_mult: int = 4  # MLP hidden width = dim * hidden_mult
    depth: int = 2  # blocks (nl_lm, cms_mlp: each ending in one CMS chain of len(cms.periods) levels)
    heads: int = 4  # attention heads (nl_lm, dit)
    # compute dtype of nl_lm's matmuls and activations, and of the DiT's matmuls; parameters,
    # optimizer state, the inner-loop memory (state, gates, normalisers), losses and gradient
    # reductions stay float32
    dtype: Literal["float32", "bfloat16"] = "float32"
    # jax.checkpoint in nl_lm: memory (the inner loop's per-chunk internals: recomputed from each
    # chunk's carried state, not stored; 18% fewer ops and 17% less memory at titans_demo, measured)
    # | block (attention, memory and CMS sub-blocks, and inside the memory its chunks as with
    # `memory`) | none (store everything); exact, since all are pure. dit: block recomputes each
    # block, none and memory keep everything; cms_mlp: no block to recompute (block is refused)
    remat: Literal["none", "block", "memory"] = "memory"
    nl_lm: NlLmConfig = NlLmConfig()
    dit: DiTConfig = DiTConfig()

    def check(self) -> None:
        if self.vocab_size < 1 or self.dim < 1 or self.depth < 1:
            raise ConfigError("model.vocab_size, model.dim and model.depth must be >= 1")
        for key in ("hidden_mult", "heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        self.nl_lm.check()
        if self.name == "nl_lm":
            self.nl_lm.check_with(self.dim, self.heads, self.depth)
        if self.name == "dit":
            self.dit.check_with(self.dim, self.heads)
        if self.name == "cms_mlp" and self.remat == "block":
            raise ConfigError("model.remat=block recomputes nl_lm's and dit's blocks; cms_mlp has none to recompute")
