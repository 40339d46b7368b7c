"""The Python API of a trained model (nljax/trained_model.py): `nljax.load` of a run directory
and of an export give the same model, tokenizer and samples as `python -m nljax.generate`;
`logits` reads a stream as training does (windows, the memory carried, `reset` per row); the
README's and the guide's Python snippets run as written."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT, TINY_NL, bpe_corpus, python_block, saved_run

import nljax
from nljax import export
from nljax.errors import ConfigError
from nljax.run import sampling, trained

# seq_len 16: the snippets' 9- and 33-byte texts cross windows
NL = [*TINY_NL, "train.seq_len=16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A directory holding runs/default (a text run with a checkpoint) and runs/default/export,
    the paths the snippets name."""
    root = tmp_path_factory.mktemp("api")
    run_dir = root / "runs" / "default"
    saved_run(run_dir, NL, 1, 1, steps=1)  # one step: one step variant compiled
    export.export(trained.load(run_dir, devices=jax.devices()[:1]), run_dir / "export")
    return root


@pytest.fixture(scope="module")
def lm(runs):
    return nljax.load(runs / "runs" / "default")  # loaded once: its compiled forwards serve every test


def test_a_run_and_its_export_load_alike_and_generate_as_the_command(runs, lm):
    run_dir = runs / "runs" / "default"
    ex = nljax.load(run_dir / "export")
    assert isinstance(lm, nljax.TrainedModel) and lm.makes_text and lm.step == ex.step == 1
    assert lm.config == ex.config and lm.seq_len == 16 and lm.end_id == 0
    text = "déf f(x):\n\treturn x ☃"
    assert lm.encode(text) == list(text.encode()) and lm.decode(lm.encode(text)) == text
    settings = dict(max_new_tokens=40, temperature=0.9, top_k=20, top_p=0.95, seed=3)
    pieces = []
    got = lm.generate("def ", stream=pieces.append, **settings)
    assert got == "".join(pieces) and got == ex.generate("def ", **settings)
    assert "" not in pieces  # a byte held back (part of a character) is no call
    # the command's code path (nljax.generate), on 2 devices: the same tokens
    t = trained.load(run_dir, devices=jax.devices()[:2])
    tokens = sampling.generate_text(t, sampling.Settings(prompt="def ", **settings), lambda _: None)
    assert got == lm.decode(tokens)
    assert lm.generate("def ", seed=4, max_new_tokens=40) != lm.generate("def ", seed=5, max_new_tokens=40)


def test_logits_compile_once_per_row_count(runs):
    """A window that reads the memory another window wrote runs the forward the first compiled:
    a fresh memory and a returned one were placed apart, and a run's model compiled twice."""
    for path in (runs / "runs" / "default", runs / "runs" / "default" / "export"):
        lm = nljax.load(path)  # its own forward, compiled here
        _, memory = lm.logits(np.ones((2, 40), np.int32))  # windows 2 and 3 read the memory
        lm.logits(np.ones((2, 5), np.int32), memory)
        lm.logits(np.ones((2, 5), np.int32))
        assert lm._forward._cache_size() == 1, path


def test_logits_reads_the_windows_back_after_the_last(lm, monkeypatch):
    """Every window is dispatched before any window's logits are copied to the host: a copy
    after each window made the device wait for it before the next."""
    events, window = [], lm._window

    class Logits:  # a window's logits on the device, its copy to the host recorded
        def __init__(self, x):
            self.x = x

        def __array__(self, dtype=None, copy=None):
            events.append("read")
            return np.asarray(self.x, dtype)

    def dispatched(*args):
        events.append("dispatch")
        logits, memory = window(*args)
        return Logits(logits), memory

    monkeypatch.setattr(lm, "_window", dispatched)
    got, _ = lm.logits(np.ones((1, 40), np.int32))  # three windows of 16
    assert events == ["dispatch"] * 3 + ["read"] * 3
    monkeypatch.undo()
    np.testing.assert_array_equal(got, lm.logits(np.ones((1, 40), np.int32))[0])


