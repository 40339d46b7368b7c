"""Checkpoints: bitwise resume on the same mesh, elastic resume 8 -> 4 -> 2 devices, a changed
global batch, SIGKILL during training and during a save, and bad checkpoints.

One reference run (the nested-learning LM with memory, 8 devices, error buffers in use) is
trained once per module and saved along the way; the other tests restore its checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import TINY, Setup, assert_trees_close, make, save
from nljax import config
from nljax.checkpoint import contents, elastic, storage
from nljax.checkpoint.lifecycle import Checkpoints
from nljax.checkpoint.restore import restore
from nljax.rundir import checkpoint_dir
from nljax.conductor import pulse
from nljax.state import TrainState
from nljax.hostdev import mean_loss

# Attention + neural memory (per-row state) + two CMS levels, small enough to compile quickly.
NL = ["model.name=nl_lm", "model.heads=2", "model.nl_lm.window=8", "model.nl_lm.memory_layers=[0]", "model.nl_lm.memory_heads=2",
      "model.nl_lm.memory_dim=8", "model.nl_lm.memory_hidden=8", "model.nl_lm.memory_chunk=4", "cms.periods=[1,4]",
      "model.nl_lm.memory_kind=mlp"]
STEPS = 5
TINY_NL_ARGS = [*TINY, *NL, "mesh.inter=2", "mesh.intra=4", "train.steps=6", "eval.every=0", "eval.batches=1"]


def steps(setup: Setup, state: TrainState, start: int, stop: int):
    """Train steps [start, stop) from `state` (donated); returns (losses, state)."""
    losses = []
    for s in range(start, stop):
        p = pulse(s, setup.cfg.cms.periods)
        state, m, _ = setup.cache.train(p.active, state, setup.batch(s))
        losses.append(mean_loss(m))
    return losses, state


def host(tree):
    return jax.tree.map(np.asarray, tree)


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """8 devices (2 x 4), steps 0..5 uninterrupted, checkpoints saved after steps 2 and 4."""
    d = tmp_path_factory.mktemp("ref")
    setup = make([*NL, f"checkpoint.dir={d}"], 2, 4)
    state = setup.state
    l1, state = steps(setup, state, 0, 2)
    save(setup, state, 2)
    l2, state = steps(setup, state, 2, 4)
    save(setup, state, 4)
    l3, state = steps(setup, state, 4, STEPS)
    setup.state = state
    return {"setup": setup, "losses": l1 + l2 + l3, "final": host(state), "dir": d}


def test_resume_on_the_same_mesh_is_bitwise(ref):
    setup = ref["setup"]
    r = restore(setup.engine, setup.state, ref["dir"] / "2")
    assert r.step == 2 and not r.fresh_rows and r.warnings == []
    errs = [e for e in r.state.err_buf if e is not None]
    assert errs and any(np.abs(np.asarray(e)).sum() > 0 for e in errs)  # a frozen level's buffer is in use
    losses, state = steps(setup, r.state, 2, STEPS)
    assert losses == ref["losses"][2:]  # bitwise
    for a, b in zip(jax.tree.leaves(host(state)), jax.tree.leaves(ref["final"])):
        np.testing.assert_array_equal(a, b)
    setup.state = state


def test_plain_orbax_reads_a_checkpoint(ref):
    import orbax.checkpoint as ocp

    m = ocp.CheckpointManager(ref["dir"], options=ocp.CheckpointManagerOptions(read_only=True))
    assert m.all_steps() == [2, 4]
    out = m.restore(4)
    assert out["nljax"]["step"] == 4 and out["nljax"]["mesh"]["devices"] == 8
    assert out["nljax"]["conductor"] == {"step": 4, "periods": [1, 4]}
    memory = out["state"]["memory"]["block0"]["M"]["W1"]
    assert memory.shape[0] == 8 and len(memory.sharding.device_set) == 8  # rows sharded as trained


def test_plain_orbax_restores_onto_another_topology(tmp_path):
    """The README's recipe: a checkpoint saved on a 4-device mesh, read with plain Orbax onto 2
    other devices with shardings of the reader's choosing (array metadata, then StandardRestore)."""
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    setup = make([f"checkpoint.dir={tmp_path}"], 1, 4)
    save(setup, setup.state, 3)
    saved = {k: np.asarray(x) for k, x in contents.named_arrays(setup.state).items()}

    # --- the recipe (README, "Checkpoints and resume") ---
    mesh = Mesh(np.array(jax.devices()[4:6]), ("x",))  # devices the checkpoint was not saved on
    meta = ocp.StandardCheckpointer().metadata(tmp_path / "3" / "state").item_metadata

    def target(m):  # split the first axis where it divides, else replicate
        spec = P("x") if m.shape and m.shape[0] % 2 == 0 else P()
        return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, spec))

    with ocp.CheckpointManager(tmp_path) as mngr:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(jax.tree.map(target, meta)))
        state = mngr.restore(3, args=args)["state"]
    # ---

    restored = contents.unnest(state)
    assert set(restored) == set(saved)
    for k, x in restored.items():
        assert x.sharding.device_set == set(jax.devices()[4:6]), k
        np.testing.assert_array_equal(np.asarray(x), saved[k])
    assert any(x.sharding.spec == P("x") for x in restored.values())


