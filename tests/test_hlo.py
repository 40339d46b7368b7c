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


def test_groups_by_mesh_axes():
    """jax 0.11's form (lines as XLA:CPU printed them with jax 0.11.2): the groups named by the
    axes they span, over the program's mesh; read as the other forms were (the reduce-scatter was
    taken for one over all 8 devices, every byte figure wrong with it)."""
    c = parse("%reduce_scatter.7 = f32[16]{0} reduce-scatter(%param.1), channel_id=1, replica_groups=mesh['inter'=2,"
              "'intra'=4] {'intra'}, use_global_device_ids=true, dimensions={0}, to_apply=%region_0.0")
    assert (c.op, c.axes, c.groups, c.bytes) == ("reduce-scatter", ("intra",), ((0, 1, 2, 3), (4, 5, 6, 7)), 256)
    assert c.wire_bytes == pytest.approx(64 * 3)
    c = parse("ROOT %psum_invariant.7 = f32[16]{0} all-reduce(%reduce_scatter.7), channel_id=1, "
              "replica_groups=mesh['inter'=2,'intra'=4] {'inter'}, use_global_device_ids=true, to_apply=%region_1.0")
    assert (c.axes, c.groups) == (("inter",), ((0, 4), (1, 5), (2, 6), (3, 7)))
    c = parse("%ar = f32[64]{0} all-reduce(%p), replica_groups=mesh['inter'=2,'intra'=4] {'inter','intra'}, "
              "use_global_device_ids=true, to_apply=%region_0.0")
    assert c.axes == ("inter", "intra") and c.group_size == 8
    # a size-1 axis named beside another (psum_scatter over ('intra', 'model')): the group is intra's
    (c,) = hlo.collectives("%rs = f32[16]{0} reduce-scatter(%p), replica_groups=mesh['inter'=2,'intra'=4,'model'=1] "
                           "{'intra','model'}, use_global_device_ids=true, dimensions={0}", {**MESH, "model": 1})
    assert c.axes == ("intra",) and c.groups[1] == (4, 5, 6, 7)
    assert hlo.collectives("%ar = f32[4]{0} all-reduce(%p), replica_groups=mesh['inter'=2,'intra'=4,'model'=1] "
                           "{'model'}, to_apply=%add", {**MESH, "model": 1}) == []  # a group of one moves nothing


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
    assert throughput.xla_count(looped) == (None, throughput.LOOP)  # why: nljax.bench's note under its table
    assert throughput.xla_count(once)[1] is None
    assert throughput.flops(unrolled) == pytest.approx(8 * 2 * 64**3, rel=0.05)


# A scheduled module as XLA:GPU prints it, cut to what `launches` reads: two kernels in the entry,
# a loop of 5 whose body holds a kernel, a library call and a loop of 3 (one kernel in its body),
# a conditional with one kernel per branch (both forms XLA prints), a call whose target holds a
# copy, an async all-reduce (its start a launch, its done none), and a loop of unknown trip count
# as the root. The fused computation's and the reduction's instructions are a kernel's body.
LOOPS = """HloModule jit_f, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%fused_computation (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %m = f32[8]{0} multiply(f32[8]{0} %p0, f32[8]{0} %p0)
  %r = f32[] reduce(f32[8]{0} %m, f32[] %p0), dimensions={0}, to_apply=%add
  ROOT %t = f32[8]{0} tanh(f32[8]{0} %m)
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %p), index=1
  %f = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation
  ROOT %t = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %f)
}

%inner_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] fusion((s32[], f32[8]{0}) %p), kind=kLoop, calls=%fused_computation
}

%outer_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %p), index=1
  %f = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation
  %g = f32[8]{0} custom-call(f32[8]{0} %f), custom_call_target="__cublas$gemm"
  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %g)
}

%outer_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] fusion((s32[], f32[8]{0}) %p), kind=kLoop, calls=%fused_computation
}

%yes (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation
}

%no (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation
}

%callee (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(f32[8]{0} %x)
}

%wrapped_all_reduce (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (x: f32[8], q: pred[], n: s32[]) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %q = pred[] parameter(1)
  %a = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_computation
  %b = f32[8]{0} bitcast(f32[8]{0} %a)
  %w = (s32[], /*index=1*/f32[8]{0}) while((s32[], f32[8]{0}) %t0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %c = f32[8]{0} conditional(pred[] %q, f32[8]{0} %b, f32[8]{0} %b), true_computation=%yes, false_computation=%no
  %d = f32[8]{0} conditional(s32[] %n, f32[8]{0} %c, f32[8]{0} %c), branch_computations={%yes, %no}
  %k = f32[8]{0} call(f32[8]{0} %d), to_apply=%callee
  %s = ((f32[8]{0}), f32[8]{0}) async-start(f32[8]{0} %k), calls=%wrapped_all_reduce
  %e = f32[8]{0} async-done(((f32[8]{0}), f32[8]{0}) %s)
  %z = f32[8]{0} fusion(f32[8]{0} %e), kind=kLoop, calls=%fused_computation
  ROOT %u = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t1), condition=%inner_cond, body=%inner_body
}
"""


def test_launches_count_kernels_times_their_loops_trips():
    outer, inner = 5, 3
    got = hlo.launches(LOOPS)
    # the entry's two, the outer body's, the inner body's per outer trip, four branches, the root
    # loop's body once (its trip count unknown)
    assert got["fusion"] == 2 + outer * 1 + outer * inner * 1 + 4 + 1
    assert got["library"] == outer  # the cuBLAS call in the outer body
    assert got["copy"] == 1  # the call's target
    assert got["collective"] == 1  # the async all-reduce: its start
    assert got["loop"] == 2  # only the loop of unknown trips runs its condition: once and once more
    assert got["other"] == 0
    # in the text's order of computations (not a set's: the same order in every process)
    names = [line.split(" = ")[0].split()[-1] for _, _, line in hlo.launching(LOOPS)]
    assert names == ["%f", "%f", "%g", "%f", "%f", "%c", "%a", "%s", "%z", "%u"], names


def test_launches_of_a_compiled_loop_grow_with_its_trips():
    """On a program XLA compiled: a loop of n trips launches n times its body's kernels, so each
    further trip adds the same number of launches, at least one."""
    import jax
    import jax.numpy as jnp

    def total(n):
        f = lambda x: jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x @ x) + i, x)
        return sum(hlo.launches(jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text()).values())

    a, b, c = total(10), total(20), total(30)
    assert c - b == b - a >= 10, (a, b, c)
