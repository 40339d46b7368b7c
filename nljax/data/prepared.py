"""Prepared text: the user's documents (data/documents.py) tokenized once (data/tokenization.py)
into flat token arrays, with a manifest that says what they are.

    DIR/manifest.json                      (below)
    DIR/train.bin, DIR/eval.bin            token ids, raw little-endian `dtype`, documents back to back
    DIR/train.docs.npy, DIR/eval.docs.npy  int64 [D]: the first token of each document
    DIR/tokenizer.json                     a copy of the tokenizer (with one): DIR is all a run needs

manifest.json holds `format`; `tokenizer` (kind, vocab_size, sha256, doc_end_token);
`vocab_size`; `dtype`; `settings` (the data.* keys it was prepared from); `sources` (the files
read and their sizes); per split (`train`, `eval`): `tokens`, `documents`, `bytes` (UTF-8 bytes
of its documents + 1 per document boundary), `max_token`, its two files and their sha256; and
`digest`, the sha256 of the tokenizer, dtype and splits: the content digest that the lockstep
check compares and summary.json reports (the same content from other paths has the same digest).

`build` prepares into memory (a run given data.train) or into DIR (`python -m nljax.prepare`):
the same arrays and the same digest either way, one chunk of documents at a time (data/chunks.py),
in worker processes for DIR. Document boundaries are the manifest's document starts, never a
token value, so any tokenizer's ids may appear anywhere. Files for DIR are streamed into its work
directory beside it (data/workdir.py: an interrupted prepare resumes from there), made into a
complete directory there, read back, and put in place of DIR whole (data/outdir.py): DIR is the
previous prepared data or the new, never a mix, and a prepare that fails leaves it as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import tqdm

from nljax import writable
from nljax.data import chunks, documents, outdir, tokenization, workdir
from nljax.data.outdir import FORMAT, MANIFEST
from nljax.data.settings import EVAL_FRACTION, DataConfig
from nljax.errors import ConfigError, few

SPLITS = ("train", "eval")
TOKENIZER = "tokenizer.json"
OWN = frozenset({f"{s}{ext}" for s in SPLITS for ext in (".bin", ".docs.npy")} | {MANIFEST, TOKENIZER})
LEGACY = (".prepare.lock", ".prepare-work")  # what an earlier nljax.prepare kept inside DIR: ours too
CHUNK_BYTES = 8 << 20  # UTF-8 bytes of text per chunk (prepare.chunk_bytes)
# tests only: nljax.prepare kills itself (SIGKILL, or "N:SIGINT") once N chunks are recorded, or
# (SIGKILL) at a point of replacing DIR: "built", "aside" (between the two renames), "replaced"
TEST_KILL_AFTER = "NLJAX_PREPARE_TEST_KILL_AFTER"
PROGRESS_EVERY = 10.0  # seconds between nljax.prepare's progress lines where it draws no bar


@dataclasses.dataclass(frozen=True)
class Split:
    tokens: np.ndarray  # [N] unsigned ids (a read-only memmap when read from DIR)
    starts: np.ndarray  # int64 [D]: the first token of each document

    @property
    def ends(self) -> np.ndarray:
        """int64 [D]: the last token of each document (where the ContextStream marks a boundary)."""
        return np.append(self.starts[1:], len(self.tokens)) - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    train: Split | None  # None: not opened (`load(splits=("eval",))`, what an evaluation reads)
    eval: Split
    manifest: dict

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def tokens_per_byte(self) -> float:
        """Held-out tokens per held-out byte: nats per token x this = nats per byte."""
        return self.manifest["eval"]["tokens"] / self.manifest["eval"]["bytes"]


def settings_record(d: DataConfig) -> dict:
    """The data.* keys a corpus is prepared from (eval_fraction only when it splits data.train),
    its files absolute: a run from another directory names the same ones."""
    return {"train": [documents.absolute(p) for p in d.train], "eval": [documents.absolute(p) for p in d.eval],
            "text_key": d.text_key,
            "eval_fraction": None if d.eval else d.eval_fraction, "doc_end_token": d.doc_end_token}


def _sources(d: DataConfig) -> tuple[list[Path], list[Path]]:
    train = documents.expand(d.train, "data.train") if d.train else []  # none: held-out text only
    held = documents.expand(d.eval, "data.eval") if d.eval else []
    trained = {p.resolve() for p in train}
    both = [p for p in held if p.resolve() in trained]
    if both:
        raise ConfigError(f"{both[0]} is in both data.train and data.eval: held-out documents must not be trained on")
    return train, held


def _fill(d: DataConfig, tok, sources: tuple, sinks: dict, dtype: np.dtype, workers: int, chunk_bytes: int,
          start: dict | None = None, on_chunk=None) -> int:
    """Tokenize the sources (train files, eval files) into the sinks, from `start` (a resumed
    prepare's progress); every round(1/eval_fraction)-th training document is held out unless
    data.eval is given. `on_chunk(chunk, chunks done, training documents seen)` after each chunk.
    Returns the training documents seen."""
    every, split_train = round(1 / d.eval_fraction), not sources[1]  # >= 2: eval_fraction <= 0.5
    seen, done = (start["seen"], start["chunks"]) if start else (0, 0)
    position = tuple(start["position"]) if start else (0, 0, 0)
    for light, e in chunks.encoded(chunks.read(sources, d.text_key, chunk_bytes, position), tok, dtype, workers):
        n = len(e.lengths)
        if e.split == 1:
            held = np.ones(n, bool)
        else:
            held = split_train & ((seen + np.arange(n)) % every == every - 1)
            seen += n
        for name, mask in (("train", ~held), ("eval", held)):
            keep = mask & (e.lengths > 0)  # a tokenizer may give nothing for blank text: no document
            if keep.any():
                sinks[name].add(e.ids[np.repeat(keep, e.lengths)], e.lengths[keep], e.nbytes[keep])
        done += 1
        if on_chunk:
            on_chunk(light, done, seen)
    return seen


def _manifest(d: DataConfig, tok, sources: tuple, sinks: dict, seen: int) -> dict:
    """The manifest of the filled sinks, or the line saying why there is none."""
    train_files, eval_files = sources
    if not sinks["train"].tokens and train_files:  # no data.train: held-out text alone
        raise ConfigError(f"data.train: no text in {len(train_files)} file(s) (every document empty)")
    if not sinks["eval"].tokens:
        every = round(1 / d.eval_fraction)  # as _fill splits
        # every `every`-th document is held out, so a fraction of 1/seen holds out the last one
        # (at most 0.5: a single document is never split off)
        raise_it = f", data.eval_fraction={1 / seen:.4g} or more (at most 0.5)" if seen >= 2 else ""
        # one big .txt (a Shakespeare's input.txt) is one document, which no fraction splits
        whole = any(str(f).endswith((".txt", ".txt.gz")) for f in train_files)
        why = "data.eval holds no text" if eval_files else (
            f"{seen} document(s) at data.eval_fraction={d.eval_fraction} (every {_ordinal(every)} held out) hold "
            f"out none; give data.eval{raise_it} or more documents"
            f"{' (a .txt file is one document, never split: cut it into several files)' if whole else ''}")
        raise ConfigError(f"no held-out documents: {why}")
    content = {"format": FORMAT, "tokenizer": tok.info(), "vocab_size": tok.vocab_size,
               "dtype": np.dtype(sinks["train"].dtype).name, **{s: sinks[s].record(s) for s in SPLITS}}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    sources = {k: _source_record(files) for k, files in (("train", train_files), ("eval", eval_files))}
    return {**content, "settings": settings_record(d), "sources": sources, "digest": digest}


def _ordinal(n: int) -> str:
    """2nd, 3rd, 20th, 21st, 112th."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _source_record(files: list[Path]) -> list[dict]:
    return [{"path": documents.absolute(str(p)), "bytes": p.stat().st_size} for p in files]


def build(d: DataConfig, out: Path | None = None, overwrite: bool = False, workers: int = 0,
          chunk_bytes: int = CHUNK_BYTES) -> Corpus:
    """The corpus of data.train / data.eval, tokenized into memory, or into `out` and read back.
    Into `out`: by `workers` processes (0: this one), resumed where an interrupted prepare into
    `out` stopped (data/workdir.py); the files are the same whatever the workers and interruptions."""
    if not d.train and (out is None or not d.eval):  # data.eval alone in memory: `held_out`
        raise ConfigError("data.eval alone is held-out text only (for nljax.evaluate): preparing needs data.train")
    tok = tokenization.load(d.tokenizer, d.doc_end_token)
    sources = _sources(d)
    dtype = tokenization.dtype_for(tok.vocab_size)
    if out is not None:  # read back before it replaced DIR: the same files (renames), not hashed twice
        return _write(Path(out), overwrite, d, tok, sources, dtype, workers, chunk_bytes)
    sinks = {s: workdir.Sink(io.BytesIO(), io.BytesIO(), dtype) for s in SPLITS}
    manifest = _manifest(d, tok, sources, sinks, _fill(d, tok, sources, sinks, dtype, 0, chunk_bytes))
    return Corpus(_in_memory(sinks["train"]), _in_memory(sinks["eval"]), manifest)


def held_out(d: DataConfig) -> Corpus:
    """data.eval's files alone (no data.train), every document held out and tokenized into
    memory as `build` tokenizes: what `nljax.evaluate data.eval=GLOB` scores a checkpoint on. Its
    training split is the same text, which nothing that evaluates reads (a run that trains refuses
    data.eval alone: `nljax.run.tasks.check_trains`)."""
    tok = tokenization.load(d.tokenizer, d.doc_end_token)
    files = documents.expand(d.eval, "data.eval")
    split, sink = _all_held_out(d, files, tok)
    if not sink.tokens:  # _manifest's line would name data.train, which was not given
        raise ConfigError(f"data.eval: no text in {len(files)} file(s) (every document empty)")
    return Corpus(split, split, _manifest(d, tok, (files, files), {"train": sink, "eval": sink}, 0))


def tokenized(d: DataConfig, files: list[Path], tok) -> tuple[Split, dict]:
    """The documents of `files`, tokenized into memory by `tok` as `build` tokenizes them (their
    data.text_key field or column, each document ended): the split, and its record (tokens,
    documents, bytes, as a manifest's). A `data.eval_sets` set (data/evalsets.py)."""
    split, sink = _all_held_out(d, files, tok)
    return split, sink.record("eval")


def _all_held_out(d: DataConfig, files: list[Path], tok) -> tuple[Split, workdir.Sink]:
    """`files` tokenized into one in-memory sink, every document held out (no training files:
    none is split off): its split, and the sink."""
    sink = workdir.Sink(io.BytesIO(), io.BytesIO(), tokenization.dtype_for(tok.vocab_size))
    _fill(d, tok, ([], files), {"train": sink, "eval": sink}, sink.dtype, 0, CHUNK_BYTES)
    return _in_memory(sink), sink


def _in_memory(sink: workdir.Sink) -> Split:
    """The split an in-memory sink holds."""
    return Split(np.frombuffer(sink.f.getvalue(), sink.dtype),
                 np.frombuffer(sink.starts_f.getvalue(), "<i8").astype(np.int64))


def _job(d: DataConfig, tok, sources: tuple, dtype: np.dtype) -> dict:
    """What an interrupted prepare must match to be resumed: the settings, the tokenizer, the
    dtype and the source files as they are now (paths, sizes, modification times)."""
    files = [[str(p.absolute()), p.stat().st_size, p.stat().st_mtime_ns] for group in sources for p in group]
    return {"format": FORMAT, "settings": settings_record(d), "tokenizer": tok.info(), "dtype": dtype.str,
            "files": files, "split": [len(sources[0]), len(sources[1])]}


def _ours(name: str) -> bool:
    """Whether `name` in DIR is one a prepare writes there (overwrite=true replaces only such)."""
    return name in OWN or name in LEGACY or ".tmp-" in name


def _write(out: Path, overwrite: bool, d: DataConfig, tok, sources: tuple, dtype: np.dtype, workers: int,
           chunk_bytes: int) -> Corpus:
    """Tokenize into the work directory beside `out` (resumed when an interrupted prepare of the
    same job left one), finish and read back the new directory there, then put it in place of
    `out` whole (data/outdir.py); one prepare at a time per directory (a lock held while it
    writes). The corpus read back."""
    o = outdir.at(out)
    with outdir.locked(o):
        if note := outdir.recover(o, _ours, MANIFEST):
            print(f"nljax.prepare: warning: {note}", file=sys.stderr, flush=True)
        work = workdir.WorkDir(o.work, _job(d, tok, sources, dtype), dtype, SPLITS)
        work.check()
        if work.finished(this_job=False) and not work.done.exists():  # stopped once it had replaced DIR
            work.discard()
        _check_out(o, overwrite)
        try:
            c = _finished(work)
            if c is None:
                try:
                    manifest = _tokenize_into(work, d, tok, sources, dtype, workers, chunk_bytes)
                except ConfigError:  # bad data: nothing to resume, nothing left behind
                    work.discard()
                    raise
                c = _commit(work, manifest, tok)
            outdir.replace(o, work.done, _test_kill)
            work.discard()
        finally:
            work.close()
    return c


def _check_out(o: outdir.Out, overwrite: bool) -> None:
    """Refused in one line: a DIR holding a user's files (overwrite=true replaces prepared data,
    never those: the source text may be there), prepared data without overwrite=true, a file, a
    mount point (DIR is replaced by renames)."""
    writable.dangling(o.path)  # a loop of symbolic links raises its own one-line error (ELOOP)
    if os.path.lexists(o.path) and not o.path.is_dir():
        raise ConfigError(f"{o.given} is a file, not a directory; give another out=")
    there = outdir.strangers(o.path, lambda name: name in LEGACY or ".tmp-" in name) if o.path.is_dir() else []
    foreign = [name for name in there if not _ours(name)]
    if foreign:
        raise ConfigError(f"{o.given} holds files that are not nljax prepared data ({few(foreign)}); "
                          "give a new or empty out=")
    if there and not overwrite:  # a manifest, or the files of a prepare that stopped part-way
        raise ConfigError(f"{o.given} already holds prepared data ({few(there)}); give another out= or "
                          "overwrite=true")
    if outdir.on_another_file_system(o):
        raise ConfigError(f"{o.given} is a mount point (another file system than its parent): nljax.prepare "
                          "replaces DIR by renaming a directory beside it; give out= a directory inside it")


def _finished(work: workdir.WorkDir) -> Corpus | None:
    """The new directory of an interrupted prepare of this job that was complete (stopped before
    it replaced DIR), read back; None when there is none (or it does not read back: started over)."""
    if not work.finished():
        return None
    try:
        c = load(work.done)
    except ConfigError:
        work.discard()
        print(f"nljax.prepare: {work.path}: an interrupted prepare whose files differ from their manifest, "
              "started over", flush=True)
        return None
    print("nljax.prepare: resuming an interrupted prepare: its files are complete (verified), putting them in place",
          flush=True)
    return c


def _test_kill(point: str) -> None:
    """Tests only: SIGKILL this process at `point` of the replacement (TEST_KILL_AFTER=point)."""
    if os.environ.get(TEST_KILL_AFTER) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _tokenize_into(work: workdir.WorkDir, d: DataConfig, tok, sources: tuple, dtype: np.dtype, workers: int,
                   chunk_bytes: int) -> dict:
    """Fill the work directory's part files, recording each chunk, with a progress bar (bytes/s,
    tokens/s) on a terminal; the manifest."""
    sinks, start, note = work.open()
    if note:
        print(f"nljax.prepare: {note}", flush=True)
    workers = 0 if isinstance(tok, tokenization.Bytes) else workers  # bytes: a copy, no worth a process
    # "N", "N:SIGINT" or "N:SIGTERM:group" (to this process's group: its workers too, as a batch job's end)
    kill_after, _, how = os.environ.get(TEST_KILL_AFTER, "0").partition(":")
    how, _, whom = how.partition(":")
    kill_after, how = int(kill_after) if kill_after.isdigit() else 0, getattr(signal, how or "SIGKILL")
    tokens = lambda: sum(s.tokens for s in sinks.values())
    docs = lambda: sum(s.documents for s in sinks.values())
    first, first_docs = tokens(), docs()
    with tqdm.tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="nljax.prepare", disable=None,
                   dynamic_ncols=True) as bar:
        # no terminal (a batch job's log): no bar, a line every PROGRESS_EVERY seconds instead
        lines = ProgressLines() if bar.disable else None
        read = 0

        def on_chunk(chunk, done, seen):
            nonlocal read
            work.record(sinks, done, chunk.end, seen)
            read += chunk.nbytes
            if lines:
                lines.update(docs() - first_docs, read, tokens() - first)
            else:
                bar.update(chunk.nbytes)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"{(tokens() - first) / elapsed:,.0f} tokens/s", refresh=False)
            if done == kill_after:  # the tests' stand-in for a kill (or Ctrl-C) at an arbitrary point
                if how == signal.SIGINT:  # Python's handler, even where the test's shell ignores SIGINT (a
                    signal.signal(signal.SIGINT, signal.default_int_handler)  # background job): as at a terminal
                if whom == "group" and os.getpgid(0) == os.getpid():  # a group of its own: not the test's
                    os.killpg(os.getpid(), how)
                else:
                    os.kill(os.getpid(), how)
        seen = _fill(d, tok, sources, sinks, dtype, workers, chunk_bytes, start, on_chunk)
    return _manifest(d, tok, sources, sinks, seen)


