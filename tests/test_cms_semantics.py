"""CMS semantics made explicit: per-level clipping and skipping, and what `cms.accumulate`
buffers (`gradients` vs `updates`) checked against hand-written references."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, leaf_pairs, make, train

from nljax.config import ConfigError, load
from nljax.engine.conductor import pulse
from nljax.parallel import levels
from nljax.parallel.hostdev import put_batch

FIRE, FROZEN = (True, True), (True, False)


def copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def level(setup, tree, l):
    """Level l's subtree of a params pytree (replicated layout), on the host."""
    return levels.split(jax.device_get(tree), setup.engine.level_tree, setup.engine.n_levels)[l]


def with_buffer(setup, state, value, row=None):
    """`state` with level 1's error buffer set to `value` (on every device, or only `row`'s)."""
    buf = np.zeros(state.err_buf[1].shape, np.float32)
    buf[slice(None) if row is None else row] = value
    err = (state.err_buf[0], jax.device_put(buf, state.err_buf[1].sharding))
    return state.replace(err_buf=err)


def params_host(setup, state):
    """Parameters as the model's pytree on the host, whatever the strategy stores."""
    return jax.device_get(setup.engine.strategy.gather_params(state.params))


# A huge gradient on level 1 only: it must be clipped on its own and leave level 0's update as
# if level 1 had stayed frozen (a joint norm would shrink level 0's update ~1e6-fold).
@pytest.mark.parametrize("strategy,inter,intra", [("replicated", 1, 1), ("fsdp", 2, 4)])
def test_clipping_is_per_level(strategy, inter, intra):
    setup = make(["cms.periods=[1,8]", "optim.name=sgd", "optim.lr=0.1", "optim.clip_norm=0.5",
                  f"sync.strategy={strategy}"], inter, intra)
    start = with_buffer(setup, setup.state, 1e6)
    batch = setup.batch(0)
    fired, m, _ = setup.cache.train(FIRE, copy(start), batch)
    frozen, _, _ = setup.cache.train(FROZEN, copy(start), batch)
    before, fired, frozen = (params_host(setup, s) for s in (start, fired, frozen))
    assert_trees_close(level(setup, fired, 0), level(setup, frozen, 0), rtol=1e-6, atol=1e-7)
    norms = np.asarray(m["level_grad_norm"])
    assert norms[1] > 1e6 and 0 < norms[0] < 1e3
    # level 1 moved by exactly lr * clip_norm (SGD): clipped by its own norm
    step = np.concatenate([np.ravel(a - b) for a, b in leaf_pairs(level(setup, fired, 1), level(setup, before, 1))])
    np.testing.assert_allclose(np.linalg.norm(step), 0.1 * 0.5, rtol=1e-4)


# A non-finite gradient (or one above sync.max_grad_norm) only in level 1: level 1 is skipped —
# parameters and optimizer state kept, its poisoned buffer dropped — and level 0 updates as if
# level 1 had stayed frozen.
@pytest.mark.parametrize("strategy,inter,intra", [("replicated", 2, 4), ("zero1", 2, 4)])
@pytest.mark.parametrize("poison,extra", [(np.nan, []), (1e6, ["sync.max_grad_norm=1e3"])])
def test_skip_is_per_level(strategy, inter, intra, poison, extra):
    setup = make(["cms.periods=[1,8]", f"sync.strategy={strategy}", *extra], inter, intra)
    start, _, _ = setup.cache.train(FIRE, copy(setup.state), setup.batch(0))  # moments non-zero
    start = with_buffer(setup, start, poison, row=3)  # one device's buffer
    batch = setup.batch(1)
    fired, m, _ = setup.cache.train(FIRE, copy(start), batch)
    frozen, _, _ = setup.cache.train(FROZEN, copy(start), batch)
    np.testing.assert_array_equal(np.asarray(m["level_skipped"]), [0, 1])
    assert float(m["skipped"]) == 1
    p_start, p_fired, p_frozen = (params_host(setup, s) for s in (start, fired, frozen))
    # two programs (level 1 fired, frozen): their level-0 updates agree to float32 rounding (to the
    # bit under XLA:CPU's default emitters; conftest's faster ones fuse the two differently). A
    # leak of the poison would show as nan or as a ~1e6-fold smaller update (test_clipping_...)
    assert_trees_close(level(setup, p_fired, 0), level(setup, p_frozen, 0), rtol=1e-6, atol=1e-7)
    assert not np.allclose(jax.tree.leaves(level(setup, p_fired, 0))[0], jax.tree.leaves(level(setup, p_start, 0))[0])
    assert_trees_close(level(setup, p_fired, 1), level(setup, p_start, 1), rtol=0, atol=0)
    assert_trees_close(fired.opt_state[1], start.opt_state[1], rtol=0, atol=0)
    assert not np.asarray(fired.err_buf[1]).any(), "a skipped level's buffer is dropped"
    # the next firing is clean again
    nxt, m, _ = setup.cache.train(FIRE, fired, setup.batch(2))
    np.testing.assert_array_equal(np.asarray(m["level_skipped"]), [0, 0])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nxt.params))


