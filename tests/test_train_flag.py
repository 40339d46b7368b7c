"""`apply`'s optional `train` (nljax.Model): a registered model with dropout trains with it on,
and every evaluation (the run's own, fresh and streaming; `nljax.evaluate`, on 1 device and on
a sharded mesh) scores it with dropout off: exactly the loss of its network applied with
`deterministic=True` by hand."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make, saved_run, train

import nljax
from nljax import evaluate
from nljax.data.text import eval_batches, eval_windows
from nljax.models import specs
from nljax.models.base import takes_train
from nljax.models.cms_mlp import CMSMLP
from nljax.models.layers import token_loss


class DropNet(nn.Module):
    vocab: int
    dim: int
    rate: float

    @nn.compact
    def __call__(self, tokens, deterministic: bool):  # [B, T] int32
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)  # [B, T, D]
        x = nn.Dropout(self.rate)(x, deterministic=deterministic)
        return nn.Dense(self.vocab, name="head")(x)  # [B, T, V]


@dataclasses.dataclass(frozen=True)
class Dropping:
    """A memory-less language model with dropout at rate 0.5, as a user writes one."""

    vocab: int
    dim: int
    rate: float = 0.5

    @property
    def net(self) -> DropNet:
        return DropNet(self.vocab, self.dim, self.rate)

    def init(self, key):
        return self.net.init(key, jnp.zeros((1, 8), jnp.int32), deterministic=True)["params"]

    def level_of(self, path):
        return 0

    def init_memory(self, rows):
        return {}

    def logits(self, params, memory, batch, key=None):
        return self.net.apply({"params": params}, batch["tokens"][:, :-1], deterministic=True), memory

    # `train` without a default: a path that scores the model without saying fails loudly
    def apply(self, params, memory, batch, key, *, train: bool):
        logits = self.net.apply({"params": params}, batch["tokens"][:, :-1], deterministic=not train,
                                rngs={"dropout": key})
        return (*token_loss(logits, batch["tokens"][:, 1:], batch.get("mask"), batch.get("weight")), memory)


@pytest.fixture
def dropping():
    nljax.register_model("dropping", lambda cfg: Dropping(cfg.model.vocab_size, cfg.model.dim))
    yield
    specs.unregister("dropping")


def by_hand(model: Dropping, params, batches, key=None) -> float:
    """The mean loss over `batches` of the network applied by hand: with dropout under `key`, or
    without (key None: deterministic=True)."""
    loss = count = 0.0
    for b in batches:
        rngs = {} if key is None else {"dropout": key}
        logits = model.net.apply({"params": params}, jnp.asarray(b["tokens"])[:, :-1], deterministic=key is None,
                                 rngs=rngs)
        s, c = token_loss(logits, jnp.asarray(b["tokens"])[:, 1:], b.get("mask"), b.get("weight"))
        loss, count = loss + float(s), count + float(c)
    return loss / count


def test_only_an_apply_that_declares_train_is_given_it():
    assert takes_train(Dropping(256, 8))
    assert not takes_train(CMSMLP(256, 8, 8, 1, 1))  # nljax's own: called as before

    @dataclasses.dataclass(frozen=True)
    class Anything(CMSMLP):
        def apply(self, params, memory, batch, key=None, **kwargs):  # may not expect train=
            return super().apply(params, memory, batch, key)

    assert not takes_train(Anything(256, 8, 8, 1, 1))


def test_training_applies_dropout_under_the_steps_key(dropping):
    setup = make(["model.name=dropping", "cms.periods=[1]"])
    model = setup.engine.model
    params = jax.device_get(setup.engine.strategy.export_state(setup.state).params)
    batch = jax.device_get(setup.batch(0))
    losses, _ = train(setup, 3)
    assert np.all(np.isfinite(losses))
    # step 0 on the one device: the key of `nljax.engine.step.device_key(seed, 0)` at device index 0
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(setup.cfg.seed), 0), 0)
    dropped, clean = by_hand(model, params, [batch], key), by_hand(model, params, [batch])
    assert losses[0] == pytest.approx(dropped, rel=1e-6)
    assert abs(dropped - clean) > 1e-3  # dropout at 0.5 moves the loss: the check above can tell
    # another key, another loss: the step's key reaches the dropout
    assert abs(by_hand(model, params, [batch], jax.random.key(1)) - dropped) > 1e-4


def test_every_evaluation_applies_no_dropout_on_any_mesh(dropping, tmp_path, capsys):
    """The run trains and evaluates on a 2 x 2 mesh; `nljax.evaluate` reads its checkpoint on the
    8 devices (1 x 8) and on one: each gives the loss of the network with dropout off."""
    run_dir = tmp_path / "run"
    overrides = ["model.name=dropping", "cms.periods=[1]", "eval.batches=2", "eval.stream_steps=2"]
    setup, state = saved_run(run_dir, overrides, 2, 2)
    model, cfg = setup.engine.model, setup.cfg
    params = jax.device_get(setup.engine.strategy.export_state(state).params)
    rows, task = cfg.train.batch_size, setup.run.task
    fresh = by_hand(model, params, eval_batches(eval_windows(task.eval_data, cfg.train.seq_len, 2 * rows), rows))
    stream = by_hand(model, params, task.held_out().batches(2))
    with_dropout = by_hand(model, params, eval_batches(eval_windows(task.eval_data, cfg.train.seq_len, 2 * rows),
                                                      rows), jax.random.key(cfg.seed))
    assert abs(with_dropout - fresh) > 1e-3  # the comparisons below can tell dropout on from off

    own = setup.run.evaluate(state.params, 2)  # the run's own evaluation, as the trainer calls it
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert evaluate.main([f"run.dir={run_dir}", f"out={out}"]) == 0
    command = json.loads(out.read_text())
    one = evaluate.scores(evaluate.load(str(run_dir), devices=jax.devices()[:1]))
    assert command["devices"] == 8
    for got in (own, command, one):
        assert got["eval_loss"] == pytest.approx(fresh, rel=1e-6)
        assert got["eval_loss_stream"] == pytest.approx(stream, rel=1e-6)
