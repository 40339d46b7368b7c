"""The chunk-parallel neural memory equals its token-by-token definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close

from nljax.models import memory as nm

B, H, T, D, HID = 2, 2, 8, 4, 8


def inputs(kind, seed=0, gates=True):
    ks = jax.random.split(jax.random.key(seed), 10)
    q, k = (jax.random.normal(ks[i], (B, H, T, D)) * 0.5 for i in range(2))
    v = jax.random.normal(ks[2], (B, H, T, D))
    u = lambda i, lo, hi: jax.random.uniform(ks[i], (B, H, T), minval=lo, maxval=hi)
    theta, eta, alpha = (u(3, 0.05, 0.5), u(4, 0.3, 0.95), u(5, 0.01, 0.3)) if gates else (u(3, 0.05, 0.5),) * 3
    shapes = {"W": (H, D, D)} if kind == "linear" else {"W1": (H, D, HID), "W2": (H, HID, D)}
    m0 = {n: jax.random.normal(ks[6 + i], s) * 0.3 for i, (n, s) in enumerate(shapes.items())}
    state = nm.init_state(m0, B)
    state["S"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(ks[9], x.shape), state["S"])
    return state, (q, k, v, theta, eta, alpha)


# the inner loop's two XLA forms (model.nl_lm.memory_impl scan and parallel), each against the definition;
# the parallel form also with its reads in groups of one chunk, one group after another (large batches)
FORMS = {"scan": nm.memory_forward, "parallel": nm.memory_parallel,
         "parallel_grouped": lambda *a, chunk, **kw: nm.memory_parallel(*a, chunk=chunk, groups=T // chunk, **kw)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("chunk", [1, 4, T])
def test_chunk_parallel_equals_sequential(kind, chunk, form):
    state, args = inputs(kind)
    y, st = FORMS[form](state, *args, kind=kind, chunk=chunk)
    y_ref, st_ref = nm.memory_reference(state, *args, kind=kind, chunk=chunk)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_trees_close(st, st_ref, rtol=1e-5, atol=1e-5)


# the parallel form's gradients in the slow tier here: the fast tier compares them with the scan's
# (tests/test_memory_parallel.py)
@pytest.mark.parametrize("form", ["scan", *(pytest.param(f, marks=pytest.mark.slow) for f in ("parallel", "parallel_grouped"))])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradients_match_sequential(kind, form):
    state, args = inputs(kind, seed=1)

    def objective(fn, state, args):
        y, st = fn(state, *args, kind=kind, chunk=4)
        return jnp.sum(jnp.sin(y)) + sum(jnp.sum(jnp.cos(x)) for x in jax.tree.leaves(st))

    g = jax.grad(objective, argnums=(1, 2))(FORMS[form], state, args)
    g_ref = jax.grad(objective, argnums=(1, 2))(nm.memory_reference, state, args)
    assert_trees_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_momentum_and_forget_gate_matter():
    state, (q, k, v, theta, eta, alpha) = inputs("mlp")
    base = nm.memory_forward(state, q, k, v, theta, eta, alpha, kind="mlp", chunk=4)[1]
    no_mom = nm.memory_forward(state, q, k, v, theta, eta * 0, alpha, kind="mlp", chunk=4)[1]
    no_forget = nm.memory_forward(state, q, k, v, theta, eta, alpha * 0, kind="mlp", chunk=4)[1]
    for other in (no_mom, no_forget):
        assert not np.allclose(base["M"]["W1"], other["M"]["W1"])
    # eta = 0 is handled exactly (log floor), matching the reference
    ref = nm.memory_reference(state, q, k, v, theta, eta * 0, alpha, kind="mlp", chunk=4)[1]
    np.testing.assert_allclose(no_mom["M"]["W1"], ref["M"]["W1"], rtol=1e-5, atol=1e-5)


def test_reset_rows():
    state, _ = inputs("linear")
    m0 = {"W": jnp.ones((H, D, D))}
    out = nm.reset_rows(state, m0, jnp.array([True, False]))
    np.testing.assert_array_equal(out["M"]["W"][0], np.ones((H, D, D)))
    np.testing.assert_array_equal(out["S"]["W"][0], 0)
    np.testing.assert_array_equal(out["M"]["W"][1], state["M"]["W"][1])
    np.testing.assert_array_equal(out["S"]["W"][1], state["S"]["W"][1])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_normaliser_bounds_the_curvature(kind):
    """nu_t >= ||J_t||² (the largest Gauss-Newton curvature of token t's loss): the premise of the
    module's stability argument, checked against the exact Jacobian."""
    state, (q, k, *_rest) = inputs(kind, seed=2)
    m = jax.tree.map(lambda w: w * 3.0, state["M"])  # large weights: the bound must still hold
    nu = nm.normaliser(m, k, kind)  # [B, H, T]
    for b in range(B):
        for h in range(H):
            for t in range(T):
                row = jax.tree.map(lambda w: w[b : b + 1, h : h + 1], m)
                f = lambda mm: nm.read(mm, k[b : b + 1, h : h + 1, t : t + 1], kind).ravel()
                jac = jnp.concatenate([j.reshape(D, -1) for j in jax.tree.leaves(jax.jacobian(f)(row))], axis=1)
                assert np.linalg.norm(jac, 2) ** 2 <= nu[b, h, t] * (1 + 1e-5)


def test_the_mlp_normaliser_is_reached():
    """nu's MLP bound is tight where the module docstring's inequalities are equalities: every
    hidden unit at gelu's steepest point (slope GELU_SLOPE, so c enters squared) and a rank-one
    W2. There ||J_t||² is nu_t (less the floor): a looser bound is no bound (a normaliser with c
    in place of c² stayed above the random case of `test_normaliser_bounds_the_curvature`)."""
    d, hid = 4, 8
    k = jnp.zeros((1, 1, 1, d)).at[..., 0].set(1.0)  # a unit key
    steepest = 1.4180  # argmax of gelu' (tanh form), where the slope is 1.12899 <= GELU_SLOPE
    w1 = jnp.zeros((1, 1, d, hid)).at[:, :, 0, :].set(steepest)  # every pre-activation k W1 at it
    u, w = jnp.arange(1.0, hid + 1.0), jnp.array([0.6, 0.8, 0.0, 0.0])
    m = {"W1": w1, "W2": jnp.einsum("f,e->fe", u, w)[None, None]}  # rank one
    slope = jax.grad(jax.nn.gelu)(steepest)
    assert float(slope) == pytest.approx(nm.GELU_SLOPE, rel=1e-5)
    f = lambda mm: nm.read(mm, k, "mlp").ravel()
    jac = jnp.concatenate([j.reshape(d, -1) for j in jax.tree.leaves(jax.jacobian(f)(m))], axis=1)
    curvature = np.linalg.norm(np.asarray(jac), 2) ** 2
    nu = float(nm.normaliser(m, k, "mlp")[0, 0, 0])
    assert curvature <= nu * (1 + 1e-5)
    assert curvature >= (nu - nm.NU_FLOOR) * (1 - 1e-4)  # reached, within gelu's slope at the point


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("chunk,dk", [(1, 4), (16, 4), (64, 64), (256, 16)])
def test_memory_stays_bounded(kind, chunk, dk):
    """Adversarial gates (largest step, momentum near 1, no forgetting) over many tokens of unit
    keys and values: the memory neither diverges nor grows with chunk size or width."""
    t, hid = 1024, 2 * dk
    ks = jax.random.split(jax.random.key(3), 4)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = (unit(jax.random.normal(ks[i], (1, 2, t, dk))) for i in range(3))
    ones = jnp.ones((1, 2, t))
    shapes = {"W": (2, dk, dk)} if kind == "linear" else {"W1": (2, dk, hid), "W2": (2, hid, dk)}
    m0 = {n: jax.random.normal(ks[3], s) / np.sqrt(s[1]) for n, s in shapes.items()}
    for eta in (0.0, 0.99):
        y, st = jax.jit(nm.memory_forward, static_argnames=("kind", "chunk"))(
            nm.init_state(m0, 1), q, k, v, ones, ones * eta, ones * 0, kind=kind, chunk=chunk)
        assert bool(jnp.all(jnp.isfinite(y)))
        # reads stay of the order of the (unit) values
        assert float(jnp.max(jnp.linalg.norm(y, axis=-1))) < 10.0, (eta, float(jnp.max(jnp.abs(y))))


def test_memory_learns_an_association():
    """The inner loop does what it is for: after writing pairs (k_i, v_i) a few times, reading k_i
    returns v_i far better than a fresh memory does."""
    n, d = 8, 32
    ks = jax.random.split(jax.random.key(4), 2)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    keys, vals = unit(jax.random.normal(ks[0], (1, 1, n, d))), unit(jax.random.normal(ks[1], (1, 1, n, d)))
    reps = 16
    k, v = jnp.tile(keys, (1, 1, reps, 1)), jnp.tile(vals, (1, 1, reps, 1))
    g = jnp.ones((1, 1, n * reps))
    state = nm.init_state({"W": jnp.zeros((1, d, d))}, 1)
    _, st = nm.memory_forward(state, k, k, v, g, g * 0.5, g * 0, kind="linear", chunk=n)
    err = jnp.linalg.norm(nm.read(st["M"], keys, "linear") - vals, axis=-1)
    assert float(jnp.max(err)) < 0.4, err  # a fresh (zero) memory is off by 1.0


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_chunk_scale_bounds_the_chunk_curvature(kind):
    """lambda_t >= ||sum_{j <= t} J_j^T J_j / nu_j|| over every prefix of a chunk (exact
    Jacobians): each read's step stays inside its curvature bound whatever the keys; lambda_t =
    t + 1 for identical keys."""
    state, (q, k, *_rest) = inputs(kind, seed=5)
    m = jax.tree.map(lambda w: w * 2.0, state["M"])
    nu = nm.normaliser(m, k, kind)
    lam = nm.chunk_scale(m, k, nu, kind)  # [B, H, T]: the whole sequence as one chunk
    assert lam.shape == (B, H, T)
    for b in range(B):
        for h in range(H):
            row = jax.tree.map(lambda w: w[b : b + 1, h : h + 1], m)
            f = lambda mm: nm.read(mm, k[b : b + 1, h : h + 1], kind).reshape(T, D)
            jac = jnp.concatenate([j.reshape(T, D, -1) for j in jax.tree.leaves(jax.jacobian(f)(row))], axis=2)
            jt = jac / jnp.sqrt(nu[b, h])[:, None, None]  # [T, D, P]
            for t in range(T):
                curv = np.linalg.norm(np.asarray(jt[: t + 1].reshape((t + 1) * D, -1)), 2) ** 2
                assert curv <= lam[b, h, t] * (1 + 1e-5), (t, curv, lam[b, h, t])
    unit = k[:, :, :1] / jnp.linalg.norm(k[:, :, :1], axis=-1, keepdims=True)
    same = jnp.broadcast_to(unit, k.shape)  # unit keys, as the model makes them
    if kind == "linear":
        np.testing.assert_allclose(nm.chunk_scale(m, same, nm.normaliser(m, same, kind), kind),
                                   jnp.broadcast_to(jnp.arange(1, T + 1), (B, H, T)), rtol=1e-3)


def test_chunk_scale_bounds_hidden_features_of_opposite_signs():
    """The MLP memory's bound takes |h_i . h_j|: gelu's negative lobe gives hidden features whose
    products are negative, and the chunk's curvature is then larger than the signed sums say. Two
    tokens, W2 = 0 (so only the output layer's Jacobian, h_t^T, is left): the normalised
    curvature is the largest eigenvalue of [[a, -b], [-b, a]], a + b, above 1."""
    k = jnp.eye(2)[None, None]  # [1, 1, 2 tokens, dk 2]: unit keys
    w1 = jnp.array([[3.0, 0.0], [-0.75, 3.0]])  # k W1: [3, 0] and [-0.75, 3]; gelu(-0.75) < 0
    m = {"W1": w1[None, None], "W2": jnp.zeros((1, 1, 2, 2))}
    nu = nm.normaliser(m, k, "mlp")
    lam = nm.chunk_scale(m, k, nu, "mlp")[0, 0, -1]
    f = lambda mm: nm.read(mm, k, "mlp").reshape(-1)
    jac = jnp.concatenate([j.reshape(4, -1) for j in jax.tree.leaves(jax.jacobian(f)(m))], axis=1)
    jac = jac / jnp.sqrt(jnp.repeat(nu[0, 0], 2))[:, None]  # rows: token 0's two outputs, then token 1's
    curvature = np.linalg.norm(np.asarray(jac), 2) ** 2
    assert curvature > 1.02  # the case the signed sums (<= 1, floored at 1) miss
    assert curvature <= lam * (1 + 1e-5)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_reads_are_causal(kind):
    """Token t's read depends on nothing after t, inside its chunk too: changing every input of
    token t + 1 leaves the reads of tokens <= t bit for bit (generation pads after the current
    token; teacher-forced evaluation scores each token from its past only)."""
    state, args = inputs(kind, seed=6)
    fwd = jax.jit(nm.memory_forward, static_argnames=("kind", "chunk"))
    y = fwd(state, *args, kind=kind, chunk=T)[0]
    for t in (0, 3, T - 2):
        changed = [x.at[:, :, t + 1].set(x[:, :, t + 1] * 3.0 + 0.1) for x in args[:3]]
        changed += [x.at[:, :, t + 1].set(0.9 - 0.8 * x[:, :, t + 1]) for x in args[3:]]  # gates stay in [0, 1]
        y2 = fwd(state, *changed, kind=kind, chunk=T)[0]
        np.testing.assert_array_equal(y2[:, :, : t + 1], y[:, :, : t + 1])
        assert not np.allclose(y2[:, :, t + 1], y[:, :, t + 1])
