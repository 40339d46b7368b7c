"""The GPU-minded paths of nl_lm against their reference forms (issue 44): cuDNN's sliding-window
attention (its arguments checked through XLA's implementation, its lowering for CUDA), the
embedding's one-hot and segment-sum gradients, the chunked cross-entropy; and the choice between
them, which on a CPU is the old program."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_close, cli, make, train

from nljax import config
from nljax.errors import ConfigError
from nljax.models import attention, build, compiles, embedding
from nljax.models.chunked_loss import chunked_token_loss
from nljax.models.layers import dense_dot, local_attention, token_loss
from nljax.models.nl_lm import NLLM

# ------------------------------------------------------------------------ attention


@pytest.mark.parametrize("t, window, dtype", [(100, 16, jnp.float32), (40, 50, jnp.float32),
                                              (24, 16, jnp.float32), (96, 16, jnp.bfloat16)])
def test_cudnn_arguments_through_xla_equal_the_blocked_form(t, window, dtype):
    """`fused_local_attention` (what the cudnn form calls: is_causal=True, local_window_size=
    (window - 1, 0), jax's default scale) run by XLA == the blocked form: outputs and gradients,
    T a multiple of the window or not, T <= 2 windows (within one window, where the window
    masks nothing, and past it, where it does: the blocked form's own masked [T, T] path),
    bfloat16 inputs."""
    q, k, v = (jax.random.normal(key, (2, t, 3, 8)).astype(dtype) for key in jax.random.split(jax.random.key(t), 3))
    fused = jax.jit(lambda q, k, v: attention.fused_local_attention(q, k, v, window, implementation="xla"))
    blocked = jax.jit(lambda q, k, v: local_attention(q, k, v, window))
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(fused(q, k, v)), np.float32(blocked(q, k, v)), atol=tol)
    grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)
    assert_trees_close(jax.tree.map(np.float32, grads(fused)), jax.tree.map(np.float32, grads(blocked)),
                       rtol=1e-5 if dtype == jnp.float32 else 5e-2, atol=1e-5 if dtype == jnp.float32 else 5e-2)


def test_a_future_token_changes_nothing_through_the_fused_arguments():
    """The causal flag stays on (jax PR #39576): a later token's key and value leave every earlier
    output unchanged."""
    q, k, v = (jax.random.normal(key, (1, 48, 2, 8)) for key in jax.random.split(jax.random.key(1), 3))
    y = attention.fused_local_attention(q, k, v, 16, implementation="xla")
    y2 = attention.fused_local_attention(q, k.at[:, 30].set(9.0), v.at[:, 30].set(9.0), 16, implementation="xla")
    np.testing.assert_array_equal(y[:, :30], y2[:, :30])
    assert not np.allclose(y[:, 30:46], y2[:, 30:46])  # within the window after it: seen


def tiny_net(**change):
    cfg = config.load(None, [*TINY_NL, "model.dtype=bfloat16", "model.heads=2", "model.dim=32"])
    return dataclasses.replace(build(cfg).net, **change), cfg


def test_cudnn_attention_lowers_for_cuda(monkeypatch):
    """The cudnn form's training step (logits and gradients of a whole tiny nl_lm) lowers for
    CUDA on this CPU machine: cuDNN's forward and backward custom calls, the window passed as
    its sliding_window_length. jax asks the CUDA plugin for cuDNN's version when it traces the
    call (none here: "cuDNN is not detected"), so the test stands in a version (9.10)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    net, cfg = tiny_net(attention="cudnn")
    model = NLLM(net)
    params = jax.eval_shape(model.init, jax.random.key(0))  # shapes only: nothing runs on this CPU
    batch = {"tokens": jnp.zeros((2, cfg.train.seq_len + 1), jnp.int32), "reset": jnp.ones((2,), bool)}
    loss = lambda p: model.apply(p, model.init_memory(2), batch)[0]
    text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
    window = cfg.model.nl_lm.window
    assert f"sliding_window_length\\22: {window}," in text, "the window is not cuDNN's sliding_window_length"
    # causal too: the window alone is a left window only to cuDNN (jax PR #39576), which XLA's
    # form on a CPU (test_a_future_token_changes_nothing_through_the_fused_arguments) does not show
    assert "mask_type\\22: \\22CAUSAL\\22" in text and "NO_MASK" not in text


@pytest.mark.parametrize("choice, dtype, head_dim, cuda, form", [
    ("auto", "float32", 64, False, "blocked"), ("auto", "bfloat16", 64, False, "blocked"),  # a CPU: always blocked
    ("auto", "bfloat16", 64, True, "pallas"), ("auto", "float16", 128, True, "pallas"),
    ("auto", "float32", 64, True, "pallas"), ("auto", "bfloat16", 256, True, "pallas"),  # cuDNN refuses: the kernel
    ("auto", "bfloat16", 48, True, "cudnn"), ("auto", "float16", 24, True, "cudnn"),  # the kernel refuses: cuDNN
    ("auto", "bfloat16", 12, True, "blocked"), ("auto", "float32", 48, True, "blocked"),  # both refuse: blocked
    ("blocked", "bfloat16", 64, True, "blocked"),
    ("cudnn", "bfloat16", 64, True, "cudnn"), ("cudnn", "bfloat16", 128, True, "cudnn"),  # 128: its widest head
])
def test_attention_choice(choice, dtype, head_dim, cuda, form, monkeypatch):
    # the rules by shape; whether a form compiles on the GPU is tests/test_compile_probes.py's
    monkeypatch.setattr(compiles, "refusal", lambda *a: None)
    assert attention.resolve(choice, dtype, head_dim, cuda) == form


@pytest.mark.parametrize("dtype, head_dim, cuda, why", [
    ("bfloat16", 64, False, "cuDNN runs on CUDA GPUs only"), ("float32", 64, True, "bfloat16 or float16 inputs"),
    ("bfloat16", 20, True, "multiple of 8"), ("bfloat16", 136, True, "<= 128"),
])
def test_cudnn_that_cannot_run_is_one_line(dtype, head_dim, cuda, why):
    with pytest.raises(ConfigError, match=why) as e:
        attention.resolve("cudnn", dtype, head_dim, cuda)
    assert "\n" not in str(e.value) and "model.nl_lm.attention=cudnn" in str(e.value)


@pytest.mark.parametrize("override, why", [
    ("model.nl_lm.attention=flash", "model.nl_lm.attention"), ("model.nl_lm.embed_grad=dense", "model.nl_lm.embed_grad"),
    ("model.nl_lm.loss_chunk=-1", "model.nl_lm.loss_chunk must be >= 0"),
])
def test_bad_values_are_refused(override, why):
    with pytest.raises(ConfigError, match=why):
        config.load(None, [override])


def test_cudnn_on_a_cpu_stops_the_command_with_one_line(tmp_path):
    r = cli("nljax.train", "model.nl_lm.attention=cudnn", "model.dtype=bfloat16", "train.steps=1",
            f"run.dir={tmp_path / 'run'}", check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.nl_lm.attention=cudnn" in lines[0] and "CUDA GPUs only" in lines[0], r.stderr


def test_the_default_config_on_a_cpu_keeps_the_old_paths():
    """auto on a CPU: the blocked attention, autodiff's scatter-add, the whole-batch loss."""
    for name in (None, "titans_demo", "nl_350m"):
        net = build(config.load(name, [])).net
        assert (net.attention, net.embed_grad, net.loss_chunk) == ("blocked", "scatter", 0), name
    assert embedding.resolve("auto", 256, "gpu") == "onehot" and embedding.resolve("auto", 50304, "gpu") == "scatter"
    assert embedding.resolve("auto", 256, "cpu") == "scatter" and embedding.resolve("segment", 256, "cpu") == "segment"
    # the one-hot form up to ONEHOT_MAX_VOCAB rows, that many included
    assert [embedding.resolve("auto", v, "gpu") for v in (4096, 4097)] == ["onehot", "scatter"]

# ------------------------------------------------------------------------ embedding


@pytest.mark.parametrize("grad", ["onehot", "segment"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_embedding_gradient_equals_the_scatter_add(grad, dtype):
    """The same parameter (name, initial value) and forward bits as `nn.Embed`; the table's
    gradient equal to autodiff's scatter-add in float32, and in bfloat16 no further from the
    exact sum (float64) than the scatter-add, which sums in bfloat16, is."""
    ids = jax.random.randint(jax.random.key(0), (4, 33), 0, 50)  # repeated ids, and unused rows (50..63)
    plain, ours = nn.Embed(64, 16, dtype=dtype), embedding.Embed(64, 16, dtype=dtype, grad=grad)
    params = plain.init(jax.random.key(1), ids)
    assert_trees_close(ours.init(jax.random.key(1), ids), params, rtol=0, atol=0)
    np.testing.assert_array_equal(ours.apply(params, ids), plain.apply(params, ids))
    ct = jax.random.normal(jax.random.key(2), (4, 33, 16)).astype(dtype)
    table_grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, ids).astype(jnp.float32) * ct))(params)["params"]["embedding"]
    ref, got = np.asarray(table_grad(plain)), np.asarray(table_grad(ours))
    assert got.dtype == np.float32
    exact = np.zeros((64, 16))
    np.add.at(exact, np.asarray(ids).reshape(-1), np.asarray(ct.astype(jnp.float32), np.float64).reshape(-1, 16))
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:
        assert np.abs(got - exact).max() <= np.abs(ref - exact).max() + 1e-6
        np.testing.assert_allclose(got, ref, atol=0.05)
    assert not got[50:].any()


def test_scatter_embedding_sums_its_gradient_in_float32_under_bfloat16():
    """`scatter` in bfloat16: nn.Embed's forward bits, and the table's gradient summed in float32
    (gathered from the float32 table, then cast). nn.Embed's own scatter-add sums the bf16
    cotangents in bf16: 256 tokens per row put it 2.4% from the exact sum (float32: below 1e-6)."""
    ids = jax.random.randint(jax.random.key(0), (8, 512), 0, 16)
    plain, ours = nn.Embed(16, 8, dtype=jnp.bfloat16), embedding.Embed(16, 8, dtype=jnp.bfloat16, grad="scatter")
    params = plain.init(jax.random.key(1), ids)
    np.testing.assert_array_equal(ours.apply(params, ids), plain.apply(params, ids))
    ct = jax.random.normal(jax.random.key(2), (8, 512, 8)).astype(jnp.bfloat16)
    got = jax.grad(lambda p: jnp.sum(ours.apply(p, ids).astype(jnp.float32) * ct))(params)["params"]["embedding"]
    exact = np.zeros((16, 8))
    np.add.at(exact, np.asarray(ids).reshape(-1), np.asarray(ct, np.float64).reshape(-1, 8))
    assert got.dtype == jnp.float32
    assert np.linalg.norm(got - exact) < 1e-6 * np.linalg.norm(exact)


# ------------------------------------------------------------------------ chunked cross-entropy


def full_loss(x, kernel, bias, targets, mask=None, weight=None):
    """The head (nn.Dense(dtype=x.dtype, dot_general=dense_dot)'s arithmetic) and token_loss."""
    x2, k2, b2 = nn.dtypes.promote_dtype(x, kernel, bias, dtype=x.dtype)
    return token_loss(dense_dot(x2, k2, (((2,), (0,)), ((), ()))) + b2, targets, mask, weight)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("masked", ["none", "mask", "mask+weight"])
@pytest.mark.parametrize("chunk", [16, 1000])  # B * T = 111: 7 chunks (the last padded), and one
def test_chunked_loss_equals_the_full_one(dtype, masked, chunk):
    b, t, d, v = 3, 37, 16, 50
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (b, t, d)).astype(dtype)
    kernel, bias = jax.random.normal(keys[1], (d, v)) * 0.3, jax.random.normal(keys[2], (v,))
    targets = jax.random.randint(keys[3], (b, t), 0, v)
    mask = None if masked == "none" else jnp.array([1, 0, 1])
    weight = jax.random.uniform(keys[4], (b, t)) if masked == "mask+weight" else None
    full = lambda *a: full_loss(*a, targets, mask, weight)
    chunked = lambda *a: chunked_token_loss(*a, targets, mask, weight, chunk)
    (l1, n1), (l2, n2) = jax.jit(full)(x, kernel, bias), jax.jit(chunked)(x, kernel, bias)
    tol = 1e-6 if dtype == jnp.float32 else 2e-3
    np.testing.assert_allclose(l2, l1, rtol=tol)
    assert float(n1) == float(n2)
    g1 = jax.jit(jax.grad(lambda *a: full(*a)[0], argnums=(0, 1, 2)))(x, kernel, bias)
    g2 = jax.jit(jax.grad(lambda *a: chunked(*a)[0], argnums=(0, 1, 2)))(x, kernel, bias)
    assert [g.dtype for g in g2] == [g.dtype for g in g1]
    scale = max(float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in g1)
    assert_trees_close(jax.tree.map(np.float32, g2), jax.tree.map(np.float32, g1), rtol=tol * 10,
                       atol=tol * 10 * scale)


def test_chunked_loss_gradients_in_bfloat16_are_as_close_to_float32_as_the_matmul_allows():
    """bf16 compute, 8192 tokens in chunks of 2048, a byte vocabulary: each gradient of the chunked
    loss against the same loss in float32. The bias's gradient sums 8192 cotangents; summed in
    bf16 per chunk it failed the H200's check (2026-11-28) and is 1e-2 off here; in float32 it is
    as close as the float32 matmul's rounding."""
    b, t, d, v = 4, 2048, 64, 256
    keys = jax.random.split(jax.random.key(4), 3)
    x = (jax.random.normal(keys[0], (b, t, d)) / 4).astype(jnp.bfloat16)
    kernel, bias = jax.random.normal(keys[1], (d, v)) * d**-0.5, jnp.zeros((v,))
    targets = jax.random.randint(keys[2], (b, t), 0, v)
    grad = lambda x: jax.jit(jax.grad(lambda *a: chunked_token_loss(*a, targets, chunk=2048)[0], argnums=(0, 1, 2)))(
        x, kernel, bias)
    with jax.default_matmul_precision("highest"):
        ref = grad(x.astype(jnp.float32))
    got = grad(x)
    rel = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / float(jnp.max(jnp.abs(r))))
           for g, r in zip(got, ref, strict=True)]
    assert rel[2] < 1e-3, rel  # the bias
    assert max(rel) < 2e-2, rel  # x and the kernel: bf16 products


