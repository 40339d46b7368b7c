"""The mesh is the launch's, not the run's: `--resume` on devices the saved mesh (mesh.* in the
run's config.yaml) does not fit takes the defaults that fit, with one note line; a mesh set on
the command line that does not fit is one error line naming where it was set
(nljax/run/resuming.py: `fit_mesh`). The continuation itself is the elastic restore's
(tests/test_checkpoint.py: `test_elastic_resume_8_4_2_devices`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import QUICK, TINY, cli, saved_run, tree_hash

from nljax import config
from nljax.errors import ConfigError
from nljax.run.resuming import fit_mesh, mesh_given


def _cfg(*overrides: str) -> config.Config:
    return config.load(None, ["run.dir=runs/mesh8", *overrides])


def test_a_saved_mesh_that_does_not_fit_takes_the_defaults_with_a_note():
    saved = _cfg("mesh.inter=2")  # as a run started with --cpu-devices 8 mesh.inter=2 saved it
    cfg, note = fit_mesh(saved, {}, 1)
    assert (cfg.mesh.inter, cfg.mesh.intra, cfg.mesh.model) == (-1, -1, 1)
    assert note == ("resuming on 1 device: mesh.inter=2 from runs/mesh8/config.yaml does not fit, using mesh.inter=-1 "
                    "(set mesh.* to choose)")
    assert fit_mesh(saved, {}, 2) == (saved, None)  # 2 x 1 fits: kept
    assert fit_mesh(saved, {}, 8) == (saved, None)
    # every saved key that is not the default goes, whichever of them does not fit
    cfg, note = fit_mesh(_cfg("mesh.inter=2", "mesh.intra=4", "mesh.model=2"), {}, 4)
    assert (cfg.mesh.inter, cfg.mesh.intra, cfg.mesh.model) == (-1, -1, 1)
    assert note == ("resuming on 4 devices: mesh.inter=2, mesh.intra=4, mesh.model=2 from runs/mesh8/config.yaml do "
                    "not fit, using mesh.inter=-1, mesh.intra=-1, mesh.model=1 (set mesh.* to choose)")
    # 2 processes x 2 devices: the default puts one inter slot on each process
    cfg, note = fit_mesh(_cfg("mesh.intra=8"), {}, 4, 2)
    assert (cfg.mesh.inter, cfg.mesh.intra) == (-1, -1) and note.startswith("resuming on 4 devices (2 processes): ")


def test_a_mesh_set_now_is_kept_and_refused_where_it_does_not_fit():
    # set on the command line, with a saved key that does not fit beside it: the saved one goes
    cfg, note = fit_mesh(_cfg("mesh.inter=4", "mesh.intra=2"), {"intra": "on the command line"}, 4)
    assert (cfg.mesh.inter, cfg.mesh.intra) == (-1, 2) and note.startswith("resuming on 4 devices: mesh.inter=4 from ")
    with pytest.raises(ConfigError) as e:
        fit_mesh(_cfg("mesh.inter=3"), {"inter": "on the command line"}, 2)
    assert str(e.value) == "mesh.inter=3 does not divide the 2 available devices (mesh.inter=3 set on the command line)"
    with pytest.raises(ConfigError) as e:  # the saved inter=2 goes; intra=3 from the file stays and does not fit
        fit_mesh(_cfg("mesh.inter=2", "mesh.intra=3"), {"intra": "in --config my.yaml"}, 4)
    assert str(e.value) == "mesh.intra=3 does not divide the 4 available devices (mesh.intra=3 set in --config my.yaml)"


def test_mesh_given_names_where_each_key_was_set(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("mesh:\n  intra: 4\n  inter: 2\n")
    assert mesh_given(None, []) == {}
    assert mesh_given(None, ["mesh.inter=-1", "train.steps=3"]) == {}  # the default: nothing a fit would change
    assert mesh_given(None, ["mesh.inter=2"]) == {"inter": "on the command line"}
    assert mesh_given(str(f), ["mesh.inter=4"]) == {"inter": "on the command line", "intra": f"in --config {f}"}


@pytest.fixture(scope="module")
def mesh8(tmp_path_factory):
    """A run saved on 8 devices as a 2 x 4 mesh: config.yaml (mesh.inter=2, mesh.intra=4) and
    checkpoint 2."""
    run = tmp_path_factory.mktemp("mesh8") / "run"
    saved_run(run, [], 2, 4)
    return run


def test_resume_on_one_device_continues_with_a_note(mesh8, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(mesh8, run)
    p = cli("nljax.train", "--cpu-devices", "1", "--resume", f"run.dir={run}", "train.steps=3", *QUICK)
    assert (f"nljax: resuming on 1 device: mesh.inter=2, mesh.intra=4 from {run}/config.yaml do not fit, using "
            "mesh.inter=-1, mesh.intra=-1 (set mesh.* to choose)") in p.stderr.splitlines(), p.stderr
    assert f"resumed from {run / 'checkpoints' / '2'} at step 2" in p.stdout, p.stdout
    assert "mesh inter=1 x intra=1" in p.stdout, p.stdout
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [2]


def test_resume_with_a_mesh_set_that_does_not_fit_is_one_line(mesh8):
    before = tree_hash(mesh8)
    p = cli("nljax.train", "--cpu-devices", "1", "--resume", f"run.dir={mesh8}", "mesh.inter=2", "train.steps=3",
            check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["nljax.train: error: mesh.inter=2 does not divide the 1 available devices "
                                     "(mesh.inter=2 set on the command line)"], p.stderr
    assert tree_hash(mesh8) == before


def _losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # four command-line runs, about a minute on 2 cores
def test_a_run_trained_on_8_devices_resumes_on_1_and_on_2_as_the_uninterrupted_run(tmp_path):
    """The newcomer's commands: `--cpu-devices 8 mesh.inter=2`, then `--resume` with no mesh
    setting on 1 device (the saved mesh does not fit: the note, then the defaults) and on 2 (2 x 1
    fits: kept, no note); each continuation's losses are the uninterrupted 8-device run's."""
    import shutil

    args = [*TINY, *QUICK, "cms.periods=[1,2]", "checkpoint.every=2", "eval.every=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    cli("nljax.train", "--cpu-devices", "8", "mesh.inter=2", *args, "train.steps=6", f"run.dir={ref}")
    cli("nljax.train", "--cpu-devices", "8", "mesh.inter=2", *args, "train.steps=4", f"run.dir={run}")
    shutil.copytree(run, tmp_path / "run2")
    one = cli("nljax.train", "--cpu-devices", "1", "--resume", f"run.dir={run}", "train.steps=6")
    assert (f"nljax: resuming on 1 device: mesh.inter=2 from {run}/config.yaml does not fit, using mesh.inter=-1 "
            "(set mesh.* to choose)") in one.stderr.splitlines(), one.stderr
    two = cli("nljax.train", "--cpu-devices", "2", "--resume", f"run.dir={tmp_path / 'run2'}", "train.steps=6")
    assert "resuming on" not in two.stderr and "mesh inter=2 x intra=1" in two.stdout, two.stdout + two.stderr
    for resumed in (run, tmp_path / "run2"):
        np.testing.assert_allclose(_losses(resumed), _losses(ref), rtol=1e-5)
