"""The training loop: tail flush of an accumulation, batch-scaled learning rate, per-device
keys, the throughput table, run-directory hygiene."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_close, leaf_pairs, make, train

from nljax import config
from nljax.config import ConfigError
from nljax.engine import optim
from nljax.engine.conductor import Conductor, pulse
from nljax.engine.core import Engine
from nljax.engine.step import StepCache, device_key
from nljax.parallel.hostdev import put_batch
from nljax.parallel.mesh import DATA_AXES, ROWS, make_mesh
from nljax.run import throughput

TAIL = ["optim.name=sgd", "optim.lr=0.1", "cms.periods=[1,2]"]


@functools.lru_cache(maxsize=None)
def host_batch(step):
    """Step `step`'s 8-row global batch on the host (the same ContextStream whatever the setup)."""
    return jax.device_get(make(TAIL, 1, 1).batch(step))


def rows_of(setup, step, rows):
    """The first `rows` rows of step `step`'s 8-row global batch, on `setup`'s mesh."""
    return put_batch({k: v[:rows] for k, v in host_batch(step).items()}, setup.mesh)


@functools.lru_cache(maxsize=None)
def tail_run(inter, intra, accum):
    """Steps 0 and 2 on full 8-row batches, step 1 on a 4-row tail (2 micro-batches of 2 rows)."""
    setup = make([*TAIL, f"train.accum_steps={accum}"], inter, intra)
    metrics = []
    _, state = train(setup, 3, batch=lambda s: rows_of(setup, s, 4 if s == 1 else 8), metrics=metrics)
    return setup, jax.device_get(state.params), float(np.sum(metrics[-1]["loss_sum"]))


def test_tail_flush_equals_one_step_on_the_concatenated_rows():
    """accum_steps=4 on 2 devices: the tail batch's 2 micro-batches are averaged (not dropped,
    not divided by 4), and the frozen level's error buffer takes them as one step."""
    ref_full = make(TAIL, 1, 1)  # batch 8, accumulation off
    ref_tail = make([*TAIL, "train.batch_size=4"], 1, 1)  # the tail's 4 rows as one batch
    state = ref_full.state
    for s in range(3):
        setup = ref_tail if s == 1 else ref_full
        state, m, _ = setup.cache.train(pulse(s, (1, 2)).active, state, rows_of(setup, s, 4 if s == 1 else 8))
    setup, params, last_loss = tail_run(1, 2, 4)
    assert_trees_close(params, jax.device_get(state.params), rtol=1e-5, atol=1e-6)
    assert last_loss == pytest.approx(float(np.sum(m["loss_sum"])), rel=1e-5)
    # full batches keep their variant key; the tail is its own variant (2 micro-batches)
    assert setup.cache.traces == {(True, True): 1, ((True, False), 2): 1}


def test_tail_is_not_dropped():
    """Guards the test above: training on the tail changes the parameters."""
    setup, params, _ = tail_run(1, 2, 4)
    dropped = make([*TAIL, "train.accum_steps=4"], 1, 2).state  # the same run with the tail dropped
    _, st = train(setup, (0, 2), state=dropped, batch=lambda s: rows_of(setup, s, 8))
    assert max(float(np.abs(a - b).max()) for a, b in leaf_pairs(params, jax.device_get(st.params))) > 1e-4


def test_bad_tail_batches_are_refused():
    setup, _, _ = tail_run(1, 2, 4)
    active = (True, True)
    for rows in (3, 12):  # not a multiple of the 2-row micro-batch; more than a batch
        with pytest.raises(ConfigError, match=f"a batch of {rows} rows"):
            setup.cache.variant(active, {"tokens": np.zeros((rows, 9), np.int32)})
    nl = make([*TINY_NL, "model.nl_lm.memory_chunk=8", "train.accum_steps=2", "cms.periods=[1]"], 1, 2)
    with pytest.raises(ConfigError, match="inner-loop memory"):
        nl.cache.variant((True,), {"tokens": np.zeros((4, 9), np.int32)})


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling(scaling, factor):
    cfg = config.load(None, [f"optim.lr_scaling={scaling}", "optim.base_batch_size=16", "train.batch_size=64",
                             "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=0.01"])
    assert optim.peak_lr(cfg.optim, 64) == pytest.approx(0.01 * factor)
    lr = optim.schedule(cfg.optim, cfg.train.steps, cfg.train.batch_size)
    assert float(lr(5)) == pytest.approx(0.01 * factor)
    with pytest.raises(ConfigError, match="optim.base_batch_size"):
        config.load(None, ["optim.base_batch_size=0"])


def test_device_keys_differ_and_reproduce():
    """fold_in(seed, step, global device index) under shard_map on a 2 x 4 mesh."""
    mesh = make_mesh(2, 4, jax.devices())

    def keys(seed, step):
        fn = jax.shard_map(lambda s: jax.random.key_data(device_key(seed, s[0]))[None], mesh=mesh,
                           in_specs=jax.sharding.PartitionSpec(), out_specs=ROWS, check_vma=False)
        return np.asarray(jax.jit(fn)(jnp.array([step], jnp.int32)))  # [8, key words]

    a = keys(0, 3)
    assert len({tuple(k) for k in a}) == 8, "every device has its own key"
    np.testing.assert_array_equal(a, keys(0, 3))  # same seed, step and mesh: same keys
    assert not np.array_equal(a, keys(0, 4)) and not np.array_equal(a, keys(1, 3))
    expected = [jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 3), i)) for i in range(8)]
    np.testing.assert_array_equal(a, np.stack(expected))  # device i = i-th in inter-major order
    assert DATA_AXES == ("inter", "intra")


