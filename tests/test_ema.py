"""The parameters' moving average (`optim.ema_decay`): its formula per CMS level, under zero1 and
fsdp against one device, kept through checkpoints (restored onto another strategy), read by
evaluation and by the tools in the trained parameters' place, restarted by checkpoint.init_params,
and its config lines."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, assert_trees_equal, make, saved_run, train

from nljax.checkpoint.initparams import start_from
from nljax.checkpoint.restore import restore, restore_params
from nljax.config import ConfigError, load
from nljax.engine import optim
from nljax.engine.conductor import pulse
from test_strategies import canonical_on_host

DECAY = 0.8
EMA = ["cms.periods=[1,2]", "model.dim=15", f"optim.ema_decay={DECAY}"]


def averages(setup, state):
    """Each level's average from `state`, as the model's pytrees, on the host."""
    _, opt = canonical_on_host(setup, state)
    return optim.average_of(opt)


def test_each_level_averages_over_the_steps():
    """a = p at the start, then per step a <- 0.8 a + 0.2 p: level 1 (period 2), whose parameters
    stand still between its updates (steps 0 and 2), takes its two steps at each update,
    a <- 0.8^2 a + (1 - 0.8^2) p, and is unchanged at the steps it is frozen; evaluation reads
    it (`Run.model_params`), not the trained parameters."""
    setup = make(EMA)
    split = lambda p: setup.engine.levels.split(jax.device_get(p))
    want = list(split(setup.state.params))
    assert_trees_equal(averages(setup, setup.state), tuple(want))
    for s in range(4):
        train(setup, range(s, s + 1))
        now = split(setup.state.params)
        for l, fired in enumerate(pulse(s, (1, 2)).active):
            if fired:
                d = DECAY ** (1, 2)[l]
                want[l] = jax.tree.map(lambda a, p: d * a + (1 - d) * p, want[l], now[l])
        assert_trees_close(averages(setup, setup.state), tuple(want), rtol=1e-6, atol=1e-7)
    read = jax.device_get(setup.run.model_params(setup.state))
    assert_trees_close(read, setup.engine.levels.merge(tuple(want)), rtol=1e-6, atol=1e-7)
    moved = [not np.allclose(a, p) for a, p in zip(jax.tree.leaves(read), jax.tree.leaves(setup.state.params))]
    assert any(moved)  # it is not the trained parameters
    assert make(EMA[:2]).run.model_params(setup.state) is setup.state.params  # off: the trained ones


def test_a_skipped_update_leaves_the_average():
    """A level whose every gradient is skipped (sync.max_grad_norm) keeps its parameters, and
    its average stays where it was (not a step of decay toward them). After a step that moved
    the parameters away from it: at the start the two are equal, and a step of decay would leave
    it there but for rounding."""
    setup = make(EMA)
    train(setup, 1)
    start = averages(setup, setup.state)
    skipping = make([*EMA, "sync.max_grad_norm=1e-9", "train.max_skipped=0"])
    _, state = train(skipping, range(1, 2), state=setup.state)
    assert_trees_equal(averages(skipping, state), start)
    _, state = train(make(EMA), range(1, 2), state=state)  # the same step, not skipped: the average moves
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(averages(setup, state)),
                                                         jax.tree.leaves(start)))


STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-device run: its checkpoint after step 2 (run.dir/checkpoints/2), then steps 2-3."""
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    setup, _ = saved_run(run_dir, EMA, 1, 1, steps=2)
    train(setup, range(2, STEPS))
    return run_dir, setup


# (1, 2) in the slow tier: the suite's time
@pytest.mark.parametrize("strategy,inter,intra", [pytest.param("zero1", 1, 2, marks=pytest.mark.slow), ("zero1", 2, 4),
                                                  pytest.param("fsdp", 1, 2, marks=pytest.mark.slow), ("fsdp", 2, 4)])
