"""The SPMD engine against a single-device reference, and what its compiled steps communicate."""

import functools

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, make, replicas, train

from nljax.config import ConfigError
from nljax.measure import hlo
from nljax.measure.comm import comm_per_step
from nljax.parallel import levels
from nljax.parallel.hostdev import mean_loss, put_batch
from nljax.parallel.mesh import check_batch, make_mesh

PERIODS = "cms.periods=[1,2,3]"
STEPS = 12  # two full cycles of [1, 2, 3]
MESHES = [(1, 1), (1, 2), (2, 2), (2, 4), (4, 2)]


def mode(frozen: str) -> list[str]:
    """accumulate | skip | updates (accumulate, buffering per-step gradients: `cms.accumulate`)."""
    if frozen == "updates":
        return ["cms.frozen_grads=accumulate", "cms.accumulate=updates"]
    return [f"cms.frozen_grads={frozen}"]


@functools.lru_cache(maxsize=None)
def reference(frozen: str):
    setup = make([PERIODS, *mode(frozen)], 1, 1)
    losses, state = train(setup, STEPS)
    return losses, jax.device_get(state.params), jax.device_get(state.opt_state)


# On one device both reductions compile to the same program, so (1, 1) runs once per mode.
CASES = [
    (inter, intra, reduce, "accumulate")
    for reduce in ["flat", "hierarchical"]
    for inter, intra in MESHES
    if (inter, intra) != (1, 1) or reduce == "hierarchical"
]
# `cms.accumulate=skip` differs from `accumulate` only in what a frozen level keeps on its own
# device (nothing): the mesh-dependent part is the same, covered on every mesh above.
CASES += [(i, j, r, "skip") for r in ["flat", "hierarchical"] for i, j in [(1, 2), (2, 4)]]
# `cms.accumulate=updates` (Adam on each buffered step at the firing) on the meshes.
CASES += [(i, j, r, "updates") for r in ["flat", "hierarchical"] for i, j in [(1, 2), (2, 4), (4, 2)]]
# The suite runs `accumulate` on (1, 1) and (2, 2) hierarchical and (4, 2) flat (conftest's
# SLOW_CASES moves its other meshes); `skip` and `updates` run here in the slow tier (.ci/run,
# after the suite). The suite checks both modes against a single-device reference in
# tests/test_strategies.py (zero1 and fsdp: `skip` on (2, 4), `updates` on (2, 4), (4, 2) and
# (1, 8)), and test_frozen_modes_differ below keeps the three modes apart.
CASES = [c if c[3] == "accumulate" else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("inter,intra,reduce,frozen", CASES)
def test_matches_single_device(inter, intra, reduce, frozen):
    ref_losses, ref_params, ref_opt = reference(frozen)
    setup = make([PERIODS, *mode(frozen), f"sync.reduce={reduce}"], inter, intra)
    losses, state = train(setup, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=1e-4, atol=2e-6)
    # Adam's moments: its steps barely see a gradient scaled alike everywhere (a sum over devices
    # for their mean), its moments do
    assert_trees_close(state.opt_state, ref_opt, rtol=1e-4, atol=1e-7)
    # one compiled variant per active set of [1, 2, 3], never retraced
    assert setup.cache.traces == {a: 1 for a in [(1, 1, 1), (1, 0, 0), (1, 1, 0), (1, 0, 1)]}


def test_frozen_modes_differ():
    # guards the test above: the modes must not be the same computation
    assert not np.allclose(reference("accumulate")[0], reference("skip")[0])
    assert not np.allclose(reference("accumulate")[0], reference("updates")[0])  # Adam: one step vs one per step


@pytest.mark.parametrize("reduce", ["flat", "hierarchical"])
def test_params_bitwise_identical_but_buffers_rank_local(reduce):
    setup = make([PERIODS, f"sync.reduce={reduce}"], 2, 4)
    _, state = train(setup, 5)  # ends after step 4: level 2 (period 3) holds steps 4's grads
    for leaf in jax.tree.leaves(state.params):
        copies = replicas(leaf)
        assert len(copies) == 8
        for c in copies[1:]:
            assert np.array_equal(c, copies[0])
    buf = np.asarray(state.err_buf[2])  # [8, N_2], one row per device
    assert buf.shape[0] == 8 and np.abs(buf).sum() > 0
    assert not np.allclose(buf[0], buf[1]), "each device accumulates its own gradients"


def test_accumulate_applies_sum_of_frozen_gradients():
    """SGD, periods [1, 2]: level 1's update at step 2 is -lr * (g(step 1) + g(step 2))."""
    setup = make(["cms.periods=[1,2]", "optim.name=sgd", "optim.lr=0.1"], 1, 2)
    eng = setup.engine

    def grad_level1(params, step):
        batch = jax.device_get(setup.batch(step))
        g = jax.grad(lambda p: (lambda s, c, _: s / c)(*eng.model.apply(p, {}, batch, None)))(params)
        return levels.split(g, eng.level_tree, 2)[1]

    from nljax.engine.conductor import pulse

    _, s0 = train(setup, 1)  # step 0: everything fires
    p0 = jax.device_get(s0.params)
    g1 = grad_level1(p0, 1)  # step 1's gradient, taken at the parameters after step 0
    s1, _, _ = setup.cache.train(pulse(1, (1, 2)).active, s0, setup.batch(1))
    p1 = jax.device_get(s1.params)
    g2 = grad_level1(p1, 2)
    assert_trees_close(levels.split(p1, eng.level_tree, 2)[1], levels.split(p0, eng.level_tree, 2)[1], 0, 0)
    s2, _, _ = setup.cache.train(pulse(2, (1, 2)).active, s1, setup.batch(2))
    expected = jax.tree.map(lambda p, a, b: p - 0.1 * (a + b), levels.split(p1, eng.level_tree, 2)[1], g1, g2)
    got = levels.split(jax.device_get(s2.params), eng.level_tree, 2)[1]
    assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def _level0_only_collectives(reduce, inter, intra, frozen="accumulate"):
    setup = make([PERIODS, f"sync.reduce={reduce}", *mode(frozen)], inter, intra)
    text = setup.cache.train_fn((True, False, False), setup.state, setup.batch(0)).as_text()
    sizes = levels.level_sizes(setup.state.params, setup.engine.level_tree, 3)
    return hlo.collectives(text, dict(setup.mesh.shape)), sizes


@pytest.mark.parametrize("frozen", ["accumulate", "updates"])
def test_hlo_flat_level0_only(frozen):
    colls, sizes = _level0_only_collectives("flat", 2, 4, frozen)
    assert [(c.op, c.axes) for c in colls] == [("all-reduce", ("inter", "intra"))]
    assert colls[0].bytes == sizes[0][1]  # exactly level 0's gradient, nothing of levels 1, 2


def test_hlo_updates_firing_reduces_each_buffered_step_once():
    """`updates`: when level 1 (period 2) fires, its two per-step gradients cross devices as one
    [2, N_1] all-reduce; level 2 (frozen) moves nothing."""
    setup = make([PERIODS, "sync.reduce=flat", *mode("updates")], 2, 4)
    text = setup.cache.train_fn((True, True, False), setup.state, setup.batch(0)).as_text()
    sizes = levels.level_sizes(setup.state.params, setup.engine.level_tree, 3)
    colls = hlo.collectives(text, dict(setup.mesh.shape))
    assert {c.op for c in colls} == {"all-reduce"}
    got, want = sorted(c.bytes for c in colls), sorted([sizes[0][1], 2 * sizes[1][1]])
    assert got == want or sum(got) == sum(want)  # XLA may combine the per-level all-reduces


@pytest.mark.parametrize("inter,intra,frozen", [(2, 4, "accumulate"), (4, 2, "accumulate"), (2, 4, "updates")])
def test_hlo_hierarchical_level0_only(inter, intra, frozen):
    colls, sizes = _level0_only_collectives("hierarchical", inter, intra, frozen)
    n0 = sizes[0][0]
    shard = -(-n0 // intra)
    assert [(c.op, c.axes) for c in colls] == [
        ("reduce-scatter", ("intra",)),
        ("all-reduce", ("inter",)),
        ("all-gather", ("intra",)),
    ]
    rs, ar, ag = colls
    assert rs.bytes == shard * intra * 4 and rs.group_size == intra
    assert ar.bytes == shard * 4 and ar.group_size == inter  # 1/intra of the data crosses `inter`
    assert ag.bytes == shard * intra * 4
    # groups: intra groups are rows of the mesh, inter groups its columns
    assert sorted(rs.groups) == [tuple(range(i * intra, (i + 1) * intra)) for i in range(inter)]
    assert sorted(ar.groups) == [tuple(range(j, inter * intra, intra)) for j in range(intra)]


def test_comm_report_all_variants():
    setup = make([PERIODS, "sync.reduce=flat"], 2, 4)
    assert setup.cache.traces == {}
    r = comm_per_step(setup.cache, setup.state, setup.batch(0))
    # on more than one device it compiles each pattern and reads its collectives (the one-device
    # test below compiles none)
    assert len(setup.cache.traces) == 4 and r["mean_wire_bytes_per_step"] > 0
    sizes = r["param_bytes_per_level"]
    by_name = {v["active"]: v for v in r["variants"]}
    assert set(by_name) == {"L0", "L0+1", "L0+2", "L0+1+2"}
    for name, v in by_name.items():
        want = sorted(sizes[l] for l in v["active_levels"])
        got = sorted(c["payload_bytes"] for c in v["collectives"])
        assert got == want or sum(got) == sum(want)  # XLA may combine the per-level all-reduces
    ring = lambda b: 2 * b * 7 / 8
    mean = (3 * ring(sizes[0]) + 2 * ring(sizes[0] + sizes[1]) + ring(sizes[0] + sizes[2])) / 6
    # [1,2,3] over 6 steps: L0 x2, L0+1 x2, L0+2 x1, L0+1+2 x1
    mean = (2 * ring(sizes[0]) + 2 * ring(sizes[0] + sizes[1]) + ring(sizes[0] + sizes[2]) + ring(sum(sizes))) / 6
    assert r["mean_wire_bytes_per_step"] == pytest.approx(mean)
    assert r["ddp_wire_bytes_per_step"] == pytest.approx(ring(sum(sizes)))
    assert r["ratio_vs_ddp"] < 1


def test_comm_report_on_one_device_compiles_nothing():
    """On a one-device mesh no step communicates: the report is zeros without compiling any
    pattern (a run shorter than a cycle compiled the ones it had not reached only to read none).
    On more devices it compiles each pattern and reads its collectives: checked on (2, 4) by
    test_comm_report_all_variants above, whose compilations it uses (a (1, 2) run here compiled
    the four patterns again for the suite's 15 minutes)."""
    one = make([PERIODS], 1, 1)
    r = comm_per_step(one.cache, one.state, one.batch(0))
    assert one.cache.traces == {} and len(r["variants"]) == 4
    assert all(v["wire_bytes"] == 0 and v["collectives"] == [] for v in r["variants"])
    assert r["mean_wire_bytes_per_step"] == 0 and r["ratio_vs_ddp"] is None


def test_mesh_and_batch_errors():
    with pytest.raises(ConfigError, match=r"mesh inter=3 x intra=2 = 6 devices, but 8 are available"):
        make_mesh(3, 2)
    with pytest.raises(ConfigError, match=r"mesh.inter=3 does not divide the 8 available devices"):
        make_mesh(3, -1)
    with pytest.raises(ConfigError, match=r"train.batch_size=12 does not divide over 8 data-parallel devices "
                                          r"\(mesh inter=2 x intra=4\): give a multiple of 8 \(8 or 16\)"):
        check_batch(12, make_mesh(2, 4))
    assert make_mesh(-1, 4).shape == {"inter": 2, "intra": 4, "model": 1}
    assert make_mesh(-1, 2, model=2).shape == {"inter": 2, "intra": 2, "model": 2}
    with pytest.raises(ConfigError, match=r"mesh inter=2 x intra=2 x model=4 = 16 devices, but 8 are available"):
        make_mesh(2, 2, model=4)
    with pytest.raises(ConfigError, match=r"mesh.model=3 does not divide the 8 available devices"):
        make_mesh(-1, -1, model=3)
    with pytest.raises(ConfigError, match=r"mesh.inter=3 does not divide the 4 devices each holding 1/2 of a model"):
        make_mesh(3, -1, model=2)


def test_put_batch_gives_each_device_its_rows():
    mesh = make_mesh(2, 4)
    rows = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
    b = put_batch({"tokens": rows}, mesh)["tokens"]
    for shard in b.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), rows[shard.index])