class ProgressLines:
    """nljax.prepare's progress where it draws no bar (stderr not a terminal: a batch job's log,
    which showed nothing until the last line): after a chunk, a line on stdout with this run's
    documents, bytes and tokens so far and their rates, at most one per `every` seconds."""

    def __init__(self, every: float | None = None, clock=time.monotonic, file=None):
        self.every = PROGRESS_EVERY if every is None else every
        self.clock, self.file = clock, file
        self.start = self.last = clock()

    def update(self, documents: int, nbytes: int, tokens: int) -> str | None:
        """The line printed, or None (the last one is more recent than `every` seconds)."""
        now = self.clock()
        if now - self.last < self.every:
            return None
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        line = (f"nljax.prepare: {documents:,} documents, {nbytes / 1e6:,.1f} MB, {tokens:,} tokens in "
                f"{elapsed:,.0f} s ({nbytes / 1e6 / elapsed:,.2f} MB/s, {tokens / elapsed:,.0f} tokens/s)")
        print(line, file=self.file or sys.stdout, flush=True)
        return line


def _commit(work: workdir.WorkDir, manifest: dict, tok) -> Corpus:
    """The finished directory (work.done): the token files moved there from the work directory,
    manifest.json last, everything on disk (fsync); read back (every sha256) before it replaces
    DIR."""
    work.close()
    new = work.done
    if new.exists():  # a commit cut short: made again
        shutil.rmtree(new)
    new.mkdir()
    for s in SPLITS:
        work.starts_to_npy(s, new / f"{s}.docs.npy")
    if hasattr(tok, "raw"):
        (new / TOKENIZER).write_bytes(tok.raw)
        manifest["tokenizer"]["file"] = TOKENIZER
    for s in SPLITS:  # from here until the manifest is written, an interruption starts over
        os.replace(work.path / f"part.{s}.bin", new / f"{s}.bin")
    (new / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    outdir.sync(sorted(new.iterdir()))
    work.finish()  # before the read-back (seconds on a large corpus): a kill in it resumes here
    try:
        return load(new)
    except ConfigError as e:
        work.discard()
        raise ConfigError(f"the prepared files read back differ from what was written ({e}); "
                          "DIR is as it was: run again") from None


def _regular(path: Path, name: str) -> Path:
    """`path / name`, refused in one line when something else than a regular file has that name
    (a FIFO would block the read for ever, a folder reads as an odd size)."""
    file = path / name
    if file.exists() and not file.is_file():
        raise ConfigError(f"data.prepared={path}: {name} is not a regular file: prepare again")
    return file


def read_manifest(path: Path) -> dict:
    """The manifest of the prepared directory `path`, checked (its format, fields and digest, and
    its tokenizer.json's sha256), without opening the token files: what a loaded model needs of
    its data (`tokenization_of`)."""
    if not path.is_dir() and not outdir.aside(path):  # (set aside by an overwrite: said below)
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"data.prepared={path} {what}: write it with python -m nljax.prepare")
    _regular(path, MANIFEST)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        if old := outdir.aside(path):
            raise ConfigError(f"data.prepared={path} is absent: an overwrite of it by nljax.prepare stopped part-way "
                              f"(the previous data are in {old}); run nljax.prepare into it again") from None
        raise ConfigError(f"data.prepared={path} holds no {MANIFEST}: write it with python -m nljax.prepare") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} is not a manifest of format {FORMAT}")
    with _fields_of(path):
        for key in ("digest", "vocab_size", "dtype"):
            manifest[key]
        tok = manifest["tokenizer"]
        if tok["kind"] != "bytes":
            _check_tokenizer_copy(path, tok)
        for s in SPLITS:
            manifest[s]["max_token"]
        _check_manifest_digest(path, manifest)
    return manifest


