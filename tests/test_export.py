"""Export: the parameters gathered from any strategy, written as safetensors with the config, load
back (`nljax.load_model`) into a model whose logits equal the training state's."""

import dataclasses
import json
from typing import NamedTuple
from unittest import mock

import jax
import numpy as np
import pytest
from helpers import TINY_NL, assert_trees_equal, lock, saved_run

import nljax
from nljax import export
from nljax.errors import ConfigError
from nljax.run import trained


@pytest.mark.parametrize("strategy", [pytest.param("replicated", marks=pytest.mark.slow), "fsdp"])
def test_export_load_gives_the_training_states_logits(strategy, tmp_path):
    setup, state = saved_run(tmp_path / "run", [*TINY_NL, f"sync.strategy={strategy}"], 2, 4)
    t = trained.load(tmp_path / "run", devices=jax.devices()[:1])
    batch = jax.device_get(setup.batch(2))
    batch = {"tokens": batch["tokens"], "reset": np.ones(len(batch["reset"]), bool)}
    params = jax.device_get(setup.engine.strategy.gather_params(state.params))
    memory = setup.engine.model.init_memory(len(batch["reset"]))
    want, _ = setup.engine.model.logits(params, memory, batch)

    model, loaded = nljax.load_model(export.export(t, tmp_path / "f32"))
    got, _ = model.logits(loaded, memory, batch)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    if strategy == "replicated":  # an export written before the qkv kernels took a head axis loads too
        from safetensors.flax import load_file, save_file

        weights = tmp_path / "f32" / export.WEIGHTS
        old = {k: (v.reshape(v.shape[0], -1) if k.endswith("qkv/kernel") else v) for k, v in load_file(str(weights)).items()}
        assert any(v.ndim == 2 and k.endswith("qkv/kernel") for k, v in old.items())
        save_file(old, str(weights))
        import json

        info = json.loads((tmp_path / "f32" / export.CONFIG).read_text())
        del info["sha256"], info["digest"]  # written before exports carried checksums
        (tmp_path / "f32" / export.CONFIG).write_text(json.dumps(info))
        model, loaded = nljax.load_model(tmp_path / "f32")
        np.testing.assert_array_equal(np.asarray(model.logits(loaded, memory, batch)[0]), np.asarray(want))

    model, half = nljax.load_model(export.export(t, tmp_path / "bf16", "bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(half)} == {np.dtype("bfloat16")}
    got, _ = model.logits(half, memory, batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05)  # bf16 weights: ~3 digits


def test_the_export_holds_the_runs_config_and_a_dit_loads_without_its_images(tmp_path):
    """config.json is the run's config as it trained (not the 1-device, 1-row config the export
    restored it with); a DiT's export records its image shape and label count, so it loads with
    its training images gone, and its velocity equals the training state's."""
    import json

    from nljax import config

    npz = tmp_path / "imgs.npz"
    rng = np.random.default_rng(0)
    np.savez(npz, x=rng.integers(0, 256, (40, 4, 4, 3), np.uint8), y=rng.integers(0, 3, 40))
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=2", "images.source=file", f"images.path={npz}", "cms.periods=[1]",
           "train.batch_size=8"]
    setup, state = saved_run(tmp_path / "run", dit, 2, 4, steps=1)
    out = export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), tmp_path / "export")
    info = json.loads((out / export.CONFIG).read_text())
    assert info["config"] == config.to_dict(setup.cfg), "the run's config as trained"
    assert info["images"] == {"shape": [4, 4, 3], "num_classes": 3}
    npz.rename(tmp_path / "elsewhere.npz")
    model, params = nljax.load_model(out)
    z, t, r, y = rng.normal(size=(2, 4, 4, 3)).astype(np.float32), np.array([0.9, 0.5]), np.array([0.1, 0.5]), np.array([0, 2])
    want = setup.engine.model.velocity(jax.device_get(setup.engine.strategy.gather_params(state.params)))(z, t, r, y)
    np.testing.assert_array_equal(np.asarray(model.velocity(params)(z, t, r, y)), np.asarray(want))