def test_a_device_without_weighted_targets_does_not_skip_the_step():
    """Weighted targets (the recall probe's `weight`) that leave one device's rows with none: that
    device's mean is 0, not 0/0, so the step updates every level from the other device's gradient
    (0/0's NaN made every level's gradient non-finite: all four skipped, measured)."""
    setup = make([], 1, 2)
    batch = {k: np.asarray(v) for k, v in jax.device_get(setup.batch(0)).items()}
    batch["weight"] = np.ones((8, 8), np.float32)
    batch["weight"][:4] = 0  # device 0's rows
    start = jax.device_get(setup.state.params)
    metrics = []
    train(setup, 1, batch=lambda s: put_batch(batch, setup.mesh), metrics=metrics)
    m = jax.device_get(metrics[0])
    assert list(m["count"]) == [0, 32] and m["skipped"] == 0 and np.isfinite(m["grad_norm"])
    end = jax.device_get(setup.state.params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(end))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)))


def test_a_batch_without_weighted_targets_logs_a_loss_of_0():
    """No weighted target on any device: the step's gradient is 0 everywhere and the logged loss
    0 (as evaluation's means), where the host's mean was a ZeroDivisionError that ended the run."""
    setup = make([], 1, 2)
    batch = {k: np.asarray(v) for k, v in jax.device_get(setup.batch(0)).items()}
    batch["weight"] = np.zeros((8, 8), np.float32)
    metrics = []
    train(setup, 1, batch=lambda s: put_batch(batch, setup.mesh), metrics=metrics)
    assert list(jax.device_get(metrics[0])["count"]) == [0, 0]
    assert mean_loss(metrics[0]) == 0.0
