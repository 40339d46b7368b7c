"""Mixed precision (`model.dtype`) and rematerialization (`model.remat`) of the nested-learning LM
(the DiT's bf16: tests/test_meanflow.py)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT, TINY_NL_DEEP, assert_trees_equal, leaf_pairs, make, train

from nljax import config
from nljax.models import build
from nljax.models.layers import RowDense, biased
from nljax.models.nl_lm import CausalConv


def grads(overrides):
    """Gradients of the default model's loss on two rows, carried memory included."""
    model = build(config.load(None, overrides))
    params = jax.jit(model.init)(jax.random.key(0))  # one compile instead of hundreds of eager ops
    tokens = jax.random.randint(jax.random.key(1), (2, 129), 0, 256)
    batch = {"tokens": tokens, "reset": jnp.ones(2, bool)}
    memory = model.init_memory(2)
    return jax.jit(jax.grad(lambda p: model.apply(p, memory, batch)[0]), compiler_options=EXACT)(params)


@pytest.mark.parametrize("remat,kind", [pytest.param("block", "linear", marks=pytest.mark.slow), ("memory", "mlp")])
def test_remat_gradients_are_bitwise_equal(remat, kind):
    """Recomputing a pure function gives the same bits: seed 000's ban on gradient checkpointing
    (a stateful inner loop re-run diverges) does not apply to a functional inner loop."""
    mem = f"model.nl_lm.memory_kind={kind}"
    ref, got = grads(["model.remat=none", mem]), grads([f"model.remat={remat}", mem])
    assert_trees_equal(ref, got)


def test_remat_saves_memory():
    """The compiled step's temporaries shrink with remat of the inner loop (the MLP memory's
    per-chunk weights and per-token pieces are no longer kept for the backward pass)."""
    def temp(remat):
        model = build(config.load(None, [f"model.remat={remat}", "train.seq_len=256", "model.nl_lm.memory_kind=mlp"]))
        params = jax.eval_shape(model.init, jax.random.key(0))
        batch = {"tokens": jax.ShapeDtypeStruct((8, 257), jnp.int32), "reset": jax.ShapeDtypeStruct((8,), bool)}
        memory = jax.eval_shape(lambda: model.init_memory(8))
        fn = jax.jit(jax.grad(lambda p, m, b: model.apply(p, m, b)[0]))
        return fn.lower(params, memory, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp("memory") < 0.9 * temp("none")


def test_remat_keeps_less_for_the_backward_pass():
    """What the forward pass keeps for the backward pass (the residuals of `jax.vjp`: a property
    of the program, not of a backend's buffer assignment), in bf16: model.remat=memory recomputes
    the inner loop's chunks and the elementwise work whose float32 intermediates outweigh their
    bf16 inputs (norms, GELU, attention's scores), block recomputes whole sub-blocks too."""
    def kept(remat):
        model = build(config.load(None, [f"model.remat={remat}", "train.seq_len=256", "model.nl_lm.memory_kind=mlp",
                                         "model.dtype=bfloat16"]))
        params = jax.eval_shape(model.init, jax.random.key(0))
        batch = {"tokens": jax.ShapeDtypeStruct((8, 257), jnp.int32), "reset": jax.ShapeDtypeStruct((8,), bool)}
        memory = jax.eval_shape(lambda: model.init_memory(8))
        residuals = lambda p, m, b: jax.tree.leaves(jax.vjp(lambda p: model.apply(p, m, b)[0], p)[1])
        return sum(r.size * r.dtype.itemsize for r in jax.eval_shape(residuals, params, memory, batch))

    none, memory, block = kept("none"), kept("memory"), kept("block")
    # measured: 249, 93 and 13 MiB (before norms, GELU and scores were recomputed: 279, 219, 23)
    assert memory < 0.5 * none and block < 0.07 * none


def test_layer_norm_is_flax_forward_to_the_bit_and_its_backward():
    """nljax's LayerNorm (a backward pass that keeps only the input and the statistics) computes
    flax's nn.LayerNorm to the bit and its gradients to rounding, in float32 and bfloat16."""
    import flax.linen as nn

    from nljax.models.layers import LayerNorm

    for dtype, rtol, shape in ((jnp.float32, 1e-6, (4, 16, 64)), (jnp.bfloat16, 1e-2, (4, 16, 64)),
                               (jnp.float32, 1e-6, (8, 96))):
        x = (jax.random.normal(jax.random.key(0), shape) * 3 + 1).astype(dtype)
        ref, ours = nn.LayerNorm(dtype=dtype), LayerNorm(dtype)
        params = jax.tree.map(lambda v: v + jax.random.normal(jax.random.key(2), v.shape), ref.init(jax.random.key(1), x))
        np.testing.assert_array_equal(ours.apply(params, x), ref.apply(params, x))
        np.testing.assert_array_equal(jax.jit(ours.apply)(params, x), jax.jit(ref.apply)(params, x))
        loss = lambda m: jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(m.apply(p, x).astype(jnp.float32))), argnums=(0, 1)))
        for a, b in leaf_pairs(loss(ours)(params, x), loss(ref)(params, x)):
            assert a.dtype == b.dtype
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.abs(a - b).max() <= rtol * np.abs(b).max()


