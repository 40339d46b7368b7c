"""`checkpoint.init_params`: a new run from a checkpoint's parameters only, at step 0 with a fresh
optimizer state, error buffers and memory (nljax/checkpoint/initparams.py); on another mesh,
strategy, optimizer and CMS periods too; bad inputs in one line; through the command line, and
a `--resume` of such a run continuing its own checkpoints. Also: a new run from another run's
checkpoint (`checkpoint.resume=PATH`) saves its final state to its own checkpoint.dir."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from helpers import QUICK, SMALL, TINY, TINY_NL, assert_trees_equal, cli, make, saved_run, train

from nljax.checkpoint import contents, storage
from nljax.checkpoint.lifecycle import Checkpoints
from nljax.errors import ConfigError

# Attention + neural memory (per-row state) and a level of period 4 (its error buffer in use)
NL = [*TINY_NL, "cms.periods=[1,4]", "eval.every=0", "eval.batches=1"]
TRAINED = 3  # the source run's steps


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A run directory (config.yaml, checkpoint 3) trained 3 steps on 8 devices (2 x 4)."""
    d = tmp_path_factory.mktemp("src")
    setup, state = saved_run(d / "run", NL, 2, 4, steps=TRAINED)
    return {"dir": d / "run", "step_dir": d / "run" / "checkpoints" / str(TRAINED), "state": host(state),
            "engine": setup.engine}


def _named(state, prefix):
    return {k: np.asarray(v) for k, v in contents.named_arrays(state).items() if k.startswith(prefix)}


def _started(setup, lines=None):
    say = (lambda text: lines.append(text)) if lines is not None else (lambda text: None)
    return Checkpoints.resolve(setup.engine, setup.state, say=say)


def test_a_new_run_starts_at_step_0_with_the_checkpoints_parameters_only(src, tmp_path):
    saved = src["state"]
    # the source's optimizer, error buffers and memory are not fresh: what must not come along
    assert any(v.any() for v in _named(saved, "err_buf/").values())
    assert all(v > 0 for k, v in _named(saved, "opt_state/").items() if k.endswith("/count"))
    setup = make([*NL, f"checkpoint.init_params={src['dir']}", "train.steps=2", f"run.dir={tmp_path}/new"], 2, 4)
    fresh = host(setup.state)
    lines = []
    c = _started(setup, lines)
    assert lines == [f"parameters from {src['step_dir']} (trained {TRAINED} steps); this run starts at step 0 "
                     "with a fresh optimizer state"]
    assert c.start == 0 and c.restored is None and c.resume_step is None and c.last_saved is None
    assert c.params_from == src["step_dir"]
    got = host(c.state)
    assert int(got.step) == 0
    assert_trees_equal(got.params, saved.params)
    # this run's own, at step 0
    assert_trees_equal((got.opt_state, got.err_buf, got.memory), (fresh.opt_state, fresh.err_buf, fresh.memory))
    assert not any(v.any() for v in _named(got, "opt_state/").values() if v.dtype.kind == "i")  # counts at 0
    # a state the step takes (its shardings): one step trains from it
    losses, _ = train(setup, 1, state=c.state)
    assert np.isfinite(losses).all()


# (overrides, mesh inter x intra x model): what shapes the optimizer state and the error buffers
# but not the parameters (optim.name and optim.momentum, the CMS periods, cms.frozen_grads) differs
# from the source's
OTHER = {
    "fsdp sgd": (["sync.strategy=fsdp", "optim.name=sgd", "optim.momentum=0.9", "cms.periods=[1,2]"], (1, 4, 1)),
    "zero1 tensor-parallel": (["sync.strategy=zero1", "cms.frozen_grads=skip"], (2, 2, 2)),
}


@pytest.mark.parametrize("case", sorted(OTHER))
def test_another_mesh_strategy_optimizer_and_periods(src, tmp_path, case):
    """From the step directory itself, onto another mesh and strategy (tensor-parallel too), with
    settings that shape the optimizer state and the error buffers but not the parameters."""
    extra, mesh = OTHER[case]
    setup = make([*NL, f"checkpoint.init_params={src['step_dir']}", *extra, "train.steps=1",
                  f"run.dir={tmp_path}/new"], *mesh)
    fresh = host(setup.state)
    c = _started(setup)
    params = host(setup.engine.strategy.export_state(c.state).params)  # the model's tree, whole
    assert_trees_equal(params, src["state"].params)
    got = host(c.state)
    assert_trees_equal((got.opt_state, got.err_buf, got.memory), (fresh.opt_state, fresh.err_buf, fresh.memory))
    losses, _ = train(setup, 1, state=c.state)
    assert np.isfinite(losses).all()


