"""The GPU targets of issues 17 (item 6) and 44, read from the JSON that benchmarks/gpu_suite.sh wrote.

    python benchmarks/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_paths.py beside it, imported or run as a script


def load(out: Path, name: str) -> dict | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def verdict(ok: bool | None) -> str:
    return "n/a " if ok is None else ("MET " if ok else "MISS")


def profiled(b: dict) -> str:
    """The profile's headline (bench --profile), if the bench ran one."""
    p = b.get("profile")
    if not p:
        return ""
    cats = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["by_category_s"].items())
    where = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in list(p.get("by_scope_s", {}).items())[:4])
    busy = f", busy {p['busy_s'] * 1e3:.1f} ms per step" + (f" (step {p['timed_step_s'] * 1e3:.1f} ms without the profiler)"
                                                          if p.get("timed_step_s") else "")
    return (f"; profile: {kernels(p['ops'], p['busy_fraction'])} under the profiler{busy} "
            f"(median {p['median_op_us']:.1f} us); {cats}"
            + (f"; most time in: {where}" if where else "") + idled(p.get("idle")))


def idled(idle: dict | None) -> str:
    """Where the device waited in a profiled step (nljax.measure.traces, `idle`), if recorded."""
    if not idle:
        return ""
    ms = lambda k: f"{idle[k] * 1e3:.1f} ms"
    return (f"; device idle: before the first op {ms('before_first_op_s')}, between ops {ms('between_ops_s')}, "
            f"after the last op {ms('after_last_op_s')}")


def gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.1f} GB"


def loaded(row: dict) -> str:
    """" (loaded, not compiled)" for a step loaded from an executable compiled ahead
    (NLJAX_EXECUTABLES); " (the step of ...)" for an ab.py variant that shares another's step."""
    how = row.get("executable", "compiled")
    return "" if how == "compiled" else f" (the step {how})" if how.startswith("shared") else " (loaded, not compiled)"


def kernels(per_step: float, busy) -> str:
    return f"{per_step:,.0f} kernels/step, device busy {100 * (busy or 0):.0f}% of the step"