@contextlib.contextmanager
def _fields_of(path: Path):
    """A manifest field missing or of another type, read inside: one line."""
    try:
        yield
    except ConfigError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} lacks {e} or holds it as another type: "
                          "prepare again") from None


def load(path: Path, splits: tuple[str, ...] = SPLITS) -> Corpus:
    """A prepared directory, its tokens memory-mapped; sizes checked against the manifest.
    `splits`: those opened and checked, the others None and never opened: ("eval",) is what an
    evaluation reads (a train.bin of 10B tokens takes about 25 s to hash, and may be gone)."""
    manifest = read_manifest(path)
    with _fields_of(path):
        opened = {s: _open_split(path, manifest, s) if s in splits else None for s in SPLITS}
        return Corpus(opened["train"], opened["eval"], manifest)


def _check_manifest_digest(path: Path, manifest: dict) -> None:
    """The manifest's content (dtype, vocabulary, each file's sha256) is what its digest was made
    of: a field edited by hand (a dtype, a token count) is refused, not read as other bytes."""
    content = {k: manifest[k] for k in ("format", "tokenizer", "vocab_size", "dtype", *SPLITS)}
    content["tokenizer"] = {k: v for k, v in content["tokenizer"].items() if k != "file"}  # added after
    if hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest() != manifest["digest"]:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} was changed since it was written (its digest does "
                          "not match its content): prepare again")


