"""The Pallas sliding-window flash attention (nljax/models/attention_kernel.py) computes what the
blocked form (`layers.local_attention`) computes: outputs, log-sum-exp and gradients, in interpret
mode on CPU; its loops read only the tiles the window touches; it lowers for CUDA (Triton) on this
CPU-only machine; `model.nl_lm.attention=pallas` selects it, and a training run through it equals
one through the blocked form."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_close, assert_trees_equal, leaf_pairs, make, train

from nljax import config
from nljax.errors import ConfigError
from nljax.models import attention, build, compiles
from nljax.models import attention_kernel as ak
from nljax.models.layers import local_attention
from nljax.models.nl_lm import NLLM
from nljax.models.platform import cuda_lowering


def qkv(t, dtype=jnp.float32, b=2, h=3, hd=16, seed=0):
    """q, k, v [b, t, h, hd] and a cotangent for the output, standard normal."""
    keys = jax.random.split(jax.random.key(seed + t), 4)
    return [jax.random.normal(key, (b, t, h, hd)).astype(dtype) for key in keys]


def kernel(window, bq, bk):
    return lambda q, k, v: ak.flash_attention(q, k, v, window, block_q=bq, block_k=bk, interpret=True)


def blocked(window):
    return lambda q, k, v: local_attention(q, k, v, window)


def out_and_grads(attend, q, k, v, ct):
    """(y, (dq, dk, dv)) for the cotangent ct, as float32."""
    return jax.tree.map(lambda x: np.asarray(x, np.float32), vjp_fn(attend)(q, k, v, ct))


def vjp_fn(attend):
    """The jitted (q, k, v, ct) -> (y, (dq, dk, dv)) of `attend`."""
    def f(q, k, v, ct):
        y, pull = jax.vjp(attend, q, k, v)
        return y, pull(ct.astype(y.dtype))
    return jax.jit(f)


def max_rel_err(a, b) -> float:
    """The largest difference of any leaf, relative to that leaf's largest entry in b (absolute
    where b's leaf is zero: dQ and dK at a window of 1, where each token sees only itself)."""
    errs, scales = [], []
    for x, y in leaf_pairs(a, b):
        scales.append(np.abs(y).max())
        errs.append(np.abs(x - y).max() / (scales[-1] or 1.0))
    assert max(scales) > 1e-3  # not a comparison of zeros
    return max(errs)


# T, window, query tile, key tile: T and the window multiples of the tiles or not (T padded), the
# window > T, the window 1, unequal tiles, the default (64) tiles clamped to T and the window,
# tiles of 8 (interpret mode only: several tiles per window and more loop steps)
CASES = [(64, 16, 16, 16), (70, 24, 16, 16), (40, 50, 16, 16), (48, 1, 16, 16), (96, 20, 32, 16),
         (80, 40, 16, 32), (100, 12, 64, 64), (40, 12, 8, 8)]


@pytest.mark.parametrize("t, window, bq, bk", CASES)
def test_float32_outputs_and_gradients_equal_the_blocked_form(t, window, bq, bk):
    q, k, v, ct = qkv(t)
    got = out_and_grads(kernel(window, bq, bk), q, k, v, ct)
    ref = out_and_grads(blocked(window), q, k, v, ct)
    assert max_rel_err(got, ref) < 2e-6


@pytest.mark.parametrize("t, window, bq, bk", [(96, 20, 32, 16), (40, 12, 8, 8)])
def test_bfloat16_inputs(t, window, bq, bk):
    """bfloat16 q, k, v: against the float32 blocked form on the same (rounded) values, the
    kernel's error is the bfloat16 blocked form's at most (both round the probabilities to
    bfloat16 before they meet v; the kernel keeps its sums in float32), and its gradients come
    back in bfloat16."""
    q, k, v, ct = qkv(t, jnp.bfloat16, seed=1)
    exact = out_and_grads(blocked(window), *(x.astype(jnp.float32) for x in (q, k, v)), ct.astype(jnp.float32))
    got = vjp_fn(kernel(window, bq, bk))(q, k, v, ct)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    got, ref = jax.tree.map(lambda x: np.asarray(x, np.float32), got), out_and_grads(blocked(window), q, k, v, ct)
    assert max_rel_err(got, exact) <= 1.5 * max_rel_err(ref, exact)
    assert max_rel_err(got, exact) < 2e-2


