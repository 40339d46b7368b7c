"""A load reads and holds the parameters alone (nljax/checkpoint/restore.py `restore_params`):
`nljax.load` (and generate, export, lm_eval through it) of a run trained with adamw reads only the
checkpoint's `params/...` arrays and its step, and the devices hold about the parameters' bytes
while it reads, not the training state's (parameters, two Adam moments, error buffers, memory)
twice over; the parameters are those of the whole restore, bit for bit, from a checkpoint in the
load's layout and from one in another (fsdp, tensor-parallel)."""

from __future__ import annotations

import gc
import math

import jax
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_equal, leaf_pairs, save, saved_run, train

from nljax.checkpoint import storage
from nljax.checkpoint.restore import restore
from nljax.engine.strategy import Strategy
from nljax.errors import ConfigError
from nljax.measure import budget
from nljax.run import trained
from nljax.run.core import Run

# (sync.strategy, mesh inter x intra x model) the run trained with; the load is one device's
TRAINED = {"replicated 8": ("replicated", (1, 8, 1)), "fsdp tensor-parallel": ("fsdp", (2, 2, 2))}


def device_bytes() -> int:
    """Bytes the live arrays hold on the devices, every replica and shard counted."""
    return sum(len(x.sharding.device_set) * math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.live_arrays())


@pytest.mark.parametrize("case", sorted(TRAINED))
def test_a_load_reads_and_holds_the_parameters_alone(tmp_path, monkeypatch, case):
    strategy, (inter, intra, model) = TRAINED[case]
    run_dir = tmp_path / "run"
    setup, state = saved_run(run_dir, [*TINY_NL, f"sync.strategy={strategy}"], inter, intra, steps=1, model=model)
    assert setup.cfg.optim.name == "adamw" and setup.engine.tp == model
    want = jax.tree.map(np.asarray, setup.engine.strategy.export_state(state).params)  # the model's tree, whole
    del setup, state
    gc.collect()

    read, held = [], []
    reader = storage.read_arrays

    def spy(*args, **kwargs):
        arrays, sums = reader(*args, **kwargs)
        read.append(sorted(arrays))
        held.append(device_bytes())
        return arrays, sums

    importer = Strategy.import_params

    def spy_import(self, canonical):
        out = importer(self, canonical)
        converted.append(device_bytes())
        return out

    converted = []
    monkeypatch.setattr(storage, "read_arrays", spy)
    monkeypatch.setattr(Strategy, "import_params", spy_import)
    before = device_bytes()
    t = trained.load(run_dir, devices=jax.devices()[:1])
    monkeypatch.undo()

    saved = storage.read_meta(t.path)["arrays"]
    wanted = sorted(n for n in saved if n == "step" or n.startswith("params/"))
    size = lambda names: sum(math.prod(saved[n]["shape"]) * np.dtype(saved[n]["dtype"]).itemsize for n in names)
    params_bytes, state_bytes = size(wanted), size(saved)  # as saved (fsdp: padded level vectors)
    assert state_bytes > 3 * params_bytes  # two Adam moments, error buffers and memory beside them
    # while reading, the one device holds the parameters read and nothing else (the whole restore
    # held this run's fresh state and the checkpoint's: over 6x the parameters)
    assert len(held) == 1 and held[0] - before <= 1.05 * params_bytes, (held, before, params_bytes, state_bytes)
    # converted from another layout: the saved layout's copy is dropped before this run's is made
    assert len(converted) == (strategy != "replicated") and all(b - before <= 2 * params_bytes for b in converted)
    # every parameter and the step; none of the optimizer state, error buffers or memory saved beside
    assert {"opt_state", "err_buf", "memory"} <= {n.split("/")[0] for n in saved}
    assert read == [wanted]
    assert_trees_equal(t.params, want)
    # the whole restore's parameters, bit for bit
    full = restore(t.run.engine, t.run.init_state(), t.path).state.params
    for a, b in leaf_pairs(t.params, full):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



def test_a_load_is_budgeted_for_what_it_holds_not_the_training_state(tmp_path, monkeypatch):
    """The memory check before anything is allocated (nljax/measure/budget.py) counts what a load
    holds: a model whose parameters fit a device loads there though its training would not."""
    run_dir = tmp_path / "run"
    saved_run(run_dir, TINY_NL, 1, 1, steps=1)
    cfg = trained.config_of(run_dir)
    terms = budget.engine_terms(cfg, Run.create(cfg, jax.devices()[:1]).engine)
    assert terms["optimizer state"] == 2 * terms["parameters"] > 0 and terms["gradients"] > 0
    # what training needs but the optimizer state (two Adam moments): more than a load holds
    monkeypatch.setattr(budget, "available_bytes", lambda *args: sum(terms.values()) - terms["optimizer state"])
    with pytest.raises(ConfigError, match="the run needs at least"):
        Run.create(cfg, jax.devices()[:1])
    t = trained.load(run_dir, devices=jax.devices()[:1])
    assert t.step == 1
    # a load that does not fit is told so, not given a training run's remedies
    monkeypatch.setattr(budget, "available_bytes", lambda *args: terms["parameters"] // 2)
    with pytest.raises(ConfigError, match=r"the load needs at least .*; the trained model does not fit this device"):
        trained.load(run_dir, devices=jax.devices()[:1])


def test_a_parameter_that_fails_its_checksum_falls_back_to_an_older_checkpoint(tmp_path, monkeypatch):
    """The parameters read are checked against their checksums as the whole restore checks every
    array: a newer checkpoint whose parameter does not match is passed over for an older one."""
    run_dir = tmp_path / "run"
    setup, _ = saved_run(run_dir, TINY_NL, 1, 1, steps=1)
    train(setup, range(1, 2))
    save(setup, setup.state, 2)
    real, damaged = storage.checksums, []

    def checksums(arrays):
        sums = real(arrays)
        if not damaged:  # the newest checkpoint's first parameter, as if a bit had flipped on disk
            damaged.append(min(n for n in sums if n.startswith("params/")))
            sums[damaged[0]] ^= 1
        return sums

    monkeypatch.setattr(storage, "checksums", checksums)
    t = trained.load(run_dir, devices=jax.devices()[:1])
    newest = run_dir / "checkpoints" / "2"
    assert t.step == 1 and t.skipped == ((newest, f"checkpoint {newest}: array '{damaged[0]}' does not match its "
                                                  "checksum (corrupted)"),)
