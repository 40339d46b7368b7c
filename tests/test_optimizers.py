"""SGD with momentum (`optim.momentum`, `optim.nesterov`) and Lion (`optim.name=lion`): their
steps against the formulas, under zero1 and fsdp against one device, through a checkpoint
restored onto another strategy, and their config lines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, make, save, train

from nljax.checkpoint.restore import restore
from nljax.config import ConfigError, load
from nljax.engine import optim
from nljax.engine.conductor import pulse
from test_strategies import canonical_on_host

LR = 0.1
OPTS = {"momentum": ["optim.name=sgd", f"optim.lr={LR}", "optim.momentum=0.9"],
        "nesterov": ["optim.name=sgd", f"optim.lr={LR}", "optim.momentum=0.9", "optim.nesterov=true"],
        # Lion's step is lr x a sign: a small lr, as for a run; its decoupled weight decay on all
        "lion": ["optim.name=lion", "optim.lr=0.001", "optim.weight_decay=0.5", "optim.decay_params=all"]}


def _grad(setup, params, step):
    batch = jax.device_get(setup.batch(step))
    return jax.grad(lambda p: (lambda s, c, _: s / c)(*setup.engine.model.apply(p, {}, batch, None)))(params)


def _steps(setup, n):
    """The parameters before each of `n` steps and after the last, and the gradient each step
    took (one level, one device: the engine's gradient is the model's)."""
    params, grads, state = [jax.device_get(setup.state.params)], [], setup.state
    for s in range(n):
        grads.append(_grad(setup, params[-1], s))
        state, _, _ = setup.cache.train(pulse(s, (1,)).active, state, setup.batch(s))
        params.append(jax.device_get(state.params))
    return params, grads


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_follows_the_formula(nesterov):
    """m_t = g_t + 0.9 m_{t-1}; the step -lr m_t, or with Nesterov -lr (g_t + 0.9 m_t)."""
    setup = make(["cms.periods=[1]", *OPTS["nesterov" if nesterov else "momentum"]])
    params, grads = _steps(setup, 3)
    m = jax.tree.map(jnp.zeros_like, params[0])
    for t in range(3):
        m = jax.tree.map(lambda m, g: g + 0.9 * m, m, grads[t])
        d = jax.tree.map(lambda m, g: g + 0.9 * m, m, grads[t]) if nesterov else m
        assert_trees_close(params[t + 1], jax.tree.map(lambda p, d: p - LR * d, params[t], d), rtol=1e-5, atol=1e-6)
    # the momentum moves them: not plain SGD's step from step 1 on
    plain = jax.tree.map(lambda p, g: p - LR * g, params[1], grads[1])
    assert not all(np.allclose(a, b, atol=1e-4) for a, b in zip(jax.tree.leaves(params[2]), jax.tree.leaves(plain)))


def test_sgd_without_momentum_keeps_no_state():
    """momentum 0 (the default) is plain SGD as before: optax.identity, an empty state."""
    cfg = load(None, ["optim.name=sgd"]).optim
    assert cfg.momentum == 0 and not cfg.nesterov
    assert jax.tree.leaves(optim.update_direction(cfg).init(jnp.zeros(3))) == []


def test_lion_steps_by_the_sign():
    """c = b1 mu + (1 - b1) g, the step -lr (sign(c) + wd p); then mu = b2 mu + (1 - b2) g."""
    setup = make(["cms.periods=[1]", *OPTS["lion"]])
    params, grads = _steps(setup, 2)
    lr, wd, b1, b2 = 0.001, 0.5, 0.9, 0.99
    mu = jax.tree.map(jnp.zeros_like, params[0])
    moved = 0
    for t in range(2):
        c = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads[t])
        for p0, p1, c in zip(*map(jax.tree.leaves, (params[t], params[t + 1], c))):
            want = p0 - lr * (np.sign(c) + wd * p0)
            sure = np.abs(c) > 1e-6 * np.abs(c).max()  # a sign of float noise may round either way
            np.testing.assert_allclose(np.asarray(p1)[sure], np.asarray(want)[sure], rtol=1e-5, atol=1e-7)
            moved += int((sure & (c != 0)).sum())
        mu = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g, mu, grads[t])
    assert moved > 0


# Against one device, as tests/test_strategies.py's test_matches_replicated (its model, steps,
# level 1 frozen every other step, and tolerances), on the smallest mesh and the (2, 4).
BASE = ["cms.periods=[1,2]", "model.dim=15"]
STEPS = 4
_cache = {}


def _run(opt, strategy, inter, intra, ckpt=None):
    """A setup after STEPS steps; the one-device reference saves a checkpoint after step 2."""
    key = (opt, strategy, inter, intra)
    if key not in _cache:
        extra = [f"checkpoint.dir={ckpt}"] if ckpt else []
        setup = make([*BASE, *OPTS[opt], f"sync.strategy={strategy}", *extra], inter, intra)
        first, _ = train(setup, 2)
        if ckpt:
            save(setup, setup.state, 2)
        rest, _ = train(setup, range(2, STEPS))
        _cache[key] = setup, np.concatenate([first, rest]), setup.state
    return _cache[key]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("optimizers")


def _reference(opt, ckpt):
    setup, losses, state = _run(opt, "replicated", 1, 1, ckpt / opt)
    return losses, jax.device_get(state.params), jax.device_get(state.opt_state)


@pytest.mark.parametrize("opt", ["momentum", "lion"])
@pytest.mark.parametrize("strategy,inter,intra", [("zero1", 1, 2), ("zero1", 2, 4), ("fsdp", 1, 2), ("fsdp", 2, 4)])
def test_sharded_matches_one_device(opt, strategy, inter, intra, ckpt):
    ref_losses, ref_params, ref_opt = _reference(opt, ckpt)
    setup, losses, state = _run(opt, strategy, inter, intra)
    assert jax.tree.leaves(ref_opt)  # a state to shard: trace, or Lion's count and mu
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    params, opt_state = canonical_on_host(setup, state)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=2e-6)
    assert_trees_close(opt_state, ref_opt, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("opt,strategy", [("momentum", "fsdp"), ("lion", "zero1")])
def test_checkpoint_restores_onto_another_strategy(opt, strategy, ckpt):
    """The one-device replicated run's checkpoint after step 2, restored onto zero1 or fsdp on
    (2, 4) through the canonical layout: steps 2-3 continue as the uninterrupted run."""
    ref_losses, ref_params, ref_opt = _reference(opt, ckpt)
    setup = _run(opt, strategy, 2, 4)[0]
    r = restore(setup.engine, setup.state, ckpt / opt / "2")
    assert r.step == 2
    losses, state = train(setup, range(2, STEPS), state=r.state)
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=2e-5)
    params, opt_state = canonical_on_host(setup, state)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=2e-6)
    assert_trees_close(opt_state, ref_opt, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1"])
def test_momentum_range(value):
    with pytest.raises(ConfigError) as e:
        load(None, ["optim.name=sgd", f"optim.momentum={value}"])
    assert str(e.value) == f"config key 'optim.momentum' must be in [0, 1), got {float(value)}"


@pytest.mark.parametrize("opts,message", [
    (["optim.momentum=0.5"], "optim.momentum and optim.nesterov are sgd's: adamw's momentum is optim.b1"),
    (["optim.name=lion", "optim.nesterov=true"],
     "optim.momentum and optim.nesterov are sgd's: lion's momentum is optim.b1"),
    (["optim.name=sgd", "optim.nesterov=true"],
     "optim.nesterov=true needs optim.momentum > 0 (plain SGD has no look-ahead)"),
    # adamw's settings where the rule reads them not: unused without a word
    (["optim.name=sgd", "optim.b1=0.8"], "optim.b1 is not read by optim.name=sgd (adamw's and lion's; sgd's is "
                                         "optim.momentum)"),
    (["optim.name=sgd", "optim.b2=0.9"], "optim.b2 is not read by optim.name=sgd (adamw's and lion's)"),
    (["optim.name=sgd", "optim.eps=1e-6"], "optim.eps is not read by optim.name=sgd (Adam's epsilon: adamw's alone)"),
    (["optim.name=lion", "optim.eps=1e-6"], "optim.eps is not read by optim.name=lion (Adam's epsilon: adamw's alone)")])
def test_momentum_set_where_it_is_unused_is_refused(opts, message):
    """torch's momentum on adamw or lion, or a look-ahead without momentum, would change nothing."""
    with pytest.raises(ConfigError) as e:
        load(None, opts)
    assert str(e.value) == message


