"""What must not grow with a run's length or with the runs of one process (a notebook): objects
kept per run or per load, per step or per resume (docs/benchmarks/2026-12-02-long-runs.md)."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp

from nljax.checkpoint import contents


class _Model:
    """The one method `contents.fingerprint` calls."""

    def __init__(self, width: int):
        self.width = width
        self.traced = 0

    def init(self, key):
        self.traced += 1
        return {"w": jnp.zeros((2, self.width))}


def test_fingerprint_keeps_no_model_after_the_next():
    """Each run of a notebook and each nljax.load builds a new model, and a checkpoint save or
    restore fingerprints it: the cache kept every one of them alive for the process's life (one
    model more per run or load, measured with nl_lm). Only the latest is kept now, traced once."""
    first = _Model(3)
    assert contents.fingerprint(first) == {"w": [[2, 3], "float32"]}
    assert contents.fingerprint(first) == {"w": [[2, 3], "float32"]}
    assert first.traced == 1  # a run's saves trace the model once
    gone = weakref.ref(first)
    second = _Model(4)
    assert contents.fingerprint(second) == {"w": [[2, 4], "float32"]}
    del first
    gc.collect()
    assert gone() is None


def test_a_task_is_not_kept_alive_by_its_fingerprint():
    """Each run builds its task, which holds the data it read (a corpus tokenized into memory,
    the images), and its start-up asks for the data's digest. A functools.cache on the method
    kept every task of the process, with its data: one more per run in a notebook, never freed."""
    import jax

    from nljax import config
    from nljax.parallel.mesh import make_mesh
    from nljax.run import tasks

    mesh = make_mesh(1, 1, jax.devices()[:1])
    text = ["train.seq_len=32", "train.batch_size=4"]
    image = ["model.name=dit", "images.source=moons", "cms.periods=[1]", "train.batch_size=4"]
    for make, overrides in ((tasks.TextTask, text), (tasks.ImageTask, image)):
        task = make(config.load(None, overrides), mesh)
        digest = task.fingerprint()
        assert len(digest) == 64 and task.fingerprint() == digest
        gone = weakref.ref(task)
        del task
        gc.collect()
        assert gone() is None
