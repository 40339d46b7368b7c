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
the same arrays and the same digest either way. Document boundaries are the manifest's document
starts, never a token value, so any tokenizer's ids may appear anywhere. Files in DIR are written
under temporary names and renamed, manifest.json last: a DIR with a manifest is complete, and a
prepare that fails leaves an earlier one as it was.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from nljax.data import documents, tokenization
from nljax.data.settings import DataConfig
from nljax.errors import ConfigError

FORMAT = "nljax-text-1"
SPLITS = ("train", "eval")
MANIFEST, TOKENIZER, LOCK = "manifest.json", "tokenizer.json", ".prepare.lock"


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
    train: Split
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


class _Sink:
    """One split's tokens, written as they come (to a file or to memory), and its record."""

    def __init__(self, f, dtype: np.dtype):
        self.f, self.dtype, self.sha = f, dtype, hashlib.sha256()
        self.starts: list[int] = []
        self.tokens = self.bytes = 0
        self.max = -1

    def add(self, ids: np.ndarray, nbytes: int) -> None:
        if not len(ids):  # a tokenizer may give nothing for blank text: no document
            return
        raw = ids.astype(self.dtype).tobytes()
        self.f.write(raw)
        self.sha.update(raw)
        self.starts.append(self.tokens)
        self.tokens += len(ids)
        self.bytes += nbytes
        self.max = max(self.max, int(ids.max()))

    def record(self, name: str) -> dict:
        starts = np.asarray(self.starts, np.int64)
        return {"file": f"{name}.bin", "docs_file": f"{name}.docs.npy", "tokens": self.tokens,
                "documents": len(starts), "bytes": self.bytes, "max_token": self.max,
                "sha256": self.sha.hexdigest(), "docs_sha256": hashlib.sha256(starts.tobytes()).hexdigest()}


def settings_record(d: DataConfig) -> dict:
    """The data.* keys a corpus is prepared from (eval_fraction only when it splits data.train),
    its files absolute: a run from another directory names the same ones."""
    return {"train": [documents.absolute(p) for p in d.train], "eval": [documents.absolute(p) for p in d.eval],
            "text_key": d.text_key,
            "eval_fraction": None if d.eval else d.eval_fraction, "doc_end_token": d.doc_end_token}


def _sources(d: DataConfig) -> tuple[list[Path], list[Path]]:
    train = documents.expand(d.train, "data.train")
    held = documents.expand(d.eval, "data.eval") if d.eval else []
    trained = {p.resolve() for p in train}
    both = [p for p in held if p.resolve() in trained]
    if both:
        raise ConfigError(f"{both[0]} is in both data.train and data.eval: held-out documents must not be trained on")
    return train, held


def _tokenize(d: DataConfig, tok, train_files: list[Path], eval_files: list[Path], sinks: dict) -> dict:
    """Fill the sinks (every round(1/eval_fraction)-th document held out unless data.eval is
    given) and return the manifest."""
    every, i = max(2, round(1 / d.eval_fraction)), 0
    for texts in documents.batches(train_files, d.text_key):
        for ids, nbytes in tok.encode_docs(texts):
            held = not eval_files and i % every == every - 1
            sinks["eval" if held else "train"].add(ids, nbytes)
            i += 1
    for texts in documents.batches(eval_files, d.text_key):
        for ids, nbytes in tok.encode_docs(texts):
            sinks["eval"].add(ids, nbytes)
    if not sinks["train"].tokens:
        raise ConfigError(f"data.train: no text in {len(train_files)} file(s) (every document empty)")
    if not sinks["eval"].tokens:
        why = "data.eval holds no text" if eval_files else (
            f"{i} document(s) at data.eval_fraction={d.eval_fraction} hold out none; give data.eval or more documents")
        raise ConfigError(f"no held-out documents: {why}")
    content = {"format": FORMAT, "tokenizer": tok.info(), "vocab_size": tok.vocab_size,
               "dtype": np.dtype(sinks["train"].dtype).name, **{s: sinks[s].record(s) for s in SPLITS}}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    sources = {k: _source_record(files) for k, files in (("train", train_files), ("eval", eval_files))}
    return {**content, "settings": settings_record(d), "sources": sources, "digest": digest}


def _source_record(files: list[Path]) -> list[dict]:
    return [{"path": str(p.absolute()), "bytes": p.stat().st_size} for p in files]