def test_dense_dot_gradients_are_autodiffs():
    """dense_dot (the language models' dense layers) differentiates as jax.lax.dot_general does:
    the same cotangents, in the primals' dtypes, on the CPU's path and on the other backends'. In
    bf16 both are held to the float32 gradient of the same rounded inputs, dense_dot's no further
    from it than autodiff's: jax 0.11's XLA:CPU sums lax.dot_general's bf16 kernel gradient less
    exactly (1.6% of the largest entry off, dense_dot's 0.2%; on jax 0.10 both 0.2%: 2026-11-30),
    so the two are not within 1% of each other there."""
    import flax.linen as nn

    from nljax.models.layers import dense_dot, kernel_grad, kernel_grad_transposed_first

    rounded = lambda tree, dtype: jax.tree.map(lambda a: a.astype(dtype).astype(jnp.float32), tree)
    for dtype, rtol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        x = jax.random.normal(jax.random.key(0), (4, 16, 48)).astype(dtype)
        for layer in (lambda dg, dtype=dtype: nn.Dense(40, dtype=dtype, dot_general=dg),
                      lambda dg, dtype=dtype: nn.DenseGeneral((3, 2, 8), use_bias=False, dtype=dtype, dot_general=dg)):
            ref, ours = layer(None), layer(dense_dot)
            params = ref.init(jax.random.key(1), x)
            np.testing.assert_array_equal(ours.apply(params, x), ref.apply(params, x))
            w = jax.random.normal(jax.random.key(4), ref.apply(params, x).shape)  # the output's cotangent
            grad = lambda m, p, x: jax.jit(jax.grad(lambda p, x: jnp.sum(m.apply(p, x).astype(jnp.float32) * w),
                                                    argnums=(0, 1)))(p, x)
            want = jax.tree.leaves(grad(layer(None, jnp.float32), rounded(params, dtype), rounded(x, dtype)))
            for (a, b), exact in zip(leaf_pairs(grad(ours, params, x), grad(ref, params, x)), want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                if dtype == jnp.float32:
                    assert np.abs(a - b).max() <= rtol * np.abs(b).max()
                off = lambda g: np.abs(g - exact).max() / np.abs(exact).max()  # a bias's bf16 sum: ~1%
                assert off(a) <= max(2 * rtol, off(b) + 1e-3), (off(a), off(b))
    for k, m in ((24, 40), (40, 24)):  # x narrower (x transposed), g narrower (g transposed)
        x, g = jax.random.normal(jax.random.key(2), (64, k)), jax.random.normal(jax.random.key(3), (64, m))
        for path in (kernel_grad, kernel_grad_transposed_first):
            np.testing.assert_allclose(jax.jit(path)(x, g), np.asarray(x).T @ np.asarray(g), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a dense layer's contraction"):
        dense_dot(x, g, (((0,), (0,)), ((), ())))


def test_dense_dot_kernel_gradient_is_a_row_major_product_on_cpu():
    """What dense_dot is for: XLA:CPU runs x^T g, the kernel's gradient, as a dot contracting its
    left operand's leading dim (a slow Eigen path, half the matmul peak) unless x^T is formed
    first. If the plain layer stops showing that form, XLA handles it and dense_dot can go."""
    import re

    import flax.linen as nn

    from nljax.models.layers import dense_dot

    def dots(dg, features):
        m = nn.Dense(features, dot_general=dg)
        x = jnp.ones((4, 64, 48))
        p = m.init(jax.random.key(0), x)
        f = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.tanh(m.apply(p, x))), argnums=(0, 1)))
        return re.findall(r"lhs_contracting_dims=\{(\d+)\}", f.lower(p, x).compile().as_text())

    for features in (64, 32):  # x (48 wide) transposed first, then g (32 wide)
        plain, ours = dots(None, features), dots(dense_dot, features)
        assert "0" in plain and len(plain) == 3  # the forward product, x's and the kernel's gradients
        assert "0" not in ours and len(ours) == 3, (features, ours)


