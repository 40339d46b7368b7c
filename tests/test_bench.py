"""`python -m nljax.bench` as a user runs it: a smoke test of its JSON, not a benchmark."""

import json
import math
import os
import platform

import pytest
from helpers import TINY, TINY_NL, cli, default_emitters, subprocess_env

from nljax.run import throughput

# TINY_NL with the defaults elsewhere (the optimizer, the MLP width, 4 memory heads)
NL = [*TINY_NL, "model.dim=16", "model.depth=1", "model.nl_lm.memory_heads=4", "train.batch_size=4", "train.seq_len=16"]


def test_a_pattern_alone_fires_just_its_levels():
    """The loop's timing of one pattern (`only`): its levels every step, the others never, from
    any step after 0 (where every level fires)."""
    from nljax.bench import only

    for active in ((True, False, False), (True, True, False), (True, True, True), (False, True, False)):
        c = only(active, 5, 9)
        pulses = []
        for _ in range(9):
            pulses.append(c.pulse.active)
            c = c.advance()
        assert pulses == [active] * 9, (active, pulses)


def test_a_lighter_pattern_timed_as_the_worst_is_said_to_be_noise():
    """The note under a timing (a run's table, the bench's report): only where every level's
    pattern was timed and another timed slower."""
    note = throughput.noisy_worst("L0", ["L0", "L0+1+2"], 3, "throughput.reps")
    assert note == ("note: L0 timed slower than L0+1+2, where all levels fire: it does less work, so the timing "
                    "is noisy here (a loaded or shared machine; throughput.reps raises the rounds)")
    assert throughput.noisy_worst("L0+1+2", ["L0", "L0+1+2"], 3, "x") is None  # the expected worst
    assert throughput.noisy_worst("L0", ["L0", "L0+1"], 3, "x") is None  # every level's pattern not timed
    assert throughput.noisy_worst("L0", {"L0": {}, "L0+1": {}}, 2, "x").startswith("note: L0 timed slower than L0+1,")