def lines(out: Path) -> list[str]:
    rows = []
    b = load(out, "bench_titans_demo")
    if b:
        comp = ", ".join(f"{k} {p['compile_s']:.1f} s{loaded(p)}" for k, p in b["per_pattern"].items())
        rows.append(f"info  titans_demo: {b['units_per_s_per_device_mean']:,.0f} tokens/s/device mean, "
                    f"worst {b['units_per_s_per_device_worst']:,.0f}; compile per variant: {comp}")
    for name, how in (("titans_vs_bf16", ""), ("titans_vs_bf16_loop", ", memory_impl=parallel_pallas"),
                      ("titans_vs_bf16_parallel", ", memory_impl=parallel"),
                      ("titans_vs_bf16_while", ", XLA's while loops in its graphs (+WHILE)")):
        t = load(out, name)
        ratio = t.get("ratio_tokens_per_s") if t else None
        if ratio is None and how:  # another form's row only when its part ran
            continue
        # the training loop's figure (what training gets) where measured, each step waited for beside it
        looped = t.get("ratio_tokens_per_s_in_loop") if t else None
        best = looped if looped is not None else ratio
        said = "skipped" if ratio is None else (
            f"{ratio:.1f}x (target >= 100x; {t['nljax']['tokens_per_s']:,.0f} vs "
            f"{t['titans_pytorch']['tokens_per_s']:,.0f} tokens/s)" if looped is None else
            f"{looped:.1f}x in the training loop, {ratio:.1f}x each step waited for (target >= 100x; "
            f"{t['nljax']['tokens_per_s_in_loop']:,.0f} vs {t['titans_pytorch']['tokens_per_s']:,.0f} tokens/s)")
        rows.append(f"{verdict(None if best is None else best >= 100)}  titans_demo vs titans-pytorch bf16, batch 4{how}: "
                    + said + forms((t or {}).get("nljax", {}).get("forms")))
    ab = (("titans_demo", "ab_titans_forms"), ("titans_demo", "ab_titans_alone"), ("titans_demo", "ab_titans_remat"),
          ("titans_demo", "ab_titans_loop"),
          ("titans_demo", "ab_titans_unroll"), ("nl_350m", "ab_nl_350m"))
    for config, r in [(config, r) for config, name in ab for r in (load(out, name) or {}).get("rows", [])]:
        rows.append(f"info  {config} {' '.join(r['variant'].split())}: {r['median_ms']:.2f} ms/step (x{r['ratio']:.3f} "
                    f"of the first), compile {r['compile_s']:.0f} s{loaded(r)}{profiled_ops(r)}{forms(r.get('forms'))}")
    rows += cmdbuf_lines(out)
    for name in ("bench_titans_demo_graphs",):
        b = load(out, name)
        if b:
            rows.append(f"info  {name}: {b['mean_step_ms']:.2f} ms/step, {b['units_per_s_per_device_mean']:,.0f} "
                        f"tokens/s/device{profiled(b)}")
    for remat in ("block", "memory"):
        b = load(out, f"bench_titans_demo_b128_{remat}")
        peak = b["memory"]["peak_bytes"] if b else None
        rows.append(f"{verdict(None if peak is None else peak < 20e9)}  titans_demo batch 128 x 512 peak memory, "
                    f"model.remat={remat}: " + ("-" if peak is None else f"{peak / 1e9:.1f} GB (target < 20 GB; "
                                                f"{b['units_per_s_per_device_mean']:,.0f} tokens/s/device){forms(config_forms(b))}"))
    for name, remat in (("bench_nl_350m", "block, scanned"), ("bench_nl_350m_memory", "memory, scanned"),
                        ("bench_nl_350m_unrolled", "memory, scan_layers=false")):
        # MFU of the model's FLOPs (analytic: the outer loop, attention, the inner loop's estimate);
        # XLA's count where it has one (not for a scanned net: it counts a loop's body once)
        b = load(out, name)
        mfu = b["mfu_analytic_mean"] if b else None
        xla = "" if not b or b.get("mfu_mean") is None else f", {100 * b['mfu_mean']:.1f}% XLA count"
        rows.append(f"{verdict(None if mfu is None else mfu >= 0.40)}  nl_350m seq 2048 MFU, model.remat={remat}: "
                    + ("-" if mfu is None else f"{100 * mfu:.1f}% analytic{xla} (target >= 40%; "
                       f"{b['flops']['params'] / 1e6:.0f}M parameters; peak {gb(b['memory']['peak_bytes'])})"
                       f"{profiled(b)}"))
    rows += memory_kernel_lines(load(out, "memory_kernel"))
    rows += memory_kernel_lines(load(out, "memory_loop_kernel"), "loop kernel")
    rows += memory_kernel_lines(load(out, "memory_pullback"), "parallel form's pull-backs")
    rows += issue44_lines(out)
    mf, fm = load(out, "bench_dit_b4_meanflow"), load(out, "bench_dit_b4_flow_matching")
    r = mf["mean_step_ms"] / fm["mean_step_ms"] if mf and fm else None
    rows.append(f"{verdict(None if r is None else r <= 1.6)}  DiT-B/4 32x32 MeanFlow / flow-matching step: "
                + ("-" if r is None else f"{r:.2f}x (target <= 1.6x; {mf['mean_step_ms']:.1f} vs {fm['mean_step_ms']:.1f} ms)"))
    return rows


def profiled_ops(r: dict) -> str:
    """'; N kernels/step, ... idle ...' of an ab.py row profiled (--profile), else nothing."""
    return f"; {kernels(r['ops_per_step'], r['busy_fraction'])}{idled(r.get('idle'))}" if "ops_per_step" in r else ""


