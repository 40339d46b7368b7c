"""The configs ship inside the package (nljax/configs/): `--config NAME` finds one by name from
any directory, a path still works as before (an existing file wins), and the configs' old
location (`configs/nl_gpu.yaml`) still resolves by its file name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nljax import config
from nljax.errors import ConfigError


def test_packaged_configs_ship_in_the_package():
    names = config.packaged_configs()
    assert {"nl_default", "nl_gpu", "meanflow_digits", "meanflow_toy", "titans_demo"} <= set(names)
    assert config.PACKAGED == Path(config.__file__).parent / "configs"


@pytest.mark.parametrize("given", ["nl_gpu", "nl_gpu.yaml", "configs/nl_gpu.yaml"])
def test_a_packaged_config_resolves_by_name(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any directory: nothing named so here
    assert config.config_path(given) == config.PACKAGED / "nl_gpu.yaml"
    cfg = config.load(given)
    assert cfg == config.load(str(config.PACKAGED / "nl_gpu.yaml"))
    assert cfg.train.seq_len == 1024  # nl_gpu's own, not the default's


def test_an_existing_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "nl_gpu.yaml").write_text("train:\n  steps: 7\n")
    (tmp_path / "nl_gpu").write_text("train:\n  steps: 9\n")
    assert config.load("configs/nl_gpu.yaml").train.steps == 7
    assert config.load("nl_gpu").train.steps == 9
    assert config.load(str(tmp_path / "configs" / "nl_gpu.yaml")).train.steps == 7


@pytest.mark.parametrize("given", ["nl_gppu", "elsewhere/nl_gpu.yaml", "/nowhere/nl_gpu.yaml"])
def test_an_unknown_name_lists_the_packaged_ones(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        config.load(given)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"config file not found: {given} ")
    assert all(name in line for name in config.packaged_configs())


def test_the_command_line_finds_a_packaged_config_from_any_directory(tmp_path):
    """`python -m nljax.prepare --config NAME` (the quickest command that loads a config) from
    a directory without configs/: a packaged name is read, an unknown one is one line."""
    env = {**os.environ, "PYTHONPATH": str(Path(config.__file__).parent.parent)}
    run = lambda name: subprocess.run([sys.executable, "-m", "nljax.prepare", "--config", name],  # noqa: E731
                                      capture_output=True, text=True, cwd=tmp_path, env=env)
    p = run("nl_default")
    assert p.returncode == 2 and "config file" not in p.stderr, p.stderr  # past the config: prepare's own line
    p = run("no_such")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "config file not found: no_such" in p.stderr and "nl_gpu" in p.stderr