def test_bench_json_fields_are_sane(tmp_path):
    """Two emulated devices, a tiny nl_lm with a memory layer, two patterns, 2 timed rounds,
    then 2 profiled steps of the slower pattern. The streaming evaluation asked for does not fit
    the held-out text (as at titans_demo's batch 128): the bench, which evaluates nothing, runs."""
    out, trace = tmp_path / "bench.json", tmp_path / "trace"
    # the memory's 4 chunks unrolled: no loop in the step, so XLA's FLOP count is exact and shown
    p = cli("nljax.bench", "--cpu-devices", "2", "--steps", "2", "--warmup", "1", "--out", str(out),
            "--profile", "2", "--profile-dir", str(trace), *NL, "model.nl_lm.memory_unroll=4",
            "eval.stream_steps=100000", env=default_emitters(subprocess_env()))
    assert "tokens/s per device" in p.stdout and "device busy" in p.stdout and not list(tmp_path.glob("runs"))
    r = json.loads(out.read_text())
    # each phase said as it starts, on stderr (a compile took minutes in silence, found by a newcomer)
    said = [line.removeprefix("nljax.bench: ").split(" (")[0].split(" in ")[0] for line in p.stderr.splitlines()
            if line.startswith("nljax.bench: ")]
    assert said == ["building the run", "initializing the parameters and the optimizer state ...",
                    "building pattern L0", "compiled pattern L0", "building pattern L0+1",
                    "compiled pattern L0+1", "timing 1 warm-up and 2 timed rounds of 2 patterns ...",
                    "timing 16 steps of each pattern through the training loop ...",
                    f"profiling 2 steps of pattern {r['worst_pattern']} ..."], p.stderr
    assert r["devices"] == 2 and r["unit"] == "tokens" and r["units_per_device_step"] == 2 * 16
    # the table's unit columns as the run's throughput table names them (images were "ima")
    from nljax.bench import format_report

    assert "tok/s/dev" in p.stdout and " img/s/dev" in format_report({**r, "unit": "images"})
    # a "-" in the XLA column is said once, under the table, with why (a step with a scan: XLA's
    # cost analysis counts a loop's body once); here every step is counted: no such line
    assert all(row["xla_flops_missing"] is None for row in r["per_pattern"].values()) and "MFU '-'" not in p.stdout
    looped = {k: {**v, "xla_flops_per_unit": None, "mfu": None, "xla_flops_missing": throughput.LOOP}
              for k, v in r["per_pattern"].items()}
    notes = [line for line in format_report({**r, "per_pattern": looped}).splitlines() if "MFU '-'" in line]
    assert notes == [f"XLA FLOP, MFU '-': {throughput.LOOP}; MFU(an.) is from the analytic count"], notes
    assert set(r["per_pattern"]) == {"L0", "L0+1"}
    # level 0 alone timed as the slowest: said to be the machine's noise, as a training run says it
    said = [line for line in format_report({**r, "worst_pattern": "L0"}).splitlines() if "timed slower" in line]
    assert said == [throughput.noisy_worst("L0", ["L0", "L0+1"], 2, "--steps")] and "--steps raises" in said[0]
    assert "timed slower" not in format_report({**r, "worst_pattern": "L0+1"})
    # what `auto` resolved to on this CPU, recorded and said
    assert r["config"]["forms"] == {"attention": "blocked", "memory_impl": "scan", "embed_grad": "scatter",
                                    "loss_chunk": 0}
    assert "computed by: attention blocked, memory_impl scan, embed_grad scatter, loss_chunk 0" in p.stdout
    # each pattern also as training runs it: 16 steps through the loop (not dispatched ahead on a CPU)
    assert r["loop"] == 16 and r["dispatch_ahead"] is False
    loop_line = next(line for line in p.stdout.splitlines() if line.startswith("through the training loop"))
    assert loop_line.startswith("through the training loop (16 steps of each pattern, dispatched ahead: no): L0 ")
    assert r["units_per_s_per_device_in_loop_mean"] * r["loop_step_ms_mean"] / 1e3 == pytest.approx(2 * 16)
    assert r["mfu_analytic_in_loop_mean"] == pytest.approx(
        r["flops"]["total_per_unit"] * r["units_per_s_per_device_in_loop_mean"] / r["peak_flops_per_device"])
    for p in r["per_pattern"].values():
        assert p["loop_step_ms"] > 0 and p["units_per_s_per_device_in_loop"] * p["loop_step_ms"] / 1e3 == pytest.approx(32)
        assert p["compile_s"] > 0 and p["step_time"]["samples"] == 2
        assert 0 < p["step_time"]["min_ms"] <= p["step_time"]["median_ms"] <= p["step_time"]["max_ms"]
        assert p["units_per_s_per_device"] > 0 and p["xla_flops_per_unit"] > 0
        assert 0 < p["mfu"] < 1 and 0 < p["mfu_analytic"] < 1
    fl = r["flops"]
    assert fl["params"] > fl["matmul_params"] > 0 and fl["inner_memory_per_token"] > 0
    assert fl["total_per_unit"] == fl["outer_per_token"] + fl["attention_per_token"] + fl["inner_memory_per_token"]
    assert r["units_per_s_per_device_mean"] > 0 and r["units_per_s_per_device_worst"] > 0
    assert r["units_per_s_per_device_worst"] <= r["units_per_s_per_device_mean"] * (1 + 1e-9)
    assert r["peak_flops_per_device"] > 1e8 and "measured" in r["peak_source"]
    assert "shared by 2 emulated devices" in r["peak_source"]  # each device's share of the host's peak
    assert r["memory"]["peak_bytes"] > 0 and math.isfinite(r["memory"]["peak_bytes"])
    assert r["environment"]["jax"] and r["environment"]["device_kind"]
    chosen = [k for k in os.environ if k in ("LD_PRELOAD", "GLIBC_TUNABLES") or k.startswith("MALLOC_")]
    if platform.libc_ver()[0] == "glibc" and not chosen:  # the command set the allocator (nljax/measure/hostmem.py)
        assert r["environment"]["malloc"]["nljax"].startswith("retain"), r["environment"]["malloc"]
    prof = r["profile"]
    assert prof["pattern"] == r["worst_pattern"] and prof["devices"] == 2 and prof["steps"] == 2
    assert prof["module"] == "jit_train_step"  # the train step's ops, found by its module's name
    assert prof["ops"] > 10 and 0 < prof["busy_s"] and 0 < prof["busy_fraction"] <= 1.05
    assert prof["by_category_s"]["matmul"] > 0 and prof["top"][0]["s"] >= prof["top"][-1]["s"] > 0
    assert prof["timed_step_s"] * 1e3 == pytest.approx(r["per_pattern"][r["worst_pattern"]]["step_time"]["median_ms"])
    scopes = prof["by_scope_s"]  # where in the model, from the compiled program's op_name metadata
    assert {"forward mem", "backward mem", "forward attn", "step"} <= set(scopes), scopes
    assert scopes["backward mem"] > 0
    assert list(trace.rglob("perfetto_trace.json.gz"))  # kept for TensorBoard or Perfetto
    hlo = (trace / "program.hlo.txt").read_text()  # and the profiled program beside it
    assert hlo.startswith("HloModule jit_train_step") and "op_name=" in hlo
    # benchmarks/gpu_summary.py reads it (a CPU bench under the nl_350m row's name: the form)
    (tmp_path / "bench_nl_350m.json").write_text(out.read_text())
    row = next(r for r in gpu_summary().lines(tmp_path) if "nl_350m" in r)
    assert row.startswith(("MET", "MISS")) and "% analytic, " in row and "% XLA count" in row and "device busy" in row


