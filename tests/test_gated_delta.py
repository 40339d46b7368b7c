"""The second architecture, examples/gated_delta (a plugin written only against nljax's public
model API), under the engine: N devices == 1 device for every strategy (losses, parameters,
every row's memory), exact resume, generation, export -> load_model -> the same logits.

Nothing is installed: the fixture puts the example's source and a dist-info folder holding its
entry point (what `pip install -e examples/gated_delta` would write) on the path, in this process
and in the commands' subprocesses."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import QUICK, ROOT, TINY, assert_trees_close, make, run_python, train

import nljax
from nljax.models import registry, specs

EXAMPLE = ROOT / "examples" / "gated_delta"
GD = [*TINY, "model.name=gated_delta", "model.depth=2", "model.heads=2", "model.gated_delta.window=4",
      "model.gated_delta.memory_heads=2", "model.gated_delta.memory_dim=4", "cms.periods=[1,2]"]
STEPS = 4  # level 1 frozen at odd steps: its gradients wait in the error buffers


def entry_point_site(root: Path) -> Path:
    """The dist-info `pip install` writes for the example: its entry point in `nljax.models`."""
    text = (EXAMPLE / "pyproject.toml").read_text()
    line = next(l for l in text.splitlines() if l.startswith("gated_delta = "))  # the package's own entry point
    info = root / "nljax_gated_delta-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nljax-gated-delta\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[nljax.models]\n{line.replace(chr(34), '')}\n")
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = entry_point_site(tmp_path_factory.mktemp("site"))
    paths = [str(root), str(EXAMPLE / "src")]
    sys.path[:0] = paths
    registry.rediscover()
    yield f"{ROOT}:{root}:{EXAMPLE / 'src'}"  # PYTHONPATH of a command
    specs.unregister("gated_delta")
    registry._DONE.discard("plugins")
    for p in paths:
        sys.path.remove(p)


def test_the_example_is_a_plugin_that_nljax_never_imports(site):
    assert registry.spec("gated_delta").origin.startswith("plugin 'gated_delta = nljax_gated_delta:register'")
    assert not any("gated_delta" in p.read_text() for p in (ROOT / "nljax").rglob("*.py"))
    # written against the public API: nljax names it imports are nljax, nljax.errors, nljax.models.blocks
    src = (EXAMPLE / "src" / "nljax_gated_delta" / "model.py").read_text()
    used = {l.split()[1] for l in src.splitlines() if l.startswith("from nljax")}
    assert used == {"nljax.errors", "nljax.models.blocks"}


@pytest.fixture(scope="module")
def reference(site):
    setup = make(GD, 1, 1)
    losses, state = train(setup, STEPS)
    return losses, jax.device_get(state.params), jax.device_get(state.memory)


# the flat reduction on (1, 8) too, in the slow tier (.ci/run runs it after the suite)
MESHES = [(2, 4, "hierarchical"), pytest.param(1, 8, "flat", marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy", ["replicated", pytest.param("zero1", marks=pytest.mark.slow),
                                      pytest.param("fsdp", marks=pytest.mark.slow)])
@pytest.mark.parametrize("inter, intra, reduce", MESHES)
def test_matches_single_device_under_every_strategy(reference, strategy, inter, intra, reduce):
    ref_losses, ref_params, ref_memory = reference
    setup = make([*GD, f"sync.strategy={strategy}", f"sync.reduce={reduce}"], inter, intra)
    losses, state = train(setup, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(setup.engine.strategy.export_state(state).params, ref_params, rtol=1e-4, atol=2e-5)
    # every row's memory, gathered from the device that owns it, equals the reference's row
    assert_trees_close(state.memory, ref_memory, rtol=1e-4, atol=2e-5)
    s = np.asarray(state.memory["block1"]["S"])  # [rows, heads, dk, dv]
    assert s.shape == (8, 2, 4, 4) and np.abs(s).sum() > 0  # written, and carried out of the step


def _cli(site: str, module: str, *args: str):
    return run_python("-m", module, *args, env={"PYTHONPATH": site}, timeout=600)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow  # the longest end-to-end run (2-4 minutes); its N == 1 checks stay in the suite
def test_the_commands_train_resume_generate_and_export_it(site, tmp_path):
    """`python -m nljax.train model.name=gated_delta` on 2 devices with checkpoints after steps 2
    and 4; resumed from step 2: the same losses, bitwise; nljax.generate writes text after the
    prompt; nljax.export, then nljax.load_model: the trained state's logits."""
    run = tmp_path / "run"
    args = [*QUICK, *GD, "train.steps=4", "checkpoint.every=2", "eval.batches=1"]
    _cli(site, "nljax.train", "--cpu-devices", "2", *args, f"run.dir={run}")
    losses = _losses(run)
    assert len(losses) == 4
    shutil.copytree(run, tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "4")
    _cli(site, "nljax.train", "--cpu-devices", "2", "--resume", *args, f"run.dir={tmp_path / 'again'}")
    assert _losses(tmp_path / "again") == losses

    p = _cli(site, "nljax.generate", f"run.dir={run}", "prompt=def ", "max_new_tokens=12", "temperature=0")
    assert p.stdout.startswith("def ") and len(p.stdout.rstrip("\n").encode()) >= 4 + 1

    _cli(site, "nljax.export", f"run.dir={run}", f"out={tmp_path / 'export'}")
    model, params = nljax.load_model(tmp_path / "export")
    from nljax.run import trained

    t = trained.load(run, devices=jax.devices()[:1])
    batch = {"tokens": np.arange(2 * 9, dtype=np.int32).reshape(2, 9) % 256, "reset": np.ones(2, bool)}
    ours, mem = model.logits(params, model.init_memory(2), batch)
    theirs, _ = t.model.logits(jax.device_get(t.params), t.model.init_memory(2), batch)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert jax.tree.map(np.shape, mem) == {"block0": {"S": (2, 2, 4, 4)}, "block1": {"S": (2, 2, 4, 4)}}


@pytest.mark.slow
def test_tensor_parallel_splits_heads_and_their_state(site):
    """mesh 1 x 2 x 2 (two data slots, two tensor-parallel shards) under zero1: the 1-device
    run's losses, parameters and memory (SGD: Adam's normalised step can turn the split matmuls'
    ~1e-7 summation differences into larger ones, tests/test_tp.py); each memory head's state on
    the device that owns it."""
    setup = make([*GD, "sync.strategy=zero1", "optim.name=sgd"], 1, 2, 2)
    one = make([*GD, "optim.name=sgd"], 1, 1)
    l1, s1 = train(one, STEPS)
    ln, sn = train(setup, STEPS)
    np.testing.assert_allclose(ln, l1, rtol=2e-5)
    assert_trees_close(setup.engine.strategy.export_state(sn).params, s1.params, rtol=1e-4, atol=1e-5)
    assert_trees_close(sn.memory, s1.memory, rtol=1e-4, atol=1e-5)
    s = sn.memory["block0"]["S"]  # [rows, heads, dk, dv]: split over rows and heads
    assert s.sharding.shard_shape(s.shape)[:2] == (s.shape[0] // 2, s.shape[1] // 2)
