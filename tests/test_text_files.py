"""Own text data (data.source=files): .txt, .jsonl and .gz documents written here, bytes or a
tokenizer built here (no download), prepared to disk or in memory; training through the real
entry, exact and elastic resume on it; every bad-data case refused with one line."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import shutil
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest
from helpers import cli, lock, tree_hash

from nljax import config
from nljax.checkpoint import storage
from nljax.data import outdir, prepared, tokenization
from nljax.data.text import SEPARATOR, ContextStream
from nljax.parallel import mesh as meshlib
from nljax.prepare import main as prepare_main
from nljax.run import startup, tasks
from nljax.run.sampling import tokenization_of
from nljax.train import main as train_main

WORDS = "the a memory level stream token window model learns reads writes data file line of and to in été".split()
# A model small enough to compile in seconds (the stream's `reset` at document ends is checked
# on its own below; the runs check what the data path decides: the tokens every row reads).
# model.vocab_size is the test tokenizer's size for the byte runs too (a padded table): every run
# then compiles the same step programs, which the compile cache holds after the first.
TINY = ["model.name=cms_mlp", "model.dim=16", "model.depth=1", "model.hidden_mult=2", "cms.periods=[1]",
        "train.batch_size=8", "train.seq_len=8", "train.steps=6", "optim.lr=0.01", "optim.warmup_steps=0",
        "data.eval_fraction=0.2", "model.vocab_size=320"]
QUICK = ["--quiet", "eval.every=0", "eval.batches=1", "eval.stream_steps=0", "throughput.reps=1",
         "throughput.split=false", "run.plots=false", "run.trackers=[]"]

def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 40))) + ".\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """6 .txt files, a .jsonl of 24 documents, a .jsonl.gz of 10 (and one blank line), a held-out
    .txt set; `docs`: the training documents in the order they are read."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = []
    for i in range(6):
        docs.append(_text(rng))
        (root / f"doc{i}.txt").write_text(docs[-1])
    lines = [_text(rng) for _ in range(24)]
    (root / "lines.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(lines)))
    packed = [_text(rng) for _ in range(10)]
    with gzip.open(root / "packed.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in packed) + "\n\n")
    (root / "held").mkdir()
    for i in range(3):
        (root / "held" / f"h{i}.txt").write_text(_text(rng) * 3)
    train = [f"{root}/*.txt", f"{root}/*.jsonl", f"{root}/*.jsonl.gz"]
    return {"root": root, "train": train, "docs": docs + lines + packed, "eval": [f"{root}/held/*.txt"]}


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of 320 tokens trained here on the corpus: ids above 255."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus["docs"], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def data_config(*overrides: str) -> config.Config:
    return config.load(None, ["data.source=files", *overrides])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_out_under_a_file_is_refused_in_one_line_before_tokenizing(corpus, tmp_path, capsys, monkeypatch):
    """out= whose parent is a file: one line naming it and exit 2 before any text is read, as
    nljax.train says of such a run.dir (it was mkdir's "File exists")."""
    train = f"data.train=[{','.join(corpus['train'])}]"
    (afile := tmp_path / "afile").write_text("")
    monkeypatch.setattr(prepared.workdir, "WorkDir", mock.Mock(side_effect=AssertionError("tokenizing began")))
    for out in (afile / "prep", afile / "deeper" / "prep"):
        assert prepare_main([train, f"out={out}"]) == 2
        assert one_line(capsys) == f"nljax.prepare: error: out={out}: {afile} is a file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_an_out_that_cannot_be_written_is_refused_in_one_line_before_tokenizing(corpus, tmp_path, capsys, monkeypatch):
    """out= in a folder this user cannot write, or a DIR it cannot write (as on a read-only file
    system): one line and exit 2, as nljax.train refuses such a run.dir; it was exit 1, from the
    lock file's open (or, for DIR itself, a replacement that could not remove the previous data)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    lock(locked, monkeypatch)
    try:
        train = f"data.train=[{','.join(corpus['train'])}]"
        monkeypatch.setattr(prepared.workdir, "WorkDir", mock.Mock(side_effect=AssertionError("tokenizing began")))
        for out, where in ((locked / "prep", f"{locked / 'prep'}: {locked}"), (locked, f"{locked}")):
            assert prepare_main([train, f"out={out}", "overwrite=true"]) == 2
            assert one_line(capsys) == f"nljax.prepare: error: out={where} is not writable"
        assert list(locked.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["locked"]
    finally:
        locked.chmod(0o755)


# ---------------------------------------------------------------------------------------------
# Preparing: documents whole, the held-out split by document, disk == memory


def test_prepare_keeps_documents_whole_and_holds_out_every_nth(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "prep"
    train = f"data.train=[{','.join(corpus['train'])}]"
    assert prepare_main([train, "data.eval_fraction=0.2", f"out={out}"]) == 0
    assert "nljax.prepare: wrote" in capsys.readouterr().out
    on_disk = prepared.load(out)
    m = on_disk.manifest
    assert m["dtype"] == "uint8" and m["vocab_size"] == 256 and m["tokenizer"]["kind"] == "bytes"
    assert isinstance(on_disk.train.tokens, np.memmap)
    docs = corpus["docs"]
    held = [d for i, d in enumerate(docs) if i % 5 == 4]
    for split, want in ((on_disk.train, [d for i, d in enumerate(docs) if i % 5 != 4]), (on_disk.eval, held)):
        got = [bytes(split.tokens[a:e + 1]).decode() for a, e in zip(split.starts, split.ends, strict=True)]
        assert got == [d + "\0" for d in want]  # whole, in order, each ended by NUL
    assert m["train"]["bytes"] == m["train"]["tokens"] and on_disk.tokens_per_byte == 1.0
    in_memory = prepared.build(data_config(train, "data.eval_fraction=0.2").data)
    assert in_memory.digest == on_disk.digest
    np.testing.assert_array_equal(in_memory.train.tokens, on_disk.train.tokens)
    np.testing.assert_array_equal(in_memory.eval.starts, on_disk.eval.starts)
    # a held-out set given: every training document is trained on, the held-out files evaluate
    both = prepared.build(data_config(train, f"data.eval={corpus['eval'][0]}").data)
    assert both.manifest["train"]["documents"] == len(docs) and both.manifest["eval"]["documents"] == 3
    assert both.digest != on_disk.digest
    # DIR is not replaced unless asked; data.prepared with other data.train is refused
    assert prepare_main([train, f"out={out}"]) == 2 and "already holds prepared data" in one_line(capsys)
    # a user's folder is never written into: not its files (overwrite or not), not one named like ours
    (mine := tmp_path / "mine").mkdir()
    (mine / "notes.txt").write_text("keep")
    for extra in ([], ["overwrite=true"]):
        assert prepare_main([train, f"out={mine}", *extra]) == 2
        assert f"{mine} holds files that are not nljax prepared data (notes.txt)" in one_line(capsys)
    (partial := tmp_path / "partial").mkdir()
    (partial / "train.bin").write_text("precious")
    assert prepare_main([train, f"out={partial}"]) == 2 and "already holds prepared data (train.bin)" in one_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (partial / "train.bin").read_text() == "precious"
    assert prepare_main([train, f"outt={mine}"]) == 2  # a misspelt setting, not an unknown config section
    assert "unknown setting 'outt': did you mean 'out'?" in one_line(capsys)
    with pytest.raises(config.ConfigError, match="was prepared with data.eval_fraction=0.2, not 0.05"):
        prepared.corpus(data_config(train, f"data.prepared={out}").data)
    # the same files spelled relative to where this runs (config.yaml records them absolute): accepted
    monkeypatch.chdir(corpus["root"])
    relative = "data.train=['*.txt', '*.jsonl', './*.jsonl.gz']"
    assert prepared.corpus(data_config(relative, "data.eval_fraction=0.2", f"data.prepared={out}").data).digest == m["digest"]
    with pytest.raises(config.ConfigError, match=r"was prepared with data.train=\[.*\], not \['/.*/\*.txt'\]"):
        prepared.corpus(data_config("data.train=['*.txt']", "data.eval_fraction=0.2", f"data.prepared={out}").data)


def test_a_byte_order_mark_is_dropped(tmp_path):
    """A BOM (Windows editors write one) was a 'not valid JSON' line in a .jsonl, and three bytes of
    U+FEFF trained on at the start of a .txt; it is dropped: the same tokens as without."""
    text = "été, fine text\n"
    (tmp_path / "held.txt").write_text("held-out text\n")
    (tmp_path / "plain.txt").write_text(text)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    line = "\ufeff" + json.dumps({"text": text}, ensure_ascii=False) + "\r\n"  # each line: files joined with cat
    (tmp_path / "bom.jsonl").write_bytes((line * 2 + "\ufeff\r\n").encode())  # and a line of a BOM alone: blank
    tokens = lambda name: prepared.build(data_config(f"data.train={tmp_path / name}",
                                                     f"data.eval={tmp_path / 'held.txt'}").data).train.tokens
    assert tokens("bom.txt").tobytes() == tokens("plain.txt").tobytes() == text.encode() + b"\0"
    assert tokens("bom.jsonl").tobytes() == (text.encode() + b"\0") * 2


def test_a_file_named_like_a_glob_is_read_as_itself(tmp_path):
    """'notes[1].txt' exists: it is that file, not a glob that matches 'notes1.txt' (or nothing)."""
    from nljax.data import documents

    (tmp_path / "notes[1].txt").write_text("mine")
    (tmp_path / "notes1.txt").write_text("another")
    assert documents.expand([str(tmp_path / "notes[1].txt")], "data.train") == [tmp_path / "notes[1].txt"]
    assert documents.expand([str(tmp_path / "notes[0-9].txt")], "data.train") == [tmp_path / "notes1.txt"]


def test_a_list_is_offered_only_where_each_part_names_something(tmp_path):
    """A path of several joined by commas, each naming a file, is refused with the list to give
    instead; not where a part names nothing (a name with a comma, merely missing: a list would
    be refused too), nor for a data.eval_sets set, whose glob is one (no list under its key)."""
    from nljax.data import documents

    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    both, half = f"{tmp_path}/a.txt,{tmp_path}/b.txt", f"{tmp_path}/a.txt,{tmp_path}/none.txt"
    with pytest.raises(config.ConfigError) as e:
        documents.expand([both], "data.train")
    assert str(e.value) == (f"data.train: no file {both} (several paths are a list: "
                            f"data.train='[{tmp_path}/a.txt, {tmp_path}/b.txt]')")
    for pattern, key in ((half, "data.train"), (both, "data.eval_sets held")):
        with pytest.raises(config.ConfigError) as e:
            documents.expand([pattern], key)
        assert str(e.value) == f"{key}: no file {pattern}"


def test_a_jsonl_line_without_its_text_names_its_fields_up_to_eight():
    from nljax.data.documents import _what_is_there

    assert _what_is_there({"title": "t", "body": "b"}, "text") == "its fields: title, body"
    nine = {f"f{i}": i for i in range(9)}  # the first eight named
    assert _what_is_there(nine, "text") == "its fields: f0, f1, f2, f3, f4, f5, f6, f7, ..."
    assert _what_is_there({}, "text") == "its fields: none"


def test_prepared_data_given_as_text_is_offered_as_data_prepared(tmp_path):
    """nljax.prepare's output where text files are read is refused, and offered as data.prepared
    (a data.eval_sets set reads it: tests/test_eval_sets.py)."""
    from nljax.data import documents

    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "manifest.json").write_text(json.dumps({"format": prepared.FORMAT}))
    prep = str(tmp_path / "prep")
    with pytest.raises(config.ConfigError) as e:
        documents.expand([prep], "data.train")
    assert str(e.value) == (f"data.train: {prep} holds data nljax.prepare wrote, not text: give it as "
                            f"data.prepared={prep}")


def test_a_glob_matching_a_link_to_nothing_or_a_pipe_is_refused(tmp_path):
    """A glob skipped a link to nothing (a share not mounted) and a pipe as it skips a folder: the
    text lacked that file without a word. Refused as when named, a link named as such."""
    import os

    from nljax.data import documents

    (tmp_path / "a.txt").write_text("mine")
    (tmp_path / "b.txt").symlink_to(tmp_path / "unmounted" / "b.txt")
    for pattern in ("*.txt", "b.txt"):
        with pytest.raises(config.ConfigError) as e:
            documents.expand([str(tmp_path / pattern)], "data.train")
        assert str(e.value) == (f"data.train: {tmp_path / 'b.txt'} is a symbolic link to "
                                f"{tmp_path / 'unmounted' / 'b.txt'}, which does not exist")
    (tmp_path / "b.txt").unlink()
    os.mkfifo(tmp_path / "c.txt")
    with pytest.raises(config.ConfigError) as e:
        documents.expand([str(tmp_path / "*.txt")], "data.train")
    assert str(e.value) == f"data.train: {tmp_path / 'c.txt'} is not a regular file (a pipe or a device)"
    (tmp_path / "c.txt").unlink()
    (tmp_path / "sub.txt").mkdir()  # a folder a glob matches is still skipped
    assert documents.expand([str(tmp_path / "*.txt")], "data.train") == [tmp_path / "a.txt"]


def test_tokenizer_ids_above_255_and_boundaries_from_the_manifest(corpus, tokenizer):
    d = data_config(f"data.train=[{','.join(corpus['train'])}]", f"data.tokenizer={tokenizer}",
                    "data.doc_end_token=<eos>").data
    c = prepared.build(d)
    m = c.manifest
    assert m["dtype"] == "uint16" and m["vocab_size"] == 320 and m["train"]["max_token"] > 255
    eos = tokenization.load(str(tokenizer), "<eos>").end_id
    assert (c.train.tokens[c.train.ends] == eos).all() and (c.train.tokens == eos).sum() == len(c.train.ends)
    assert c.tokens_per_byte < 0.5  # merges: fewer tokens than bytes
    # nljax.generate encodes a prompt and decodes the samples with the same tokenizer
    codec = tokenization_of(data_config(f"data.train=[{','.join(corpus['train'])}]", f"data.tokenizer={tokenizer}"))
    # multi-byte characters split across byte-level tokens (記憶's bytes, never merged: one token each)
    text = corpus["docs"][0] + " été 記憶"
    assert "".join(codec.decode_stream(codec.encode(text))) == text and max(codec.encode(text)) > 255
    # `reset` from the manifest's document ends == a token-by-token scan for a boundary
    stream = ContextStream(c.train.tokens, 8, 8, seed=3, ends=c.train.ends)
    is_end = np.zeros(len(c.train.tokens), bool)
    is_end[c.train.ends] = True
    n = len(c.train.tokens)
    for step in range(1, 60):
        start = stream.offsets() + step * 8
        want = is_end[(start[:, None] - 8 + np.arange(8)) % n].any(axis=1)
        np.testing.assert_array_equal(stream.rows_at(step, np.arange(8))["reset"], want)
    # bytes: the ends give the rows the stdlib corpus' NUL scan gives, batch for batch
    b = prepared.build(data_config(f"data.train=[{','.join(corpus['train'])}]").data).train
    by_ends, by_nul = ContextStream(b.tokens, 8, 16, 1, ends=b.ends), ContextStream(b.tokens, 8, 16, 1)
    assert (b.tokens[b.ends] == SEPARATOR).all()
    for step in range(0, 40):
        x, y = by_ends.rows_at(step, np.arange(8)), by_nul.rows_at(step, np.arange(8))
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
        np.testing.assert_array_equal(x["reset"], y["reset"])


def test_vocab_size_is_taken_from_the_tokenizer_and_checked(corpus, tokenizer):
    files = [f"data.train=[{','.join(corpus['train'])}]", f"data.tokenizer={tokenizer}"]
    assert tasks.resolve(data_config(*files)).model.vocab_size == 320  # left at 256: the tokenizer's
    assert tasks.resolve(data_config(*files, "model.vocab_size=384")).model.vocab_size == 384  # padded
    with pytest.raises(config.ConfigError, match="model.vocab_size=300 is smaller than the 320 tokens"):
        tasks.resolve(data_config(*files, "model.vocab_size=300"))
    with pytest.raises(config.ConfigError, match="model.vocab_size=200 is smaller than the 256 tokens of bytes"):
        tasks.resolve(data_config(files[0], "model.vocab_size=200"))


# ---------------------------------------------------------------------------------------------
# Training through the real entry, resumed exactly and elastically


@pytest.fixture(autouse=True)
def _own_compile_cache():
    """The runs below turn on JAX's persistent compile cache (run.compile_cache=auto, under this
    session's $XDG_CACHE_HOME); it is turned off again for the tests that follow in this process."""
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_bytes_from_txt_and_jsonl_train_without_preparing(corpus, tmp_path, capsys):
    """data.train alone: tokenized into memory at start; summary.json, the lockstep fingerprint
    and the checkpoints carry the content digest, which another corpus changes."""
    train = f"data.train=[{','.join(corpus['train'])}]"
    run = tmp_path / "run"
    assert train_main([*QUICK, *TINY, "data.source=files", train, f"run.dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    m = prepared.build(data_config(train, "data.eval_fraction=0.2").data).manifest
    assert summary["data"] == {"source": "files", "train_tokens": m["train"]["tokens"],
                               "eval_tokens": m["eval"]["tokens"], "vocab_size": 320, "digest": m["digest"]}
    assert np.isfinite(summary["eval_bpb"]) and len(records(run)) == 6
    mesh = meshlib.make_mesh(1, 1, jax.devices()[:1])
    small = [*TINY, "eval.stream_steps=1"]
    task = tasks.TextTask(tasks.resolve(data_config(*small, train)), mesh)
    other = tasks.TextTask(tasks.resolve(data_config(*small, train, f"data.eval={corpus['eval'][0]}")), mesh)
    assert startup.data_fingerprint(task) == m["digest"] != startup.data_fingerprint(other)
    # the checkpoint keeps the digest: a resume on other data is told so (one warning line)
    assert storage.read_meta(run / "checkpoints" / "6")["data"]["digest"] == m["digest"]
    capsys.readouterr()
    assert train_main([*QUICK, *TINY, "data.source=files", train, f"data.eval={corpus['eval'][0]}", "--resume",
                       f"run.dir={run}", "train.steps=7"]) == 0
    warned = [l for l in capsys.readouterr().err.splitlines() if "other data" in l]
    assert warned == [f"nljax: warning: checkpoint {run / 'checkpoints' / '6'} was trained on other data (digest "
                      f"{m['digest'][:12]} there, {startup.data_fingerprint(other)[:12]} here): the resumed run "
                      "reads other data than the run it continues"], warned


def test_another_tokenizer_is_refused_on_resume_and_load(corpus, tokenizer, tmp_path, capsys):
    """Checkpoints record what their token ids are: bytes, or the tokenizer's sha256. Resuming or
    loading with ids of another tokenizer of the same size (the model fits, the ids mean other
    text) is one line and writes nothing; a new run from the parameters alone is warned."""
    import nljax

    tok = tmp_path / "tok.json"
    shutil.copy(tokenizer, tok)
    train = f"data.train=[{','.join(corpus['train'])}]"
    args = [*QUICK, *TINY, "data.source=files", train, f"data.tokenizer={tok}", "data.doc_end_token=<eos>"]
    run, byte_run = tmp_path / "run", tmp_path / "bytes"
    assert train_main([*args, f"run.dir={run}"]) == 0
    sha = hashlib.sha256(tok.read_bytes()).hexdigest()
    assert storage.read_meta(run / "checkpoints" / "6")["data"]["tokenizer"] == {"kind": "tokenizers", "sha256": sha}
    assert train_main([*QUICK, *TINY, "data.source=files", train, f"run.dir={byte_run}"]) == 0  # 320 rows too
    # the same vocabulary, two tokens' ids swapped: every shape fits, the ids mean other text
    spec = json.loads(tok.read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok.write_text(json.dumps(spec))
    other = hashlib.sha256(tok.read_bytes()).hexdigest()
    capsys.readouterr()
    for resumed, saved in ((run, f"the tokenizer of sha256 {sha[:12]}"), (byte_run, "byte tokens")):
        before = tree_hash(resumed)
        assert train_main([*args, "--resume", f"run.dir={resumed}", "train.steps=7"]) == 2
        assert one_line(capsys) == (f"nljax.train: error: checkpoint {resumed / 'checkpoints' / '6'} was trained on "
                                    f"{saved}, this run's data use the tokenizer of sha256 {other[:12]}: its token "
                                    "ids would stand for other text")
        assert tree_hash(resumed) == before
    # a tokenizer of more tokens than the run's model has rows for: the resume's own line
    big = json.loads(tok.read_text())
    big["model"]["vocab"].update({f"extra{i}": 320 + i for i in range(10)})
    (bigger := tmp_path / "big.json").write_text(json.dumps(big))
    assert train_main([*args, f"data.tokenizer={bigger}", "--resume", f"run.dir={run}", "train.steps=7"]) == 2
    assert one_line(capsys) == (f"nljax.train: error: model.vocab_size=320 is smaller than the 330 tokens of the "
                                f"tokenizer's vocabulary (the run's, {run / 'config.yaml'}): its model has no row "
                                "for the other tokens; resume on data of the run's tokenizer")
    # run.dir's data.tokenizer file changed since it trained: the load would decode other text
    with pytest.raises(config.ConfigError, match=f"trained on the tokenizer of sha256 {sha[:12]}, the run's data "
                                                 f"now use the tokenizer of sha256 {other[:12]}"):
        nljax.load(run)
    # a new run from the parameters alone: the user's choice, warned
    assert train_main([*args, f"checkpoint.init_params={run}", f"run.dir={tmp_path / 'new'}", "train.steps=1"]) == 0
    assert f"trained on the tokenizer of sha256 {sha[:12]}" in capsys.readouterr().err


def test_a_bytes_run_resumed_with_a_tokenizer_is_told_the_tokenization(corpus, tokenizer, tmp_path):
    """A run of byte tokens (model.vocab_size never set: the bytes' 256) resumed with
    data.tokenizer: the line names the tokenizations, not a model.vocab_size the user never set."""
    from nljax.run.resuming import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    train = f"data.train=[{','.join(corpus['train'])}]"
    data = ["model.name=cms_mlp", "data.source=files", train, f"run.dir={run}"]
    saved = tasks.resolve(config.load(None, data))
    assert saved.model.vocab_size == 256
    (run / "config.yaml").write_text(json.dumps(config.to_dict(saved)))  # YAML reads JSON
    args = ["checkpoint.resume=latest", f"run.dir={run}", f"data.tokenizer={tokenizer}", "data.doc_end_token=<eos>"]
    with pytest.raises(config.ConfigError) as e:
        resumed_config(config.load(None, args, check=False), None, args)
    assert str(e.value) == (f"the run in {run} was trained on byte tokens (model.vocab_size=256 in "
                            f"{run / 'config.yaml'}), this run's data use data.tokenizer={tokenizer} (320 tokens): its "
                            "token ids would stand for other text; resume on data of the run's tokenization, or start "
                            "a new run in another run.dir")
    # model.vocab_size set on the command line: that key is the line's, as before
    with pytest.raises(config.ConfigError, match=r"^model.vocab_size=320 cannot change on resume \(256 in"):
        resumed_config(config.load(None, [*args, "model.vocab_size=320"], check=False), None, [*args, "model.vocab_size=320"])


def test_a_resume_takes_a_data_override_alone(corpus, tmp_path, capsys):
    """Prepared data moved since the run: `--resume run.dir=R data.prepared=NEW` resumes (the
    command line alone, data.source at its default, was refused before the saved config applied)."""
    prep, moved, run = tmp_path / "prep", tmp_path / "moved", tmp_path / "run"
    assert prepare_main([f"data.train=[{','.join(corpus['train'])}]", "data.eval_fraction=0.2", f"out={prep}"]) == 0
    assert train_main([*QUICK, *TINY, "train.steps=2", "data.source=files", f"data.prepared={prep}",
                       f"run.dir={run}"]) == 0
    prep.rename(moved)
    assert train_main(["--quiet", "--resume", f"run.dir={run}", "train.steps=3", f"data.prepared={moved}"]) == 0
    assert [r["step"] for r in records(run)] == [0, 1, 2]
    # and a fresh run still needs data.source=files with it
    assert train_main(["--quiet", f"data.prepared={moved}", f"run.dir={tmp_path / 'new'}"]) == 2
    assert "data.prepared is read only with data.source=files" in capsys.readouterr().err


def test_a_loaded_model_reads_no_text(corpus, tokenizer, tmp_path):
    """nljax.load (generate, export, lm_eval) needs the tokenizer's file, not the text: the token
    files of data.prepared deleted, or the data.train files gone, it loads and samples the same."""
    import nljax

    prep, run, mem = tmp_path / "prep", tmp_path / "run", tmp_path / "mem"
    src = tmp_path / "src"
    shutil.copytree(corpus["root"], src)
    train = f"data.train=[{src}/*.txt,{src}/*.jsonl]"
    assert prepare_main([train, f"data.tokenizer={tokenizer}", "data.doc_end_token=<eos>", f"out={prep}"]) == 0
    assert train_main([*QUICK, *TINY, "data.source=files", f"data.prepared={prep}", f"run.dir={run}"]) == 0
    assert train_main([*QUICK, *TINY, "data.source=files", train, f"data.tokenizer={tokenizer}",
                       "data.doc_end_token=<eos>", f"run.dir={mem}"]) == 0
    before = {r: nljax.load(r).generate("the ", max_new_tokens=5, seed=0) for r in (run, mem)}
    for p in [*prep.glob("*.bin"), *prep.glob("*.npy")]:
        p.unlink()
    shutil.rmtree(src)
    assert {r: nljax.load(r).generate("the ", max_new_tokens=5, seed=0) for r in (run, mem)} == before
    # the tokenizer's file is still checked: the prepared copy edited is refused
    (prep / "tokenizer.json").write_text((prep / "tokenizer.json").read_text().replace("<eos>", "<end>"))
    with pytest.raises(config.ConfigError, match="is not the tokenizer it was prepared with"):
        nljax.load(run)


def test_tokenized_files_train_and_resume_exactly_and_elastically(corpus, tokenizer, tmp_path):
    """Prepared with the tokenizer; 6 steps on 8 devices with checkpoints after 3 and 6. Resumed
    from step 3 on the same 8 devices: the same losses bitwise; on 4 devices (elastic): the same
    up to float reduction order."""
    prep = tmp_path / "prep"
    assert prepare_main([f"data.train=[{','.join(corpus['train'])}]", f"data.tokenizer={tokenizer}",
                         "data.doc_end_token=<eos>", "data.eval_fraction=0.2", f"out={prep}"]) == 0
    # model.vocab_size at its default: taken from the tokenizer
    args = [*QUICK, *TINY, "model.vocab_size=256", "checkpoint.every=3", "data.source=files", f"data.prepared={prep}"]
    ref = tmp_path / "ref"
    assert train_main([*args, f"run.dir={ref}"]) == 0
    assert config.load(str(ref / "config.yaml")).model.vocab_size == 320  # from the tokenizer
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["data"]["digest"] == json.loads((prep / "manifest.json").read_text())["digest"]
    assert summary["data"]["vocab_size"] == 320
    losses = [r["loss"] for r in records(ref)]
    for name in ("same", "elastic"):  # the run as it was after step 3
        shutil.copytree(ref, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "6")
    assert train_main([*args, "--resume", f"run.dir={tmp_path / 'same'}"]) == 0
    assert [r["loss"] for r in records(tmp_path / "same")] == losses
    assert json.loads((tmp_path / "same" / "summary.json").read_text())["eval_loss"] == summary["eval_loss"]
    p = cli("nljax.train", "--cpu-devices", "4", "--resume", *args, f"run.dir={tmp_path / 'elastic'}", check=False)
    assert p.returncode == 0, p.stderr
    elastic = [r["loss"] for r in records(tmp_path / "elastic")]
    assert elastic[:3] == losses[:3]
    np.testing.assert_allclose(elastic[3:], losses[3:], rtol=1e-5)


def test_the_eval_fraction_a_refusal_names_holds_a_document_out(tmp_path):
    """The data.eval_fraction that "no held-out documents" proposes holds out one (the last)."""
    root = tmp_path / "R"
    _bad_files(root)
    assert prepare_main([f"data.train=[{root}/ok.txt,{root}/two.jsonl]", "data.eval_fraction=0.3333",
                         f"out={tmp_path / 'out'}"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["train"]["documents"], manifest["eval"]["documents"]) == (2, 1), manifest


# ---------------------------------------------------------------------------------------------
# Bad data: one line, exit 2, before training; nothing written


def _bad_files(root: Path) -> None:
    root.mkdir()
    (root / "ok.txt").write_text("fine text\n")
    (root / "two.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (root / "empty.txt").write_text("\0\0")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "bad.jsonl").write_text('{"text": "one"}\n{"text": "two"\n')
    (root / "latin1.jsonl").write_bytes('{"text": "one"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    (root / "nokey.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (root / "nulltext.jsonl").write_text('{"text": null}\n')
    (root / "array.jsonl").write_text('["one", "two"]\n')
    (root / "surrogate.jsonl").write_text('{"text": "one"}\n{"text": "half \\ud83d an emoji"}\n')
    (root / "notgz.txt.gz").write_bytes(b"plain text, not gzip")
    (root / "notes.md").write_text("# not a supported type\n")
    (root / "sub").mkdir()
    (root / "prep").mkdir()  # what nljax.prepare writes: named as text
    (root / "prep" / "manifest.json").write_text(json.dumps({"format": prepared.FORMAT}))
    from tokenizers import Tokenizer, models, pre_tokenizers

    gap = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "fine": 5}, unk_token="[UNK]"))  # 2 entries, id 5
    gap.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    gap.save(str(root / "gap.json"))
    (root / "model").mkdir()  # a model's folder, as downloaded from the Hub
    gap.save(str(root / "model" / "tokenizer.json"))


BAD = [
    (["data.train=R/missing.txt"], "data.train: no file R/missing.txt"),
    (["data.train=R/*.text"], "data.train: 'R/*.text' matches no file"),
    # paths joined by a comma are one path: said how to give several
    (["data.train=R/ok.txt,R/two.jsonl"], "data.train: no file R/ok.txt,R/two.jsonl (several paths are a list: "
                                          "data.train='[R/ok.txt, R/two.jsonl]')"),
    (["data.train=R/ok.txt", "data.eval=R/*.jsonl, R/e*.txt"], "data.eval: 'R/*.jsonl, R/e*.txt' matches no file "
                                                               "(several paths are a list: data.eval='[R/*.jsonl, "
                                                               "R/e*.txt]')"),
    (["data.train=R/sub"], "data.train: R/sub is a directory"),
    # the glob offered was R/prep/*.txt
    (["data.train=R/prep"], "data.train: R/prep holds data nljax.prepare wrote, not text: give it as "
                            "data.prepared=R/prep"),
    # a shell's completion ends a folder with "/": the glob offered was R/sub//*.txt
    (["data.train=R/sub/"], "data.train: R/sub/ is a directory (give a glob such as R/sub/*.txt, or a folder"),
    (["data.train="], "data.train: an empty path"),
    (["data.train=R/ok.txt", "data.eval=['']"], "data.eval: an empty path"),
    (["data.train=R/notes.md"], "data.train: R/notes.md is not a file nljax reads as text (it reads .txt, .jsonl, "
                                      ".txt.gz, .jsonl.gz, .parquet, .arrow or .feather files, or folders datasets' save_to_disk "
                                      "wrote)"),
    (["data.train=R/empty.txt"], "data.train: no text in 1 file(s)"),
    (["data.train=R/latin1.txt"], "R/latin1.txt: not UTF-8 text (byte 3"),
    (["data.train=R/bad.jsonl"], "R/bad.jsonl:2: not valid JSON"),
    # the line's own message, not wrapped in "not valid JSON (...)" naming the line twice
    (["data.train=R/latin1.jsonl"], "R/latin1.jsonl:2: not UTF-8 text (byte 13"),
    # what the line holds instead: a corpus's text under another name is found at once
    (["data.train=R/nokey.jsonl"], "R/nokey.jsonl:2: no string field 'text' (data.text_key; its fields: body)"),
    (["data.train=R/nulltext.jsonl"], "R/nulltext.jsonl:1: no string field 'text' (data.text_key; it holds null)"),
    (["data.train=R/array.jsonl"], "R/array.jsonl:1: no string field 'text' (data.text_key; the line is an array, "
                                   "not an object)"),
    (["data.train=R/surrogate.jsonl"], "R/surrogate.jsonl:2: field 'text' holds a lone surrogate"),
    (["data.train=R/notgz.txt.gz"], "R/notgz.txt.gz: not a valid gzip file"),
    # a single .txt is one document: said, as no data.eval_fraction splits it
    (["data.train=R/ok.txt"], "no held-out documents: 1 document(s) at data.eval_fraction=0.05 (every 20th held out) "
                              "hold out none; give data.eval or more documents (a .txt file is one document, never "
                              "split: cut it into several files)"),
    (["data.train=R/ok.txt", "data.eval_fraction=0.5"], "no held-out documents: 1 document(s) at "
                                                          "data.eval_fraction=0.5 (every 2nd held out) hold out none"),
    # the fraction that holds one out is named, and it does: every 3rd of 3 documents
    (["data.train=[R/ok.txt,R/two.jsonl]"], "no held-out documents: 3 document(s) at data.eval_fraction=0.05 (every "
                                          "20th held out) hold out none; give data.eval, data.eval_fraction=0.3333 or "
                                          "more (at most 0.5) or more documents"),
    (["data.train=R/ok.txt", "data.eval=R/ok.txt"], "R/ok.txt is in both data.train and data.eval"),
    (["data.train=R/ok.txt", "data.eval=R/sub/../ok.txt"], "R/sub/../ok.txt is in both data.train and data.eval"),
    (["data.train=R/ok.txt", "data.tokenizer=R/gap.json"],
     "data.tokenizer R/gap.json gave token id 5, not below its vocabulary size 2"),
    (["data.train=R/ok.txt", "data.tokenizer=R/ok.txt"], "data.tokenizer: R/ok.txt is not a tokenizers tokenizer.json"),
    # a Hub name, as Levanter's and MaxText's tokenizer settings take: said to be none
    (["data.train=R/ok.txt", "data.tokenizer=gpt2"],
     "data.tokenizer: cannot read gpt2: No such file or directory (a tokenizer.json file, not a Hub name"),
    (["data.train=R/ok.txt", "data.tokenizer=R/model"],
     "data.tokenizer: cannot read R/model: Is a directory (give the tokenizer.json in it: "
     "data.tokenizer=R/model/tokenizer.json)"),
    (["data.train=R/ok.txt", "data.tokenizer=R/gap.json", "data.doc_end_token=</s>"],
     "data.doc_end_token='</s>' is not a token"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m.split(":")[-1][:30].strip() for _, m in BAD])
def test_bad_data_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    root = tmp_path / "R"
    _bad_files(root)
    sub = lambda s: s.replace("R/", f"{root}/")
    out = tmp_path / "out"
    assert prepare_main([*map(sub, args), f"out={out}"]) == 2
    assert one_line(capsys).startswith(f"nljax.prepare: error: {sub(message)}")
    assert not out.exists()
    run = tmp_path / "run"  # the same through training without preparing: before anything is built
    assert train_main(["--quiet", "data.source=files", *map(sub, args), f"run.dir={run}"]) == 2
    assert one_line(capsys).startswith(f"nljax.train: error: {sub(message)}")
    assert not run.exists()


def test_overwrite_is_true_or_false(tmp_path, capsys):
    """overwrite=yes (or True) was read as false: the refusal of a DIR holding data then asked for
    the overwrite=true just given."""
    assert prepare_main(["data.train=x.txt", "overwrite=yes", f"out={tmp_path / 'out'}"]) == 2
    assert one_line(capsys) == "nljax.prepare: error: overwrite must be true or false, got 'yes'"
    assert not (tmp_path / "out").exists()


def test_bad_prepared_data_and_vocab_are_one_line(corpus, tokenizer, tmp_path, capsys):
    prep = tmp_path / "prep"
    files = f"data.train=[{','.join(corpus['train'])}]"
    assert prepare_main([files, f"data.tokenizer={tokenizer}", f"out={prep}"]) == 0
    again = tmp_path / "again"  # one config for both steps: data.prepared is where prepare writes
    assert prepare_main([files, f"data.tokenizer={tokenizer}", f"data.prepared={again}"]) == 0
    assert (again / "manifest.json").read_text() == (prep / "manifest.json").read_text()
    capsys.readouterr()
    cases = [
        ([f"data.prepared={prep}", "model.vocab_size=300"], "model.vocab_size=300 is smaller than the 320 tokens"),
        ([f"data.prepared={prep}", "data.doc_end_token=<eos>"],
         f"data.prepared={prep} was prepared with data.doc_end_token=None, not '<eos>'"),
        ([f"data.prepared={tmp_path}"], f"data.prepared={tmp_path} holds no manifest.json"),
        ([f"data.prepared={tmp_path / 'none'}"], f"data.prepared={tmp_path / 'none'} does not exist: write it with"),
        ([f"data.prepared={tokenizer}"], f"data.prepared={tokenizer} is a file, not a directory: write it with"),
        # its tokenizer has no end token, known once DIR is read: still before run.dir is written
        ([f"data.prepared={prep}", "train.sample_every=1", "train.seq_len=16", "eval.stream_steps=0"], "an empty prompt starts a document after "
                                                            "data.doc_end_token"),
    ]
    for args, message in cases:
        assert train_main(["--quiet", "data.source=files", *args, f"run.dir={tmp_path / 'run'}"]) == 2
        assert one_line(capsys).startswith(f"nljax.train: error: {message}")
    with open(prep / "train.bin", "r+b") as f:  # a token file cut short
        f.truncate(10)
    assert train_main(["--quiet", "data.source=files", f"data.prepared={prep}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "train.bin holds 10 bytes, the manifest says" in one_line(capsys)
    (prep / "train.bin").unlink()  # it said "train.bin holds None bytes"
    assert train_main(["--quiet", "data.source=files", f"data.prepared={prep}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert one_line(capsys).endswith(f"data.prepared={prep}: train.bin is missing (deleted or moved since): "
                                     "prepare again")
    assert not (tmp_path / "run").exists()


def test_prepared_data_with_another_tokenizer_is_named_as_such(corpus, tokenizer, tmp_path):
    """data.prepared with data.train and another tokenizer (its end token not given): the line
    named data.doc_end_token's change, not the tokenizer's."""
    from tokenizers import Tokenizer

    prep, files = tmp_path / "prep", f"data.train=[{','.join(corpus['train'])}]"
    prepared.build(data_config(files, f"data.tokenizer={tokenizer}", "data.doc_end_token=<eos>").data, prep)
    other = tmp_path / "other.json"
    tok = Tokenizer.from_file(str(tokenizer))
    tok.add_tokens(["zzz"])
    tok.save(str(other))
    with pytest.raises(config.ConfigError) as e:
        prepared.corpus(data_config(files, f"data.prepared={prep}", f"data.tokenizer={other}").data)
    assert str(e.value) == f"data.prepared={prep} was prepared with another tokenizer than data.tokenizer={other}"


def test_an_eval_fraction_beside_prepared_data_alone_is_said(corpus, tmp_path, capsys):
    """data.prepared alone holds its own held-out split, made when it was prepared: a
    data.eval_fraction other than that one (or beside a directory split by data.eval) splits
    nothing, and was ignored without a word; now a note at start-up says so (a config may keep
    the key for its runs on data.train). Its default, and the directory's own, are not noted."""
    files = f"data.train=[{','.join(corpus['train'])}]"
    prep, held = tmp_path / "prep", tmp_path / "held"
    prepared.build(data_config(files, "data.eval_fraction=0.25").data, prep)
    prepared.build(data_config(files, f"data.eval={corpus['eval'][0]}").data, held)
    notes = lambda where, fraction: prepared.split_notes(
        json.loads((where / "manifest.json").read_text()),
        data_config(f"data.prepared={where}", f"data.eval_fraction={fraction}").data)
    assert notes(prep, 0.05) == notes(prep, 0.25) == []
    for where, said in ((prep, "data.eval_fraction=0.25"), (held, "its data.eval")):
        assert notes(where, 0.1) == [f"note: data.eval_fraction=0.1 splits nothing here: data.prepared={where} holds "
                                     f"out what it was prepared with ({said}); prepare again to split otherwise"]
    assert prepare_main([files, "data.eval_fraction=0.25", f"out={tmp_path / 'p'}"]) == 0  # through a run's start-up
    capsys.readouterr()
    said = [a for a in QUICK if a != "--quiet"]  # the notes go with the start-up's lines
    assert train_main([*said, *TINY, "data.source=files", f"data.prepared={tmp_path / 'p'}", "train.steps=1",
                       f"run.dir={tmp_path / 'run'}"]) == 0
    assert (f"note: data.eval_fraction=0.2 splits nothing here: data.prepared={tmp_path / 'p'} holds out what it "
            "was prepared with (data.eval_fraction=0.25)") in capsys.readouterr().out


def test_held_out_text_too_short_names_where_it_came_from(corpus, tmp_path, capsys):
    """Trained from data.prepared alone, the line blamed data.eval_fraction=0.05, which the
    directory was not split by: its held-out text is its data.eval's."""
    (tmp_path / "tiny.txt").write_text("hi")
    prep, files = tmp_path / "prep", f"data.train=[{','.join(corpus['train'])}]"
    assert prepare_main([files, f"data.eval={tmp_path / 'tiny.txt'}", f"out={prep}"]) == 0
    capsys.readouterr()
    for args, source in (([f"data.prepared={prep}"], f"data.prepared={prep}"),
                         ([files, f"data.eval={tmp_path / 'tiny.txt'}"], f"data.eval={tmp_path / 'tiny.txt'}")):
        assert train_main(["--quiet", "data.source=files", *args, f"run.dir={tmp_path / 'run'}"]) == 2
        assert one_line(capsys) == (f"nljax.train: error: the held-out text (3 tokens from {source}) is shorter than "
                                    "train.seq_len+1=129")
    assert not (tmp_path / "run").exists()


def test_a_prepared_dir_matches_its_sources_and_itself(corpus, tokenizer, tmp_path, capsys, monkeypatch):
    """What a run given data.prepared with data.train checks (each case trained silently on other
    text, or decoded with another tokenizer, before), and what it checks of DIR itself."""
    import fcntl

    src = tmp_path / "src"
    shutil.copytree(corpus["root"], src)
    files = [f"data.train=[{src}/*.txt]", "data.eval_fraction=0.2"]
    prep = tmp_path / "prep"
    assert prepare_main([*files, f"out={prep}"]) == 0
    use = lambda *a: prepared.corpus(data_config(*files, f"data.prepared={prep}", *a).data)
    assert use().digest
    (src / "doc0.txt").write_text((src / "doc0.txt").read_text() + "edited\n")
    with pytest.raises(config.ConfigError, match=f"from other files than data.train names now .*{src}/doc0.txt"):
        use()
    (src / "doc0.txt").unlink()
    with pytest.raises(config.ConfigError, match=f"{src}/doc0.txt was added, removed or changed"):
        use()
    # a relative spelling is the files of the directory it was prepared in, not of another
    monkeypatch.chdir(src)
    rel = tmp_path / "rel"
    assert prepare_main(["data.train=[doc1.txt]", f"data.eval=[{src}/held/h0.txt]", f"out={rel}"]) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "doc1.txt").write_text("other text altogether\n")
    monkeypatch.chdir(other)
    with pytest.raises(config.ConfigError, match=r"was prepared with data.train=\[.*src/doc1.txt'\]"):
        prepared.corpus(data_config("data.train=[doc1.txt]", f"data.eval=[{src}/held/h0.txt]", f"data.prepared={rel}").data)
    # a tokenized DIR with data.train and no data.tokenizer (bytes) is refused
    tok_dir = tmp_path / "tok"
    tok_files = [f"data.train=[{corpus['root']}/*.txt]", f"data.eval=[{corpus['root']}/held/*.txt]"]
    assert prepare_main([*tok_files, f"data.tokenizer={tokenizer}", f"out={tok_dir}"]) == 0
    with pytest.raises(config.ConfigError, match="prepared with a tokenizer, and data.tokenizer is not given"):
        prepared.corpus(data_config(*tok_files, f"data.prepared={tok_dir}").data)
    capsys.readouterr()
    # one prepare at a time into a DIR: the second is refused while the first holds the lock
    busy = tmp_path / "busy"
    with open(outdir.at(busy).lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert prepare_main([*tok_files, f"out={busy}"]) == 2
    assert "another nljax.prepare is writing into" in one_line(capsys)
    assert prepare_main([*tok_files, f"out={busy}"]) == 0  # released: it writes
    # DIR itself: a manifest lacking a key, a tokenizer copy that is not the manifest's, document
    # starts out of order: one line each
    def broken(name, change):
        d = tmp_path / name
        shutil.copytree(tok_dir, d)
        change(d)
        assert train_main(["--quiet", "data.source=files", f"data.prepared={d}", f"run.dir={tmp_path / 'run'}"]) == 2
        return one_line(capsys)
    def drop_digest(d):
        m = json.loads((d / "manifest.json").read_text())
        del m["digest"]
        (d / "manifest.json").write_text(json.dumps(m))
    assert "manifest.json lacks 'digest'" in broken("nodigest", drop_digest)
    assert "tokenizer.json is not the tokenizer it was prepared with" in broken(
        "othertok", lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace("<eos>", "<eot>")))
    def unsorted(d):
        starts = np.load(d / "train.docs.npy")
        starts[1], starts[2] = starts[2], starts[1]
        np.save(d / "train.docs.npy", starts)
    assert "train.docs.npy does not match the manifest" in broken("unsorted", unsorted)
    assert not (tmp_path / "run").exists()


def test_training_samples_are_the_tokenizers_text(corpus, tokenizer):
    """train.sample_every with a tokenizer: the prompt is the tokenizer's ids and the sample its
    decoding (ids above 255 are tokens, not bytes), as nljax.generate writes it: to the
    tokenizer's end token (data.doc_end_token), if the model samples it."""
    from nljax.run.core import Run
    from nljax.run.samples import TrainingSampler
    from nljax.run.sampling import Settings, TextSampler

    cfg = data_config(*TINY, "model.vocab_size=256", f"data.train=[{','.join(corpus['train'])}]",
                      f"data.tokenizer={tokenizer}", "data.doc_end_token=<eos>", "train.sample_every=1",
                      "train.sample_prompt=the memory", "train.sample_tokens=48", "mesh.intra=1",
                      "train.batch_size=1")
    run = Run.create(cfg, jax.devices()[:1])
    params = run.init_state().params
    text, why = TrainingSampler(run).sample(params)
    codec = tokenization.load(str(tokenizer), "<eos>")
    sampler = TextSampler(run.engine.model, run.engine.strategy.gather_params(params), run.mesh, cfg.train.seq_len,
                          codec.end_id, vocab=cfg.model.vocab_size)
    ids = list(sampler.tokens(codec.encode("the memory"), Settings(prompt="the memory", max_new_tokens=48,
                                                                    seed=cfg.seed)))
    assert max(ids) >= 256  # an untrained model samples the whole vocabulary
    end = ids.index(codec.end_id) if codec.end_id in ids else len(ids)
    assert text == "the memory" + "".join(codec.decode_stream(ids[:end], context=codec.encode("the memory")))
    assert why == ("eos" if end < len(ids) else "length")


def test_continuations_read_after_the_prompt(tmp_path):
    """A SentencePiece-style decoder (Metaspace) drops the leading space of the first token it
    decodes, a WordPiece one writes a continuation's '##': the sampled tokens are decoded after
    the prompt's, so 'the' + ' quick' is not shown as 'thequick'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "\u2581the": 1, "\u2581quick": 2, "\u2581fox": 3},
                                        unk_token="[UNK]"))
    pieces.pre_tokenizer, pieces.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    words = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "the": 1, "quick": 2, "##ly": 3}, unk_token="[UNK]"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    for tok, prompt, new, want in ((pieces, "the", [2, 3], "the quick fox"), (words, "the quick", [3, 2], "the quickly quick")):
        tok.save(str(tmp_path / "tokenizer.json"))
        codec = tokenization.load(str(tmp_path / "tokenizer.json"))
        ids = codec.encode(prompt)
        assert prompt + "".join(codec.decode_stream(iter(new), context=ids)) == want
        assert tok.decode(ids + new) == want  # what the whole sequence reads


def test_decode_is_the_streams_pieces_joined_in_two_decodings(corpus, tokenizer, tmp_path):
    """`decode` (the harness's stop check at every generated token, `nljax.load(...).decode`) was
    `decode_stream`'s pieces joined: a tokenizer.json decoded the whole sequence again per token,
    12 s of host time per 256-token answer after a 2,000-token prompt. Now two decodings, and the
    same text (after a prompt with a Metaspace decoder too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "\u2581the": 1, "\u2581quick": 2, "\u2581fox": 3},
                                        unk_token="[UNK]"))
    pieces.pre_tokenizer, pieces.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    pieces.save(str(tmp_path / "pieces.json"))
    rng = random.Random(3)
    text = "".join(_text(rng) for _ in range(8))
    for codec, prompt in ((tokenization.Bytes(), "déjà "), (tokenization.load(str(tokenizer)), "the memory"),
                          (tokenization.load(str(tmp_path / "pieces.json")), "the")):
        ids, ctx = codec.encode(text)[:300] if prompt != "the" else [2, 3, 2], codec.encode(prompt)
        assert codec.decode(ids, context=ctx) == "".join(codec.decode_stream(ids, context=ctx))
        assert codec.decode(ids) == "".join(codec.decode_stream(ids))
    codec = tokenization.load(str(tokenizer))
    ids, ctx = codec.encode(text), codec.encode("the memory")
    codec.tok = mock.Mock(wraps=codec.tok)  # counts the tokenizer's decodings
    codec.decode(ids, context=ctx)
    assert len(ids) > 100 and codec.tok.decode.call_count == 2


def test_a_glob_skips_what_a_run_wrote_in_its_run_dir(tmp_path, capsys):
    """A run directory inside the corpus's folder (data.train='notes/**/*.txt' with
    run.dir=notes/runs/x): the glob read the run's own files as text (its nljax_written.txt,
    metrics.jsonl, W&B's requirements.txt), and more of them at each resume. Those a run's
    listing names are skipped; a user's file in a run directory, and a run's file named without
    a glob, are read."""
    from nljax.data import documents
    from nljax.runtime import runlog

    assert documents.RUN_LISTING == runlog.WRITTEN
    notes = tmp_path / "notes"
    (notes / "runs" / "x" / "wandb" / "run-1" / "files").mkdir(parents=True)
    for name in ("a.txt", "b.jsonl", "runs/x/mine.txt", "runs/x/metrics.jsonl",
                 "runs/x/wandb/run-1/files/requirements.txt"):
        (notes / name).write_text('{"text": "t"}\n')
    for name in ("metrics.jsonl", "wandb"):
        runlog.note_written(notes / "runs" / "x", name)
    globs = [f"{notes}/**/*.txt", f"{notes}/**/*.jsonl"]
    assert documents.expand(globs, "data.train") == [notes / "a.txt", notes / "runs/x/mine.txt", notes / "b.jsonl"]
    metrics = notes / "runs" / "x" / "metrics.jsonl"
    assert documents.expand([str(metrics)], "data.train") == [metrics]


def test_a_file_named_twice_is_read_once(tmp_path):
    """data.train's paths and globs: each file once, in the order first named, however often and
    however spelled (a path, another spelling of it, a glob that matches it again)."""
    from nljax.data import documents

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name)
    (tmp_path / "sub").mkdir()
    names = [str(tmp_path / "b.txt"), str(tmp_path / "sub" / ".." / "b.txt"), str(tmp_path / "*.txt")]
    assert [p.name for p in documents.expand(names, "data.train")] == ["b.txt", "a.txt"]


def test_a_document_the_tokenizer_gives_no_tokens_is_no_document(tmp_path):
    """A tokenizer may give nothing for a text (whitespace alone, split away by its
    pre-tokenizer; no data.doc_end_token): that text is no document, so no two documents start
    at the same token and each document's end is after its start."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "   ", "b a a"]))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    c = prepared.build(data_config(f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}",
                                   f"data.tokenizer={tmp_path / 'tokenizer.json'}").data)
    assert c.manifest["train"]["documents"] == 2
    np.testing.assert_array_equal(c.train.starts, [0, 2])
    np.testing.assert_array_equal(c.train.ends, [1, 4])


def test_a_tokenizer_counts_each_documents_bytes_and_end_as_bytes_do(tokenizer, tmp_path):
    """`encode_flat`'s third array, each document's UTF-8 bytes + 1 (its end, as the byte
    tokenization's NUL), is the same whatever the tokenization: bits per byte compare across
    them. A tokenizer.json whose ids skip a number (the id at its vocabulary size) is refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    texts = ["plain", "été 記憶", "a b c"]
    hf = tokenization.load(str(tokenizer))
    np.testing.assert_array_equal(hf.encode_flat(texts, np.uint16)[2], tokenization.Bytes().encode_flat(texts, np.uint8)[2])
    np.testing.assert_array_equal(hf.encode_flat(texts, np.uint16)[2], [6, 13, 6])
    skips = Tokenizer(models.WordLevel({"a": 0, "b": 2}, unk_token="a"))  # 2 tokens, ids 0 and 2
    skips.pre_tokenizer = pre_tokenizers.Whitespace()
    skips.save(str(tmp_path / "skips.json"))
    with pytest.raises(config.ConfigError, match="gave token id 2, not below its vocabulary size 2"):
        tokenization.load(str(tmp_path / "skips.json")).encode_flat(["a b"], np.uint16)


def test_documents_are_encoded_without_the_tokenizers_own_special_tokens(tmp_path):
    """A tokenizer.json with a post-processor (BERT's [CLS] ... [SEP]) adds nothing to a document:
    its end is data.doc_end_token's, once, and a prompt is its text's ids alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    wrapping = Tokenizer(models.WordLevel({"[CLS]": 0, "[SEP]": 1, "a": 2, "b": 3}, unk_token="[CLS]"))
    wrapping.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapping.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                            special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    wrapping.save(str(tmp_path / "wrapping.json"))
    tok = tokenization.load(str(tmp_path / "wrapping.json"), "[SEP]")
    ids, lengths, _ = tok.encode_flat(["a b", "b"], np.uint8)
    assert ids.tolist() == [2, 3, 1, 3, 1] and lengths.tolist() == [3, 2]
    assert tok.encode("a b") == [2, 3]
