"""nljax: nested-learning models and MeanFlow denoisers as one SPMD program over a JAX mesh."""

__version__ = "0.1.0"