def cmdbuf_lines(out: Path) -> list[str]:
    """The titans_cmdbuf part's runs (auto's step alone through ab.py's loop, one process per set of
    XLA command-buffer flags, OUT/ab_titans_cmdbuf_NAME.json): each set's step, named by the flags
    it ran under, against the run with XLA's defaults."""
    runs = {p.stem.removeprefix("ab_titans_cmdbuf_"): json.loads(p.read_text())
            for p in sorted(out.glob("ab_titans_cmdbuf_*.json"))}
    base = runs["default"]["rows"][0]["median_ms"] if "default" in runs else None
    rows = []
    for name in sorted(runs, key=lambda n: n != "default"):  # the defaults first, then by name
        r = runs[name]["rows"][0]
        flags = " ".join(runs[name].get("xla_flags") or []) or "XLA's defaults"
        unroll = [w for w in r["variant"].split() if w.startswith("model.nl_lm.memory_unroll=")]  # while_u2, _u4
        ratio = "" if base is None or name == "default" else f" (x{r['median_ms'] / base:.3f} of the defaults' run)"
        rows.append(f"info  titans_demo command buffers, {' '.join([flags, *unroll])}: {r['median_ms']:.2f} ms/step "
                    f"through the training loop{ratio}, compile {r['compile_s']:.0f} s{loaded(r)}{profiled_ops(r)}")
    return rows + cmdbuf_log_lines(out)


# XLA's log lines (xla/backends/gpu/runtime/command_buffer_thunk.cc at VLOG 3, jax 0.11.2): one
# before each graph's first recording or update, one at each launch
_RECORDED = re.compile(r"Create/Update command buffer.*?; updated_allocs=(\d+); "
                       r"is_first_record=(\w+); needs_update=(\w+)")
_LAUNCHED = "Execute command buffer; num_executions="


def cmdbuf_log_lines(out: Path) -> list[str]:
    """The titans_cmdbuf part's logged runs (OUT/titans_cmdbuf_log*.log, each under its set's
    flags): graph launches, first recordings and updates per step, and how many buffers had moved
    before an update; nothing when the part did not run."""
    rows = []
    for log in sorted(out.glob("titans_cmdbuf_log*.log")):
        meta = load(out, log.stem)
        if not meta:
            continue
        steps = (meta["rounds"] + meta.get("warmup", 0)) * max(meta["loop"], 1)
        flags = " ".join(meta.get("xla_flags") or []) or "its defaults"
        text = log.read_text(errors="replace")
        launches = text.count(_LAUNCHED)
        records = [(int(n), first in ("1", "true"), update in ("1", "true"))
                   for n, first, update in _RECORDED.findall(text)]
        if not launches and not records:
            rows.append(f"info  titans_demo command buffers, XLA's log ({flags}): no graph launched or recorded in "
                        f"{steps} steps (no command buffers on this device, or this XLA logs them otherwise)")
            continue
        updates = [n for n, first, update in records if update and not first]
        spread = ", ".join(f"{k} moved: {v}" for k, v in sorted(collections.Counter(updates).items()))
        rows.append(f"info  titans_demo command buffers, XLA's log ({flags}, {steps} steps): "
                    f"{launches / steps:,.1f} graph launches per step, {len(updates) / steps:,.1f} updates per step "
                    f"before one ({len(updates)} in all; buffers {spread or '-'}), "
                    f"{sum(first for _, first, _ in records)} first recordings")
    return rows


def memory_kernel_lines(m: dict | None, what: str = "kernel") -> list[str]:
    """The fused memory kernels against the scan (benchmarks/memory_kernel.py, one JSON): issue
    44's >= 3x, for the kernel, its forward with the scan's backward (the fallback) and the loop
    kernel; the parallel-reads form's ratio alongside ("info": the target is the kernels')."""
    if not m:
        return [f"{verdict(None)}  memory {what} fwd+bwd vs scan: -"]
    rows = [f"MISS  memory {what} at {name}'s shapes: {err}" for name, err in m.get("errors", {}).items()]
    for name, r in m["shapes"].items():
        ms = r["median_ms"]
        for k, c in r["check"].items():
            sp = r["speedup"][k].get("forward+backward")
            check = (f"check ok (largest difference {c['max_rel_err']['outputs']:.1e} outputs, "
                     f"{c['max_rel_err']['grads']:.1e} gradients, of each leaf's largest entry)" if c["ok"] else
                     f"CHECK FAILED: {c.get('error') or c['max_rel_err']}")
            timing = ("not timed: " + r["errors"].get(f"{k} forward+backward", "?") if sp is None else
                      f"{sp:.2f}x (target >= {m['target_speedup']:g}x; {ms[f'{k} forward+backward']:.2f} vs "
                      f"{ms['scan forward+backward']:.2f} ms)")
            met = verdict(c["ok"] and sp is not None and sp >= m["target_speedup"])
            if k.startswith("parallel"):  # the XLA forms: no target of their own
                met = "info" if c["ok"] else "FAIL"
            rows.append(f"{met}  memory {k} fwd+bwd vs "
                        f"scan, {name}'s shapes: {timing}; {check}")
        written, by_jax = (ms.get(f"{k} forward+backward") for k in ("parallel", "parallel, JAX's pull-back"))
        if written and by_jax:
            rows.append(f"info  memory parallel form, {name}'s shapes: the hand-written pull-back (end_pullback) "
                        f"{by_jax / written:.2f}x the speed of JAX's ({written:.2f} vs {by_jax:.2f} ms fwd+bwd)")
    return rows


