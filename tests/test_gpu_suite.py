"""benchmarks/gpu_suite.sh and its Python parts run on a CPU (a dry run: tiny shapes), so that the
script a GPU session gets cannot rot between sessions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import pytest
from helpers import ROOT, subprocess_env

SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def bench_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # gpu_summary imports gpu_paths as the script does
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def suite(out, *parts, **env):
    return subprocess.run(["bash", str(SUITE), str(out), *parts], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env(**{"PYTHON": sys.executable, **env}), timeout=1800)


def test_the_path_checks_pass_in_a_dry_run_and_the_summary_reads_them(tmp_path):
    """benchmarks/gpu_paths.py at tiny shapes (XLA standing in for cuDNN): every check passes,
    its JSON is what gpu_summary.py reads."""
    paths = bench_module("gpu_paths")
    assert paths.main(["--dry-run", "--reps", "1", "--out", str(tmp_path / "paths.json")]) == 0
    r = json.loads((tmp_path / "paths.json").read_text())
    assert r["ok"] and r["dry_run"] and r["attention"]["implementation"] == "xla"
    (tmp_path / "DRY_RUN").write_text("")
    rows = bench_module("gpu_summary").lines(tmp_path)
    assert sum(row.startswith("ok  ") for row in rows) == 5, rows
    pallas = r["attention_pallas"]
    assert pallas["interpret"] and set(pallas["max_err_vs_float32"]) == {"bfloat16", "float32"}


def test_a_wrong_window_fails_the_attention_check(monkeypatch):
    """The check can fail: the window passed without the causal flag (jax PR #39576's trap)
    sees future tokens, and the check says so."""
    import jax

    paths = bench_module("gpu_paths")
    monkeypatch.setattr(paths.attention, "fused_local_attention", lambda q, k, v, w, implementation: (
        jax.nn.dot_product_attention(q, k, v, local_window_size=(w - 1, w - 1), implementation=implementation)))
    assert not paths.check_attention(paths.DRY, cuda=False, reps=1)["ok"]


def test_the_pallas_check_can_fail_and_a_kernel_error_is_one_failed_line(monkeypatch):
    """A kernel with half the window fails the pallas attention check; one that raises (a Triton
    compile failure on a GPU) is a FAIL line naming the error, and the other checks still run."""
    paths = bench_module("gpu_paths")
    flash = paths.attention_kernel.flash_attention
    half = lambda q, k, v, w, **kw: flash(q, k, v, w // 2, **kw)
    monkeypatch.setattr(paths.attention_kernel, "flash_attention", half)
    assert not paths.check_pallas_attention(paths.DRY, reps=1)["ok"]

    def broken(*a, **kw):
        raise RuntimeError("triton: out of shared memory")

    monkeypatch.setattr(paths.attention_kernel, "flash_attention", broken)
    r = {"attention": paths.check_attention(paths.DRY, cuda=False, reps=1),
         "attention_pallas": paths.check_pallas_attention(paths.DRY, reps=1)}
    line = paths.pallas_line(r)
    assert line.startswith("FAIL attention pallas (interpreted)") and "out of shared memory" in line


def test_attention_tiles_picks_the_fastest_correct_launch_of_each_kernel(tmp_path, monkeypatch, capsys):
    """benchmarks/attention_tiles.py's dry run (interpreted): every kernel's candidates timed, the
    default first; a launch whose output is wrong is marked so and never chosen, however fast; the
    chosen launches together are checked against the float32 blocked form."""
    tiles = bench_module("attention_tiles")
    ak = tiles.ak
    wrong = ak.Tiles(32, 16)  # resolved at the dry run's shape as itself
    forward = ak._forward
    monkeypatch.setattr(ak, "_forward", lambda q, k, v, w, launch, interp: (
        tuple(x * 2 for x in forward(q, k, v, w, launch, interp)) if launch.block_q == wrong.block_q else
        forward(q, k, v, w, launch, interp)))
    times = iter(range(100, 0, -1))  # each candidate faster than the one before: the wrong one is the fastest forward
    monkeypatch.setattr(tiles, "timed", lambda fn, *a, reps: jax_block(fn(*a)) + next(times) * 1e-5)
    assert tiles.main(["--dry-run", "--out", str(tmp_path / "t.json")]) == 0
    r = json.loads((tmp_path / "t.json").read_text())
    assert list(r["kernels"]) == ["forward", "dkv", "dq"]
    for rows in r["kernels"].values():
        assert rows[0]["launch"]["block_q"] == 64 and rows[0]["err_vs_default"] == 0  # the default, resolved
    bad = [row for row in r["kernels"]["forward"] if row["launch"]["block_q"] == 32]
    assert len(bad) == 1 and not bad[0]["ok"] and bad[0]["err_vs_default"] > 0.5
    assert r["side_by_side"]["tuning"]["forward"] != str(bad[0]["name"]) and r["side_by_side"]["ok"]
    assert "WRONG" in capsys.readouterr().out


def test_attention_tiles_budget_leaves_candidates_out_and_still_compares(tmp_path):
    tiles = bench_module("attention_tiles")
    assert tiles.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path / "t.json")]) == 0
    r = json.loads((tmp_path / "t.json").read_text())
    assert all(rows == [] for rows in r["kernels"].values()) and len(r["not_reached"]["dq"]) == 3
    assert r["side_by_side"]["speedup"] > 0  # the default against itself


def jax_block(x):
    import jax
    jax.block_until_ready(x)
    return 0.0


def test_an_unknown_part_stops_the_suite_before_anything_runs(tmp_path):
    r = suite(tmp_path, "paths", "bogus")
    assert r.returncode == 2 and "unknown part 'bogus'" in r.stdout, r.stdout + r.stderr
    assert not any(tmp_path.iterdir())


def test_a_bench_the_budget_stops_is_stopped_not_failed(tmp_path):
    """A bench still running when SUITE_BUDGET_S runs out is killed by `timeout` and reported as
    STOPPED (its log says so), not as the bench's own failure: on 2026-11-28 a batch-128 row the
    budget cut read `FAILED` with an empty log. A bench that fails by itself still says FAILED, also
    when it is killed (exit 137) before the budget's cap."""
    fake = tmp_path / "python"
    # the suite's `-c` check (model.dtype exists) answered at once, not by importing nljax: that
    # import takes seconds on a loaded machine, and the budget left after it must stay >= SUITE_MIN_S
    fake.write_text(f"""#!/bin/sh
case "$1" in -c) exit 0 ;; benchmarks/gpu_summary.py) exec {sys.executable} "$@" ;; esac
case "$*" in *batch_size=128*) sleep 30 ;; *memory_unroll=4*) kill -9 $$ ;; *) exit 3 ;; esac
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = suite(out, "b128", SUITE_BUDGET_S="4", SUITE_MIN_S="1", PYTHON=str(fake))
    assert "STOPPED (bench_titans_demo_b128_memory)" in r.stdout and "FAILED (bench_titans_demo_b128" not in r.stdout, r.stdout
    assert "stopped by the suite's budget" in (out / "bench_titans_demo_b128_memory.log").read_text()
    r = suite(out, "fused350m", "fused350m_memunroll", SUITE_BUDGET_S="30", SUITE_MIN_S="1", PYTHON=str(fake))
    assert "FAILED (bench_nl_350m_fused, exit 3)" in r.stdout, r.stdout
    # killed (as by the OOM killer) well before its cap: timeout's code, but the bench's failure
    assert "FAILED (bench_nl_350m_fused_memunroll, exit 137)" in r.stdout, r.stdout


def test_each_bench_keeps_its_autotuning_results_unless_xla_refuses_the_flag(tmp_path):
    """Each bench compiles with its own autotune cache folder (OUT/autotune/NAME: the card's
    choices come back with the results, every compile still cold); an XLA that refuses the flag
    (the probe fails) runs every bench without it, and machine.txt says which."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
case "$2" in *zeros*) [ -n "$REFUSE" ] && exit 1; exit 0 ;; esac
case "$1" in -c) exit 0 ;; benchmarks/gpu_summary.py) exec {sys.executable} "$@" ;; esac
echo "$XLA_FLAGS" > "$OUT_FLAGS"
""")
    fake.chmod(0o755)
    out, flags = tmp_path / "out", tmp_path / "flags"
    suite(out, "b128", PYTHON=str(fake), OUT_FLAGS=str(flags))
    assert f"--xla_gpu_per_fusion_autotune_cache_dir={out}/autotune/bench_titans_demo_b128_memory" in flags.read_text()
    assert "autotune: --xla_gpu_per_fusion_autotune_cache_dir" in (out / "machine.txt").read_text()
    r = suite(tmp_path / "refused", "b128", PYTHON=str(fake), OUT_FLAGS=str(flags), REFUSE="1")
    assert "autotune" not in flags.read_text() and "refused by this XLA" in r.stdout, r.stdout


def test_the_command_buffer_part_runs_each_flag_set_in_its_own_process(tmp_path):
    """titans_cmdbuf: ab.py once per set of XLA command-buffer flags, each process with its own set
    in XLA_FLAGS (beside its autotuning folder), the defaults' run with none; a set this XLA refuses
    (its probe fails, as an older jax's for a flag it does not know) is skipped and named, the
    others still run."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
case "$2" in *zeros*) case "$XLA_FLAGS" in *update_mode*) exit 1 ;; esac; exit 0 ;; esac
case "$1" in -c) exit 0 ;; benchmarks/gpu_summary.py) exec {sys.executable} "$@" ;; esac
prev=""; for a in "$@"; do [ "$prev" = "--out" ] && out=$(basename "$a" .json); prev=$a; done
echo "$XLA_FLAGS" > "$CALLS/$out"; echo "$TF_CPP_VMODULE" > "$CALLS/$out.vmodule"; echo "$*" > "$CALLS/$out.args"
""")
    fake.chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls"
    calls.mkdir()
    r = suite(out, "vs_pytorch_while", "titans_cmdbuf", PYTHON=str(fake), CALLS=str(calls))
    vmodule = {p.stem: p.read_text().strip() for p in calls.glob("*.vmodule")}
    # titans_demo against titans-pytorch under the `while` set's flags (a part of the first call)
    assert (calls / "titans_vs_bf16_while").read_text().split()[-2:] == [
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        f"--xla_gpu_per_fusion_autotune_cache_dir={out}/autotune/titans_vs_bf16_while"], r.stdout
    for suffix in ("", ".vmodule", ".args"):
        (calls / f"titans_vs_bf16_while{suffix}").unlink()
    del vmodule["titans_vs_bf16_while"]
    flags = {p.name.removeprefix("ab_titans_cmdbuf_").removeprefix("titans_cmdbuf_"): p.read_text().split()
             for p in calls.iterdir() if p.suffix not in (".vmodule", ".args")}
    assert sorted(flags) == ["default", "log", "log_while", "off", "unroll", "while", "while_u2", "while_u4"], (
        sorted(flags), r.stdout)
    # while_u2, while_u4: the +WHILE step at 2 and at 4 chunks per loop iteration, each alone as the others
    for u in (2, 4):
        args = (calls / f"ab_titans_cmdbuf_while_u{u}.args").read_text()
        assert args.count("memory_unroll") == 1 and f"model.nl_lm.memory_unroll={u} --out" in args, args
    assert "memory_unroll" not in (calls / "ab_titans_cmdbuf_while.args").read_text()
    # the logged runs (under +WHILE and under the defaults) are the only ones that log XLA's graphs
    assert {k: v for k, v in vmodule.items() if v} == {"titans_cmdbuf_log": "command_buffer_thunk=3",
                                                       "titans_cmdbuf_log_while": "command_buffer_thunk=3"}, vmodule
    assert "FAILED" not in r.stdout, r.stdout
    cmdbuf = {name: [f for f in words if f.startswith(("--xla_gpu_enable_command_buffer", "--xla_gpu_command_buffer"))]
              for name, words in flags.items()}
    while_ = ["--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"]
    assert cmdbuf == {"default": [], "log": [], "off": ["--xla_gpu_enable_command_buffer="],
                      "while": while_, "log_while": while_, "while_u2": while_, "while_u4": while_,
                      "unroll": ["--xla_gpu_enable_command_buffer=+WHILE",
                                 "--xla_gpu_command_buffer_unroll_loops=true"]}
    assert all(f"--xla_gpu_per_fusion_autotune_cache_dir={out}/autotune/{prefix}titans_cmdbuf_{name}" in words
               for name, words in flags.items() for prefix in ["" if name.startswith("log") else "ab_"])
    for refused in ("while_skip_temp", "skip_temp"):
        assert (f"ab_titans_cmdbuf_{refused}: skipped, this XLA refuses" in r.stdout
                and "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" in r.stdout), r.stdout
    # in the order a call cut short by the budget should reach them: the whole step one graph, its
    # temporaries fixed and XLA's logs of both before the temporaries alone, whole loops unrolled
    # in one graph and no graphs at all
    said = [line.split(":")[0].removeprefix("== ") for line in r.stdout.splitlines() if line.startswith("== ")]
    assert said == ["titans_vs_bf16_while", "ab_titans_cmdbuf_default", "ab_titans_cmdbuf_while",
                    "ab_titans_cmdbuf_while_skip_temp", "ab_titans_cmdbuf_while_u2", "ab_titans_cmdbuf_while_u4",
                    "titans_cmdbuf_log_while",
                    "titans_cmdbuf_log", "ab_titans_cmdbuf_skip_temp", "ab_titans_cmdbuf_unroll", "ab_titans_cmdbuf_off"], said


def test_the_summary_names_each_command_buffer_run_by_its_flags(tmp_path):
    """titans_cmdbuf's rows: each run's step with the XLA flags it ran under (ab.py's `xla_flags`),
    the defaults' first, the others as a ratio to it."""
    def run(name, flags, ms):
        row = {"variant": "model.dtype=bfloat16", "median_ms": ms, "min_ms": ms, "ratio": 1.0, "compile_s": 45.0,
               "executable": "compiled", "ops_per_step": 4390, "busy_fraction": 0.7}
        (tmp_path / f"ab_titans_cmdbuf_{name}.json").write_text(json.dumps({"xla_flags": flags, "rows": [row]}))

    run("off", ["--xla_gpu_enable_command_buffer="], 20.0)
    run("default", [], 16.0)
    for u, ms in ((2, 12.0), (4, 11.0)):  # named by the flags and the unroll
        run(f"while_u{u}", ["--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"], ms)
        one = json.loads((tmp_path / f"ab_titans_cmdbuf_while_u{u}.json").read_text())
        one["rows"][0]["variant"] += f" model.nl_lm.memory_unroll={u}"
        (tmp_path / f"ab_titans_cmdbuf_while_u{u}.json").write_text(json.dumps(one))
    rows = [r for r in bench_module("gpu_summary").lines(tmp_path) if "command buffers" in r]
    assert rows[2:] == [
        f"info  titans_demo command buffers, --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
        f"model.nl_lm.memory_unroll={u}: {ms:.2f} ms/step through the training loop (x{ms / 16:.3f} of the defaults' "
        "run), compile 45 s; 4,390 kernels/step, device busy 70% of the step" for u, ms in ((2, 12.0), (4, 11.0))], rows
    rows = rows[:2]
    assert rows == ["info  titans_demo command buffers, XLA's defaults: 16.00 ms/step through the training loop, "
                    "compile 45 s; 4,390 kernels/step, device busy 70% of the step",
                    "info  titans_demo command buffers, --xla_gpu_enable_command_buffer=: 20.00 ms/step through the "
                    "training loop (x1.250 of the defaults' run), compile 45 s; 4,390 kernels/step, device busy 70% "
                    "of the step"], rows


def test_the_summary_counts_xlas_graph_launches_and_updates_per_step(tmp_path):
    """titans_cmdbuf_log: XLA's log lines (command_buffer_thunk.cc at VLOG 3, as jax 0.11.2's XLA
    writes them) counted per step of the logged run, each update with how many buffers had moved;
    a log without them (a CPU) is said to have none."""
    summary = bench_module("gpu_summary")
    (tmp_path / "titans_cmdbuf_log.json").write_text(json.dumps({"rounds": 1, "warmup": 1, "loop": 4, "rows": []}))
    (tmp_path / "titans_cmdbuf_log_while.json").write_text(json.dumps(
        {"rounds": 1, "warmup": 1, "loop": 4, "rows": [], "xla_flags": ["--xla_gpu_enable_command_buffer=+WHILE"]}))
    log = tmp_path / "titans_cmdbuf_log.log"
    log.write_text("nljax.bench: compiled\n")
    assert [r for r in summary.lines(tmp_path) if "XLA's log" in r] == [
        "info  titans_demo command buffers, XLA's log (its defaults): no graph launched or recorded in 8 steps (no command buffers "
        "on this device, or this XLA logs them otherwise)"]
    record = ("I1201 10:00:00.000000 1 command_buffer_thunk.cc:300] [0] Create/Update command buffer by recoding "
              "command buffer cmd sequence after {e} executions since last update; num_commands=41; "
              "updated_allocs={n}; is_first_record={first}; needs_update={update}\n")
    launch = "I1201 10:00:00.000001 1 command_buffer_thunk.cc:330] [0] Execute command buffer; num_executions=1\n"
    log.write_text(2 * record.format(e=0, n=90, first=1, update=0) + 6 * record.format(e=1, n=0, first=0, update=1)
                   + 2 * record.format(e=1, n=3, first=0, update=1) + 24 * launch)
    assert [r for r in summary.lines(tmp_path) if "XLA's log" in r] == [
        "info  titans_demo command buffers, XLA's log (its defaults, 8 steps): 3.0 graph launches per step, 1.0 "
        "updates per step before one (8 in all; buffers 0 moved: 6, 3 moved: 2), 2 first recordings"]
    # each logged run under its own flags; the +WHILE one: one graph a step, recorded once
    (tmp_path / "titans_cmdbuf_log_while.log").write_text(record.format(e=0, n=90, first=1, update=0) + 8 * launch)
    assert [r for r in summary.lines(tmp_path) if "XLA's log" in r][1] == (
        "info  titans_demo command buffers, XLA's log (--xla_gpu_enable_command_buffer=+WHILE, 8 steps): 1.0 graph "
        "launches per step, 0.0 updates per step before one (0 in all; buffers -), 1 first recordings")


def test_the_summary_gives_the_loop_kernels_ratio_to_titans_pytorch_when_measured(tmp_path):
    """vs_pytorch_loop's, vs_pytorch_parallel's and vs_pytorch_while's rows (the 100x target with
    memory_impl=parallel_pallas, =parallel, and XLA's loops in graphs) beside the auto forms' row, each against the target; absent, only the auto row says
    'skipped'."""
    summary = bench_module("gpu_summary")
    rows = [r for r in summary.lines(tmp_path) if "titans-pytorch" in r]
    assert len(rows) == 1 and rows[0].endswith("skipped"), rows
    for name, ratio in (("titans_vs_bf16", 45.2), ("titans_vs_bf16_loop", 120.0), ("titans_vs_bf16_parallel", 99.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"ratio_tokens_per_s": ratio, "nljax": {"tokens_per_s": ratio * 2000},
                                                           "titans_pytorch": {"tokens_per_s": 2000}}))
    rows = [r for r in summary.lines(tmp_path) if "titans-pytorch" in r]
    assert rows[0].startswith("MISS") and "45.2x" in rows[0], rows
    assert rows[1].startswith("MET") and "memory_impl=parallel_pallas: 120.0x" in rows[1], rows
    assert rows[2].startswith("MISS") and "memory_impl=parallel: 99.0x" in rows[2], rows
    (tmp_path / "titans_vs_bf16_while.json").write_text(json.dumps({"ratio_tokens_per_s": 101.0, "nljax": {
        "tokens_per_s": 202000}, "titans_pytorch": {"tokens_per_s": 2000}}))
    row = [r for r in summary.lines(tmp_path) if "titans-pytorch" in r][3]
    assert row.startswith("MET") and "XLA's while loops in its graphs (+WHILE): 101.0x" in row, row
    # measured through the training loop as well: that figure decides, the other beside it
    (tmp_path / "titans_vs_bf16.json").write_text(json.dumps({
        "ratio_tokens_per_s": 90.0, "ratio_tokens_per_s_in_loop": 104.0,
        "nljax": {"tokens_per_s": 180000, "tokens_per_s_in_loop": 208000,
                  "forms": {"attention": "cudnn", "memory_impl": "parallel", "loss_chunk": None}},
        "titans_pytorch": {"tokens_per_s": 2000}}))
    row = [r for r in summary.lines(tmp_path) if "titans-pytorch" in r][0]
    assert row.startswith("MET") and "104.0x in the training loop, 90.0x each step waited for" in row, row
    assert row.endswith("; computed by: attention cudnn, memory_impl parallel"), row  # what auto took there


