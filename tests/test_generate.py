"""Generation: the sampling rules, windowed decoding that continues the stream exactly as training
reads it, the same tokens on 1 and 8 devices from a run trained under fsdp, images from a
MeanFlow run, and one-line errors."""

import jax
import numpy as np
import pytest
from PIL import Image
from helpers import TINY_NL, assert_trees_equal, saved_run

from nljax import generate
from nljax.errors import ConfigError
from nljax.run import sampling, trained

# TINY_NL at train.seq_len 8: a 30-token generation crosses several windows of the memory
NL = TINY_NL
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    setup, state = saved_run(run_dir, [*NL, "sync.strategy=fsdp"], 2, 4)
    return run_dir, jax.device_get(setup.engine.strategy.gather_params(state.params))


def test_sampling_rules():
    logits = np.array([0.0, 3.0, 1.0, 2.5, -1.0])
    rng = np.random.default_rng(0)
    s = sampling.Settings
    assert sampling.sample_token(logits, rng, s(temperature=0)) == 1
    assert {sampling.sample_token(logits, rng, s(temperature=5, top_k=1)) for _ in range(20)} == {1}
    assert {sampling.sample_token(logits, rng, s(temperature=5, top_k=2)) for _ in range(200)} == {1, 3}
    # exactly k tokens when logits tie at the k-th place (bfloat16 logits often do): the lower ids
    tied = np.array([2.0, -5.0, 2.0, 2.0, 2.0])
    assert {sampling.sample_token(tied, rng, s(temperature=1, top_k=1)) for _ in range(50)} == {0}
    assert {sampling.sample_token(tied, rng, s(temperature=1, top_k=3)) for _ in range(200)} == {0, 2, 3}
    # top_p: token 1 alone has p ~ 0.53 at temperature 1, so top_p 0.5 keeps it alone
    assert {sampling.sample_token(logits, rng, s(temperature=1, top_p=0.5)) for _ in range(50)} == {1}
    # the frequencies of n draws within 4.5 standard deviations of softmax(logits / temperature),
    # every token drawn (a sampler off by 15% in temperature, or never drawing the least likely
    # token, fails here)
    n = 20_000
    for temperature in (1.0, 2.0):
        draws = [sampling.sample_token(logits, rng, s(temperature=temperature)) for _ in range(n)]
        p = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        freq = np.bincount(draws, minlength=5) / n
        assert np.all(np.abs(freq - p) <= 4.5 * np.sqrt(p * (1 - p) / n)), (temperature, freq, p)
    # a temperature so small that logits / temperature overflows: the most likely token, no NaN
    assert {sampling.sample_token(logits, rng, s(temperature=1e-320)) for _ in range(5)} == {1}



class _Recorded:
    """A generator stand-in that records the probabilities `sample_token` draws from."""

    def choice(self, n, p):
        self.p = np.array(p)
        return 0


def test_sampling_edges():
    s = sampling.Settings
    rec = _Recorded()
    # top_p keeps the smallest set whose probability reaches p: at exactly p, no more
    halves = np.log([0.5, 0.25, 0.25])
    sampling.sample_token(halves, rec, s(temperature=1, top_p=0.5))
    np.testing.assert_array_equal(rec.p, [1.0, 0.0, 0.0])
    # a top_p just under 1 drops the tail it leaves out
    sampling.sample_token(np.array([0.0, np.log(0.004 / 0.996)]), rec, s(temperature=1, top_p=0.995))
    np.testing.assert_array_equal(rec.p, [1.0, 0.0])
    # ties at the k-th place go to the lower ids in a byte vocabulary too (numpy's default sort
    # is not stable over 16 elements)
    tied = np.tile([1.0, 0.0], 128)  # 128 tokens tie at the top
    sampling.sample_token(tied, rec, s(temperature=1, top_k=40))
    assert set(np.flatnonzero(rec.p)) == set(range(0, 80, 2))


