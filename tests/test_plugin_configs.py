"""What a run saves of its config holds its own model's section only (`config.own_model`): the
sections of the other models registered in the process are not the run's. They were saved too,
so that registering (or installing, or removing) a plugin model made every earlier run's
checkpoint "not fit" (`model.extra=(absent) there`) and a config.yaml saved beside a plugin an
"unknown config key" where the plugin was not registered."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from helpers import TINY, saved_run

import nljax
from nljax import config, evaluate
from nljax.errors import ConfigError
from nljax.models import specs
from nljax.models.cms_mlp import CMSMLP


@dataclasses.dataclass(frozen=True)
class ExtraConfig:
    width: int = 3


@pytest.fixture
def extra():
    """A plugin model with a settings section of its own (a cms_mlp under another name)."""
    nljax.register_model("extra", lambda cfg: CMSMLP(cfg.model.vocab_size, cfg.model.dim, cfg.model.hidden_mult,
                                                      len(cfg.cms.periods)), settings=ExtraConfig)
    yield
    specs.unregister("extra")


RUN = [*TINY, "model.name=cms_mlp", "cms.periods=[1,2]"]


def test_a_run_saved_beside_a_plugin_loads_without_it(tmp_path, extra):
    run = tmp_path / "run"
    saved_run(run, RUN, 1, 1)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "extra" not in saved["model"] and "nl_lm" not in saved["model"]  # only cms_mlp's own
    specs.unregister("extra")
    try:
        evaluate.load(str(run))  # the checkpoint's config too: no section of a model not registered here
    finally:
        nljax.register_model("extra", lambda cfg: None, settings=ExtraConfig)


def test_a_run_saved_before_a_plugin_was_registered_loads_beside_it(tmp_path):
    run = tmp_path / "run"
    saved_run(run, RUN, 1, 1)
    nljax.register_model("extra", lambda cfg: None, settings=ExtraConfig)
    try:
        evaluate.load(str(run))  # failed: "does not fit this run: model.extra=(absent) there, {'width': 3} here"
    finally:
        specs.unregister("extra")


def test_a_config_saved_with_every_models_section_reads_its_own(tmp_path):
    """A config.yaml written before: every model registered then, one of them unknown here."""
    tree = config.to_dict(config.load(None, RUN))
    tree["model"]["nl_lm"] = {"window": 7}
    tree["model"]["gone"] = {"width": 5}  # a plugin since removed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    cfg = config.load(str(tmp_path / "config.yaml"), saved=True)
    assert cfg.model.name == "cms_mlp" and cfg.model.nl_lm == config.load(None).model.nl_lm


def test_a_run_of_a_model_not_registered_here_says_so(tmp_path):
    tree = config.to_dict(config.load(None, RUN))
    tree["model"]["name"] = "gone"
    tree["model"]["gone"] = {"width": 5}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"^config file .*config.yaml: the run's model 'gone' is not registered "
                                          r"in this process \(registered: cms_mlp, dit, nl_lm\): run the command where "
                                          r"it is, a script's model through that script .*entry point$") as e:
        config.load(str(tmp_path / "config.yaml"), saved=True)
    assert "\n" not in str(e.value)
