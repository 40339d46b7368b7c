"""A gated-delta-rule memory language model for nljax, as a plugin (`model.name=gated_delta`).

Installed (`pip install -e examples/gated_delta`), its entry point in the group `nljax.models`
makes nljax call `register` the first time it reads its model registry; nothing in nljax imports
this package. The model itself: `nljax_gated_delta.model`.
"""

from __future__ import annotations

NAME = "gated_delta"


def register() -> None:
    """Register the model, its config section `model.gated_delta` and its config rule."""
    import nljax
    from nljax_gated_delta.model import GatedDeltaConfig, build, check

    # the shared model.* keys `build` reads: model.remat, which it does not, is warned of when set
    nljax.register_model(NAME, build, settings=GatedDeltaConfig, check=check,
                         shared=("vocab_size", "dim", "hidden_mult", "depth", "heads", "dtype"))
