"""nljax.prepare at corpus scale: the same files with 1 and N worker processes (and the same
tokens as the in-memory build, the reference); a prepare killed after some chunks resumes from
its verified record to the same files as one never interrupted, whatever the worker count; a
record that does not match its files, or sources changed since, start over. overwrite=true
replaces DIR whole: killed before, between or after the renames that put the new directory in
place, DIR is the complete previous data or the complete new (or, between the renames, absent,
the previous data whole beside it), and the next prepare recovers with one warning line. Memory bounds are in
tests/test_columnar_data.py (row groups) and docs/benchmarks/2026-11-28-prepare-cpu.md (RSS)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from nljax import config
from nljax.data import outdir, prepared, workdir
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
            "data.eval_fraction=0.1", "prepare.chunk_bytes=3000"]  # 32 chunks
    return {"root": root, "args": args}


def files(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in FILES}


def work(out: Path) -> Path:
    """The work directory of a prepare into `out` (beside it)."""
    return outdir.at(out).work


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
        assert not work(out).exists()
    in_memory = prepared.build(config.load(None, ["data.source=files", *corpus["args"]]).data)
    on_disk = prepared.load(tmp_path / "w2")
    assert in_memory.digest == on_disk.digest and on_disk.manifest["train"]["max_token"] > 255
    np.testing.assert_array_equal(in_memory.train.tokens, on_disk.train.tokens)
    np.testing.assert_array_equal(in_memory.eval.starts, on_disk.eval.starts)
    # chunking is how the work is cut, not what is written
    out = tmp_path / "big-chunks"
    assert prepare_main([*corpus["args"], "prepare.chunk_bytes=1000000", "prepare.workers=2", f"out={out}"]) == 0
    assert files(out) == reference


def test_a_splits_max_token_is_of_all_its_chunks():
    """The manifest's max_token is the largest id of the whole split, not of its last chunk."""
    import io

    sink = workdir.Sink(io.BytesIO(), io.BytesIO(), np.dtype("<u2"))
    sink.add(np.array([5, 299, 0]), np.array([3]), np.array([4]))
    sink.add(np.array([7, 0]), np.array([2]), np.array([3]))
    assert sink.record("train")["max_token"] == 299


def _killed(corpus, out: Path, after: int, workers: int) -> None:
    """nljax.prepare in a subprocess, SIGKILLed by its test hook once `after` chunks are
    recorded; its worker processes end with it."""
    mark = uuid.uuid4().hex
    p = cli("nljax.prepare", *corpus["args"], f"prepare.workers={workers}", f"out={out}", check=False,
            env={prepared.TEST_KILL_AFTER: str(after), "NLJAX_TEST_MARK": mark})
    assert p.returncode == -9, (p.returncode, p.stderr)
    progress = json.loads((work(out) / "progress.json").read_text())
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
    with open(work(out) / "part.train.bin", "ab") as f:  # a chunk written after the last record
        f.write(b"\x07" * 1000)
    _killed(corpus, out, after=6, workers=1)  # resumed at 3, killed again at 6, with another worker count
    assert prepare_main([*corpus["args"], "prepare.workers=2", f"out={out}"]) == 0
    said = capsys.readouterr().out
    assert "resuming an interrupted prepare: 6 chunks done" in said and "(verified)" in said
    assert files(out) == reference
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no lock, work or previous data left beside


@pytest.mark.parametrize("sig, code, said", [("SIGINT", 130, "interrupted (Ctrl-C)"),
                                              ("SIGTERM", 143, "stopped (SIGTERM)"),
                                              ("SIGTERM:group", 143, "stopped (SIGTERM)")])
