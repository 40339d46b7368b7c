"""The user's own text as documents: paths and globs of .txt and .jsonl files (optionally .gz),
Parquet and Arrow files, and folders written by `datasets.Dataset.save_to_disk`.

A .txt file is one document; a .jsonl line is one, its `text_key` field; a Parquet or Arrow row
is one, its `text_key` column (data/columnar.py). A save_to_disk folder is its .arrow shards, in
the order its state.json lists them. Files are read in the order of the list (each glob's
matches sorted, a file named twice read once), so the same files give the same documents in the
same order on every process and in every run. Documents are kept whole, never cut or merged; NUL
characters are removed (NUL ends a document of the byte tokenization, as in the stdlib corpus),
as is a byte order mark that starts a .txt file or a .jsonl line, and documents left empty are
skipped.

Files are streamed: a .jsonl line, a .txt file, a Parquet row group or an Arrow record batch at a
time, so memory stays bounded whatever a file's size. `read` says where it is (file, record) after
every list of documents, and starts from such a position: an interrupted nljax.prepare resumes
without reading again what it has done.

Every problem is one line (`ConfigError`) naming the file, and the line of a .jsonl: a path or
glob that names no file, or a link to nothing or a pipe (a glob skips only folders), another file
type, bytes that are not UTF-8, a .gz that is not gzip, a line that is not a JSON object with a
string `text_key`, a Parquet or Arrow file without that column (data/columnar.py).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterator, Sequence

from nljax import writable
from nljax.data import columnar
from nljax.data.outdir import is_prepared
from nljax.data.settings import TEXT_FORMATS
from nljax.errors import ConfigError, first_line

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", *columnar.SUFFIXES)
SAVED = ("state.json", "dataset_info.json")  # what marks a folder datasets.Dataset.save_to_disk wrote
BATCH = 1024  # documents per list read, at most (a list is tokenized at once, in parallel)
# the listing of the files a run wrote in its run.dir (nljax.runtime.runlog.WRITTEN, a layer above)
RUN_LISTING = "nljax_written.txt"
BOM = "\ufeff"  # the byte order mark Windows editors write first: an encoding's mark, not text


def absolute(path: str) -> str:
    """`path` (or glob) as `expand` reads it (`~` expanded), made absolute: the same files from
    any directory."""
    return os.path.abspath(os.path.expanduser(path))


def expand(patterns: Sequence[str], key: str) -> list[Path]:
    """The files `patterns` (paths or globs, under config key `key`) name, in order, each once."""
    files: list[Path] = []
    seen: set[Path] = set()  # resolved: one file named twice in two spellings is read once
    runs: dict[Path, set[str] | None] = {}  # each folder's run listing, read once (`_run_output`)
    for pattern in patterns:
        if not pattern:  # read as the working directory: "data.train:  is a directory"
            raise ConfigError(f"{key}: an empty path (give the paths or globs of the text files)")
        # a glob (** spans directories), unless a file has that very name ("notes[1].txt")
        if any(c in pattern for c in "*?[") and not os.path.isfile(os.path.expanduser(pattern)):
            # its files, and the folders save_to_disk wrote as their shards (other folders, what `**`
            # spans, are skipped: a save_to_disk folder among the matches was skipped without a word)
            matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
            # a link to nothing (a share not mounted) or a pipe was skipped as a folder is: the
            # training text lacked that file without a word
            if odd := next((m for m in matches if not m.is_file() and not m.is_dir()), None):
                raise ConfigError(f"{key}: {not_regular(odd)}")
            found = [q for m in matches if not _dataset_metadata(m) and not _run_output(m, runs)
                     for q in ([m] if m.is_file() else saved_shards(m, str(m), key) if _saved(m) or _splits(m) else [])]
            if not found:
                raise ConfigError(f"{key}: '{pattern}' matches no file{_list_hint(pattern, key)}")
            _one_split_each(found, pattern, key)
        else:
            p = Path(os.path.expanduser(pattern))
            if not p.exists() and not writable.dangling(p):
                raise ConfigError(f"{key}: {missing(p, pattern)}{_list_hint(pattern, key)}")
            if p.is_dir():
                found = saved_shards(p, pattern, key)
                if not found:  # (matched by a glob, it adds nothing, as a Parquet file of no rows)
                    raise ConfigError(f"{key}: {pattern} is an empty dataset (its state.json lists no .arrow file)")
            elif not p.is_file():
                raise ConfigError(f"{key}: {not_regular(p, pattern)}")
            else:
                found = [p]
        for p in found:
            if not p.name.endswith(SUFFIXES):
                # a file of a directory nljax.prepare wrote (DIR/* for DIR): the directory itself is read
                whole = (f"; {p.parent} holds data nljax.prepare wrote: give the directory itself"
                         if is_prepared(p.parent) else "")
                raise ConfigError(f"{key}: {p} is not a file nljax reads as text (it reads {TEXT_FORMATS}){whole}")
            if p.name.endswith(columnar.SUFFIXES):
                columnar.require_pyarrow(p)
            if p.resolve() not in seen:
                seen.add(p.resolve())
                files.append(p)
    return files


def _run_output(path: Path, runs: dict[Path, set[str] | None]) -> bool:
    """Whether a glob's match is something a run wrote in its run.dir: its listing
    (nljax_written.txt) or what the listing names (metrics.jsonl, wandb/.../requirements.txt). A
    glob over a folder that holds a run directory (`notes/**/*.txt` with run.dir=notes/runs/x)
    read them as text, and more of them at each resume (the data then changed). A user's own
    file in a run directory is read; so is a run's file named without a glob. `runs`: the
    listing of each folder looked at (None: not a run directory)."""
    for folder in path.parents:  # the nearest run directory decides
        if folder not in runs:
            runs[folder] = _listed(folder / RUN_LISTING)
        if runs[folder] is not None:
            return path.relative_to(folder).parts[0] in runs[folder]
    return False


def _listed(listing: Path) -> set[str] | None:
    """The names a run's listing holds, itself among them; None where there is none."""
    try:
        return {*listing.read_text(errors="replace").splitlines(), RUN_LISTING} if listing.is_file() else None
    except OSError:  # unreadable: not taken for a run's
        return None


