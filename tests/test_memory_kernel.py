"""The fused Pallas memory kernel (nljax/models/memory_kernel.py) computes what the scan
(`memory_forward`) and the token-by-token definition (`memory_reference`) compute: reads, final
states and gradients, in interpret mode on CPU; it lowers for CUDA (Triton) on this CPU-only
machine; `model.nl_lm.memory_impl` selects it, and a training run through it equals one through
the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_NL, assert_trees_close, leaf_pairs, make, train
from nljax import config
from nljax.errors import ConfigError
from nljax.models import memory as nm
from nljax.models import memory_forms as forms
from nljax.models import memory_kernel as mk
from nljax.models.platform import cuda_lowering

B, H, D, HID = 2, 3, 8, 16  # rows and heads > 1
slow = pytest.mark.slow
# Each interpreted case compiles the kernel, its backward and the reference: 10-25 s on the 2-core
# machine. The fast tier covers every chunk size and both memory kinds; the slow tier the rest.


def inputs(kind, t, seed=0, dtype=jnp.float32, d=D, hid=HID):
    """State and (q, k, v, theta, eta, alpha) as NeuralMemory makes them: unit-norm q, k, v, gates
    in (0, 1), a memory0 with weight in both layers and a non-zero momentum."""
    ks = jax.random.split(jax.random.key(seed), 10)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = (unit(jax.random.normal(ks[i], (B, H, t, d))).astype(dtype) for i in range(3))
    u = lambda i, lo, hi: jax.random.uniform(ks[i], (B, H, t), minval=lo, maxval=hi).astype(dtype)
    gates = (u(3, 0.05, 1.0), u(4, 0.0, 0.95), u(5, 0.0, 0.3))
    shapes = {"W": (H, d, d)} if kind == "linear" else {"W1": (H, d, hid), "W2": (H, hid, d)}
    m0 = {n: jax.random.normal(ks[6 + i], s) * (1.0 if n == "W1" else 0.3) for i, (n, s) in enumerate(shapes.items())}
    state = nm.init_state(m0, B)
    state["S"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(ks[9], x.shape), state["S"])
    return state, (q, k, v, *gates)


def objective(fn, kind, chunk):
    """A scalar of the reads and the final state that weighs every entry differently; the reads
    and the state come out as its aux."""
    def f(state, args):
        y, st = fn(state, *args, kind=kind, chunk=chunk)
        return jnp.sum(jnp.sin(3 * y)) + sum(jnp.sum(jnp.cos(x)) for x in jax.tree.leaves(st)), (y, st)
    return f


def outputs_and_grads(fn, kind, chunk, state, args):
    """((y, final state), gradients w.r.t. (state, (q, k, v, theta, eta, alpha))), one compilation."""
    grads, out = jax.jit(jax.grad(objective(fn, kind, chunk), argnums=(0, 1), has_aux=True))(state, args)
    return out, grads


def kernel(state, *args, kind, chunk):
    return mk.memory_kernel(state, *args, kind=kind, chunk=chunk, interpret=True)


def assert_close(a, b, rtol, atol):
    for x, y in leaf_pairs(a, b):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def assert_grads_close(a, b, tol):
    """Each gradient leaf within `tol` of the reference's largest entry: the gradient w.r.t. eta
    is ill-conditioned (log eta near eta = 0), and there the scan itself is 1.6e-4 of that scale
    from a float64 evaluation at chunk 64, the kernel 1.7e-4."""
    for x, y in leaf_pairs(a, b):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        scale = np.abs(y).max()
        assert scale > 1e-4  # every input moves the objective: the comparison is not of zeros
        assert np.abs(x - y).max() <= tol * scale, (np.abs(x - y).max(), scale)


@pytest.mark.parametrize("kind", ["linear", pytest.param("mlp", marks=slow)])
def test_kernel_equals_the_token_by_token_definition(kind):
    """Reads, final state and gradients at chunk 4 over two chunks; the reads and state both
    from the forward pass that keeps the chunk-start states for the backward and from the one
    that does not (no gradient taken). (The MLP kernel's gradients against the scan's in the fast
    tier, the scan's against this reference in tests/test_memory.py.)"""
    chunk = 4
    state, args = inputs(kind, t=8, seed=3)
    out, grads = outputs_and_grads(kernel, kind, chunk, state, args)
    ref, ref_grads = outputs_and_grads(nm.memory_reference, kind, chunk, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_close(jax.jit(lambda s, a: kernel(s, *a, kind=kind, chunk=chunk))(state, args), ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 1e-4)


@pytest.mark.parametrize("kind,chunk", [("linear", 1), ("mlp", 4), ("linear", 16), ("mlp", 64),
                                        *(pytest.param(k, c, marks=slow) for k, c in
                                          (("mlp", 1), ("linear", 4), ("mlp", 16), ("linear", 64)))])
def test_kernel_equals_the_scan_outputs_and_gradients(kind, chunk):
    """Reads, final state, and the gradients of both w.r.t. every input: q, k, v, the gates and
    the initial state (M and S), over several chunks (the state carried between them)."""
    state, args = inputs(kind, t=2 * chunk if chunk > 4 else 16, seed=chunk + 1)
    out, grads = outputs_and_grads(kernel, kind, chunk, state, args)
    ref, ref_grads = outputs_and_grads(nm.memory_forward, kind, chunk, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 5e-4)


def test_the_mlp_kernel_walks_its_hidden_width_in_tiles(monkeypatch):
    """The MLP memory's hidden width in four tiles (the kernels' loops over tiles: sums over the
    width accumulated, each tile's state and its cotangent stored on their own) gives the scan's
    reads, final state and gradients. (The other tests' width, 16, is one tile of 16.)"""
    monkeypatch.setattr(mk, "HIDDEN_TILE", 4)
    assert HID // mk._hidden_tile(HID) == 4
    chunk = 4
    state, args = inputs("mlp", t=12, seed=5)
    out, grads = outputs_and_grads(kernel, "mlp", chunk, state, args)
    ref, ref_grads = outputs_and_grads(nm.memory_forward, "mlp", chunk, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 5e-4)


@pytest.mark.parametrize("kind", ["linear", pytest.param("mlp", marks=slow)])
def test_scan_backward_equals_the_backward_kernel(kind):
    """backward="scan" (the fallback: XLA's reverse scan of the chunk's vjp after the forward
    kernel) gives the backward kernel's gradients."""
    state, args = inputs(kind, t=32, seed=11)
    scan_bwd = lambda s, *a, **kw: mk.memory_kernel(s, *a, interpret=True, backward="scan", **kw)
    (out, grads), (ref, ref_grads) = (outputs_and_grads(f, kind, 16, state, args) for f in (scan_bwd, kernel))
    assert_close(out, ref, rtol=0, atol=0)  # the same forward kernel
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("kind", [pytest.param("linear", marks=slow), "mlp"])
def test_bf16_inputs(kind):
    """bfloat16 q, k, v and gates: the kernel computes in float32 from them, as the scan does on
    the same values upcast (1e-5); its gradients come back in bfloat16 (their rounding: 1e-2)."""
    assert_bf16_inputs_computed_in_float32(kernel, kind)


def assert_bf16_inputs_computed_in_float32(fn, kind):
    """`fn` (an inner loop) on bfloat16 inputs: float32 reads and state equal to the scan's on the
    same values upcast, gradients in bfloat16 within their rounding."""
    chunk = 16
    state, args = inputs(kind, t=32, seed=7, dtype=jnp.bfloat16)
    up = tuple(x.astype(jnp.float32) for x in args)
    (y, st), grads = outputs_and_grads(fn, kind, chunk, state, args)
    ref, ref_grads = outputs_and_grads(nm.memory_forward, kind, chunk, state, up)
    assert y.dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(st))
    assert_close((y, st), ref, rtol=1e-5, atol=1e-5)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(grads[1]))
    assert_grads_close(grads, ref_grads, 1e-2)