def gpu_summary():
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_summary
    finally:
        sys.path.pop(0)
    return gpu_summary


@pytest.mark.slow
def test_gpu_suite_and_ab(tmp_path):
    """benchmarks/gpu_suite.sh parses and refuses an unknown part; benchmarks/ab.py's JSON is
    sane and its summary reads it (a CPU run of a tiny model under the GPU row's name: the form,
    not the figures)."""
    import subprocess
    import sys

    from helpers import ROOT

    suite = ROOT / "benchmarks" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(suite)]).returncode == 0
    p = subprocess.run(["bash", str(suite), str(tmp_path / "out"), "nope"], cwd=ROOT, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert p.returncode == 2 and "unknown part 'nope'" in p.stdout
    variants = [" ".join(NL), " ".join([*NL, "model.remat=none"])]
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), "--cpu-devices", "1", "--rounds", "1",
                        "--warmup", "0", "--profile", "1",
                        *variants, "--out", str(tmp_path / "ab_titans_remat.json")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ab = json.loads((tmp_path / "ab_titans_remat.json").read_text())["rows"]
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "residuals.py"), *NL], capture_output=True, text=True)
    assert p.returncode == 0 and "residuals" in p.stdout and " GiB in " in p.stdout, p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "residuals.py"), "--config",
                        "meanflow_digits"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "residuals.py: error: model.name=dit is not a language model (this script feeds it tokens)"]
    assert [r["ratio"] for r in ab][0] == 1.0 and all(r["median_ms"] > 0 and r["ops_per_step"] > 10 for r in ab)
    # --loop: rounds of steps through the training loop, with and without dispatching ahead; the
    # profile finds the steps the loop marks itself
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), "--cpu-devices", "1", "--rounds", "1",
                        "--warmup", "0", "--loop", "3", "--profile", "2", " ".join([*NL, "train.dispatch_ahead=true"]),
                        " ".join([*NL, "train.dispatch_ahead=false"]), "--out", str(tmp_path / "loop.json")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "rounds of 3 steps in the training loop" in p.stdout, p.stderr
    looped = json.loads((tmp_path / "loop.json").read_text())
    assert looped["loop"] == 3 and [r["variant"].endswith("dispatch_ahead=false") for r in looped["rows"]] == [False, True]
    assert all(r["median_ms"] > 0 for r in looped["rows"])
    # each step marked: waited for, both steps' windows hold their ops; dispatched ahead a
    # window ends at the next dispatch, and a loaded CPU may start a step's ops only after that
    assert looped["rows"][1]["idle"]["steps"] == 2 and looped["rows"][0]["idle"]["steps"] in (1, 2)
    assert looped["rows"][1]["executable"] == f"shared with {' '.join([*NL, 'train.dispatch_ahead=true'])}"
    rows = gpu_summary().lines(tmp_path)
    assert any(r.startswith("n/a") and "DiT-B/4" in r for r in rows)
    assert any(r.startswith("info  titans_demo") and "model.remat=none" in r and "kernels/step" in r for r in rows)
    # each row says what auto took (the inner loop's form: the scan on a CPU, the parallel form on a GPU)
    assert all(r["forms"]["memory_impl"] == "scan" for r in ab)
    assert all(r.endswith("memory_impl scan, embed_grad scatter, loss_chunk 0") for r in rows if "model.remat=none" in r), rows


