"""A config built on another: `base_config:` in a YAML file (a packaged config by name, or a
path relative to the file), and `--config A --config B`, each file updating the ones before it
key by key, the overrides last (nljax/config.py `load`, `_read_layers`)."""

from __future__ import annotations

import json

import pytest
import yaml

from nljax import config
from nljax.config import ConfigError


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_base_config_by_packaged_name(tmp_path):
    f = _write(tmp_path / "mine.yaml", "base_config: nl_gpu\ntrain:\n  steps: 5\n")
    cfg = config.load(str(f))
    gpu = config.load("nl_gpu")
    assert cfg.train.steps == 5 and gpu.train.steps != 5
    # every other key as nl_gpu has it, train's other keys included (section by section)
    assert cfg == config.load("nl_gpu", ["train.steps=5"])
    assert cfg.train.batch_size == gpu.train.batch_size != config.Config().train.batch_size


def test_base_config_by_a_path_relative_to_the_file_not_to_the_current_directory(tmp_path, monkeypatch):
    _write(tmp_path / "exp" / "shared" / "base.yaml", "train:\n  steps: 9\n  batch_size: 4\n")
    f = _write(tmp_path / "exp" / "mine.yaml", "base_config: shared/base.yaml\ntrain:\n  batch_size: 2\n")
    _write(tmp_path / "cwd" / "shared" / "base.yaml", "train:\n  steps: 1\n")  # a decoy where the command runs
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = config.load(str(f))
    assert (cfg.train.steps, cfg.train.batch_size) == (9, 2)


def test_a_folder_named_as_a_packaged_config_does_not_hide_it(tmp_path):
    """A folder of runs named after the config beside the YAML (runs kept as ./nl_gpu/...)."""
    (tmp_path / "nl_gpu").mkdir()
    f = _write(tmp_path / "x.yaml", "base_config: nl_gpu\ntrain:\n  steps: 5\n")
    assert config.load(str(f)) == config.load("nl_gpu", ["train.steps=5"])


def test_a_chain_of_bases_applies_each_on_the_one_below(tmp_path):
    _write(tmp_path / "a.yaml", "base_config: nl_gpu\ntrain:\n  steps: 3\n  log_every: 7\n")
    _write(tmp_path / "b.yaml", "base_config: a.yaml\ntrain:\n  steps: 4\noptim:\n  lr: 0.002\n")
    c = _write(tmp_path / "c.yaml", "base_config: ./b.yaml\ntrain:\n  batch_size: 8\n")
    cfg = config.load(str(c), ["train.log_every=2"])
    gpu = config.load("nl_gpu")
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.log_every) == (4, 8, 2)
    assert cfg.optim.lr == 0.002 and cfg.optim.warmup_steps == gpu.optim.warmup_steps != 0
    assert cfg.model == gpu.model