def test_chunked_loss_holds_less_memory():
    """Compiled loss and gradients at 8 x 512 tokens and a 8192-id vocabulary: the chunked form's
    temporaries are a fraction of the full form's (which holds [4096, 8192] float32 logits, their
    log-softmax and their cotangents, 128 MiB each)."""
    b, t, d, v = 8, 512, 64, 8192
    x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
    kernel, bias = jax.ShapeDtypeStruct((d, v), jnp.float32), jax.ShapeDtypeStruct((v,), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    temp = lambda f: jax.jit(jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2))).lower(
        x, kernel, bias, targets).compile().memory_analysis().temp_size_in_bytes
    full = temp(lambda x, k, bb, y: full_loss(x, k, bb, y))
    chunked = temp(lambda x, k, bb, y: chunked_token_loss(x, k, bb, y, chunk=512))
    assert full > 4 * b * t * v  # at least one float32 copy of the logits
    assert chunked < full / 4, (chunked, full)


# ------------------------------------------------------------------------ the model with them


GPU_PATHS = ["model.nl_lm.embed_grad=onehot", "model.nl_lm.loss_chunk=24"]


def loss_and_grads(overrides):
    """The tiny nl_lm's loss and parameter gradients on a fixed batch (masked row included), from
    the default paths' initial parameters."""
    base = config.load(None, TINY_NL)
    params = jax.jit(build(base).init)(jax.random.key(0))  # one compile instead of hundreds of eager ops
    model = build(config.load(None, [*TINY_NL, *overrides]))
    tokens = jax.random.randint(jax.random.key(1), (4, base.train.seq_len + 1), 0, base.model.vocab_size)
    batch = {"tokens": tokens, "reset": jnp.ones((4,), bool), "mask": jnp.array([1, 1, 0, 1])}
    return jax.jit(jax.value_and_grad(lambda p: model.apply(p, model.init_memory(4), batch)[0]))(params)