def test_bench_keeps_the_persistent_compile_cache_off_while_it_runs(tmp_path, capsys):
    """The bench measures compilation (docs/guides/benchmarking-and-profiling.md): with JAX's
    persistent cache on in the process (JAX_COMPILATION_CACHE_DIR, or a training run's
    run.compile_cache before it in a notebook) it wrote its steps there, and the next bench loaded
    them and said "compiled pattern L0 in 0.6 s" (3.5 s compiled). The cache is on again after."""
    import jax

    from nljax import bench
    from nljax.runtime import compile_cache

    cache = tmp_path / "cache"
    before = jax.config.jax_compilation_cache_dir
    compile_cache.enable(str(cache))  # as a run earlier in this process (conftest: every program cached)
    try:
        assert bench.main([*TINY, "cms.periods=[1]", "--steps", "1", "--warmup", "0", "--loop", "0"]) == 0
        assert "compiled pattern L0" in capsys.readouterr().err
        assert not list(cache.glob("*train_step*")), sorted(p.name for p in cache.iterdir())
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7))  # the cache is used again after the bench
        assert list(cache.iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_bench_synthetic_images_need_the_images_task():
    p = cli("nljax.bench", "--synthetic", "8x8x1", *NL, check=False)
    assert p.returncode == 2 and p.stderr.strip() == \
        "nljax.bench: error: --synthetic is for the images task (model.name=dit); this config's model is nl_lm"


@pytest.mark.parametrize("shape", ["-1x32x3", "0x32x3", "32x32x0"])
def test_bench_synthetic_sizes_must_be_positive(shape):
    """-1 was numpy's traceback (exit 1), 0 a message about a temporary .npz."""
    from nljax import bench
    from nljax.config import ConfigError, load

    cfg = load(None, ["model.name=dit", "cms.periods=[1]"])
    with pytest.raises(ConfigError) as e:
        bench.synthetic_images(cfg, shape, "/nonexistent")  # refused before anything is written
    assert str(e.value) == f"--synthetic wants HxWxC of sizes >= 1, e.g. 32x32x3, got '{shape}'"



@pytest.mark.parametrize("out,line", [
    ("notes.md", "--out notes.md: the result is JSON, give a file name ending in .json"),
    ("notes.md/b.json", "--out notes.md/b.json: {dir}/notes.md is a file, not a directory"),
    # mkdir's traceback ("File exists") once the whole benchmark had run
    ("gone/b.json", "--out gone/b.json: {dir}/gone is a symbolic link to {dir}/nowhere, which does not exist"),
])
def test_bench_out_is_checked_before_anything_runs(tmp_path, out, line):
    """A bad --out is refused at once: never written over another kind of file, never found out
    after the whole benchmark has run."""
    (tmp_path / "notes.md").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    p = cli("nljax.bench", "--out", out, *NL, check=False, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == f"nljax.bench: error: {line.format(dir=tmp_path)}", p.stderr
    assert (tmp_path / "notes.md").read_text() == "mine"


@pytest.mark.parametrize("flags,line", [(["--steps", "0"], "--steps must be >= 1, got 0"),
                                        (["--loop", "-1"], "--loop must be >= 0, got -1")])
def test_a_count_below_its_bound_names_its_flag(flags, line):
    """One flag given wrong is named alone: the line named four flags and four values."""
    p = cli("nljax.bench", *flags, *NL, check=False)
    assert p.returncode == 2 and p.stderr.strip() == f"nljax.bench: error: {line}", p.stderr


def test_bench_out_never_replaces_a_file_it_did_not_write(tmp_path):
    """`--out` over an existing JSON file that is not an earlier benchmark result (a tokenizer.json,
    an export's config.json) is refused at once: it was silently replaced by the result. An earlier
    result, or an empty file, is replaced as before."""
    from nljax.bench import RESULT_KEYS
    from nljax.runtime.resultfile import check

    theirs = tmp_path / "tokenizer.json"
    theirs.write_text('{"model": {"type": "BPE"}}')
    p = cli("nljax.bench", "--out", "tokenizer.json", *NL, check=False, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        "nljax.bench: error: --out tokenizer.json holds a file that is not an nljax.bench result: give a new "
        "file name, or move it"), p.stderr
    assert theirs.read_text() == '{"model": {"type": "BPE"}}'
    earlier, empty = tmp_path / "b.json", tmp_path / "e.json"
    earlier.write_text(json.dumps({"config": {}, "environment": {}, "per_pattern": [], "command": "python -m nljax.bench"}))
    empty.write_text("")
    for out in (earlier, empty):  # replaced by the new result
        check(out, f"--out {out}", "nljax.bench", RESULT_KEYS)


@pytest.mark.parametrize("where", ["notes.md", "notes.md/trace"])
def test_bench_profile_dir_is_checked_before_anything_runs(tmp_path, where):
    """A --profile-dir that is (or lies under) a file is one line at once: the profiler's
    traceback came only after the whole benchmark had run, and its result was not written."""
    (tmp_path / "notes.md").write_text("mine")
    p = cli("nljax.bench", "--profile", "1", "--profile-dir", where, "--out", "b.json", *NL, check=False, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == \
        f"nljax.bench: error: --profile-dir {where}: {tmp_path}/notes.md is a file, not a directory", p.stderr
    assert (tmp_path / "notes.md").read_text() == "mine"


@pytest.mark.parametrize("given,why", [("notes.md/p", "{dir}/notes.md is a file, not a directory"),
                                       ("gone/p", "{dir}/gone is a symbolic link to {dir}/nowhere, which does not exist")])
def test_a_profile_dir_that_cannot_be_made_is_refused_before_the_timing(tmp_path, given, why):
    """`--profile-dir` under a file or a link to nothing: the trace and the HLO are written after
    the timing, where mkdir's "File exists" came as a traceback."""
    from nljax.bench import check_profile_dir
    from nljax.errors import ConfigError

    (tmp_path / "notes.md").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError) as e:
        check_profile_dir(tmp_path / given)
    assert str(e.value) == f"--profile-dir {tmp_path / given}: {why.format(dir=tmp_path)}"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
@pytest.mark.parametrize("flags,line", [
    (["--out", "/proc/b.json"], "--out /proc/b.json: /proc is not writable"),
    (["--profile", "1", "--profile-dir", "/proc/trace"], "--profile-dir /proc/trace: /proc is not writable"),
])
def test_bench_output_where_no_file_can_be_made_is_refused_at_once(flags, line):
    """A directory os.access calls writable (to root; /proc, /sys, a read-only mount to anyone)
    where no file can be made: the JSON's FileNotFoundError, or the profiler's JaxRuntimeError,
    came as a traceback after the whole benchmark had run."""
    p = cli("nljax.bench", *flags, *NL, check=False)
    assert p.returncode == 2 and p.stderr.strip() == f"nljax.bench: error: {line}", p.stderr


def test_bench_profile_dir_without_profile_is_refused(tmp_path):
    """--profile-dir alone ran the benchmark and kept no trace, in silence (exit 0, the folder
    never made): the trace it keeps is that of --profile N."""
    p = cli("nljax.bench", "--profile-dir", "prof", *NL, check=False, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        "nljax.bench: error: --profile-dir prof keeps the trace of --profile N, which was not given: add "
        "--profile N (the steps to profile, e.g. --profile 2)"), p.stderr
    assert not (tmp_path / "prof").exists()


def _ab(*args, cwd=None):
    import subprocess
    import sys

    from helpers import ROOT

    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), *args], capture_output=True, text=True,
                          cwd=cwd)