def test_print_shows_one_line_of_what_was_loaded(runs, lm, monkeypatch):
    """`print(lm)` is one short line (the dataclass's repr printed every parameter array and the
    whole config: ~2,300 lines): the model, what it makes, its parameter count and dtype, the
    step and where it was read from, for a run and for its export."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(lm.model.init, jax.random.key(0))))
    assert n > 1000
    ex = nljax.load(runs / "runs" / "default" / "export")
    for model in (lm, ex):
        line = repr(model)
        assert line == str(model) and "\n" not in line and len(line) < 300, line
        assert line == (f"<nljax.TrainedModel nl_lm (text, seq_len 16, byte tokens): {n:,} parameters (float32), "
                        f"step 1, from {model.source}>")
    assert ex.source == runs / "runs" / "default" / "export"
    assert lm.source == (runs / "runs" / "default" / "checkpoints" / "1").absolute()
    # by a relative path, an export's source is absolute as a run's is (it stayed relative)
    monkeypatch.chdir(runs / "runs")
    assert nljax.load("default/export").source == runs / "runs" / "default" / "export"


def test_checkpoint_is_a_step_number_or_a_path(tmp_path, monkeypatch):
    """`checkpoint=` is a step number (an int, or digits that name no existing path: the run's
    checkpoint at that step), as lm_eval's --model_args takes it, or a path as before; a step the
    run does not have is one line naming the steps it has."""
    import dataclasses

    from helpers import save

    run = tmp_path / "run"
    setup, state = saved_run(run, NL, 1, 1, steps=0)  # the initial parameters: no step compiled
    save(setup, dataclasses.replace(state, step=state.step + 2), 2)  # and as if after 2 steps: checkpoints 0, 2
    lm = nljax.load(run, checkpoint=0)  # restored: the older of the two
    assert lm.step == 0 and lm.source == run / "checkpoints" / "0"
    # how each form resolves (what a load restores, as above)
    monkeypatch.chdir(tmp_path)
    step = lambda n: str(run / "checkpoints" / str(n))
    for given, want in ((0, step(0)), ("0", step(0)), (step(0), step(0)), ("latest", "latest"), (2, step(2))):
        assert trained.checkpoint_path(run, given) == want, given
    (tmp_path / "2").symlink_to(run / "checkpoints" / "0")  # digits that name a path: the path
    assert trained.checkpoint_path(run, "2") == "2" and trained.checkpoint_path(run, 2) == step(2)
    with pytest.raises(ConfigError) as e:
        nljax.load(run, checkpoint=300)
    assert str(e.value) == f"checkpoint=300: {run} has no checkpoint at step 300 (its checkpoints are at steps 0, 2)"


def test_logits_read_windows_with_the_memory_and_reset(lm):
    """`logits` of 2.5 windows equals feeding them one by one with the memory carried; `reset`
    True starts a row from the fresh memory, False continues (and the memory changes the logits)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 256, (2, 40))  # no document end: no reset inside
    whole, memory = lm.logits(tokens)
    assert whole.shape == (2, 40, lm.config.model.vocab_size)
    first, m1 = lm.logits(tokens[:, :16])
    second, m2 = lm.logits(tokens[:, 16:32], m1, reset=[False, False])
    np.testing.assert_allclose(whole[:, :32], np.concatenate([first, second], 1), rtol=1e-5, atol=1e-5)
    fresh, _ = lm.logits(tokens[:, 16:32])
    reset_one, _ = lm.logits(tokens[:, 16:32], m1, reset=[True, False])
    np.testing.assert_array_equal(reset_one[0], fresh[0])  # row 0 reset: as from a fresh memory
    np.testing.assert_array_equal(reset_one[1], second[1])  # row 1 continued
    # a memory given and no reset: every row continues from it
    np.testing.assert_array_equal(lm.logits(tokens[:, 16:32], m1)[0], second)
    assert not np.allclose(second[0], fresh[0], atol=1e-6), "the memory changes nothing: the test proves nothing"
    # a document's end (byte 0) resets the memory before the next window, as training reads a stream
    ended = tokens.copy()
    ended[:, 10] = 0
    after_end, _ = lm.logits(ended[:, :32])
    np.testing.assert_array_equal(after_end[:, 16:], lm.logits(ended[:, 16:32])[0])


