"""The parallel form's loop as Pallas kernels (nljax/models/memory_loop_kernel.py,
`memory_impl=parallel_pallas`) computes what the scan computes: its per-chunk statement equals
`memory.chunk_end`; reads, final states and gradients equal `memory_forward`'s in interpret mode
on CPU (the MLP memory's hidden width in several tiles and in one); bfloat16 inputs; it lowers for
CUDA (Triton) here; a training run through it equals one through the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_NL, assert_trees_close, make, train
from nljax.errors import ConfigError
from nljax.models import memory as nm
from nljax.models import memory_forms as forms
from nljax.models import memory_kernel as mk
from nljax.models import memory_loop_kernel as ml
from nljax.models.platform import cuda_lowering
import test_memory_kernel as tmk
from test_memory_kernel import HID, assert_close, assert_grads_close, inputs, objective, outputs_and_grads

slow = pytest.mark.slow
# Each interpreted case compiles the kernels, their backward and the scan: 6-12 s on the 2-core
# machine. The fast tier has one case of each memory kind (the MLP's in tiles); the slow the rest.


def loop_kernel(state, *args, kind, chunk):
    return ml.memory_parallel_kernel(state, *args, kind=kind, chunk=chunk, interpret=True)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_end_math_equals_chunk_end(kind):
    """The kernels' per-chunk statement (2-D, one row and head, from `loop_inputs`) is
    `memory.chunk_end`: the end state of a chunk from a state with weight and momentum, every
    row and head."""
    state, (_, k, v, theta, eta, alpha) = inputs(kind, t=8, seed=2)
    want = nm.chunk_end(state, k, v, theta, eta, nm.chunk_constants(k, eta, alpha), kind)
    ins, _ = ml.loop_inputs(k, v, theta, eta, alpha, chunk=8)  # one chunk
    one = lambda M, S, k, v, *terms: ml.end_math(M, S, k, v, terms, kind)
    M, S = jax.jit(jax.vmap(jax.vmap(one)))(state["M"], state["S"], *ins)
    assert_close((M, S), (want["M"], want["S"]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(jax.tree.leaves(M)[0]), np.asarray(jax.tree.leaves(state["M"])[0]))


@pytest.mark.parametrize("kind,chunk,tiles", [("linear", 4, 1), ("mlp", 16, 4),
                                              *(pytest.param(*c, marks=slow) for c in
                                                (("linear", 1, 1), ("mlp", 1, 1), ("mlp", 4, 1), ("linear", 64, 1),
                                                 ("mlp", 64, 2)))])
def test_equals_the_scan_outputs_and_gradients(kind, chunk, tiles, monkeypatch):
    """Reads, final state, and the gradients of both w.r.t. q, k, v, the gates and the initial
    state (M and S), over several chunks; the MLP memory's hidden width walked in `tiles` tiles
    (the kernels' loops over tiles: sums over the width accumulated, each tile's state and its
    cotangent stored on their own). Against the scan within its own rounding (the slow tier),
    and against `memory_parallel`, the same arithmetic in XLA, within 1e-5 (the fast tier, where
    a wrong term in one gradient shows far below the scan's tolerance)."""
    monkeypatch.setattr(mk, "HIDDEN_TILE", HID // tiles)
    state, args = inputs(kind, t=2 * chunk if chunk > 4 else 16, seed=chunk + 1)
    out, grads = outputs_and_grads(loop_kernel, kind, chunk, state, args)
    fast = chunk in (4, 16)
    ref, ref_grads = outputs_and_grads(nm.memory_parallel if fast else nm.memory_forward, kind, chunk, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 1e-5 if fast else 5e-4)


@pytest.mark.parametrize("kind", ["linear", pytest.param("mlp", marks=slow)])
def test_orthogonal_and_repeated_keys(kind):
    """One-hot keys, each repeated, and one zero key: exact zeros and ties in the curvature bound's
    terms (|k_i . k_j|, the rows whose sum is the largest; the MLP's |h_i . h_j|, zero for the
    zero key's h = gelu(0)), where |x|'s and max's slopes are the conventions' (jnp.abs: +1 at
    0): the gradients equal `memory_parallel`'s."""
    state, (q, k, v, *gates) = inputs(kind, t=16, seed=4)
    k = jax.nn.one_hot(jnp.arange(16) // 2 % k.shape[-1], k.shape[-1])[None, None] * jnp.ones_like(k)
    k = k.at[:, :, 5].set(0.0)
    out, grads = outputs_and_grads(loop_kernel, kind, 4, state, (q, k, v, *gates))
    ref, ref_grads = outputs_and_grads(nm.memory_parallel, kind, 4, state, (q, k, v, *gates))
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_bf16_inputs(kind):
    """bfloat16 q, k, v and gates: computed in float32 from them, as the scan does on the same
    values upcast; the gradients come back in bfloat16."""
    tmk.assert_bf16_inputs_computed_in_float32(loop_kernel, kind)


def test_sequence_not_a_multiple_of_the_chunk():
    tmk.assert_refuses_a_sequence_not_a_multiple_of_the_chunk(loop_kernel)


@pytest.mark.parametrize("kind,chunk,d", [("linear", 16, 32), ("mlp", 64, 64)])
def test_lowers_for_cuda(kind, chunk, d):
    """Forward and backward lower through Pallas' Triton backend on this CPU-only machine: one
    kernel forward, the forward's and the backward's under a gradient."""
    state, args = inputs(kind, t=2 * chunk, d=d, hid=2 * d)
    fwd = lambda s, a: ml.memory_parallel_kernel(s, *a, kind=kind, chunk=chunk, interpret=False)
    grad = jax.grad(objective(lambda s, *a, **_: fwd(s, a), kind, chunk), argnums=(0, 1), has_aux=True)
    with cuda_lowering():
        texts = [jax.jit(f).trace(state, args).lower(lowering_platforms=("cuda",)).as_text() for f in (fwd, grad)]
    assert [t.count("__gpu$xla.gpu.triton") for t in texts] == [1, 2]
    assert "memory_end_backward_kernel" in texts[1] and "memory_end_forward_kernel" in texts[0]


def test_select():
    ok = dict(kind="mlp", chunk=32, dim=64, hidden=128)
    assert forms.select("parallel_pallas", **ok, backend="cpu") == "parallel_pallas"  # interpreted
    assert forms.select("parallel_pallas", **ok, backend="gpu") == "parallel_pallas"
    with pytest.raises(ConfigError, match="memory_impl=parallel_pallas: model.nl_lm.memory_chunk=8: the Pallas"):
        forms.select("parallel_pallas", **{**ok, "chunk": 8}, backend="gpu")
    fn = forms.inner_loop("parallel_pallas", "mlp", 32, 64, 128, remat=False, unroll=1)
    assert fn.func is ml.memory_parallel_kernel and fn.keywords == {"kind": "mlp", "chunk": 32}


@pytest.mark.slow  # 15-30 s each on the 2-core machine
@pytest.mark.parametrize("mesh", [(1, 2, 1), (1, 1, 2)])
def test_training_through_the_loop_kernel_equals_the_scan(mesh, monkeypatch):
    """Three steps of a tiny nl_lm with memory_impl=parallel_pallas (interpreted) on a (1, 2) mesh,
    or with tensor parallelism (the memory's heads split, mesh.model=2), equal memory_impl=scan on
    one device: losses, parameters and every row's carried memory."""
    calls = []
    fn = ml.memory_parallel_kernel
    monkeypatch.setattr(ml, "memory_parallel_kernel", lambda *a, **kw: calls.append(kw) or fn(*a, **kw))
    # SGD: Adam's normalised step can turn split heads' float32 sums (another order) into up to a
    # learning rate of difference in a near-zero gradient entry (tests/test_tp.py)
    base = [*TINY_NL, "model.nl_lm.memory_kind=mlp", "model.nl_lm.memory_dim=4", "data.reset_prob=0.3",
            "cms.periods=[1]", "model.heads=4", "model.nl_lm.memory_heads=4", "optim.name=sgd", "optim.lr=0.1"]
    ref = make([*base, "model.nl_lm.memory_impl=scan"])
    losses_ref, state_ref = train(ref, 3)
    assert not calls
    setup = make([*base, "model.nl_lm.memory_impl=parallel_pallas"], *mesh)
    assert setup.engine.tp == mesh[2]
    losses, state = train(setup, 3)
    assert calls
    np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)
    canonical = lambda s, st: jax.tree.map(np.asarray, s.engine.strategy.export_state(st).params)
    assert_trees_close(canonical(setup, state), canonical(ref, state_ref), rtol=1e-4, atol=2e-5)
    assert_trees_close(jax.tree.map(np.asarray, state.memory), jax.tree.map(np.asarray, state_ref.memory),
                       rtol=1e-4, atol=2e-5)