def test_state_vectors_by_optimizer():
    assert [optim.state_vectors(load(None, o).optim) for o in
            [[], ["optim.name=sgd"], ["optim.name=sgd", "optim.momentum=0.9"], ["optim.name=lion"]]] == [2, 0, 1, 1]


def test_a_checkpoint_with_another_momentum_does_not_fit(ckpt):
    """sgd's momentum decides whether the optimizer state holds a buffer: a checkpoint of
    another momentum is refused in one line (it was a pytree traceback), as another optim.name is."""
    _reference("momentum", ckpt)
    plain = make([*BASE, "optim.name=sgd", f"optim.lr={LR}"])
    with pytest.raises(ConfigError) as e:
        restore(plain.engine, plain.state, ckpt / "momentum" / "2")
    assert str(e.value) == (f"checkpoint {ckpt / 'momentum' / '2'} does not fit this run: optim.momentum=0.9 there, "
                            "0.0 here")


def test_a_resume_may_not_change_the_momentum(tmp_path):
    """Refused before anything is built; a config saved before optim.momentum existed reads as 0."""
    import json

    from nljax import config
    from nljax.run.resuming import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    saved = config.to_dict(load(None, ["optim.name=sgd", f"run.dir={run}"]))
    del saved["optim"]["momentum"]
    (run / "config.yaml").write_text(json.dumps(saved))
    args = ["checkpoint.resume=latest", f"run.dir={run}", "optim.name=sgd"]
    assert resumed_config(load(None, args), None, args).optim.momentum == 0
    assert config.migrate({"optim": {"name": "sgd"}})["optim"]["momentum"] == 0  # a checkpoint's, likewise
    args.append("optim.momentum=0.9")
    with pytest.raises(ConfigError) as e:
        resumed_config(load(None, args), None, args)
    assert str(e.value) == (f"optim.momentum=0.9 cannot change on resume (0.0 in {run / 'config.yaml'}: the "
                            "checkpoint holds that optimizer state); leave it out, or start a new run in another "
                            "run.dir")