def test_bad_input_is_one_line(runs, lm, tmp_path):
    cases = [
        (lambda: nljax.load(tmp_path), "is neither an export directory"),
        (lambda: nljax.load(runs / "runs" / "default" / "export", checkpoint="3"), "is an export"),
        (lambda: lm.logits(np.zeros(5, np.int32)), "tokens must be [rows, T]"),
        (lambda: lm.logits(np.zeros((1, 0), np.int32)), "tokens must be [rows, T] with T >= 1, got shape (1, 0)"),
        (lambda: lm.logits([[1, 2], [3]]), "tokens must be [rows, T]"),  # ragged rows: numpy's ValueError before
        # ids outside the vocabulary gave logits of some other token (or NaN), silently
        (lambda: lm.logits([[65, 256]]), "token ids must be in [0, 256), got 256"),
        (lambda: lm.logits([[-1, 65]]), "token ids must be in [0, 256), got -1"),
        (lambda: lm.logits([[65, 66]], reset=[True, False]), "reset must hold one flag per row (1), got 2"),
        (lambda: lm.generate("x", top_p=0), "top_p must be in 0 < top_p <= 1, got 0"),
        # an image model's arguments, ignored before
        (lambda: lm.generate("x", labels=[0, 1]), "labels= and steps= are for an image model; model.name=nl_lm "
                                                   "makes text"),
        (lambda: nljax.load(5), "nljax.load takes a directory path, got int 5"),  # a TypeError before
        # a string of overrides was read character by character ("override 't' must look like key=value")
        (lambda: nljax.load(runs / "runs" / "default", overrides="train.steps=3"),
         "overrides must be a list of 'key=value' strings, got 'train.steps=3'"),
        # what a Python user passes by habit was a TypeError, KeyError or AttributeError from deep
        # inside, or was taken silently (a dict's keys alone were read; 1.7 read as token 1)
        (lambda: nljax.load(runs / "runs" / "default", overrides={"train.steps": 3}),
         "overrides must be a list of 'key=value' strings, got a dict: give ['train.steps=3']"),
        (lambda: lm.generate("x", top_k="40"), "top_k must be an integer, got str '40'"),
        (lambda: lm.generate(["x"], temperature="0.8"), "temperature must be a number, got str '0.8'"),
        (lambda: lm.generate("x", seed=1.5), "seed must be an integer, got float 1.5"),
        (lambda: lm.encode(65), "encode takes a str, got int 65"),
        (lambda: lm.decode([65.0, 66.7]), "decode takes a list of integer token ids, got float64 of shape (2,)"),
        (lambda: lm.decode(["A"]), "decode takes a list of integer token ids, got <U1 of shape (1,)"),
        (lambda: lm.decode("AB"), "decode takes a list of integer token ids, got str 'AB'"),  # was "<U2 of shape ()"
        # a negative id was bytes()'s ValueError (a tokenizer's: an OverflowError), a larger one U+FFFD
        (lambda: lm.decode([65, -1]), "token ids must be in [0, 256), got -1"),
        (lambda: lm.decode([65, 256]), "token ids must be in [0, 256), got 256"),
        (lambda: lm.logits([[65.0, 66.7]]), "tokens must be integer ids, got float64"),
        (lambda: lm.logits([[65, 66]], lm.init_memory(rows=2)), "memory must be a memory of 1 row(s)"),
        (lambda: lm.logits([[65, 66]], {"M": np.zeros(3)}), "memory must be a memory of 1 row(s)"),
    ]
    for call, words in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value)