@functools.lru_cache(maxsize=None)
def losses(dtype, inter=1, intra=1, steps=4, optim="adamw"):
    """Each step's loss, and the parameters before and after the steps (host copies)."""
    setup = make([*TINY_NL_DEEP, f"model.dtype={dtype}", f"optim.name={optim}"], inter, intra)
    start = jax.device_get(setup.state.params)  # before `train` donates the state
    out, state = train(setup, steps)
    return out, start, jax.device_get(state.params)


def test_bf16_tracks_float32():
    """bfloat16 compute (float32 parameters, optimizer and inner loop) follows the float32 run:
    losses within 1% over the first steps (bf16 has an 8-bit mantissa: ~0.4% per rounding)."""
    f32, bf16 = losses("float32")[0], losses("bfloat16")[0]
    np.testing.assert_allclose(bf16, f32, rtol=1e-2)
    assert not np.array_equal(bf16, f32)  # the dtype did change the arithmetic


@pytest.mark.parametrize("inter,intra", [(1, 2), pytest.param(2, 4, marks=pytest.mark.slow),
                                         pytest.param(4, 2, marks=pytest.mark.slow)])
def test_bf16_matches_single_device(inter, intra):
    """N devices == 1 device in bfloat16, to a looser tolerance than float32's: the per-device
    batches round differently (XLA may fuse a bf16 product differently per shape). SGD keeps
    parameter differences proportional to gradient differences (Adam's normalised step turns a
    sign flip of a near-zero gradient into 2 lr per step, hiding what this test looks for).

    The parameters are compared by what the steps did to them: each run's update (after - before),
    relative to the one-device update's size, as a whole and leaf by leaf. Most updates here are
    ~5e-5, below what a tolerance on the parameters themselves (rtol 1e-2, atol 1e-4 before) can
    tell from rounding. Measured on (1, 2) (2026-12-01; (2, 4) and (4, 2) alike): the whole update
    0.30% apart, the worst leaf 3.2% (the memory block's norm scales, whose updates are ~1e-5);
    with the sync broken, 21-62% apart as a whole (a sum for the mean, each device's own gradient
    for the reduced one, level 1 not reduced), and the worst leaf 119% with only the last 16
    entries of each level's gradient left unreduced, which the losses and the parameter check
    passed."""
    ref_losses, ref_start, ref_end = losses("bfloat16", optim="sgd")
    got_losses, got_start, got_end = losses("bfloat16", inter, intra, optim="sgd")
    np.testing.assert_allclose(got_losses, ref_losses, rtol=2e-3)
    assert_trees_equal(got_start, ref_start)  # one initialisation: the updates start from the same point
    update = lambda end, start: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, end, start)
    got, want = update(got_end, got_start), update(ref_end, ref_start)
    rel = jax.tree.map(lambda g, w: np.linalg.norm(g - w) / np.linalg.norm(w), got, want)  # also: one structure
    far = {jax.tree_util.keystr(p): float(r) for p, r in jax.tree_util.tree_leaves_with_path(rel) if not r < 0.1}
    assert jax.tree.leaves(rel) and not far, far
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    assert np.linalg.norm(flat(got) - flat(want)) < 1e-2 * np.linalg.norm(flat(want))