def _check_tokens(path: Path, file: Path, rec: dict, dtype: np.dtype, vocab_size: int) -> None:
    """The token file is the one prepared (its sha256, read in full: a file edited in place keeps
    its size) and holds no id outside the vocabulary (one there gave NaN steps)."""
    sha, top = hashlib.sha256(), -1
    with open(file, "rb") as f:
        while chunk := f.read((1 << 24) * dtype.itemsize):
            sha.update(chunk)
            top = max(top, int(np.frombuffer(chunk, dtype).max()))
    if sha.hexdigest() != rec["sha256"]:
        raise ConfigError(f"data.prepared={path}: {rec['file']} is not the file prepared (its sha256 differs from "
                          f"the manifest's: changed since): prepare again")
    if top >= vocab_size:
        raise ConfigError(f"data.prepared={path}: {rec['file']} holds token id {top}, outside the vocabulary of "
                          f"{vocab_size}: prepare again")


def _check_tokenizer_copy(path: Path, info: dict) -> None:
    """The directory's tokenizer.json is the one the manifest names (a prepare stopped between
    the two renames, or a copied-in file, would decode with another vocabulary)."""
    try:
        raw = _regular(path, info["file"]).read_bytes()
    except OSError as e:
        raise ConfigError(f"data.prepared={path}: {info['file']} cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(raw).hexdigest() != info["sha256"]:
        raise ConfigError(f"data.prepared={path}: {info['file']} is not the tokenizer it was prepared with "
                          "(its sha256 differs from the manifest's): prepare it again")


def _open_split(path: Path, manifest: dict, name: str) -> Split:
    rec, dtype = manifest[name], np.dtype(manifest["dtype"]).newbyteorder("<")
    file, n = _regular(path, rec["file"]), rec["tokens"]
    if not file.is_file():
        raise ConfigError(f"data.prepared={path}: {rec['file']} is missing (deleted or moved since): prepare again")
    size = file.stat().st_size
    if size != n * dtype.itemsize:
        raise ConfigError(f"data.prepared={path}: {rec['file']} holds {size} bytes, the manifest says {n} tokens of "
                          f"{dtype.name} (an incomplete or changed file: prepare again)")
    try:
        _check_tokens(path, file, rec, dtype, int(manifest["vocab_size"]))
    except OSError as e:
        raise ConfigError(f"data.prepared={path}: {rec['file']} cannot be read ({e.strerror or e})") from None
    try:
        starts = np.load(_regular(path, rec["docs_file"]))
    except OSError as e:
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} cannot be read ({e.strerror or e})") from None
    except (ValueError, EOFError):  # EOFError: an empty file
        # NumPy takes what is not a .npy file for a pickle, and its line offered to load it unsafely
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} is not the .npy file prepared (damaged or "
                          "replaced since): prepare again") from None
    ordered = starts.ndim == 1 and bool(np.all(np.diff(starts) > 0))
    if starts.shape != (rec["documents"],) or not ordered or (len(starts) and (starts[0] != 0 or starts[-1] >= n)):
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} does not match the manifest's {rec['documents']} "
                          "documents: prepare again")
    if hashlib.sha256(np.asarray(starts, np.int64).tobytes()).hexdigest() != rec["docs_sha256"]:
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} is not the file prepared (its sha256 differs "
                          "from the manifest's): prepare again")
    # an empty split (the training split of held-out text prepared alone) has no file to map
    tokens = np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    return Split(tokens, starts.astype(np.int64))