def issue44_lines(out: Path) -> list[str]:
    """nl_lm's GPU paths (benchmarks/gpu_paths.py) checked and timed, and nl_350m with them."""
    rows = []
    p = load(out, "paths")
    if p:
        from gpu_paths import lines as path_lines  # benchmarks/gpu_paths.py: its own wording of each check

        rows += path_lines(p)  # "ok  " or "FAIL" first
    if t := load(out, "attention_tiles"):
        c = t["side_by_side"]
        tuned = ", ".join(f"{k} {v}" for k, v in c["tuning"].items())
        rows.append(f"{'ok  ' if c['ok'] else 'FAIL'}  Pallas attention's launches tuned at {t['shape']['seq']} tokens, "
                    f"window {t['shape']['window']}: forward + backward x{c['speedup']:.2f} the default's speed "
                    f"({c['fwd_bwd_ms']['tuned']:.3f} against {c['fwd_bwd_ms']['default']:.3f} ms; {tuned})")
    for name, how in (("bench_nl_350m_fused", "scanned"), ("bench_nl_350m_fused_unrolled", "unrolled"),
                      ("bench_nl_350m_fused_memunroll", "scanned, memory_unroll=4"),
                      ("bench_nl_350m_fused_best", "unrolled, memory_unroll=4"),
                      ("bench_nl_350m_fused_best8", "unrolled, memory_unroll=8"),
                      ("bench_nl_350m_fused_graphs", "unrolled, memory_unroll=4, while loops in CUDA graphs"),
                      ("bench_nl_350m_fused_parallel", "unrolled, memory_impl=parallel"),
                      ("bench_nl_350m_fused_parallel4", "unrolled, memory_impl=parallel, memory_unroll=4"),
                      ("bench_nl_350m_fused_loop", "unrolled, memory_impl=parallel_pallas"),
                      ("bench_nl_350m_fused_kernel", "scanned, memory_impl=pallas")):
        b = load(out, name)
        mfu = b["mfu_analytic_mean"] if b else None
        # through the training loop where the bench timed it (what training gets): that decides
        looped = b.get("mfu_analytic_in_loop_mean") if b else None
        best = looped if looped is not None else mfu
        said = "-" if mfu is None else (
            (f"{100 * mfu:.1f}% analytic" if looped is None else
             f"{100 * looped:.1f}% analytic in the training loop ({b['loop_step_ms_mean']:.1f} ms/step), "
             f"{100 * mfu:.1f}% each step waited for") +
            f" (target >= 40%; {b['mean_step_ms']:.1f} ms/step waited for; peak {gb(b['memory']['peak_bytes'])} "
            f"(target <= 36.3 GB)){profiled(b)}{forms(config_forms(b))}")
        rows.append(f"{verdict(None if best is None else best >= 0.40)}  nl_350m seq 2048 MFU, model.remat=memory + GPU "
                    f"paths, {how}: " + said)
    return rows


def config_forms(b: dict) -> dict | None:
    """The forms an nljax.bench result records (its config's)."""
    return (b.get("config") or {}).get("forms")


def forms(f: dict | None) -> str:
    """'; computed by: attention pallas, memory_impl parallel, ...' (what `auto` took on this GPU),
    from the forms a bench recorded (None: nothing said)."""
    return "; computed by: " + ", ".join(f"{k} {v}" for k, v in f.items() if v is not None) if f else ""


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dry = ["DRY RUN (GPU_SUITE_DRY_RUN): tiny shapes, one step: not measurements; MET/MISS mean nothing"] \
        if (out / "DRY_RUN").exists() else []
    print("\n".join(dry + lines(out)))