def test_sharded_average_matches_one_device(strategy, inter, intra, reference):
    """The average sharded as the optimizer state is, against one device, and what evaluation
    reads in the stored parameters' layout."""
    _, ref = reference
    setup = make([*EMA, f"sync.strategy={strategy}"], inter, intra)
    train(setup, STEPS)
    assert_trees_close(averages(setup, setup.state), averages(ref, ref.state), rtol=1e-4, atol=2e-6)
    read = setup.engine.strategy.gather_params(setup.run.model_params(setup.state))
    assert_trees_close(jax.device_get(read), jax.device_get(ref.run.model_params(ref.state)), rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("strategy", ["replicated", "fsdp"])
def test_the_tools_read_the_average_and_a_resume_keeps_it(strategy, reference):
    """restore_params(average=True) (what nljax.load, evaluate, generate, export and lm_eval
    read) gives the checkpoint's average, here and under another strategy on (2, 4); the trained
    parameters without it; a resume restores the average with the rest and goes on as the
    uninterrupted run."""
    run_dir, ref = reference
    path = run_dir / "checkpoints" / "2"
    mesh = (1, 1) if strategy == "replicated" else (2, 4)
    setup = make([*EMA, f"sync.strategy={strategy}", f"run.dir={run_dir}"], *mesh)
    r = restore(setup.engine, setup.state, path)
    gather = lambda p: jax.device_get(setup.engine.strategy.gather_params(p))
    average = gather(setup.run.model_params(r.state))
    assert_trees_close(gather(restore_params(setup.engine, path, average=True).params), average, rtol=1e-6, atol=1e-7)
    assert_trees_close(gather(restore_params(setup.engine, path).params), gather(r.state.params), rtol=0, atol=0)
    _, state = train(setup, range(2, STEPS), state=r.state)
    assert_trees_close(averages(setup, state), averages(ref, ref.state), rtol=1e-4, atol=2e-6)


def test_a_trained_run_is_used_with_its_average(reference):
    """nljax.load and every tool (`trained.load`) read the average: here on 2 devices."""
    from nljax.run.trained import load

    run_dir, ref = reference
    ref_setup = make(EMA)
    r = restore(ref_setup.engine, ref_setup.state, run_dir / "checkpoints" / "2")
    t = load(run_dir, devices=jax.devices()[:2])
    assert t.step == 2
    assert_trees_close(jax.device_get(t.run.engine.strategy.gather_params(t.params)),
                       jax.device_get(ref_setup.run.model_params(r.state)), rtol=1e-6, atol=1e-7)


def test_init_params_restarts_the_average_from_the_checkpoints_parameters(reference):
    """A fine-tuning run from a checkpoint's parameters (checkpoint.init_params) averages from
    them, not from its own random initial parameters."""
    run_dir, _ = reference
    setup = make([*EMA, "seed=7"])
    started = start_from(setup.engine, setup.state, run_dir / "checkpoints" / "2")
    assert_trees_equal(jax.device_get(setup.run.model_params(started.state)), jax.device_get(started.state.params))


def test_init_params_takes_the_parameters_of_a_checkpoint_with_another_average(reference):
    """The average is optimizer state, which checkpoint.init_params does not read: a run without
    one, or with another decay, starts from the parameters of a checkpoint that held one (they
    were refused as a misfit of optim.ema_decay)."""
    run_dir, _ = reference
    path = run_dir / "checkpoints" / "2"
    want = jax.device_get(restore_params(make(EMA).engine, path).params)
    for opts in (EMA[:2], [*EMA[:2], "optim.ema_decay=0.5"]):
        setup = make([*opts, "seed=7"])
        started = start_from(setup.engine, setup.state, path)
        assert started.step == 2
        assert_trees_equal(jax.device_get(started.state.params), want)


def test_a_checkpoint_with_another_average_does_not_fit(reference):
    """Whether the optimizer state holds an average (and what it means) is the checkpoint's."""
    run_dir, _ = reference
    plain = make(EMA[:2])
    with pytest.raises(ConfigError) as e:
        restore(plain.engine, plain.state, run_dir / "checkpoints" / "2")
    assert str(e.value) == (f"checkpoint {run_dir / 'checkpoints' / '2'} does not fit this run: optim.ema_decay=0.8 "
                            "there, 0.0 here")


@pytest.mark.parametrize("value", ["1", "-0.5"])
def test_ema_decay_range(value):
    with pytest.raises(ConfigError) as e:
        load(None, [f"optim.ema_decay={value}"])
    assert str(e.value) == f"config key 'optim.ema_decay' must be in [0, 1), got {float(value)}"


def test_the_average_is_counted_in_the_memory_budget():
    assert [optim.state_vectors(load(None, o).optim) for o in
            [[], ["optim.ema_decay=0.99"], ["optim.name=sgd", "optim.ema_decay=0.99"]]] == [2, 3, 1]


def test_training_evaluates_the_average(tmp_path):
    """A run's evaluations (during training, in metrics.jsonl, and its final one, in summary.json)
    score the average: as nljax.evaluate scores the checkpoint of that step, and not as the
    trained parameters score."""
    import json

    from helpers import QUICK

    from nljax import config
    from nljax.run.trained import load
    from nljax.run.trainer import train as run_training

    d = tmp_path / "run"
    run_training(config.load(None, [*EMA, *QUICK, "model.name=cms_mlp", "model.depth=1", "train.batch_size=8",
                                    "train.seq_len=8", "train.steps=4", "eval.every=2", "checkpoint.every=2",
                                    "eval.batches=1", "eval.stream_steps=0", f"run.dir={d}", "run.quiet=true"]))
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    during = next(r["eval_loss"] for r in records if r.get("step") == 1 and "eval_loss" in r)  # after 2 steps
    summary = json.loads((d / "summary.json").read_text())
    for step, logged in ((2, during), (4, summary["eval_loss"])):
        t = load(d, checkpoint=step, devices=jax.devices()[:1], evaluates=True)
        assert t.step == step
        np.testing.assert_allclose(logged, t.run.evaluate(t.params, t.step)["eval_loss"], rtol=1e-5)
        raw = restore_params(t.run.engine, t.path).params
        assert abs(t.run.evaluate(raw, t.step)["eval_loss"] - logged) > 1e-4, step


def test_training_samples_the_average(tmp_path, monkeypatch):
    """train.sample_every samples the model evaluation scores, the average: after the last step,
    the parameters nljax.load reads from the final checkpoint (not the trained ones)."""
    from helpers import QUICK

    from nljax import config
    from nljax.run.samples import TrainingSampler
    from nljax.run.trained import load
    from nljax.run.trainer import train as run_training

    sampled = []

    def sample(self, stored_params):
        sampled.append(jax.device_get(self.run.engine.strategy.gather_params(stored_params)))
        return self.settings.prompt, "length"

    monkeypatch.setattr(TrainingSampler, "sample", sample)
    d = tmp_path / "run"
    run_training(config.load(None, [*EMA, *QUICK, "model.name=cms_mlp", "model.depth=1", "train.batch_size=8",
                                    "train.seq_len=8", "train.steps=4", "train.sample_every=2", "eval.every=0",
                                    "eval.batches=1", "eval.stream_steps=0", f"run.dir={d}", "run.quiet=true"]))
    assert len(sampled) == 2
    t = load(d, devices=jax.devices()[:1])
    gather = lambda p: jax.device_get(t.run.engine.strategy.gather_params(p))
    assert_trees_close(sampled[-1], gather(t.params), rtol=1e-6, atol=1e-7)
    raw = gather(restore_params(t.run.engine, t.path).params)
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(sampled[-1]), jax.tree.leaves(raw)))