def test_a_run_saved_with_momentum_on_adamw_still_resumes_and_loads(tmp_path):
    """optim.momentum and nesterov beside adamw were accepted and unused before they were
    refused: a run (its config.yaml and its checkpoint's config) that set them resumes and loads
    as it trained, not refused on every read for a key that may not change on resume."""
    import json

    import yaml
    from helpers import saved_run

    from nljax.checkpoint.contents import seal
    from nljax.run.resuming import resumed_config
    from nljax.run.trained import load as load_trained

    run = tmp_path / "run"
    saved_run(run, ["model.dim=15", "cms.periods=[1,2]"], 1, 1)
    old = {"momentum": 0.9, "nesterov": True}
    tree = yaml.safe_load((run / "config.yaml").read_text())
    tree["optim"].update(old)
    (run / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    meta = run / "checkpoints" / "2" / "nljax" / "metadata"
    tree = json.loads(meta.read_text())
    tree["config"]["optim"].update(old)
    meta.write_text(json.dumps({**tree, "seal": seal(tree)}))  # as that nljax sealed it
    args = ["checkpoint.resume=latest", f"run.dir={run}"]
    assert resumed_config(load(None, args), None, args).optim.momentum == 0
    assert load_trained(run, devices=jax.devices()[:1]).step == 2


def test_the_start_up_line_names_the_update_rule():
    """The start-up's optimizer line says the momentum a run trains with (it said `sgd` alone)."""
    from nljax.run.trainer import startup_report

    for opts, want in ((OPTS["nesterov"], f"optimizer sgd with Nesterov momentum 0.9: peak lr {LR:g},"),
                       (OPTS["momentum"], f"optimizer sgd with momentum 0.9: peak lr {LR:g},"),
                       (["optim.name=sgd", f"optim.lr={LR}"], f"optimizer sgd: peak lr {LR:g},"),
                       (OPTS["lion"], "optimizer lion: peak lr 0.001,")):
        setup, lines = make(opts, 1, 1), []
        startup_report(setup, setup.state, lines.append)
        assert any(line.startswith(want) for line in lines), (want, lines)