def build(d: DataConfig, out: Path | None = None, overwrite: bool = False) -> Corpus:
    """The corpus of data.train / data.eval, tokenized into memory, or into `out` and read back."""
    tok = tokenization.load(d.tokenizer, d.doc_end_token)
    train_files, eval_files = _sources(d)
    dtype = tokenization.dtype_for(tok.vocab_size)
    if out is not None:
        _write(Path(out), overwrite, lambda sinks: _tokenize(d, tok, train_files, eval_files, sinks), dtype, tok)
        return load(Path(out))
    sinks = {s: _Sink(io.BytesIO(), dtype) for s in SPLITS}
    manifest = _tokenize(d, tok, train_files, eval_files, sinks)
    split = lambda s: Split(np.frombuffer(sinks[s].f.getvalue(), dtype), np.asarray(sinks[s].starts, np.int64))
    return Corpus(split("train"), split("eval"), manifest)


def _write(out: Path, overwrite: bool, fill, dtype: np.dtype, tok) -> None:
    """Tokenize into temporary files in `out`, then rename them into place, the manifest last;
    one prepare at a time per directory (a lock held while it writes)."""
    own = {f"{s}{ext}" for s in SPLITS for ext in (".bin", ".docs.npy")} | {MANIFEST, TOKENIZER}
    there = sorted(p.name for p in out.iterdir() if p.name != LOCK and ".tmp-" not in p.name) if out.is_dir() else []
    foreign = [name for name in there if name not in own]
    if foreign:  # overwrite=true replaces prepared data, never a user's files (the source text may be there)
        raise ConfigError(f"{out} holds files that are not nljax prepared data ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); give a new or empty out=")
    if there and not overwrite:  # a manifest, or the files of a prepare that stopped part-way
        raise ConfigError(f"{out} already holds prepared data ({', '.join(there[:3])}); give another out= or overwrite=true")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {out}: {e.strerror or e}") from None
    temp = lambda name: out / f".{name}.tmp-{os.getpid()}"
    names = [f"{s}.bin" for s in SPLITS] + [f"{s}.docs.npy" for s in SPLITS]
    names += [TOKENIZER] if hasattr(tok, "raw") else []
    names += [MANIFEST]  # last: a directory with a manifest is complete
    lock = open(out / LOCK, "a")
    try:
        try:  # released by the kernel whatever ends this process: no stale lock
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"another nljax.prepare is writing into {out} (it holds {out / LOCK}); "
                              "wait for it, or give another out=") from None
        if (out / MANIFEST).exists() and not overwrite:  # the other one finished first
            raise ConfigError(f"{out} already holds prepared data ({MANIFEST}); give another out= or overwrite=true")
        with open(temp("train.bin"), "wb") as ft, open(temp("eval.bin"), "wb") as fe:
            sinks = {"train": _Sink(ft, dtype), "eval": _Sink(fe, dtype)}
            manifest = fill(sinks)
        for s in SPLITS:
            with open(temp(f"{s}.docs.npy"), "wb") as f:
                np.save(f, np.asarray(sinks[s].starts, np.int64))
        if hasattr(tok, "raw"):
            temp(TOKENIZER).write_bytes(tok.raw)
            manifest["tokenizer"]["file"] = TOKENIZER
        temp(MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (out / MANIFEST).unlink(missing_ok=True)  # from here until the last rename, DIR is incomplete
        for name in names:
            os.replace(temp(name), out / name)
    finally:
        for name in names:
            temp(name).unlink(missing_ok=True)
        if created and {p.name for p in out.iterdir()} == {LOCK}:  # bad data: no empty directory left behind
            (out / LOCK).unlink()
            out.rmdir()
        lock.close()


def load(path: Path) -> Corpus:
    """A prepared directory, its tokens memory-mapped; sizes checked against the manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ConfigError(f"data.prepared={path} holds no {MANIFEST}: write it with python -m nljax.prepare") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"data.prepared={path}: {MANIFEST} is not a manifest of format {FORMAT}")
    try:
        for key in ("digest", "vocab_size", "dtype"):
            manifest[key]
        tok = manifest["tokenizer"]
        if tok["kind"] != "bytes":
            _check_tokenizer_copy(path, tok)
        for s in SPLITS:
            manifest[s]["max_token"]
        _check_manifest_digest(path, manifest)
        return Corpus(*(_open_split(path, manifest, s) for s in SPLITS), manifest)
    except ConfigError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a field missing or of another type
        raise ConfigError(f"data.prepared={path}: {MANIFEST} lacks {e} or holds it as another type: "
                          "prepare again") from None


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
        raw = (path / info["file"]).read_bytes()
    except OSError as e:
        raise ConfigError(f"data.prepared={path}: {info['file']} cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(raw).hexdigest() != info["sha256"]:
        raise ConfigError(f"data.prepared={path}: {info['file']} is not the tokenizer it was prepared with "
                          "(its sha256 differs from the manifest's): prepare it again")


def _open_split(path: Path, manifest: dict, name: str) -> Split:
    rec, dtype = manifest[name], np.dtype(manifest["dtype"]).newbyteorder("<")
    file, n = path / rec["file"], rec["tokens"]
    size = file.stat().st_size if file.is_file() else None
    if size != n * dtype.itemsize:
        raise ConfigError(f"data.prepared={path}: {rec['file']} holds {size} bytes, the manifest says {n} tokens of "
                          f"{dtype.name} (an incomplete or changed file: prepare again)")
    try:
        _check_tokens(path, file, rec, dtype, int(manifest["vocab_size"]))
    except OSError as e:
        raise ConfigError(f"data.prepared={path}: {rec['file']} cannot be read ({e.strerror or e})") from None
    try:
        starts = np.load(path / rec["docs_file"])
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} cannot be read ({e})") from None
    ordered = starts.ndim == 1 and bool(np.all(np.diff(starts) > 0))
    if starts.shape != (rec["documents"],) or not ordered or (len(starts) and (starts[0] != 0 or starts[-1] >= n)):
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} does not match the manifest's {rec['documents']} "
                          "documents: prepare again")
    if hashlib.sha256(np.asarray(starts, np.int64).tobytes()).hexdigest() != rec["docs_sha256"]:
        raise ConfigError(f"data.prepared={path}: {rec['docs_file']} is not the file prepared (its sha256 differs "
                          "from the manifest's): prepare again")
    return Split(np.memmap(file, dtype=dtype, mode="r", shape=(n,)), starts.astype(np.int64))


# ---------------------------------------------------------------------------------------------
# What a run reads: the corpus of its data section, and the model vocabulary it implies


_CACHE: dict = {}  # (data section, what its files are now) -> Corpus; a Run and its local copy share one


def corpus(d: DataConfig) -> Corpus:
    """data.prepared (checked against data.train and data.tokenizer when they are given too), or
    data.train tokenized into memory. Read once per process while the files stay unchanged."""
    # the source files (when given) and every file of DIR: a token file replaced or cut short, or
    # a source edited since, is read again, and checked
    paths = [*documents.expand(d.train, "data.train"), *documents.expand(d.eval, "data.eval")]
    if d.prepared:
        paths += sorted(Path(d.prepared).iterdir()) if Path(d.prepared).is_dir() else []
    paths += [Path(d.tokenizer).expanduser()] if d.tokenizer else []
    key = (d, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file()))
    if key not in _CACHE:
        if d.prepared:
            c = load(Path(d.prepared))
            _check_settings(c.manifest, d)
        else:
            c = build(d)
        _CACHE.clear()  # one corpus at a time: a memmap or an in-memory copy of the whole text
        _CACHE[key] = c
    return _CACHE[key]


def _check_settings(manifest: dict, d: DataConfig) -> None:
    """A data.prepared directory given with data.train (or data.tokenizer) must have been prepared from them."""
    where = f"data.prepared={d.prepared} was prepared"
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
    if d.tokenizer:
        sha = tokenization.load(d.tokenizer, d.doc_end_token).info()["sha256"]
        if manifest["tokenizer"].get("sha256") != sha:
            raise ConfigError(f"{where} with another tokenizer than data.tokenizer={d.tokenizer}")


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
    """The tokenization of data.source=files (to encode a prompt and decode samples)."""
    if d.prepared:
        info = corpus(d).manifest["tokenizer"]
        if info["kind"] == "bytes":
            return tokenization.Bytes()
        return tokenization.HFTokenizer(Path(d.prepared) / info["file"], info.get("doc_end_token") or "")
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