def test_ab_checks_every_variant_before_the_first_compiles():
    """Strategies compared on a mesh that one variant's devices do not fit: the second variant's
    mesh was refused only after the first variant's step had compiled (minutes for titans_demo)."""
    p = _ab("--cpu-devices", "4", " ".join([*NL, "sync.strategy=zero1"]),
            " ".join([*NL, "sync.strategy=fsdp", "mesh.inter=3"]))
    assert p.returncode == 2 and "building pattern" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f'ab.py: error: variant "{" ".join([*NL, "sync.strategy=fsdp", "mesh.inter=3"])}": mesh.inter=3 does not '
        "divide the 4 available devices")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_ab_out_is_checked_before_anything_runs(tmp_path):
    """ab.py's --out was written with Path.write_text at the end: a traceback after every variant
    had compiled and run, or another kind of file replaced."""
    p = _ab("--out", "/proc/ab.json", " ".join(NL))
    assert p.returncode == 2 and p.stderr.strip() == "ab.py: error: --out /proc/ab.json: /proc is not writable"
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    p = _ab("--out", "notes.json", " ".join(NL), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        "ab.py: error: --out notes.json holds a file that is not an ab.py result: give a new file name, or move it")
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'


def test_bench_synthetic_with_a_data_set_given_is_refused():
    """--synthetic with images.path= (or images.source=) on the command line: the random images
    replaced the data set named, in silence (a config's own images.path, meanflow_dit_b4's, is
    replaced as before)."""
    p = cli("nljax.bench", "--config", "meanflow_digits", "--synthetic", "8x8x1", "images.source=file",
            "images.path=my_images", check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "nljax.bench: error: --synthetic 8x8x1 benchmarks random images in place of the data set: images.source, "
        "images.path would not be read; give --synthetic or images.source=, not both"), p.stderr


