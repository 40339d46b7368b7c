"""`--resume` starts from the run's own config.yaml: a run started with overrides resumes with
none and continues exactly; what may change on resume changes, a change to the model is refused
in one line naming the key (nljax/run/resuming.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import QUICK, SMALL, cli, run_python
from test_checkpoint_cli import KILLER

# Overrides a resume with the defaults would refuse (cms.periods, model.*) or run differently
# (train.steps, the checkpoint cadence)
STARTED = [*SMALL, "cms.periods=[1,2]", "train.steps=8", "checkpoint.every=2", "eval.every=0", *QUICK]
TIMINGS = ("step_time_s", "tokens_per_s_per_device", "compiled", "compile_s", "tflops_per_s_per_device", "mfu")


def deterministic(run: Path) -> list[dict]:
    """metrics.jsonl without the fields that time the run (as parsed floats: bitwise)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


@pytest.mark.slow  # three CLI runs (a minute); the saved-config rule is also checked by the next test
def test_resume_with_no_overrides_continues_a_run_started_with_overrides(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    cli("nljax.train", "--cpu-devices", "2", "--quiet", *STARTED, f"run.dir={ref}")
    # Ctrl-C once step 4 is logged: checkpoint 5 saved, exit 130
    p = run_python("-c", KILLER, "int", "5", str(run / "checkpoints"), "--cpu-devices", "2", "--quiet", *STARTED,
                   f"run.dir={run}", check=False)
    assert p.returncode == 130, p.stderr
    p = cli("nljax.train", "--cpu-devices", "2", "--resume", f"run.dir={run}")
    assert f"resumed from {run / 'checkpoints' / '5'} at step 5" in p.stdout, p.stdout
    assert "warning" not in p.stderr, p.stderr  # nothing differs from the checkpoint's settings
    assert deterministic(run) == deterministic(ref)
    assert len(deterministic(run)) == 8

    # what may change on resume changes: more steps (and the cadence), with the model as saved
    p = cli("nljax.train", "--cpu-devices", "2", "--quiet", "--resume", f"run.dir={run}", "train.steps=10",
            "checkpoint.every=5")
    assert [r["step"] for r in deterministic(run)] == list(range(10))
    assert sorted(q.name for q in (run / "checkpoints").iterdir() if q.name.isdigit()) == ["10", "6", "8"]

    # a change to the model is refused in one line naming the key, before anything is built
    p = cli("nljax.train", "--cpu-devices", "2", "--resume", f"run.dir={run}", "model.dim=32", check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"nljax.train: error: model.dim=32 cannot change on resume (16 in {run / 'config.yaml'}: the checkpoint "
        "holds that model); leave it out, or start a new run in another run.dir"]


def test_config_file_with_resume_is_applied_on_the_saved_config(tmp_path):
    """`--config FILE --resume`: the run's config.yaml first, the file's keys on top (checked like
    overrides: a differing model key is refused, naming it and the file that set it, through a
    base_config too; the file's other keys apply)."""
    from nljax import config
    from nljax.run.resuming import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    saved = config.load(None, [*STARTED, f"run.dir={run}"])
    (run / "config.yaml").write_text(json.dumps(config.to_dict(saved)))  # YAML reads JSON
    file = tmp_path / "more.yaml"
    file.write_text("train:\n  steps: 20\neval:\n  every: 5\n")
    args = ["checkpoint.resume=latest", f"run.dir={run}"]
    cfg = resumed_config(config.load(str(file), args), str(file), args)
    assert (cfg.train.steps, cfg.eval.every, cfg.cms.periods, cfg.model.dim) == (20, 5, (1, 2), 16)
    file.write_text("cms:\n  periods: [1, 4]\n")
    tail = f" cannot change on resume ([1, 2] in {run / 'config.yaml'}: the checkpoint holds that model)"
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(str(file), args), str(file), args)
    assert str(e.value).startswith(f"cms.periods=[1, 4], set in --config {file},{tail}"), e.value
    # set by the file's base_config: that file is named, and how it was reached
    (tmp_path / "base.yaml").write_text("cms:\n  periods: [1, 4]\n")
    file.write_text("base_config: base.yaml\ntrain:\n  steps: 20\n")
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(str(file), args), str(file), args)
    assert str(e.value).startswith(f"cms.periods=[1, 4], set in {tmp_path / 'base.yaml'} (the base_config of "
                                   f"--config {file}),{tail}"), e.value
    # the command line's own setting wins over the files: nothing to name but the key
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(str(file), [*args, "cms.periods=[1,8]"]), str(file), [*args, "cms.periods=[1,8]"])
    assert str(e.value).startswith(f"cms.periods=[1, 8]{tail}"), e.value
    # as is a whole section the command line sets (a YAML mapping): the file's key is not the one used
    whole = [*args, "cms={periods: [1, 8]}"]
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(str(file), whole), str(file), whole)
    assert str(e.value).startswith(f"cms.periods=[1, 8]{tail}"), e.value
    # no resume, or another run's checkpoints: the command line's config, as before
    assert resumed_config(config.load(None, [f"run.dir={run}"]), None, []).train.steps == config.Config().train.steps


