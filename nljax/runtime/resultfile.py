"""A command's JSON result file (`nljax.bench --out`, `nljax.evaluate out=`) or JSON-lines one
(`nljax.generate prompts= out=`): refused before anything slow runs when it cannot be written or
holds a file of another kind, and written whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

from nljax.errors import ConfigError
from nljax.writable import broken_link, dangling


def check(out: Path, named: str, tool: str, keys: frozenset[str], lines: bool = False) -> None:
    """`out` (`named`: how the command line spells it, "--out FILE" or "out=FILE") names a JSON
    file (`lines`: a JSON-lines file, one record a line) that can be written, never over a file
    that is not an earlier result of `tool` (one holding `keys`, in every record)."""
    kind, suffix = ("JSON lines", ".jsonl") if lines else ("JSON", ".json")
    if out.suffix.lower() != suffix:
        raise ConfigError(f"{named}: the result is {kind}, give a file name ending in {suffix}")
    if out.is_dir():
        raise ConfigError(f"{named} is a directory: give the {kind} file to write")
    if why := not_a_directory(out.absolute().parent):  # else mkdir's "File exists", after the slow part
        raise ConfigError(f"{named}: {why}")
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{named}: {out} is not writable")
    if where := unwritable(out.absolute().parent):  # the result is written there, renamed into place
        raise ConfigError(f"{named}: {where} is not writable")
    if out.exists() and not (earlier_lines if lines else earlier_result)(out, keys):  # a tokenizer.json, a data set
        raise ConfigError(f"{named} holds a file that is not an {tool} result: give a new file name, or move it")


def not_a_directory(path: Path) -> str | None:
    """Why `path` can neither be a directory nor be made one, or None: the nearest of it and its
    parents that is there (a symbolic link counted, broken or not) is a file, or a link to nothing
    (both of which `mkdir(parents=True)` meets as "File exists")."""
    there = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if there is None or there.is_dir():
        return None
    if dangling(there):
        return broken_link(there)
    return f"{there} is a file, not a directory"


def unwritable(path: Path) -> Path | None:
    """The nearest of `path` and its parents that is there, where a file cannot be made in it
    (then what was there, a directory), or None. `os.access` alone answers yes to root, and for a
    file system that refuses every new file (/proc, /sys): a file is made there and taken away."""
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    if there is None or not there.is_dir():
        return None
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError:
        return there
    return None


def earlier_result(out: Path, keys: frozenset[str]) -> bool:
    """Whether the existing `out` may be replaced: empty, or a JSON object holding `keys` (an
    earlier result: a rerun into the same folder). A FIFO or a device is neither (and is not read)."""
    if not out.is_file():
        return False
    try:
        text = out.read_bytes()
        result = json.loads(text) if text.strip() else dict.fromkeys(keys)
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and keys <= result.keys()


def earlier_lines(out: Path, keys: frozenset[str]) -> bool:
    """Whether the existing `out` may be replaced: empty, or JSON lines each an object holding
    `keys` (an earlier result). A data set of JSON lines (a `prompt` field, say) is not one."""
    if not out.is_file():
        return False
    try:
        with out.open("rb") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return all(isinstance(r, dict) and keys <= r.keys() for r in records)


def temp_for(out: Path) -> Path:
    """The hidden name `out` is written under before it is renamed into place (`.NAME.tmp-PID`):
    a write cut short leaves the earlier file whole."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def temp_of(name: str) -> str | None:
    """The file name a `temp_for` name stands for (`.NAME.tmp-PID` -> NAME), or None."""
    base, tmp, pid = name[1:].rpartition(".tmp-")
    return base if name.startswith(".") and tmp and pid.isdigit() else None


def write_lines(out: Path, records: Iterable[dict]) -> int:
    """`records` as JSON lines at `out`, each written as it comes beside it under a temporary name
    that is renamed into place once the last is written: a run cut short (Ctrl-C, a full disk, an
    error) leaves the earlier file whole and no partial one. Returns the records written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_for(out)
    n = 0
    try:
        with temp.open("w", encoding="utf-8") as f:
            for record in records:
                line = json.dumps(record, ensure_ascii=False)  # readable text, as the input's
                if not line.isascii():
                    try:
                        line.encode("utf-8")
                    except UnicodeEncodeError:  # a lone surrogate (a JSON "\\ud800" read in): escaped
                        line = json.dumps(record)
                f.write(line + "\n")
                n += 1
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
    return n


def write(out: Path, result: dict) -> None:
    """`result` as JSON at `out`: written beside it under a temporary name and renamed into
    place, so that a write cut short (Ctrl-C, a full disk) leaves the earlier file whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_for(out)
    try:
        temp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
