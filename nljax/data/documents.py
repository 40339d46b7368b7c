"""The user's own text as documents: paths and globs of .txt and .jsonl files, optionally .gz.

A .txt file is one document; a .jsonl line is one, its `text_key` field. Files are read in the
order of the list (each glob's matches sorted, a file named twice read once), so the same files
give the same documents in the same order on every process and in every run. Documents are kept
whole, never cut or merged; NUL characters are removed (NUL ends a document of the byte
tokenization, as in the stdlib corpus) and documents left empty are skipped.

Every problem is one line (`ConfigError`) naming the file, and the line of a .jsonl: a path or
glob that names no file, another file type, bytes that are not UTF-8, a .gz that is not gzip, a
line that is not a JSON object with a string `text_key`.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterator, Sequence

from nljax.errors import ConfigError, first_line

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
BATCH = 1024  # documents handed to the tokenizer at once (a batch encodes in parallel)


def absolute(path: str) -> str:
    """`path` (or glob) as `expand` reads it (`~` expanded), made absolute: the same files from
    any directory."""
    return os.path.abspath(os.path.expanduser(path))


def expand(patterns: Sequence[str], key: str) -> list[Path]:
    """The files `patterns` (paths or globs, under config key `key`) name, in order, each once."""
    files: list[Path] = []
    seen: set[Path] = set()  # resolved: one file named twice in two spellings is read once
    for pattern in patterns:
        # a glob (** spans directories), unless a file has that very name ("notes[1].txt")
        if any(c in pattern for c in "*?[") and not os.path.isfile(os.path.expanduser(pattern)):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigError(f"{key}: '{pattern}' matches no file")
        else:
            p = Path(pattern).expanduser()
            if not p.exists():
                raise ConfigError(f"{key}: no file {pattern}")
            if p.is_dir():
                raise ConfigError(f"{key}: {pattern} is a directory (give a glob such as {pattern}/*.txt)")
            if not p.is_file():  # a FIFO would wait for a writer forever, a device never end
                raise ConfigError(f"{key}: {pattern} is not a regular file (a pipe or a device)")
            found = [p]
        for p in found:
            if not p.name.endswith(SUFFIXES):
                raise ConfigError(f"{key}: {p} is not a .txt or .jsonl file (optionally .gz)")
            if p.resolve() not in seen:
                seen.add(p.resolve())
                files.append(p)
    return files


def batches(files: Sequence[Path], text_key: str) -> Iterator[list[str]]:
    """The documents of `files`, in order, in lists of up to BATCH (one list per .txt file)."""
    for path in files:
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl(path, text_key)
        else:
            text = _clean(_decode(_read(path), str(path)))
            if text:
                yield [text]


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


def _jsonl(path: Path, text_key: str) -> Iterator[list[str]]:
    """One document per non-blank line; the whole file is read (a .gz decompressed) first, so
    that a damaged file is refused before any of it is used."""
    docs: list[str] = []
    for number, line in enumerate(_read(path).split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(_decode(line, where))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # e.g. an integer past the digit limit, deep nesting
            raise ConfigError(f"{where}: not valid JSON ({first_line(e) or type(e).__name__})") from None
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{where}: no string field '{text_key}' (data.text_key)")
        try:  # JSON's \ud83d escapes can spell a lone surrogate, which is no UTF-8 text
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: field '{text_key}' holds a lone surrogate (not UTF-8 text)") from None
        text = _clean(text)
        if text:
            docs.append(text)
        if len(docs) == BATCH:
            yield docs
            docs = []
    if docs:
        yield docs


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None


def _clean(text: str) -> str:
    return text.replace("\0", "")