def test_an_image_model_generates_images(tmp_path):
    npz = tmp_path / "imgs.npz"
    rng = np.random.default_rng(0)
    np.savez(npz, x=rng.integers(0, 256, (40, 4, 4, 3), np.uint8), y=rng.integers(0, 3, 40))
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=2", "images.source=file", f"images.path={npz}", "cms.periods=[1]",
           "train.batch_size=8"]
    saved_run(tmp_path / "run", dit, 1, 2, steps=1)
    export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), tmp_path / "export")
    lm, ex = nljax.load(tmp_path / "run"), nljax.load(tmp_path / "export")
    assert not lm.makes_text and lm.tokenizer is None
    one = lm.generate(labels=[0, 2, 1], steps=1)
    assert one.shape == (3, 4, 4, 3) and np.isfinite(one).all()
    # compiled once for three samples in one step: it compiled again at every call
    np.testing.assert_array_equal(lm.generate(labels=[0, 2, 1], steps=1), one)
    lm.generate(labels=[1, 1, 0], steps=1)
    assert lm._draws[None]._cache_size() == 1
    np.testing.assert_allclose(ex.generate(labels=[0, 2, 1], steps=1), one, atol=1e-6)
    assert not np.allclose(lm.generate(labels=[0, 2, 1], steps=2), one)
    # seed= keys the noise (it was ignored: every seed gave the run's samples); the default is the
    # run's seed (0 here), as its evaluation drew
    np.testing.assert_allclose(lm.generate(labels=[0, 2, 1], steps=1, seed=0), one, atol=1e-6)
    other = lm.generate(labels=[0, 2, 1], steps=1, seed=7)
    assert not np.allclose(other, one)
    np.testing.assert_allclose(ex.generate(labels=[0, 2, 1], steps=1, seed=7), other, atol=1e-6)
    for bad in (-1, 2**32, 1.5):
        with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\^32\)"):
            lm.generate(labels=[0], seed=bad)
    with pytest.raises(ConfigError, match="for language models"):
        lm.encode("x")
    # labels outside the 3 classes (3 itself is the null label: unconditional) drew from another
    # class's embedding row, silently
    assert lm.generate(labels=[3], steps=1).shape == (1, 4, 4, 3)
    for bad in (4, -1):
        with pytest.raises(ConfigError) as e:
            lm.generate(labels=[0, bad], steps=1)
        assert str(e.value) == f"labels must be a class, 0 to 2, or 3 for no class (unconditional samples), got {bad}"


def test_an_unconditional_image_model_says_which_labels_and_takes_a_seed():
    """Without labels an unconditional model was asked for labels=[class, ...], which it has
    none of; seed= was ignored (every seed the run's samples). Built, not trained: fast."""
    from pathlib import Path

    from nljax.config import load
    from nljax.models.builtin import dit

    cfg = load(None, ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
                      "model.dit.patch_size=2", "cms.periods=[1]", "seed=3"])
    model = dit(cfg, (4, 4, 1), 0)
    params = jax.tree.map(lambda p: p + 0.1, model.init(jax.random.key(0)))  # adaLN-zero's output is 0 at init
    lm = nljax.TrainedModel(model, params, cfg, 0, Path("built"))
    with pytest.raises(ConfigError) as e:
        lm.generate(steps=1)
    assert str(e.value) == ("an image model's generate needs labels=[0] * n (unconditional: the labels are not "
                            "read), one sample each, and steps >= 1")
    with pytest.raises(ConfigError, match="and steps >= 1"):
        lm.generate(labels=[0], steps=0)
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\^32\), got 4294967296"):
        lm.generate(labels=[0], seed=2**32)
    assert lm.end_id is None  # no tokenizer: no document end
    run_seed = lm.generate(labels=[0, 0])
    np.testing.assert_allclose(lm.generate(labels=[0, 0], seed=3), run_seed, atol=1e-6)  # the default: the run's
    assert not np.allclose(lm.generate(labels=[0, 0], seed=4), run_seed)
    with pytest.raises(ConfigError) as e:  # ignored before
        lm.generate("a prompt", labels=[0])
    assert str(e.value) == ("prompt= and stream= are for a language model; model.name=dit makes images: "
                            "generate(labels=[...], steps=, seed=)")
    with pytest.raises(ConfigError) as e:
        lm.generate(labels=[0], details=True)
    assert str(e.value) == ("details= tells why each text ended, for a language model; model.name=dit makes images "
                            "(an array of samples)")