# ---------------------------------------------------------------------------------------------
# What a run reads: the corpus of its data section, and the model vocabulary it implies


_CACHE: dict = {}  # (data section, what its files are now) -> Corpus; a Run and its local copy share one


def _home(path: str) -> Path:
    """`path` with `~` read as the home directory (os.path's: `~name` of no user stays as typed, as
    a shell leaves it, where pathlib's raises RuntimeError, a traceback)."""
    return Path(os.path.expanduser(path))


def corpus(d: DataConfig, evaluates: bool = False) -> Corpus:
    """data.prepared (checked against data.train and data.tokenizer when they are given too), or
    data.train tokenized into memory (data.eval alone: `held_out`). Read once per process while
    the files stay unchanged. `evaluates`: only what an evaluation scores: of data.prepared, the
    manifest and the held-out split (`Corpus.train` None: train.bin is not opened), and the
    files data.train and data.eval name beside it are not looked for (moved, deleted); data.train
    without data.prepared is tokenized either way (its held-out documents are split from it)."""
    if evaluates and d.prepared:  # DIR holds the held-out split: the text it was prepared from may be gone
        d = dataclasses.replace(d, train=(), eval=())
    # the source files (when given) and every file of DIR: a token file replaced or cut short, or
    # a source edited since, is read again, and checked
    paths = [*documents.expand(d.train, "data.train"), *documents.expand(d.eval, "data.eval")]
    prepared_dir = _home(d.prepared)
    if d.prepared:
        paths += sorted(prepared_dir.iterdir()) if prepared_dir.is_dir() else []
    paths += [_home(d.tokenizer)] if d.tokenizer else []
    key = (d, evaluates, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file()))
    if key not in _CACHE:
        if d.prepared:
            c = load(prepared_dir, ("eval",) if evaluates else SPLITS)
            _check_settings(c.manifest, d)
            if not evaluates and not c.manifest["train"]["tokens"]:
                raise ConfigError(f"data.prepared={d.prepared} holds held-out text only (prepared from data.eval "
                                  f"alone): nothing to train on; score it as a held-out set, data.eval_sets=[NAME="
                                  f"{d.prepared}]")
        else:
            c = build(d) if d.train else held_out(d)
        _CACHE.clear()  # one corpus at a time: a memmap or an in-memory copy of the whole text
        _CACHE[key] = c
    return _CACHE[key]