def test_a_resume_at_its_target_evaluates_the_checkpoints_average(tmp_path, monkeypatch):
    """train.target_eval_loss on resume scores the checkpoint's average, as every evaluation of
    the run does: the report's eval_loss is nljax.evaluate's of that checkpoint, and the harness
    tasks (eval.harness_tasks; here a stand-in for lm-eval that keeps what it scored) score it too."""
    import dataclasses
    import json

    from helpers import QUICK

    from nljax import config
    from nljax.run import harness
    from nljax.run.trained import load
    from nljax.run.trainer import train as run_training

    scored = []

    class Harness:
        def __init__(self, run):
            self.run = run

        def evaluate(self, stored_params):
            scored.append(jax.device_get(self.run.engine.strategy.gather_params(stored_params)))
            return {}

    monkeypatch.setattr(harness, "attach", lambda run: dataclasses.replace(run, harness=Harness(run)))

    d = tmp_path / "run"
    opts = [*EMA, *QUICK, "model.name=cms_mlp", "model.depth=1", "train.batch_size=8", "train.seq_len=8",
            "eval.every=0", "eval.batches=1", "eval.stream_steps=0", f"run.dir={d}", "run.quiet=true"]
    run_training(config.load(None, [*opts, "train.steps=4"]))
    run_training(config.load(None, [*opts, "train.steps=8", "eval.every=4", "checkpoint.resume=latest",
                                    "train.target_eval_loss=1000"]))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped_at_target_eval_loss"] == 1000
    t = load(d, devices=jax.devices()[:1], evaluates=True)
    np.testing.assert_allclose(summary["eval_loss"], t.run.evaluate(t.params, t.step)["eval_loss"], rtol=1e-5)
    raw = restore_params(t.run.engine, t.path).params
    assert abs(t.run.evaluate(raw, t.step)["eval_loss"] - summary["eval_loss"]) > 1e-4
    gather = lambda p: jax.device_get(t.run.engine.strategy.gather_params(p))
    assert_trees_close(scored[-1], gather(t.params), rtol=1e-6, atol=1e-7)
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(scored[-1]), jax.tree.leaves(gather(raw))))


