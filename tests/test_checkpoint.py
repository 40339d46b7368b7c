"""Checkpoints: bitwise resume on the same mesh, elastic resume 8 -> 4 -> 2 devices and across
strategies, plain Orbax, a changed global batch, bad checkpoints, and files nljax may not take
over. (Through the command line, killed or short of disk: tests/test_checkpoint_cli.py.)

One reference run (the nested-learning LM with memory, 8 devices, error buffers in use) is
trained once per module and saved along the way; most tests here restore its checkpoints, which
is why they stay in one module of about 370 lines: split, each part would train it again."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (TINY, TINY_NL, assert_trees_close, assert_trees_equal, data_files, make, save, train, tree_hash,
                     truncate)

from nljax import config
from nljax.checkpoint import contents, elastic, storage
from nljax.checkpoint.lifecycle import Checkpoints
from nljax.checkpoint.restore import restore
from nljax.runtime.rundir import checkpoint_dir

# Attention + neural memory (per-row state), the MLP memory, and a level of period 4.
NL = [*TINY_NL, "cms.periods=[1,4]", "model.nl_lm.memory_kind=mlp"]
STEPS = 5
TINY_NL_ARGS = [*TINY, *NL, "mesh.inter=2", "mesh.intra=4", "train.steps=6", "eval.every=0", "eval.batches=1"]


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """8 devices (2 x 4), steps 0..5 uninterrupted, checkpoints saved after steps 2 and 4."""
    d = tmp_path_factory.mktemp("ref")
    setup = make([*NL, f"checkpoint.dir={d}"], 2, 4)
    l1, _ = train(setup, 2)
    save(setup, setup.state, 2)
    l2, _ = train(setup, range(2, 4))
    save(setup, setup.state, 4)
    l3, _ = train(setup, range(4, STEPS))
    return {"setup": setup, "losses": np.concatenate([l1, l2, l3]), "final": host(setup.state), "dir": d}


def test_resume_on_the_same_mesh_is_bitwise(ref):
    setup = ref["setup"]
    r = restore(setup.engine, setup.state, ref["dir"] / "2")
    assert r.step == 2 and not r.fresh_rows and r.warnings == []
    errs = [e for e in r.state.err_buf if e is not None]
    assert errs and any(np.abs(np.asarray(e)).sum() > 0 for e in errs)  # a frozen level's buffer is in use
    losses, state = train(setup, range(2, STEPS), state=r.state)
    np.testing.assert_array_equal(losses, ref["losses"][2:])  # bitwise
    assert_trees_equal(host(state), ref["final"])
    setup.state = state


def test_a_signal_while_a_checkpoint_is_read_is_not_its_damage(ref, monkeypatch):
    """A second SIGTERM (`Terminated`) raised while the newest checkpoint is read stops the
    restore; taken for the checkpoint's damage, it would skip it for an older one (and the run
    would set it aside)."""
    import orbax.checkpoint as ocp

    from nljax.checkpoint.restore import restore_first_valid
    from nljax.runtime.preemption import Terminated

    def terminated(*args, **kwargs):
        raise Terminated

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", terminated)
    setup = ref["setup"]
    with pytest.raises(Terminated):
        restore_first_valid(setup.engine, setup.state, [ref["dir"] / "4", ref["dir"] / "2"])


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
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

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
    l4, state = train(s4, range(2, 4), state=r.state)
    save(s4, state, 4)
    s2 = make(NL, 1, 2)
    r = restore(s2.engine, s2.state, tmp_path / "1x4" / "4")
    assert r.state.memory["block0"]["M"]["W1"].sharding == s2.state.memory["block0"]["M"]["W1"].sharding
    l2, state = train(s2, range(4, STEPS), state=r.state)
    np.testing.assert_allclose(np.concatenate([l4, l2]), ref["losses"][2:], rtol=2e-5)
    final = host(state)
    assert_trees_close(final.params, ref["final"].params, rtol=1e-4, atol=1e-6)
    assert_trees_close(final.memory, ref["final"].memory, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_elastic_resume_across_strategies(ref, tmp_path):
    """replicated on 8 devices -> zero1 on 4 (2 x 2) -> fsdp on 2 (1 x 2): each restore converts
    parameters and optimizer state through the canonical layout; the continuation matches the
    uninterrupted replicated run (losses, parameters, every row's memory)."""
    z = make([*NL, "sync.strategy=zero1", f"checkpoint.dir={tmp_path}/zero1"], 2, 2)
    r = restore(z.engine, z.state, ref["dir"] / "2")
    mu = jax.tree.leaves(r.state.opt_state[0])[1]  # Adam's first moment of level 0: a flat intra shard
    assert mu.ndim == 1 and mu.sharding.shard_shape(mu.shape)[0] == mu.shape[0] // 2
    lz, state = train(z, range(2, 4), state=r.state)
    save(z, state, 4)
    finish_on_fsdp(ref, tmp_path / "zero1" / "4", lz, atol=1e-6)


def finish_on_fsdp(ref, checkpoint: Path, losses_2_3, atol: float) -> None:
    """Restore `checkpoint` (step 4) onto fsdp on 2 devices (1 x 2), train the last step, and
    compare steps 2.. with the uninterrupted run: losses, parameters, every row's memory."""
    f = make([*NL, "sync.strategy=fsdp"], 1, 2)
    r = restore(f.engine, f.state, checkpoint)
    lf, state = train(f, range(4, STEPS), state=r.state)
    np.testing.assert_allclose(np.concatenate([losses_2_3, lf]), ref["losses"][2:], rtol=2e-5)
    assert_trees_close(host(f.engine.strategy.gather_params(state.params)), ref["final"].params, rtol=1e-4, atol=atol)
    assert_trees_close(host(state.memory), ref["final"].memory, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_from_before_the_model_split_restores(tmp_path):
    """A checkpoint written before `model.nl_lm.*` / `model.dit.*` saved flat model keys
    (`model.window`, ...), and none of the keys added since (`model.nl_lm.scan_layers`,
    `memory_embed`; its memory read the stream only): it restores as if saved today, with no
    warning and the same state, and onto another strategy (which builds an engine from the
    saved config, `config.from_dict`)."""
    then = [*NL, "model.nl_lm.memory_embed=false", "model.nl_lm.memory_impl=scan", "model.nl_lm.attention=blocked",
            "model.nl_lm.embed_grad=scatter"]  # what the code computed then
    setup = make([*then, f"checkpoint.dir={tmp_path / 'ref'}"], 2, 4)
    train(setup, 2)
    save(setup, setup.state, 2)
    shutil.copytree(tmp_path / "ref", tmp_path / "ckpt")
    meta = tmp_path / "ckpt" / "2" / "nljax" / "metadata"
    m = json.loads(meta.read_text())
    model = m["config"]["model"]
    for key in ("scan_layers", "memory_embed", "memory_impl", "attention", "embed_grad", "loss_chunk"):  # added since
        del model["nl_lm"][key]
    model.update(model.pop("nl_lm"), patch_size=2)  # every run saved the DiT key then (its default)
    del m["seal"]  # written before the metadata was sealed, too
    meta.write_text(json.dumps(m))
    assert json.loads(meta.read_text())["config"]["model"]["window"] == 8
    r = restore(setup.engine, setup.state, tmp_path / "ckpt" / "2")
    assert r.step == 2 and r.warnings == []
    same = restore(setup.engine, setup.state, tmp_path / "ref" / "2").state
    assert_trees_equal(host(r.state), host(same))
    z = make([*then, "sync.strategy=zero1"], 2, 2)
    r = restore(z.engine, z.state, tmp_path / "ckpt" / "2")
    assert r.step == 2 and r.warnings == ["resuming with sync.strategy='zero1' (the checkpoint at step 2 was written with 'replicated')"]


def test_resume_may_change_how_the_step_computes(ref):
    """model.remat and memory_unroll change silently (the same bits: tests/test_precision.py);
    model.dtype, the attention's form, the embedding's gradient and the chunked loss with a
    warning each (float rounding differs); the state restored is the checkpoint's."""
    setup = make([*NL, "model.remat=block", "model.nl_lm.memory_unroll=2"], 2, 4)
    r = restore(setup.engine, setup.state, ref["dir"] / "2")
    assert r.step == 2 and r.warnings == []
    same = restore(ref["setup"].engine, ref["setup"].state, ref["dir"] / "2").state
    assert_trees_equal(host(r.state), host(same))
    other = make([*NL, "model.dtype=bfloat16", "model.nl_lm.attention=blocked", "model.nl_lm.embed_grad=onehot",
                  "model.nl_lm.loss_chunk=16"], 2, 4)
    r = restore(other.engine, other.state, ref["dir"] / "2")
    assert sorted(r.warnings) == ["resuming with model.dtype='bfloat16' (the checkpoint at step 2 was written with 'float32')",
                                  "resuming with model.nl_lm.attention='blocked' (the checkpoint at step 2 was written with 'auto')",
                                  "resuming with model.nl_lm.embed_grad='onehot' (the checkpoint at step 2 was written with 'auto')",
                                  "resuming with model.nl_lm.loss_chunk=16 (the checkpoint at step 2 was written with 0)"], r.warnings
    assert_trees_equal(host(r.state), host(same))


def test_a_resume_whose_auto_computes_another_way_is_told(ref, monkeypatch):
    """Each checkpoint records the forms its model's `auto` settings took (on this CPU: the scan);
    a resume under the same settings whose `auto` takes another (on a GPU the parallel form of the
    inner loop) gets a warning naming both, the state restored as it is; one whose setting itself
    changed is told by that setting's warning alone; a checkpoint saved before forms were recorded
    says nothing."""
    meta = storage.read_meta(ref["dir"] / "2")
    assert meta["forms"] == ref["setup"].engine.model.forms() and meta["forms"]["memory_impl"] == "scan"
    from nljax.models import memory_forms

    select = memory_forms.select
    monkeypatch.setattr(memory_forms, "select", lambda impl, *a, **k: "parallel" if impl == "auto" else select(impl, *a, **k))
    moved = make(NL, 2, 4)
    r = restore(moved.engine, moved.state, ref["dir"] / "2")
    assert r.warnings == ["resuming with model.nl_lm.memory_impl='auto' computed as 'parallel' on this cpu "
                          "(the checkpoint at step 2 was computed as 'scan'): float rounding differs"], r.warnings
    same = restore(ref["setup"].engine, ref["setup"].state, ref["dir"] / "2").state
    assert_trees_equal(host(r.state), host(same))
    from nljax.checkpoint.restore import _changed_forms

    here = moved.engine.model.forms()
    assert _changed_forms({k: v for k, v in meta.items() if k != "forms"}, moved.engine.cfg, here) == []
    # several forms moved (a GPU's checkpoint on a CPU): one line naming them all
    gpu = {**meta, "forms": {**meta["forms"], "attention": "cudnn", "embed_grad": "onehot", "memory_impl": "parallel"}}
    cpu = ref["setup"].engine.model.forms()
    assert _changed_forms(gpu, moved.engine.cfg, cpu) == [
        f"resuming with model.nl_lm.attention='auto', model.nl_lm.memory_impl='auto' and "
        f"model.nl_lm.embed_grad='auto' computed as {cpu['attention']!r}, 'scan' and {cpu['embed_grad']!r} on this "
        "cpu (the checkpoint at step 2 was computed as 'cudnn', 'parallel' and 'onehot'): float rounding differs"]
    # a form that is no setting of the model's section (a model of one's own) names nothing
    assert _changed_forms({**meta, "forms": {"odd": "a"}}, moved.engine.cfg, {"odd": "b"}) == []
    asked = make([*NL, "model.nl_lm.memory_impl=parallel"], 2, 4)
    r = restore(asked.engine, asked.state, ref["dir"] / "2")
    assert r.warnings == ["resuming with model.nl_lm.memory_impl='parallel' (the checkpoint at step 2 was written "
                          "with 'auto')"], r.warnings


@pytest.mark.slow
def test_elastic_resume_changes_mesh_model(ref, tmp_path):
    """(2, 4, 1) replicated -> (2, 2, 2) zero1 (tensor parallelism: heads, memory heads and MLP
    widths split in two) -> (1, 2, 1) fsdp: parameters, optimizer state and the error buffers of
    the period-4 level (in use at both restores, regrouped to the other split) carry over, and
    the continuation matches the uninterrupted run (losses, parameters, every row's memory)."""
    t = make([*NL, "sync.strategy=zero1", f"checkpoint.dir={tmp_path}/tp"], 2, 2, 2)
    r = restore(t.engine, t.state, ref["dir"] / "2")
    assert r.state.err_buf[1].shape == t.state.err_buf[1].shape and np.abs(np.asarray(r.state.err_buf[1])).sum() > 0
    lt, state = train(t, range(2, 4), state=r.state)
    save(t, state, 4)
    finish_on_fsdp(ref, tmp_path / "tp" / "4", lt, atol=1e-5)
    # a changed global batch under tensor parallelism: every row restarts, heads split, and it trains
    b = make([*NL, "train.batch_size=16"], 1, 2, 2)
    r = restore(b.engine, b.state, tmp_path / "tp" / "4")
    assert r.fresh_rows and r.state.memory["block0"]["M"]["W1"].sharding == b.state.memory["block0"]["M"]["W1"].sharding
    assert np.isfinite(train(b, range(4, 5), state=r.state)[0]).all()


def test_a_checkpoint_with_flat_qkv_kernels_restores(ref, tmp_path):
    """Checkpoints saved before the qkv kernels took a head axis ([D, 3 * H * hd], the memory's
    conv [K, 1, C] and [C]) restore with the same values in the new shapes, optimizer moments
    included."""
    import orbax.checkpoint as ocp

    setup = ref["setup"]
    state = restore(setup.engine, setup.state, ref["dir"] / "2").state
    flat = lambda name, x: (x.reshape(x.shape[0], 1, -1) if "conv/kernel" in name else
                            x.reshape(-1) if "conv/bias" in name else x.reshape(x.shape[0], -1))
    old = {k: (flat(k, x) if contents.RESHAPED.search(k) else x) for k, x in contents.named_arrays(state).items()}
    assert sum(contents.RESHAPED.search(k) is not None for k in old) >= 3 * 4  # params and two Adam moments
    meta = contents.metadata(setup.engine, 2, old)
    meta["model"] = {k: ([list(flat(k, np.zeros(v[0])).shape), v[1]] if contents.RESHAPED.search(k) else v)
                     for k, v in meta["model"].items()}
    del meta["seal"]  # written before the metadata was sealed, too
    with ocp.CheckpointManager(tmp_path / "old") as m:
        m.save(2, args=ocp.args.Composite(**{contents.STATE: ocp.args.StandardSave(contents.nest(old)),
                                             contents.META: ocp.args.JsonSave(meta)}))
    r = restore(setup.engine, setup.state, tmp_path / "old" / "2")
    assert r.step == 2 and r.warnings == []
    assert_trees_equal(host(r.state), host(state))
    # onto another strategy and tensor parallelism: the moments are converted in today's shapes
    f = make([*NL, "sync.strategy=fsdp"], 1, 2, 2)
    r = restore(f.engine, f.state, tmp_path / "old" / "2")
    assert_trees_close(host(f.engine.strategy.export_state(r.state).params), host(state.params), rtol=0, atol=0)


def test_the_dit_qkv_is_read_reshaped_too():
    """The DiT's qkv kernel and bias took the head axis in the same release: the rule above covers
    them and nothing else of the DiT, and an old flat kernel and bias, reshaped, give the q, k, v
    of every head that the old layer (Dense(3D), its output reshaped to [3, H, hd]) gave."""
    import flax.linen as nn

    from nljax.models import build

    dit = build(config.load(None, ["model.name=dit", "model.dim=16", "model.depth=2", "model.heads=4",
                                   "model.dit.patch_size=1", "images.source=moons", "cms.periods=[1]"]))
    shapes = contents.fingerprint(dit)
    assert {k for k in shapes if contents.RESHAPED.search(k)} == {
        f"block{i}/attn/qkv/{w}" for i in range(2) for w in ("kernel", "bias")}
    assert shapes["block0/attn/qkv/kernel"][0] == [16, 3, 4, 4]
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    old = nn.Dense(48).init(jax.random.key(2), x)["params"]
    old = {"kernel": old["kernel"], "bias": jax.random.normal(jax.random.key(3), (48,))}
    want = nn.Dense(48).apply({"params": old}, x).reshape(2, 5, 3, 4, 4)
    new = {"kernel": old["kernel"].reshape(16, 3, 4, 4), "bias": old["bias"].reshape(3, 4, 4)}
    np.testing.assert_array_equal(np.asarray(nn.DenseGeneral((3, 4, 4)).apply({"params": new}, x)), np.asarray(want))


def test_error_buffers_are_redistributed_so_the_reduction_is_unchanged():
    from nljax.parallel import mesh as meshlib

    e = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    for n_new in (4, 2, 1):
        sh = meshlib.rows_sharding(meshlib.make_mesh(1, n_new, jax.devices()[:n_new]))
        mean = np.asarray(elastic.redistribute_err_buf(e, 8, n_new, True, sh))
        total = np.asarray(elastic.redistribute_err_buf(e, 8, n_new, False, sh))
        assert mean.shape == (n_new, 5)
        np.testing.assert_allclose(mean.sum(0) / n_new, e.sum(0) / 8, rtol=1e-5)  # sync.mean
        np.testing.assert_allclose(total.sum(0), e.sum(0), rtol=1e-5)  # sums
        assert (mean == mean[0]).all()


def test_a_setting_that_moves_the_rows_restarts_every_row(ref):
    """The window, the seed or the data place each row elsewhere in the text (ContextStream):
    a carried memory would read text it never wrote. data.reset_prob moves no row."""
    for over, said in (("seed=5", "seed changed from 0 to 5"), ("train.seq_len=16", "train.seq_len changed from 8 to 16"),
                       ("data.eval_fraction=0.1", "data.eval_fraction changed from 0.05 to 0.1")):
        setup = make([*NL, over], 2, 4)
        r = restore(setup.engine, setup.state, ref["dir"] / "4")
        assert r.fresh_rows and any(said in w and "every row's memory restarts" in w for w in r.warnings), r.warnings
    setup = make([*NL, "data.reset_prob=0.5"], 2, 4)
    assert not restore(setup.engine, setup.state, ref["dir"] / "4").fresh_rows


def test_a_changed_global_batch_is_said_for_a_model_without_rows(tmp_path):
    """No memory, so no row restarts, yet the batch size still changes what each step reads
    (and the learning rate under optim.lr_scaling): a warning of its own."""
    setup = make([*TINY, f"checkpoint.dir={tmp_path}"], 1, 2)
    _, state = train(setup, 1)
    save(setup, state, 1)
    bigger = make([*TINY, "train.batch_size=16"], 1, 2)
    r = restore(bigger.engine, bigger.state, tmp_path / "1")
    assert not r.fresh_rows
    assert r.warnings == ["resuming with train.batch_size=16 (the checkpoint at step 1 was written with 8)"], r.warnings


def test_changed_global_batch_restarts_every_row(ref):
    setup = make([*NL, "train.batch_size=16", "optim.lr=0.02"], 2, 4)
    r = restore(setup.engine, setup.state, ref["dir"] / "4")
    assert r.fresh_rows and any("train.batch_size changed from 8 to 16" in w for w in r.warnings)
    assert sum("train.batch_size" in w for w in r.warnings) == 1, r.warnings  # said once, by the rows' warning
    assert any("optim.lr=0.02" in w for w in r.warnings)
    for x in jax.tree.leaves(r.state.memory):
        assert x.shape[0] == 16 and not np.asarray(x).any()
    same = restore(ref["setup"].engine, ref["setup"].state, ref["dir"] / "4").state
    assert_trees_equal(r.state.params, same.params)
    batch = setup.batch(5)
    assert not np.asarray(batch["reset"]).all()
    reset = setup.batch(5, reset_all=True)  # the first batch after this resume
    assert np.asarray(reset["reset"]).all() and reset["reset"].sharding == batch["reset"].sharding


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: one line, exit 2, nothing on disk changed


def _flip(step_dir: Path):
    for f in data_files(step_dir):
        b = bytearray(f.read_bytes())
        mid = len(b) // 2
        b[mid : mid + 64] = bytes(x ^ 0xFF for x in b[mid : mid + 64])
        f.write_bytes(bytes(b))


def _bad_meta(step_dir: Path):
    (step_dir / "nljax" / "metadata").write_text('{"format": 1, "arrays": ')


def _rewrite_meta(step_dir: Path, edit, sealed: bool = True):
    """The step's metadata as `edit` returns it, sealed anew (as if written so) unless `sealed` is false."""
    meta = step_dir / "nljax" / "metadata"
    m = edit(json.loads(meta.read_text()))
    meta.write_text(json.dumps({**m, "seal": contents.seal(m)} if sealed else m))


def _foreign_meta(step_dir: Path):
    _rewrite_meta(step_dir, lambda m: {**m, "arrays": {"step": {"shape": [], "dtype": "int32"}}})


def _other_model(step_dir: Path):
    def edit(m):
        m["model"]["head/kernel"][0] = [16, 512]
        return m
    _rewrite_meta(step_dir, edit)


def _zero_devices(step_dir: Path):
    _rewrite_meta(step_dir, lambda m: {**m, "mesh": {"inter": 2, "intra": 4, "devices": 0}})


def _edited_meta(step_dir: Path):
    """A hand edit of a value a restore trusts (an array's checksum), the seal left as written."""
    def edit(m):
        m["arrays"]["step"]["checksum"] += 1
        return m
    _rewrite_meta(step_dir, edit, sealed=False)


# case: (damage, overrides, message, through the command line (else the library call))
BAD = {
    "missing": (None, ["checkpoint.resume={d}/nowhere"], "checkpoint not found: {d}/nowhere", True),
    # --resume=auto's word as the key's value: a path "auto" of the working directory, not found
    "auto": (None, ["checkpoint.resume=auto"], "; to start the run or continue it (a job script's restart), give "
             "--resume=auto", True),
    "empty": (None, ["checkpoint.resume={d}/empty"], "no complete checkpoint in {d}/empty", False),
    "file": (None, ["checkpoint.resume={d}/run/metrics.jsonl"], "checkpoint.resume={d}/run/metrics.jsonl is a file, "
             "not a checkpoint: give latest, a step directory or a folder of checkpoints", True),
    # named explicitly: `--resume` would fall back to step 2 (test_resume_falls_back_...)
    "truncated": (truncate, ["checkpoint.resume={d}/ckpt/4"], "checkpoint {d}/ckpt/4: array data unreadable", True),
    "flipped": (_flip, [], "checkpoint {d}/ckpt/4:", False),
    "metadata": (_bad_meta, [], "checkpoint {d}/ckpt/4: metadata unreadable", False),
    "foreign": (_foreign_meta, [], "checkpoint {d}/ckpt/4: metadata is not an nljax checkpoint of format 1", False),
    "orbax": (lambda d: (d / storage.ORBAX_META).write_text("garbage{"), [],
              "checkpoint {d}/ckpt/4: Orbax's _CHECKPOINT_METADATA is unreadable", False),
    "edited": (_edited_meta, [], "checkpoint {d}/ckpt/4: metadata does not match its seal", False),
    "devices": (_zero_devices, [], "checkpoint {d}/ckpt/4: metadata is not an nljax checkpoint of format 1", False),
    "fingerprint": (_other_model, [], "checkpoint {d}/ckpt/4 is from another model: parameter 'head/kernel' is "
                    "float32(16, 512) there, float32(16, 256) here", False),
    "model": (None, ["model.dim=32"], "checkpoint {d}/ckpt/4 does not fit this run: model.dim=16 there, 32 here", True),
    "periods": (None, ["cms.periods=[1,8]"], "checkpoint {d}/ckpt/4 does not fit this run: cms.periods=[1, 4] "
                "there, [1, 8] here", True),
}


def test_a_damaged_checkpoints_line_names_the_kind_first_and_cuts_the_readers_words(caplog):
    """A checkpoint found damaged: its line says the kind of damage, then after ' -- ' the error
    Orbax wrapped (not its outer "Encountered error while reading array index"), at most 120
    characters; a warning skipping it names its step first. Orbax's whole error goes to the
    `nljax.checkpoint` logger at DEBUG. The warning once embedded 300 characters of it."""
    import logging

    step = Path("/r/checkpoints/8")
    words = 'OUT_OF_RANGE: Error reading "opt_state.1.mu.block0.cms1.up.kernel/0.0" in OCDBT database at local file ' \
            '"/r/checkpoints/8/state/": Requested byte range [56122, 59996) is not valid for value of size 1000'
    try:
        try:
            raise ValueError(f"{words}. See full TensorStore details: {{'driver': 'ocdbt', ...}}")
        except ValueError as inner:
            raise Exception("Encountered error while reading array index: (slice(0, 16, 1), slice(0, 64, 1))") from inner
    except Exception as e:  # noqa: BLE001 - as Orbax raises it
        with caplog.at_level(logging.DEBUG, logger="nljax.checkpoint"):
            line = storage.damage(step, "array data unreadable", e)
    said, detail = line.split(contents.DETAIL)
    assert said == f"checkpoint {step}: array data unreadable"
    assert len(detail) == storage.DETAIL_CHARS == 120 and detail == f"ValueError: {words}"[:117] + "...", detail
    assert words in caplog.text and "Encountered error" in caplog.text  # the whole of it, traceback too
    assert contents.passed_over(step, line, "resuming from") == (
        f"checkpoint {step} (step 8) is damaged: array data unreadable; resuming from an older one -- {detail}")
    # no reader's words (a seal that does not match), found by one process of several
    seal = f"checkpoint {step}: metadata does not match its seal (edited or damaged after it was written) (process 1)"
    assert contents.passed_over(step, seal, "using") == (
        f"checkpoint {step} (step 8) is damaged (as process 1 reads it): metadata does not match its seal (edited or "
        "damaged after it was written); using an older one")


def test_a_run_directory_as_checkpoint_resume_names_its_checkpoints(tmp_path):
    """checkpoint.resume=RUN_DIR (checkpoint.init_params takes one) said "no complete checkpoint
    in RUN_DIR" of a run whose checkpoints are in its checkpoint.dir: the line says it is a run
    directory and names that folder (its config.yaml's, or the default for one unreadable)."""
    import yaml

    other = tmp_path / "other"
    other.mkdir()
    saved = config.load(None, [f"run.dir={other}", f"checkpoint.dir={tmp_path}/ckpts"])
    (other / "config.yaml").write_text(yaml.safe_dump(config.to_dict(saved), sort_keys=False))
    cfg = config.load(None, [f"run.dir={tmp_path}/new", f"checkpoint.resume={other}"])
    with pytest.raises(config.ConfigError) as e:
        storage.candidates(cfg)
    assert str(e.value) == (f"checkpoint.resume={other} is a run directory, not a checkpoint: give the folder of its "
                            f"checkpoints ({tmp_path}/ckpts: its newest) or one step of them")
    (other / "config.yaml").write_text("model: [")
    with pytest.raises(config.ConfigError, match=rf"\({other}/checkpoints: its newest\)"):
        storage.candidates(cfg)
    # an export directory: its parameters, not a checkpoint (it was "no complete checkpoint in ...")
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"config": {}, "step": 3, "dtype": "float32",
                                                 "checkpoint": f"{other}/checkpoints/3"}))
    with pytest.raises(config.ConfigError) as e:
        storage.candidates(config.load(None, [f"run.dir={tmp_path}/new", f"checkpoint.resume={exp}"]))
    assert str(e.value) == (f"checkpoint.resume={exp} is an export directory (nljax.export wrote it), not a "
                            f"checkpoint: give the checkpoint it was exported from ({other}/checkpoints/3)")


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
    # what a resume would take, newest first (an older one where the newer are damaged)
    latest = config.load(None, [*TINY_NL_ARGS, f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.resume=latest"])
    assert storage.candidates(latest) == [tmp_path / "ckpt" / "4", tmp_path / "ckpt" / "2"]
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
    # a resume of that run with run.overwrite=true continues its files: none is removed
    shutil.copytree(ref["dir"], tmp_path / "ckpt", dirs_exist_ok=True)
    cfg = config.load(None, [*TINY_NL_ARGS, f"checkpoint.dir={tmp_path}/ckpt", "run.overwrite=true", "checkpoint.resume=latest"])
    c = Checkpoints.resolve(dataclasses.replace(ref["setup"].engine, cfg=cfg), ref["setup"].state, say=lambda *a: None)
    c.open()
    c.close()
    assert c.start == 4 and sorted(q.name for q in (tmp_path / "ckpt").iterdir()) == ["2", "4"]


# ---------------------------------------------------------------------------------------------
# Nothing a user did not ask to replace is taken over or removed


def test_run_dir_removes_outputs_only_when_overwriting(tmp_path):
    from nljax.runtime import runlog
    from nljax.runtime.rundir import RunDir

    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "notes.txt").write_text("an earlier run's")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "samples_000001.png").write_text("a user's file")  # the pattern of a run's samples
    (tmp_path / "samples_000002.png").write_text("the run's")
    for name in ("samples_000002.png", "profile", "summary.json"):
        runlog.note_written(tmp_path, name)
    RunDir(str(tmp_path), overwrite=False, write=True)  # no metrics.jsonl: a fresh run, nothing removed
    assert (tmp_path / "profile" / "notes.txt").exists() and (tmp_path / "summary.json").exists()
    RunDir(str(tmp_path), overwrite=True, write=True)
    assert not (tmp_path / "profile").exists() and not (tmp_path / "summary.json").exists()
    assert not (tmp_path / "samples_000002.png").exists() and (tmp_path / "samples_000001.png").exists()
    # an attempt that stopped before its first step (its metrics.jsonl empty: a tracker that could
    # not start) is replaced, its W&B files too; it was "a run", refusing the retry its line suggested
    (tmp_path / "wandb" / "offline-run-1").mkdir(parents=True)
    (tmp_path / "summary.json").write_text("{}")
    for name in ("wandb", "summary.json"):  # each noted by the attempt as it made it
        runlog.note_written(tmp_path, name)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    RunDir(str(tmp_path), overwrite=False, write=True)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "wandb").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # one step logged: a run
    with pytest.raises(config.ConfigError, match="already holds a run"):
        RunDir(str(tmp_path), overwrite=False, write=True)


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