def not_regular(p: Path, named: str | None = None) -> str:
    """What a path that is neither a file nor a folder is: a symbolic link to nothing, or a pipe
    or a device (a FIFO would wait for a writer forever, a device never end)."""
    if writable.dangling(p):
        return writable.broken_link(p, named)
    return f"{named or p} is not a regular file (a pipe or a device)"


def missing(p: Path, pattern: str) -> str:
    """What a path that does not exist is: a split a `DatasetDict` folder lacks (its splits
    named), a name with no file suffix (a Hugging Face dataset's name, which nljax never
    downloads), or no file."""
    if _splits(p.parent):  # my_dataset/validation where it saved train and test
        splits = sorted(q.name for q in p.parent.iterdir() if (q / "state.json").is_file())
        return f"{p.parent} has no split '{p.name}' (its splits: {', '.join(splits) or 'none'})"
    if not p.name.endswith(SUFFIXES) and not p.suffix:  # "wikitext", "HuggingFaceFW/fineweb"
        return (f"no file or folder {pattern} (a Hugging Face dataset is not downloaded: save it once with "
                "datasets' load_dataset(...).save_to_disk(DIR) and give DIR, or one split of it, DIR/train)")
    return f"no file {pattern}"


def _list_hint(pattern: str, key: str) -> str:
    """How to write several paths, when `pattern` is some joined by commas that each name
    something (`data.train=a.txt,b.txt` is one path with a comma in its name): '' otherwise, and
    for a data.eval_sets set (`key` "data.eval_sets NAME"), whose glob is one."""
    parts = [part.strip() for part in pattern.split(",")]
    if " " in key or len(parts) < 2 or not all(part and glob.glob(os.path.expanduser(part)) for part in parts):
        return ""
    return f" (several paths are a list: {key}='[{', '.join(parts)}]')"