def test_the_summary_judges_nl_350m_by_its_mfu_through_the_training_loop(tmp_path):
    """A bench that timed the loop (nljax.bench --loop): the loop's MFU decides the verdict, the
    waited steps' beside it; a bench without it (an older JSON) is judged by the waited steps."""
    summary = bench_module("gpu_summary")
    bench = {"mfu_analytic_mean": 0.30, "mfu_analytic_in_loop_mean": 0.41, "loop_step_ms_mean": 90.0,
             "mean_step_ms": 123.0, "memory": {"peak_bytes": 30e9}}
    (tmp_path / "bench_nl_350m_fused_best.json").write_text(json.dumps(bench))
    row = next(r for r in summary.lines(tmp_path) if "unrolled, memory_unroll=4:" in r)
    assert row.startswith("MET") and "41.0% analytic in the training loop (90.0 ms/step), 30.0% each step waited for" in row, row
    del bench["mfu_analytic_in_loop_mean"]
    (tmp_path / "bench_nl_350m_fused_best.json").write_text(json.dumps(bench))
    row = next(r for r in summary.lines(tmp_path) if "unrolled, memory_unroll=4:" in r)
    assert row.startswith("MISS") and ": 30.0% analytic (target >= 40%; 123.0 ms/step waited for" in row, row