def _check_settings(manifest: dict, d: DataConfig) -> None:
    """A data.prepared directory given with data.train (or data.tokenizer) must have been prepared from them."""
    where = f"data.prepared={d.prepared} was prepared"
    if d.tokenizer:  # first: another tokenizer given without its end token was named as data.doc_end_token's change
        sha = tokenization.load(d.tokenizer, d.doc_end_token).info()["sha256"]
        if manifest["tokenizer"].get("sha256") != sha:
            raise ConfigError(f"{where} with another tokenizer than data.tokenizer={d.tokenizer}")
    if d.train:
        saved = manifest.get("settings", {})
        for key, value in settings_record(d).items():
            if key in SPLITS and isinstance(saved.get(key), list):  # the same files, however spelled
                same = [documents.absolute(p) for p in saved[key]] == [documents.absolute(p) for p in value]
            else:
                same = saved.get(key) == value
            if not same:
                raise ConfigError(f"{where} with data.{key}={saved.get(key)!r}, not {value!r}: prepare it again, "
                                  "or give data.prepared alone")
        _check_sources(manifest, d, where)
        if not d.tokenizer and manifest["tokenizer"]["kind"] != "bytes":
            raise ConfigError(f"{where} with a tokenizer, and data.tokenizer is not given (bytes): give it, or "
                              "give data.prepared alone")
    if d.doc_end_token and manifest["tokenizer"].get("doc_end_token") != d.doc_end_token:
        raise ConfigError(f"{where} with data.doc_end_token={manifest['tokenizer'].get('doc_end_token')!r}, not "
                          f"{d.doc_end_token!r}: prepare it again, or leave data.doc_end_token out")