def saved_shards(folder: Path, pattern: str, key: str) -> list[Path]:
    """The .arrow shards of a folder `datasets.Dataset.save_to_disk` wrote, in its state.json's
    order (read as Arrow stream files: `datasets` itself is not needed)."""
    inside = pattern.rstrip("/")  # a shell's completion ends a folder with "/": not "corpus//*.txt"
    if _splits(folder):  # a DatasetDict: one folder per split
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise ConfigError(f"{key}: {pattern} holds the splits of a DatasetDict ({', '.join(splits) or 'none'}): give "
                          f"one, such as {inside}/{_example(splits, key)}")
    if not _saved(folder):
        if is_prepared(folder):  # nljax.prepare's output (a data.eval_sets set reads it: data/evalsets.py)
            raise ConfigError(f"{key}: {pattern} holds data nljax.prepare wrote, not text: give it as "
                              f"data.prepared={inside}")
        # the glob of what it holds: Spark and Dask write a Parquet "file" as a folder of part files
        held = sorted({s for p in folder.iterdir() for s in SUFFIXES if p.name.endswith(s) and p.is_file()},
                      key=SUFFIXES.index)
        raise ConfigError(f"{key}: {pattern} is a directory (give a glob such as {inside}/*{(held or ['.txt'])[0]}, "
                          "or a folder datasets' save_to_disk wrote)")
    try:
        names = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
        assert all(isinstance(n, str) and "/" not in n for n in names)  # none: a dataset of no rows
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"{key}: {folder / 'state.json'} does not list the folder's .arrow files "
                          "(_data_files): not a save_to_disk folder") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise ConfigError(f"{key}: {folder / missing[0]} is missing (listed in {folder / 'state.json'})")
    return [folder / n for n in names]


def _one_split_each(found: list[Path], pattern: str, key: str) -> None:
    """Refuse a glob that takes the files of several splits of one `DatasetDict` (dd/*, or
    **/*.arrow above it), as a glob that matches its folder: it trained on the test split too."""
    taken: dict[Path, set[str]] = {}
    for p in found:
        if _saved(p.parent) and _splits(p.parent.parent):
            taken.setdefault(p.parent.parent, set()).add(p.parent.name)
    for folder, splits in taken.items():
        if len(splits) > 1:
            names = sorted(splits)
            raise ConfigError(f"{key}: '{pattern}' matches the splits {', '.join(names)} of the DatasetDict {folder}: "
                              f"give one, such as {folder}/{_example(names, key)} (or name each)")


def _example(splits: list[str], key: str) -> str:
    """The split to offer for `key`: train for data.train, a held-out one for the others (the
    first in name order offered data.train the test split)."""
    wanted = ("train",) if key == "data.train" else ("validation", "test")
    return next((s for s in wanted if s in splits), splits[0] if splits else wanted[0])


def _splits(folder: Path) -> bool:
    """Whether `folder` holds a `datasets.DatasetDict`'s splits (refused by `saved_shards`, which
    says which to give: read whole, a glob took the test split into training)."""
    return (folder / "dataset_dict.json").is_file()


def _dataset_metadata(path: Path) -> bool:
    """Whether `path` is a file of a `datasets` folder's own (state.json, dataset_info.json,
    dataset_dict.json): a `**` glob matches them with the folder, which is read (or refused) as
    a whole."""
    return path.name in (*SAVED, "dataset_dict.json") and (_saved(path.parent) or _splits(path.parent))


def _saved(folder: Path) -> bool:
    """Whether `folder` is one `datasets.Dataset.save_to_disk` wrote (its marker files)."""
    return folder.is_dir() and all((folder / name).is_file() for name in SAVED)


def read(files: Sequence[Path], text_key: str, start: tuple[int, int] = (0, 0),
         batch: int = BATCH, max_bytes: int = 0) -> Iterator[tuple[list[str], int, int]]:
    """The documents of `files` in lists of up to `batch`, from record `start[1]` of file
    `start[0]`; each list with the index of its file and the records of that file read after it
    (a .txt is one record, a .jsonl line one, a Parquet or Arrow row one). A list may be empty
    (a record with no text): the position still moves.

    With `max_bytes`, a list also ends at the document with which the UTF-8 bytes (`utf8_bytes`)
    of the documents since the last such end reach `max_bytes`, counted across files: chunks.read
    ends a chunk there, so that a chunk holds at most `max_bytes` plus one document, whatever the
    documents' sizes (lists of `batch` documents of 64 KB were 64 MB chunks for 2 MB ones)."""
    cut = _Cut(max_bytes)
    for index in range(start[0], len(files)):
        path, skip = files[index], start[1] if index == start[0] else 0
        if path.name.endswith(columnar.SUFFIXES):
            for texts, done in columnar.rows(path, text_key, skip, batch):
                first, docs, at = done - len(texts), [], None  # texts are rows first .. done - 1
                for row, text in enumerate(map(_clean, texts), first + 1):
                    if text:
                        docs.append(text)
                        if cut(text):
                            yield docs, index, row
                            docs, at = [], row
                if docs or at != done:  # the rest, or rows with no text after the last cut
                    yield docs, index, done
        elif path.name.endswith((".jsonl", ".jsonl.gz")):
            for docs, done in _jsonl(path, text_key, skip, batch, cut):
                yield docs, index, done
        elif skip == 0:
            text = _clean(_decode(_read(path), str(path)).removeprefix(BOM))
            if text:
                cut(text)  # one document, one list: counted towards the next cut
            yield ([text] if text else []), index, 1