@pytest.mark.parametrize("settings,words", [
    ({"samples": 0}, "samples must be >= 1, got 0"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ({"top_k": True}, "top_k must be an integer, got bool True"),
    ({"stop_at_eos": "false"}, "stop_at_eos must be true or false, got 'false'"),
])
def test_settings_refused(settings, words):
    with pytest.raises(ConfigError) as e:
        sampling.Settings(**settings).check()
    assert words in str(e.value)


def test_settings_at_their_bounds_are_taken(tmp_path):
    s = sampling.Settings
    assert s(temperature=0).check().temperature == 0  # greedy
    assert s(seed=2**63 - 1).check().seed == 2**63 - 1
    assert s(out=str(tmp_path / "GRID.PNG")).check().out.endswith("GRID.PNG")  # the suffix in any case
    assert sampling.label_items("3, 7 ,cat") == ["3", "7", "cat"]  # spaces around the commas are not the name


def test_greedy_decoding_continues_the_stream_as_training_reads_it(fsdp_run):
    """Greedy tokens, fed back through the model as training reads a stream (`ContextStream`:
    windows of T, the memory carried, reset at the start and after a window holding a document's
    end), are each the argmax at their position: the padded partial windows and the
    window-by-window memory writes of decoding change nothing (training's windows are filled past
    the text with other tokens than decoding's padding: reads are causal). The memory's output
    projection is made large, so that what the memory holds decides the tokens (a tiny trained
    memory barely moves them), and the prompt ends a document in its second window."""
    import dataclasses

    from nljax.data.text import SEPARATOR, ContextStream

    run_dir, _ = fsdp_run
    t = trained.load(run_dir, devices=jax.devices()[:1])
    params = jax.tree.map(lambda x: x, t.params)
    out = params["mem0"]["out"]["kernel"]
    params["mem0"]["out"]["kernel"] = 3 * jax.random.normal(jax.random.key(0), out.shape, out.dtype)
    t = dataclasses.replace(t, params=params)
    prompt = "def f(x):\n\0  return"  # 19 bytes: two full windows of 8 (a NUL in the second) and a partial one
    out = sampling.generate_text(t, sampling.Settings(prompt=prompt, max_new_tokens=30, temperature=0), lambda _: None)
    seq, T = list(prompt.encode()) + out, t.cfg.train.seq_len
    stream = ContextStream(np.array(seq, np.uint8), rows=1, seq_len=T)  # cyclic: the last window wraps
    memory, preds, resets = t.model.init_memory(1), [], []
    for w in range(-(-len(seq) // T)):
        batch = stream.rows_at(w, slice(0, 1))
        logits, memory = t.model.logits(t.params, memory, batch)
        preds += np.argmax(np.asarray(logits)[0], -1).tolist()
        resets.append(bool(batch["reset"][0]))
    assert SEPARATOR == 0 and resets[:4] == [True, False, True, False]  # the prompt's NUL resets window 2
    assert preds[len(prompt) - 1 : len(seq) - 1] == out


def test_same_tokens_on_one_and_eight_devices(fsdp_run):
    """An fsdp run's checkpoint restored onto 1 and onto 8 devices gives the same parameters, bit
    for bit (the content of this test); the sampler then runs a replicated program on either, so
    the tokens agreeing follows from that (checked as the end-to-end symptom a user would see)."""
    run_dir, params = fsdp_run
    s = sampling.Settings(prompt="import ", max_new_tokens=20, temperature=1.0, top_k=50, seed=3)
    runs = [trained.load(run_dir, devices=jax.devices()[:n]) for n in (1, 8)]
    for t in runs:  # the whole tree, gathered from the fsdp shards
        assert_trees_equal(jax.device_get(t.params), params)
    one, eight = (sampling.generate_text(t, s, lambda _: None) for t in runs)
    assert runs[0].skipped == () and runs[0].warnings("nljax.generate") == []
    assert one == eight and len(one) == 20
    assert one != sampling.generate_text(runs[0], sampling.Settings(**{**vars(s), "seed": 4}), lambda _: None)


@pytest.fixture(scope="module")
def moons_run(tmp_path_factory):
    """A class-conditional MeanFlow run on the moons (2 classes), one step, on a (1, 2) mesh."""
    run_dir = tmp_path_factory.mktemp("moons") / "run"
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=1", "images.source=moons", "images.toy_points=80", "cms.periods=[1]",
           "train.batch_size=16", "meanflow.sample_steps=2"]
    saved_run(run_dir, dit, 1, 2, steps=1)
    return run_dir


def test_meanflow_run_writes_a_sample_grid(moons_run, tmp_path, capsys, monkeypatch):
    run = moons_run
    out = tmp_path / "grid.png"
    assert generate.main([f"run.dir={run}", f"out={out}", "samples=6"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread as pixels  # the grid as drawn, not the PNG's bytes

    first = pixels(out)
    assert generate.main([f"run.dir={run}", f"out={out}", "samples=6"]) == 0  # its own grid: replaced
    # seed= draws other noise (it was ignored: every seed gave the same grid); the run's seed (0)
    # is the default
    assert generate.main([f"run.dir={run}", f"out={out}", "samples=6", "seed=0"]) == 0
    np.testing.assert_array_equal(pixels(out), first)
    assert generate.main([f"run.dir={run}", f"out={out}", "samples=6", "seed=5"]) == 0
    assert not np.array_equal(pixels(out), first)
    # more samples than held-out labels: said (the grid was cut to them in silence)
    capsys.readouterr()
    assert generate.main([f"run.dir={run}", f"out={out}", "samples=500"]) == 0
    assert ("nljax.generate: samples=500: the run holds 16 held-out images, one sample for each one's label: "
            "drawing 16") in capsys.readouterr().err.splitlines()
    # a user's PNG of that name is never replaced; text settings on an image run are refused (both
    # were accepted, exit 0: the user's picture overwritten, prompt= ignored)
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    capsys.readouterr()
    assert generate.main([f"run.dir={run}", f"out={mine}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nljax.generate: error: out={mine} exists and is not a PNG nljax.generate wrote; give another out= or move it")
    assert mine.read_bytes().endswith(b"a user's picture")
    assert generate.main([f"run.dir={run}", "prompt=a cat", f"out={tmp_path / 'g2.png'}"]) == 2
    assert "prompt= is for a language model; this run's model is dit" in capsys.readouterr().err
    # a directory where no file can be made (Linux's /proc): one line, exit 2, before the checkpoint is read
    assert generate.main([f"run.dir={run}", "out=/proc/nljax_grid.png"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "nljax.generate: error: out=/proc/nljax_grid.png: /proc is not writable"]
    # a write that fails all the same (a disk filled meanwhile): one line naming the file, exit 1
    monkeypatch.setattr("nljax.runtime.resultfile.unwritable", lambda path: None)
    assert generate.main([f"run.dir={run}", "out=/proc/nljax_grid.png"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("nljax.generate: error: cannot write "
                                                               "/proc/nljax_grid.png: No such file or directory")
    monkeypatch.undo()
    # its export holds no held-out images to draw samples= for: the classes are asked for
    from nljax import export

    export.export(trained.load(run, devices=jax.devices()[:1]), tmp_path / "export")
    assert generate.main([f"run.dir={tmp_path / 'export'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nljax.generate: error: {tmp_path / 'export'} is the export of a class-conditional image model: give the "
        "classes to draw, labels=0,1,2 (samples= draws for held-out images, which the run directory has)")


@pytest.mark.slow  # its run (the moons_run fixture) is the slow tier's, as the grid test's above
def test_a_grid_of_the_classes_labels_names(moons_run, tmp_path, capsys, monkeypatch):
    """labels= draws one sample per class it names (numbers, comma-separated or a JSON list; the
    null class K too), the samples Python's nljax.load(run).generate(labels=, seed=) draws for them
    (its noise keyed by the sample's place); refused in one line where it cannot apply."""
    import nljax
    from nljax.measure import figures

    drawn = {}
    monkeypatch.setattr(figures, "write_samples", lambda path, one, multi, ref, steps, labels, *a: drawn.update(
        one=one, multi=multi, labels=labels))
    run, out = str(moons_run), f"out={tmp_path / 'g.png'}"
    assert generate.main([f"run.dir={run}", out, "labels=1,0,1,2", "seed=3"]) == 0
    lm = nljax.load(run)
    np.testing.assert_array_equal(drawn["labels"], [1, 0, 1, 2])
    np.testing.assert_allclose(drawn["one"], lm.generate(labels=[1, 0, 1, 2], seed=3), atol=1e-5)
    np.testing.assert_allclose(drawn["multi"], lm.generate(labels=[1, 0, 1, 2], steps=2, seed=3), atol=1e-5)
    assert not np.allclose(drawn["one"][0], drawn["one"][2])  # two samples of one class: their own noise
    first = drawn["one"]
    assert generate.main([f"run.dir={run}", out, "labels=[1, 0, 1, 2]", "seed=3"]) == 0  # a JSON list
    np.testing.assert_array_equal(drawn["one"], first)
    # its export draws the same grid (out= outside it), its classes checked before its weights are read
    from nljax import export

    export.export(trained.load(run, devices=jax.devices()[:1]), tmp_path / "export")
    exported = {}
    monkeypatch.setattr(generate, "write_samples", lambda path, one, multi, ref, steps, labels, *a: exported.update(
        one=one, multi=multi, labels=labels))
    assert generate.main([f"run.dir={tmp_path / 'export'}", out, "labels=1,0,1,2", "seed=3"]) == 0
    for key in ("one", "multi"):
        np.testing.assert_allclose(exported[key], drawn[key], atol=1e-5)
    np.testing.assert_array_equal(exported["labels"], [1, 0, 1, 2])
    capsys.readouterr()
    for args, line in [
        (["labels=1"], f"{tmp_path / 'export'} is an export: give out=FILE.png, the grid's file (outside the export "
                       "directory)"),
        ([out, "labels=3"], "labels must be a class, 0 to 1, or 2 for no class (unconditional samples), got 3")]:
        assert generate.main([f"run.dir={tmp_path / 'export'}", *args]) == 2
        assert capsys.readouterr().err.strip() == f"nljax.generate: error: {line}"
    for args, line in [
        (["labels=1", "samples=4"], "samples= and labels= together: labels= draws one sample per class it names"),
        (["labels=1,,0"], "labels=1,,0: an empty class; give classes separated by commas, as labels=3,3,7"),
        (["labels=[1"], "labels=[1: a value that begins with [ is a JSON list of classes, and this is not JSON"),
        (["labels=3"], "labels must be a class, 0 to 1, or 2 for no class (unconditional samples), got 3"),
        (["labels=cat"], "labels must be class numbers or, for a run on a folder, class names (its data name no "
                         "classes); got 'cat'"),
        (["labels=1", "meanflow.class_cond=false"], "labels=: this run's model (dit) is unconditional "
                                                    "(meanflow.class_cond=false): its samples have no class; samples=N "
                                                    "draws N"),
    ]:
        assert generate.main([f"run.dir={run}", out, *args]) == 2, args
        err = capsys.readouterr().err.strip()  # before the checkpoint is read: the line alone
        assert err.startswith(f"nljax.generate: error: {line}") and "\n" not in err, (args, err)


def test_labels_are_read_as_the_runs_classes(tmp_path):
    """`labels=` against the run's images, before any checkpoint is read: images without labels
    (an .npy's) refused in one line; a folder's class names, a name read before a number."""
    from nljax.config import load
    from nljax.data import images

    np.save(tmp_path / "x.npy", np.zeros((10, 4, 4), np.uint8))  # the model reads no label
    data = images.load(load(None, ["images.source=file", f"images.path={tmp_path / 'x.npy'}"]).images)
    with pytest.raises(ConfigError, match="^labels=: the model reads no labels .its images have none.: its samples "
                                          "have no class; samples=N draws N$"):
        sampling.grid_labels("1", data.classes, data.num_classes)
    # a folder's class names, a name read before a number (the folder `10` is label 1 of 00, 10, 2)
    for name in ("00", "10", "2"):
        (tmp_path / "f" / name).mkdir(parents=True)
        for k in range(2):
            Image.fromarray(np.full((4, 4), k, np.uint8)).save(tmp_path / "f" / name / f"{k}.png")
    data = images.load(load(None, ["images.source=file", f"images.path={tmp_path / 'f'}"]).images)

    def folder_labels(value):
        return sampling.grid_labels(value, data.classes, data.num_classes)

    assert folder_labels("10,2,0,1,3").tolist() == [1, 2, 0, 1, 3]
    assert folder_labels('["2", 0]').tolist() == [2, 0]
    for value, line in [("4", "labels must be a class, 0 to 2, or 3 for no class (unconditional samples), got 4"),
                        ("cat", "labels must be class numbers or, for a run on a folder, class names (its classes: "
                                "00, 10, 2); got 'cat'"),
                        # a negative number is out of range, not an unknown name; '²' (isdigit) no int() traceback
                        ("-1", "labels must be a class, 0 to 2, or 3 for no class (unconditional samples), got -1"),
                        ("²", "labels must be class numbers or, for a run on a folder, class names (its classes: "
                              "00, 10, 2); got '²'"),
                        ("1,,0", "labels=1,,0: an empty class; give classes separated by commas, as labels=3,3,7"),
                        ('[1, true]', "labels=[1, true]: give a JSON list of class numbers or names, as "
                                      "labels='[3, 7]'")]:
        with pytest.raises(ConfigError) as e:
            folder_labels(value)
        assert str(e.value) == line
    with pytest.raises(ConfigError, match="^labels=1,,0: an empty class"):  # its form: as the settings are read
        sampling.parse(["run.dir=x", "labels=1,,0"])


def test_an_unconditional_image_models_export_draws_samples(tmp_path, capsys, monkeypatch):
    """An export of a model that reads no labels (images without any): samples=N draws N, as
    nljax.load(DIR).generate(labels=[0] * N, seed=) does; labels= is refused in one line. Built,
    not trained: fast."""
    from types import SimpleNamespace

    import nljax
    from nljax import export
    from nljax.config import load
    from nljax.models.builtin import dit

    cfg = load(None, ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
                      "model.dit.patch_size=2", "cms.periods=[1]", "seed=3", "meanflow.sample_steps=2"])
    model = dit(cfg, (4, 4, 1), 0)
    params = jax.tree.map(lambda p: p + 0.1, model.init(jax.random.key(0)))  # adaLN-zero's output is 0 at init
    export.export(SimpleNamespace(params=params, cfg=cfg, trained_cfg=cfg, model=model, step=0, path="built",
                                  params_read="trained"), tmp_path / "export")
    drawn = {}
    monkeypatch.setattr(generate, "write_samples", lambda path, one, multi, ref, steps, labels, *a: drawn.update(
        one=one, multi=multi, labels=labels, steps=steps))
    out = f"out={tmp_path / 'g.png'}"
    assert generate.main([f"run.dir={tmp_path / 'export'}", out, "samples=3", "seed=5"]) == 0
    lm = nljax.load(tmp_path / "export")
    np.testing.assert_allclose(drawn["one"], lm.generate(labels=[0] * 3, seed=5), atol=1e-6)
    np.testing.assert_allclose(drawn["multi"], lm.generate(labels=[0] * 3, steps=2, seed=5), atol=1e-6)
    assert drawn["labels"] is None and drawn["steps"] == 2 and not np.allclose(drawn["one"][0], drawn["one"][1])
    # without seed=: the run's seed (3), as nljax.load's generate draws by default, not seed='s own default
    assert generate.main([f"run.dir={tmp_path / 'export'}", out, "samples=3"]) == 0
    np.testing.assert_allclose(drawn["one"], lm.generate(labels=[0] * 3), atol=1e-6)
    capsys.readouterr()
    assert generate.main([f"run.dir={tmp_path / 'export'}", out, "labels=1"]) == 2
    assert capsys.readouterr().err.strip() == ("nljax.generate: error: labels=: the model reads no labels (its images "
                                               "have none): its samples have no class; samples=N draws N")
    # a grid inside the export directory: refused (nljax.export then refused to write there again)
    assert generate.main([f"run.dir={tmp_path / 'export'}", f"out={tmp_path / 'export' / 'g.png'}", "samples=2"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.generate: error: {tmp_path / 'export'} is an export: give "
                                               "out=FILE.png, the grid's file (outside the export directory)")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "model.safetensors"]


def test_labels_is_for_an_image_grid(fsdp_run, capsys):
    assert generate.main([f"run.dir={fsdp_run[0]}", "labels=1"]) == 2
    assert capsys.readouterr().err.strip() == ("nljax.generate: error: labels= is for a MeanFlow (model.name=dit) "
                                               "run's image grid; this run's model is nl_lm")


def test_another_sampler_or_held_out_split_than_the_runs_is_said(tmp_path, capsys):
    """meanflow.loss= other than the run's picks the other sampler (taken in silence before): a
    MeanFlow net sampled by flow matching (Euler steps of u(z, t, t), which its loss trains on its
    r = t share) is warned of; a flow-matching net sampled as MeanFlow (an h = t - r it never saw)
    is refused in one line, by nljax.generate and nljax.evaluate alike, before anything is
    restored. images.eval_fraction= other than the run's holds out other images (the grid's
    labels and references, evaluate's scores): warned of, naming the key and both values."""
    from nljax import evaluate

    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=1", "images.source=moons", "images.toy_points=80", "cms.periods=[1]",
           "train.batch_size=16"]
    mf, fm = tmp_path / "mf", tmp_path / "fm"
    saved_run(mf, dit, 1, 1, steps=0)
    saved_run(fm, [*dit, "meanflow.loss=flow_matching"], 1, 1, steps=0)
    one = jax.devices()[:1]
    assert trained.load(mf, devices=one).warnings("nljax.generate") == []
    assert trained.load(mf, overrides=["meanflow.loss=meanflow", "images.eval_fraction=0.2"],
                        devices=one).warnings("nljax.generate") == []  # the run's own values
    # as nljax.generate reads it (its grid is drawn beside the held-out images: they are read)
    t = trained.load(mf, overrides=["meanflow.loss=flow_matching", "images.eval_fraction=0.25",
                                    "images.toy_points=100"], devices=one, reads_data=True)
    assert t.warnings("nljax.generate") == [
        f"nljax.generate: warning: meanflow.loss=flow_matching: the run trained with meanflow.loss=meanflow "
        f"({mf / 'config.yaml'}); sampling with flow matching's Euler steps of u(z, t, t), not the run's MeanFlow "
        "sampler: the samples and scores are not the run's",
        f"nljax.generate: warning: images.eval_fraction=0.25 holds out other examples than the run's (0.2 in "
        f"{mf / 'config.yaml'}): the held-out data are not those the run was scored on",
        f"nljax.generate: warning: images.toy_points=100 holds out other examples than the run's (80 in "
        f"{mf / 'config.yaml'}): the held-out data are not those the run was scored on"]
    for tool in (generate, evaluate):
        capsys.readouterr()
        assert tool.main([f"run.dir={fm}", "meanflow.loss=meanflow"]) == 2
        assert capsys.readouterr().err == (
            f"{tool.__name__}: error: meanflow.loss=meanflow: the run trained with meanflow.loss=flow_matching "
            f"({fm / 'config.yaml'}), whose net never saw r != t, and MeanFlow's sampler asks it for u(z, t, r) over "
            "[r, t]: leave meanflow.loss out (the run's own sampler)\n")


def _ended(text, stops=(), end_id=0, budget=None):
    """(the pieces `stopping.pieces` gives for `text` (its UTF-8 bytes, or bytes), a byte token
    each, the first `budget`, the text, the reason)."""
    from nljax.data.tokenization import Bytes
    from nljax.run.stopping import Ending, pieces

    tokens = list(text if isinstance(text, bytes) else text.encode("utf-8"))[:budget]
    end = Ending(Bytes().decoder(), stops, end_id)
    out = list(pieces(iter(tokens), end))
    assert "".join(out) == end.text  # the stream's pieces are the text
    return out, end.text, end.reason


def test_where_a_completion_ends():
    """At the end token (not part of the text; a character it cuts short is U+FFFD), before the
    first stop string the text holds (across tokens; the earliest of those found when one is
    completed), or at the budget's end; a stream holds back what may begin a stop string."""
    assert _ended("ab\0cd")[1:] == ("ab", "eos")
    assert _ended("ab\0cd", end_id=None)[1:] == ("ab\0cd", "length")  # stop_at_eos=false
    assert _ended("\0ab")[1:] == ("", "eos")
    assert _ended(b"a\xc3\0b")[1:] == ("a\ufffd", "eos")
    assert _ended("caf\xe9!", budget=4)[1:] == ("caf\ufffd", "length")
    pieces, text, why = _ended("one\n\ntwo", stops=["\n\n"])
    assert (text, why) == ("one", "stop")
    assert pieces == ["o", "n", "e", "", ""]  # the first line's end held back, then dropped
    assert _ended("one\ntwo\n", stops=["\n\n"])[0] == ["o", "n", "e", "", "\nt", "w", "o", "", "\n"]
    assert _ended("xabcd", stops=["abcd", "bc"])[1:] == ("xa", "stop")  # "bc" is met first
    assert _ended("xabcd", stops=["bcd", "ab"])[1:] == ("x", "stop")
    assert _ended("日本語です", stops=["本語"])[1:] == ("日", "stop")  # characters of three bytes
    assert _ended("ab\0", stops=["b"])[1:] == ("a", "stop")
    assert _ended("abc", stops=["bcd"])[1:] == ("abc", "length")  # held back, then given at the end
    assert _ended("ab", stops=["c"], budget=0)[1:] == ("", "length")


def test_a_tokenizers_text_ends_alike(tmp_path):
    """With a tokenizer.json: stop strings are looked for in the text decoded after the prompt (a
    SentencePiece-style decoder's leading space read as the sampled text has it), across tokens;
    the end token is data.doc_end_token's, its text ("<eos>") not part of the completion."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from nljax.data import tokenization
    from nljax.run.stopping import ending, pieces

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "\u2581the": 1, "\u2581quick": 2, "\u2581fox": 3, "<eos>": 4},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = tokenization.load(str(tmp_path / "tokenizer.json"), "<eos>")
    prompt = codec.encode("the")

    def ended(tokens, stops=(), stop_at_eos=True):
        end = ending(codec, prompt, stops, stop_at_eos)
        return "".join(pieces(iter(tokens), end)), end.reason

    assert ended([2, 3, 1]) == (" quick fox the", "length")
    assert ended([2, 3, 1], stops=["ck f"]) == (" qui", "stop")
    assert ended([2, 4, 3]) == (" quick", "eos")
    assert ended([2, 4, 3], stop_at_eos=False) == (" quick<eos> fox", "length")


def test_stop_settings_on_the_command_line():
    """stop=TEXT is one stop string as it stands; stop=[...] a JSON list (its escapes: a line's
    end); stop_at_eos= true or false (default true)."""
    def settings(*pairs):
        return sampling.parse(["run.dir=r", *pairs])[0]

    assert settings().stop == () and settings().stop_at_eos is True
    assert settings("stop=###").stop == ("###",)
    assert settings("stop=\\n").stop == ("\\n",)  # as it stands: no escapes
    assert settings('stop=["\\n\\n", "def "]').stop == ("\n\n", "def ")
    assert settings("stop_at_eos=false").stop_at_eos is False


@pytest.mark.parametrize("args,line", [
    (["prompt=x"], "run.dir=DIR is required"),
    (["run.dir=/nonexistent/run"], "/nonexistent/run is neither an export directory (python -m nljax.export) nor a "
                                   "run directory"),
    (["run.dir=/tmp", "top_p=0"], "0 < top_p <= 1"),
    (["run.dir=/tmp", "max_new_tokens=many"], "max_new_tokens='many' is not an integer"),
    (["run.dir=/tmp", "seed=-1"], "seed must be in [0, 2^63), got -1"),
    (["run.dir=/tmp", "temperature=nan"], "temperature must be finite and >= 0 (0: greedy), got nan"),
    # each named with its value (the line named all four and listed their values in order)
    (["run.dir=/tmp", "max_new_tokens=-5"], "max_new_tokens must be >= 0, got -5"),
    (["run.dir=/tmp", "top_k=-1"], "top_k must be >= 0 (0: every token), got -1"),
    (["run.dir=/tmp", "temperature=-1"], "temperature must be finite and >= 0 (0: greedy), got -1.0"),
    (["run.dir=/tmp", "top_p=2"], "top_p must be in 0 < top_p <= 1, got 2.0"),
    # a language model's user, who wanted the text in a file, learns where it goes too
    (["run.dir=/tmp", "out=README.md"], "out=README.md: the image grid is a PNG, give a file name ending in .png (a "
                                        "language model's out= is the results of prompts=FILE, a .jsonl file; the "
                                        "text of prompt= goes to the terminal)"),
    (["run.dir=/tmp", "temprature=0.5"], "unknown setting 'temprature': did you mean 'temperature'?"),
    (["run.dir=/tmp", "length=5"], "unknown setting 'length' (settings: prompt, max_new_tokens, "),
    (["run.dir=/tmp", "stop="], "stop is empty: a stop string ends a completion where it appears, and an empty one "
                                "appears before the first character"),
    (["run.dir=/tmp", "stop=[\"a\", \"\"]"], "stop[1] is empty: "),
    (["run.dir=/tmp", "stop=[1]"], "stop=[1]: give a JSON list of strings, as stop='[\"\\n\\n\", \"def \"]'"),
    (["run.dir=/tmp", "stop=[a"], "stop=[a: a value that begins with [ is a JSON list of strings, and this is not "
                                  "JSON (Expecting value"),
    (["run.dir=/tmp", "stop=[END]"], "; to stop at the text itself, give it in a list: stop='[\"[END]\"]'"),
    (["run.dir=/tmp", "stop=a", "stop=b"], "stop= is given more than once: give the stop strings in one JSON list"),
    (["run.dir=/tmp", "stop_at_eos=no"], "stop_at_eos='no': give true or false"),
    (["run.dir=/tmp", "stop_at_eos=True"], "stop_at_eos='True': give true or false"),
    (["run.dir=/tmp", "out=/nonexistent/dir/g.png"], "out=/nonexistent/dir/g.png: directory /nonexistent/dir does not exist"),
    (["run.dir=/tmp", "out=/tmp"], "out=/tmp is a directory"),
    # a folder no file can be made in (a read-only mount, /proc; root's os.access says yes): the
    # write failed after the checkpoint was read and the samples drawn
    (["run.dir=/tmp", "out=/proc/g.png"], "out=/proc/g.png: /proc is not writable"),
    # an image run's user learns where its grid goes, not only that prompts= is missing
    (["run.dir=/tmp", "out=g.jsonl"], "out=g.jsonl: JSON lines are the results of prompts=FILE, which is not given "
                                      "(a language model's); a MeanFlow (model.name=dit) run's out= is its image grid, "
                                      "a .png file"),
])
def test_bad_arguments_are_one_line(args, line, capsys):
    assert generate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and line in err, err


@pytest.mark.slow
def test_a_run_on_own_files_generates_from_any_directory(tmp_path, monkeypatch, capsys):
    """config.yaml records the data paths absolute: a run trained on files named relative to where
    it started generates from another directory (export reads the run the same way, trained.load)."""
    import yaml
    from helpers import cli

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "corpus").mkdir(parents=True)
    elsewhere.mkdir()
    for i in range(20):
        (work / "corpus" / f"d{i}.txt").write_text(f"document {i} says hello. " * 20)
    cli("nljax.train", "--quiet", "--cpu-devices", "1", *NL, "data.source=files", "data.train=corpus/*.txt",
        "train.steps=2", "train.seq_len=16", "train.batch_size=4", "eval.stream_steps=0", "run.dir=run", cwd=work)
    data = yaml.safe_load((work / "run" / "config.yaml").read_text())["data"]
    assert data["train"] == [str(work / "corpus" / "*.txt")]
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert generate.main([f"run.dir={work / 'run'}", "max_new_tokens=5", "prompt=doc"]) == 0
    assert capsys.readouterr().out.startswith("doc")
    # a config.yaml written before (paths as given): generate reads no text (tasks.LoadedText), so
    # a relative data.train is no matter; a relative tokenizer it must read is one line saying why
    cfg = yaml.safe_load((work / "run" / "config.yaml").read_text())
    cfg["data"]["train"] = ["corpus/*.txt"]
    (work / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert generate.main([f"run.dir={work / 'run'}", "max_new_tokens=5", "prompt=doc"]) == 0
    capsys.readouterr()
    cfg["data"]["tokenizer"] = "tok/tokenizer.json"
    (work / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert generate.main([f"run.dir={work / 'run'}", "max_new_tokens=5"]) == 2
    # one line, found as the model is built: after the progress line that says so
    reading, err = capsys.readouterr().err.strip().splitlines()
    assert reading == f"nljax.generate: reading the checkpoint of {work / 'run'} ..."
    assert "data.tokenizer in " in err and "is relative to the directory the run was started in" in err, err


def test_a_damaged_newest_checkpoint_is_named_and_text_runs_refuse_out(tmp_path, capsys):
    from helpers import save, truncate

    run = tmp_path / "run"
    setup, state = saved_run(run, NL, 1, 1, steps=1)
    save(setup, state, 2)
    truncate(run / "checkpoints" / "2")
    capsys.readouterr()
    assert generate.main([f"run.dir={run}", "max_new_tokens=2"]) == 0
    err = capsys.readouterr().err
    assert f"nljax.generate: warning: checkpoint {run / 'checkpoints' / '2'} (step 2) is damaged: array data " \
           "unreadable; using an older one -- " in err and "(step 1)" in err, err
    assert generate.main([f"run.dir={run}", f"out={tmp_path / 'x.png'}"]) == 2
    assert capsys.readouterr().err.strip() == ("nljax.generate: error: out= names the results of prompts=FILE "
                                               "(.jsonl) or a MeanFlow (model.name=dit) run's image grid; this run's "
                                               "model is nl_lm: the text of prompt= goes to the terminal")
    assert not (tmp_path / "x.png").exists()


def test_checkpoint_steps_and_an_export_directory(tmp_path, capsys):
    """checkpoint=STEP in nljax.generate and nljax.export is the run's checkpoint at that step
    (it was a path, looked for in the working directory); an export directory as run.dir is read
    as nljax.load reads it and gives the run's text; each refusal is one line."""
    import dataclasses

    from helpers import save

    from nljax import export

    run, out = tmp_path / "run", tmp_path / "export"
    setup, state = saved_run(run, NL, 1, 1, steps=0)  # the initial parameters: no step compiled
    save(setup, dataclasses.replace(state, step=state.step + 2), 2)  # and as if after 2 steps: checkpoints 0, 2
    capsys.readouterr()
    assert export.main([f"run.dir={run}", "checkpoint=0", f"out={out}"]) == 0
    assert f"nljax.export: {run / 'checkpoints' / '0'} (step 0) -> {out}" in capsys.readouterr().out
    settings = ["prompt=def ", "max_new_tokens=12", "temperature=0.9", "top_k=20", "seed=1"]
    assert generate.main([f"run.dir={run}", "checkpoint=0", *settings]) == 0
    text, err = capsys.readouterr()
    # the seconds of building and restoring, then of compiling, each said before it (silent before)
    assert err.splitlines() == [f"nljax.generate: reading the checkpoint of {run} ...",
                                f"nljax.generate: {run / 'checkpoints' / '0'} (step 0)",
                                "nljax.generate: sampling (compiling the model first) ..."]
    assert generate.main([f"run.dir={out}", *settings]) == 0
    from_export, err = capsys.readouterr()
    assert err.splitlines() == [f"nljax.generate: reading the export {out} ...",
                                f"nljax.generate: {out} (export, step 0)",
                                "nljax.generate: sampling (compiling the model first) ..."]
    assert from_export == text and text.startswith("def ") and len(text) > len("def \n")
    for tool, argv, line in (
        (generate, [f"run.dir={run}", "checkpoint=7"], f"checkpoint=7: {run} has no checkpoint at step 7 (its "
                                                       "checkpoints are at steps 0, 2)"),
        (export, [f"run.dir={run}", "checkpoint=7", f"out={tmp_path / 'e2'}"], "has no checkpoint at step 7"),
        (generate, [f"run.dir={out}", "checkpoint=0"], f"{out} is an export (one set of parameters): checkpoint=, "
                                                       "params= and overrides are for a run directory"),
        (generate, [f"run.dir={out}", "model.dim=8"], "is an export (one set of parameters)"),
        (generate, [f"run.dir={out}", "samples=4"], "samples= is for a MeanFlow (model.name=dit) run's image grid"),
        # a run's or an export's directory as checkpoint=: named by the key given (checkpoint.resume= was)
        (generate, [f"run.dir={run}", f"checkpoint={run}"], f"nljax.generate: error: checkpoint={run} is a run "
                                                            "directory, not a checkpoint: give the folder of its "
                                                            f"checkpoints ({run / 'checkpoints'}: its newest)"),
        (export, [f"run.dir={run}", f"checkpoint={out}", f"out={tmp_path / 'e2'}"],
         f"nljax.export: error: checkpoint={out} is an export directory (nljax.export wrote it), not a checkpoint: "
         f"give the checkpoint it was exported from ({run / 'checkpoints' / '0'})"),
    ):
        assert tool.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and line in err, err
    assert not (tmp_path / "e2").exists()


def test_config_yaml_records_data_paths_as_the_loaders_read_them(monkeypatch, tmp_path):
    """`~` expanded as the data loaders expand it, then absolute; lists and empty paths kept."""
    from nljax import config
    from nljax.runtime import rundir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, ["data.source=files", "data.train=[~/corpus/*.txt, rel/a.jsonl]", "images.path=x.npz",
                             "checkpoint.dir=ck"])
    tree = rundir.recorded(cfg)
    assert tree["checkpoint"]["dir"] == str(tmp_path / "ck")
    assert tree["data"]["train"] == [str(tmp_path / "home" / "corpus" / "*.txt"), str(tmp_path / "rel" / "a.jsonl")]
    assert tree["images"]["path"] == str(tmp_path / "x.npz") and tree["data"]["prepared"] == "" and tree["data"]["eval"] == []


@pytest.mark.parametrize("module", ["generate", "export", "prepare"])
def test_ctrl_c_is_one_line(module, tmp_path, monkeypatch, capsys):
    """Ctrl-C while text streams (or an export, a preparation runs): one line and exit 130, no traceback."""
    import importlib

    mod = importlib.import_module(f"nljax.{module}")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    target = mod.prepared if module == "prepare" else mod.trained_lib
    monkeypatch.setattr(target, "build" if module == "prepare" else "load", interrupted)
    if module == "generate":  # it reads the run's config first
        monkeypatch.setattr(target, "config_of", interrupted)
    (tmp_path / "config.yaml").touch()  # a run directory to nljax.generate, which tells it from an export first
    args = ["data.train=x.txt", "out=/tmp/never"] if module == "prepare" else [f"run.dir={tmp_path}"]
    assert mod.main(args) == 130
    then = ": the same command resumes where it stopped" if module == "prepare" else ""  # its work is kept
    assert capsys.readouterr().err.strip() == f"nljax.{module}: interrupted (Ctrl-C){then}"


def test_a_recall_run_generates_and_exports(tmp_path, capsys):
    """The recall probe's config needs its streaming evaluation (eval.stream_steps >= 1): the tools
    used to switch that off for every run, and refused each recall run; then kept it, and refused
    one whose 5 held-out documents fit the 4 rows it trained but not the tool's 8 devices."""
    from nljax import export

    recall = [*NL, "data.source=recall", "train.seq_len=64", "data.recall_pairs=2", "data.recall_gap=16",
              "data.recall_docs=100", "eval.batches=1", "eval.stream_steps=1", "train.batch_size=4"]
    saved_run(tmp_path / "run", recall, 1, 1, steps=1)
    assert len(jax.devices()) == 8  # generate restores onto all of them
    assert generate.main([f"run.dir={tmp_path / 'run'}", "prompt=a=1;", "max_new_tokens=3"]) == 0
    assert capsys.readouterr().out.startswith("a=1;")
    assert export.main([f"run.dir={tmp_path / 'run'}"]) == 0


def test_a_prompt_the_tokenizer_cannot_encode_is_one_line(tmp_path):
    """A tokenizer without byte fallback or an unknown token (a BPE over whitespace-split words)
    dropped the characters it has no token for: a prompt of them generated from a document start,
    and one partly of them from what was left, silently. Such a prompt is one line naming them;
    a byte-level tokenizer (every character has tokens) and bytes take any prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from nljax.data.tokenization import Bytes, HFTokenizer
    from nljax.errors import ConfigError

    docs = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 20
    paths = {}
    for name, pre in (("words", pre_tokenizers.Whitespace()), ("bytes", pre_tokenizers.ByteLevel(add_prefix_space=False))):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        alphabet = pre_tokenizers.ByteLevel.alphabet() if name == "bytes" else []
        tok.decoder = decoders.ByteLevel() if name == "bytes" else None
        tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet))
        paths[name] = tmp_path / f"{name}.json"
        tok.save(str(paths[name]))
    words = HFTokenizer(paths["words"], "<eos>")
    assert sampling.prompt_ids(words, "def f") == words.encode("def f")
    for prompt in ("日本", "def 日本 f"):
        with pytest.raises(ConfigError) as e:
            sampling.prompt_ids(words, prompt)
        assert str(e.value) == (f"prompt {prompt!r}: this run's tokenizer has no token for '日本' (the model "
                                f"would not see it): {paths['words']}")
    for codec in (HFTokenizer(paths["bytes"], "<eos>"), Bytes()):
        assert sampling.prompt_ids(codec, "def 日本 f") == codec.encode("def 日本 f")


def test_an_empty_prompt_starts_a_document_with_the_tokenizers_end_token():
    """An empty prompt is the run's document-end token (bytes: NUL; a tokenizer's may be any id);
    a tokenizer without one needs a prompt."""
    from types import SimpleNamespace

    def codec(end_id):
        return SimpleNamespace(lost=lambda text: "", encode=lambda text: [], end_id=end_id, path="tok.json")

    assert sampling.prompt_ids(codec(7), "") == [7]
    with pytest.raises(ConfigError, match="an empty prompt starts a document after data.doc_end_token"):
        sampling.prompt_ids(codec(None), "")