@functools.lru_cache(maxsize=None)
def default_loss_and_grads():
    return loss_and_grads(())


# the segment sum and a one-chunk loss in the whole model: slow tier (each is checked alone above)
@pytest.mark.parametrize("more", [pytest.param(["model.nl_lm.embed_grad=segment", "model.nl_lm.loss_chunk=1000"],
                                               marks=pytest.mark.slow), GPU_PATHS])
def test_nl_lm_loss_and_gradients_equal_the_default_paths(more):
    """The model's loss and every parameter's gradient, with the one-hot or segment embedding
    gradient and the chunked loss (a chunk that divides B * T or not), equal the default paths'."""
    (l1, g1), (l2, g2) = default_loss_and_grads(), loss_and_grads(tuple(more))
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    assert_trees_close(g2, g1, rtol=1e-4, atol=1e-5)  # sums in another order: float32 rounding


@pytest.mark.slow
def test_tensor_parallel_with_the_gpu_paths_matches_one_device():
    """Mesh (1, 2, 2) with tensor parallelism: losses and parameters over 2 steps equal one
    device's with the default paths. The embedding and the head are replicated under tensor
    parallelism (their gradients those of one device), so the one-device test above covers the
    paths; this one (slow tier) runs them inside the sharded step."""
    tp = [*TINY_NL, "model.heads=4", "model.nl_lm.memory_heads=4", "optim.name=sgd", "optim.lr=0.1"]
    one, many = make(tp), make([*tp, *GPU_PATHS], 1, 2, 2)
    assert many.engine.tp == 2
    l1, s1 = train(one, 2)
    ln, sn = train(many, 2)
    np.testing.assert_allclose(ln, l1, rtol=2e-5)
    p1, pn = one.engine.strategy.export_state(s1).params, many.engine.strategy.export_state(sn).params
    assert_trees_close(jax.tree.map(np.asarray, pn), jax.tree.map(np.asarray, p1), rtol=1e-4, atol=1e-5)