def utf8_bytes(text: str) -> int:
    """The UTF-8 length of `text` without encoding it when it is ASCII (`isascii` reads a flag
    CPython keeps); a lone surrogate (JSON allows one) counts its three bytes."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class _Cut:
    """Where lists end by bytes (`read`'s max_bytes; 0: never): called with each document in
    order, True for the one with which the bytes since the last True reach the limit."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.counted = max_bytes, 0

    def __call__(self, text: str) -> bool:
        if not self.max_bytes:
            return False
        self.counted += utf8_bytes(text)
        if self.counted < self.max_bytes:
            return False
        self.counted = 0
        return True


def _read(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if path.name.endswith(".gz"):
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ConfigError(f"{path}: not a valid gzip file ({first_line(e) or type(e).__name__})") from None
    return raw


def _jsonl(path: Path, text_key: str, skip: int, batch: int, cut: _Cut) -> Iterator[tuple[list[str], int]]:
    """One document per non-blank line, from line `skip` + 1; the file is streamed (a .gz
    decompressed as it is read), one line in memory at a time."""
    gz = path.name.endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            yield from _lines(path, f, text_key, skip, batch, cut)
    except OSError as e:
        if gz and not isinstance(e, FileNotFoundError | PermissionError):
            raise ConfigError(f"{path}: not a valid gzip file ({first_line(e) or type(e).__name__})") from None
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:
        raise ConfigError(f"{path}: not a valid gzip file ({first_line(e) or type(e).__name__})") from None


def _lines(path: Path, f, text_key: str, skip: int, batch: int, cut: _Cut) -> Iterator[tuple[list[str], int]]:
    docs: list[str] = []
    number = at = 0  # the line read, and the one the last list ended at
    for number, line in enumerate(f, 1):
        if number <= skip or not line.strip():
            continue
        where = f"{path}:{number}"
        # its own line: a ConfigError is a ValueError, which the JSON errors below catch. A BOM is
        # no JSON: dropped at the start of any line (files joined with `cat` carry one each)
        decoded = _decode(line, where).removeprefix(BOM)
        if not decoded.strip():  # a BOM alone (an empty file saved by a Windows editor): a blank line
            continue
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # e.g. an integer past the digit limit, deep nesting
            raise ConfigError(f"{where}: not valid JSON ({first_line(e) or type(e).__name__})") from None
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            there = _what_is_there(record, text_key)
            raise ConfigError(f"{where}: no string field '{text_key}' (data.text_key; {there})")
        try:  # JSON's \ud83d escapes can spell a lone surrogate, which is no UTF-8 text
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: field '{text_key}' holds a lone surrogate (not UTF-8 text)") from None
        text = _clean(text)
        if text:
            docs.append(text)
            if cut(text) or len(docs) == batch:  # (cut counts every document: called first)
                yield docs, number
                docs, at = [], number
    if docs or at != number or not at:  # the rest, or blank lines after the last list (or none read)
        yield docs, number


def _what_is_there(record, text_key: str) -> str:
    """What a .jsonl line without a string `text_key` holds instead: its fields (a corpus whose
    text is under another name, "content"), as a Parquet file's columns are named, or the JSON
    type of the field or of the line."""
    kinds = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    if not isinstance(record, dict):
        return f"the line is {kinds[type(record)]}, not an object"
    if text_key in record:
        return f"it holds {kinds[type(record[text_key])]}"
    names = list(record)
    return f"its fields: {', '.join(names[:8]) + (', ...' if len(names) > 8 else '') or 'none'}"


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None


def _clean(text: str) -> str:
    return text.replace("\0", "")
