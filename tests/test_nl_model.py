"""The nested-learning LM under the engine: rank-local memory, resets, single-device reference."""

import functools

import jax
import numpy as np
import pytest
from helpers import TINY_NL_DEEP, assert_trees_close, leaf_pairs, make, replicas, train

from nljax import config
from nljax.data.text import SEPARATOR, ContextStream
from nljax.measure import hlo
from nljax.parallel import levels

NL = [*TINY_NL_DEEP, "model.nl_lm.memory_kind=mlp"]
STEPS = 4


@functools.lru_cache(maxsize=None)
def reference(kind):
    setup = make([*NL, f"model.nl_lm.memory_kind={kind}"], 1, 1)
    losses, state = train(setup, STEPS)
    return losses, jax.device_get(state.params), jax.device_get(state.memory), jax.device_get(state.opt_state)


@pytest.mark.parametrize(
    # every mesh of the rule with the MLP memory; the linear memory across devices: tests/test_tp.py
    "inter,intra,kind", [(1, 2, "mlp"), pytest.param(2, 2, "mlp", marks=pytest.mark.slow), (2, 4, "mlp"),
                          pytest.param(4, 2, "mlp", marks=pytest.mark.slow)]
)
def test_matches_single_device_including_memory(inter, intra, kind):
    ref_losses, ref_params, ref_memory, ref_opt = reference(kind)
    setup = make([*NL, f"model.nl_lm.memory_kind={kind}"], inter, intra)
    losses, state = train(setup, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    # Adam turns float32 reduction-order noise in near-zero gradients into ~1e-5 differences
    # (the learning rate is 1e-2); anything structural is orders of magnitude larger.
    assert_trees_close(state.params, ref_params, rtol=1e-4, atol=2e-5)
    # every row's memory, gathered from the devices that own it, equals the reference's row
    assert_trees_close(state.memory, ref_memory, rtol=1e-4, atol=2e-5)
    # Adam's moments (its steps barely see a gradient scaled alike everywhere, its moments do)
    assert_trees_close(state.opt_state, ref_opt, rtol=1e-4, atol=1e-7)


def test_memory_is_rank_local_and_never_communicated():
    setup = make(NL, 2, 4)
    _, state = train(setup, 3)
    for leaf in jax.tree.leaves(state.params):
        copies = replicas(leaf)
        assert all(np.array_equal(c, copies[0]) for c in copies[1:])
    m = state.memory["block1"]["M"]["W1"]  # [G, H, dk, hidden], split by rows
    shards = m.addressable_shards
    assert len(shards) == 8 and shards[0].data.shape[0] == m.shape[0] // 8
    assert not np.allclose(np.asarray(shards[0].data), np.asarray(shards[1].data))
    # memory changed from its initial value and carries over to the next step
    w0 = np.asarray(state.params["mem1"]["memory0_W1"])
    assert not np.allclose(np.asarray(m)[0], w0)
    # the compiled step moves exactly the active levels' gradient bytes: no memory collective
    for active in [(True, False), (True, True)]:
        batch = setup.batch(0)
        text = setup.cache.train_fn(active, state, batch).as_text()
        sizes = levels.level_sizes(state.params, setup.engine.level_tree, 2)
        colls = hlo.collectives(text, dict(setup.mesh.shape))
        rs = [c for c in colls if c.op == "reduce-scatter"]
        want = sum(-(-sizes[l][0] // 4) * 4 * 4 for l in range(2) if active[l])
        assert sum(c.bytes for c in rs) == want
        assert all(c.op in ("reduce-scatter", "all-reduce", "all-gather") for c in colls)
        assert sum(c.bytes for c in colls if c.op == "all-reduce") == want // 4


def test_stream_resets_exactly_rows_with_a_boundary():
    data = np.full(64, 7, np.uint8)
    data[[5, 40]] = SEPARATOR  # rows start at 0, 16, 32, 48 with seq_len 4
    s = ContextStream(data, rows=4, seq_len=4)
    resets = [s.rows_at(step, np.arange(4))["reset"].tolist() for step in range(5)]
    assert resets[0] == [True] * 4  # every stream starts fresh
    # row 0's chunk at step 1 holds inputs [4, 8) (boundary at 5); row 2's at step 2 holds [40, 44)
    assert resets[1:] == [[False] * 4, [True, False, False, False], [False, False, True, False], [False] * 4]
    # a subset of rows gives the same flags for those rows (each device builds only its own)
    assert s.rows_at(3, np.array([2, 3]))["reset"].tolist() == [True, False]


def test_reset_rows_start_from_memory0():
    """A row flagged for reset behaves as a fresh stream; the other rows keep their memory."""
    setup = make(NL, 1, 1)
    model, params = setup.engine.model, jax.device_get(setup.state.params)
    batch = jax.device_get(setup.batch(1))
    key = jax.random.key(1)
    memory = jax.tree.map(lambda x: jax.random.normal(key, x.shape), model.init_memory(8))
    fresh = model.init_memory(8)
    reset = np.zeros(8, bool)
    reset[[2, 5]] = True
    apply = jax.jit(model.apply)  # one compile for the three forwards instead of eager ops
    out_mixed = apply(params, memory, {**batch, "reset": reset})[2]
    out_fresh = apply(params, fresh, {**batch, "reset": np.ones(8, bool)})[2]
    out_kept = apply(params, memory, {**batch, "reset": np.zeros(8, bool)})[2]
    assert jax.tree.structure(out_mixed) == jax.tree.structure(out_fresh) == jax.tree.structure(out_kept)
    assert jax.tree.leaves(out_mixed)
    for mixed, fr, kept in zip(jax.tree.leaves(out_mixed), jax.tree.leaves(out_fresh), jax.tree.leaves(out_kept),
                               strict=True):
        mixed, fr, kept = map(np.asarray, (mixed, fr, kept))
        np.testing.assert_allclose(mixed[[2, 5]], fr[[2, 5]], rtol=1e-6)
        others = [0, 1, 3, 4, 6, 7]
        np.testing.assert_allclose(mixed[others], kept[others], rtol=1e-6)
        assert not np.allclose(mixed[[2, 5]], kept[[2, 5]])


@pytest.mark.parametrize("inter,intra,accum", [pytest.param(1, 1, 4, marks=pytest.mark.slow), (1, 2, 2)])
def test_accumulation_equals_one_step_on_the_whole_batch(inter, intra, accum):
    """accum micro-batches per device, synchronized once: same losses, params and memory."""
    ref_losses, ref_params, ref_memory, ref_opt = reference("mlp")
    setup = make([*NL, "model.nl_lm.memory_kind=mlp", f"train.accum_steps={accum}"], inter, intra)
    losses, state = train(setup, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=1e-4, atol=2e-5)
    assert_trees_close(state.memory, ref_memory, rtol=1e-4, atol=2e-5)
    assert_trees_close(state.opt_state, ref_opt, rtol=1e-4, atol=1e-7)


def test_accumulation_that_does_not_divide_is_an_error():
    from nljax.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.accum_steps=3 does not divide the 4 rows each device holds"):
        make([*NL, "train.accum_steps=3"], 1, 2)


def test_non_finite_memory_row_restarts_and_others_are_untouched():
    """A row whose memory is NaN leaves the step with memory0 (so it cannot poison later steps);
    the other rows are exactly what they would be without it."""
    setup = make(NL, 1, 1)
    model, params = setup.engine.model, jax.device_get(setup.state.params)
    batch = {**jax.device_get(setup.batch(1)), "reset": np.zeros(8, bool)}
    key = jax.random.key(2)
    memory = jax.tree.map(lambda x: jax.random.normal(key, x.shape), model.init_memory(8))
    poisoned = jax.tree.map(lambda x: x.at[3].set(np.nan), memory)
    apply = jax.jit(model.apply)  # one compile for both forwards instead of eager ops
    clean_out = apply(params, memory, batch)[2]
    out = apply(params, poisoned, batch)[2]
    fresh = model.init_memory(1)
    for leaf, clean in leaf_pairs(out, clean_out):
        leaf, clean = np.asarray(leaf), np.asarray(clean)
        assert np.isfinite(leaf[3]).all()
        others = [0, 1, 2, 4, 5, 6, 7]
        np.testing.assert_array_equal(leaf[others], clean[others])
    # the restarted row holds memory0 (M), bit for bit, and zero momentum (S)
    assert list(out) == ["block1"] and jax.tree.structure(fresh) == jax.tree.structure(out)
    for name, m in out["block1"]["M"].items():
        np.testing.assert_array_equal(np.asarray(m)[3], np.asarray(params["mem1"][f"memory0_{name}"]), err_msg=name)
    assert all(not np.asarray(s)[3].any() for s in jax.tree.leaves(out["block1"]["S"]))


@pytest.mark.parametrize("kind", ["mlp"])  # the linear memory: tests/test_memory.py's causal reads
def test_logits_are_causal(kind):
    """The whole model reads nothing after token t at t, inside a memory chunk too (the memory's
    step scale of a read covers the chunk's tokens <= t only): changing token t + 1 leaves logits
    <= t bit for bit. Memory in both blocks, a chunk of 16 longer than the attention window of 4
    (the memory reaches what attention does not), two windows in a row (the second reads the
    first's memory). Random parameters: init's memory0 output layer is zero."""
    import jax.numpy as jnp

    from nljax.models import build

    model = build(config.load(None, [*NL, f"model.nl_lm.memory_kind={kind}", "model.nl_lm.memory_layers=[0,1]",
                                     "model.nl_lm.memory_chunk=16", "train.seq_len=32"]))
    keys = iter(jax.random.split(jax.random.key(2), 100))
    params = jax.tree.map(lambda w: w + 0.3 * jax.random.normal(next(keys), w.shape), model.init(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(3), (2, 2, 33), 0, 256)

    @jax.jit
    def logits(tokens):
        memory, out = model.init_memory(2), []
        for w in range(2):
            lg, memory = model.logits(params, memory, {"tokens": tokens[:, w], "reset": jnp.full((2,), w == 0)})
            out.append(lg)
        return jnp.concatenate(out, axis=1)  # [B, 64, V]

    change = lambda p: logits(tokens.at[:, p // 32, p % 32].add(7) % 256)  # input token p of the 64
    base = logits(tokens)
    for t in (2, 9, 14, 40):  # inside the first chunk, its end, inside the second window
        changed = change(t + 1)
        np.testing.assert_array_equal(changed[:, : t + 1], base[:, : t + 1])
        assert not np.allclose(changed[:, t + 1], base[:, t + 1])
    # far beyond the 2 x 3 tokens attention reaches: only the memory carries token 3 there
    assert not np.allclose(change(3)[:, 30], base[:, 30])


def test_every_block_starts_as_the_identity():
    """At init every block adds nothing to the residual stream (attention's, the memory's and the
    CMS MLPs' output layers are zero), so a memory in any block first reads the token embeddings,
    not a random mix of them (docs/experiments/2026-11-27-where-the-memory-goes.md):
    the logits at t depend on token t alone, bit for bit, whatever came before it."""
    import jax.numpy as jnp

    from nljax.models import build

    model = build(config.load(None, ["model.nl_lm.memory_layers=[0,1]", "model.nl_lm.memory_kind=mlp"]))
    params = model.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 129), 0, 256)
    other = tokens.at[:, :100].set((tokens[:, :100] + 1) % 256)  # every earlier token changed
    logits = lambda t: model.logits(params, model.init_memory(2), {"tokens": t, "reset": jnp.ones(2, bool)})[0]
    np.testing.assert_array_equal(logits(other)[:, 100:], logits(tokens)[:, 100:])


@pytest.mark.parametrize("embed", [True, pytest.param(False, marks=pytest.mark.slow)])  # 22 s each
def test_a_later_memory_reads_the_tokens_under_a_shared_stream(embed):
    """On the recall probe block 0's CMS MLPs learn a large output that is the same at every
    position (docs/experiments/2026-11-27-where-the-memory-goes.md); here a bias of
    rms 6 stands in for it. Block 1's memory input is then almost all shared from its stream
    alone; with `memory_embed` it also reads the normalised token embeddings, and at most about
    half of it is shared. Read from what the memory itself receives (the input of its
    `__call__`)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from nljax.models import build, nl_lm

    model = build(config.load(None, ["model.nl_lm.memory_layers=[1]", f"model.nl_lm.memory_embed={str(embed).lower()}"]))
    params = jax.jit(model.init)(jax.random.key(0))  # one compile instead of hundreds of eager ops
    bias = 6.0 * jax.random.normal(jax.random.key(2), params["block0"]["cms0"]["down"]["bias"].shape)
    params = {**params, "block0": {**params["block0"], "cms0": {**params["block0"]["cms0"], "down": {
        **params["block0"]["cms0"]["down"], "bias": bias}}}}
    tokens = jax.random.randint(jax.random.key(1), (4, 129), 0, 256)

    @jax.jit  # the memory's input, returned from the compiled forward (one compile, not eager ops)
    def memory_input(params, tokens):
        seen = []

        def record(call, args, kwargs, context):
            if isinstance(context.module, nl_lm.NeuralMemory) and context.method_name == "__call__":
                seen.append(args[0])
            return call(*args, **kwargs)

        with nn.intercept_methods(record):
            model.logits(params, model.init_memory(4), {"tokens": tokens, "reset": jnp.ones(4, bool)})
        (x,) = seen
        return x

    x = memory_input(params, tokens)
    shared = float(jnp.mean(jnp.sum(x.mean(1) ** 2, -1) / jnp.mean(jnp.sum(x * x, -1), 1)))
    assert (shared < 0.6) if embed else (shared > 0.95), shared


@pytest.mark.parametrize("t, window", [(100, 16), (40, 50)])
def test_blocked_local_attention_equals_the_full_masked_form(t, window):
    """Blocks of `window` queries over their block and the one before (linear in T) == jax's
    masked [T, T] form: outputs and gradients, T a multiple of the window or not, and T <= 2 windows."""
    import jax.numpy as jnp

    from nljax.models.layers import local_attention

    q, k, v = (jax.random.normal(key, (2, t, 3, 8)) for key in jax.random.split(jax.random.key(t), 3))
    full = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0))
    blocked = lambda q, k, v: local_attention(q, k, v, window)
    np.testing.assert_allclose(blocked(q, k, v), full(q, k, v), atol=2e-6)
    grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert_trees_close(grads(blocked), grads(full), atol=1e-5)


# ------------------------------------------------------------------------ scanned layers

DEEP4 = [*NL, "model.depth=4", "model.nl_lm.memory_layers=[1,3]"]  # unit of 2 blocks, 2 units


def scanned_params(params, depth, memory_layers):
    """The unrolled net's parameters in the scanned layout: unit u's block j is block u * p + j."""
    import re

    from nljax.models.nl_lm import unit_size

    p = unit_size(depth, memory_layers)
    numbered = lambda k: re.fullmatch(r"(\D+)(\d+)", k)
    out = {k: v for k, v in params.items() if not numbered(k)}
    out["units"] = {f"{m[1]}{j}": jax.tree.map(lambda *s: np.stack(s), *(params[f"{m[1]}{u * p + j}"]
                                                                             for u in range(depth // p)))
                    for m in map(numbered, params) if m for j in range(p) if int(m[2]) == j}
    return out


def test_unit_size_is_the_shortest_repeating_run_of_blocks():
    from nljax.models.nl_lm import unit_size

    assert unit_size(20, (4, 9, 14, 19)) == 5
    assert unit_size(12, (2, 5, 8, 11)) == 3
    assert unit_size(4, ()) == 1 and unit_size(4, (0, 1, 2, 3)) == 1
    assert unit_size(8, (1, 3, 5)) == 8  # titans_demo: no repeat (block 7 has none)
    with pytest.raises(config.ConfigError, match="scan_layers needs blocks that repeat"):
        config.load(None, [*DEEP4, "model.nl_lm.memory_layers=[1]", "model.nl_lm.scan_layers=true"])


@pytest.mark.slow
def test_scanned_layers_equal_the_unrolled_net():
    """`model.nl_lm.scan_layers`: the same function of the same parameters (stacked per unit):
    logits and every memory state over two steps (the second reads what the first wrote), and
    gradients; with the MLP memory and block remat inside the scanned unit."""
    import jax.numpy as jnp

    from nljax.models import build

    over = [*DEEP4, "model.remat=block", "train.seq_len=24"]
    flat, scan = (build(config.load(None, [*over, f"model.nl_lm.scan_layers={s}"])) for s in ("false", "true"))
    tokens = jax.random.randint(jax.random.key(1), (3, 2, 25), 0, 256)

    def run(model, params):  # two steps' logits and memories, and the second step's gradients
        memory, out = model.init_memory(3), []
        for step in range(2):
            batch = {"tokens": tokens[:, step], "reset": jnp.full((3,), step == 0)}
            if step == 1:  # one backward pass traced: the suite's time is in compiling them
                grads = jax.grad(lambda p: model.apply(p, memory, batch)[0])(params)
            logits, memory = model.logits(params, memory, batch)
            out.append((logits, memory))
        return out, grads

    params = flat.init(jax.random.key(0))
    stacked = scanned_params(params, 4, (1, 3))
    assert jax.tree.structure(stacked) == jax.tree.structure(scan.init(jax.random.key(0)))
    (out_flat, g_flat), (out_scan, g_scan) = (jax.jit(functools.partial(run, m))(p) for m, p in
                                              ((flat, params), (scan, stacked)))
    for (la, ma), (lb, mb) in zip(out_flat, out_scan, strict=True):
        np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
        assert_trees_close(mb, ma, rtol=1e-5, atol=1e-6)
    assert_trees_close(g_scan, scanned_params(g_flat, 4, (1, 3)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_memory_module_is_its_inner_loop_on_unit_projections(kind):
    """`NeuralMemory` as its docstrings define it, computed by hand (no conv): q, k, v unit vectors per head;
    the gates from the `gates` layer, per head (step theta, momentum eta, forgetting alpha) in that
    order, theta scaled by lr_max, with the gate kernel at zero the values its init documents
    (theta = eta = 1/2, forgetting sigmoid(-6): slow); the inner loop's token-by-token
    definition from memory0; each head's read RMS-normalised, gated by sigmoid(W x + b),
    projected out. Random weights elsewhere (init's output layers are zero)."""
    import jax.numpy as jnp

    from nljax.models import memory as nm
    from nljax.models.blocks import memory_state
    from nljax.models.nl_lm import NeuralMemory

    b, t, dim, heads, dk, lr_max = 2, 8, 16, 2, 4, 0.5
    mem = NeuralMemory(dim=dim, heads=heads, dk=dk, hidden=8, kind=kind, chunk=4, lr_max=lr_max, conv=0,
                       impl="scan")  # conv=0: the projections by hand (the conv's causality: test_logits_are_causal)
    x = jax.random.normal(jax.random.key(0), (b, t, dim))
    reset = jnp.ones((b,), bool)
    params = mem.init(jax.random.key(1), x, memory_state(mem, b), reset)["params"]
    keys = iter(jax.random.split(jax.random.key(2), 100))
    params = jax.tree.map(lambda w: w + 0.5 * jax.random.normal(next(keys), w.shape), params)
    params["gates"] = {"kernel": jnp.zeros_like(params["gates"]["kernel"]),
                       "bias": mem.init(jax.random.key(1), x, memory_state(mem, b), reset)["params"]["gates"]["bias"]}
    stale = jax.tree.map(lambda w: 5.0 + w, memory_state(mem, b))  # reset: replaced by memory0
    y, state = mem.apply({"params": params}, x, stale, reset)

    proj = jnp.einsum("btd,dchk->cbhtk", x, params["qkv"]["kernel"])  # [3, B, H, T, dk]
    q, k, v = proj / jnp.sqrt(jnp.sum(proj**2, axis=-1, keepdims=True) + 1e-6)  # unit norm
    gate = lambda p: jnp.full((b, heads, t), p)
    theta, eta, alpha = gate(0.5 * lr_max), gate(0.5), gate(float(jax.nn.sigmoid(-6.0)))
    memory0 = {n[len("memory0_"):]: w for n, w in params.items() if n.startswith("memory0_")}
    reads, state_ref = nm.memory_reference(nm.init_state(memory0, b), q, k, v, theta, eta, alpha, kind=kind,
                                           chunk=4)
    reads = reads.transpose(0, 2, 1, 3)  # [B, T, H, dk]
    normed = reads / jnp.sqrt(jnp.mean(reads**2, axis=-1, keepdims=True) + 1e-6) * params["out_norm"]["scale"]
    og = params["out_gate"]
    gated = normed * jax.nn.sigmoid(x @ og["kernel"] + og["bias"]).reshape(b, t, heads, dk)
    want = gated.reshape(b, t, heads * dk) @ params["out"]["kernel"]
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-5)
    assert_trees_close(state, state_ref, rtol=1e-4, atol=1e-5)


def test_rotary_rotates_each_pair_by_its_frequency():
    """Rotary positions (RoPE, Su et al.; halves-paired as in GPT-NeoX): at position t feature i
    and feature i + hd/2 turn by the angle t * base^(-2i / hd), so norms are kept and q . k
    depends on the positions' difference only."""
    import jax.numpy as jnp

    from nljax.models.nl_lm import rotary

    hd, t = 8, 7
    pos = jnp.arange(t, dtype=jnp.float32)
    for i in range(hd // 2):
        e = jnp.zeros((1, t, 1, hd)).at[..., i].set(1.0)  # the unit vector e_i at every position
        angle = pos * 10000.0 ** (-2 * i / hd)
        y = rotary(e)[0, :, 0]
        np.testing.assert_allclose(y[:, i], jnp.cos(angle), atol=1e-5)
        np.testing.assert_allclose(y[:, i + hd // 2], jnp.sin(angle), atol=1e-5)
        assert not np.delete(np.asarray(y), [i, i + hd // 2], axis=1).any()  # the pair turns alone
    q, k = (jnp.broadcast_to(jax.random.normal(key, (hd,)), (1, t, 1, hd)) for key in jax.random.split(jax.random.key(0), 2))
    rq, rk = rotary(q)[0, :, 0], rotary(k)[0, :, 0]
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q[0, :, 0], axis=-1), rtol=1e-5)
    dots = rq @ rk.T  # [m, n]
    for d in range(-2, 3):  # every pair at the same offset n - m reads the same
        diag = jnp.diagonal(dots, offset=d)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-4, atol=1e-5)


def test_cms_levels_start_as_the_identity_and_add_to_the_stream():
    """`CMSChain`: each level a residual MLP (x + MLP_l(x), in sequence), starting as the
    identity (its output layer zero): at init the chain returns its input bit for bit, with
    weights it adds each level's output to the stream. (Without the residual a zero-initialised
    chain zeroed the stream, and the identity test of the whole net still passed: logits that
    depend on nothing depend on token t alone.)"""
    from nljax.models.layers import MLP, CMSChain

    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    chain = CMSChain(dim=8, hidden=16, levels=2)
    params = chain.init(jax.random.key(1), x)["params"]
    np.testing.assert_array_equal(chain.apply({"params": params}, x), x)
    keys = iter(jax.random.split(jax.random.key(2), 100))
    params = jax.tree.map(lambda w: w + 0.5 * jax.random.normal(next(keys), w.shape), params)
    want = x
    for level in range(2):
        want = want + MLP(8, 16).apply({"params": params[f"cms{level}"]}, want)
    np.testing.assert_allclose(chain.apply({"params": params}, x), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, x)


def test_the_causal_conv_reads_its_kernel_over_the_tokens_before():
    """`CausalConv` as its docstring defines it: y_t = sum_j w_j x_{t-K+1+j} + b per channel, the
    tokens before the first zero. (A conv padded on the right, reading tokens after t, passed the
    fast tier: the whole model's causality test, `test_logits_are_causal`, is in the slow one.)"""
    import jax.numpy as jnp

    from nljax.models.nl_lm import CausalConv

    b, t, k, ch = 2, 7, 3, (2, 3)
    x = jax.random.normal(jax.random.key(0), (b, t, *ch))
    conv = CausalConv(k)
    params = conv.init(jax.random.key(1), x)["params"]
    params = {"kernel": params["kernel"], "bias": jax.random.normal(jax.random.key(2), ch)}
    y = conv.apply({"params": params}, x)
    padded = jnp.concatenate([jnp.zeros((b, k - 1, *ch)), x], axis=1)  # x_{-K+1} .. x_{-1} = 0
    want = jnp.stack([sum(params["kernel"][j] * padded[:, s + j] for j in range(k)) for s in range(t)], axis=1)
    np.testing.assert_allclose(y, want + params["bias"], rtol=1e-6, atol=1e-6)


def test_the_logits_read_the_inputs_and_the_loss_the_targets():
    """A batch's tokens [B, T+1]: the net reads [:, :-1] (the inputs), the loss scores [:, 1:]
    (each input's next token). (The logits of tokens [:, 1:], each position reading its own
    target, passed the fast tier.)"""
    import dataclasses

    import jax.numpy as jnp

    from nljax.models.nl_lm import NLLM

    @dataclasses.dataclass(frozen=True)
    class Echo:  # a net whose logits put all their mass on the token read at each position
        loss_chunk: int = 0

        def apply(self, variables, tokens, memory, reset):
            return 50.0 * jax.nn.one_hot(tokens, 16), memory

    tokens = jnp.array([[1, 2, 3, 4, 5]])
    model = NLLM(Echo())
    batch = {"tokens": tokens, "reset": jnp.ones(1, bool)}
    logits, _ = model.logits({}, {}, batch)
    np.testing.assert_array_equal(jnp.argmax(logits, -1), tokens[:, :-1])
    loss, count, _ = model.apply({}, {}, batch)  # each position predicts the token it read: wrong
    assert count == 4 and float(loss) > 4 * 40.0
    loss, _, _ = model.apply({}, {}, {**batch, "tokens": jnp.array([[3, 3, 3, 3, 3]])})  # now right
    assert float(loss) < 1e-12


def test_stream_resets_from_document_ends_across_the_wrap():
    """With `ends` (the user's files), a row whose previous chunk wraps past the end of the
    tokens to the start is reset when an end lies in the wrapped part: as the NUL scan finds it
    in the same bytes. The tokens wrap the same way."""
    data = np.full(10, 7, np.uint8)
    data[2] = SEPARATOR
    by_ends = ContextStream(data, rows=1, seq_len=5, ends=np.array([2]))
    by_nul = ContextStream(data, rows=1, seq_len=5)
    np.testing.assert_array_equal(by_ends.ends_within(np.array([8, 3, 0, 6]), 5), [True, False, True, False])
    for step in range(1, 6):  # the row's chunks run 0-5, 5-10, 10-15 = 0-5 (mod 10), ...
        assert by_ends.rows_at(step, np.arange(1))["reset"] == by_nul.rows_at(step, np.arange(1))["reset"]
    # the tokens themselves wrap: step 1 reads 5 .. 10, the last its target read from the start
    counting = ContextStream(np.arange(10, dtype=np.uint8), rows=1, seq_len=5)
    np.testing.assert_array_equal(counting.rows_at(1, np.arange(1))["tokens"][0], [5, 6, 7, 8, 9, 0])


def test_the_stdlib_corpus_holds_out_every_nth_module():
    """data.source=stdlib: the standard library's top-level modules sorted by name, every
    round(1 / eval_fraction)-th held out (the 2nd, 4th, ... at 0.5; every 7th at 0.15), each
    document NUL-ended."""
    import sysconfig
    from pathlib import Path

    from nljax.data.text import stdlib_corpus

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = lambda fs: b"".join(f.read_bytes().replace(b"\0", b"") + b"\0" for f in fs)
    train, held = stdlib_corpus(0.5)
    assert held.tobytes() == docs(files[1::2]) and train.tobytes() == docs(files[0::2])
    held = stdlib_corpus(0.15)[1]  # round(1 / 0.15) = 7, as data.source=files splits
    assert held.tobytes() == docs(files[6::7])


def test_random_resets_are_drawn_per_global_row():
    """data.reset_prob: one draw per (seed, step) for all rows, each row taking its own, so a
    device that builds rows 5-7 gets the flags those rows get in the whole batch (the mesh
    changes nothing), and about reset_prob of the rows reset."""
    data = np.full(4096, 7, np.uint8)  # no document boundary: every reset after step 0 is a draw
    s = ContextStream(data, rows=8, seq_len=4, seed=1, reset_prob=0.5)
    whole = np.array([s.rows_at(step, np.arange(8))["reset"] for step in range(1, 41)])
    for step in range(1, 41):
        np.testing.assert_array_equal(s.rows_at(step, np.arange(5, 8))["reset"], whole[step - 1, 5:])
        np.testing.assert_array_equal(s.rows_at(step, slice(2, 4))["reset"], whole[step - 1, 2:4])
    assert 0.35 < whole.mean() < 0.65


def test_row_starts_are_multiples_of_align_and_move_with_the_seed():
    """`align` (the recall probe's: train.seq_len, one fixed-length document per window): every
    row starts on a multiple of it, whatever the seed; the seed shifts the rows' starts."""
    data = np.arange(1000) % 251
    for seed in range(6):
        s = ContextStream(data, rows=5, seq_len=8, seed=seed, align=8)
        assert (s.offsets() % 8 == 0).all(), seed
        assert (s.rows_at(3, np.arange(5))["tokens"][:, 0] == data[(s.offsets() + 24) % 1000]).all()
    offsets = [tuple(ContextStream(data, rows=5, seq_len=8, seed=seed).offsets()) for seed in range(4)]
    assert len(set(offsets)) == 4