@pytest.mark.parametrize("t, window", [(50, 7), (24, 40)])
def test_log_sum_exp_is_each_querys_over_its_window(t, window):
    """The saved log-sum-exp [B, H, T] is that of the scaled logits q.k / sqrt(hd) over keys
    t - window + 1 .. t (dense masked reference), and the forward alone gives the output."""
    q, k, v, _ = qkv(t, seed=2)
    y, lse = jax.jit(lambda q, k, v: ak.flash_forward(q, k, v, window, block_q=16, block_k=16, interpret=True))(q, k, v)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    back = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    ref = jax.nn.logsumexp(jnp.where((back >= 0) & (back < window), logits, -jnp.inf), axis=-1)
    assert lse.shape == (2, 3, t) and lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, ref, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(y, jax.jit(blocked(window))(q, k, v), atol=2e-6)


def test_the_loops_read_only_the_tiles_the_window_touches():
    """Cost O(T * window): NaN keys and values before the first tile that a query tile's window
    touches leave its outputs and dQ finite and unchanged (a loop from key tile 0 would carry 0 *
    NaN into them); a NaN cotangent after the last query tile that sees a key tile leaves that
    tile's dK and dV unchanged (the dK/dV loop's upper bound)."""
    t, window, tile = 128, 16, 16
    q, k, v, ct = qkv(t, seed=3)
    f = vjp_fn(kernel(window, tile, tile))
    y, (dq, dk, dv) = f(q, k, v, ct)
    # query tile 4 (tokens 64..79) reads key tiles 3.. (tokens 48..): poison tokens 0..47
    poisoned = [x.at[:, :48].set(jnp.nan) for x in (k, v)]
    y2, (dq2, _, _) = f(q, *poisoned, ct)
    np.testing.assert_array_equal(y2[:, 64:], y[:, 64:])
    np.testing.assert_array_equal(dq2[:, 64:], dq[:, 64:])
    assert np.isnan(y2[:, :48]).all()  # the poison is real where it is read
    # key tile 1 (tokens 16..31) is seen by queries up to 46, query tiles up to 2 (tokens ..47)
    _, (_, dk2, dv2) = f(q, k, v, ct.at[:, 48:].set(jnp.nan))
    np.testing.assert_array_equal(dk2[:, :32], dk[:, :32])
    np.testing.assert_array_equal(dv2[:, :32], dv[:, :32])
    assert np.isnan(dv2[:, 48:]).all()


def test_tiles_are_clamped_to_the_sequence_and_the_window():
    assert ak.tiles(4096, 512, 64, 64) == (64, 64, 4096)
    assert ak.tiles(48, 1, 64, 64) == (64, 16, 64)  # never below 16 by clamping; T padded to the tile
    assert ak.tiles(100, 24, 64, 64) == (64, 32, 128)
    assert ak.tiles(40, 12, 8, 8) == (8, 8, 40)  # asked for: interpret mode only
    with pytest.raises(ValueError, match="block_k must be a power of two, got 48"):
        ak.tiles(64, 16, 64, 48)
    q = jnp.zeros((1, 32, 1, 16))
    with pytest.raises(ValueError, match="forward tiles 8 x 8: the compiled kernel needs tiles >= 16"):
        ak.flash_attention(q, q, q, 4, block_q=8, block_k=8, interpret=False)


def test_each_kernel_takes_its_own_tiles():
    """Per-kernel tiles (`Tuning`: forward, dK/dV and dQ each its own query and key tiles, T padded
    to a multiple of all of them) compute what the blocked form computes, and what uniform tiles
    compute to rounding."""
    t, window = 70, 24
    q, k, v, ct = qkv(t, seed=4)
    tuning = ak.Tuning(forward=ak.Tiles(16, 32), dkv=ak.Tiles(32, 16), dq=ak.Tiles(16, 16))
    resolved = ak.Tuning(ak.Tiles(16, 32, 4), ak.Tiles(32, 16, 4), ak.Tiles(16, 16, 4))
    assert tuning.resolved(t, window, 16) == (resolved, 96)
    got = out_and_grads(lambda q, k, v: ak.flash_attention(q, k, v, window, tuning=tuning, interpret=True), q, k, v, ct)
    assert max_rel_err(got, out_and_grads(blocked(window), q, k, v, ct)) < 2e-6
    assert max_rel_err(got, out_and_grads(kernel(window, 16, 16), q, k, v, ct)) < 2e-6


@pytest.mark.parametrize("t, window, bq, bk", [*CASES, (128, 64, 16, 16), (128, 40, 16, 32), (100, 33, 32, 16)])
def test_loops_split_at_the_windows_edges_give_the_masked_loops_values(t, window, bq, bk):
    """`Tiles.split`: the mask only on the edge tiles of each loop (forward, dK/dV, dQ). The tiles
    left unmasked are ones every query sees whole, so the outputs and gradients are the masked
    loops' to the bit (a tile taken for whole that is not would let a query see a key outside its
    window), and the blocked form's."""
    q, k, v, ct = qkv(t, seed=5)
    split = ak.Tuning(*(ak.Tiles(bq, bk, split=True),) * 3)
    got = out_and_grads(lambda q, k, v: ak.flash_attention(q, k, v, window, tuning=split, interpret=True), q, k, v, ct)
    want = out_and_grads(kernel(window, bq, bk), q, k, v, ct)
    assert_trees_equal(got, want)
    assert max_rel_err(got, out_and_grads(blocked(window), q, k, v, ct)) < 2e-6