def test_ctrl_c_or_sigterm_keeps_the_work_and_says_how_to_resume(corpus, reference, tmp_path, sig, code, said):
    """Ctrl-C, or SIGTERM (a batch job's time limit), stops the prepare in one line and the shell's
    128 + the signal, the work kept (SIGTERM ended the process with no word before); the same
    command resumes, and the caller's SIGTERM handler is back after a prepare in its process.
    SIGTERM to the whole process group (SLURM's time limit, `kill -- -PGID`) reaches the workers
    too: the workers dying of it is not said as a worker killed ("run again"), the stop is."""
    out = tmp_path / "prep"
    p = cli("nljax.prepare", *corpus["args"], "prepare.workers=2", f"out={out}", check=False,
            env={prepared.TEST_KILL_AFTER: f"4:{sig}"}, start_new_session=True)
    assert p.returncode == code, p.stderr
    assert p.stderr.strip() == f"nljax.prepare: {said}: the same command resumes where it stopped"
    assert json.loads((work(out) / "progress.json").read_text())["chunks"] >= 4
    before = signal.getsignal(signal.SIGTERM)
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 0
    assert files(out) == reference
    assert signal.getsignal(signal.SIGTERM) == before  # the caller's handler, back


def test_ctrl_c_after_the_first_chunks_of_large_documents_keeps_them(corpus, tmp_path, capsys):
    """Documents of 17 KB, chunks of 40 KB: Ctrl-C once 2 chunks are recorded keeps those 2
    chunks of 3 documents each (the first 6 of 60; lists of 39 documents read whole made the first
    chunk 39 documents, 660 KB, and a user's Ctrl-C in it lost the work: "an interrupted prepare
    that had recorded no chunk, started over"); the same command resumes from them to the files
    of a prepare never interrupted."""
    rng = random.Random(3)
    src = tmp_path / "big.jsonl"
    docs = [" ".join(rng.choice(WORDS) for _ in range(2600))[:17_000] for _ in range(60)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    args = [f"data.train={src}", f"data.tokenizer={corpus['root']}/tokenizer.json", "data.eval_fraction=0.1",
            "prepare.chunk_bytes=40000", "prepare.workers=1"]
    out = tmp_path / "prep"
    p = cli("nljax.prepare", *args, f"out={out}", check=False, env={prepared.TEST_KILL_AFTER: "2:SIGINT"})
    assert p.returncode == 130, p.stderr
    progress = json.loads((work(out) / "progress.json").read_text())
    kept = progress["splits"]["train"]["documents"] + progress["splits"]["eval"]["documents"]
    assert (progress["chunks"], progress["position"], kept) == (2, [0, 0, 6], 6), progress
    assert prepare_main([*args, f"out={out}"]) == 0
    assert "resuming an interrupted prepare: 2 chunks done" in capsys.readouterr().out
    reference = tmp_path / "reference"
    prepared.build(config.load(None, ["data.source=files", *args]).data, reference, workers=0)
    assert files(out) == files(reference)


def test_a_record_that_does_not_match_or_other_sources_start_over(corpus, reference, tmp_path, capsys):
    out = tmp_path / "prep"
    _killed(corpus, out, after=4, workers=1)
    with open(work(out) / "part.train.bin", "r+b") as f:  # a byte inside the recorded prefix
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


def test_work_stopped_before_its_first_record_is_said_so(corpus, reference, tmp_path, capsys):
    """A prepare stopped before its first chunk was recorded (a disk full in it) is not work "of
    other data or settings", as the line said of the same command run again."""
    out = tmp_path / "prep"
    work(out).mkdir(parents=True)
    (work(out) / "part.train.bin").write_bytes(b"\0" * 100)  # written, never recorded
    assert prepare_main([*corpus["args"], "prepare.workers=0", f"out={out}"]) == 0
    assert f"{work(out)}: an interrupted prepare that had recorded no chunk, started over" in capsys.readouterr().out
    assert files(out) == reference


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
    assert capsys.readouterr().err.strip() == (f"nljax.prepare: error: {src}/part9.jsonl:2: no string field 'text' "
                                               "(data.text_key; its fields: body)")
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no DIR, no work, no lock


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


# ---------------------------------------------------------------------------------------------
# overwrite=true: DIR replaced whole


def previous(corpus, out: Path, *extra: str) -> tuple[dict[str, bytes], str]:
    """`out` prepared from the same text held out otherwise: other files and digest; (files, digest)."""
    assert prepare_main([*corpus["args"], "data.eval_fraction=0.2", "prepare.workers=1", f"out={out}", *extra]) == 0
    return files(out), prepared.load(out).digest


def whole(out: Path, want: dict[str, bytes], digest: str) -> None:
    """`out` holds exactly `want`, and the prepared reader reads it (every sha256) as `digest`."""
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES) and files(out) == want
    assert prepared.load(out).digest == digest


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("nljax.prepare: warning:")]


