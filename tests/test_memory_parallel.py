"""The inner loop with its reads taken out of the loop (`memory.memory_parallel`,
model.nl_lm.memory_impl=parallel) computes what the scan (`memory_forward`) computes: reads, final
states and gradients, at chunk sizes 1 to 64 with rows and heads > 1; its loop runs half the
scan's matrix products per chunk; a training run through it equals one through the scan. (Both
forms against the token-by-token definition: tests/test_memory.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_NL, assert_trees_close, make, train
from nljax.models import memory as nm
from nljax.models import memory_forms as forms
import test_memory_kernel as tmk
from test_memory_kernel import assert_close, assert_grads_close, inputs, outputs_and_grads


# the fast tier has chunks 1 and 64, both kinds, and the MLP training run below (chunk 4, two
# chunks a window, gradients through every parameter): chunk 4 alone runs in the slow tier
slow = pytest.mark.slow


SLOW_CASES = (("mlp", 4, 16), ("linear", 16, 64), ("mlp", 16, 48))


@pytest.mark.parametrize("kind,chunk,t", [("linear", 1, 8), ("mlp", 64, 128),
                                          *(pytest.param(*c, marks=slow) for c in SLOW_CASES)])
def test_parallel_equals_the_scan_outputs_and_gradients(kind, chunk, t):
    state, args = inputs(kind, t, seed=chunk)
    ref, ref_grads = outputs_and_grads(nm.memory_forward, kind, chunk, state, args)
    out, grads = outputs_and_grads(nm.memory_parallel, kind, chunk, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # eta's gradient is ill-conditioned, the more so the longer the chunk (assert_grads_close):
    # seen up to 2.7e-5 of its scale at chunk 16 and 2.1e-4 at 64; every other leaf within 1e-6
    assert_grads_close(grads, ref_grads, 5e-4 if chunk == 64 else 1e-4)


@pytest.mark.parametrize("kind,groups", [("mlp", 2), ("mlp", 8), ("linear", 4)])
def test_reads_in_groups_equal_the_scan(kind, groups):
    """The parallel form's reads in groups of chunks, forward and backward, one group after
    another (what large batches get, `memory.read_groups`): 8 chunks of 4 in 2, 4 or 8 groups, the
    loops unrolled by 3 (in a group of one chunk: 1), as the scan: reads, final states, gradients."""
    state, args = inputs(kind, 32, seed=groups)
    ref, ref_grads = outputs_and_grads(nm.memory_forward, kind, 4, state, args)
    grouped = lambda *a, **kw: nm.memory_parallel(*a, groups=groups, unroll=3, **kw)
    out, grads = outputs_and_grads(grouped, kind, 4, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 1e-4)


def memory_shapes(batch, heads, t, chunk, dim=64, hidden=128):
    """(state, q) of an MLP memory as abstract arrays: shapes only, nothing computed."""
    m = {"W1": jax.ShapeDtypeStruct((batch, heads, dim, hidden), jnp.float32),
         "W2": jax.ShapeDtypeStruct((batch, heads, hidden, dim), jnp.float32)}
    return {"M": m, "S": m}, jax.ShapeDtypeStruct((batch, heads, t, dim), jnp.bfloat16)


@pytest.mark.parametrize("name,batch,heads,t,chunk,groups", [
    ("titans_demo", 4, 4, 512, 32, 1), ("titans_demo", 32, 4, 512, 32, 1), ("titans_demo", 128, 4, 512, 32, 4),
    ("nl_350m", 8, 8, 2048, 64, 1), ("nl_350m", 16, 8, 2048, 64, 2)])
def test_large_batches_read_in_groups(name, batch, heads, t, chunk, groups):
    """The group count at the configs' memory shapes: one group (the computation as it was, the
    same compiled program) at titans_demo's batch 4 and nl_350m's batch 8; at titans_demo's batch
    128, where all 16 chunks at once held 24.3 GB against the scan's 18.4 (H200, offline), 4."""
    state, q = memory_shapes(batch, heads, t, chunk)
    assert nm.read_groups(t // chunk, nm.read_bytes(state, q, chunk)) == groups


def test_read_groups_divide_the_chunks_within_the_budget():
    assert nm.read_groups(16, 10, budget=40) == 4  # 4 chunks a group: 40 bytes
    assert nm.read_groups(12, 10, budget=50) == 3  # 5 would fit, 4 divide 12
    assert nm.read_groups(7, 10, budget=30) == 7  # 7 is prime: one chunk a group
    assert nm.read_groups(5, 100, budget=30) == 5  # one chunk over the budget: still one a group


def test_the_grouping_reaches_both_passes():
    """The gradient's program at titans_demo's batch 128 (traced only): the reads of its 4 groups
    one after another in the forward (a loop of 4 over the groups beside the loop of 16 over the
    chunks' end states) and in the backward (a loop of 4, each iteration pulling back its reads and
    its 4 chunks' end states); at batch 4, loops over the 16 chunks alone."""
    def loop_lengths(batch):
        state, q = memory_shapes(batch, 4, 512, 32)

        def loss(state, q, gates):
            y, st = nm.memory_parallel(state, q, q, q, gates, gates, gates, kind="mlp", chunk=32)
            return jnp.sum(y) + sum(jnp.sum(x) for x in jax.tree.leaves(st))

        def lengths(j):  # (length, nested) of each scan, in program order
            for e in j.eqns:
                subs = [p for p in e.params.values() if hasattr(p, "jaxpr") or hasattr(p, "eqns")]
                inner = [x for p in subs for x in lengths(getattr(p, "jaxpr", p))]
                yield from [(e.params["length"], inner)] if e.primitive.name == "scan" else inner

        gates = jax.ShapeDtypeStruct(q.shape[:3], q.dtype)
        return list(lengths(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, q, gates).jaxpr))

    assert loop_lengths(4) == [(16, []), (16, [])]
    assert loop_lengths(128) == [(16, []), (4, []), (4, [(4, [])])]