def test_elastic_resume_8_4_2_devices(ref, tmp_path):
    """Steps 0-1 on 8 devices, 2-3 on 4, 4 on 2, restoring with each mesh's shardings: the
    losses, parameters and every row's memory match the uninterrupted 8-device run. Level 1
    (period 4) has gradients in its error buffers at both restores and fires at step 4."""
    s4 = make([*NL, f"checkpoint.dir={tmp_path}/1x4"], 1, 4)
    r = restore(s4.engine, s4.state, ref["dir"] / "2")
    assert r.state.err_buf[1].shape == (4, r.state.err_buf[1].shape[1])
    l4, state = steps(s4, r.state, 2, 4)
    save(s4, state, 4)
    s2 = make(NL, 1, 2)
    r = restore(s2.engine, s2.state, tmp_path / "1x4" / "4")
    assert r.state.memory["block0"]["M"]["W1"].sharding == s2.state.memory["block0"]["M"]["W1"].sharding
    l2, state = steps(s2, r.state, 4, STEPS)
    np.testing.assert_allclose(l4 + l2, ref["losses"][2:], rtol=2e-5)
    final = host(state)
    assert_trees_close(final.params, ref["final"].params, rtol=1e-4, atol=1e-6)
    assert_trees_close(final.memory, ref["final"].memory, rtol=1e-4, atol=1e-5)