def test_export_cli_and_bad_input(tmp_path, capsys, monkeypatch):
    saved_run(tmp_path / "run", TINY_NL, 1, 1, steps=1)
    assert export.main([f"run.dir={tmp_path / 'run'}", "dtype=bfloat16"]) == 0
    weights = tmp_path / "run" / "export" / export.WEIGHTS
    assert weights.is_file() and weights.stat().st_mode & 0o777 == (tmp_path / "run" / "export" / export.CONFIG).stat().st_mode & 0o777
    # the seconds of reading the checkpoint are said before it, on standard error
    assert capsys.readouterr().err.splitlines() == [f"nljax.export: reading the checkpoint of {tmp_path / 'run'} ..."]
    assert export.main([f"run.dir={tmp_path / 'run'}", "dtype=int8"]) == 2
    assert export.main(["run.dir=/nonexistent"]) == 2
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={tmp_path / 'run' / 'config.yaml'}"]) == 2
    assert export.main([f"run.dir={tmp_path / 'run'}", "dtpye=float32"]) == 2
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / export.CONFIG).write_text('{"mine": 1}')
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={mine}"]) == 2
    assert (mine / export.CONFIG).read_text() == '{"mine": 1}' and not (mine / export.WEIGHTS).exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and "dtype must be one of" in err[0] and "config.yaml not found" in err[1], err
    assert "config.yaml is a file: the export is a directory" in err[2] and "did you mean 'dtype'" in err[3]
    assert err[4] == f"nljax.export: error: out={mine} holds config.json of something else than an nljax export; choose another directory"
    # prepared data (its tokenizer.json was said to be "of something else than an nljax export")
    from nljax.data import outdir

    data = tmp_path / "prepared"
    data.mkdir()
    (data / outdir.MANIFEST).write_text(json.dumps({"format": outdir.FORMAT}))
    (data / export.TOKENIZER).write_text("{}")
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={data}"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: out={data} holds prepared data (nljax.prepare "
                                               "wrote it): choose another directory")
    under_a_file = tmp_path / "run" / "config.yaml" / "export"  # its parent is a file: no directory there
    # refused before the checkpoint is read, exit 2 as train's run.dir (it was exit 1 once the export was written)
    with mock.patch.object(trained, "load", side_effect=AssertionError("the checkpoint was read")):
        assert export.main([f"run.dir={tmp_path / 'run'}", f"out={under_a_file}"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: out={under_a_file}: {tmp_path / 'run' / 'config.yaml'} "
                                               "is a file, not a directory")
    # into the run's own folder of checkpoints: its resume stopped at the folder nljax did not write
    in_checkpoints = tmp_path / "run" / "checkpoints" / "6"
    with mock.patch.object(trained, "load", side_effect=AssertionError("the checkpoint was read")):
        assert export.main([f"run.dir={tmp_path / 'run'}", f"out={in_checkpoints}"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: out={in_checkpoints} is inside "
                                               f"{tmp_path / 'run' / 'checkpoints'}, which holds a run's checkpoints "
                                               "(its resume would stop at the export's folder): choose another "
                                               "directory")
    assert not in_checkpoints.exists()
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # a folder on the way that is a link to nothing
    with mock.patch.object(trained, "load", side_effect=AssertionError("the checkpoint was read")):
        assert export.main([f"run.dir={tmp_path / 'run'}", f"out={tmp_path / 'gone' / 'export'}"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: out={tmp_path / 'gone' / 'export'}: "
                                               f"{tmp_path / 'gone'} is a symbolic link to {tmp_path / 'nowhere'}, "
                                               "which does not exist")
    assert export.main([f"run.dir={tmp_path / 'run'}"]) == 0  # an earlier export is replaced
    done = tmp_path / "run" / "export"
    capsys.readouterr()
    assert export.main([f"run.dir={done}"]) == 2  # an export of the export: it was "config.yaml not found"
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: {done} is an export directory (nljax.export "
                                               "wrote it), not a run directory: give the run's directory")
    # a run.dir that is a file, out= left to its default (<run.dir>/export): the line named out=
    # ("out=F/export: F is a file"), which the user had not given
    run_file = tmp_path / "run" / "config.yaml"
    assert export.main([f"run.dir={run_file}"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.export: error: {run_file}/config.yaml not found: run.dir must "
                                               "be a run directory written by nljax.train")
    before = {p.name: p.read_bytes() for p in done.iterdir()}

    def cut_short(tree, path, *a, **k):  # Ctrl-C halfway through the weights
        open(path, "wb").write(b"half")
        raise KeyboardInterrupt

    import safetensors.flax
    monkeypatch.setattr(safetensors.flax, "save_file", cut_short)
    assert export.main([f"run.dir={tmp_path / 'run'}", "dtype=bfloat16"]) == 130
    assert {p.name: p.read_bytes() for p in done.iterdir()} == before  # the earlier export, whole
    with pytest.raises(nljax.errors.ConfigError, match="not a directory written by nljax.export"):
        nljax.load_model(tmp_path)


def test_an_unwritable_out_is_one_line_and_exit_2_before_the_checkpoint_is_read(tmp_path, capsys, monkeypatch):
    """out= in a folder this user cannot write (as on a read-only file system): one line and exit 2,
    as nljax.train refuses such a run.dir, and nothing read or written; it was exit 1, once the
    checkpoint was read and gathered."""
    locked = tmp_path / "locked"
    locked.mkdir()
    lock(locked, monkeypatch)
    try:
        saved_run(tmp_path / "run", TINY_NL, 1, 1, steps=1)
        for out in (locked / "export", locked):
            with mock.patch.object(trained, "load", side_effect=AssertionError("the checkpoint was read")):
                assert export.main([f"run.dir={tmp_path / 'run'}", f"out={out}"]) == 2
            where = f"out={out}" + ("" if out == locked else f": {locked}")
            assert capsys.readouterr().err.strip() == f"nljax.export: error: {where} is not writable"
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


class PlainParams(NamedTuple):
    embed: jax.Array
    out: jax.Array


@dataclasses.dataclass(frozen=True)
class Plain:
    """A model of plain JAX, its parameters a NamedTuple (no flax), a bigram table."""

    vocab: int
    dim: int
    seen: list = dataclasses.field(default_factory=list, compare=False)  # the paths level_of was given

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return PlainParams(jax.random.normal(k1, (self.vocab, self.dim)), jax.random.normal(k2, (self.dim, self.vocab)))

    def level_of(self, path):
        self.seen.append(path)
        return 0

    def init_memory(self, rows):
        return {}

    def logits(self, params, memory, batch, key=None):
        return params.embed[batch["tokens"][:, :-1]] @ params.out, memory

    def apply(self, params, memory, batch, key):
        from nljax.models.blocks import token_loss

        logits, memory = self.logits(params, memory, batch, key)
        return (*token_loss(logits, batch["tokens"][:, 1:]), memory)


def test_parameters_of_any_pytree_export_and_load(tmp_path):
    """Parameters a NamedTuple (a model of plain JAX) trained and checkpointed, but the export
    flattened them with flax's flatten_dict: an AssertionError's traceback. They are named by their
    paths ('embed', as level_of is given them: '.embed' before) and load back as the NamedTuple."""
    from nljax.models import specs

    model = Plain(256, 8)
    nljax.register_model("plain", lambda cfg: model)
    try:
        setup, state = saved_run(tmp_path / "run", ["model.name=plain", "cms.periods=[1]", "train.seq_len=16",
                                                    "train.batch_size=4"], 1, 1)
        assert set(model.seen) == {"embed", "out"}
        t = trained.load(tmp_path / "run", devices=jax.devices()[:1])
        (tmp_path / "export").mkdir()  # an earlier export's tokenizer.json: this export writes none
        (tmp_path / "export" / "tokenizer.json").write_text("{}")
        loaded_model, loaded = nljax.load_model(export.export(t, tmp_path / "export"))
        assert not (tmp_path / "export" / "tokenizer.json").exists()
        assert isinstance(loaded, PlainParams)
        want = jax.device_get(setup.engine.strategy.gather_params(state.params))
        for a, b in zip(loaded, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        specs.unregister("plain")


@pytest.mark.slow  # a DiT run of its own, loaded and sampled: the README's suite kept under 15 minutes
def test_an_image_run_loads_and_exports_without_its_images(tmp_path, capsys):
    """nljax.load and nljax.export of a DiT run build the model from what its checkpoint recorded
    of its images (their shape, the labels and their names): with the images moved away (it was
    "images.path ... not found"), it samples as before, by class name too, and exports; the
    grid of nljax.generate, drawn beside the held-out images, still reads them (one line)."""
    from PIL import Image

    from nljax import generate
    from nljax.data import images

    rng = np.random.default_rng(0)
    folder = tmp_path / "pets"
    for name in ("cat", "dog"):
        (folder / name).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (4, 4, 3), np.uint8)).save(folder / name / f"{i}.png")
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=2", "images.source=file", f"images.path={folder}", "cms.periods=[1]",
           "train.batch_size=8"]
    setup, state = saved_run(tmp_path / "run", dit, 1, 1, steps=1)
    folder.rename(tmp_path / "moved")
    images.load.cache_clear()  # as in a process of its own: the training's images are not at hand
    lm = nljax.load(tmp_path / "run")
    assert lm.model == setup.engine.model and lm.model.classes == ("cat", "dog")
    z, t, r = np.zeros((2, 4, 4, 3), np.float32), np.array([0.9, 0.5]), np.array([0.1, 0.5])
    want = setup.engine.model.velocity(jax.device_get(state.params))(z, t, r, np.array([1, 0]))
    np.testing.assert_array_equal(lm.model.velocity(lm.params)(z, t, r, np.array([1, 0])), want)
    assert lm.generate(labels=["dog", "cat"], steps=1).shape == (2, 4, 4, 3)
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={tmp_path / 'export'}"]) == 0
    assert_trees_equal(nljax.load_model(tmp_path / "export")[1], jax.device_get(state.params))
    capsys.readouterr()
    assert generate.main([f"run.dir={tmp_path / 'run'}", f"out={tmp_path / 'grid.png'}"]) == 2
    assert f"{folder}" in capsys.readouterr().err


def test_out_with_hidden_files_is_refused_unless_an_earlier_export(tmp_path):
    """A directory of dotfiles (out=~) is a user's: refused; an earlier export's stray hidden file
    (a desktop's .DS_Store) is not."""
    from nljax.runtime.exportdir import CONFIG, WEIGHTS

    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("")
    with pytest.raises(ConfigError, match=r"holds .*\.bashrc"):
        export.check_out(home)
    done = tmp_path / "done"
    done.mkdir()
    (done / WEIGHTS).write_text("")
    (done / CONFIG).write_text('{"config": {}, "step": 1, "dtype": "float32", "checkpoint": "x"}')
    (done / ".DS_Store").write_text("")
    export.check_out(done)
