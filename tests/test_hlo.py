"""HLO text parsing, on lines in the formats XLA prints for CPU and GPU."""

import pytest

from nljax import hlo

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