def test_elastic_resume_across_strategies(ref, tmp_path):
    """replicated on 8 devices -> zero1 on 4 (2 x 2) -> fsdp on 2 (1 x 2): each restore converts
    parameters and optimizer state through the canonical layout; the continuation matches the
    uninterrupted replicated run (losses, parameters, every row's memory)."""
    z = make([*NL, "sync.strategy=zero1", f"checkpoint.dir={tmp_path}/zero1"], 2, 2)
    r = restore(z.engine, z.state, ref["dir"] / "2")
    mu = jax.tree.leaves(r.state.opt_state[0])[1]  # Adam's first moment of level 0: a flat intra shard
    assert mu.ndim == 1 and mu.sharding.shard_shape(mu.shape)[0] == mu.shape[0] // 2
    lz, state = steps(z, r.state, 2, 4)
    save(z, state, 4)
    f = make([*NL, "sync.strategy=fsdp"], 1, 2)
    r = restore(f.engine, f.state, tmp_path / "zero1" / "4")
    lf, state = steps(f, r.state, 4, STEPS)
    np.testing.assert_allclose(lz + lf, ref["losses"][2:], rtol=2e-5)
    assert_trees_close(host(f.engine.strategy.gather_params(state.params)), ref["final"].params, rtol=1e-4, atol=1e-6)
    assert_trees_close(host(state.memory), ref["final"].memory, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_from_before_the_model_split_restores(ref, tmp_path):
    """A checkpoint written before `model.nl_lm.*` / `model.dit.*` saved flat model keys
    (`model.window`, ...): it restores as if saved today, with no warning and the same state, and
    onto another strategy (which builds an engine from the saved config, `config.from_dict`)."""
    shutil.copytree(ref["dir"], tmp_path / "ckpt")
    meta = tmp_path / "ckpt" / "2" / "nljax" / "metadata"
    m = json.loads(meta.read_text())
    model = m["config"]["model"]
    model.update(model.pop("nl_lm"), patch_size=model.pop("dit")["patch_size"])
    meta.write_text(json.dumps(m))
    assert json.loads(meta.read_text())["config"]["model"]["window"] == 8
    setup = ref["setup"]
    r = restore(setup.engine, setup.state, tmp_path / "ckpt" / "2")
    assert r.step == 2 and r.warnings == []
    same = restore(setup.engine, setup.state, ref["dir"] / "2").state
    for a, b in zip(jax.tree.leaves(host(r.state)), jax.tree.leaves(host(same))):
        np.testing.assert_array_equal(a, b)
    z = make([*NL, "sync.strategy=zero1"], 2, 2)
    r = restore(z.engine, z.state, tmp_path / "ckpt" / "2")
    assert r.step == 2 and r.warnings == ["resuming with sync.strategy='zero1' (checkpoint: 'replicated')"]


def test_error_buffers_are_redistributed_so_the_reduction_is_unchanged():
    from nljax import mesh as meshlib

    e = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    for n_new in (4, 2, 1):
        sh = meshlib.rows_sharding(meshlib.make_mesh(1, n_new, jax.devices()[:n_new]))
        mean = np.asarray(elastic.redistribute_err_buf(e, 8, n_new, True, sh))
        total = np.asarray(elastic.redistribute_err_buf(e, 8, n_new, False, sh))
        assert mean.shape == (n_new, 5)
        np.testing.assert_allclose(mean.sum(0) / n_new, e.sum(0) / 8, rtol=1e-5)  # sync.mean
        np.testing.assert_allclose(total.sum(0), e.sum(0), rtol=1e-5)  # sums
        assert (mean == mean[0]).all()


def test_changed_global_batch_restarts_every_row(ref):
    setup = make([*NL, "train.batch_size=16", "optim.lr=0.02"], 2, 4)
    r = restore(setup.engine, setup.state, ref["dir"] / "4")
    assert r.fresh_rows and any("train.batch_size changed from 8 to 16" in w for w in r.warnings)
    assert any("optim.lr=0.02" in w for w in r.warnings)
    for x in jax.tree.leaves(r.state.memory):
        assert x.shape[0] == 16 and not np.asarray(x).any()
    same = restore(ref["setup"].engine, ref["setup"].state, ref["dir"] / "4").state
    for a, b in zip(jax.tree.leaves(r.state.params), jax.tree.leaves(same.params)):
        np.testing.assert_array_equal(a, b)
    batch = setup.batch(5)
    assert not np.asarray(batch["reset"]).all()
    reset = setup.batch(5, reset_all=True)  # the first batch after this resume
    assert np.asarray(reset["reset"]).all() and reset["reset"].sharding == batch["reset"].sharding


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: one line, exit 2, nothing on disk changed


def _data_files(step_dir: Path) -> list[Path]:
    # every data file: an OCDBT store may keep data that no array reads any more, whose damage
    # rightly goes unnoticed
    files = [f for f in (step_dir / "state").rglob("d/*") if f.is_file()]
    assert files
    return files


def _truncate(step_dir: Path):
    for f in _data_files(step_dir):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(step_dir: Path):
    for f in _data_files(step_dir):
        b = bytearray(f.read_bytes())
        mid = len(b) // 2
        b[mid : mid + 64] = bytes(x ^ 0xFF for x in b[mid : mid + 64])
        f.write_bytes(bytes(b))


def _bad_meta(step_dir: Path):
    (step_dir / "nljax" / "metadata").write_text('{"format": 1, "arrays": ')


def _foreign_meta(step_dir: Path):
    meta = step_dir / "nljax" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "arrays": {"step": {"shape": [], "dtype": "int32"}}}))