def test_a_changed_model_is_named_before_the_checks_it_fails(tmp_path):
    """A resume that changes model.name is refused naming model.name: the merged config's own
    check failed first and named a key the user did not touch (train.seq_len=6 must be a multiple
    of model.nl_lm.memory_chunk=...)."""
    from nljax import config
    from nljax.run.resuming import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    saved = config.load(None, [*STARTED, "train.seq_len=6", f"run.dir={run}"])
    (run / "config.yaml").write_text(json.dumps(config.to_dict(saved)))
    args = ["checkpoint.resume=latest", f"run.dir={run}", "model.name=nl_lm"]
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(None, args), None, args)
    assert str(e.value) == (f"model.name='nl_lm' cannot change on resume ('cms_mlp' in {run / 'config.yaml'}: the "
                            "checkpoint holds that model); leave it out, or start a new run in another run.dir")


@pytest.mark.slow  # an edge case of 10-15 s: the README's suite kept under 15 minutes on 2 cores (.ci/run runs it)
def test_a_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    """`--resume` of a run whose checkpoint is at train.steps: one line says there is nothing left
    to train, and no save is announced (none happens: the checkpoint is untouched); the final
    evaluation and summary.json are made again."""
    from nljax.train import main as train_main

    run = tmp_path / "run"
    args = [*SMALL, "train.steps=2", "eval.every=0", *QUICK, "throughput.reps=0", f"run.dir={run}"]
    assert train_main(args) == 0
    step = run / "checkpoints" / "2"
    before = sorted((p.relative_to(step), p.stat().st_mtime_ns) for p in step.rglob("*"))
    capsys.readouterr()
    assert train_main(["--resume", *args]) == 0
    out = capsys.readouterr().out
    assert ("nothing left to train: the checkpoint is at step 2 = train.steps (raise train.steps to continue); "
            "evaluating it again for summary.json") in out.splitlines(), out
    assert "saving the final checkpoint" not in out, out
    assert sorted((p.relative_to(step), p.stat().st_mtime_ns) for p in step.rglob("*")) == before
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 2


