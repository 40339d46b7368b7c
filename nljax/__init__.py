"""nljax: nested-learning models and MeanFlow denoisers as one SPMD program over a JAX mesh.

The Python API of a trained model: `nljax.load(path)` (a run directory or an export directory)
gives a `TrainedModel` with `encode`, `decode`, `generate` and `logits` (nljax/trained_model.py).
Everything is imported on call: `import nljax` stays free of JAX and Flax."""

from nljax.version import __version__

# The model API, imported when first asked for (`nljax.Model`, `nljax.register_model`): the
# contract a model meets (nljax/models/base.py) and the registry a plugin's model enters by
# (nljax/models/specs.py, nljax/models/registry.py); the building blocks are `nljax.models.blocks`.
_LAZY = {"Model": "nljax.models.base", "TextModel": "nljax.models.base", "ModelSpec": "nljax.models.specs",
         "register_model": "nljax.models.specs",
         "Completion": "nljax.run.stopping"}  # what `TrainedModel.generate(..., details=True)` returns

__all__ = ["__version__", "Completion", "Model", "ModelSpec", "TextModel", "TrainedModel", "load", "load_model",
           "register_model"]


def load(path, checkpoint="latest", overrides=(), params=""):
    """The trained model in `path` (a run directory that `python -m nljax.train` wrote, at its
    newest intact checkpoint or `checkpoint`: a step number or a step directory; or an export
    directory that `python -m nljax.export` wrote), on one device, with its run's tokenizer:
    `nljax.TrainedModel`. `params`: of a run under optim.ema_decay, "average" (the parameters'
    moving average, the default there) or "trained" (the optimizer's own)."""
    from nljax.trained_model import load as load_trained

    return load_trained(path, checkpoint, overrides, params)


def load_model(path):
    """(model, params) of a directory written by `python -m nljax.export` (nljax/export.py)."""
    from nljax.export import load_model as load

    return load(path)


def __dir__():  # a notebook's completion (nljax.<Tab>) lists the names imported on first use too
    return sorted({*globals(), *__all__})


def __getattr__(name):  # nljax.TrainedModel and the model API, imported when first asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "TrainedModel":
        from nljax.trained_model import TrainedModel

        return TrainedModel
    raise AttributeError(f"module 'nljax' has no attribute {name!r}")