def test_the_split_loops_leave_the_mask_off_most_tiles():
    """At a window of 512 in 64-token tiles a query tile's loop runs 9 key tiles, 7 of them seen
    whole by every query (the unmasked middle loop); the dK/dV kernel's likewise."""
    for q0 in (1024, 1536):
        lo, hi, a, b = (int(x) for x in ak._key_tiles(q0, 64, 64, 512))
        assert (hi - lo, min(b, hi) - max(a, lo)) == (9, 7)


@pytest.mark.parametrize("t, window", [(48, 1), (48, 5), (48, 16), (45, 17), (48, 47), (40, 100)])
def test_the_loops_bounds_are_exactly_the_tiles_the_window_touches_and_sees_whole(t, window):
    """Both loops' bounds (`_key_tiles`: the forward and dQ kernels', `_query_tiles`: the dK/dV
    kernel's) against every (query tile, key tile) pair's visibility counted token by token, at tiles
    1 .. 16 each way: [lo, hi) the tiles with some query-key pair in the window, [a, b) within them
    the ones seen whole. A bound too wide reads or unmasks what it must not (the split test's
    mutations); one too narrow leaves a tile masked that need not be (no wrong value, a slower loop)."""
    for bq, bk in itertools.product((1, 2, 4, 8, 16), repeat=2):
        tp = -(-t // max(bq, bk)) * max(bq, bk)
        pos = np.arange(tp)
        back = pos[:, None] - pos[None, :]  # query - key
        seen = ((back >= 0) & (back < window)).reshape(tp // bq, bq, tp // bk, bk)
        some, whole = seen.any(axis=(1, 3)), seen.all(axis=(1, 3))  # [query tile, key tile]

        def check(bounds, some, whole):  # each row of `some`: one tile of the grid, its loop's tiles
            lo, hi, a, b = (np.asarray(x) for x in bounds)
            for i, (l, h) in enumerate(zip(lo, hi, strict=True)):
                a_, b_ = min(max(a[i], l), h), min(max(b[i], min(max(a[i], l), h)), h)  # as `_loops` clips
                assert list(np.flatnonzero(some[i])) == list(range(l, h)), (bq, bk, i)
                assert list(np.flatnonzero(whole[i])) == list(range(a_, b_)), (bq, bk, i)

        check(ak._key_tiles(jnp.arange(0, tp, bq), bq, bk, window), some, whole)
        check(ak._query_tiles(jnp.arange(0, tp, bk), bq, bk, window, tp // bq), some.T, whole.T)


def test_each_kernel_is_launched_with_its_own_warps_and_stages():
    """The warps and pipeline stages asked for each kernel reach its Triton launch (lowered for
    CUDA here, split loops too); warps 0 is 4 at heads of 64, 8 above."""
    import re
    tuning = ak.Tuning(forward=ak.Tiles(128, 64, 8, 3), dkv=ak.Tiles(64, 128, 4, 1, split=True),
                       dq=ak.Tiles(64, 32, 0, 4, split=True))
    f = lambda q, k, v: ak.flash_attention(q, k, v, 256, tuning=tuning, interpret=False)
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    q = jnp.zeros((1, 512, 2, 64), jnp.bfloat16)
    with cuda_lowering():
        text = jax.jit(grad).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    launches = {m[1]: (int(m[3]), int(m[2])) for m in
                re.finditer(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    assert launches == {"attention_forward": (8, 3), "attention_dkv": (4, 1), "attention_dq": (4, 4)}


@pytest.mark.parametrize("t, dtype", [(256, jnp.bfloat16), (200, jnp.float32)])
def test_kernel_lowers_for_cuda(t, dtype):
    """Forward and backward lower through Pallas' Triton backend on this CPU-only machine: the
    forward kernel, then the forward, dK/dV and dQ kernels (T a multiple of the tiles, or
    padded)."""
    q = jnp.zeros((2, t, 4, 64), dtype)
    f = lambda q, k, v: ak.flash_attention(q, k, v, 100, interpret=False)
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    with cuda_lowering():
        texts = [jax.jit(g).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text() for g in (f, grad)]
    assert [text.count("__gpu$xla.gpu.triton") for text in texts] == [1, 3]


def test_model_with_pallas_attention_lowers_for_cuda_without_a_second_forward(monkeypatch):
    """A whole tiny nl_lm's gradient with attention=pallas and model.remat=memory lowers for CUDA,
    three kernels per block: the fused form keeps no scores, so remat does not wrap it in
    jax.checkpoint (which would run its forward kernel twice)."""
    cfg = config.load(None, [*TINY_NL, "model.dtype=bfloat16", "model.heads=2", "model.dim=32", "model.depth=2",
                             "model.remat=memory", "model.nl_lm.memory_impl=scan"])
    flash = attention.flash_attention  # compiled, as on a GPU (interpreted on this CPU otherwise)
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **kw: flash(*a, **kw, interpret=False))
    net = dataclasses.replace(build(cfg).net, attention="pallas")
    model = NLLM(net)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = {"tokens": jnp.zeros((2, cfg.train.seq_len + 1), jnp.int32), "reset": jnp.ones((2,), bool)}
    loss = lambda p: model.apply(p, model.init_memory(2), batch)[0]
    with cuda_lowering():
        text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3 * cfg.model.depth


@pytest.mark.parametrize("choice, dtype, head_dim, cuda, form", [
    ("auto", "bfloat16", 64, False, "blocked"), ("auto", "float32", 64, False, "blocked"),  # a CPU: always blocked
    ("pallas", "float32", 12, False, "pallas"),  # a CPU: interpreted, any head width
    ("auto", "bfloat16", 64, True, "pallas"), ("auto", "float32", 64, True, "pallas"),  # the kernel first
    ("auto", "bfloat16", 48, True, "cudnn"),  # the kernel refuses a width that is not a power of two
    ("auto", "bfloat16", 256, True, "pallas"),  # cuDNN refuses heads over 128
    ("auto", "float32", 48, True, "blocked"),  # both refuse
    ("pallas", "bfloat16", 64, True, "pallas"), ("blocked", "float32", 64, True, "blocked"),
])
def test_attention_choice(choice, dtype, head_dim, cuda, form, monkeypatch):
    # the rules by shape; whether a form compiles on the GPU is tests/test_compile_probes.py's
    monkeypatch.setattr(compiles, "refusal", lambda *a: None)
    assert attention.resolve(choice, dtype, head_dim, cuda) == form


@pytest.mark.parametrize("dtype, head_dim, why", [("float32", 48, "power of two >= 16"),
                                                  ("bfloat16", 8, "power of two >= 16"),
                                                  ("int8", 64, "float32, bfloat16 or float16")])
def test_pallas_that_cannot_compile_is_one_line(dtype, head_dim, why):
    with pytest.raises(ConfigError, match=why) as e:
        attention.resolve("pallas", dtype, head_dim, cuda=True)
    assert "\n" not in str(e.value) and str(e.value).startswith("model.nl_lm.attention=pallas: ")


def test_pallas_on_a_cpu_builds_the_kernel_path():
    net = build(config.load(None, [*TINY_NL, "model.nl_lm.attention=pallas"])).net
    assert net.attention == "pallas"
    assert build(config.load(None, TINY_NL)).net.attention == "blocked"


def test_training_through_the_kernel_equals_the_blocked_form(monkeypatch):
    """Three steps of a tiny nl_lm (no memory: the attention alone) with attention=pallas
    (interpreted) on two devices equal attention=blocked on one: losses and parameters. T = 32
    over a window of 4: two query tiles, the blocked form's blocks proper (T > 2 windows). The
    kernel is traced only for pallas."""
    calls = []
    flash = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **kw: calls.append(a[3]) or flash(*a, **kw))
    base = [*TINY_NL, "train.seq_len=32", "model.nl_lm.window=4", "cms.periods=[1]", "model.nl_lm.memory_layers=[]"]
    losses_ref, state_ref = train(make([*base, "model.nl_lm.attention=blocked"]), 3)
    assert not calls
    losses, state = train(make([*base, "model.nl_lm.attention=pallas"], 1, 2), 3)
    assert calls and set(calls) == {4}
    np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)
    assert_trees_close(state.params, state_ref.params, rtol=1e-4, atol=2e-5)


def test_resume_may_change_the_attention_form_with_a_warning():
    from nljax.checkpoint.restore import _changed_settings

    saved = config.load(None, [*TINY_NL, "model.nl_lm.attention=blocked"])
    resumed = config.load(None, [*TINY_NL, "model.nl_lm.attention=pallas"])
    assert _changed_settings({"config": config.to_dict(saved)}, resumed) == [
        "resuming with model.nl_lm.attention='pallas' (the checkpoint was written with 'blocked')"]