def test_the_suite_hands_its_executables_folder_to_every_bench(tmp_path):
    """SUITE_EXECUTABLES=DIR: every bench runs with NLJAX_EXECUTABLES=DIR (absolute) and
    machine.txt names it; a DIR that is no folder stops the suite with one line; unset, nothing."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
case "$2" in *zeros*) exit 0 ;; esac
case "$1" in -c) exit 0 ;; benchmarks/gpu_summary.py) exec {sys.executable} "$@" ;; esac
echo "[$NLJAX_EXECUTABLES]" > "$OUT_SEEN"
""")
    fake.chmod(0o755)
    exe, seen = tmp_path / "exe", tmp_path / "seen"
    exe.mkdir()
    (exe / "0123.xla").write_bytes(b"")
    suite(tmp_path / "out", "b128", PYTHON=str(fake), OUT_SEEN=str(seen), SUITE_EXECUTABLES=str(exe))
    assert seen.read_text().strip() == f"[{exe}]"
    assert f"executables: NLJAX_EXECUTABLES={exe} (1 files)" in (tmp_path / "out" / "machine.txt").read_text()
    r = suite(tmp_path / "missing", "b128", PYTHON=str(fake), OUT_SEEN=str(seen),
              SUITE_EXECUTABLES=str(tmp_path / "no"))
    assert r.returncode == 2 and r.stdout.strip() == f"SUITE_EXECUTABLES={tmp_path / 'no'}: not a directory", r.stdout
    suite(tmp_path / "plain", "b128", PYTHON=str(fake), OUT_SEEN=str(seen))
    assert seen.read_text().strip() == "[]" and "executables" not in (tmp_path / "plain" / "machine.txt").read_text()


