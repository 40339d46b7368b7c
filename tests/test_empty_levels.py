"""A model that puts no parameter in some CMS level (every parameter at level 0, the default
`cms.periods` of three levels): its empty levels' state (optimizer moments, error buffers, flat
shards) is zero-size, which Orbax refuses to save. The checkpoint leaves those arrays out and
makes them again when read; a resume is bitwise, and an elastic one (another strategy and
mesh) reads them too."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal, make, save, train

import nljax
from nljax.checkpoint.restore import restore
from nljax.models import specs
from nljax.models.layers import token_loss
from nljax.parallel.levels import describe


class Net(nn.Module):
    vocab: int
    dim: int

    @nn.compact
    def __call__(self, tokens):  # [B, T] int32
        return nn.Dense(self.vocab, name="head")(nn.Embed(self.vocab, self.dim, name="embed")(tokens))  # [B, T, V]


@dataclasses.dataclass(frozen=True)
class Flat:
    """A memory-less model without CMS levels, as a user writes one."""

    vocab: int
    dim: int

    def init(self, key):
        return Net(self.vocab, self.dim).init(key, jnp.zeros((1, 8), jnp.int32))["params"]

    def level_of(self, path):
        return 0

    def init_memory(self, rows):
        return {}

    def apply(self, params, memory, batch, key):
        logits = Net(self.vocab, self.dim).apply({"params": params}, batch["tokens"][:, :-1])
        return (*token_loss(logits, batch["tokens"][:, 1:], batch.get("mask")), memory)


@pytest.fixture
def flat():
    nljax.register_model("flat", lambda cfg: Flat(cfg.model.vocab_size, cfg.model.dim))
    yield
    specs.unregister("flat")


ARGS = ["model.name=flat", "model.dim=16", "cms.periods=[1,2,4]", "cms.frozen_grads=accumulate"]


@pytest.mark.parametrize("strategy", ["replicated", "zero1", "fsdp"])
def test_a_model_without_cms_levels_saves_and_resumes_bitwise(flat, tmp_path, strategy):
    setup = make([*ARGS, f"sync.strategy={strategy}", f"checkpoint.dir={tmp_path}"], 2, 2)
    empty = [k for k, x in _named(setup.state).items() if x.size == 0]
    assert empty  # the test needs a zero-size array in the state
    train(setup, 2)
    save(setup, setup.state, 2)  # Orbax refused it: "Cannot save arrays with zero size"
    straight, final = train(setup, range(2, 5))
    r = restore(setup.engine, setup.state, tmp_path / "2")
    assert r.step == 2 and r.warnings == []
    for k in empty:
        x = _named(r.state)[k]
        assert x.size == 0 and x.sharding == _named(setup.state)[k].sharding
    resumed, state = train(setup, range(2, 5), state=r.state)
    np.testing.assert_array_equal(resumed, straight)
    assert_trees_equal(state, final)


def test_an_elastic_resume_reads_the_empty_levels(flat, tmp_path):
    saved = make([*ARGS, "sync.strategy=zero1", f"checkpoint.dir={tmp_path}"], 2, 2)
    train(saved, 2)
    save(saved, saved.state, 2)
    other = make([*ARGS, "sync.strategy=fsdp", f"checkpoint.dir={tmp_path}"], 1, 8)
    r = restore(other.engine, other.state, tmp_path / "2")
    assert r.step == 2
    here, there = other.engine.strategy.export_state(r.state), saved.engine.strategy.export_state(saved.state)
    assert_trees_equal((here.params, here.opt_state), (there.params, there.opt_state))
    train(other, range(2, 3), state=r.state)  # and it trains on from there


@pytest.mark.parametrize("strategy", ["replicated", "zero1", "fsdp"])
def test_the_step_reads_no_zero_size_array(flat, strategy):
    """jaxlib 0.11.2's XLA crashes compiling a shard_map whose outputs depend on a zero-size
    input (docs/guides/reliability.md, JAX versions), which the step's did through the empty levels' state: the
    step's body reads none (step.unread_empty), checked in its jaxpr so that jaxlib 0.10, which
    compiles it anyway, checks it too. Every level active (step 0) and levels 1, 2 frozen."""
    from jax.sharding import PartitionSpec as P

    from nljax.engine.step import TRAIN_METRIC_SPECS, batch_specs, local_train_step

    setup = make([*ARGS, f"sync.strategy={strategy}"], 2, 2)
    eng, state, batch = setup.engine, setup.state, setup.batch(0)
    specs = eng.strategy.state_specs(state)
    for active in ((True, True, True), (True, False, False)):
        step = jax.shard_map(lambda s, b, t: local_train_step(eng, active, s, b, t), mesh=eng.mesh,
                             in_specs=(specs, batch_specs(batch), P()), out_specs=(specs, TRAIN_METRIC_SPECS),
                             check_vma=False)
        (eqn,) = [e for e in jax.make_jaxpr(step)(state, batch, jnp.int32(5)).eqns if e.primitive.name == "shard_map"]
        body = eqn.params["jaxpr"]
        empty = {v for v in body.invars if v.aval.size == 0}
        assert len(empty) == sum(x.size == 0 for x in jax.tree.leaves(state))  # the empty levels' state
        used = [v for e in body.eqns for v in e.invars] + list(body.outvars)
        read = {v for v in used if isinstance(v, jax.extend.core.Var) and v in empty}
        assert not read, (active, read)


def test_the_level_table_says_which_levels_hold_nothing(flat):
    setup = make(ARGS, 1, 1)
    table = describe(setup.engine.param_shapes, setup.engine.level_tree, setup.cfg.cms.periods)
    assert "levels 1, 2 hold no parameters (the model's level_of puts none there): their periods change nothing" in table
    # one level: "its period", not "their periods"
    one = describe(setup.engine.param_shapes, setup.engine.level_tree, setup.cfg.cms.periods[:2])
    assert "level 1 holds no parameters (the model's level_of puts none there): its period changes nothing; a " \
           "new run with cms.periods=[1] would do the same" in one


def _named(state):
    from nljax.checkpoint.contents import named_arrays

    return named_arrays(state)


def test_a_model_without_logits_is_not_offered_for_sampling(flat):
    """The closing lines offer `nljax.generate` only for a model it can sample."""
    from types import SimpleNamespace

    from nljax.run.trainer import closing

    setup = make(ARGS, 1, 1)
    offered = lambda model: any("nljax.generate" in line for line in
                                closing(setup.cfg, SimpleNamespace(task=SimpleNamespace(unit="tokens"),
                                                                   engine=SimpleNamespace(model=model))))
    assert not offered(setup.engine.model)
    assert offered(make([], 1, 1).engine.model)  # the default model has logits()