def test_groups_must_divide_the_chunks():
    state, args = inputs("linear", 12)
    with pytest.raises(ValueError, match="2 groups do not divide the 3 chunks"):
        nm.memory_parallel(state, *args, kind="linear", chunk=4, groups=2)


@pytest.mark.parametrize("form", [nm.memory_forward, nm.memory_parallel], ids=["scan", "parallel"])
def test_bf16_inputs_are_computed_in_float32(form):
    """Every form takes bfloat16 inputs as float32 (the kernels' tests check theirs): reads and
    state in float32, equal to the scan's on the values upcast."""
    tmk.assert_bf16_inputs_computed_in_float32(form, "mlp")


def test_memory_unroll_reaches_both_loops():
    """3 chunks per loop iteration in the parallel form's forward loop and in its backward one, at
    most the chunks there are (4 here); a number that divides them, in blocks."""
    unrolled = lambda u: lambda *a, **kw: nm.memory_parallel(*a, unroll=u, **kw)
    assert [u for _, u in loops_of(unrolled(3), "mlp")] == [3, 3]
    assert [u for _, u in loops_of(unrolled(9), "mlp")] == [4, 4]
    # 2, which divides the 4 chunks: loops over blocks of 2 chunks (one slice a block, as lax.scan's)
    one, two = loops_of(unrolled(1), "mlp"), loops_of(unrolled(2), "mlp")
    assert [p * 2 for p, _ in one] == [p for p, _ in two] and [u for _, u in two] == [1, 1], (one, two)