def test_unawaited_writes_of_a_failed_save_are_hidden_only_after_a_failure_inside_the_scope():
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
        with errors_hidden() as noise:
            collect_one()  # no failure yet: someone else's warning, shown
            noise.settle(quiet_s=0)  # a failure was caught
            collect_one()
        collect_one()  # out of the scope: shown
        expected = f"coroutine '{write_fragment.__qualname__}' was never awaited"
        assert [str(w.message) for w in shown] == [expected, expected]


def test_prune_keeps_multiples_of_keep_every(tmp_path, monkeypatch):
    """checkpoint.keep_every: the newest `keep`, and the older steps at a multiple of it."""
    for s in range(2, 22, 2):
        (tmp_path / str(s)).mkdir()
    monkeypatch.setattr(storage, "complete_steps", lambda root: list(range(2, 22, 2)))
    storage.prune(tmp_path, keep=2, keep_every=6)
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [6, 12, 18, 20]


def test_prune_says_when_an_old_checkpoint_cannot_be_removed(tmp_path, monkeypatch, capsys):
    """checkpoint.keep: a step that cannot be deleted (permissions, NFS) is named in a warning, and
    the other old steps still go."""
    from nljax.checkpoint import storage

    for s in (1, 2, 3):
        (tmp_path / str(s)).mkdir()
    monkeypatch.setattr(storage, "complete_steps", lambda root: [1, 2, 3])
    rmtree = storage.shutil.rmtree

    def refuse_step_1(path, *a, **k):
        if path.name == "1":
            raise PermissionError(13, "Permission denied")
        rmtree(path, *a, **k)

    monkeypatch.setattr(storage.shutil, "rmtree", refuse_step_1)
    storage.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]
    assert capsys.readouterr().err == (f"nljax: warning: could not remove old checkpoint {tmp_path / '1'} "
                                       "(checkpoint.keep=1): Permission denied\n")


