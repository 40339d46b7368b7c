"""Whether a directory a command will write can be made and written, checked before the slow part
(building a model, reading a checkpoint, tokenizing a corpus): a destination that cannot be
written is bad input, one line and exit 2, as every other refusal of what the user gave.
`nljax.train`'s run.dir and checkpoint.dir, `nljax.export`'s out= and `nljax.prepare`'s out=
share it, so the three say it alike."""

from __future__ import annotations

import os
from pathlib import Path

from nljax.errors import ConfigError


def dangling(path: Path) -> bool:
    """Whether `path` is a symbolic link to nothing. A loop of links (a -> b -> a) is not one: its
    OSError (ELOOP, naming `path`) is raised here, which every command says in one line
    (`cli.unusable_path`). Python 3.13's Path.resolve no longer raises for a loop (3.11 and 3.12
    raised RuntimeError), and Path.exists answers False for one, as for a link to nothing."""
    if not path.is_symlink() or path.exists():
        return False
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    return False


def broken_link(path: Path, named: str | None = None) -> str:
    """What every command says of a `dangling` path (`named`: how it names it, the path itself by
    default): one wording wherever it is met."""
    return f"{named or path} is a symbolic link to {os.readlink(path)}, which does not exist"


def refuse_unwritable(named: str, path: Path, beside: bool = False) -> None:
    """Refuses the directory `path` (`named`: how the message names it, "run.dir runs/x" or
    "out=DIR") when the nearest part of it that exists is a file, or a directory this process
    cannot write into: its permissions, or a read-only file system (`os.access` tells both; root
    passes the first). `beside`: the command also writes next to `path`, in its parent
    (nljax.prepare's lock and work directory), which must then be writable too. Without this the
    write failed at the end, as an OSError (exit 1), the work done lost."""
    starts = [path.parent, *([path] if path.exists() else [])] if beside else [path]
    for start in starts:
        # a link counted, broken or not: mkdir(parents=True) meets a link to nothing as "File exists"
        there = next(p for p in (start, *start.parents) if os.path.lexists(p))  # "." or "/" at the latest
        where = named + ("" if there == path else f": {there}")
        if dangling(there):
            raise ConfigError(broken_link(there, where))
        if not there.is_dir():
            raise ConfigError(f"{where} is a file, not a directory")
        if not os.access(there, os.W_OK | os.X_OK):
            raise ConfigError(f"{where} is not writable")
