"""nljax: nested-learning models and MeanFlow denoisers as one SPMD program over a JAX mesh."""

from nljax.version import __version__

__all__ = ["__version__", "load_model"]


def load_model(path):
    """(model, params) of a directory written by `python -m nljax.export` (nljax/export.py).
    Imported on call: `import nljax` stays free of JAX and Flax."""
    from nljax.export import load_model as load

    return load(path)