def test_sequence_not_a_multiple_of_the_chunk():
    assert_refuses_a_sequence_not_a_multiple_of_the_chunk(kernel)


def assert_refuses_a_sequence_not_a_multiple_of_the_chunk(fn):
    state, args = inputs("linear", t=12)
    with pytest.raises(ValueError, match="not a multiple of the memory chunk 8"):
        fn(state, *args, kind="linear", chunk=8)


@pytest.mark.parametrize("kind,chunk,d", [("linear", 16, 32), ("mlp", 64, 64)])
def test_kernel_lowers_for_cuda(kind, chunk, d):
    """Forward and backward lower through Pallas' Triton backend on this CPU-only machine: the
    lowering errors a GPU session would meet (an op without a Triton rule, a shape it refuses)
    show here."""
    state, args = inputs(kind, t=2 * chunk, d=d, hid=2 * d)
    fwd = lambda s, a: mk.memory_kernel(s, *a, kind=kind, chunk=chunk, interpret=False)
    grad = jax.grad(objective(lambda s, *a, **_: fwd(s, a), kind, chunk), argnums=(0, 1), has_aux=True)
    with cuda_lowering():
        texts = [jax.jit(f).trace(state, args).lower(lowering_platforms=("cuda",)).as_text() for f in (fwd, grad)]
    assert [t.count("__gpu$xla.gpu.triton") for t in texts] == [1, 2]  # forward; forward and backward


