"""Weight decay's mask (`optim.decay_params`): flax's kernels and embeddings decay, biases, norm
scales and an initial memory do not (or a model's own `decays`); the mask lines up with the flat
vectors the sharded strategies keep, and a zero1 run with it matches one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, make, train

from nljax.engine import optim
from nljax.engine.core import decays_of
from nljax.models.base import decays_by_name
from nljax.parallel.levels import path_str
from nljax.run.trainer import weight_decay

# cms_mlp (helpers.TINY): kernels, biases, norm scales and an embedding in each of two levels
WD = ["optim.weight_decay=0.5", "optim.name=sgd", "optim.lr=0.1", "cms.periods=[1,2]"]


def test_kernels_and_embeddings_decay_by_name():
    assert decays_by_name("block0/cms1/up/kernel") and decays_by_name("embed/embedding")
    assert not any(map(decays_by_name, ["block0/cms1/up/bias", "norm/scale", "mem0/memory0_W", "head/bias"]))


def test_masked_parameters_keep_their_values():
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda p: jnp.zeros((1, *p.shape)), params)  # no gradient: decay alone moves them
    tx = optax.identity()
    new, _ = optim.apply_steps(tx, grads, jnp.array([True]), tx.init(params), params, jnp.array([0.1]), 0.5,
                               {"w": 1.0, "b": 0.0})
    np.testing.assert_allclose(new["w"], 1 - 0.1 * 0.5)
    np.testing.assert_array_equal(new["b"], params["b"])
    every, _ = optim.apply_steps(tx, grads, jnp.array([True]), tx.init(params), params, jnp.array([0.1]), 0.5)
    np.testing.assert_allclose(every["b"], 1 - 0.1 * 0.5)


def test_the_flat_mask_is_the_tree_mask_raveled():
    setup = make(WD, 1, 2, 1)
    lay = setup.engine.levels
    for l in range(lay.n_levels):
        tree = lay.decays(l)
        want = np.concatenate([np.full(int(np.prod(f)), d, np.float32)
                               for f, d in zip(lay.flats[l].shapes, jax.tree.leaves(tree), strict=True)])
        np.testing.assert_array_equal(lay.decay_mask(l, jnp.arange(lay.flats[l].size)), want)
        assert 0 < want.sum() < want.size  # both kinds in every level
    # no mask at all where nothing is excluded: the update compiles as it did before the mask
    assert make([*WD, "optim.decay_params=all"]).engine.levels.decays(0) is None
    assert make(["cms.periods=[1,2]"]).engine.levels.decay_tree is None


def test_the_start_up_line_counts_what_decays():
    setup = make(WD)
    shapes = jax.tree_util.tree_flatten_with_path(setup.engine.param_shapes)[0]
    n = sum(int(np.prod(x.shape)) for p, x in shapes if decays_by_name(path_str(p)))
    total = sum(int(np.prod(x.shape)) for _, x in shapes)
    assert weight_decay(setup.cfg, setup.engine) == (f", weight decay 0.5 on {n:,} of {total:,} parameters "
                                                     "(optim.decay_params=weights)")
    plain = make(["cms.periods=[1,2]"]).cfg
    assert decays_of(plain, setup.engine.model) is None and weight_decay(plain, None) == ""


# fsdp's in the slow tier (its own compilations, ~30 s on 2 busy cores): the suite checks zero1's
@pytest.mark.parametrize("strategy", ["zero1", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_masked_decay_matches_one_device(strategy):
    """A sharded strategy's flat mask against the replicated tree's (fsdp's: a mutation decaying
    every parameter there passed the suite and test_tp's fsdp case with weight decay)."""
    one, many = make(WD), make([*WD, f"sync.strategy={strategy}"], 2, 4)
    l1, s1 = train(one, 4)
    ln, sn = train(many, 4)
    np.testing.assert_allclose(ln, l1, rtol=2e-5)
    c1, cn = one.engine.strategy.export_state(s1), many.engine.strategy.export_state(sn)
    assert_trees_close(jax.device_get(cn.params), jax.device_get(c1.params), rtol=1e-4, atol=1e-6)
    # and the mask acted: the biases and norm scales differ from a run that decays everything
    _, sa = train(make([*WD, "optim.decay_params=all"]), 4)
    ca = one.engine.strategy.export_state(sa)
    assert not np.allclose(ca.params["block0"]["cms1"]["norm"]["scale"], c1.params["block0"]["cms1"]["norm"]["scale"])
