"""`nljax.measure.traces`: the device-time summary of a profiler trace, on hand-written traces whose
answer is known (the bench's smoke test profiles a real step)."""

import gzip
import json
import sys

import pytest
from helpers import ROOT

from nljax.measure import traces

sys.path.insert(0, str(ROOT / "benchmarks"))
import place_trace  # noqa: E402  (benchmarks/ is no package)


def meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def op(pid, tid, hlo_op, ts, dur, name=None, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name or hlo_op, "ts": ts, "dur": dur,
            "args": {"hlo_op": hlo_op, **args}}


def write(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path


def test_gpu_trace_counts_stream_kernels_once(tmp_path):
    """Two steps on one GPU: kernels on two streams (one overlap), the derived "XLA Ops" lane
    repeating them (not counted), a host event with no HLO op (not counted)."""
    events = [
        meta(1, "/device:GPU:0"), meta(1, "Stream #13(Compute)", 13), meta(1, "Stream #14(NCCL)", 14),
        meta(1, "XLA Ops", 99), meta(7, "/host:CPU"), meta(7, "python", 3),
        # step 1: gemm [0, 100), fusions [100, 170), all-reduce [120, 220) on the other stream
        op(1, 13, "custom-call.3", 0, 100, name="sm90_xmma_gemm_bf16"),
        op(1, 13, "fusion.12", 100, 50), op(1, 13, "fusion.13", 150, 20),
        op(1, 14, "all-reduce-start.1", 120, 100, name="ncclDevKernel_AllReduce"),
        # step 2 after an idle gap: fusion.12 again, a predicate copy
        op(1, 13, "fusion.12", 1000, 50), op(1, 13, "copy.4", 1050, 10, name="memcpy DtoH"),
        op(1, 99, "fusion.12", 100, 50), op(1, 99, "custom-call.3", 0, 100),
        {"ph": "X", "pid": 7, "tid": 3, "name": "PjitFunction(step)", "ts": 0, "dur": 2000},
    ]
    s = traces.summarize(write(tmp_path, events), steps=2, step_s=1e-3)
    assert s["device"] == "/device:GPU:0" and s["devices"] == 1
    assert s["ops"] == 3  # 6 kernels over 2 steps
    assert s["busy_s"] == pytest.approx((220 + 60) * 1e-6 / 2)  # [0, 220) and [1000, 1060)
    assert s["busy_fraction"] == pytest.approx(0.14)
    assert s["by_category_s"] == pytest.approx(
        {"matmul": 50e-6, "collective": 50e-6, "other": 60e-6, "copy": 5e-6})
    top = {t["op"]: t for t in s["top"]}
    assert top["fusion.12"]["calls"] == 1.0 and top["fusion.12"]["s"] == pytest.approx(50e-6)
    assert top["custom-call.3"]["category"] == "matmul"  # from the kernel's name
    kinds = {t["op"]: t for t in s["top_kinds"]}
    assert s["top_kinds"][0]["op"] == "fusion" and kinds["fusion"]["calls"] == 1.5
    assert kinds["fusion"]["s"] == pytest.approx(60e-6) and kinds["copy"]["category"] == "copy"
    text = "\n".join(traces.format_summary(s))
    assert "busy 0.14 ms of 1.00 ms (14%)" in text and "fusion.12" in text


def test_cpu_trace_splits_devices_by_ordinal(tmp_path):
    """XLA:CPU: one host process, ops tagged with their device ordinal; the first device is
    summarized, ops on two threads at once count once in busy time."""
    events = [
        meta(5, "/host:CPU"), meta(5, "tf_XLAEigen/1", 1), meta(5, "tf_XLAEigen/2", 2),
        op(5, 1, "ynn_fusion.1", 0, 40, device_ordinal="0"), op(5, 2, "dynamic_update_slice.0", 10, 20, device_ordinal="0"),
        op(5, 1, "while.6", 40, 10, device_ordinal="0"),
        op(5, 2, "ynn_fusion.1", 0, 70, device_ordinal="1"),
        {"ph": "X", "pid": 5, "tid": 1, "name": "ThunkExecutor::Execute (wait for completion)", "ts": 0,
         "dur": 90, "args": {"device_ordinal": "0"}},
    ]
    s = traces.summarize(write(tmp_path, events), steps=1, step_s=100e-6)
    assert s["devices"] == 2 and s["device"].endswith("device 0")
    assert s["ops"] == 3 and s["busy_s"] == pytest.approx(50e-6)
    assert s["by_category_s"] == pytest.approx({"matmul": 40e-6, "copy": 20e-6, "control": 10e-6})


def test_busy_time_and_kinds():
    assert traces.busy_time([(0, 10), (5, 7), (8, 12), (20, 21)]) == 13
    assert traces.busy_time([]) == 0
    assert traces.kind("fusion.12.3") == "fusion" and traces.kind("add_tanh_fusion") == "add_tanh_fusion"


def test_a_trace_without_ops_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no XLA op events"):
        traces.summarize(write(tmp_path, [meta(1, "/host:CPU")]), steps=1, step_s=1.0)
    with pytest.raises(FileNotFoundError):
        traces.summarize(tmp_path / "nothing", steps=1, step_s=1.0)


def test_only_the_train_steps_ops_count_when_named(tmp_path):
    """Evaluation or sampling between profiled training steps runs other programs: only the train
    step's module counts (all ops when no op names it)."""
    events = [meta(5, "/host:CPU"), meta(5, "tf_XLAEigen/1", 1),
              op(5, 1, "fusion.1", 0, 10, hlo_module=traces.TRAIN_MODULE),
              op(5, 1, "fusion.1", 20, 30, hlo_module="jit_local_eval_step")]
    s = traces.summarize(write(tmp_path, events), steps=1, step_s=100e-6)
    assert s["module"] == traces.TRAIN_MODULE and s["ops"] == 1 and s["busy_s"] == pytest.approx(10e-6)
    s = traces.summarize(tmp_path, steps=1, step_s=100e-6, module="jit_other")
    assert s["module"] is None and s["ops"] == 2


HLO = """HloModule jit_train_step
ENTRY %main {
  %fusion.12 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fc.12, metadata={op_name="jit(train_step)/shard_map/jvp(NLNet)/NLNet.unrolled/mem1/while/body/bhti,bhio->bhto/dot_general" source_file="m.py" source_line=3}
  ROOT %loop_add_fusion.2 = f32[4]{0} fusion(f32[4]{0} %fusion.12), kind=kLoop, calls=%fc.2, metadata={op_name="jit(train_step)/transpose(jvp(NLNet))/NLNet.scanned/while/body/closed_call/units/units/checkpoint/eval_jaxpr/block3/cms0/up/add"}
  %copy.4 = f32[4]{0} copy(f32[4]{0} %p)
  %fusion.7 = f32[] fusion(f32[4]{0} %p), kind=kInput, calls=%fc.7, metadata={op_name="jit(train_step)/add"}
}
"""


def test_scopes_from_hlo_metadata(tmp_path):
    """Each op's time goes to the pass and the model's modules its op_name names: by its HLO op,
    by its GPU kernel's name (`_N` for `.N`) when the HLO op is a command buffer, `?` without."""
    names = traces.op_names(HLO)
    assert set(names) == {"fusion.12", "loop_add_fusion.2", "fusion.7"}  # copy.4 has no metadata
    assert traces.scope(names["fusion.12"]) == "forward mem"  # the einsum's equation is not a module
    assert traces.scope(names["loop_add_fusion.2"]) == "backward block/cms"  # `units`: the scan container
    assert traces.scope(names["fusion.7"]) == "step" and traces.scope(None) == "?"
    assert traces.scope("jit(train_step)/transpose(jvp(NLNet))/NLNet.unrolled/add") == "backward"
    assert traces.op_scope(names, "command_buffer_3", "loop_add_fusion_2") == "backward block/cms"
    events = [meta(1, "/device:GPU:0"), meta(1, "Stream #13(Compute)", 13),
              op(1, 13, "fusion.12", 0, 30), op(1, 13, "command_buffer_3", 30, 20, name="loop_add_fusion_2"),
              op(1, 13, "copy.4", 50, 5), op(1, 13, "fusion.7", 55, 5), op(1, 13, "fusion.12", 60, 10)]
    s = traces.summarize(write(tmp_path, events), steps=1, step_s=100e-6, hlo_text=HLO)
    assert s["by_scope_s"] == pytest.approx({"forward mem": 40e-6, "backward block/cms": 20e-6, "?": 5e-6,
                                             "step": 5e-6})
    assert list(s["by_scope_s"])[0] == "forward mem"
    assert "op time by where in the model" in "\n".join(traces.format_summary(s))
    assert "by_scope_s" not in traces.summarize(tmp_path, steps=1, step_s=100e-6)  # no HLO, no scopes
    # the step without the profiler, beside the profiled one (the profiler slows the host's side)
    s = traces.summarize(tmp_path, steps=1, step_s=100e-6, timed_step_s=40e-6)
    assert s["timed_step_s"] == 40e-6 and s["busy_fraction"] == pytest.approx(0.7)  # of the profiled step
    assert "(the step without the profiler: 0.04 ms)" in "\n".join(traces.format_summary(s))


BUFFERS_HLO = """HloModule jit_train_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fc.2 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %add.1 = f32[4]{0} add(f32[4]{0} %param_0, f32[4]{0} %param_0), metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.unrolled/head/add"}
}

%body.3 (arg: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %arg = (s32[], f32[4,4]{1,0}) parameter(0)
  %gemm.9 = (f32[4,4]{1,0}, s8[0]{0}) custom-call(f32[4,4]{1,0} %x, f32[4,4]{1,0} %x), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/transpose(jvp(NLNet))/NLNet.unrolled/attn0/bqd,bkd->bqk/dot_general"}
  ROOT %tuple.1 = (s32[], f32[4,4]{1,0}) tuple(s32[] %i, f32[4,4]{1,0} %g)
}

%command_buffer.5 (p0: f32[4], p1: f32[4,4]) -> (f32[4], f32[4,4]) {
  %p0 = f32[4]{0} parameter(0)
  %cublas-gemm.1 = (f32[4,4]{1,0}, s8[0]{0}) custom-call(f32[4,4]{1,0} %p1, f32[4,4]{1,0} %p1), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/transpose(jvp(NLNet))/NLNet.unrolled/block0/cms1/dot_general"}
  %loop_dynamic_update_slice_fusion.4 = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=%fc.4, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/mem1/dynamic_update_slice"}
  %fusion.6 = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=%fc.2, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.unrolled/norm0/mul"}
  %copy.8 = f32[4]{0} copy(f32[4]{0} %p0)
  %while.2 = (s32[], f32[4,4]{1,0}) while((s32[], f32[4,4]{1,0}) %t), condition=%cond.3, body=%body.3
  ROOT %tuple.2 = (f32[4]{0}, f32[4,4]{1,0}) tuple(f32[4]{0} %copy.8, f32[4,4]{1,0} %g)
}

ENTRY %main.9 (p: f32[4], q: f32[4,4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %call.7 = (f32[4]{0}, f32[4,4]{1,0}) call(f32[4]{0} %p, f32[4,4]{1,0} %q), to_apply=%command_buffer.5
  ROOT %get-tuple-element.3 = f32[4]{0} get-tuple-element((f32[4]{0}, f32[4,4]{1,0}) %call.7), index=0
}
"""


def test_kernels_in_command_buffers_found_through_the_buffers_instructions(tmp_path):
    """A library kernel inside a CUDA command buffer (the profiler names the buffer, the kernel is
    cuBLAS's or a memcpy) goes to the scopes of the buffer's instructions of its category, loops
    inside the buffer included, fused computations not (a fusion has its own metadata)."""
    names, buffers = traces.op_names(BUFFERS_HLO), traces.command_buffers(BUFFERS_HLO)
    assert {"command_buffer.5", "command_buffer_5", "call.7", "call_7"} <= set(buffers)
    scope = lambda op, kernel: traces.op_scope(names, op, kernel, buffers)
    # cuBLAS: the buffer's two matmuls (one in a while loop's body), in two places of the model
    assert scope("command_buffer_5", "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT") == "backward attn | backward block/cms"
    assert scope("call.7", "memcpy128") == "forward mem"  # the copy-category instructions: the update slice
    assert scope("command_buffer_5", "loop_dynamic_update_slice_fusion_4") == "forward mem"  # by the kernel's name
    assert scope("command_buffer_5", "some_other_kernel") == "forward norm"  # a fusion: the buffer's fusions
    assert scope("command_buffer_5", "ncclDevKernel_AllReduce") == (  # no instruction of its kind: all of them
        "backward attn | backward block/cms | forward mem | forward norm")
    assert scope("command_buffer_9", "memcpy128") == "?" and traces.op_scope(names, "command_buffer_5", "x") == "?"
    events = [meta(1, "/device:GPU:0"), meta(1, "Stream #13(Compute)", 13),
              op(1, 13, "command_buffer_5", 0, 30, name="nvjet_sm90_tst_128x128"),
              op(1, 13, "command_buffer_5", 30, 10, name="memcpy32_post"), op(1, 13, "copy.11", 40, 5),
              op(1, 13, "call.7", 45, 5, name="memcpy128")]  # the buffer by its call: not the call's own place
    s = traces.summarize(write(tmp_path, events), steps=1, step_s=100e-6, hlo_text=BUFFERS_HLO)
    assert s["by_scope_s"] == pytest.approx({"backward attn | backward block/cms": 30e-6, "forward mem": 15e-6,
                                             "?": 5e-6})
    # the buffer's category in the top list: the kind of most of its time (its matmul), not its first kernel's
    events[2:4] = events[3:1:-1]
    s = traces.summarize(write(tmp_path / "again", events), steps=1, step_s=100e-6, hlo_text=BUFFERS_HLO)
    assert {t["op"]: t["category"] for t in s["top"]}["command_buffer_5"] == "matmul"


# A scheduled program as XLA:GPU prints it when it forms command buffers from thunks (no
# `command_buffer` computations): a layer loop's body (its header's parameters wrap with an
# /*index=N*/ comment) holding a fusion, a cuBLAS matmul, a copy of loop state with no op_name, an
# async dynamic-update-slice, a Pallas call and a fusion that shares the first one's kernel.
SCHEDULED_HLO = """HloModule jit_train_step, is_scheduled=true

%fused_add (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %add.0 = f32[4]{0} add(%p.1, %p.1), metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/mem1/add"}
}

%body.3 (arg: (s32[], f32[4], f32[4], f32[4], f32[4], /*index=5*/f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %loop_add_fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/mem1/add"}
  %cublas-gemm.2 = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/block0/cms1/up/dot_general"}
  %copy.5 = f32[4]{0} copy(%loop_add_fusion.1), metadata={scheduling_name="copy.5"}
  %fusion-start.6 = ((f32[4]{0}, s32[]), f32[4]{0}, u32[]) fusion-start(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/attn0/dynamic_update_slice" deduplicated_name="loop_dynamic_update_slice_fusion.1"}
  %pallas_call.7 = f32[4]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/attn0/attention_forward/pallas_call"}
  %loop_add_fusion.8 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while/body/units/norm0/add" deduplicated_name="loop_add_fusion.1"}
  ROOT %tuple.9 = (s32[], f32[4]{0}) tuple(%i, %copy.5)
}

ENTRY %main.10 (p: f32[4]) -> (s32[], f32[4]) {
  %loop_broadcast_fusion.11 = f32[4]{0} fusion(), kind=kLoop, calls=%fused_add, metadata={scheduling_name="loop_broadcast_fusion.11"}
  %tuple.12 = (s32[], f32[4]{0}) tuple(%c, %loop_broadcast_fusion.11)
  ROOT %while.13 = (s32[], f32[4]{0}) while(%tuple.12), condition=%cond.4, body=%body.3, metadata={op_name="jit(train_step)/jvp(NLNet)/NLNet.scanned/while"}
}
"""


def test_kernels_in_thunk_command_buffers_placed_by_the_schedule(tmp_path):
    """The profiler tags each kernel of a command buffer with the buffer (`command_buffer_N`) and
    its kernel name only. A fusion's kernel is named after it, or after the instruction whose kernel
    it shares (`deduplicated_name`); a library kernel (cuBLAS's nvjet, a memcpy, a Pallas kernel) is
    the next instruction of its kind in the schedule after the last placed kernel of the same
    execution of the buffer, a memset the matmul it precedes; an instruction without an op_name
    takes its users' (else its loop's); an op outside buffers, the profiler's own op_name."""
    cb = lambda ts, kernel, run="7": op(1, 13, "command_buffer_3", ts, 10, name=kernel, cuda_graph_id="2",
                                        cuda_graph_node_id="1", correlation_id=run)
    events = [meta(1, "/device:GPU:0"), meta(1, "Stream #13(Compute)", 13),
              cb(0, "loop_add_fusion_1"),  # shared by two instructions: the one before the matmul
              cb(10, "Memset 0"), cb(20, "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT"),
              cb(30, "memcpy128"), cb(40, "memcpy32_post"), cb(50, "attention_forward"),
              cb(60, "loop_add_fusion_1"),  # now the one after the Pallas call
              cb(100, "nvjet_sm90_tst_64x64", run="8"), cb(110, "memcpy128", run="8"),  # nothing to go by
              cb(200, "loop_broadcast_fusion_11", run="9"),  # entry's zeros for the loop: the loop's
              {"ph": "X", "pid": 1, "tid": 13, "ts": 300, "dur": 10, "name": "MemcpyD2D",
               "args": {"hlo_op": "loop_dynamic_slice_fusion.449", "correlation_id": "10",
                        "name": "jit(train_step)/transpose(jvp(NLNet))/NLNet.scanned/while/body/dynamic_slice"}}]
    s = traces.summarize(write(tmp_path, events), steps=1, step_s=1e-3, hlo_text=SCHEDULED_HLO)
    us = 1e-6
    assert s["by_scope_s"] == pytest.approx({
        "forward mem": 10 * us, "forward block/cms": 20 * us,  # the matmul and its memset
        "forward": 20 * us,  # the loop-state copy (in the loop's body) and the entry's zeros (for the loop)
        "forward attn": 10 * us, "forward attn/attention_forward": 10 * us, "forward norm": 10 * us,
        "?": 20 * us, "backward": 10 * us})
    # cut down as the real profile below was (`place_trace.py --extract`), the same placing
    place_trace.extract(tmp_path, SCHEDULED_HLO, 1, tmp_path / "small.json.gz")
    small = json.load(gzip.open(tmp_path / "small.json.gz", "rt"))
    again = traces.summarize(write(tmp_path / "again", place_trace.profile_events(small)), steps=1, step_s=1e-3,
                             hlo_text=small["hlo"])
    assert again["by_scope_s"] == pytest.approx(s["by_scope_s"])
    program = traces.Program(SCHEDULED_HLO)
    assert "fused_add" not in program.code and program.named["loop_add_fusion_1"] == [("body.3", 2), ("body.3", 7)]
    assert traces.kernel_kind("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm>") == "gemm"
    assert traces.kernel_kind("Memset 3") == "memset" and traces.kernel_kind("memcpy32_post") == "copy"
    assert traces.kernel_kind("gemm_fusion_dot_2") == "fusion" and traces.kernel_kind("attention_dq") == "custom"


def test_a_real_h200_profile_is_placed(tmp_path, capsys):
    """One step of nl_350m (model.remat=memory + GPU paths, scanned layers) profiled on one NVIDIA
    H200 with jax 0.11.2 on 2026-11-28, cut down by `benchmarks/place_trace.py --extract` (its
    kernels in thunk-formed command buffers: 30% of its op time went to '?' before the schedule
    placed them; 0.15% is left, a few memcpy kernels and one zeros fusion with nothing to go by)."""
    data = json.load(gzip.open(ROOT / "tests" / "data" / "h200_nl350m_profile.json.gz", "rt"))
    d = write(tmp_path, place_trace.profile_events(data))
    (d / "program.hlo.txt").write_text(data["hlo"])
    s = traces.summarize(d, steps=1, step_s=0.18, hlo_text=data["hlo"])
    where = s["by_scope_s"]
    assert where.get("?", 0.0) < 0.005 * sum(where.values())
    # several candidates are rare: a shared kernel's name ahead of every placed kernel of its buffer
    assert sum(v for k, v in where.items() if " | " in k) < 0.01 * sum(where.values())
    # the layer scan's residuals: stacked by the forward scan, sliced out by the backward one
    ops = traces.op_events(traces.load_events(d))["/device:GPU:0"]
    copies = [(e, w) for e, w in zip(ops, traces.place(ops, traces.Program(data["hlo"])), strict=True)
              if e["name"] == "MemcpyD2D"]
    assert copies and {w for _, w in copies} == {"forward", "backward"}
    assert place_trace.main([str(d), "--steps", "1", "--unplaced"]) == 0
    assert "kernels placed at '?', per step:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        place_trace.main([str(tmp_path / "nothing"), "--steps", "1"])
    assert "program.hlo.txt does not exist" in capsys.readouterr().err


def test_idle_before_a_step_dispatched_ahead_starts_when_the_step_before_ends(tmp_path):
    """The training loop's marks tile its time (a step dispatched ahead: its mark ends at the next
    dispatch), so the next mark starts while the step before still runs: the device is waiting
    for the new step's first op only once that op before has ended."""
    host = lambda ts, dur: {"ph": "X", "pid": 7, "tid": 3, "name": traces.STEP_EVENT, "ts": ts, "dur": dur}
    events = [
        meta(1, "/device:GPU:0"), meta(1, "Stream #13", 13), meta(7, "/host:CPU"),
        host(0, 100), op(1, 13, "fusion.1", 20, 110),  # step 1: first op at 20, runs into step 2's mark
        host(100, 100), op(1, 13, "fusion.2", 140, 50),  # step 2: its first op 10 us after fusion.1 ends
    ]
    idle = traces.summarize(write(tmp_path, events), steps=2, step_s=100e-6)["idle"]
    assert idle["steps"] == 2 and idle["before_first_op_s"] == pytest.approx((20 + 10) * 1e-6 / 2)


def test_idle_time_of_each_marked_step_is_split(tmp_path):
    """Two steps `record` marked: the device's idle time before the first op, between ops (by gap
    length, overlapping streams counted once) and after the last op, per step; the longest gaps
    name the ops around them. A trace without the marks has no `idle`."""
    host = lambda ts, dur: {"ph": "X", "pid": 7, "tid": 3, "name": traces.STEP_EVENT, "ts": ts, "dur": dur}
    events = [
        meta(1, "/device:GPU:0"), meta(1, "Stream #13", 13), meta(1, "Stream #14", 14), meta(7, "/host:CPU"),
        # step 1, window [0, 300): first op at 40; gaps 3 us (10 -> 13 on the other stream's
        # overlap: [40, 90) and [60, 100) are one interval), 60 us; last op ends at 250
        host(0, 300),
        op(1, 13, "fusion.1", 40, 50), op(1, 14, "fusion.2", 60, 40), op(1, 13, "fusion.3", 103, 7),
        op(1, 13, "while.4", 170, 80),
        # step 2, window [1000, 1100): first op at 1010, one 20 us gap, last op ends at 1095
        host(1000, 100),
        op(1, 13, "fusion.1", 1010, 30), op(1, 13, "fusion.3", 1060, 35),
    ]
    s = traces.summarize(write(tmp_path, events), steps=2, step_s=200e-6)
    idle = s["idle"]
    assert idle["steps"] == 2
    assert idle["before_first_op_s"] == pytest.approx((40 + 10) * 1e-6 / 2)
    assert idle["between_ops_s"] == pytest.approx((3 + 60 + 20) * 1e-6 / 2)
    assert idle["after_last_op_s"] == pytest.approx((50 + 5) * 1e-6 / 2)
    assert [(g["per_step"], round(g["s"] * 1e6, 6)) for g in idle["gaps"]] == [(0.5, 1.5), (0.5, 10.0), (0.5, 30.0)]
    assert idle["longest"][0] == {"us": 60, "after": "fusion.3", "before": "while.4"}
    assert idle["longest"][1] == {"us": 20, "after": "fusion.1", "before": "fusion.3"}
    assert idle["longest"][2] == {"us": 3, "after": "fusion.2", "before": "fusion.3"}  # the later end
    text = "\n".join(traces.format_summary(s))
    assert "device idle per step 0.09 ms: before the first op" in text and "between ops 0.04 ms (0.5 of under 5 us: 0.00 ms, 0.5 of 5-50 us: 0.01 ms, 0.5 of 50 us or more: 0.03 ms)" in text
    assert "after fusion.3, before while.4" in text
    unmarked = traces.summarize(write(tmp_path / "b", [e for e in events if e.get("name") != traces.STEP_EVENT]),
                                steps=2, step_s=200e-6)
    assert "idle" not in unmarked


def test_the_profiled_step_is_the_marks_mean_not_the_wall_clock_around_them(tmp_path):
    """The wall clock around a recording held the profiler's start (an H200: 449 ms a step for the
    first variant, its device "busy 3%"): for `record`'s and `trace`'s steps (from_marks), each
    marked, the busy fraction divides by the marks' mean step, the wall clock's kept beside it."""
    host = lambda ts, dur: {"ph": "X", "pid": 7, "tid": 3, "name": traces.STEP_EVENT, "ts": ts, "dur": dur}
    events = [meta(1, "/device:GPU:0"), meta(1, "Stream #13", 13), meta(7, "/host:CPU"),
              host(0, 100), op(1, 13, "fusion.1", 10, 50), host(100, 300), op(1, 13, "fusion.1", 120, 50)]
    s = traces.summarize(write(tmp_path, events), steps=2, step_s=0.449, from_marks=True)
    assert s["step_s"] == pytest.approx(200e-6) and s["wall_step_s"] == 0.449
    assert s["busy_fraction"] == pytest.approx(50 / 200)
    # marks for fewer steps than recorded (a trace cut short): the wall clock's, as before
    s = traces.summarize(tmp_path, steps=3, step_s=0.449, from_marks=True)
    assert s["step_s"] == 0.449 and "wall_step_s" not in s
    # a training run's window passes its own steps' time, without the compiling ones: kept
    s = traces.summarize(tmp_path, steps=2, step_s=0.449)
    assert s["step_s"] == 0.449 and "wall_step_s" not in s