def test_the_start_up_line_says_what_is_evaluated():
    from nljax.run.trainer import startup_report

    for opts, average in ((EMA, True), (EMA[:2], False)):
        setup, lines = make(opts), []
        startup_report(setup, setup.state, lines.append)
        line = next(line for line in lines if line.startswith("optimizer adamw"))
        assert line.endswith("; evaluation and the tools read the moving average (optim.ema_decay=0.8)") == average, line


def test_a_use_of_the_model_budgets_the_optimizer_state_it_reads(monkeypatch):
    """A tool reads the average from the optimizer state: its memory budget counts that state
    (a device that holds the parameters alone, not with it, refuses the load in one line)."""
    from nljax.measure import budget
    from nljax.run.core import Run

    setup, plain = make(EMA), make(EMA[:2])
    terms = budget.engine_terms(setup.cfg, setup.engine)
    assert terms["optimizer state"] > 0
    monkeypatch.setattr(budget, "available_bytes", lambda *a: sum(budget.in_use(terms).values()) + 1)
    with pytest.raises(ConfigError, match="the trained model does not fit this device"):
        Run.create(setup.cfg, jax.devices()[:1], trains=False)
    Run.create(plain.cfg, jax.devices()[:1], trains=False)  # without the average it fits
    Run.create(setup.cfg, jax.devices()[:1], trains=False, average=False)  # and params=trained reads none


@pytest.mark.slow  # ~10 s each (two compilations of every step variant on 8 devices): as above
@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_the_average_moves_no_byte(strategy):
    """The average is updated on each device's own part of a level, where its optimizer state
    is: every step variant's collectives (from the compiled HLO) are the same with it as without,
    so a frozen level still moves zero bytes."""
    from nljax.measure.comm import comm_per_step

    def collectives(opts):
        setup = make([*opts, f"sync.strategy={strategy}"], 2, 4)
        r = comm_per_step(setup.cache, setup.state, setup.batch(0))
        return [[(c["op"], c["axes"], c["wire_bytes"]) for c in v["collectives"]] for v in r["variants"]]

    plain = collectives(EMA[:2])
    assert all(plain) and collectives(EMA) == plain


@pytest.mark.slow  # ~17 s on 2 cores: the README's suite kept under 15 minutes (.ci/run runs the slow tier)
def test_under_tensor_parallelism_the_average_matches_one_device():
    """zero1 over (1, 2) with the model split over 2 devices (mesh.model): each device's average
    covers its shard of the parameters, as its optimizer state does; the average as the model's
    pytree equals the one-device run's."""
    from test_tp import SGD, TP

    opts = [*TP, *SGD, "sync.strategy=zero1", f"optim.ema_decay={DECAY}"]
    one, many = make(opts), make(opts, 1, 2, 2)
    train(one, 3)
    train(many, 3)
    read = lambda s: jax.device_get(s.engine.strategy.gather_params(s.run.model_params(s.state)))
    assert_trees_close(read(many), read(one), rtol=1e-4, atol=1e-6)
    c1, cn = (s.engine.strategy.export_state(s.state) for s in (one, many))
    assert_trees_close(jax.device_get(optim.average_of(cn.opt_state)), jax.device_get(optim.average_of(c1.opt_state)),
                       rtol=1e-4, atol=1e-6)


