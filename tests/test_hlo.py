"""HLO text parsing, on lines in the formats XLA prints for CPU and GPU."""

import pytest

from nljax.measure import hlo

MESH = {"inter": 2, "intra": 4}


def parse(line):
    (c,) = hlo.collectives(line, MESH)
    return c


def test_explicit_groups_and_axes():
    c = parse("%ar = f32[100]{0} all-reduce(f32[100]{0} %x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add")
    assert (c.op, c.axes, c.bytes, c.group_size) == ("all-reduce", ("inter",), 400, 2)
    assert c.wire_bytes == pytest.approx(2 * 400 * 1 / 2)


def test_iota_groups():
    c = parse("%rs = f32[25]{0} reduce-scatter(f32[100]{0} %x), replica_groups=[2,4]<=[8], dimensions={0}")
    assert c.axes == ("intra",) and c.bytes == 400 and c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    c = parse("%ar = bf16[8]{0} all-reduce(bf16[8]{0} %x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add")
    assert c.axes == ("inter",) and c.groups[0] == (0, 4) and c.bytes == 16


def test_async_start_ops_count_results_once():
    ag = parse("%ags = (f32[25]{0}, f32[100]{0}) all-gather-start(f32[25]{0} %x), replica_groups=[2,4]<=[8], "
               "dimensions={0}")
    assert ag.bytes == 400
    ar = parse("%ars = f32[100]{0} all-reduce-start(f32[100]{0} %x), replica_groups={{0,1,2,3,4,5,6,7}}")
    assert ar.bytes == 400 and ar.axes == ("inter", "intra")
    rs = parse("%rss = ((f32[400]{0}), f32[100]{0}) reduce-scatter-start(f32[400]{0} %x), "
               "replica_groups=[2,4]<=[8], dimensions={0}")
    assert rs.bytes == 1600 and rs.wire_bytes == pytest.approx(1200)
    # the matching -done ops are not collectives of their own
    assert hlo.collectives("%d = f32[100]{0} all-reduce-done(f32[100]{0} %ars)", MESH) == []


def test_single_device_groups_move_nothing():
    assert hlo.collectives("%ar = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={{0},{1}}", MESH) == []


def test_collectives_in_loops_count_their_trips():
    """A psum inside a scan of 5, and one inside a scan of 3 nested in a scan of 4, on a compiled
    program: each collective's `count` is the times one call runs it (the loop's body once in the
    text, where bytes used to be counted once per step)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("inter", "intra"), axis_types=(AxisType.Auto,) * 2)

    def loop(c, n, axis):
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c * 2.0, axis).sum(), None), c, None, length=n)[0]

    def f(x):
        x = loop(x, 5, "intra")
        return jax.lax.scan(lambda c, _: (loop(c, 3, "inter"), None), x, None, length=4)[0]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("inter", "intra")), out_specs=P(("inter", "intra"))))
    text = g.lower(jnp.ones(16)).compile().as_text()
    got = sorted((c.axes, c.count, c.bytes) for c in hlo.collectives(text, MESH))
    assert got == [(("inter",), 12, 8), (("intra",), 5, 8)], got
    assert sorted(hlo.loop_trips(text)) == [3, 4, 5]


def test_xla_flops_only_for_programs_without_loops():
    """XLA's cost analysis counts a loop's body once: a scan of 8 matmuls reports the FLOPs of
    one. `throughput.flops` gives XLA's count only for a program without such a loop."""
    import jax
    import jax.numpy as jnp

    from nljax.run import throughput

    x = jnp.ones((64, 64))
    once = jax.jit(lambda a: a @ a).lower(x).compile()
    looped = jax.jit(lambda a: jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=8)[0]).lower(x).compile()
    unrolled = jax.jit(lambda a: jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=8, unroll=8)[0]).lower(x).compile()
    assert throughput.flops(once) == pytest.approx(2 * 64**3, rel=0.05)
    assert throughput.flops(looped) is None and hlo.loop_trips(looped.as_text()) == [8]
    assert throughput.flops(unrolled) == pytest.approx(8 * 2 * 64**3, rel=0.05)