@pytest.mark.parametrize("unroll", [2, pytest.param(3, marks=slow)])
def test_parallel_unrolled_and_remat_scan_agree(unroll):
    """The unrolled parallel form equals the scan with remat (what the parallel form's backward
    keeps: the chunk-start states): in blocks of 2 of the 8 chunks, or 3 at a time (fori_loop's
    unrolling, slow: its values are the loop's)."""
    state, args = inputs("mlp", 32, seed=3)
    ref, ref_grads = outputs_and_grads(lambda *a, **kw: nm.memory_forward(*a, remat=True, **kw), "mlp", 4, state, args)
    out, grads = outputs_and_grads(lambda *a, **kw: nm.memory_parallel(*a, unroll=unroll, **kw), "mlp", 4, state, args)
    assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, 1e-4)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_chunk_end_is_the_end_state_of_chunk_step(kind):
    state, (q, k, v, theta, eta, alpha) = inputs(kind, 8, seed=5)
    const = nm.chunk_constants(k, eta, alpha)
    end, _ = nm.chunk_step(state, q, k, v, theta, eta, const, kind)
    assert_close(nm.chunk_end(state, k, v, theta, eta, const, kind), end, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("chunk,zero_key", [(1, False), (8, False), (8, True)])
def test_end_pullback_is_the_end_states_vjp(kind, chunk, zero_key):
    """The parallel form's backward loop pulls each chunk back by hand (`end_pullback`): what
    `jax.vjp` of `end_state` gives, for every input, with the curvature bound at its floor (one
    token: lambda = 1, nothing flows through it) and above it (8 tokens: through one row's sum).
    A zero key makes its row of the MLP memory's |h_i . h_j| zero: the kink of abs, where JAX's
    derivative is +1 (and the scan's gradient takes it)."""
    state, (_, k, v, theta, eta, alpha) = inputs(kind, chunk, seed=chunk)
    if zero_key:
        k = k.at[:, :, 1].set(0.0)
    ends = nm.end_inputs(theta, eta, nm.chunk_constants(k, eta, alpha))
    terms = nm.EndTerms(state["M"], k, v, ends, kind)
    assert bool(jnp.all(terms.lam_raw < 1.0)) if chunk == 1 else bool(jnp.all(terms.lam_raw > 1.0))
    end, pull = jax.vjp(lambda *a: nm.end_state(*a, kind), state, k, v, ends)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(end))))
    d_end = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), end)
    want, got = pull(d_end), nm.end_pullback(state, k, v, ends, kind, d_end)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        scale = float(jnp.max(jnp.abs(x)))
        assert scale > 0 or chunk == 1, jax.tree_util.keystr(path)  # only the floor's cotangents may be zero
        assert float(jnp.max(jnp.abs(y - x))) <= 1e-5 * max(scale, 1e-6), jax.tree_util.keystr(path)


def loops_of(fn, kind: str) -> list[tuple[int, int]]:
    """(matrix products, chunks per iteration) of each `lax.scan` in the gradient of fn's inner
    loop over 4 chunks of 16 tokens (the forward's loop, then the backward's): the products of its
    body counted in the jaxpr, nested calls included."""
    state, args = inputs(kind, 64, d=16, hid=32)

    def loss(state, args):
        y, st = fn(state, *args, kind=kind, chunk=16)
        return jnp.sum(y) + sum(jnp.sum(x) for x in jax.tree.leaves(st))

    def inner(j):
        j = getattr(j, "jaxpr", j)
        return j if hasattr(j, "eqns") else inner(j)

    def products(j):
        return sum((e.primitive.name == "dot_general") + sum(products(inner(p)) for p in e.params.values()
                                                             if hasattr(p, "jaxpr") or hasattr(p, "eqns"))
                   for e in j.eqns)

    def loops(j):
        for e in j.eqns:
            if e.primitive.name == "scan":
                yield products(inner(e.params["jaxpr"])), e.params["unroll"]
            else:
                for p in e.params.values():
                    if hasattr(p, "jaxpr") or hasattr(p, "eqns"):
                        yield from loops(inner(p))

    return list(loops(inner(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, args))))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_parallel_loop_has_at_most_half_the_products_per_chunk(kind):
    """What the form is for: a GPU runs a loop's chunks one after another, each body a few dozen
    small kernels; the parallel form's loops (forward and backward) have at most half the matrix
    products per chunk of the scan with remat (MLP memory: 6 and 21 against 16 and 43; linear: 2
    and 7 against 7 and 18)."""
    scan = [p for p, _ in loops_of(lambda *a, **kw: nm.memory_forward(*a, remat=True, **kw), kind)]
    parallel = [p for p, _ in loops_of(nm.memory_parallel, kind)]
    assert len(scan) == len(parallel) == 2 and min(parallel) > 0, (scan, parallel)
    assert all(2 * p <= s for p, s in zip(parallel, scan, strict=True)), (scan, parallel)