def split_notes(manifest: dict, d: DataConfig) -> list[str]:
    """A note where data.prepared alone is given with a data.eval_fraction (not its default) other
    than the one the directory was split at: it splits nothing there (the directory's split was
    made when it was prepared), and was ignored without a word. A config may keep the key for
    the runs on data.train, so it is said, not refused."""
    if d.train or not d.prepared or "settings" not in manifest:  # with data.train: `_check_settings`
        return []
    then = manifest["settings"].get("eval_fraction")
    if d.eval_fraction in (EVAL_FRACTION, then):
        return []
    split = "its data.eval" if then is None else f"data.eval_fraction={then}"
    return [f"note: data.eval_fraction={d.eval_fraction} splits nothing here: data.prepared={d.prepared} holds out "
            f"what it was prepared with ({split}); prepare again to split otherwise"]


def _check_sources(manifest: dict, d: DataConfig, where: str) -> None:
    """The files data.train / data.eval name now are those read then, with the same sizes: an
    added, removed or grown file means the directory holds other text than they do."""
    now = {"train": documents.expand(d.train, "data.train"),
           "eval": documents.expand(d.eval, "data.eval") if d.eval else []}
    for split, files in now.items():
        # absolute since the paths are (a manifest from before recorded them as spelled)
        then = {documents.absolute(r["path"]): r["bytes"] for r in manifest.get("sources", {}).get(split, [])}
        if not then:  # an old manifest without sources: nothing to compare with
            continue
        current = {r["path"]: r["bytes"] for r in _source_record(files)}
        if current != then:
            changed = sorted(set(current) ^ set(then)) or sorted(p for p in current if current[p] != then[p])
            raise ConfigError(f"{where} from other files than data.{split} names now ({changed[0]} was added, "
                              "removed or changed since): prepare it again, or give data.prepared alone")