def test_damaged_newest_checkpoint_falls_back_with_a_warning(src, tmp_path, capfd):
    ck = tmp_path / "ck"
    shutil.copytree(src["step_dir"], ck / "1")
    shutil.copytree(src["step_dir"], ck / "3")
    (ck / "3" / "nljax" / "metadata").write_text('{"format": 1, "arrays": ')
    setup = make([*NL, f"checkpoint.init_params={ck}", "train.steps=1", f"run.dir={tmp_path}/new"], 2, 4)
    capfd.readouterr()
    c = _started(setup)
    assert c.params_from == ck / "1"
    err = capfd.readouterr().err
    assert f"nljax: warning: checkpoint {ck / '3'} (step 3) is damaged: metadata unreadable; using an older one -- " \
           in err, err


# case: (overrides, the error line after "nljax.train: error: ")
BAD = {
    "missing": (["checkpoint.init_params={t}/nowhere"], "checkpoint.init_params: checkpoint not found: {t}/nowhere"),
    "empty": (["checkpoint.init_params={t}/empty"], "checkpoint.init_params: no complete checkpoint in {t}/empty"),
    "file": (["checkpoint.init_params={s}/config.yaml"], "checkpoint.init_params={s}/config.yaml is a file, not a "
             "checkpoint: give a run directory, a step directory or a folder of checkpoints"),
    # an export: its parameters, but not a checkpoint ("no complete checkpoint in {t}/exp" before)
    "export": (["checkpoint.init_params={t}/exp"], "checkpoint.init_params={t}/exp is an export directory "
               "(nljax.export wrote it), not a checkpoint: give the checkpoint it was exported from ({c}), or its "
               "run directory"),
    "with resume": (["checkpoint.init_params={s}", "checkpoint.resume={c}"],
                    "checkpoint.init_params={s} and checkpoint.resume={c} both name a checkpoint to start from"),
    "model": (["checkpoint.init_params={s}", "model.dim=32"],
              "checkpoint {c} does not fit this run: model.dim=16 there, 32 here"),
    "levels": (["checkpoint.init_params={s}", "cms.periods=[1,4,8]"],
               "checkpoint {c} does not fit this run: cms.periods=[1, 4] there, [1, 4, 8] here"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(src, tmp_path, capfd, case):
    from nljax import train as train_cmd

    (tmp_path / "empty").mkdir()
    (tmp_path / "exp").mkdir()  # what nljax.export writes, as far as it is read: its config.json
    (tmp_path / "exp" / "config.json").write_text(json.dumps({"config": {}, "step": 3, "dtype": "float32",
                                                              "checkpoint": str(src["step_dir"])}))
    extra, message = BAD[case]
    fill = dict(t=tmp_path, s=src["dir"], c=src["step_dir"])
    args = [*TINY, *NL, "mesh.inter=2", "mesh.intra=4", "train.steps=2", f"run.dir={tmp_path}/new",
            *[a.format(**fill) for a in extra]]
    capfd.readouterr()
    assert train_cmd.main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nljax.train: error: {message.format(**fill)}"), err
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_a_new_run_from_another_runs_checkpoint_at_train_steps_saves_its_own(src, tmp_path):
    """checkpoint.resume=PATH at train.steps: nothing to train, and the final save writes the
    state to this run's checkpoint.dir (its closing lines offer to resume and export it)."""
    own = tmp_path / "own"
    setup = make([*NL, f"checkpoint.resume={src['step_dir']}", f"train.steps={TRAINED}", f"checkpoint.dir={own}"], 2, 4)
    (own / str(TRAINED)).mkdir(parents=True)  # a user's folder named as that step: the save would replace it
    with pytest.raises(ConfigError, match=f"checkpoint.dir {own} holds {TRAINED}, which nljax did not write"):
        _started(setup)
    (own / str(TRAINED)).rmdir()
    c = _started(setup)
    assert c.start == TRAINED and c.last_saved is None
    c.open()
    try:
        c.finish(TRAINED, c.state)
    finally:
        c.close()
    assert storage.committed_steps(own) == [TRAINED]


RUN = [*SMALL, "cms.periods=[1,2]", "eval.every=0", "checkpoint.every=3", *QUICK]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_through_the_command_line_and_a_resume_of_such_a_run(tmp_path):
    """A run trained 6 steps; a new run from its run directory for 3 steps (fewer than 6) starts at
    step 0 with this run's warm-up; `--resume` of that run continues its own checkpoints, the
    source gone."""
    src, new = tmp_path / "src", tmp_path / "new"
    cli("nljax.train", "--cpu-devices", "2", "--quiet", *RUN, "train.steps=6", f"run.dir={src}")
    p = cli("nljax.train", "--cpu-devices", "2", *RUN, "train.steps=3", "optim.warmup_steps=2",
            f"checkpoint.init_params={src}", f"run.dir={new}")
    assert f"parameters from {src / 'checkpoints' / '6'} (trained 6 steps)" in p.stdout, p.stdout
    recs = _records(new)
    assert [r["step"] for r in recs] == [0, 1, 2]
    # the warm-up from its start: half the peak at step 0 (the schedule at step + 1), the peak at step 1
    assert 0 < recs[0]["lr"] == pytest.approx(recs[1]["lr"] / 2)
    assert sorted(int(q.name) for q in (new / "checkpoints").iterdir()) == [3]
    shutil.rmtree(src)  # recorded in new/config.yaml; a resume of `new` does not read it
    p = cli("nljax.train", "--cpu-devices", "2", "--resume", f"run.dir={new}", "train.steps=4")
    assert f"resumed from {new / 'checkpoints' / '3'} at step 3" in p.stdout, p.stdout
    assert "parameters from" not in p.stdout, p.stdout
    # the one warning: the longer cosine schedule (nothing of the checkpoint init_params names)
    assert [w for w in p.stderr.splitlines() if "warning" in w] == [
        "nljax: warning: resuming with train.steps=4 (the checkpoint at step 3 was written with 3): the cosine "
        "learning-rate schedule now decays to step 4"], p.stderr
    assert [r["step"] for r in _records(new)] == [0, 1, 2, 3]


def test_config_yaml_records_init_params_absolute(tmp_path, monkeypatch):
    """config.yaml records checkpoint.init_params absolute, as the data paths and checkpoint.dir
    (it was kept relative: the config.yaml reused from another folder named no checkpoint)."""
    from nljax import config
    from nljax.runtime.rundir import recorded

    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, [*TINY_NL, "checkpoint.init_params=runs/a/checkpoints/4", "data.source=files",
                                      "data.train=a.txt"])
    tree = recorded(cfg)
    assert tree["checkpoint"]["init_params"] == str(tmp_path / "runs/a/checkpoints/4")
    assert tree["data"]["train"] == [str(tmp_path / "a.txt")]  # as the data paths
    assert recorded(config.load(None, TINY_NL))["checkpoint"]["init_params"] == ""  # none: none recorded


def test_another_vocabulary_names_the_checkpoints_tokenization(src):
    """model.vocab_size, which the data's tokenizer decides (a key the user may never have set):
    the line names what the checkpoint was trained on, where it recorded it."""
    engine = make([*NL, "model.vocab_size=300"], 1, 1).engine
    meta = storage.read_meta(src["step_dir"])
    line = f"checkpoint {src['step_dir']} does not fit this run: model.vocab_size=256 there, 300 here"
    with pytest.raises(ConfigError) as e:  # recorded no tokenizer (saved by the tests' helper): as before
        contents.check_fits(src["step_dir"], meta, engine)
    assert str(e.value) == line
    with pytest.raises(ConfigError) as e:
        contents.check_fits(src["step_dir"], {**meta, "data": {"tokenizer": {"kind": "bytes"}}}, engine)
    assert str(e.value) == f"{line} (it was trained on byte tokens; this run's data decide its vocabulary)"