def test_keep_every_keeps_those_checkpoints_for_good(tmp_path):
    """checkpoint.keep_every: besides the newest checkpoint.keep, every checkpoint at a multiple of
    it stays (the saves here: 2, 4, ..., 10, and 10 at the end)."""
    setup = make([f"run.dir={tmp_path}", "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.keep_every=4",
                  "checkpoint.async_save=false"])
    c = Checkpoints.resolve(setup.engine, setup.state, say=lambda *a: None)
    c.open()
    try:
        for step in range(1, 11):
            c.maybe_save(step, setup.state)
        c.finish(10, setup.state)
    finally:
        c.close()
    assert storage.complete_steps(tmp_path / "checkpoints") == [4, 8, 10]


def test_keep_holds_one_more_checkpoint_between_saves_and_keep_at_the_end(tmp_path):
    """checkpoint.keep (docs/guides/checkpoints-and-resume.md, Saving): the older checkpoints are
    removed as the next save begins, so between saves the newest `keep` and the one just written
    are on disk (a save cut short still leaves `keep` complete ones); the run's end removes the
    extra one."""
    setup = make([f"run.dir={tmp_path}", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.async_save=false"])
    c = Checkpoints.resolve(setup.engine, setup.state, say=lambda *a: None)
    c.open()
    between = []
    try:
        for step in range(1, 6):
            c.maybe_save(step, setup.state)
            between.append(storage.complete_steps(tmp_path / "checkpoints"))
        c.finish(5, setup.state)
    finally:
        c.close()
    assert between == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert storage.complete_steps(tmp_path / "checkpoints") == [4, 5]


def test_steps_set_aside_and_foreign_steps_are_named_by_their_bounds(tmp_path):
    """`set_aside` never moves a step over an earlier one of its name (a third `12` becomes
    `12.2`); `foreign_steps` names the folders in (after, last], not the one at `after` (the step
    a run continues from, or step 0 before a fresh run's first save)."""
    for n in range(3):
        (tmp_path / "12").mkdir()
        (tmp_path / "12" / "mark").write_text(str(n))
        storage.set_aside(tmp_path, [tmp_path / "12"])
    moved = tmp_path / storage.SET_ASIDE
    assert {p.name: (p / "mark").read_text() for p in moved.iterdir()} == {"12": "0", "12.1": "1", "12.2": "2"}
    for name in ("3", "4", "8", "9"):  # a user's folders, named as steps
        (tmp_path / name).mkdir()
    assert [p.name for p in storage.foreign_steps(tmp_path, 3, 8)] == ["4", "8"]


def test_a_failed_saves_os_error_is_found_where_it_was_raised_during_another():
    """A save's line names the disk's error however it was raised: wrapped (`raise ... from`),
    or raised while handling it (Orbax's writer raising its own error in an `except OSError`)."""
    def failed(wrapped):
        try:
            try:
                raise OSError(28, "No space left on device")
            except OSError as e:
                if wrapped:
                    raise RuntimeError("write failed") from e
                raise RuntimeError("write failed")  # noqa: B904 - the case tested: the OSError is its context
        except RuntimeError as e:
            return e

    assert storage.os_error(failed(True)) == storage.os_error(failed(False)) == \
        "OSError: [Errno 28] No space left on device"


def test_a_partial_read_of_an_array_the_checkpoint_lacks_is_damage(ref):
    """A read of some arrays (`restore_params`') names each one it wants: one that the step does
    not hold (Orbax's partial restore hands back its abstract entry) is damage, not a parameter."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    want = {name: jax.ShapeDtypeStruct(shape, np.float32 if shape else np.int32, sharding=one)
            for name, shape in (("step", ()), ("params/nowhere", (2,)))}
    with pytest.raises(contents.Damaged, match=r"array data unreadable.*\['params/nowhere'\] missing"):
        storage.read_arrays(ref["dir"] / "4", want, partial=True)


def test_a_resume_of_the_checkpoint_dir_or_a_step_in_it_continues_the_run(tmp_path):
    """checkpoint.resume naming checkpoint.dir itself, or a step in it, continues the run's own
    files as `latest` does; a checkpoint elsewhere starts a new run."""
    def own(resume):
        cfg = config.load(None, [*TINY_NL_ARGS, f"checkpoint.dir={tmp_path}/ck", f"checkpoint.resume={resume}"])
        return storage.continues_own(cfg)

    assert own("latest") and own(tmp_path / "ck") and own(tmp_path / "ck" / "4")
    assert not own(tmp_path / "other") and not own(tmp_path / "ck2")


def test_saved_arrays_that_do_not_form_the_saved_strategys_state_are_refused():
    """`_saved_state` puts the saved arrays back into the saved strategy's state: an array that
    state has no place for is one line naming it, not dropped silently (nor is one it lacks)."""
    setup = make(["sync.strategy=zero1"])
    arrays = contents.named_arrays(setup.state)
    rest = dataclasses.replace(setup.state, params=None, opt_state=None)
    assert elastic._saved_state(setup.engine, arrays, rest).step is arrays["step"]
    for name, odd in (("opt_state/extra", {**arrays, "opt_state/extra": arrays["step"]}),
                      ("step", {n: x for n, x in arrays.items() if n != "step"})):
        with pytest.raises(config.ConfigError, match=f"do not form a sync.strategy=zero1 state \\(e.g. '{name}'\\)"):
            elastic._saved_state(setup.engine, odd, rest)


def test_a_resume_compares_data_paths_as_the_files_they_name(tmp_path, monkeypatch):
    """The checkpoint keeps data paths as written, run.dir/config.yaml records them absolute: the
    same files either way, a list's entries too, are no change (no warning, no row restarted).
    With the data's digest the checkpoint's, other paths are the same data; a checkpoint that
    recorded no digest restarts no row for this run's."""
    from nljax.checkpoint import restore as resume

    monkeypatch.chdir(tmp_path)
    files = lambda *train: [*TINY_NL_ARGS, "data.source=files", f"data.train=[{','.join(train)}]"]
    saved = {"config": config.to_dict(config.load(None, files("a/*.txt", "b.txt"))), "step": 4}
    rows = {"memory/block0": None}
    assert resume._changed(saved, config.load(None, files(f"{tmp_path}/a/*.txt", f"{tmp_path}/b.txt"))) == []
    moved = config.load(None, files("c/*.txt"))
    assert [k for k, *_ in resume._changed(saved, moved)] == ["data.train"]
    assert resume._changed(saved, moved, same_data=True) == []
    assert not resume._rows_restart(saved, config.load(None, files("a/*.txt", "b.txt")), rows, [], digest="abc")
    assert resume._rows_restart({**saved, "data": {"digest": "xyz"}}, config.load(None, files("a/*.txt", "b.txt")),
                                rows, [], digest="abc")


def test_a_checkpoint_pruned_as_it_is_read_is_passed_over_for_the_newest(tmp_path):
    """A tool beside a live run (nljax.evaluate, generate, export, checkpoint.init_params) reads
    the newest checkpoint while the run saves the next and prunes it to checkpoint.keep: its
    arrays vanish mid-read. That was "checkpoint .../3300: array data unreadable" (exit 2), as if
    damaged; now the search starts again from the newest. A damaged one (still there) and a step
    named (no listing again) are said as before."""
    from nljax.checkpoint.contents import Damaged
    from nljax.checkpoint.restore import RELISTS, first_valid

    steps = {s: tmp_path / str(s) for s in (10, 20, 30)}
    for s in (10, 20):
        steps[s].mkdir()
    newest_first = lambda: sorted(tmp_path.iterdir(), key=lambda p: -int(p.name))

    def read(path):
        if path.name == "20":  # the live run saves 30 and prunes 20 as it is read
            steps[30].mkdir()
            shutil.rmtree(path)
            raise Damaged(f"checkpoint {path}: array data unreadable")
        if path.name == "10":
            raise Damaged(f"checkpoint {path}: array data unreadable")
        return path.name

    assert first_valid(read, newest_first(), newest_first) == ("30", [])
    steps[30].rmdir()
    steps[20].mkdir()
    with pytest.raises(Damaged, match="20: array data unreadable"):  # a step named: no listing again
        first_valid(read, [steps[20]])
    steps[20].mkdir()
    with pytest.raises(Damaged, match="every checkpoint .* is damaged; the oldest: checkpoint .*10"):
        first_valid(lambda p: read(p) if p.name == "10" else (_ for _ in ()).throw(Damaged("x")), newest_first(),
                    newest_first)

    def pruned(path):  # pruned every time: said after RELISTS tries, not taken for damage
        shutil.rmtree(path)
        (tmp_path / str(int(path.name) + 100)).mkdir()
        raise Damaged(f"checkpoint {path}: array data unreadable")

    with pytest.raises(config.ConfigError, match=f"removed {RELISTS} times as they were read .* checkpoint.keep"):
        first_valid(pruned, newest_first(), newest_first)


def test_a_checkpoints_listing_that_a_live_run_prunes_is_listed_again(tmp_path, monkeypatch):
    """Orbax stats each step folder as it lists them: a step a live run pruned in between was a
    FileNotFoundError (nljax.evaluate beside a live run: "error: [Errno 2] No such file or
    directory: .../checkpoints/3800", exit 1). Listed again now, a few times at most."""
    from nljax.checkpoint import storage

    root = tmp_path / "checkpoints"
    for s in (2, 4):
        (root / str(s) / storage.META).mkdir(parents=True)
        (root / str(s) / storage.META / "metadata").write_text("{}")
        (root / str(s) / storage.ORBAX_META).write_text("{}")
    failures = iter([2])

    class Manager:  # Orbax's listing, pruned under it once
        def all_steps(self):
            if next(failures, None):
                raise FileNotFoundError(2, "No such file or directory", str(root / "2"))
            return [2, 4]

    monkeypatch.setattr(storage, "manager", lambda root: Manager())
    assert storage.complete_steps(root) == [2, 4]
    failures = iter([1] * storage.LISTINGS)
    with pytest.raises(FileNotFoundError):  # pruned at every listing: not hidden
        storage.complete_steps(root)