def tokenization_of(d: DataConfig):
    """How the data section's text becomes tokens (to encode a prompt and decode samples): bytes,
    or data.source=files' tokenizer, read from its file and data.prepared's manifest alone: a
    loaded model needs no token file."""
    if d.source != "files":
        return tokenization.Bytes()
    if d.prepared:
        info = read_manifest(_home(d.prepared))["tokenizer"]
        if info["kind"] == "bytes":
            return tokenization.Bytes()
        return tokenization.HFTokenizer(_home(d.prepared) / info["file"], info.get("doc_end_token") or "")
    return tokenization.load(d.tokenizer, d.doc_end_token)


def model_vocab(c: Corpus, configured: int, default: int) -> int:
    """model.vocab_size for corpus `c`: its vocabulary when the config leaves the `default`, else
    the configured size, which must hold every token (a larger one pads the embedding table)."""
    v = c.vocab_size
    vocab = v if configured == default else configured
    if vocab < v:
        what = "bytes" if c.manifest["tokenizer"]["kind"] == "bytes" else "the tokenizer's vocabulary"
        raise ConfigError(f"model.vocab_size={configured} is smaller than the {v} tokens of {what}; leave it at "
                          f"{default} to take the data's vocabulary")
    top = max(c.manifest[s]["max_token"] for s in SPLITS)
    if top >= vocab:
        raise ConfigError(f"the data hold token id {top}, not below model.vocab_size={vocab}")
    return vocab
