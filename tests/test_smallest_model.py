"""examples/smallest_model.py, the write-your-own-model guide's one-file model: under the engine
on 2 x 2 devices it equals one device (losses, parameters, every row's cache), its slow level is
level 1, and the file's commands train, resume exactly, generate and evaluate."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import jax
import numpy as np
import pytest
from helpers import QUICK, ROOT, TINY, assert_trees_close, make, run_python, train

from nljax.models import specs

EXAMPLE = ROOT / "examples" / "smallest_model.py"
ARGS = [*(a for a in TINY if not a.startswith("model.")), "model.name=smallest", "model.dim=16",
        "model.smallest.hidden=8", "cms.periods=[1,2]"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("smallest_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["smallest_model"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    import nljax

    nljax.register_model("smallest", module.build, settings=module.SmallestConfig, shared=("vocab_size", "dim"))
    yield module
    specs.unregister("smallest")
    del sys.modules["smallest_model"]


@pytest.mark.slow
def test_it_matches_one_device_on_a_2x2_mesh(example):
    ref = make(ARGS, 1, 1)
    model = example.Smallest(256, 16, 8, True)
    levels = {p: model.level_of(p) for p in ("cms1/up/kernel", "embed/embedding", "cache_gain")}
    assert levels == {"cms1/up/kernel": 1, "embed/embedding": 0, "cache_gain": 0}
    ref_losses, ref_state = train(ref, 4)
    setup = make([*ARGS, "sync.strategy=zero1"], 2, 2)
    losses, state = train(setup, 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(setup.engine.strategy.export_state(state).params, jax.device_get(ref_state.params),
                       rtol=1e-4, atol=2e-5)
    counts = np.asarray(state.memory["counts"])  # [rows, vocab]: each row's document so far
    assert counts.shape == (8, 256) and counts.sum() > 0
    assert_trees_close(state.memory, jax.device_get(ref_state.memory), rtol=1e-6, atol=0)


def _losses(run) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


@pytest.mark.slow
def test_its_commands_train_resume_generate_and_evaluate(tmp_path):
    run = tmp_path / "run"
    args = [*QUICK, *ARGS, "train.steps=4", "checkpoint.every=2", "eval.batches=1"]
    run_python(str(EXAMPLE), "train", "--cpu-devices", "2", *args, f"run.dir={run}")
    losses = _losses(run)
    assert len(losses) == 4
    shutil.copytree(run, tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "4")
    # a resume takes the run's own config.yaml: no model.name needed
    run_python(str(EXAMPLE), "train", "--cpu-devices", "2", "--resume", f"run.dir={tmp_path / 'again'}")
    assert _losses(tmp_path / "again") == losses
    p = run_python(str(EXAMPLE), "generate", f"run.dir={run}", "prompt=The ", "max_new_tokens=8", "temperature=0")
    assert p.stdout.startswith("The ") and len(p.stdout.rstrip("\n").encode()) > 4
    p = run_python(str(EXAMPLE), "evaluate", f"run.dir={run}")
    assert "eval_loss" in p.stdout, p.stdout


def test_its_command_line_gives_its_model_to_every_run(example):
    """`train` and `bench` give model.name=smallest to a new run, a resume and a --resume=auto start
    alike (without it that start trained nl_lm, bench measured it), cms.periods=[1,4] to a new run
    without --config only (a resume's own could be other: refused as changed; a file's would be
    overridden) and to --resume=auto (one line starts and continues a run: the same levels both
    times; without them its start trained [1,8,64,512]), and the line's own settings after them
    (they win)."""
    defaults = ["model.name=smallest", "cms.periods=[1,4]"]
    assert example.command_line(["run.dir=r"]) == ("train", [*defaults, "run.dir=r"])
    assert example.command_line(["train", "run.dir=r", "cms.periods=[1,2]"])[1][-1] == "cms.periods=[1,2]"
    assert example.command_line(["train", "--resume=auto", "run.dir=r"]) == ("train", [*defaults, "--resume=auto",
                                                                                      "run.dir=r"])
    for resume in ("--resume", "checkpoint.resume=latest"):
        assert example.command_line(["train", resume, "run.dir=r"]) == ("train", ["model.name=smallest", resume,
                                                                                  "run.dir=r"]), resume
    assert example.command_line(["train", "--config", "mine.yaml"]) == ("train", ["model.name=smallest", "--config",
                                                                                  "mine.yaml"])
    assert example.command_line(["generate", "run.dir=r"]) == ("generate", ["run.dir=r"])
    assert example.command_line(["bench", "--cpu-devices", "2"]) == ("bench", [*defaults, "--cpu-devices", "2"])