@pytest.mark.parametrize("groups,unroll,lengths", [(1, 1, [8, 8]), (2, 2, [4, 2, 2, 2])])
def test_the_loops_slice_at_an_offset_that_is_not_their_counter(groups, unroll, lengths):
    """The parallel form's loops (forward and backward, over chunks, blocks of chunks or groups)
    slice their inputs and outputs in the body, at `min(i, n - 1)` (or `max(n - 1 - i, 0)`), not
    through `lax.scan`'s own xs and ys: XLA:GPU made the counter's own slices dynamic-slice
    fusions, which keep a loop out of one graph and have its body's graph recorded again before
    every launch (memory._scan). 8 chunks: one loop each way; in 2 groups with blocks of 2 chunks,
    the forward's blocks, the reads' groups, the backward's groups and, in each, its blocks."""
    state, args = inputs("mlp", 128, d=16, hid=32)
    loss = lambda st, a: jnp.sum(nm.memory_parallel(st, *a, kind="mlp", chunk=16, groups=groups, unroll=unroll)[0])

    def loops(j):  # every scan, nested ones after the one holding them
        for e in j.eqns:
            yield from [e] if e.primitive.name == "scan" else []
            for p in e.params.values():
                if hasattr(p, "jaxpr") or hasattr(p, "eqns"):
                    yield from loops(getattr(p, "jaxpr", p))

    def offsets(body):  # what computes the offset of each slice of the body (jax's slicing helpers)
        made = {v: e.primitive.name for e in body.eqns for v in e.outvars}
        return [made.get(e.invars[-1] if e.params["name"] == "dynamic_index_in_dim" else e.invars[2], "counter")
                for e in body.eqns if e.primitive.name in ("jit", "pjit")
                and e.params["name"] in ("dynamic_index_in_dim", "dynamic_update_index_in_dim")]

    found = list(loops(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, args).jaxpr))
    assert [e.params["length"] for e in found] == lengths
    for e in found:
        p = e.params
        assert len(e.invars) == p["num_consts"] + p["num_carry"] and len(e.outvars) == p["num_carry"], p["length"]
        made = offsets(p["jaxpr"].jaxpr)
        assert made and set(made) <= {"min", "max"}, made


def test_memory_impl_parallel_is_selected_on_every_backend():
    ok = dict(kind="mlp", chunk=8, dim=8, hidden=8)  # shapes the Triton kernel could not take
    assert {forms.select("parallel", **ok, backend=b) for b in ("cpu", "gpu")} == {"parallel"}
    fn = forms.inner_loop("parallel", "linear", 4, 8, 8, remat=False, unroll=2)
    assert fn.func is nm.memory_parallel and fn.keywords == {"kind": "linear", "chunk": 4, "unroll": 2}


@pytest.mark.parametrize("kind,mesh", [pytest.param("linear", (1, 2, 1), marks=slow), ("mlp", (1, 2, 1)),
                                       pytest.param("mlp", (1, 1, 2), marks=slow)])
def test_training_through_the_parallel_form_equals_the_scan(kind, mesh):
    """Three steps of a tiny nl_lm with memory_impl=parallel on a (1, 2) mesh, or with tensor
    parallelism (the memory's heads split, mesh.model=2), equal memory_impl=scan on one device:
    losses, parameters (memory0's gradient reaches it through the rows' resets) and every row's
    carried memory."""
    # SGD: Adam's normalised step can turn split heads' float32 sums (another order) into up to a
    # learning rate of difference in a near-zero gradient entry (tests/test_tp.py)
    base = [*TINY_NL, f"model.nl_lm.memory_kind={kind}", "model.nl_lm.memory_dim=4", "data.reset_prob=0.3",
            "cms.periods=[1]", "model.heads=4", "model.nl_lm.memory_heads=4", "optim.name=sgd", "optim.lr=0.1"]
    ref = make([*base, "model.nl_lm.memory_impl=scan"])
    losses_ref, state_ref = train(ref, 3)
    setup = make([*base, "model.nl_lm.memory_impl=parallel"], *mesh)
    assert setup.engine.tp == mesh[2]
    losses, state = train(setup, 3)
    np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)
    canonical = lambda s, st: jax.tree.map(np.asarray, s.engine.strategy.export_state(st).params)
    assert_trees_close(canonical(setup, state), canonical(ref, state_ref), rtol=1e-4, atol=2e-5)
    assert_trees_close(jax.tree.map(np.asarray, state.memory), jax.tree.map(np.asarray, state_ref.memory),
                       rtol=1e-4, atol=2e-5)
