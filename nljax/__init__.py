"""nljax: nested-learning models and MeanFlow denoisers as one SPMD program over a JAX mesh."""

from nljax.version import __version__

# The model API, imported when first asked for (`nljax.Model`, `nljax.register_model`): the
# contract a model meets (nljax/models/base.py) and the registry a plugin's model enters by
# (nljax/models/specs.py, nljax/models/registry.py); the building blocks are `nljax.models.blocks`.
_LAZY = {"Model": "nljax.models.base", "TextModel": "nljax.models.base", "ModelSpec": "nljax.models.specs",
         "register_model": "nljax.models.specs"}

__all__ = ["__version__", "Model", "ModelSpec", "TextModel", "load_model", "register_model"]


def load_model(path):
    """(model, params) of a directory written by `python -m nljax.export` (nljax/export.py).
    Imported on call: `import nljax` stays free of JAX and Flax."""
    from nljax.export import load_model as load

    return load(path)


def __getattr__(name):  # the model API, imported when first asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nljax' has no attribute {name!r}")