def _other_model(step_dir: Path):
    meta = step_dir / "nljax" / "metadata"
    m = json.loads(meta.read_text())
    m["model"]["head/kernel"][0] = [16, 512]
    meta.write_text(json.dumps(m))


def _zero_devices(step_dir: Path):
    meta = step_dir / "nljax" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "mesh": {"inter": 2, "intra": 4, "devices": 0}}))


# case: (damage, overrides, message, through the command line (else the library call))
BAD = {
    "missing": (None, ["checkpoint.resume={d}/nowhere"], "checkpoint not found: {d}/nowhere", True),
    "empty": (None, ["checkpoint.resume={d}/empty"], "no complete checkpoint in {d}/empty", False),
    # named explicitly: `--resume` would fall back to step 2 (test_resume_falls_back_...)
    "truncated": (_truncate, ["checkpoint.resume={d}/ckpt/4"], "checkpoint {d}/ckpt/4: array data unreadable", True),
    "flipped": (_flip, [], "checkpoint {d}/ckpt/4:", False),
    "metadata": (_bad_meta, [], "checkpoint {d}/ckpt/4: metadata unreadable", False),
    "foreign": (_foreign_meta, [], "checkpoint {d}/ckpt/4: metadata is not an nljax checkpoint of format 1", False),
    "devices": (_zero_devices, [], "checkpoint {d}/ckpt/4: metadata is not an nljax checkpoint of format 1", False),
    "fingerprint": (_other_model, [], "checkpoint {d}/ckpt/4 is from another model: parameter 'head/kernel' is "
                    "float32(16, 512) there, float32(16, 256) here", False),
    "model": (None, ["model.dim=32"], "checkpoint {d}/ckpt/4 does not fit this run: model.dim=16 there, 32 here", True),
    "periods": (None, ["cms.periods=[1,8]"], "checkpoint {d}/ckpt/4 does not fit this run: cms.periods=[1, 4] "
                "there, [1, 8] here", True),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_one_line_and_changes_nothing(ref, tmp_path, capfd, case):
    """Through `nljax.train` (one line on stderr, exit 2) or, where the run would be the same,
    through the library calls it makes (one-line ConfigError); the directory is unchanged."""
    from nljax import train

    damage, extra, message, through_cli = BAD[case]
    shutil.copytree(ref["dir"], tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    if damage:
        damage(tmp_path / "ckpt" / "4")
    before = tree_hash(tmp_path)
    args = [*TINY_NL_ARGS, f"run.dir={run}", f"checkpoint.dir={tmp_path}/ckpt", *[a.format(d=tmp_path) for a in extra]]
    message = message.format(d=tmp_path)
    if through_cli:
        capfd.readouterr()
        assert train.main(["--resume", *args]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nljax.train: error: ") and message in err[0], err
    else:
        cfg = config.load(None, [*args, "checkpoint.resume=latest"] if "checkpoint.resume" not in str(extra) else args)
        with pytest.raises(config.ConfigError) as e:
            restore(ref["setup"].engine, ref["setup"].state, storage.candidates(cfg)[0])
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree_hash(tmp_path) == before


def test_fresh_run_does_not_replace_checkpoints(ref, tmp_path, capfd):
    from nljax import train

    shutil.copytree(ref["dir"], tmp_path / "ckpt")
    before = tree_hash(tmp_path)
    capfd.readouterr()
    assert train.main([*TINY_NL_ARGS, f"run.dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"]) == 2
    assert "already holds checkpoints" in capfd.readouterr().err
    assert tree_hash(tmp_path) == before
    # run.overwrite=true: the earlier run's checkpoints go when the new run starts writing
    cfg = config.load(None, [*TINY_NL_ARGS, f"checkpoint.dir={tmp_path}/ckpt", "run.overwrite=true"])
    c = Checkpoints.resolve(dataclasses.replace(ref["setup"].engine, cfg=cfg), ref["setup"].state)
    assert sorted(q.name for q in (tmp_path / "ckpt").iterdir()) == ["2", "4"]
    c.open()
    assert not any((tmp_path / "ckpt").iterdir())
    c.close()


# ---------------------------------------------------------------------------------------------
# The command line, killed with SIGKILL


SMALL = ["model.name=cms_mlp", "model.dim=16", "model.depth=1", "train.batch_size=8", "train.seq_len=16",
         "cms.periods=[1,2]", "eval.batches=1", "eval.every=0", "optim.warmup_steps=0", "train.steps=12",
         "checkpoint.every=4", "checkpoint.keep=2"]

# Runs nljax.train and SIGKILLs itself: `save N` inside the save of step N, after every array is
# written and before Orbax commits it; `step N` once step N-1 is logged and checkpoint N-2 is
# complete; `kill N` once step N-1 is logged. `term N` sends itself SIGTERM instead.
KILLER = r"""
import os, signal, sys, time
from pathlib import Path
mode, at, ckdir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
sys.argv = ["nljax.train", *sys.argv[4:]]
if mode == "save":
    from orbax.checkpoint._src.path import atomicity
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        def patch(orig):
            async def finalize(self, *a, **k):
                if Path(self.get_final()).name == str(at):
                    os.kill(os.getpid(), signal.SIGKILL)
                return await orig(self, *a, **k)
            return finalize
        cls.finalize = patch(cls.finalize)
else:
    from nljax import rundir
    log = rundir.RunDir.log
    def killing_log(self, record):
        log(self, record)
        if record["step"] == at - 1:  # steps 0 .. at-1 are logged; step `at` never runs
            if mode == "term":  # a preemption notice: the run saves checkpoint `at` and exits
                os.kill(os.getpid(), signal.SIGTERM)
                return
            t = time.time()
            while mode == "step" and not (ckdir / str(at - 2)).is_dir() and time.time() - t < 60:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)  # mode "kill": wherever the saves in flight are
    rundir.RunDir.log = killing_log
from nljax.train import main
sys.exit(main())
"""


def cli(*args, killer=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", KILLER, *killer] if killer else [sys.executable, "-m", "nljax.train"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=600)


def losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_during_a_save_and_during_training_then_resume(tmp_path):
    """Killed while committing checkpoint 8 (4 is complete), resumed from 4, killed again at step
    10 (8 complete), resumed from 8. Each resumed run logs the losses the run before it logged
    for the same steps, bitwise, and the final metrics.jsonl has every step once."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "2", "--quiet", *SMALL, f"run.dir={run}"]
    p = cli(*base, killer=["save", "8", str(ck)])
    assert p.returncode == -9, p.stderr
    assert (ck / "4").is_dir() and not (ck / "8").exists()
    assert any(q.name.startswith("8.") for q in ck.iterdir())  # the partial save is left behind
    first = losses(run)  # steps 0..7 at least, uninterrupted
    p = cli("--resume", *base, killer=["step", "10", str(ck)])
    assert p.returncode == -9, p.stderr
    assert sorted(int(q.name) for q in ck.iterdir() if q.name.isdigit()) == [4, 8]
    second = losses(run)  # 0..3 from the first run, 4..9 resumed from 4
    assert len(second) == 10 and second[:8] == first[:8]
    p = cli("--resume", *base[:2], *base[3:])
    assert p.returncode == 0, p.stderr
    assert f"resumed from {ck / '8'} at step 8" in p.stdout
    steps_logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(12)) and losses(run)[:10] == second
    assert sorted(q.name for q in ck.iterdir()) == ["12", "8"]  # checkpoint.keep=2
    _truncate(ck / "12")  # a damaged array file, named: one line on the real stderr, nothing changed
    before = tree_hash(run)
    p = cli(*base, f"checkpoint.resume={ck / '12'}")
    assert p.returncode == 2 and p.stderr.strip().startswith(f"nljax.train: error: checkpoint {ck / '12'}: array data")
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert tree_hash(run) == before


def test_preemption_and_kills_at_random_steps_resume_exactly(tmp_path):
    """Fault injection: SIGTERM (a preemption notice), SIGKILL, SIGTERM at seeded random steps,
    each followed by --resume. A notice saves at the next step boundary and exits 143 with one
    line; a kill loses what is not yet committed. The final metrics.jsonl equals an uninterrupted
    run's: the same steps once each, the same losses bitwise."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    ck = run / "checkpoints"
    assert cli("--cpu-devices", "2", "--quiet", *SMALL, f"run.dir={ref}").returncode == 0
    base = ["--cpu-devices", "2", "--quiet", *SMALL, f"run.dir={run}"]
    rng = random.Random(1)
    t1 = rng.randint(1, 5)
    t2 = rng.randint(t1 + 2, 9)
    t3 = rng.randint(t2 + 1, 11)
    p = cli(*base, killer=["term", str(t1), str(ck)])
    assert p.returncode == 143, p.stderr
    assert p.stderr.strip() == f"nljax.train: preempted (SIGTERM): stopped after step {t1 - 1}, checkpoint saved; continue with --resume"
    assert (ck / str(t1)).is_dir()
    p = cli("--resume", *base, killer=["kill", str(t2), str(ck)])
    assert p.returncode == -9, p.stderr
    p = cli("--resume", *base, killer=["term", str(t3), str(ck)])
    assert p.returncode == 143 and (ck / str(t3)).is_dir(), p.stderr
    p = cli("--resume", *base)
    assert p.returncode == 0, p.stderr
    steps_logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(12)), (t1, t2, t3)
    assert losses(run) == losses(ref), (t1, t2, t3)


# ---------------------------------------------------------------------------------------------
# Nothing a user did not ask to replace is taken over or removed


def test_run_dir_removes_outputs_only_when_overwriting(tmp_path):
    from nljax import runlog
    from nljax.rundir import RunDir

    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "notes.txt").write_text("mine")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "samples_000001.png").write_text("a user's file")  # the pattern of a run's samples
    (tmp_path / "samples_000002.png").write_text("the run's")
    runlog.note_written(tmp_path, "samples_000002.png")
    RunDir(str(tmp_path), overwrite=False, write=True)  # no metrics.jsonl: a fresh run, nothing removed
    assert (tmp_path / "profile" / "notes.txt").exists() and (tmp_path / "summary.json").exists()
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert not (tmp_path / "profile").exists() and not (tmp_path / "summary.json").exists()
    assert not (tmp_path / "samples_000002.png").exists() and (tmp_path / "samples_000001.png").exists()


def test_only_orbax_steps_count_as_checkpoints(ref, tmp_path):
    (tmp_path / "2024").mkdir()  # a user's folder with a numeric name
    (tmp_path / "notes").mkdir()
    (tmp_path / "7.orbax-checkpoint-tmp").mkdir()  # a save cut short
    shutil.copytree(ref["dir"] / "2", tmp_path / "2")
    assert sorted(p.name for p in storage.leftovers(tmp_path)) == ["2", "7.orbax-checkpoint-tmp"]


def test_another_runs_checkpoint_does_not_take_over_this_runs_files(ref, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(ref["dir"] / "2", d / "2")  # this run.dir's own earlier checkpoint
    before = tree_hash(d)
    setup = make([*NL, f"checkpoint.dir={d}", f"checkpoint.resume={ref['dir'] / '4'}"], 2, 4)
    with pytest.raises(config.ConfigError, match="already holds another run's checkpoints"):
        Checkpoints.resolve(setup.engine, setup.state, say=lambda *a: None)
    assert tree_hash(d) == before
    # with run.overwrite=true it starts a new run from that state: not a continuation of this one
    setup = make([*NL, f"checkpoint.dir={d}", f"checkpoint.resume={ref['dir'] / '4'}", "run.overwrite=true",
                  "checkpoint.every=0"], 2, 4)
    c = Checkpoints.resolve(setup.engine, setup.state, say=lambda *a: None)
    assert c.start == 4 and c.resume_step is None
    c.open()  # run.overwrite removes the earlier checkpoints even though this run saves none
    assert storage.leftovers(d) == []


def test_relative_run_dir_saves(ref, tmp_path, monkeypatch):
    # The default run.dir is relative; Orbax's writer only takes absolute paths.
    monkeypatch.chdir(tmp_path)
    setup = ref["setup"]
    cfg = dataclasses.replace(setup.cfg, run=dataclasses.replace(setup.cfg.run, dir="runs/rel"),
                              checkpoint=dataclasses.replace(setup.cfg.checkpoint, dir=""))
    assert checkpoint_dir(cfg).is_absolute()
    m = storage.writer(cfg)
    storage.save(m, dataclasses.replace(setup.engine, cfg=cfg), 5, setup.state)
    m.wait_until_finished()
    m.close()
    assert storage.complete_steps(tmp_path / "runs" / "rel" / "checkpoints") == [5]


QUICK = ["throughput.reps=1", "throughput.split=false", "run.plots=false", "run.trackers=[]"]


def test_pruning_and_resume_skip_folders_nljax_did_not_write(tmp_path):
    """checkpoint.keep prunes only nljax's own steps, and --resume never picks a user's folder
    with a number for a name (Orbax's max_to_keep deleted them; '7' became 'latest')."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for name in ("0", "7"):
        (ck / name).mkdir(parents=True)
        (ck / name / "notes").write_text("mine")
    base = ["--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={run}", "checkpoint.every=2",
            "checkpoint.keep=1", "checkpoint.async_save=false"]
    p = cli(*base, "train.steps=4")
    assert p.returncode == 0, p.stderr
    assert sorted(q.name for q in ck.iterdir()) == ["0", "4", "7"]
    assert storage.complete_steps(ck) == [4]
    p = cli("--resume", *base[:2], *base[3:], "train.steps=6")
    assert p.returncode == 0, p.stderr
    assert f"resumed from {ck / '4'} at step 4" in p.stdout
    assert sorted(q.name for q in ck.iterdir()) == ["0", "6", "7"]
    assert (ck / "0" / "notes").read_text() == (ck / "7" / "notes").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# A damaged newest checkpoint, an older one named, a full disk


def test_resume_falls_back_past_a_damaged_checkpoint_and_sets_later_ones_aside(tmp_path):
    """`--resume` with the newest checkpoint damaged resumes from the newest intact one, with a
    warning naming the damaged one, which is moved to checkpoints/set_aside/ (not deleted). An
    older checkpoint named explicitly is resumed too: the later ones are set aside the same way."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={run}", "checkpoint.keep=3"]
    p = cli(*base)
    assert p.returncode == 0, p.stderr
    assert storage.complete_steps(ck) == [4, 8, 12]
    _truncate(ck / "12")
    damaged = tree_hash(ck / "12")
    p = cli("--resume", *base)
    assert p.returncode == 0, p.stderr
    assert f"nljax: warning: checkpoint {ck / '12'} is damaged, resuming from an older one (array data unreadable" \
        in p.stderr, p.stderr
    assert f"step 12 will be moved to {ck / 'set_aside'}" in p.stderr
    assert "Traceback" not in p.stderr
    assert tree_hash(ck / "set_aside" / "12") == damaged  # kept as it was
    assert storage.complete_steps(ck) == [4, 8, 12]  # 12 saved again by the resumed run
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == list(range(12))
    # An explicit older checkpoint: 8 and 12 are set aside (12 beside the damaged one), not refused.
    p = cli(*base, f"checkpoint.resume={ck / '4'}")
    assert p.returncode == 0, p.stderr
    assert f"steps 8, 12 will be moved to {ck / 'set_aside'}" in p.stderr
    assert sorted(q.name for q in (ck / "set_aside").iterdir()) == ["12", "12.1", "8"]
    assert storage.complete_steps(ck) == [4, 8, 12]
    assert tree_hash(ck / "set_aside" / "12") == damaged


def test_resume_with_every_checkpoint_damaged_is_one_line(tmp_path):
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    base = ["--cpu-devices", "1", "--quiet", *SMALL, *QUICK, f"run.dir={run}", "train.steps=8"]
    assert cli(*base).returncode == 0
    for s in (4, 8):
        _truncate(ck / str(s))
    before = tree_hash(run)
    p = cli("--resume", *base)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"nljax.train: error: every checkpoint in {ck} is damaged; the oldest: checkpoint "
                               f"{ck / '4'}: array data unreadable"), p.stderr
    assert tree_hash(run) == before