def test_a_resume_pointed_at_another_runs_checkpoints_is_refused(tmp_path, capsys):
    """`--resume` with checkpoint.dir changed to the checkpoints/ folder of another run directory
    continued this run from that run's state: it dropped this run's metrics.jsonl records from
    that checkpoint's step on, and its saves pruned the other run's checkpoints. One line, nothing
    changed; run.overwrite=true does not replace that run's checkpoints either (it replaces this
    run's files); checkpoints moved to a folder of their own still resume."""
    import shutil

    from helpers import tree_hash

    from nljax.train import main as train_main

    args = [*SMALL, "train.steps=2", "eval.every=0", *QUICK, "throughput.reps=0"]
    assert train_main([*args, f"run.dir={tmp_path / 'a'}"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    before = tree_hash(tmp_path)
    capsys.readouterr()
    theirs = tmp_path / "a" / "checkpoints"
    assert train_main(["--resume", *args, "train.steps=4", f"run.dir={tmp_path / 'b'}", f"checkpoint.dir={theirs}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"nljax.train: error: checkpoint.dir {theirs} is the checkpoints folder of another run "
                   f"({tmp_path / 'a'}), not of the run in {tmp_path / 'b'} (its checkpoint.dir is "
                   f"{tmp_path / 'b' / 'checkpoints'}): continue that run with --resume run.dir={tmp_path / 'a'}, or "
                   f"start a new run from one of its checkpoints with checkpoint.resume={theirs}/STEP in another "
                   "run.dir"], err
    assert tree_hash(tmp_path) == before
    # from a run.dir of no run: it went on with the other run's checkpoints, its saves in that
    # run's folder; and a fresh run there is told to resume that run from its own run.dir
    new = tmp_path / "c"
    for resume, line in [(["--resume"], f"nljax.train: error: checkpoint.dir {theirs} is the checkpoints folder of "
                          f"another run ({tmp_path / 'a'}), not of the run in {new} (which holds no run): continue "
                          f"that run with --resume run.dir={tmp_path / 'a'}, or start a new run from one of its "
                          f"checkpoints with checkpoint.resume={theirs}/STEP in another run.dir"),
                         ([], f"nljax.train: error: checkpoint.dir {theirs} already holds checkpoints (up to step 2): "
                          f"continue that run with --resume run.dir={tmp_path / 'a'}, choose another checkpoint.dir"),
                         # run.overwrite replaces this run's files, never another run's checkpoints
                         (["run.overwrite=true"], f"nljax.train: error: checkpoint.dir {theirs} holds the checkpoints "
                          f"of the run in {tmp_path / 'a'}: run.overwrite=true replaces this run's files, not another "
                          f"run's; choose another checkpoint.dir (to start that run over: run.dir={tmp_path / 'a'} "
                          "run.overwrite=true)")]:
        assert train_main([*resume, *args, "train.steps=4", f"run.dir={new}", f"checkpoint.dir={theirs}"]) == 2
        assert capsys.readouterr().err.splitlines() == [line]
        assert tree_hash(tmp_path) == before
    (tmp_path / "b" / "checkpoints").rename(tmp_path / "ck")  # moved by the user: still this run's
    assert train_main(["--resume", *args, "train.steps=3", f"run.dir={tmp_path / 'b'}",
                       f"checkpoint.dir={tmp_path / 'ck'}"]) == 0
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["2", "3"]
    # the refusal's way to start that run over: its own checkpoints are its files to replace
    assert train_main([*args, f"run.dir={tmp_path / 'a'}", "run.overwrite=true"]) == 0


def test_a_resume_from_a_step_number_reads_that_checkpoint_of_the_run(tmp_path, monkeypatch):
    """`checkpoint.resume=STEP` is the run's checkpoint at that step, as `checkpoint=STEP` reads
    in nljax.evaluate, generate and export (it was "checkpoint not found: $PWD/2"), in the run's
    checkpoint.dir as its config.yaml has it (the command line's default, <run.dir>/checkpoints,
    was looked in: "no checkpoint at step 2"); a step the run has no checkpoint at is one line
    naming the steps it has; digits naming a path here stay that path."""
    from nljax import config
    from nljax.run.resuming import step_resume

    run, ck = tmp_path / "run", tmp_path / "ck"
    started = [*SMALL, "cms.periods=[1,2]", "train.steps=4", "checkpoint.every=2", "eval.every=0", *QUICK]
    cli("nljax.train", "--quiet", *started, f"run.dir={run}", f"checkpoint.dir={ck}")
    p = cli("nljax.train", "checkpoint.resume=2", f"run.dir={run}")
    assert f"resumed from {ck / '2'} at step 2" in p.stdout, p.stdout
    # the later checkpoint set aside, as for any resume from an older one, and step 4 trained again
    assert (ck / "set_aside" / "4").is_dir() and (ck / "4").is_dir()
    with pytest.raises(config.ConfigError, match=rf"^checkpoint.resume=3: {run} has no checkpoint at step 3 \(its "
                                                 r"checkpoints are at steps 2, 4\)$"):
        step_resume(config.load(None, [f"run.dir={run}", "checkpoint.resume=3"]), None, [])
    (tmp_path / "7").mkdir()  # a folder named 7 here: the path, as before
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, [f"run.dir={run}", "checkpoint.resume=7"])
    assert step_resume(cfg, None, []).checkpoint.resume == "7"


def test_what_a_resume_reads_from_the_run_dir_alone(tmp_path, monkeypatch, capsys):
    """From the directories alone, before anything is built: a folder in config.yaml's place is
    refused as the run's saved config; a checkpoints folder of no step (only folders of other
    names) is no run whose config.yaml is missing; checkpoint.resume=4 naming a path that exists
    here is that path, not step 4 of the run."""
    from nljax import config
    from nljax.run.resuming import resumed_config, saved_config_file, step_resume

    run = tmp_path / "run"
    (run / "config.yaml").mkdir(parents=True)
    cfg = config.load(None, [f"run.dir={run}", "checkpoint.resume=latest"])
    with pytest.raises(config.ConfigError, match=r"config.yaml is not a regular file: it cannot be the run's saved"):
        saved_config_file(cfg)
    (run / "config.yaml").rmdir()
    (run / "checkpoints" / "tmp").mkdir(parents=True)
    (run / "checkpoints" / "12").write_text("")  # a file of a step's name: no step
    assert resumed_config(cfg, None, []) == cfg and capsys.readouterr().err == ""
    (run / "checkpoints" / "12").unlink()
    (run / "checkpoints" / "12").mkdir()
    assert resumed_config(cfg, None, []) == cfg and "config.yaml is missing" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    Path("4").mkdir()
    given = config.load(None, [f"run.dir={run}", "checkpoint.resume=4"])
    assert step_resume(given, None, []).checkpoint.resume == "4"


def test_a_resume_takes_this_commands_settings_and_the_runs_checkpoint_dir(tmp_path, capsys):
    """run.quiet and run.overwrite are this command's, never the saved ones; the run's own
    checkpoint.dir (config.yaml's, wherever it is) resumes, as does one of another name beside
    another run; another run's checkpoints/ folder is refused; a run whose checkpoints are outside
    run.dir is not said to lack a config.yaml beside them."""
    from nljax import config
    from nljax.run.resuming import resumed_config

    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "other"
    for d in (a, b, other):
        d.mkdir()
    (a / "nljax_written.txt").write_text("metrics.jsonl\n")
    (other / "nljax_written.txt").write_text("metrics.jsonl\n")
    saved = config.load(None, [f"run.dir={b}", f"checkpoint.dir={a / 'checkpoints'}", "run.quiet=true",
                               "run.overwrite=true"])
    (b / "config.yaml").write_text(json.dumps(config.to_dict(saved)))  # YAML reads JSON
    args = [f"run.dir={b}", "checkpoint.resume=latest"]
    resumed = resumed_config(config.load(None, args), None, args)
    assert resumed.checkpoint.dir == str(a / "checkpoints")
    assert not resumed.run.quiet and not resumed.run.overwrite
    args = [f"run.dir={b}", "checkpoint.resume=latest", f"checkpoint.dir={other / 'ck'}"]
    assert resumed_config(config.load(None, args), None, args).checkpoint.dir == str(other / "ck")
    args = [f"run.dir={b}", "checkpoint.resume=latest", f"checkpoint.dir={other / 'checkpoints'}"]
    with pytest.raises(config.ConfigError, match="is the checkpoints folder of another run"):
        resumed_config(config.load(None, args), None, args)
    (b / "config.yaml").unlink()
    (tmp_path / "ck" / "12").mkdir(parents=True)
    args = [f"run.dir={b}", "checkpoint.resume=latest", f"checkpoint.dir={tmp_path / 'ck'}"]
    resumed_config(config.load(None, args), None, args)
    assert capsys.readouterr().err == ""


def test_a_key_added_since_the_checkpoint_at_its_default_is_not_said():
    """A checkpoint written before a key existed resumed with three warnings for settings nobody
    had touched ("resuming with optim.nesterov=False (the checkpoint at step 6 was written with
    (absent))", a 2026-11-28 run resumed by the code of 12-02). A key at its default does what the
    code did then (`config.ADDED` holds the keys where it does not): said only when set otherwise."""
    from nljax import config
    from nljax.checkpoint.restore import _changed_settings

    saved = config.to_dict(config.load(None, []))
    del saved["optim"]["nesterov"], saved["train"]["target_eval_loss"], saved["images"]["classes"]
    meta = {"config": saved, "step": 6}
    assert _changed_settings(meta, config.load(None, [])) == []
    assert _changed_settings(meta, config.load(None, ["optim.momentum=0.9", "optim.nesterov=true",
                                                      "optim.name=sgd"])) == [
        "resuming with optim.momentum=0.9 (the checkpoint at step 6 was written with 0.0)",
        "resuming with optim.name='sgd' (the checkpoint at step 6 was written with 'adamw')",
        "resuming with optim.nesterov=True (the checkpoint at step 6 was written with (absent))"]