def test_overwrite_gives_the_files_of_a_fresh_prepare_and_leaves_nothing_beside(corpus, reference, tmp_path):
    out = tmp_path / "prep"
    old, _ = previous(corpus, out)
    assert old != reference
    assert prepare_main([*corpus["args"], "prepare.workers=2", f"out={out}", "overwrite=true"]) == 0
    whole(out, reference, prepared.load(out).digest)
    assert [p.name for p in tmp_path.iterdir()] == ["prep"]
    # a directory a user made empty for it is replaced alike; a symlink to DIR: its target is
    (empty := tmp_path / "empty").mkdir()
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={empty}"]) == 0
    assert files(empty) == reference
    (link := tmp_path / "link").symlink_to(out)
    previous(corpus, link, "overwrite=true")
    assert link.is_symlink() and files(out) == files(link) != reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "prep"]


@pytest.mark.parametrize("point", ["built", "aside", "replaced"])
def test_an_overwrite_killed_during_the_swap_leaves_whole_data_and_the_next_run_recovers(
        corpus, reference, tmp_path, capsys, point):
    """SIGKILL once the new directory is complete and read back ("built"), between the two
    renames ("aside"), after them ("replaced"): DIR is the previous data whole, or absent with the
    previous data whole beside it, or the new data whole; the next prepare recovers with at most
    one warning line and writes the files of a fresh prepare, with nothing left beside DIR."""
    out = tmp_path / "prep"
    old, digest = previous(corpus, out)
    capsys.readouterr()
    p = cli("nljax.prepare", *corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true", check=False,
            env={prepared.TEST_KILL_AFTER: point})
    assert p.returncode == -9, (p.returncode, p.stderr)
    aside = outdir.at(out).old
    if point == "built":  # the new directory complete in the work directory, DIR untouched
        whole(out, old, digest)
        assert files(work(out) / "prepared") == reference and not aside.exists()
    elif point == "aside":  # DIR absent for an instant; the previous data whole under our name
        assert not out.exists()
        whole(aside, old, digest)
        with pytest.raises(config.ConfigError, match=re.escape(
                f"data.prepared={out} is absent: an overwrite of it by nljax.prepare stopped part-way (the previous "
                f"data are in {aside}); run nljax.prepare into it again")):
            prepared.load(out)
        # the next prepare, even one not asked to overwrite, puts them back first
        assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 2
        err = capsys.readouterr().err
        assert warnings(err) == [f"nljax.prepare: warning: an overwrite of {out} stopped part-way: the previous "
                                 f"data are back in place (from {aside})"]
        assert "already holds prepared data" in err.splitlines()[-1]
        whole(out, old, digest)
    else:  # the new data in place, the previous not yet removed
        whole(out, reference, prepared.load(out).digest)
        whole(aside, old, digest)
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 0
    said = capsys.readouterr()
    assert "started over" not in said.out  # what was left is recognised, not taken for a broken record
    if point == "replaced":
        assert warnings(said.err) == [f"nljax.prepare: warning: removed {aside}, the data {out} held before an "
                                      "overwrite that stopped once the new data were in place"]
    else:
        assert warnings(said.err) == []
        assert "resuming an interrupted prepare: its files are complete (verified)" in said.out  # not tokenized again
    whole(out, reference, prepared.load(out).digest)
    assert [p.name for p in tmp_path.iterdir()] == ["prep"]