def test_an_image_model_of_a_folder_takes_its_class_names_as_labels():
    """labels=["cat"] raised int()'s ValueError: a folder's run names its classes (model.classes),
    and a name stands for its label; a name it lacks, or no names, is one line. Built, no parameters: fast."""
    from pathlib import Path

    from nljax.config import load
    from nljax.models.builtin import dit

    cfg = load(None, ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
                      "model.dit.patch_size=2", "cms.periods=[1]", "meanflow.cfg_omega=1", "meanflow.cfg_kappa=0"])
    for classes in (("cat", "dog", "fox"), None):
        lm = nljax.TrainedModel(dit(cfg, (4, 4, 1), 3, classes), {}, cfg, 0, Path("built"))  # refused before params
        if classes:  # the ids generate samples (drawing them compiles: seconds)
            from nljax.data.images import label_ids

            ids = label_ids(["fox", "cat", 1, np.int64(2), jax.numpy.asarray(0), 3], lm.model.classes, 3)
            assert ids.tolist() == [2, 0, 1, 2, 0, 3] and ids.dtype == np.int32
        with pytest.raises(ConfigError) as e:
            lm.generate(labels=[0, "owl"])
        known = "its classes: cat, dog, fox" if classes else "its data name no classes"
        assert str(e.value) == (f"labels must be class numbers or, for a run on a folder, class names ({known}); "
                                "got 'owl'")
    # one label given alone: a name was read letter by letter ("got 'c'"), a number a TypeError
    for one in ("cat", 2, np.int64(2)):
        with pytest.raises(ConfigError) as e:
            lm.generate(labels=one)
        assert str(e.value) == f"labels is a list, one sample each: labels=[{one!r}] for one sample"


def test_import_nljax_stays_free_of_jax():
    """The Python API guide: `import nljax` imports neither JAX nor Flax; the guides on text data and
    evaluation: nor pyarrow, nor lm-evaluation-harness (or the torch it imports)."""
    code = ("import sys, nljax; assert callable(nljax.load) and callable(nljax.load_model); "
            "assert nljax.Completion('a', 'eos', 2).finish_reason == 'eos'; "
            # a notebook's nljax.<Tab> lists what dir() does: the names imported on first use too
            "assert set(nljax.__all__) <= set(dir(nljax)), dir(nljax); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax', 'pyarrow', 'lm_eval', "
            "'torch')]; assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("where", ["README.md", "docs/guides/python-api.md"])
def test_the_python_snippets_run_as_written(where, runs, monkeypatch, capsys):
    """The snippet, run in a directory holding the runs/ it names (a tiny trained run)."""
    code = python_block(ROOT / where, "<!-- python-api -->" if where == "README.md" else None)
    monkeypatch.chdir(runs)
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
    assert capsys.readouterr().out.strip(), "the snippet prints the generated text"


@pytest.mark.slow
def test_the_guides_training_from_python_runs_as_written(tmp_path, monkeypatch, capsys):
    """The guide's "Train from Python" snippet: train, read summary.json, export and load, in
    this process (as a notebook would), then its training again into the same run.dir: refused
    with exit code 2, which the snippet raises as its RuntimeError."""
    code = python_block(ROOT / "docs" / "guides" / "python-api.md", "<!-- train-from-python -->")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "python-api.md", "exec"), {"__name__": "__snippet__"})
    assert (tmp_path / "runs" / "notebook" / "export" / "model.safetensors").is_file()
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="nljax.train ended with exit code 2"):
        exec(compile(code, "python-api.md", "exec"), {"__name__": "__snippet__"})
    assert "already holds a run" in capsys.readouterr().err


