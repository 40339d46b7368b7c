"""out=DIR of `python -m nljax.prepare`: the names it owns beside DIR, and how it replaces DIR
whole.

A prepare builds the new prepared directory beside DIR, in its work directory (the same parent,
so the same file system: renames, never a copy), reads it back (every sha256), and only then
puts it in place. A directory cannot be renamed onto a non-empty one (POSIX), so that takes two
renames, then a removal:

    DIR                         -> .DIR.prepare-old   the previous data, whole, under a name of ours
    .DIR.prepare-work/prepared  -> DIR                the new data, whole
    .DIR.prepare-old            removed

At every instant DIR is the complete previous data or the complete new data, except between the
two renames, when it is absent and the previous data are whole at .DIR.prepare-old. A failed
second rename or a Ctrl-C there renames them back at once. A prepare stopped there for good (a
kill, a power cut) is finished or undone by the next prepare into DIR, before anything else, with
one warning line: DIR absent, the previous data are renamed back (the command then goes on as
asked: with overwrite=true, it puts the new data in place again, without tokenizing again); DIR
present and the prepared data that replaced them (stopped after the second rename), the previous
data are removed.

The names beside DIR (for out=data/mine):

    data/.mine.prepare.lock    held (flock) while a prepare writes DIR; removed when it ends
    data/.mine.prepare-work/   the work directory (data/workdir.py); prepared/ in it: the
                               finished new directory, until it becomes DIR
    data/.mine.prepare-old/    the previous DIR, between the two renames only

Nothing else is removed: .DIR.prepare-old only while it holds nothing but the names a prepared
directory holds and DIR is prepared data (otherwise one line, and both are kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Collection, Iterator

from nljax.errors import ConfigError, few
from nljax import writable

FORMAT = "nljax-text-1"  # a prepared directory's manifest says it (nljax.data.prepared writes it)
MANIFEST = "manifest.json"


def is_prepared(path: Path) -> bool:
    """Whether `path` holds the manifest nljax.prepare writes (read only if a regular file: a FIFO
    would block): a directory of prepared data, whatever the state of its token files. Here, below
    the readers of text (`nljax.data.documents` names a prepared directory given as text)."""
    if not (path / MANIFEST).is_file():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


@dataclasses.dataclass(frozen=True)
class Out:
    given: Path  # out= as the user wrote it: what messages name
    path: Path  # resolved (a symlink's target, not the link): what is renamed

    @property
    def lock(self) -> Path:
        return self._beside("prepare.lock")

    @property
    def work(self) -> Path:
        return self._beside("prepare-work")

    @property
    def old(self) -> Path:
        return self._beside("prepare-old")

    def _beside(self, what: str) -> Path:
        return self.path.parent / f".{self.path.name}.{what}"


def at(out: Path) -> Out:
    """The names of out=`out`; refused in one line when DIR cannot be renamed as a whole (the
    root, the working directory or one above it)."""
    path = Path(os.path.expanduser(out)).resolve()
    if path.parent == path or Path.cwd().resolve().is_relative_to(path):
        raise ConfigError(f"out={out} is the working directory or holds it: nljax.prepare replaces DIR by renaming "
                          "it, give a directory beside or below")
    return Out(Path(out), path)


def strangers(directory: Path, ours: Callable[[str], bool]) -> list[str]:
    """The names in `directory` that `ours` does not recognise, sorted."""
    return sorted(p.name for p in directory.iterdir() if not ours(p.name))


def on_another_file_system(o: Out) -> bool:
    """Whether DIR is a mount point: renaming it, or a directory beside it onto it, cannot work."""
    return o.path.is_dir() and os.stat(o.path).st_dev != os.stat(o.path.parent).st_dev


@contextlib.contextmanager
def locked(o: Out) -> Iterator[None]:
    """Hold .DIR.prepare.lock while the body runs (released by the kernel whatever ends this
    process); another prepare into DIR is refused in one line. The file is removed at the end,
    so one found removed or replaced after it was locked is not the lock: taken again."""
    # a parent that is a file, or that cannot be written (permissions, a read-only file system):
    # one line and exit 2 before anything is tokenized, as train's run.dir
    writable.refuse_unwritable(f"out={o.given}", o.path, beside=True)
    try:
        o.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {o.given.parent}: {e.strerror or e}") from None
    while True:
        f = open(o.lock, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise ConfigError(f"another nljax.prepare is writing into {o.given} (it holds {o.lock}); "
                              "wait for it, or give another out=") from None
        try:
            held = os.stat(o.lock)
        except FileNotFoundError:  # removed by the prepare that held it until now
            held = None
        mine = os.fstat(f.fileno())
        if held is not None and (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino):
            break
        f.close()
    try:
        yield
    finally:
        o.lock.unlink(missing_ok=True)  # before the lock goes: a prepare waiting sees a new file
        f.close()


def recover(o: Out, ours: Callable[[str], bool], manifest: str) -> str:
    """Undo or finish a replacement of DIR that stopped between its renames (see the module's
    docstring); the line that says which, or '' when there was none. `ours`: whether a name in
    a prepared directory is one a prepare writes; `manifest`: the name that makes it complete."""
    if not os.path.lexists(o.old):
        return ""
    if o.old.is_symlink() or not o.old.is_dir():
        raise ConfigError(f"{o.old} is not a directory nljax.prepare set aside: move it away, then run again")
    if foreign := strangers(o.old, ours):
        raise ConfigError(f"{o.old} holds files that are not nljax prepared data ({few(foreign)}): "
                          "move them away, then run again")
    if os.path.lexists(o.path):  # stopped after the new data went in place: the previous are not needed
        if not (o.path / manifest).is_file() or strangers(o.path, ours):  # not what a prepare put there
            raise ConfigError(f"{o.old} holds the data {o.given} held before an overwrite that stopped part-way, "
                              f"and {o.given} is not the prepared data that replaced them: move one of them away, "
                              "then run again")
        shutil.rmtree(o.old)
        return (f"removed {o.old}, the data {o.given} held before an overwrite that stopped once the new data "
                "were in place")
    os.rename(o.old, o.path)
    _sync(o.path.parent)
    return f"an overwrite of {o.given} stopped part-way: the previous data are back in place (from {o.old})"


def replace(o: Out, new: Path, stage: Callable[[str], None] = lambda point: None) -> None:
    """Put the finished directory `new` (in the work directory) at DIR: the previous DIR set
    aside, `new` renamed in, the previous one removed. `stage(point)` at each step: the tests'
    stand-in for a kill there ("built", "aside", "replaced")."""
    stage("built")
    if not os.path.lexists(o.path):
        os.rename(new, o.path)
        _sync(o.path.parent)
        return
    os.rename(o.path, o.old)
    try:
        stage("aside")
        os.rename(new, o.path)
    except BaseException:  # a failed rename, a Ctrl-C: the previous data go back (a kill: the next run)
        with contextlib.suppress(OSError):
            os.rename(o.old, o.path)
        raise
    _sync(o.path.parent)
    stage("replaced")
    shutil.rmtree(o.old)


def aside(path: Path) -> Path | None:
    """Where the previous data of `path` are while an overwrite of it stopped between its
    renames left it absent (the reader's hint), or None."""
    try:
        o = at(path)
    except ConfigError:
        return None
    return o.old if o.old.is_dir() and not os.path.lexists(o.path) else None


def sync(paths: Collection[Path]) -> None:
    """fsync these files, then the directory of the first: their bytes and names on disk before
    they replace anything (a power cut then leaves the previous or these, never empty files)."""
    for p in paths:
        _sync(p)
    if paths:
        _sync(next(iter(paths)).parent)


def _sync(path: Path) -> None:
    """fsync a file, or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