PREPARE = ROOT / "benchmarks" / "gpu_prepare.sh"


def test_prepare_compiles_each_part_with_the_suites_overrides_and_its_autotuning_results(tmp_path):
    """benchmarks/gpu_prepare.sh hands gpu_compile.py the suite's overrides of each part (the key
    of a step is its program: another override, another program, nothing loaded on the card),
    with the card's autotuning results of that bench where AUTOTUNE has them."""
    text = SUITE.read_text()
    prepare = PREPARE.read_text()
    fused = "FUSED=(model.remat=memory model.nl_lm.attention=auto model.nl_lm.embed_grad=onehot)"
    assert fused in text and fused in prepare
    scan = "SCAN=(model.nl_lm.memory_impl=scan)"  # auto is the parallel form on a GPU: the scan's rows name it
    assert scan in text and scan in prepare
    for name, overrides in (("_loop", "model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel_pallas"),
                            ("_best", 'model.nl_lm.scan_layers=false model.nl_lm.memory_unroll=4 "${SCAN[@]}"'),
                            ("_parallel", "model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel"),
                            ("_parallel4", "model.nl_lm.scan_layers=false model.nl_lm.memory_impl=parallel "
                                           "model.nl_lm.memory_unroll=4")):
        assert f"fused350m {name} {overrides}" in text and f"fused350m{name} {name} {overrides};" in prepare, name
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$*" >> "$OUT_ARGS"\n')
    fake.chmod(0o755)
    args, tuned = tmp_path / "args", tmp_path / "autotune"
    (tuned / "ab_titans_loop").mkdir(parents=True)
    env = subprocess_env(PYTHON=str(fake), OUT_ARGS=str(args), AUTOTUNE=str(tuned))
    r = subprocess.run(["bash", str(PREPARE), str(tmp_path / "exe"), "titans_loop", "b128"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    loop, b128 = args.read_text().splitlines()
    exe = tmp_path / "exe"
    assert loop == (f"benchmarks/gpu_compile.py --gpu h200 --save-executables {exe} --out {exe / 'titans_loop.json'} "
                    f"--autotune {tuned / 'ab_titans_loop'} --config titans_demo "
                    "--variant loop:model.nl_lm.memory_impl=parallel_pallas model.dtype=bfloat16 model.nl_lm.memory_impl=scan")
    assert "--autotune" not in b128 and b128.endswith("model.dtype=bfloat16 model.remat=memory train.batch_size=128")
    forms_args = tmp_path / "forms_args"  # titans_forms takes ab_titans_loop's results when it has none of its own
    r = subprocess.run(["bash", str(PREPARE), str(exe), "titans_forms", "ab350m"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "OUT_ARGS": str(forms_args)}, timeout=60)
    forms, ab350m = forms_args.read_text().splitlines()
    assert r.returncode == 0 and f"--autotune {tuned / 'ab_titans_loop'} " in forms, r.stdout + r.stderr
    assert ("--variant parallel:model.nl_lm.memory_impl=parallel --variant parallel16:model.nl_lm.memory_impl=parallel,"
            "model.nl_lm.memory_unroll=16 --variant loop:model.nl_lm.memory_impl=parallel_pallas") in forms
    assert "--autotune" not in ab350m and ab350m.endswith(f"{fused[7:-1]} model.nl_lm.scan_layers=false {scan[6:-1]}")
    assert "no autotuning results (AUTOTUNE/ab_nl_350m)" in r.stdout
    assert "XLA's default matmul tiles" in r.stdout
    # titans_unroll's unroll-1 step is vs_pytorch's (one key): with that bench's results when it has none
    (tuned / "titans_vs_bf16_parallel").mkdir()
    unroll_args = tmp_path / "unroll_args"
    r = subprocess.run(["bash", str(PREPARE), str(exe), "titans_unroll"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "OUT_ARGS": str(unroll_args)}, timeout=60)
    assert r.returncode == 0 and f"--autotune {tuned / 'titans_vs_bf16_parallel'} " in unroll_args.read_text(), r.stdout
    # titans_cmdbuf: vs_pytorch's step under the suite's +WHILE sets' XLA flags (a step's key has them)
    for flag in ("WHILE=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
                 "SKIP_TEMP=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"):
        assert flag in text and flag in prepare, flag
    assert '"while_skip_temp $WHILE $SKIP_TEMP"' in text and '"while $WHILE"' in text
    fake.write_text('#!/bin/sh\necho "$XLA_FLAGS|$*" >> "$OUT_ARGS"\n')
    cmdbuf_args = tmp_path / "cmdbuf_args"
    r = subprocess.run(["bash", str(PREPARE), str(exe), "titans_cmdbuf"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "OUT_ARGS": str(cmdbuf_args), "XLA_FLAGS": ""}, timeout=60)
    runs = [line.split("|") for line in cmdbuf_args.read_text().splitlines()]
    assert r.returncode == 0 and [flags for flags, _ in runs] == [
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_update_mode=SKIP_TEMP",
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"], runs
    assert all(f"--autotune {tuned / 'titans_vs_bf16_parallel'} --config titans_demo" in a
               and a.endswith("model.dtype=bfloat16") for _, a in runs), runs
    assert ("--no-base --variant u2:model.nl_lm.memory_unroll=2 --variant u4:model.nl_lm.memory_unroll=4"
            in runs[2][1]), runs  # while_u2's and while_u4's steps
    r = subprocess.run(["bash", str(PREPARE), str(tmp_path / "exe"), "bogus"], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("unknown part 'bogus'")


def test_the_suite_reads_as_bash():
    assert subprocess.run(["bash", "-n", str(SUITE)], capture_output=True).returncode == 0
    assert subprocess.run(["bash", "-n", str(PREPARE)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_the_issue44_suite_runs_dry_on_a_cpu(tmp_path):
    """Every part of the default preset, tiny shapes, one step each (minutes on 2 cores): each
    writes its JSON and the summary says it was a dry run."""
    r = suite(tmp_path, GPU_SUITE_DRY_RUN="1", SUITE_BUDGET_S="1500")
    logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("paths", "bench_nl_350m_fused", "bench_nl_350m_fused_unrolled", "bench_nl_350m_fused_memunroll",
                 "bench_nl_350m_fused_kernel", "bench_nl_350m_fused_best",
                 "bench_nl_350m_fused_best8", "bench_nl_350m_fused_graphs", "bench_nl_350m_fused_parallel",
                 "bench_nl_350m_fused_parallel4", "bench_nl_350m_fused_loop", "memory_loop_kernel", "memory_pullback",
                 "attention_tiles",
                 "titans_vs_bf16", "titans_vs_bf16_while", "titans_vs_bf16_loop", "titans_vs_bf16_parallel", "ab_titans_alone", "ab_titans_loop", "ab_titans_unroll", "ab_titans_forms", "ab_nl_350m",
                 "bench_titans_demo_b128_memory", "ab_titans_cmdbuf_default", "ab_titans_cmdbuf_while",
                 "titans_cmdbuf_log"):
        assert (tmp_path / f"{name}.json").exists(), (name, r.stdout, logs)
    assert "model.nl_lm.memory_impl=parallel_pallas" in json.loads((tmp_path / "titans_vs_bf16_loop.json").read_text())["overrides"]
    assert "model.nl_lm.memory_impl=parallel" in json.loads((tmp_path / "titans_vs_bf16_parallel.json").read_text())["overrides"]
    assert len(json.loads((tmp_path / "ab_titans_alone.json").read_text())["rows"]) == 1
    for trace in ("trace_nl_350m_fused", "trace_nl_350m_fused_best"):  # kept for the profile's placement
        assert (tmp_path / trace / "program.hlo.txt").exists()
    assert "jax " in (tmp_path / "machine.txt").read_text()  # the card and software, for the report
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("DRY RUN") and "GPU paths, scanned" in summary and "FAILED" not in r.stdout, r.stdout
    assert "Pallas attention's launches tuned" in summary


def test_titans_pytorch_reports_the_training_loops_cycle_beside_the_waited_steps():
    """benchmarks/titans_pytorch.py's report: the cycle mean of the waited steps (7/8 level 0 +
    1/8 the slower pattern) and the loop's 8 steps per call as its own figure and ratio."""
    tp = bench_module("titans_pytorch")
    args = types.SimpleNamespace(batch=4, seq=512, device="cuda", dtype="bf16", threads=0, config="titans_demo",
                                 overrides=[])
    sizes = {"nljax": {"params": 10, "nonembedding_params": 6}, "titans_pytorch": {"params": 20, "nonembedding_params": 12}}
    med = {"nljax L0": 0.020, "nljax L0+1+2+3": 0.028, f"nljax {tp.LOOP}": 8 * 0.018, "titans-pytorch": 1.0}
    r = tp.report(args, med, sizes, "bfloat16")
    assert r["nljax"]["step_s"] == {"L0": 0.020, "L0+1+2+3": 0.028}  # the loop's call is no pattern
    assert r["nljax"]["step_s_cycle_mean"] == pytest.approx((7 * 0.020 + 0.028) / 8)
    assert r["nljax"]["step_s_in_loop"] == pytest.approx(0.018)
    assert r["ratio_tokens_per_s_in_loop"] == pytest.approx(1.0 / 0.018)
    assert "nljax (loop)" in tp.format_report(r) and "in the training loop 55.6x" in tp.format_report(r)


@pytest.mark.slow
def test_titans_pytorch_times_nljax_through_the_loop(tmp_path):
    """The script's nljax side on a CPU (--skip-torch, a tiny titans_demo): both waited patterns
    and the loop's cycle are timed and written."""
    out = tmp_path / "tp.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "titans_pytorch.py"), "--skip-torch", "--batch", "1",
                        "--seq", "32", "--rounds", "1", "--warmup", "0", "--threads", "0", "--out", str(out),
                        "train.batch_size=1", "train.seq_len=32", "model.dim=32", "model.heads=2", "model.depth=2",
                        "model.nl_lm.memory_layers=[1]", "model.nl_lm.memory_dim=8", "model.nl_lm.memory_hidden=8"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    nl = json.loads(out.read_text())["nljax"]
    assert sorted(nl["step_s"]) == ["L0", "L0+1+2+3"] and nl["step_s_in_loop"] > 0 and nl["tokens_per_s_in_loop"] > 0
    assert nl["forms"]["memory_impl"] == "scan"  # auto on a CPU