def test_a_failed_rename_puts_the_previous_data_back_and_the_work_is_kept(corpus, reference, tmp_path, capsys,
                                                                          monkeypatch):
    """The rename of the new directory onto DIR fails (a full disk, say), or Ctrl-C comes between
    the two renames: one line, DIR is the previous data (renamed back at once), and the next run
    puts the finished new directory in place (read back again first)."""
    out = tmp_path / "prep"
    old, digest = previous(corpus, out)

    def ctrl_c(point):
        if point == "aside":
            raise KeyboardInterrupt

    monkeypatch.setattr(prepared, "_test_kill", ctrl_c)
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted (Ctrl-C): the same command resumes where it stopped")
    whole(out, old, digest)
    assert not outdir.at(out).old.exists() and files(work(out) / "prepared") == reference
    monkeypatch.undo()
    real = os.rename

    def new_fails(src, dst):
        if Path(src) == work(out) / "prepared":
            raise OSError(28, "No space left on device", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", new_fails)
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 1
    assert capsys.readouterr().err.strip() == f"nljax.prepare: error: cannot write {out}: [Errno 28] No space left on device"
    monkeypatch.setattr(os, "rename", real)
    whole(out, old, digest)
    finished = work(out) / "prepared"
    assert not outdir.at(out).old.exists() and files(finished) == reference
    # the finished directory is read back before it is put in place: one changed since is not
    with open(finished / "train.bin", "r+b") as f:
        f.seek(7)
        f.write(bytes([f.read(1)[0] ^ 1]))
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 0
    assert "an interrupted prepare whose files differ from their manifest, started over" in capsys.readouterr().out
    assert files(out) == reference


def test_overwrite_of_a_users_directory_is_refused_and_nothing_is_removed(corpus, tmp_path, capsys, monkeypatch):
    """overwrite=true replaces prepared data only: a directory with a file of the user's (even
    beside prepared files) is refused in one line, as is previous data set aside that a user
    has put a file into; nothing is removed, nothing is left beside."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.bin").write_text("precious")
    (mine / "notes.txt").write_text("keep")
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={mine}", "overwrite=true"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.prepare: error: {mine} holds files that are not nljax "
                                               "prepared data (notes.txt); give a new or empty out=")
    assert {p.name: p.read_text() for p in mine.iterdir()} == {"train.bin": "precious", "notes.txt": "keep"}
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    # a set-aside directory (our name) with a user's file in it: neither removed nor renamed
    out = tmp_path / "prep"
    aside = outdir.at(out).old
    aside.mkdir()
    (aside / "manifest.json").write_text("{}")
    (aside / "thesis.tex").write_text("keep")
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.prepare: error: {aside} holds files that are not nljax "
                                               "prepared data (thesis.tex): move them away, then run again")
    assert sorted(p.name for p in aside.iterdir()) == ["manifest.json", "thesis.tex"] and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mine", aside.name])
    # previous data set aside, and at DIR something that is not the prepared data that replaced
    # them (a user's folder made since): neither is removed
    (aside / "thesis.tex").unlink()
    out.mkdir()
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}", "overwrite=true"]) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.prepare: error: {aside} holds the data {out} held before "
                                               f"an overwrite that stopped part-way, and {out} is not the prepared "
                                               "data that replaced them: move one of them away, then run again")
    assert [p.name for p in aside.iterdir()] == ["manifest.json"] and out.is_dir()
    # a mount point cannot be replaced by a rename (the check; a prepare into one is refused)
    assert outdir.on_another_file_system(outdir.at(Path("/proc")))
    assert not outdir.on_another_file_system(outdir.at(mine))
    # DIR is replaced by a rename: not the working directory, nor one above it
    monkeypatch.chdir(mine)
    for spelling in (".", str(tmp_path)):
        assert prepare_main([*corpus["args"], f"out={spelling}", "overwrite=true"]) == 2
        assert capsys.readouterr().err.strip() == (f"nljax.prepare: error: out={spelling} is the working directory "
                                                   "or holds it: nljax.prepare replaces DIR by renaming it, give a "
                                                   "directory beside or below")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "train.bin"]


def test_a_work_directory_that_is_not_ours_is_refused_and_kept(corpus, tmp_path, capsys):
    """The work directory's name (.DIR.prepare-work) taken by a file, a link to a user's folder,
    or a folder holding a file a prepare does not write: one line and exit 2, all of it kept (a
    file: exit 1 and a "Not a directory: PosixPath(...)" line; a link: "Cannot call rmtree on a
    symbolic link"; a user's file: removed with the work as "an interrupted prepare")."""
    out = tmp_path / "prep"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    for make, line in (
        (lambda w: w.write_text("a file"), "is not a directory nljax.prepare works in: move it away, then run again"),
        (lambda w: w.symlink_to(theirs), "is a symbolic link, not a directory nljax.prepare works in"),
        (lambda w: (w.mkdir(), (w / "notes.txt").write_text("keep")),
         "holds files that nljax.prepare does not write there (notes.txt): move them away, then run again"),
    ):
        make(work(out))
        assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"nljax.prepare: error: {work(out)} {line}"), err
        assert os.path.lexists(work(out)) and not out.exists()
        if work(out).is_dir() and not work(out).is_symlink():
            assert [p.name for p in work(out).iterdir()] == ["notes.txt"]
            (work(out) / "notes.txt").unlink()
            work(out).rmdir()
        else:
            work(out).unlink()
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_a_chunk_is_cut_by_utf8_bytes_not_characters(tmp_path):
    """prepare.chunk_bytes counts the text's UTF-8 bytes: documents of 3-byte characters make
    chunks of a third as many characters as ASCII ones (memory follows bytes), and a chunk's
    bytes are what the progress bar adds."""
    from nljax.data import chunks, documents

    for name, char in (("ascii", "a"), ("cjk", "記")):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": char * 100}) + "\n" for _ in range(60)))
        files = documents.expand([str(tmp_path / f"{name}.jsonl")], "data.train")
        cut = list(chunks.read([files, []], "text", 1000))
        per_chunk = {len(c.texts) for c in cut[:-1]}
        assert per_chunk == ({10} if char == "a" else {4}), (name, [len(c.texts) for c in cut])
        assert all(c.nbytes == sum(len(t.encode()) for t in c.texts) for c in cut)
    assert chunks.utf8_bytes("\ud800") == 3  # a lone surrogate (JSON allows one) is counted, not an error


def test_a_chunk_ends_once_its_bytes_reach_chunk_bytes_whatever_the_documents_sizes(tmp_path):
    """Documents of 1 to 17 KB in .jsonl (across two files), Parquet and .txt: every chunk ends at
    the document with which it reaches prepare.chunk_bytes (no more than that plus one document; one
    larger is a chunk of its own), and reading again from any chunk's end gives the chunks after
    it, the same documents in the same order. Lists of chunk_bytes >> 10 documents read whole were
    cut only after the list: 17 KB documents made chunks of 17 x chunk_bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nljax.data import chunks, documents

    rng = random.Random(2)
    docs = ["x" * rng.choice([1000, 5000, 17000, 17000, 60000]) + str(i) for i in range(80)]
    docs[7] = "記" * 30000  # 90 KB of UTF-8, a third of it in characters
    for name, part in (("a.jsonl", docs[:30]), ("b.jsonl", docs[30:50])):
        (tmp_path / name).write_text("".join(json.dumps({"text": d}) + "\n" + ("\n" if i % 3 else "")
                                             for i, d in enumerate(part)))  # blank lines among them
    pq.write_table(pa.table({"text": docs[50:75] + [""]}), tmp_path / "c.parquet", row_group_size=10)
    for i, d in enumerate(docs[75:]):
        (tmp_path / f"d{i}.txt").write_text(d)
    files = documents.expand([str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.parquet", "d*.txt")], "data.train")
    for chunk_bytes in (20_000, 50_000, 200_000):
        cut = list(chunks.read([files, []], "text", chunk_bytes))
        assert [t for c in cut for t in c.texts] == docs, chunk_bytes
        for c in cut:
            sizes = [chunks.utf8_bytes(t) for t in c.texts]
            assert c.nbytes == sum(sizes)
            assert sum(sizes[:-1]) < chunk_bytes, (chunk_bytes, sizes)  # it ended once it reached chunk_bytes
        assert all(c.nbytes >= chunk_bytes for c in cut[:-1]), chunk_bytes  # ... and not before
        for k, c in enumerate(cut):  # a resumed read from chunk k's end: the chunks after it
            again = list(chunks.read([files, []], "text", chunk_bytes, c.end))
            assert [a.texts for a in again] == [b.texts for b in cut[k + 1:]], (chunk_bytes, k)


def test_progress_lines_are_at_most_one_per_interval():
    """Where no bar is drawn (a batch job's log), a line after a chunk once `every` seconds have
    passed since the last: this run's documents, bytes, tokens and their rates."""
    import io

    now = [100.0]
    out = io.StringIO()
    lines = prepared.ProgressLines(every=10, clock=lambda: now[0], file=out)
    said = []
    for step in range(1, 13):  # a chunk every 3 s for 36 s
        now[0] = 100.0 + 3 * step
        said.append(lines.update(100 * step, 2_000_000 * step, 500_000 * step))
    assert [i for i, line in enumerate(said, 1) if line] == [4, 8, 12]  # at 12 s, 24 s and 36 s
    assert said[3] == ("nljax.prepare: 400 documents, 8.0 MB, 2,000,000 tokens in 12 s "
                       "(0.67 MB/s, 166,667 tokens/s)")
    assert out.getvalue().splitlines() == [line for line in said if line]


def test_without_a_terminal_prepare_prints_progress_lines(corpus, tmp_path, capsys, monkeypatch):
    """Output not a terminal (here captured; a batch job's log): no bar, and progress lines on
    stdout (a line per chunk here, with no interval), the last with the totals; it printed
    nothing until its last line (36 s silent on a 31 MB corpus)."""
    monkeypatch.setattr(prepared, "PROGRESS_EVERY", 0.0)
    out = tmp_path / "prep"
    assert prepare_main([*corpus["args"], "prepare.workers=1", f"out={out}"]) == 0
    said = capsys.readouterr()
    lines = [line for line in said.out.splitlines() if re.match(r"nljax.prepare: [\d,]+ documents, ", line)]
    m = prepared.load(out).manifest
    from nljax.data import chunks, documents

    files = documents.expand([f"{corpus['root']}/*.jsonl"], "data.train")
    assert len(lines) == len(list(chunks.read([files, []], "text", 3000))) > 5, said.out
    last = re.match(r"nljax.prepare: ([\d,]+) documents, ([\d.]+) MB, ([\d,]+) tokens in \d+ s "
                    r"\([\d.]+ MB/s, [\d,]+ tokens/s\)$", lines[-1])
    assert last, lines[-1]
    documents = m["train"]["documents"] + m["eval"]["documents"]
    assert int(last[1].replace(",", "")) == documents == 400
    assert float(last[2]) == round((m["train"]["bytes"] + m["eval"]["bytes"] - documents) / 1e6, 1)
    assert int(last[3].replace(",", "")) == m["train"]["tokens"] + m["eval"]["tokens"]
    assert "nljax.prepare:" not in said.err  # no bar either


def test_a_full_disk_while_tokenizing_names_the_file(tmp_path):
    """A token file that fills the disk as a chunk is appended: the OS's error from `write`
    carries no file name, and the line was 'a write failed: [Errno 28] ...', naming no file."""
    import io

    from nljax import cli
    from nljax.data import workdir

    class Full(io.FileIO):
        def write(self, b):
            raise OSError(28, "No space left on device")

    tokens, starts = tmp_path / "part.train.bin", tmp_path / "part.train.starts"
    with Full(tokens, "wb") as f, Full(starts, "wb") as s:
        with pytest.raises(OSError) as e:
            workdir.Sink(f, s, np.dtype(np.uint16)).add(np.arange(5), np.array([5]), np.array([6]))
    assert cli.write_failed(e.value) == f"cannot write {tokens}: [Errno 28] No space left on device"


def test_ctrl_c_stops_the_workers_at_once_not_after_their_chunks(corpus, tmp_path):
    """Ctrl-C while workers tokenize large chunks: the pool's shutdown waited for every chunk in
    flight (seconds each at the default 8 MB); the workers are stopped now, their chunks dropped
    (only recorded chunks count), within half the time one chunk takes (it took 0.78 of it before)."""
    from nljax.data import chunks, documents, tokenization

    tok = tokenization.load(str(corpus["root"] / "tokenizer.json"), "<eos>")
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS) for _ in range(200_000))  # about 1.3 MB a document
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(6)))
    t0 = time.perf_counter()
    tok.encode_flat([text], np.dtype("<u2"))
    one = time.perf_counter() - t0  # one chunk's tokenizing, in this process
    files = documents.expand([str(tmp_path / "big.jsonl")], "data.train")
    stream = chunks.encoded(chunks.read([files, []], "text", len(text)), tok, np.dtype("<u2"), 1)
    next(stream)  # the first chunk back, the second in flight
    workers = [int(p) for p in _children() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    took = time.perf_counter() - t0
    assert took < one / 2, (took, one)
    assert workers and not any(Path(f"/proc/{p}").exists() for p in workers), workers


def test_chunks_resume_into_the_held_out_files_from_their_start_and_end_where_the_records_do(tmp_path):
    """A chunk ends at the document with which its bytes reach chunk_bytes, not one after (lists of
    two documents read at 2 KiB a chunk). `chunks.read` from a position in data.train's files
    reads data.eval's from their first record (the position's file and record are data.train's),
    and a split whose last records hold no text still ends with a chunk at its end: the position
    a resumed prepare starts from is after every record read."""
    from nljax.data import chunks, documents

    def jsonl(name, texts):
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return documents.expand([str(tmp_path / name)], "data")

    a, b, c, d, x, y, z = (ch * (2048 if ch < "x" else 1024) for ch in "abcdxyz")
    train = jsonl("a.jsonl", [a, b]) + jsonl("b.jsonl", [c, d, ""])
    held = jsonl("h.jsonl", [x, y, z])
    everything = list(chunks.read([train, held], "text", 2048))
    assert [c.texts for c in everything] == [[a], [b], [c], [d], [], [x, y], [z]]
    assert [c.end for c in everything if c.split == 0][-1] == (0, 1, 3)  # after b.jsonl's blank last line
    resumed = list(chunks.read([train, held], "text", 2048, start=(0, 1, 1)))  # b.jsonl from its 2nd line
    assert [t for c in resumed if c.split == 0 for t in c.texts] == [d]
    assert [t for c in resumed if c.split == 1 for t in c.texts] == [x, y, z]
    assert resumed[-1].end == (1, 0, 3)


def test_at_most_twice_the_workers_chunks_are_in_flight(tmp_path, monkeypatch):
    """The memory bound of `chunks.encoded`: at most 2 x workers chunks handed to the pool and not
    yet taken back, whatever the chunk count, and the chunks come back in order. A pool in this
    process stands in for the worker processes and counts."""
    from nljax.data import chunks, documents, tokenization

    class Future:
        def __init__(self, pool, fn, args):
            self.pool, self.fn, self.args = pool, fn, args

        def result(self):
            self.pool.in_flight -= 1
            return self.fn(*self.args)

    class Pool:
        def __init__(self, workers, **kw):
            self.in_flight = self.most = 0
            pools.append(self)

        def submit(self, fn, *args):
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            return Future(self, fn, args)

        def shutdown(self, **kw):
            pass

    pools = []
    monkeypatch.setattr(chunks, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(chunks, "_TOKENIZER", tokenization.Bytes())
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    files = documents.expand([str(tmp_path / "t.jsonl")], "data.train")
    for workers in (1, 3):
        got = list(chunks.encoded(chunks.read([files, []], "text", 1), tokenization.Bytes(), np.uint8, workers))
        assert [light.end for light, _ in got] == [(0, 0, i) for i in range(1, 41)]
        assert pools[-1].most == 2 * workers  # (the workers' start-up calls: `workers` at once, before)