def test_row_dense_sums_its_bias_gradient_in_float32_under_bfloat16():
    """RowDense in bfloat16 (every CMS level's `down`, the DiT's attention `out` and `mlp_down`):
    the bias is added in float32, so its gradient is a float32 sum of the cotangents. Added in
    bfloat16 it was summed in bfloat16: 4096 rows put it 6.2e-3 from the exact sum."""
    layer = RowDense(32, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (8, 512, 16)).astype(jnp.bfloat16)
    params = layer.init(jax.random.key(1), x)
    ct = (jax.random.normal(jax.random.key(2), (8, 512, 32)) + 0.1).astype(jnp.bfloat16)
    y, vjp = jax.vjp(lambda p: layer.apply(p, x), params)
    assert y.dtype == jnp.bfloat16
    got = np.asarray(jax.jit(vjp)(ct)[0]["params"]["bias"], np.float64)
    exact = np.asarray(ct, np.float64).sum(axis=(0, 1))
    assert np.linalg.norm(got - exact) < 1e-6 * np.linalg.norm(exact)


# (layer, features, its other arguments, an input): nn.Dense as the CMS levels' `up`, the memory's
# `out_gate`, the head, the DiT's `mlp_up` and `final`; nn.DenseGeneral as the DiT's `qkv`; nn.Conv
# as its `patch_embed`
BIASED = {
    "dense32": (nn.Dense, 32, {}, (8, 512, 16)),
    "dense256": (nn.Dense, 256, {}, (8, 512, 16)),
    "dense_general": (nn.DenseGeneral, (3, 2, 4), {}, (8, 512, 16)),
    "conv": (nn.Conv, 8, {"kernel_size": (2, 2), "strides": (2, 2), "padding": "VALID"}, (8, 64, 64, 3)),
}


@pytest.mark.parametrize("case", list(BIASED))
def test_biased_layers_sum_their_bias_gradient_in_float32_under_bfloat16(case):
    """`layers.biased` in bfloat16: flax's layer's parameters (names, shapes, initial values), the
    bias added in float32, so its gradient is a float32 sum of the cotangents (flax's bf16 add:
    6e-3 from the exact sum at 4096 rows); float32 is flax's layer itself."""
    layer, features, kwargs, shape = BIASED[case]
    x = jax.random.normal(jax.random.key(0), shape).astype(jnp.bfloat16)
    plain, ours = layer(features, dtype=jnp.bfloat16, **kwargs), biased(layer, features, jnp.bfloat16, **kwargs)
    params = plain.init(jax.random.key(1), x)
    assert_trees_equal(ours.init(jax.random.key(1), x), params)
    assert type(biased(layer, features, jnp.float32, **kwargs)) is layer
    y, vjp = jax.vjp(lambda p: ours.apply(p, x), params)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(plain.apply(params, x), np.float32), rtol=1e-2, atol=1e-2)
    ct = (jax.random.normal(jax.random.key(2), y.shape) + 0.1).astype(jnp.bfloat16)
    got = jax.jit(vjp)(ct)[0]["params"]
    rows = tuple(range(y.ndim - params["params"]["bias"].ndim))  # every axis but the bias's
    exact = np.asarray(ct, np.float64).sum(axis=rows)
    assert np.linalg.norm(np.asarray(got["bias"], np.float64) - exact) < 1e-6 * np.linalg.norm(exact)


def test_causal_conv_sums_its_gradients_in_float32_under_bfloat16():
    """The memory's causal convolution on bfloat16 inputs: products and sums in float32, so its
    kernel's and bias's gradients are float32 sums over the tokens (in bfloat16: 2.2% and 0.64%
    from the exact sums at 4096 tokens); the output stays bfloat16."""
    conv = CausalConv(4)
    x = jax.random.normal(jax.random.key(0), (8, 512, 3, 2, 4)).astype(jnp.bfloat16)
    params = conv.init(jax.random.key(1), x)
    ct = (jax.random.normal(jax.random.key(2), x.shape) + 0.1).astype(jnp.bfloat16)
    y, vjp = jax.vjp(lambda p: conv.apply(p, x), params)
    assert y.dtype == jnp.bfloat16
    got = jax.jit(vjp)(ct)[0]["params"]
    x64, ct64 = np.asarray(x, np.float64), np.asarray(ct, np.float64)
    xp = np.pad(x64, ((0, 0), (3, 0), (0, 0), (0, 0), (0, 0)))
    exact = {"bias": ct64.sum(axis=(0, 1)), "kernel": np.stack([(xp[:, j : j + 512] * ct64).sum(axis=(0, 1)) for j in range(4)])}
    for name, want in exact.items():
        assert np.linalg.norm(np.asarray(got[name], np.float64) - want) < 1e-6 * np.linalg.norm(want), name
