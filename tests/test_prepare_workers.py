"""nljax.prepare at corpus scale: the same files with 1 and N worker processes (and the same
tokens as the in-memory build, the reference); a prepare killed after some chunks resumes from
its verified record to the same files as one never interrupted, whatever the worker count; a
record that does not match its files, or sources changed since, start over. Memory bounds are in
tests/test_columnar_data.py (row groups) and docs/benchmarks/2026-11-28-prepare-cpu.md (RSS)."""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from nljax import config
from nljax.data import prepared
from nljax.prepare import main as prepare_main

WORDS = "the a memory level stream token window model learns reads writes été 記憶 data file".split()
FILES = ["manifest.json", "train.bin", "eval.bin", "train.docs.npy", "eval.docs.npy", "tokenizer.json"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """400 documents over 4 .jsonl files, and a 300-token BPE trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("scale")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) + "\n" for _ in range(400)]
    for i in range(4):
        (root / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i * 100:(i + 1) * 100]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    args = [f"data.train={root}/*.jsonl", f"data.tokenizer={root}/tokenizer.json", "data.doc_end_token=<eos>",
            "data.eval_fraction=0.1", "prepare.chunk_bytes=3000"]  # about 13 chunks
    return {"root": root, "args": args}


def files(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in FILES}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    """The files of an uninterrupted prepare in this process (workers=0: no pool)."""
    out = tmp_path_factory.mktemp("ref") / "prep"
    d = config.load(None, ["data.source=files", *corpus["args"]]).data
    prepared.build(d, out, workers=0, chunk_bytes=3000)
    return files(out)


def test_one_and_two_workers_write_the_same_files_as_the_in_memory_build(corpus, reference, tmp_path):
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert prepare_main([*corpus["args"], f"prepare.workers={workers}", f"out={out}"]) == 0
        assert files(out) == reference, workers
        assert not (out / prepared.WORK).exists()
    in_memory = prepared.build(config.load(None, ["data.source=files", *corpus["args"]]).data)
    on_disk = prepared.load(tmp_path / "w2")
    assert in_memory.digest == on_disk.digest and on_disk.manifest["train"]["max_token"] > 255
    np.testing.assert_array_equal(in_memory.train.tokens, on_disk.train.tokens)
    np.testing.assert_array_equal(in_memory.eval.starts, on_disk.eval.starts)
    # chunking is how the work is cut, not what is written
    out = tmp_path / "big-chunks"
    assert prepare_main([*corpus["args"], "prepare.chunk_bytes=1000000", "prepare.workers=2", f"out={out}"]) == 0
    assert files(out) == reference


def _killed(corpus, out: Path, after: int, workers: int) -> None:
    """nljax.prepare in a subprocess, SIGKILLed by its test hook once `after` chunks are
    recorded; its worker processes end with it."""
    mark = uuid.uuid4().hex
    p = cli("nljax.prepare", *corpus["args"], f"prepare.workers={workers}", f"out={out}", check=False,
            env={prepared.TEST_KILL_AFTER: str(after), "NLJAX_TEST_MARK": mark})
    assert p.returncode == -9, (p.returncode, p.stderr)
    progress = json.loads((out / prepared.WORK / "progress.json").read_text())
    assert progress["chunks"] == after and not (out / "manifest.json").exists()
    deadline = time.time() + 10
    while _marked(mark) and time.time() < deadline:  # the workers see their parent's pipe close
        time.sleep(0.2)
    assert not _marked(mark), "worker processes outlived the killed prepare"


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds `mark`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_a_killed_prepare_resumes_to_the_same_files(corpus, reference, tmp_path, capsys):
    out = tmp_path / "prep"
    _killed(corpus, out, after=3, workers=2)
    with open(out / prepared.WORK / "part.train.bin", "ab") as f:  # a chunk written after the last record
        f.write(b"\x07" * 1000)
    _killed(corpus, out, after=6, workers=1)  # resumed at 3, killed again at 6, with another worker count
    assert prepare_main([*corpus["args"], "prepare.workers=2", f"out={out}"]) == 0
    said = capsys.readouterr().out
    assert "resuming an interrupted prepare: 6 chunks done" in said and "(verified)" in said
    assert files(out) == reference
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, prepared.LOCK])


def test_ctrl_c_keeps_the_work_and_says_how_to_resume(corpus, reference, tmp_path):
    out = tmp_path / "prep"
    p = cli("nljax.prepare", *corpus["args"], "prepare.workers=2", f"out={out}", check=False,
            env={prepared.TEST_KILL_AFTER: "4:SIGINT"})
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip() == "nljax.prepare: interrupted (Ctrl-C): the same command resumes where it stopped"
    assert json.loads((out / prepared.WORK / "progress.json").read_text())["chunks"] >= 4
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 0
    assert files(out) == reference


def test_a_record_that_does_not_match_or_other_sources_start_over(corpus, reference, tmp_path, capsys):
    out = tmp_path / "prep"
    _killed(corpus, out, after=4, workers=1)
    with open(out / prepared.WORK / "part.train.bin", "r+b") as f:  # a byte inside the recorded prefix
        f.seek(10)
        f.write(b"\xff")
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 0
    assert "files differ from its record, started over" in capsys.readouterr().out
    assert files(out) == reference
    # interrupted, then a source file changes: the work is of other data, started over
    other = tmp_path / "other"
    _killed(corpus, other, after=2, workers=1)
    src = corpus["root"] / "part3.jsonl"
    before = src.read_text()
    try:
        src.write_text(before + json.dumps({"text": "one more document\n"}) + "\n")
        assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={other}"]) == 0
        assert "an interrupted prepare of other data or settings, started over" in capsys.readouterr().out
        assert prepared.load(other).manifest["train"]["documents"] + prepared.load(other).manifest["eval"]["documents"] == 401
    finally:
        src.write_text(before)
        os.utime(src)


def test_bad_data_found_mid_way_leaves_no_work_behind(corpus, tmp_path, capsys):
    """A bad line in the last file, found after chunks were recorded: one line, exit 2, and
    neither DIR nor its work directory is left (nothing to resume: the data must change)."""
    src = tmp_path / "src"
    src.mkdir()
    for p in corpus["root"].glob("*.jsonl"):
        (src / p.name).write_text(p.read_text())
    (src / "part9.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    out = tmp_path / "out"
    args = [f"data.train={src}/*.jsonl", "prepare.chunk_bytes=3000", f"out={out}"]
    assert prepare_main(args) == 2
    assert capsys.readouterr().err.strip() == f"nljax.prepare: error: {src}/part9.jsonl:2: no string field 'text' (data.text_key)"
    assert not out.exists()


def test_a_worker_killed_mid_way_is_one_error_and_the_work_is_kept(corpus):
    """SIGKILL to a worker (as the kernel's OOM killer would): `WorkerDied`, which nljax.prepare
    prints as one line and exit 1, keeping its work directory to resume from."""
    import signal

    from nljax.data import chunks, documents, tokenization

    tok = tokenization.load(str(corpus["root"] / "tokenizer.json"), "<eos>")
    files = documents.expand([f"{corpus['root']}/*.jsonl"], "data.train")
    stream = chunks.encoded(chunks.read([files, []], "text", 3000), tok, np.dtype("<u2"), 2)
    next(stream)
    workers = [int(p) for p in _children() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    with pytest.raises(chunks.WorkerDied, match="a worker process ended before its chunk was tokenized"):
        for _ in stream:
            pass


def _children() -> list[str]:
    return [c for task in Path("/proc/self/task").iterdir() for c in (task / "children").read_text().split()]