@pytest.mark.parametrize("case", ["cycle", "self", "missing", "misspelt", "path", "list", "number", "bad key", "empty"])
def test_a_bad_base_is_one_line_naming_both_files(tmp_path, capsys, case):
    from nljax import train

    top = tmp_path / "top.yaml"
    base = {"cycle": "other.yaml", "self": "top.yaml", "missing": "nowhere.yaml", "misspelt": "nl_gpuu",
            "path": "../elsewhere/nowhere.yaml", "list": "list.yaml",
            "number": "3", "bad key": "other.yaml", "empty": ""}[case]
    _write(top, f"base_config: {base}\ntrain:\n  steps: 3\n")
    _write(tmp_path / "other.yaml", "base_config: top.yaml\n" if case == "cycle" else "train:\n  stepz: 1\n")
    _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    said = {"cycle": f"config file {tmp_path / 'other.yaml'} (the base_config of {top}): base_config top.yaml "
                     f"makes a cycle ({top} -> {tmp_path / 'other.yaml'} -> {top})",
            "self": f"config file {top}: base_config top.yaml makes a cycle ({top} -> {top})",
            "missing": f"config file {top}: base_config nowhere.yaml not found (neither {tmp_path / 'nowhere.yaml'} "
                       "nor a packaged config: ",
            # a packaged config's name misspelt: the nearest named, as an unknown key's line does
            "misspelt": f"config file {top}: base_config nl_gpuu not found (neither {tmp_path / 'nl_gpuu'} nor a "
                        "packaged config: ",
            # a path: the file tried, from top.yaml's folder, its '..' folded; no packaged config offered
            "path": f"config file {top}: base_config ../elsewhere/nowhere.yaml not found: no file "
                    f"{tmp_path.parent / 'elsewhere' / 'nowhere.yaml'} (a relative base_config is read from the folder "
                    "of the file naming it)",
            "list": f"config file {tmp_path / 'list.yaml'} (the base_config of {top}) must hold a mapping",
            "number": f"config file {top}: base_config must name a packaged config or a YAML file, got 3",
            # `base_config:` with nothing after it (YAML's null) was read as no base at all
            "empty": f"config file {top}: base_config must name a packaged config or a YAML file, got None",
            "bad key": f"config file {tmp_path / 'other.yaml'} (the base_config of {top}): unknown config key "
                       "'train.stepz'"}[case]
    with pytest.raises(ConfigError) as e:
        config.load(str(top))
    assert str(e.value).startswith(said)
    assert str(e.value).endswith(" (did you mean 'nl_gpu'?)") == (case == "misspelt")
    assert case != "path" or str(e.value) == said
    assert train.main(["--config", str(top), "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"nljax.train: error: {e.value}"]


def test_a_missing_base_names_the_path_tried_from_the_file_naming_it(tmp_path, monkeypatch, capsys):
    """A base_config path is read from the folder of the file that names it, however deep in the
    chain: the line says that file (and what included it) and the path tried, as written from here."""
    from nljax import train

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "top.yaml", "base_config: conf/a.yaml\n")
    _write(tmp_path / "conf" / "a.yaml", "base_config: ../base/missing.yaml\ntrain:\n  steps: 3\n")
    (tmp_path / "base").mkdir()
    assert train.main(["--config", "top.yaml", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "nljax.train: error: config file conf/a.yaml (the base_config of top.yaml): base_config ../base/missing.yaml "
        "not found: no file base/missing.yaml (a relative base_config is read from the folder of the file naming "
        "it)"], err


def test_two_config_files_layer_in_order_with_the_overrides_on_top(tmp_path, capsys):
    from nljax import train

    b = _write(tmp_path / "b.yaml", "train:\n  steps: 11\n  log_every: 3\noptim:\n  lr: 0.001\n")
    assert train.main(["--config", "nl_gpu", "--config", str(b), "--print-config", "train.log_every=5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    gpu = config.to_dict(config.load("nl_gpu"))
    assert "base_config" not in printed
    assert (printed["train"]["steps"], printed["train"]["log_every"], printed["optim"]["lr"]) == (11, 5, 0.001)
    # nl_gpu's keys that b.yaml leaves out, in the sections it touches too
    assert printed["train"]["batch_size"] == gpu["train"]["batch_size"]
    assert printed["optim"]["warmup_steps"] == gpu["optim"]["warmup_steps"]
    assert printed["model"] == gpu["model"]
    # the other order: nl_gpu's train.steps wins over b's
    assert config.load([str(b), "nl_gpu"]).train.steps == gpu["train"]["steps"] != 11


@pytest.mark.parametrize("command", ["train", "comm", "bench", "prepare"])
def test_every_command_taking_config_takes_it_again(command):
    from nljax import refdoc

    args = refdoc.parser_of(command).parse_intermixed_args(["--config", "a.yaml", "--config", "b.yaml"])
    assert args.config == ["a.yaml", "b.yaml"]


def test_a_wrong_key_in_the_second_file_names_that_file(tmp_path, capsys):
    from nljax import train

    a = _write(tmp_path / "a.yaml", "train:\n  steps: 2\n")
    b = _write(tmp_path / "b.yaml", "train:\n  stepz: 3\n")
    assert train.main(["--config", str(a), "--config", str(b), "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"nljax.train: error: config file {b}: unknown config key 'train.stepz' (did you mean 'train.steps'?)"]
    b.write_text("train:\n  steps: many\n")  # a wrong value too, though an override sets the key again
    with pytest.raises(ConfigError, match=rf"^config file {b}: config key 'train.steps' must be int"):
        config.load([str(a), str(b)], ["train.steps=4"])
    a.write_text("train:\n  stepz: 3\n")  # the first file's, named as before
    with pytest.raises(ConfigError, match=rf"^config file {a}: unknown config key 'train.stepz'"):
        config.load([str(a), str(b)])


def test_the_saved_config_yaml_is_the_resolved_one(tmp_path):
    """What a run writes holds every setting and no base_config: evaluate, generate, export and
    --resume read it as they read any run's."""
    from nljax.run import trained
    from nljax.runtime.rundir import RunDir

    run = tmp_path / "run"
    f = _write(tmp_path / "mine.yaml", "base_config: nl_gpu\ntrain:\n  steps: 5\n")
    cfg = config.load(str(f), [f"run.dir={run}"])
    RunDir(str(run), overwrite=False, write=True).save_config(cfg)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "base_config" not in saved and saved["model"]["dim"] == cfg.model.dim
    assert trained.trained_config(run) == cfg


def test_several_files_on_resume_layer_on_the_saved_config_in_order(tmp_path):
    from nljax.run.resuming import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    saved = config.load(None, ["model.dim=16", "cms.periods=[1,2]", "train.steps=8", f"run.dir={run}"])
    (run / "config.yaml").write_text(json.dumps(config.to_dict(saved)))  # YAML reads JSON
    _write(tmp_path / "a.yaml", "train:\n  steps: 20\n  log_every: 4\n")
    b = _write(tmp_path / "b.yaml", "base_config: a.yaml\ntrain:\n  steps: 30\neval:\n  every: 5\n")
    c = _write(tmp_path / "c.yaml", "train:\n  log_every: 6\n")
    args = ["checkpoint.resume=latest", f"run.dir={run}", "eval.every=7"]
    files = [str(b), str(c)]
    cfg = resumed_config(config.load(files, args), files, args)
    assert (cfg.train.steps, cfg.train.log_every, cfg.eval.every) == (30, 6, 7)
    assert (cfg.model.dim, cfg.cms.periods) == (16, (1, 2))  # the run's, which no file sets


def test_a_mesh_key_set_by_one_of_several_files_is_named_by_that_file(tmp_path):
    """A launch's mesh that does not fit names where each key was set (nljax/run/resuming.py)."""
    from nljax.run.resuming import mesh_given

    a = _write(tmp_path / "a.yaml", "mesh:\n  intra: 4\n  inter: 2\n")
    b = _write(tmp_path / "b.yaml", "mesh:\n  inter: 4\n")
    assert mesh_given([str(a), str(b)], []) == {"inter": f"in --config {b}", "intra": f"in --config {a}"}
    given = mesh_given([str(a), str(b)], ["mesh.intra=2"])
    assert given == {"inter": f"in --config {b}", "intra": "on the command line"}


def test_base_config_on_the_command_line_names_the_file_to_give(capsys):
    """`base_config=x` as an override was an unknown key: it is a file's key; --config x it is."""
    from nljax import train

    with pytest.raises(ConfigError) as e:
        config.load(None, ["base_config=nl_gpu"])
    assert str(e.value) == ("base_config is a config file's key (a YAML file's top-level 'base_config: nl_gpu'); "
                            "on the command line give the file itself: --config nl_gpu")
    assert train.main(["base_config=nl_gpu", "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"nljax.train: error: {e.value}"]


@pytest.mark.parametrize("key", ["base", "extends", "defaults", "Inherit"])
def test_another_tools_key_for_the_base_config_names_base_config(tmp_path, key):
    """`base: nl_gpu` (or Hydra's `defaults:`, `extends:`) in a file: the unknown-key line listed
    the config's sections, which base_config is not among, so the user could not find the key."""
    f = _write(tmp_path / "mine.yaml", f"{key}: nl_gpu\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(f))
    assert str(e.value) == (f"config file {f}: unknown config key '{key}' (did you mean 'base_config'? a file builds "
                            "on another config with 'base_config: NAME', a packaged config or a YAML file)")
    # on the command line too (`base=nl_gpu`): the line listed the sections alone there as well
    with pytest.raises(ConfigError) as e:
        config.load(None, [f"{key}=nl_gpu"])
    assert str(e.value) == (f"unknown config key '{key}' (a config builds on another with a YAML file's top-level "
                            "'base_config: nl_gpu'; on the command line give the file itself: --config nl_gpu)")
