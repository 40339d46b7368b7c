"""A command's JSON result file (`nljax.bench --out`, `nljax.evaluate out=`): refused before
anything slow runs when it cannot be written or holds a file of another kind, and written whole or
not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

from nljax.errors import ConfigError


def check(out: Path, named: str, tool: str, keys: frozenset[str]) -> None:
    """`out` (`named`: how the command line spells it, "--out FILE" or "out=FILE") names a JSON
    file that can be written, never over a file that is not an earlier result of `tool` (one
    holding `keys`)."""
    if out.suffix.lower() != ".json":
        raise ConfigError(f"{named}: the result is JSON, give a file name ending in .json")
    if out.is_dir():
        raise ConfigError(f"{named} is a directory: give the JSON file to write")
    if why := not_a_directory(out.absolute().parent):  # else mkdir's "File exists", after the slow part
        raise ConfigError(f"{named}: {why}")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not os.access(out if out.exists() else parent, os.W_OK):
        raise ConfigError(f"{named}: {out if out.exists() else parent} is not writable")
    if out.exists() and not earlier_result(out, keys):  # a tokenizer.json, an export's config.json
        raise ConfigError(f"{named} holds a file that is not an {tool} result: give a new file name, or move it")


def not_a_directory(path: Path) -> str | None:
    """Why `path` can neither be a directory nor be made one, or None: the nearest of it and its
    parents that is there (a symbolic link counted, broken or not) is a file, or a link to nothing
    (both of which `mkdir(parents=True)` meets as "File exists")."""
    there = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if there is None or there.is_dir():
        return None
    if there.is_symlink() and not there.exists():
        return f"{there} is a symbolic link to {os.readlink(there)}, which does not exist"
    return f"{there} is a file, not a directory"


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


def write(out: Path, result: dict) -> None:
    """`result` as JSON at `out`: written beside it under a temporary name and renamed into
    place, so that a write cut short (Ctrl-C, a full disk) leaves the earlier file whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        temp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