def test_a_model_trained_with_gpu_forms_is_read_with_the_forms_that_run_here(tmp_path):
    """generate, lm_eval, nljax.load and exports read a run trained with cuDNN attention and the
    Pallas memory kernel on a CPU by the forms `auto` picks here (the same outputs), unless the
    user's overrides name a form."""
    import yaml

    from nljax.models.builtin import for_this_backend
    from nljax.run import trained

    gpu = config.load(None, ["model.nl_lm.attention=cudnn", "model.nl_lm.memory_impl=pallas"])
    here = for_this_backend(gpu)
    assert (here.model.nl_lm.attention, here.model.nl_lm.memory_impl) == ("auto", "auto")
    kept = for_this_backend(gpu, keep={"model.nl_lm.memory_impl"})
    assert (kept.model.nl_lm.attention, kept.model.nl_lm.memory_impl) == ("auto", "pallas")
    assert for_this_backend(config.load(None, ["model.nl_lm.attention=blocked"])).model.nl_lm.attention == "blocked"
    loop = config.load(None, ["model.nl_lm.memory_impl=parallel_pallas"])  # the loop kernel: GPU-only too
    assert for_this_backend(loop).model.nl_lm.memory_impl == "auto"
    assert for_this_backend(config.load(None, ["model.nl_lm.memory_impl=parallel"])).model.nl_lm.memory_impl == "parallel"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(gpu), sort_keys=False))
    cfg = trained.config_of(run_dir)
    assert (cfg.model.nl_lm.attention, cfg.model.nl_lm.memory_impl) == ("auto", "auto")
    build(cfg)  # builds on this CPU (cudnn would stop it with one line)
    cfg = trained.config_of(run_dir, overrides=["model.nl_lm.attention=pallas"])
    assert cfg.model.nl_lm.attention == "pallas"


def test_a_pallas_form_on_a_cpu_is_said_at_start_up():
    """memory_impl or attention set to a Pallas kernel trains on a CPU by its interpret mode, as
    asked, only slowly: the start-up says so (it said nothing); the forms that run here, nothing."""
    from nljax.models.builtin import interpreted
    from nljax.run.trainer import startup_report

    setup, lines = make([*TINY_NL, "model.nl_lm.memory_impl=parallel_pallas", "model.nl_lm.attention=pallas"]), []
    startup_report(setup, setup.state, lines.append)
    notes = [line for line in lines if "interpret mode" in line]
    assert [n.split()[1] for n in notes] == ["model.nl_lm.attention=pallas", "model.nl_lm.memory_impl=parallel_pallas"]
    assert all(n.endswith("is a GPU kernel: on cpu it runs in Pallas's interpret mode, slowly (for checking; "
                          "auto takes the forms that run here)") for n in notes), notes
    model = setup.engine.model
    assert interpreted(config.load(None, ["model.nl_lm.memory_impl=parallel", "model.nl_lm.attention=blocked"]), model) == []
    # another model reads no nl_lm section, whatever it holds
    assert interpreted(config.load("meanflow_digits", ["model.nl_lm.memory_impl=pallas"]), object()) == []