def test_an_export_carries_the_runs_tokenizer(tmp_path, capsys):
    """A run on its own files with a tokenizer.json: the export holds a copy, so `nljax.load` of
    the export encodes and decodes as the run did with the tokenizer and the corpus gone; another
    or a damaged one in its place is refused in one line, by nljax.generate's prompts= too (which
    reads it before the weights)."""

    from tokenizers import Tokenizer, models, pre_tokenizers

    files = bpe_corpus(tmp_path, "document {i} says hello to the tokenizer, ünïcode {sq}. ")
    tok, corpus = Tokenizer.from_file(str(tmp_path / "tok.json")), tmp_path / "corpus"
    saved_run(tmp_path / "run", [*NL, *files], 1, 1, steps=0)  # the initial parameters: no step compiled
    out = export.export(trained.load(tmp_path / "run", devices=jax.devices()[:1]), tmp_path / "export")
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    (tmp_path / "tok.json").unlink()
    corpus.rename(tmp_path / "gone")
    ex = nljax.load(out)
    text = "document 7 says hello, ünïcode"
    assert ex.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert max(ex.encode(text)) > 255 and ex.decode(ex.encode(text)) == text
    assert ex.end_id == tok.token_to_id("<eos>")
    sampled = ex.generate("document", max_new_tokens=8, seed=2)
    assert ex.decode(ex.encode(sampled)) == sampled
    # another tokenizer.json put in its place is refused, in one line
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.add_special_tokens(["<eos>"])
    other.save(str(out / "tokenizer.json"))
    with pytest.raises(ConfigError, match="tokenizer.json is not the file that was written with the export"):
        nljax.load(out)
    from nljax import generate

    (out / "tokenizer.json").write_text("{")  # cut short: named as the export's damaged file, not parsed
    (tmp_path / "prompts.txt").write_text("document\n")
    assert generate.main([f"run.dir={out}", f"prompts={tmp_path / 'prompts.txt'}", f"out={tmp_path / 'c.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tokenizer.json is not the file that was written with the export" in err, err


def test_cpu_devices_once_jax_has_started_is_what_it_has_or_one_line(capsys):
    """A second `nljax.train.main(["--cpu-devices", "N", ...])` in one Python process (a
    notebook), or one after the user's own JAX calls: JAX's devices are set once per process, so
    N is what it has (nothing to do), or one line saying so. Even the same N was refused as "JAX
    could not start a backend ... check that the device and its JAX plugin are installed", and
    `jax_platforms` was left set to cpu."""
    from nljax import cli, train

    n, platforms = len(jax.devices()), jax.config.jax_platforms  # started: conftest's 8 CPU devices
    cli.setup_devices(n)
    assert train.main(["--cpu-devices", str(n), "--print-config"]) == 0
    capsys.readouterr()
    with pytest.raises(ConfigError, match=f"--cpu-devices 2: JAX has already started in this Python process, with "
                                          f"{n} cpu device"):
        cli.setup_devices(2)
    assert train.main(["--cpu-devices", "2", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"give --cpu-devices {n} or leave it out" in err and "restart its kernel" in err, err
    assert jax.config.jax_platforms == platforms


def test_cpu_devices_once_jax_has_started_on_an_accelerator_says_to_leave_it_out(monkeypatch):
    """JAX started on a GPU (a notebook's first run without the flag): no --cpu-devices is taken
    then, so the line says to leave it out; it said to give --cpu-devices 1, refused again."""
    import types

    from nljax import cli

    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="gpu")])
    with pytest.raises(ConfigError) as e:
        cli.setup_devices(1)
    assert "with 1 gpu device(s)" in str(e.value) and "--cpu-devices 1 or" not in str(e.value)
    assert ": leave it out to use those, or start a new process" in str(e.value)


def test_jax_64_bit_mode_is_refused_in_one_line(runs, lm):
    """A session that turned on JAX's 64-bit mode before nljax (jax_enable_x64): a run trained
    float64 parameters whatever model.dtype said and crashed at its throughput table (a 40-line
    TypeError); loading a float32 run was refused as "from another model". A model loaded before
    is refused its calls too."""
    from nljax import config
    from nljax.run.core import Run

    jax.config.update("jax_enable_x64", True)
    try:
        for call in (lambda: lm.logits([[65, 66]]), lambda: lm.generate("x", max_new_tokens=2)):
            with pytest.raises(ConfigError, match="JAX's 64-bit mode is on"):
                call()
    finally:
        jax.config.update("jax_enable_x64", False)
    assert lm.logits([[65, 66]])[0].dtype == np.float32  # usable again once it is off
    jax.config.update("jax_enable_x64", True)
    try:
        with pytest.raises(ConfigError, match=r"^JAX's 64-bit mode is on in this process .*turn it off first"):
            nljax.load(runs / "runs" / "default")
        with pytest.raises(ConfigError, match="JAX's 64-bit mode is on"):  # an export's too
            nljax.load(runs / "runs" / "default" / "export")
        with pytest.raises(ConfigError, match="JAX's 64-bit mode is on"):
            Run.create(config.load(None, NL))
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("command", ["train", "generate", "export", "evaluate", "prepare", "bench", "comm"])
def test_a_commands_main_returns_argparses_refusal_as_a_code(command, capsys):
    """`nljax.train.main([...])` from Python (the guides' way to train from a notebook or a
    script) returns its exit code for every refusal: a mistyped flag raised argparse's SystemExit
    instead, which ended a script past its `if rc:` and showed in a notebook's cell as
    "SystemExit: 2". --help returns 0 after the help."""
    import importlib

    main = importlib.import_module(f"nljax.{command}").main
    assert main(["--bogus"]) == 2
    said = f"nljax.{command}: error: unrecognized arguments: --bogus (--help lists the options)\n"
    assert capsys.readouterr().err == said
    assert main(["--help"]) == 0
    assert f"usage: nljax.{command}" in capsys.readouterr().out
    # a str for the list was read letter by letter ("override 't' must look like key=value"), a
    # number was argparse's TypeError
    for argv, got in (("run.dir=x", "str 'run.dir=x'"), (["--help", 3], "int 3")):
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"nljax.{command}: error: main takes the command's arguments as a list of "
                                           f"str, one each (shlex.split of a command line gives it), got {got}\n")