def test_select():
    ok = dict(kind="mlp", chunk=32, dim=64, hidden=128)
    assert forms.select("auto", **ok, backend="cpu") == "scan"
    assert forms.select("auto", **ok, backend="gpu") == "parallel"  # the faster on an H200, 2026-11-30
    assert forms.select("pallas", **ok, backend="cpu") == "pallas"  # interpreted
    assert forms.select("scan", **ok, backend="gpu") == "scan"
    small = {**ok, "chunk": 8}
    assert forms.select("auto", **small, backend="gpu") == "parallel"  # no kernel: any shape
    with pytest.raises(ConfigError, match="memory_chunk=8: the Pallas memory kernel needs powers of two >= 16"):
        forms.select("pallas", **small, backend="gpu")
    assert mk.gpu_unsupported("linear", 64, 48, 1) == (
        "model.nl_lm.memory_dim=48: the Pallas memory kernel needs powers of two >= 16 on a GPU")
    assert mk.gpu_unsupported("linear", 64, 64, 1) is None  # the hidden width is the MLP's only


def test_unknown_memory_impl_is_one_line_error():
    line = r"model.nl_lm.memory_impl' must be one of \['auto', 'scan', 'parallel', 'pallas', 'parallel_pallas'\], got 'fast'"
    with pytest.raises(ConfigError, match=line):
        config.load(None, ["model.nl_lm.memory_impl=fast"])


# slow tier (18 s linear, about 60 s MLP on the shared 2-core machine); the fast tier has the
# kernel's equality with the scan above, and the parallel form's training run (tests/test_memory_parallel.py)
# goes through the same wiring (memory_forms.inner_loop)
@slow
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_training_through_the_kernel_equals_the_scan(kind, monkeypatch):
    """A few steps of a tiny nl_lm with memory_impl=pallas (interpreted) on two devices equal
    memory_impl=scan on one: losses, parameters (memory0's gradient reaches it through the rows'
    resets) and every row's carried memory. The kernel is traced only for pallas."""
    calls = []
    kernel_fn = mk.memory_kernel
    monkeypatch.setattr(mk, "memory_kernel", lambda *a, **kw: calls.append(kw) or kernel_fn(*a, **kw))
    base = [*TINY_NL, f"model.nl_lm.memory_kind={kind}", "model.nl_lm.memory_dim=4", "data.reset_prob=0.3",
            "cms.periods=[1]"]  # one compiled step variant
    ref = make([*base, "model.nl_lm.memory_impl=scan"])
    losses_ref, state_ref = train(ref, 3)
    assert not calls
    resets = [np.asarray(ref.batch(s)["reset"]) for s in (1, 2)]  # (step 0 resets every row)
    assert any(r.any() for r in resets) and not all(r.all() for r in resets)  # some rows restart, others carry
    setup = make([*base, "model.nl_lm.memory_impl=pallas"], 1, 2)
    losses, state = train(setup, 3)
    assert calls and all(c["kind"] == kind for c in calls)
    np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)
    assert_trees_close(state.params, state_ref.params, rtol=1e-4, atol=2e-5)
    assert_trees_close(state.memory, state_ref.memory, rtol=1e-4, atol=2e-5)