def test_sgd_updates_equal_gradients():
    """SGD, constant lr, no weight decay: buffering per-step gradients and running SGD on each is
    θ − η Σ g, the same as one step on the summed gradient."""
    base = ["cms.periods=[1,2,3]", "optim.name=sgd", "optim.lr=0.1"]
    grads = make([*base, "cms.accumulate=gradients"], 1, 1)
    updates = make([*base, "cms.accumulate=updates"], 1, 1)
    assert updates.state.err_buf[2].shape[1] == 2 * grads.state.err_buf[2].shape[1]  # C_2 - 1 slots
    la, sa = train(grads, 7)
    lb, sb = train(updates, 7)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    assert_trees_close(sb.params, sa.params, rtol=1e-5, atol=1e-7)


def adam(g, mu, nu, count, b1=0.9, b2=0.99, eps=1e-8):
    """optax.scale_by_adam by hand (numpy): (direction, mu, nu, count)."""
    mu, nu, count = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g, count + 1
    return (mu / (1 - b1**count)) / (np.sqrt(nu / (1 - b2**count)) + eps), mu, nu, count


def test_adam_eps_is_optim_eps():
    """optim.eps reaches Adam's update: a first step moves the parameters by lr g / (|g| + eps)
    (after the bias corrections Adam's moments are g and g²), here with an eps near |g|, where
    optax's default 1e-8 would give lr sign(g)."""
    eps, lr = 1e-3, 0.01
    setup = make([f"optim.eps={eps}", "optim.schedule=constant", "cms.periods=[1]"])
    eng, batch = setup.engine, setup.batch(0)
    before = params_host(setup, setup.state)
    g = jax.grad(lambda p: (lambda s, c, _: s / c)(*eng.model.apply(p, {}, jax.device_get(batch), None)))(before)
    _, state = train(setup, 1)
    moved = jax.tree.map(lambda a, b: a - b, before, params_host(setup, state))
    want = jax.tree.map(lambda g: lr * g / (np.abs(g) + eps), g)
    assert_trees_close(moved, want, rtol=1e-3, atol=1e-8)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
    assert not np.allclose(flat(moved), lr * np.sign(flat(g)), rtol=0.05)  # eps made the difference


def test_adam_updates_run_adam_on_each_step():
    """Adam, periods [1, 3]: at step 3, level 1 moves by −lr Σ_t u_t, where Adam runs on steps 1,
    2, 3's gradients in turn (all taken at the parameters level 1 had after step 0), and its
    moments and count advance three times. `gradients` mode gives a different result."""
    setup = make(["cms.periods=[1,3]", "cms.accumulate=updates"], 1, 1)
    eng, lr = setup.engine, 0.01

    def grad_level1(params, step):
        batch = jax.device_get(setup.batch(step))
        g = jax.grad(lambda p: (lambda s, c, _: s / c)(*eng.model.apply(p, {}, batch, None)))(params)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(levels.split(g, eng.level_tree, 2)[1])])

    flat1 = lambda params: np.concatenate([np.ravel(x) for x in jax.tree.leaves(level(setup, params, 1))])
    _, state = train(setup, 1)  # step 0: both fire
    opt = jax.device_get(state.opt_state[1])
    mu, nu = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (opt.mu, opt.nu))
    count = int(opt.count)
    theta, gs = flat1(state.params), []
    for s in (1, 2, 3):
        gs.append(grad_level1(jax.device_get(state.params), s))
        state, _, _ = setup.cache.train(pulse(s, (1, 3)).active, state, setup.batch(s))
    total = np.zeros_like(theta)
    for g in gs:
        u, mu, nu, count = adam(g, mu, nu, count)
        total += lr * u
    np.testing.assert_allclose(flat1(state.params), theta - total, rtol=1e-5, atol=1e-7)
    got = jax.device_get(state.opt_state[1])
    assert int(got.count) == count == 4
    np.testing.assert_allclose(np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.nu)]), nu, rtol=1e-5, atol=1e-12)

    other = make(["cms.periods=[1,3]", "cms.accumulate=gradients"], 1, 1)
    _, s2 = train(other, 4)
    assert not np.allclose(flat1(s2.params), flat1(state.params), rtol=1e-4, atol=0)


def test_config_errors():
    with pytest.raises(ConfigError, match="cms.accumulate"):
        load(None, ["cms.accumulate=sums"])
    with pytest.raises(ConfigError, match="optim.clip_norm"):
        load(None, ["optim.clip_norm=-1"])
    assert load(None, ["cms.accumulate=updates"]).cms.accumulate == "updates"


@pytest.mark.parametrize("inter,intra", [(1, 1), (2, 4)])
def test_a_non_finite_frozen_step_under_updates_is_skipped_at_the_firing(inter, intra):
    """Under `updates` each buffered step is checked as a synchronized step is: a non-finite
    gradient at a frozen step (here on one device's rows) leaves Adam's state as if that step
    had not happened, on every device. It was left out of the buffer, whose zero slot (one
    device) or partial sum (several) Adam then stepped on, unreported."""
    setup = make(["cms.periods=[1,3]", "cms.accumulate=updates"], inter, intra)
    state = setup.state
    for step in range(4):
        batch = setup.batch(step)
        if step == 1:
            host = jax.device_get(batch)
            tokens = np.array(host["tokens"])
            tokens[-1, 0] = 10**6  # the last row (the last device's): an id past the table, NaN
            batch = put_batch({**host, "tokens": tokens}, setup.mesh)
        state, m, _ = setup.cache.train(pulse(step, (1, 3)).active, state, batch)
    np.testing.assert_array_equal(np.asarray(m["level_skipped"]), [0, 1])
    assert int(jax.device_get(state.opt_state[1]).count) == 3  # steps 0, 2 and 3
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