def test_lm_evals_main_refuses_a_str_for_its_list_in_one_line(capsys):
    """lm_eval's `main` splits its arguments before its own parser: a str was read letter by
    letter there ("--tasks is missing", with --tasks given), a number was a TypeError."""
    from nljax import lm_eval

    for argv, got in (("--tasks x", "str '--tasks x'"), (["--tasks", 3], "int 3")):
        assert lm_eval.main(argv) == 2
        assert capsys.readouterr().err == ("nljax.lm_eval: error: main takes the command's arguments as a list of "
                                           f"str, one each (shlex.split of a command line gives it), got {got}\n")


def test_a_path_in_mains_arguments_is_its_str(tmp_path, capsys):
    """`nljax.train.main(["--config", Path("my.yaml")])`: a path is taken as the str it names (it
    was argparse's TypeError: 'PosixPath' object is not subscriptable)."""
    from nljax import train

    (tmp_path / "my.yaml").write_text("train:\n  steps: 7\n")
    assert train.main(["--print-config", "--config", tmp_path / "my.yaml"]) == 0
    assert "  steps: 7" in capsys.readouterr().out



def test_main_without_arguments_in_a_jupyter_kernel_reads_none_of_the_kernels(monkeypatch, capsys):
    """`nljax.evaluate.main()` in a notebook: sys.argv is the kernel's (`ipykernel_launcher.py -f
    kernel.json`), which the command read as its own ("unrecognized arguments: -f")."""
    import types

    from nljax import cli, evaluate

    monkeypatch.setattr(sys, "argv", ["/env/lib/ipykernel_launcher.py", "-f", "/run/kernel-1.json"])
    assert cli.command_line() == ["-f", "/run/kernel-1.json"]  # a script of that name, not a kernel
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert cli.command_line() == []
    assert evaluate.main() == 2
    assert capsys.readouterr().err == "nljax.evaluate: error: run.dir=DIR is required: the run directory nljax.train wrote\n"