# Runs nljax.train with the file-size limit lowered (as a full disk would stop writes) once
# checkpoint 4 is complete and step 5 is logged: the save of step 8 fails inside TensorStore.
FULL = r"""
import resource, signal, sys, time
from pathlib import Path
ckdir, limit = Path(sys.argv[1]), int(sys.argv[2])
sys.argv = ["nljax.train", *sys.argv[3:]]
from nljax import rundir
log = rundir.RunDir.log
def limiting_log(self, record):
    log(self, record)
    if record["step"] == 5:
        t = time.time()
        while str(ckdir) != "-" and not (ckdir / "4").is_dir() and time.time() - t < 60:
            time.sleep(0.05)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
rundir.RunDir.log = limiting_log
from nljax.train import main
sys.exit(main())
"""


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_failed_write_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, async_save):
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    # 6000 bytes: metrics.jsonl (about 300 bytes a step) fits, a checkpoint's files do not
    p = subprocess.run([sys.executable, "-c", FULL, str(ck), "6000", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK,
                        f"run.dir={run}", f"checkpoint.async_save={str(async_save).lower()}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"nljax.train: error: checkpoint {ck / '8'} could not be saved (OSError: [Errno 27] "
                                f"File too large); the newest complete checkpoint is {ck / '4'}"), p.stderr
    assert storage.complete_steps(ck) == [4]
    assert sorted(q.name for q in ck.iterdir() if not q.name.startswith("8.")) == ["4"]
    p = cli("--resume", "--cpu-devices", "1", *SMALL, *QUICK, f"run.dir={run}")  # once there is room again
    assert p.returncode == 0 and f"resumed from {ck / '4'} at step 4" in p.stdout, p.stderr
    assert storage.complete_steps(ck) == [8, 12]


def test_failed_write_of_the_run_files_is_one_line(tmp_path):
    """The same limit hit by metrics.jsonl (no checkpoints): one line naming the file."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", FULL, "-", "1000", "--cpu-devices", "1", "--quiet", *SMALL, *QUICK,
                        f"run.dir={run}", "checkpoint.every=0"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == f"nljax.train: error: cannot write {run / 'metrics.jsonl'}: [Errno 27] File too large"


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm and tmpfs in a user namespace")
def test_disk_full_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path):
    """A real full disk: checkpoint.dir on a 400 KiB tmpfs holds checkpoint 4 (272 KiB), not 8."""
    run, ck = tmp_path / "run", tmp_path / "ck"
    ck.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    train = " ".join(f"'{a}'" for a in [sys.executable, "-m", "nljax.train", "--cpu-devices", "1", "--quiet",
                                       *SMALL, *QUICK, f"run.dir={run}", f"checkpoint.dir={ck}"])
    script = f"mount -t tmpfs -o size=400k tmpfs '{ck}' && {train}; rc=$?; ls '{ck}' > '{tmp_path}/ls'; exit $rc"
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"nljax.train: error: checkpoint {ck / '8'} could not be saved (OSError: [Errno 28] "
                                f"No space left on device); the newest complete checkpoint is {ck / '4'}"), p.stderr
    assert (tmp_path / "ls").read_text().split() == ["4", "8.orbax-checkpoint-tmp"]


def test_unawaited_writes_of_a_failed_save_are_hidden_only_inside_the_scope():
    """A failed save can leave writes it never started; their 'never awaited' warnings arrive when
    they are collected, which CI once saw as a second line beside the error."""
    import gc
    import warnings
    from nljax.checkpoint.quiet import errors_hidden

    async def write_fragment():
        pass

    def collect_one():
        write_fragment()  # a coroutine created and dropped unawaited
        gc.collect()

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with errors_hidden():
            collect_one()
        assert shown == []
        collect_one()
        assert [str(w.message) for w in shown] == [f"coroutine '{write_fragment.__qualname__}' was never awaited"]