def test_slow_loop_calls_are_said_as_they_end(monkeypatch):
    """`--loop K` runs K steps of each pattern through the training loop, after an untimed call:
    nl_default's five calls of 16 steps on the 2-core CPU passed 40 s after one line (found by a
    newcomer). A call of `slow_s` or more is said as it ends; quick ones are not."""
    from types import SimpleNamespace

    from nljax import bench

    said, calls = [], []
    monkeypatch.setattr(bench, "say", said.append)
    monkeypatch.setattr(bench, "loop_steps", lambda run, state, conductor, k, built: calls.append(k) or state + k)
    run = SimpleNamespace(cache=SimpleNamespace(variant=lambda a, batch: a))
    fns = {(True, False): None, (True, True): None}
    seconds, state = bench.time_loops(run, fns, 0, None, start=1, k=4, slow_s=0.0)
    assert state == 12 and calls == [4, 4, 4] and set(seconds) == set(fns)
    assert [line.split(":")[0] for line in said] == [
        "through the training loop, warm-up", "through the training loop, pattern L0 (1 of 2)",
        "through the training loop, pattern L0+1 (2 of 2)"], said
    assert all(": 4 steps in " in line for line in said), said
    said.clear()
    bench.time_loops(run, fns, 0, None, start=1, k=4)
    assert said == []


def test_slow_rounds_are_said_as_they_end(monkeypatch):
    """A round of a large model's steps on a CPU takes minutes (meanflow_dit_b4: 6.9 s a step at batch
    16 on the 2-core CPU, 16 times that at its batch 256): the seven rounds passed after one line. A round of `slow_s`
    or more is said as it ends; quick ones are not."""
    from nljax import bench

    said = []
    monkeypatch.setattr(bench, "say", said.append)
    step = lambda state, batch: (state + 1, {})  # noqa: E731
    times, state = bench.time_steps({(True,): step}, 0, None, warmup=1, steps=2, slow_s=0.0)
    assert state == 3 and len(times[(True,)]) == 2
    assert [line.split(":")[0] for line in said] == ["warm-up round 1 of 1", "timed round 1 of 2", "timed round 2 of 2"]
    said.clear()
    bench.time_steps({(True,): step}, 0, None, warmup=1, steps=2)
    assert said == []


def test_peak_memory_reads_a_device_of_this_process(monkeypatch):
    """Under `nljax.launch --nproc 2`, process 1 asked the global device 0 (process 0's) for its
    memory statistics and stopped: 'MemoryStats is only supported for addressable PjRt devices'."""
    import jax

    from nljax import bench

    class OtherProcess:  # jax.devices()[0] of process 1
        def memory_stats(self):
            raise RuntimeError("INVALID_ARGUMENT: MemoryStats is only supported for addressable PjRt devices.")

    ours = jax.local_devices()
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [OtherProcess(), *ours])
    assert bench.peak_memory({})["peak_bytes"] is None  # a CPU keeps no high-water mark, nothing compiled