class KeyProbe:
    """A test-only model whose memory rows record the key `Model.apply` received."""

    task = "text"

    def init(self, key):
        return {"w": jnp.ones((2,))}

    def level_of(self, path):
        return 0

    def init_memory(self, rows):
        return {"key": jnp.zeros((rows, 2), jnp.uint32)}

    def apply(self, params, memory, batch, key):
        rows = batch["tokens"].shape[0]
        data = jnp.broadcast_to(jax.random.key_data(key), (rows, 2))
        return jnp.sum(params["w"] ** 2) * rows, jnp.float32(rows), {"key": data}


def test_model_receives_per_device_per_micro_batch_keys():
    cfg = config.load(None, ["train.batch_size=8", "train.accum_steps=2", "cms.periods=[1]", "seed=7"])
    mesh = make_mesh(2, 2, jax.devices()[:4])
    eng = Engine.create(cfg, KeyProbe(), mesh)
    cache = StepCache(eng)
    batch = put_batch({"tokens": np.zeros((8, 3), np.int32)}, mesh)

    def run():
        state = eng.init_state(jax.random.key(0), 8)
        state, _, _ = cache.train((True,), state, batch)
        state, _, _ = cache.train((True,), state, batch)  # step 1
        return np.asarray(state.memory["key"])  # [8 rows, 2]: device d holds rows 2d, 2d+1

    got = run()
    base = jax.random.fold_in(jax.random.key(7), 1)
    fold = jax.random.fold_in
    expected = [jax.random.key_data(fold(fold(base, row // 2), row % 2)) for row in range(8)]
    np.testing.assert_array_equal(got, np.stack(expected))
    np.testing.assert_array_equal(got, run())


def test_patterns_in_run_match_walking_the_steps():
    periods = (1, 3, 4)
    for start, steps in [(0, 0), (0, 5), (0, 12), (2, 31), (0, 100)]:
        walked = {}
        for s in range(start, steps):
            a = pulse(s, periods).active
            walked[a] = walked.get(a, 0) + 1
        assert throughput.patterns_in_run(periods, start, steps) == walked
    assert len(Conductor(periods).patterns()) == 4


def test_throughput_table():
    all3, l0, l01 = (True, True, True), (True, False, False), (True, True, False)
    m = throughput.Measured(step_s={l0: 0.010, l01: 0.012, all3: 0.020},
                            compute_s={l0: 0.008, l01: 0.009, all3: 0.011},
                            flops={l0: 1e9, l01: 1.2e9, all3: 1.5e9})
    wire = {"L0": 100, "L0+1": 150, "L0+1+2": 300}
    t = throughput.report(m, {l0: 6, l01: 3, all3: 1}, {l0: 2, l01: 1, all3: 1}, wire,
                          units_per_device_step=1000, n_devices=4, peak=1e12)
    assert t["worst_pattern"] == "L0+1+2" and t["worst"]["step_time_ms"] == pytest.approx(20)
    r = t["per_pattern"]["L0+1"]
    assert r["comm_ms"] == pytest.approx(3) and r["tokens_per_s_per_device"] == pytest.approx(1000 / 0.012)
    assert r["mfu"] == pytest.approx(1.2e9 / 0.012 / 1e12) and r["steps_per_cycle"] == 1
    mean_step = (6 * 0.010 + 3 * 0.012 + 0.020) / 10
    assert t["mean"]["step_time_ms"] == pytest.approx(mean_step * 1e3)
    assert t["tokens_per_s_per_device_mean"] == pytest.approx(1000 / mean_step)
    assert t["tokens_per_s_aggregate"] == pytest.approx(4 * 1000 / mean_step)
    assert t["mean"]["wire_bytes"] == pytest.approx((600 + 450 + 300) / 10)
    text = throughput.format_table(t)
    assert "worst L0+1+2" in text and "mean (run)" in text and "analytic" not in text
    assert "aggregate over 4 devices 344,828" in text and "note:" not in text
    # emulated CPU devices (the trainer's note): said under the compute/comm split it is about,
    # not in summary.json alone
    t["note"] = "CPU devices share the host's cores: comm_ms measures contention more than communication"
    assert throughput.format_table(t).endswith("\nnote: " + t["note"])
    del t["note"]
    # one device: singular ("over 1 devices" read as a typo in every single-device run's table)
    one = throughput.report(m, {l0: 6, l01: 3, all3: 1}, {l0: 2, l01: 1, all3: 1}, wire,
                            units_per_device_step=1000, n_devices=1, peak=1e12)
    assert one["devices"] == 1 and "aggregate over 1 device 86,207" in throughput.format_table(one)
    assert r["flops_source"] == "xla"
    # a step with a loop has no exact XLA count (None): the analytic count stands in, and says so
    looped = throughput.Measured(m.step_s, m.compute_s, flops={a: None for a in m.step_s})
    t = throughput.report(looped, {l0: 6, l01: 3, all3: 1}, {l0: 2, l01: 1, all3: 1}, wire,
                          units_per_device_step=1000, n_devices=4, peak=1e12, analytic_flops=2e9)
    r = t["per_pattern"]["L0+1"]
    assert r["flops_source"] == "analytic" and r["mfu"] == pytest.approx(2e9 / 0.012 / 1e12)
    assert t["mean"]["mfu"] == pytest.approx(2e9 / (mean_step * 1e12))
    assert "MFU from the analytic FLOP count" in throughput.format_table(t)
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and throughput.peak_flops("cpu") is None
    assert throughput.peak_flops("cpu", 2.0) == 2e12
    assert throughput.peak_flops("NVIDIA H100 NVL") == 835e12 and throughput.peak_flops("NVIDIA GH200 480GB") == 989e12



def test_throughput_table_edges():
    """A compute time over the step's (timing noise) is no negative communication; patterns that
    have no count in the run weigh one each, not zero (with none counted: a division
    by zero); a mean FLOP count only where every pattern has one; no source where no count is known."""
    l0, l01 = (True, False), (True, True)
    m = throughput.Measured(step_s={l0: 0.010, l01: 0.020}, compute_s={l0: 0.012, l01: 0.015},
                            flops={l0: 1e9, l01: None})
    t = throughput.report(m, {}, {l0: 1, l01: 1}, {}, units_per_device_step=100, n_devices=2, peak=1e12)
    assert t["per_pattern"]["L0"]["comm_ms"] == 0.0 and t["per_pattern"]["L0+1"]["comm_ms"] == pytest.approx(5)
    assert t["mean"]["step_time_ms"] == pytest.approx(15) and t["mean"]["steps_in_run"] == 0
    assert t["mean"]["flops_per_device_step"] is None and t["mean"]["mfu"] is None
    r = t["per_pattern"]["L0+1"]
    assert r["flops_per_device_step"] is None and r["flops_source"] is None and r["mfu"] is None
    assert t["per_pattern"]["L0"]["flops_source"] == "xla"
    assert "MFU from the analytic" not in throughput.format_table(t)
    # MFU in percent; a skipped compute/comm split said under the table
    m.split_skipped = "the one-device program does not fit"
    t = throughput.report(m, {}, {l0: 1, l01: 1}, {}, units_per_device_step=100, n_devices=2, peak=1e12)
    lines = throughput.format_table(t).splitlines()
    assert lines[1].startswith("L0 ") and lines[1].endswith(" 10.0%")  # 1e9 FLOPs in 10 ms of 1e12/s
    assert lines[-1] == "compute/comm split skipped: the one-device program does not fit"



def test_throughput_rows_are_in_order_of_the_levels_that_fire():
    all3, l0, l01 = (True, True, True), (True, False, False), (True, True, False)
    m = throughput.Measured(step_s={all3: 0.03, l01: 0.02, l0: 0.01}, compute_s={}, flops={})
    t = throughput.report(m, {}, {}, {}, units_per_device_step=1, n_devices=1, peak=None)
    assert list(t["per_pattern"]) == ["L0", "L0+1", "L0+1+2"]


def test_the_end_of_run_timing_rounds_and_medians():
    """Rounds so short that `min_seconds` would take millions stop at `max_reps`; a budget under one
    round still times one; a median, so that one slow round (a collection, a page fault) does not
    move it."""
    import time

    calls = []
    throughput._time_interleaved({k: (lambda k=k: calls.append(k)) for k in "ab"}, reps=3, max_reps=50)
    assert len(calls) == 2 * (1 + 50)  # the warm-up, then 50 rounds
    calls.clear()
    runs = {k: (lambda k=k: calls.append(k) or time.sleep(0.02)) for k in "ab"}
    throughput._time_interleaved(runs, reps=5, budget_s=0.001)
    assert len(calls) == 2 * (1 + 1)
    n = [0]

    def one_slow():
        n[0] += 1
        time.sleep(0.6 if n[0] == 3 else 0.001)  # call 1 is the warm-up: round 2 is slow

    assert throughput._time_interleaved({"a": one_slow}, reps=3, min_seconds=0)["a"] < 0.15  # a mean would be over 0.2


def test_overwrite_removes_stale_outputs(tmp_path):
    from nljax.run.trackers import TensorBoard
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    (tmp_path / "metrics.jsonl").write_text("old\n")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "loss.png").write_text("")
    (tmp_path / "profile").mkdir()
    for name in ("metrics.jsonl", "summary.json", "loss.png", "profile"):  # an earlier run's, as it records them
        runlog.note_written(tmp_path, name)
    (tmp_path / "checkpoints").mkdir()
    TensorBoard(tmp_path).close()  # the run's TensorBoard file, noted as written by the run
    (tmp_path / "events.out.tfevents.1.mine").write_text("")  # a user's: kept
    (tmp_path / "export").mkdir()  # the earlier run's nljax.export: removed
    (tmp_path / "export" / "model.safetensors").write_text("")
    (tmp_path / "export" / "config.json").write_text('{"config": {}, "step": 1, "dtype": "float32", "checkpoint": "x"}')
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir(str(tmp_path), overwrite=False, write=True)
    assert (tmp_path / "summary.json").exists()
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "events.out.tfevents.1.mine", "metrics.jsonl",
                                                         "nljax_written.txt"]
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (tmp_path / "export").mkdir()  # a user's files under that name: kept
    (tmp_path / "export" / "config.json").write_text("{}")
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert (tmp_path / "export" / "config.json").read_text() == "{}"


def test_loop_trains_a_tail_batch_from_the_task(tmp_path):
    """The trainer asks the task for batches; a task whose data pass ends at step 1 hands it a
    4-row tail, which the loop trains (logged with its micro-batches) with no new compile. The
    history counts the logged records (it holds none of them)."""
    import dataclasses

    from nljax.run.trackers import Trackers
    from nljax.run.trainer import History, Output, train_loop
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    setup, params, last_loss = tail_run(1, 2, 4)  # its variants are compiled already

    class EpochTask:
        unit, units_per_row = "tokens", 8

        def batch(self, step, reset_all=False):
            return rows_of(setup, step, 4 if step == 1 else 8)

    loop_setup = dataclasses.replace(setup.run, cfg=dataclasses.replace(setup.cfg, train=dataclasses.replace(
        setup.cfg.train, steps=3)), task=EpochTask())
    state = setup.engine.init_state(jax.random.key(setup.cfg.seed), 8)
    out = Output(RunDir(str(tmp_path), False, write=True), runlog.Progress(3, 0, 1, quiet=True), Trackers())
    traces = dict(setup.cache.traces)
    state, hist = train_loop(loop_setup, state, Conductor((1, 2)), out)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("micro_batches") for r in records] == [None, 2, None]
    assert records[1]["tokens_per_s_per_device"] * records[1]["step_time_s"] == pytest.approx(2 * 8)
    # per-level gradient norms of the levels that fired, and which of them were skipped
    assert [sorted(k for k in r if k.startswith("grad_norm_l")) for r in records] == [
        ["grad_norm_l0", "grad_norm_l1"], ["grad_norm_l0"], ["grad_norm_l0", "grad_norm_l1"]]
    assert all(r["grad_norm_l0"] > 0 and r["skipped_levels"] == [] for r in records)
    steady = [r for r in records if not r["compiled"]]
    assert isinstance(hist, History) and (hist.steps, hist.final_loss, hist.skipped) == (3, records[-1]["loss"], 0)
    assert hist.steady_steps == len(steady) > 0
    assert hist.steady_units == pytest.approx(sum(r["tokens_per_s_per_device"] * r["step_time_s"] for r in steady))
    assert_trees_close(jax.device_get(state.params), params, rtol=1e-6, atol=1e-7)
    assert setup.cache.traces == traces


def test_log_lines_every_n_steps_and_at_a_resumed_runs_first_step(capsys):
    """Without a terminal, a line every train.log_every steps, at an evaluation and at the last
    step; and at the run's first step, a resumed run's too: it was silent until the next
    multiple of log_every, and its loss was not shown beside the one before the interruption."""
    from nljax.runtime import runlog

    def printed(start, total=25, every=10, evaluated=()):
        progress = runlog.Progress(total, start, every, quiet=False)
        for step in range(start, total):
            rec = {"step": step, "loss": 1.0, "pattern": "L0", "step_time_s": 0.01}
            progress.update(rec, 100.0, step == total - 1, "eval_loss 1.000" if step in evaluated else "")
        return [int(line.split()[1]) for line in capsys.readouterr().out.splitlines()]

    assert printed(0, evaluated=(14,)) == [0, 10, 14, 20, 24]
    # a diverging run's loss as its evaluation's figures are printed (it was 1736104448.0000)
    assert [runlog.loss_text(v) for v in (5.75049, 99999.5, 123456.7, 1736104448.0, float("nan"))] == [
        "5.7505", "99999.5000", "123,457", "1.736e+09", "nan"]
    assert printed(6) == [6, 10, 20, 24]  # resumed at step 6
    assert printed(20) == [20, 24]


def test_hooks_run_in_order_every_n_steps():
    from types import SimpleNamespace

    from nljax.run.loop import Hooks

    calls, hooks = [], Hooks()
    hooks.add(lambda r: calls.append(("every 2", r.step)), every=2)
    hooks.add(lambda r: calls.append(("every step", r.step)))
    hooks.add(lambda r: calls.append(("never", r.step)), every=0)
    for s in range(4):
        hooks.run(SimpleNamespace(step=s))  # a step result: only its step is read
    assert calls == [("every step", 0), ("every 2", 1), ("every step", 1), ("every step", 2), ("every 2", 3),
                     ("every step", 3)]


@pytest.mark.slow  # 6 s: four programs compiled
def test_the_splits_one_device_programs_are_said_as_such():
    """throughput.split compiles each pattern again as a one-device program after the run: said as
    that, numbered on its own. They were said as the run's step variants ("compiled step variant
    2 of 3 (pattern L0)" after the final evaluation), as if the run's were compiled again."""
    from nljax.run.phases import compile_announcer

    setup = make(["cms.periods=[1,2]"], intra=2)
    said = []
    setup.cache.announce = compile_announcer(setup.cfg.cms.periods, said.append)
    active = [(True, False), (True, True)]
    throughput.measure(setup.cache, setup.state, setup.run.batch(0), active, 1, True, setup.run.local,
                       say=said.append)
    built = [line for line in said if line.startswith(("building", "compiled", "loaded"))]
    # without the verb: compiled, or loaded from a compile cache
    what = [line.split(" ", 1)[1].split(" (pattern")[0] for line in built if "one-device" in line]
    assert what == ["one-device step variant 1 of 2"] * 2 + ["one-device step variant 2 of 2"] * 2
    assert len(built) == 8  # the run's own two, said as ever


@pytest.mark.slow
def test_a_sharded_run_that_fits_reports_without_the_split_that_does_not(tmp_path, monkeypatch, capsys):
    """fsdp shards what one device could not hold; the end-of-run compute/comm split builds the
    whole model on one device. Where that does not fit, the split is skipped and said so: the
    run that trained writes its summary (it failed at the end, with "make the model smaller")."""
    from nljax.measure import budget
    from nljax.train import main

    monkeypatch.setattr(budget, "available_bytes", lambda used=None, device=None: 100 * 2**20)  # a GPU's bytes_limit
    run = tmp_path / "run"
    rc = main(["--quiet", "model.name=cms_mlp", "model.dim=512", "model.depth=4", "cms.periods=[1,2]",
               "sync.strategy=fsdp", "train.batch_size=8", "train.seq_len=16", "train.steps=2", "eval.every=0",
               "eval.batches=1", "eval.stream_steps=0", "throughput.reps=1", "throughput.split=true", "run.plots=false",
               "run.trackers=[]", "run.compile_cache=none", f"run.dir={run}"])
    assert rc == 0, capsys.readouterr().err
    table = json.loads((run / "summary.json").read_text())["throughput"]
    assert table["split_skipped"].startswith("the one-device program does not fit (the run needs at least")
    assert all(r["compute_ms"] is None and r["step_time_ms"] > 0 for r in table["per_pattern"].values())
    assert "compute/comm split skipped" in throughput.format_table(table)


@pytest.mark.parametrize("why,settings", [
    ("throughput.reps=0", ["train.steps=2", "eval.every=0", "throughput.reps=0"]),
    # the initial parameters saved, no step run: it said "timing 0 step variants" and "200 rounds
    # of about 0 ms", then printed a table header with no rows
    ("train.steps=0", ["train.steps=0", "throughput.reps=1", "run.plots=false"]),
])
def test_a_quick_run_or_one_of_no_steps_times_nothing(tmp_path, monkeypatch, capsys, why, settings):
    """throughput.reps=0 (a quick run) or train.steps=0: the run ends after the final evaluation
    and checkpoint, nothing timed, one line saying why; the summary has no throughput table (the
    plots are drawn)."""
    from nljax.train import main

    def timed(*a, **k):
        raise AssertionError(f"{why} timed the patterns")

    monkeypatch.setattr(throughput, "measure", timed)
    run = tmp_path / "run"
    rc = main(["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1,2]", "train.batch_size=8",
               "train.seq_len=16", "eval.batches=1", "run.trackers=[]", "run.compile_cache=none", f"run.dir={run}",
               *settings])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.count(f"timing skipped ({why})") == 1 and "step ms" not in out  # no table
    summary = json.loads((run / "summary.json").read_text())
    assert summary["throughput"] == {"skipped": why} and "eval_loss" in summary
    if why == "train.steps=0":
        assert summary["steps"] == 0 and (run / "checkpoints" / "0").is_dir()  # what such a run is for
    else:
        assert (run / "step_time.png").read_bytes().startswith(b"\x89PNG")


def test_plots_are_drawn_after_the_report(tmp_path, monkeypatch, capsys):
    """The plots (matplotlib's import and drawing: ~2 s) are drawn after the report's last line
    and before the closing lines, not in a silence before the throughput table."""
    from nljax.measure import plots
    from nljax.train import main

    real = plots.write
    monkeypatch.setattr(plots, "write", lambda *a, **k: (print("<drawing>"), real(*a, **k))[1])
    rc = main(["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1,2]", "train.batch_size=8",
               "train.seq_len=16", "train.steps=2", "eval.every=0", "eval.batches=1", "throughput.reps=1",
               "run.trackers=[]", "run.compile_cache=none", f"run.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.index("step ms") < out.index("<drawing>") < out.index("run directory:"), out


def test_each_steps_record_has_its_model_flops_per_second_and_mfu(tmp_path, capsys):
    """Every metrics.jsonl row has `tflops_per_s_per_device` (MaxText's per-step TFLOP/s) and,
    with a peak (throughput.peak_tflops), `mfu` (Levanter's): the FLOPs the end-of-run table
    gives the row's pattern over the row's own step time, so the two agree but for the timing.
    Without a peak, on a CPU: no `mfu` (tests/test_trackers.py)."""
    from nljax.train import main

    run = tmp_path / "run"
    rc = main(["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1,2]", "train.batch_size=8",
               "train.seq_len=16", "train.steps=4", "eval.every=0", "eval.batches=1", "throughput.reps=1",
               "throughput.peak_tflops=0.5", "run.plots=false", "run.trackers=[]", "run.compile_cache=none",
               f"run.dir={run}"])
    assert rc == 0, capsys.readouterr().err
    table = json.loads((run / "summary.json").read_text())["throughput"]["per_pattern"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["pattern"] for r in rows} == set(table) == {"L0", "L0+1"}
    for r in rows:
        t = table[r["pattern"]]
        assert r["tflops_per_s_per_device"] * 1e12 * r["step_time_s"] == pytest.approx(t["flops_per_device_step"])
        assert r["mfu"] == pytest.approx(r["tflops_per_s_per_device"] / 0.5)
        assert r["mfu"] * r["step_time_s"] == pytest.approx(t["mfu"] * t["step_time_ms"] / 1e3)  # same FLOPs
    if table["L0"]["flops_source"] == "xla":  # XLA's count: level 1's backward pass only where it fires
        assert table["L0"]["flops_per_device_step"] < table["L0+1"]["flops_per_device_step"]


def loop_run(setup, steps, ahead, hooks=(), keep=None, stop=lambda step: False, seen=None):
    """`train_loop`'s stepping (`training_steps`) of `setup`'s run with train.dispatch_ahead=`ahead`:
    (records, {step: params of the results that kept their state}, the final state). `hooks`:
    (every, reads_state) of hooks that do nothing; `seen(result)`, called on each result as
    train_loop's hooks are."""
    import dataclasses

    from nljax.run.loop import Hooks, training_steps

    cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(setup.cfg.train, steps=steps, dispatch_ahead=ahead))
    run = dataclasses.replace(setup.run, cfg=cfg)
    h = Hooks()
    for every, reads in hooks:
        h.add(lambda r: None, every=every, reads_state=reads)
    records, kept, state = [], {}, setup.engine.init_state(jax.random.key(setup.cfg.seed), cfg.train.batch_size)
    for r in training_steps(run, state, Conductor(cfg.cms.periods), keep=keep or h.keeps, stop=stop):
        records.append(r.record)
        if seen is not None:
            seen(r)
        if r.state is not None:
            kept[r.step] = jax.device_get(r.state.params)
            state = r.state
    return records, kept, state


def test_dispatch_ahead_trains_the_same_and_keeps_the_states_hooks_read():
    """train.dispatch_ahead: the same losses, gradient norms and final parameters as reading each
    step's loss before the next dispatch; a step carries its state exactly where a hook reading
    it fires (here every 3 steps) and at the last step, and that state is the one of the
    synchronous run at that step."""
    setup = make(TINY_NL, 1, 2)
    hooks = [(3, True), (1, False)]  # a checkpoint-like hook every 3 steps; a logging one every step
    sync, sync_kept, _ = loop_run(setup, 7, False, hooks)
    ahead, ahead_kept, state = loop_run(setup, 7, True, hooks)
    assert sorted(sync_kept) == list(range(7))  # without dispatch ahead, every result has its state
    # a step's first call of its variant (each of cms.periods=[1,2]'s two patterns) includes its compilation
    assert [r["compiled"] for r in sync] == [True, True, False, False, False, False, False]
    # 2 and 5: the hook; 6: the last; 0: read before step 1's new variant compiles
    assert sorted(ahead_kept) == [0, 2, 5, 6]
    for a, b in zip(sync, ahead, strict=True):
        assert a["step"] == b["step"] and a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert a["compiled"] == b["compiled"] and b["step_time_s"] > 0
    for s in ahead_kept:
        assert_trees_close(ahead_kept[s], sync_kept[s], rtol=0, atol=0)
    assert_trees_close(jax.device_get(state.params), sync_kept[6], rtol=0, atol=0)


def test_dispatch_ahead_order_of_dispatches_reads_hooks_and_stop_questions(monkeypatch):
    """Ahead, step s + 1 is dispatched before step s is read, except where s keeps its state
    (here 2; and the last step) and before a step whose variant compiles (steps 0 and 1 are the
    first of cms.periods=[1,2]'s two patterns: step 0 is read before step 1 compiles, so a
    compilation is timed with its own step). `stop` is asked once per step, in order: after the
    step's hooks where it kept its state, before the next dispatch where it did not. Without
    dispatch ahead: dispatch, read, hooks, stop, step by step."""
    from nljax.run import loop

    setup = make(TINY_NL, 1, 1)
    events = []
    train_step = setup.run.cache.train
    monkeypatch.setattr(setup.run.cache, "train", lambda *a: events.append("D") or train_step(*a))
    monkeypatch.setattr(loop, "mean_loss", lambda m: events.append("R") or 1.0)
    hook = lambda r: events.append(f"H{r.step}")
    stop = lambda s: events.append(f"S{s}") and False
    loop_run(setup, 5, True, keep=lambda s: s == 2, stop=stop, seen=hook)
    assert events == ["D", "R", "H0", "S0",  # step 0, read before step 1 compiles
                      "D", "S1",  # step 1, dispatched ahead of step 2
                      "D", "R", "H1", "R", "H2", "S2",  # step 2 kept
                      "D", "S3", "D", "R", "H3", "R", "H4", "S4"]  # step 3 ahead of step 4, the last
    events.clear()
    loop_run(setup, 5, False, stop=stop, seen=hook)
    assert events == [e for s in range(5) for e in ("D", "R", f"H{s}", f"S{s}")]


def test_dispatch_ahead_auto_is_off_on_a_cpu_only():
    from nljax.run.loop import dispatches_ahead

    assert [dispatches_ahead("auto", p) for p in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert [dispatches_ahead(v, "cpu") for v in (True, False)] == [True, False]
    assert [dispatches_ahead(v, "gpu") for v in (True, False)] == [True, False]
    for bad in ("fast", 2):  # (YAML reads "on" and "yes" as true)
        with pytest.raises(ConfigError, match=r"train.dispatch_ahead' must be bool or one of \['auto'\], got"):
            config.load(None, [f"train.dispatch_ahead={bad}"])


@pytest.mark.parametrize("ahead", [True, False])
def test_a_stop_ends_the_loop_after_its_step_with_the_state(ahead):
    """`stop(step)` True (a preemption notice): the loop ends after that step, whose result has
    its state (train_loop saves it), whether or not it would have been dispatched ahead."""
    setup = make(TINY_NL, 1, 1)
    records, kept, state = loop_run(setup, 6, ahead, keep=lambda s: False, stop=lambda s: s == 3)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and 3 in kept
    # the state after step 3, not after a step 4 dispatched before the stop was seen
    assert int(jax.device_get(state.step)) == 4


def test_profile_edges_keep_their_state_on_every_process(tmp_path):
    """train.profile_steps: the step before the profile and its last one keep their state (not
    dispatched ahead) on every process, the one that records the trace (process 0: its run
    directory written) and the others alike, which record nothing; a step dispatched ahead on one
    process and not on another would order their collectives (the loss's gather,
    distributed.check_step) differently."""
    import dataclasses

    from nljax.run.trackers import Trackers
    from nljax.run.trainer import Output, loop_hooks
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    setup = make(TINY_NL, 1, 1)
    cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(
        setup.cfg.train, steps=10, profile_start=4, profile_steps=2, sample_every=0))
    run = dataclasses.replace(setup.run, cfg=cfg)
    kept, recording = [], []
    for write in (True, False):
        out = Output(RunDir(str(tmp_path / f"run{write}"), False, write=write), runlog.Progress(10, 0, 1, quiet=True),
                     Trackers())
        _, profiler = loop_hooks(run, out, None)
        kept.append([s for s in range(10) if profiler.keeps(s)])
        recording.append(profiler.here)
    assert kept == [[3, 5], [3, 5]] and recording == [True, False]
    profiler.start(4)  # the process that does not record starts no trace
    assert not profiler.on and not (tmp_path / "runFalse" / "profile").exists()


def test_a_profile_window_past_the_last_step_is_refused_before_anything_is_built(tmp_path):
    """train.profile_steps with train.profile_start at or past train.steps records no step: it
    was a warning among the start-up lines (none under --quiet) and the run ended without a trace.
    Refused in one line from the config alone: run.dir is not made; a window that starts inside
    the run (even one cut by its end) is taken."""
    from nljax.run.trainer import train as train_run

    run_dir = tmp_path / "run"
    cfg = config.load(None, [*TINY_NL, "train.steps=4", "train.profile_steps=2", "run.quiet=true", f"run.dir={run_dir}"])
    with pytest.raises(ConfigError) as e:
        train_run(cfg)
    assert str(e.value) == ("train.profile_start=10 is not before train.steps=4: no step of the train.profile_steps=2 "
                            "window runs; set train.profile_start below 4, or train.profile_steps=0")
    assert not run_dir.exists()
    from nljax.run.trainer import check_profile

    for settings in (["train.profile_start=3"], ["train.profile_steps=0"]):  # steps 3 and 4: step 3 recorded
        check_profile(config.load(None, [*TINY_NL, "train.steps=4", "train.profile_steps=2", *settings]))
    with pytest.raises(ConfigError, match="train.profile_start=4 is not before train.steps=4"):
        check_profile(config.load(None, [*TINY_NL, "train.steps=4", "train.profile_steps=2", "train.profile_start=4"]))


def test_a_resume_past_a_window_it_never_recorded_says_so(tmp_path):
    """A run resumed past its profile window (stopped before it, or the window moved on the
    resume) ended without a trace in silence: one warning line at the resume. A run that recorded
    its window earlier (run.dir/profile) says nothing on its resumes; a window still ahead, none."""
    from nljax.run.loop import Profiler

    said = []
    Profiler(10, 2, tmp_path, say=said.append).start(15)
    assert said == ["warning: train.profile_start=10 is before step 15, where this run resumes: nothing is "
                    "profiled (train.profile_start=15 or later profiles this run)"], said
    said.clear()
    Profiler(10, 2, tmp_path, say=said.append).start(3)  # ahead: recorded when the loop reaches it
    Profiler(10, 0, tmp_path, say=said.append).start(15)  # no window asked for
    Profiler(10, 2, tmp_path, say=said.append, here=False).start(15)  # another process than the one that writes
    (tmp_path / "profile").mkdir()
    Profiler(10, 2, tmp_path, say=said.append).start(15)  # recorded before this resume
    assert said == []


def test_a_window_cut_by_the_runs_end_is_said(tmp_path, monkeypatch):
    """train.steps=3 train.profile_start=2 train.profile_steps=2 records step 2 alone: its summary
    said "profile (1 steps, ...)" with no word of the window cut (found by a bad-input audit)."""
    from types import SimpleNamespace

    from nljax.run import loop

    monkeypatch.setattr(loop.jax.profiler, "start_trace", lambda *a, **k: None)
    monkeypatch.setattr(loop.jax.profiler, "stop_trace", lambda: None)
    monkeypatch.setattr(loop.Profiler, "report", lambda self: None)
    said = []
    for n, last, cut in ((2, True, True), (1, True, False), (2, False, False)):
        p = loop.Profiler(2, n, tmp_path, say=said.append)
        p.start(2)
        p.stop(SimpleNamespace(step=2, last=last, record={"compiled": False, "step_time_s": 0.1}))
        assert said == (["profile: 1 of the train.profile_steps=2 steps from step 2 recorded: the run ends at step 2"]
                        if cut else []), (n, last, said)
        said.clear()


def test_a_window_being_recorded_is_not_said_to_be_skipped(tmp_path, monkeypatch):
    """`start_next` calls `start` after every step: a fresh run with train.profile_start=2
    train.profile_steps=2 said "... where this run resumes: nothing is profiled" at step 3, in the
    middle of its window (the trace's folder appears when it ends), and a run resumed past its
    window said it after every step (found by a newcomer). Said once, where the run starts."""
    from nljax.run import loop

    monkeypatch.setattr(loop.jax.profiler, "start_trace", lambda *a, **k: None)
    said = []
    p = loop.Profiler(2, 2, tmp_path, say=said.append)
    for step in range(4):
        p.start(step)
    assert p.on and said == [], said
    p = loop.Profiler(10, 2, tmp_path / "resumed", say=said.append)
    for step in (15, 16, 17):
        p.start(step)
    assert len(said) == 1 and "where this run resumes" in said[0], said


def test_a_preempted_run_saves_before_it_ends_its_profile(tmp_path, monkeypatch):
    """A notice inside the profile window: the step's checkpoint is saved first, then the trace
    ended and summarised (seconds for a large trace): that work came before the save, inside the
    notice's grace period."""
    from nljax.checkpoint.lifecycle import Checkpoints
    from nljax.run.loop import Profiler
    from nljax.runtime.preemption import Notice
    from nljax.train import main

    order = []
    save_now, end = Checkpoints.save_now, Profiler.end
    monkeypatch.setattr(Notice, "stop_after", lambda self, step: step == 5)
    monkeypatch.setattr(Checkpoints, "save_now", lambda self, *a: order.append("save") or save_now(self, *a))
    monkeypatch.setattr(Profiler, "end", lambda self, step: order.append(f"end {step}") or end(self, step))
    run = tmp_path / "run"
    main(["model.name=cms_mlp", "model.dim=16", "model.depth=1", "cms.periods=[1]", "train.batch_size=8",
          "train.seq_len=16", "train.steps=10", "eval.every=0", "eval.batches=1", "throughput.reps=0",
          "checkpoint.every=100", "train.profile_start=4", "train.profile_steps=4", "run.plots=false",
          "run.trackers=[]", "run.compile_cache=none", f"run.dir={run}"])
    assert order == ["save", "end 5"] and (run / "checkpoints" / "6").is_dir()
    assert (run / "profile" / "summary.json").is_file()


def test_a_profile_window_ends_after_its_last_step(tmp_path, monkeypatch):
    """train.profile_steps=2 from step 2: the trace stops after step 3, two steps recorded, not
    after step 4; their mean step time (the summary's) leaves out the step that compiled."""
    import types

    from nljax.run import loop

    calls = []
    monkeypatch.setattr(loop.jax.profiler, "start_trace", lambda *a, **k: calls.append("start"))
    monkeypatch.setattr(loop.jax.profiler, "stop_trace", lambda: calls.append("stop"))
    monkeypatch.setattr(loop.traces, "summarize", lambda path, steps, step_s: calls.append((steps, step_s)) or {})
    monkeypatch.setattr(loop.traces, "format_summary", lambda s: [])
    (tmp_path / "profile").mkdir()  # where the trace (not written here) and its summary go
    profiler = loop.Profiler(2, 2, tmp_path, say=lambda text: None)
    profiler.start(2)
    for step, compiled, seconds in ((2, True, 5.0), (3, False, 0.25), (4, False, 0.25)):
        profiler.stop(types.SimpleNamespace(step=step, last=False,
                                            record={"compiled": compiled, "step_time_s": seconds}))
        calls.append(step)
    # the steps' mean time leaves out the step that compiled
    assert calls == ["start", 2, "stop", (2, 0.25), 3, 4] and profiler.steps == 2