def test_params_trained_reads_the_optimizers_own_parameters(reference, monkeypatch):
    """`params=trained` (nljax.load, and every tool through `trained.load`) reads the parameters
    the optimizer holds, bit for bit, not their average, and its memory budget leaves out the
    optimizer state the average is read from; the default and `params=average` read the
    average; each says which in the tool's line."""
    from nljax.measure import budget
    from nljax.run.trained import load

    run_dir, _ = reference
    path = run_dir / "checkpoints" / "2"
    setup = make(EMA)
    trained = jax.device_get(restore(setup.engine, setup.state, path).state.params)
    t = load(run_dir, devices=jax.devices()[:1], params="trained")
    assert not t.average and "params=trained" in t.which
    assert_trees_equal(jax.device_get(t.params), trained)
    for params in ("", "average"):
        t = load(run_dir, devices=jax.devices()[:1], params=params)
        assert t.average and "moving average (optim.ema_decay=0.8)" in t.which
        assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(t.params)),
                                                             jax.tree.leaves(trained)))
    terms = budget.engine_terms(t.cfg, t.run.engine)
    monkeypatch.setattr(budget, "available_bytes", lambda *a: sum(budget.in_use(terms).values()) + 1)
    assert not load(run_dir, devices=jax.devices()[:1], params="trained").average  # fits
    with pytest.raises(ConfigError, match="the trained model does not fit this device"):
        load(run_dir, devices=jax.devices()[:1])


def test_params_values_are_checked():
    from nljax.run.trained import reads_average

    with pytest.raises(ConfigError, match=r"^params=best: give average \(the parameters' moving average"):
        reads_average("best", None)
    with pytest.raises(ConfigError) as e:
        reads_average("average", load(None, []), "runs/x/config.yaml")
    assert str(e.value) == ("params=average: the run keeps no moving average of its parameters (optim.ema_decay=0 "
                            "in runs/x/config.yaml): leave params= out, or give params=trained")
    assert not reads_average("", load(None, [])) and not reads_average("trained", load(None, []))
    assert reads_average("", load(None, ["optim.ema_decay=0.9"]))


def test_the_commands_take_params(reference, tmp_path, capsys):
    """nljax.evaluate and nljax.export read what params= says and record it (the result file, the
    export's config.json); an export holds one set of parameters: params= is refused there, by
    nljax.load and nljax.generate alike; a value params= does not take is one line before
    anything is read."""
    import json

    import nljax
    from nljax import evaluate, export, generate

    run_dir, _ = reference
    out = tmp_path / "r.json"
    assert evaluate.main([f"run.dir={run_dir}", "params=trained", f"out={out}"]) == 0
    assert json.loads(out.read_text())["params"] == "trained"
    assert "(step 2, the trained parameters (params=trained" in capsys.readouterr().err
    assert export.main([f"run.dir={run_dir}", f"out={tmp_path / 'e'}"]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["params"] == "average"
    assert export.main([f"run.dir={run_dir}", f"out={tmp_path / 't'}", "params=trained"]) == 0
    assert json.loads((tmp_path / "t" / "config.json").read_text())["params"] == "trained"
    _, exported = nljax.load_model(tmp_path / "t")
    setup = make(EMA)
    trained = restore(setup.engine, setup.state, run_dir / "checkpoints" / "2").state.params
    assert_trees_equal(jax.device_get(exported), jax.device_get(trained))
    with pytest.raises(ConfigError, match="checkpoint=, params= and overrides are for a run directory"):
        nljax.load(tmp_path / "t", params="trained")
    capsys.readouterr()
    assert generate.main([f"run.dir={tmp_path / 't'}", "params=average"]) == 2
    assert "checkpoint=, params= and overrides are for a run directory" in capsys.readouterr().err
    for command in (generate.main, export.main):
        assert command([f"run.dir={run_dir}", "params=ema"]) == 2
        assert "params=ema: give average" in capsys.readouterr().err