@pytest.mark.slow  # ~20 s on the 2-core CI machine; the GPU suite's dry run (slow too) runs it as well
def test_benchmark_runs_interpreted(tmp_path):
    """benchmarks/memory_kernel.py (the GPU suite's `kernel` part) at tiny shapes, interpreted: its
    check passes, its JSON has the form benchmarks/gpu_summary.py reads (not the figures: CPU)."""
    import json
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_summary
        import memory_kernel
    finally:
        sys.path.pop(0)
    out = tmp_path / "memory_kernel.json"
    argv = ["--shapes", "tiny", "--interpret", "--rounds", "1", "--warmup", "0", "--out", str(out)]
    assert memory_kernel.main(argv) == 0
    r = json.loads(out.read_text())["shapes"]["tiny"]
    assert not r["errors"] and all(c["ok"] and c["max_rel_err"]["grads"] < 1e-5 for c in r["check"].values())
    jax_pullback = memory_kernel.JAX_PULLBACK
    assert set(r["check"]) == set(memory_kernel.VARIANTS) == {*memory_kernel.KERNELS, "parallel", jax_pullback}
    assert set(r["median_ms"]) == {"scan forward", "scan forward+backward", "kernel forward", "kernel forward+backward",
                                   "kernel, scan backward forward+backward", "parallel forward",
                                   "parallel forward+backward", "loop kernel forward", "loop kernel forward+backward",
                                   f"{jax_pullback} forward", f"{jax_pullback} forward+backward"}
    rows = gpu_summary.memory_kernel_lines(json.loads(out.read_text()))
    assert len(rows) == 6
    assert all("tiny's shapes" in r and "check ok" in r for r in rows[:5])
    assert [r.split()[0] for r in rows][3:] == ["info"] * 3 and all(r.startswith(("MET", "MISS")) for r in rows[:3])
    assert "the hand-written pull-back (end_pullback)" in rows[5]
    # --variant: the scan and the variants named, nothing else
    assert memory_kernel.main([*argv, "--variant", "loop kernel"]) == 0
    r = json.loads(out.read_text())["shapes"]["tiny"]
    assert set(r["check"]) == {"loop kernel"} and len(r["median_ms"]) == 4
    assert "loop kernel fwd+bwd" in gpu_summary.memory_kernel_lines(json.loads(out.read_text()), "loop kernel")[0]


def test_benchmark_counts_launches_without_the_card(monkeypatch, tmp_path, capsys):
    """`--launches GPU` compiles each variant's forward + backward and counts its kernels, per call
    and per chunk (the loops' bodies); here for this machine's CPU in place of the card (what
    it does with XLA:GPU's compiler is the same calls). The parallel form's loops run fewer
    operations per chunk than the scan's."""
    import json
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_compile
        import memory_kernel
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(gpu_compile, "gpu_device", lambda gpu: jax.devices()[0])
    out = tmp_path / "launches.json"
    argv = ["--launches", "h200", "--shapes", "tiny", "--variant", "parallel", "--out", str(out)]
    assert memory_kernel.main(argv) == 0
    counts = json.loads(out.read_text())["shapes"]["tiny"]["launches"]
    assert set(counts) == {"scan", "parallel"}
    assert all(c["total"] > c["per_chunk"] > 0 for c in counts.values())
    assert counts["parallel"]["per_chunk"] < counts["scan"]["per_chunk"]
    par = counts["parallel"]
    assert f"parallel: {par['total']:,} ({par['per_chunk']} per chunk)" in capsys.readouterr().out


def test_resume_may_change_memory_impl_with_a_warning(tmp_path):
    """memory_impl changes how the step computes, not what a checkpoint holds: a resume may change
    it (a warning: the rounding differs), unlike the memory's shapes."""
    from nljax.checkpoint.restore import _changed_settings
    from nljax.run.resuming import check_unchanged

    saved = config.load(None, [*TINY_NL, "model.nl_lm.memory_impl=scan"])
    resumed = config.load(None, [*TINY_NL, "model.nl_lm.memory_impl=pallas"])
    check_unchanged(saved, resumed, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="model.nl_lm.memory_dim=4 cannot change on resume"):
        check_unchanged(saved, config.load(None, [*TINY_NL, "model.nl_lm.memory_dim=4"]), tmp_path / "config.yaml")
    assert _changed_settings({"config": config.to_dict(saved)}, resumed) == [
        "resuming with model.nl_lm.memory_impl='pallas' (the checkpoint was written with 'scan')"]
