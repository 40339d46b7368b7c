"""The work directory of `python -m nljax.prepare` (.DIR.prepare-work beside DIR: data/outdir.py):
the token and document-start files as they are written, and the record of the chunks done, so
that a prepare interrupted (Ctrl-C, a kill, a full disk) resumes where it stopped, with the same
files at the end as a prepare never interrupted.

    part.train.bin, part.eval.bin         token ids, appended chunk by chunk
    part.train.starts, part.eval.starts   int64: each document's first token, appended alike
    progress.json                         the job it belongs to, the chunks done, the position
                                          in the input after them, and per split the counts and
                                          the sha256 of each file up to there
    prepared/                             once every chunk is done: the new prepared directory
                                          (the token files moved into it), until it replaces DIR;
                                          progress.json then says only that it is finished

progress.json is replaced (written aside, renamed) after each chunk, once the part files are on
disk (fsync). On resume the job must be the same (the data.* settings, the source files' paths,
sizes and modification times, the tokenizer, the dtype), the part files are cut back to the
recorded lengths (a chunk written after the last record is written again) and hashed: a prefix
whose sha256 differs from the record is not trusted, and the prepare starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from nljax.errors import ConfigError, few

PROGRESS = "progress.json"
STATE_KEYS = ("tokens", "documents", "bytes", "max_token", "sha256", "docs_sha256")


class Sink:
    """One split's tokens and document starts, appended to two binary files (or memory) as they
    come, each hashed as written: the manifest's record of the split without reading it back."""

    def __init__(self, f, starts_f, dtype: np.dtype):
        self.f, self.starts_f, self.dtype = f, starts_f, dtype
        self.sha, self.starts_sha = hashlib.sha256(), hashlib.sha256()
        self.tokens = self.documents = self.bytes = 0
        self.max = -1

    def add(self, ids: np.ndarray, lengths: np.ndarray, nbytes: np.ndarray) -> None:
        """Documents back to back: ids [N], token counts [D] (each > 0), UTF-8 bytes + 1 [D]."""
        if not len(lengths):
            return
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths[:-1])]).astype("<i8")
        raw, starts_raw = ids.astype(self.dtype, copy=False).tobytes(), starts.tobytes()
        _write(self.f, raw)
        self.sha.update(raw)
        _write(self.starts_f, starts_raw)
        self.starts_sha.update(starts_raw)
        self.tokens += len(ids)
        self.documents += len(lengths)
        self.bytes += int(nbytes.sum())
        self.max = max(self.max, int(ids.max()))

    def state(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes, "max_token": self.max,
                "sha256": self.sha.hexdigest(), "docs_sha256": self.starts_sha.hexdigest()}

    def record(self, name: str) -> dict:
        """The split's entry of manifest.json."""
        return {"file": f"{name}.bin", "docs_file": f"{name}.docs.npy", **self.state()}

    def resume(self, state: dict) -> bool:
        """Cut the files back to `state`'s lengths and hash them: whether they are what it
        recorded (then this sink goes on from there)."""
        for f, size in ((self.f, state["tokens"] * self.dtype.itemsize), (self.starts_f, state["documents"] * 8)):
            if os.fstat(f.fileno()).st_size < size:
                return False
            f.truncate(size)
            f.seek(size)
        self.sha, self.starts_sha = _hash(self.f), _hash(self.starts_f)
        self.tokens, self.documents, self.bytes, self.max = (state[k] for k in STATE_KEYS[:4])
        return self.state() == {k: state[k] for k in STATE_KEYS}


def _write(f, raw: bytes) -> None:
    """`f.write(raw)`; a failure (a full disk) names the file: the OS's error from `write` carries
    no file name, and the user's line said only that a write failed."""
    try:
        f.write(raw)
    except OSError as e:
        name = getattr(f, "name", None)  # a BytesIO (a preparation held in memory) has none
        if e.filename is not None or not isinstance(name, (str, os.PathLike)):
            raise
        raise OSError(e.errno, e.strerror, os.fspath(name)) from None


def _hash(f) -> "hashlib._Hash":
    sha = hashlib.sha256()
    with open(f.name, "rb") as again:
        while block := again.read(1 << 24):
            sha.update(block)
    return sha


class WorkDir:
    """The part files and progress record of one prepare job in `path`."""

    def __init__(self, path: Path, job: dict, dtype: np.dtype, splits: tuple[str, ...]):
        self.path, self.dtype, self.splits = path, dtype, splits
        self.job = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()
        self.files: list = []
        self.done = path / "prepared"  # the finished directory, made from the part files (data/prepared.py)

    def check(self) -> None:
        """Refused in one line, before anything in it is read or removed: a work directory that is
        not one (a file, a symbolic link: a traceback, or "Cannot call rmtree on a symbolic link",
        exit 1), or one holding names a prepare does not write (a user's file, removed with it)."""
        if not os.path.lexists(self.path):
            return
        if self.path.is_symlink() or not self.path.is_dir():
            what = "a symbolic link, not" if self.path.is_symlink() else "not"
            raise ConfigError(f"{self.path} is {what} a directory nljax.prepare works in: move it away, then run again")
        ours = {PROGRESS, f".{PROGRESS}.tmp", self.done.name,
                *(f"part.{s}.{kind}" for s in self.splits for kind in ("bin", "starts"))}
        if foreign := sorted(set(os.listdir(self.path)) - ours):
            raise ConfigError(f"{self.path} holds files that nljax.prepare does not write there "
                              f"({few(foreign)}): move them away, "
                              "then run again")

    def finished(self, this_job: bool = True) -> bool:
        """Whether the work recorded here (of this job, or of any) ended in its finished
        directory, `done` (`finish`); that directory may have replaced DIR since."""
        saved = self._saved() if this_job else self._recorded()
        return bool(saved and saved.get("finished"))

    def open(self) -> tuple[dict, dict | None, str]:
        """(the sinks, the progress to go on from or None, a line saying what was found)."""
        saved, note = self._saved(), ""
        if self.path.exists() and saved is None:
            # no record at all: stopped (a full disk, a kill) before its first chunk was recorded
            why = "of other data or settings" if self._recorded() else "that had recorded no chunk"
            note = f"{self.path}: an interrupted prepare {why}, started over"
            shutil.rmtree(self.path)
        self.path.mkdir(exist_ok=True)
        mode = "r+b" if saved else "wb"
        sinks = {}
        for s in self.splits:
            for name in (f"part.{s}.bin", f"part.{s}.starts"):
                (self.path / name).touch()
                self.files.append(open(self.path / name, mode))
            sinks[s] = Sink(self.files[-2], self.files[-1], self.dtype)
        if saved and not all(sinks[s].resume(saved["splits"][s]) for s in self.splits):
            self.close()
            shutil.rmtree(self.path)
            sinks, _, _ = self.open()
            return sinks, None, f"{self.path}: an interrupted prepare whose files differ from its record, started over"
        if saved:
            note = (f"resuming an interrupted prepare: {saved['chunks']:,} chunks done, "
                    f"{sum(saved['splits'][s]['tokens'] for s in self.splits):,} tokens (verified)")
        return sinks, saved, note

    def _saved(self) -> dict | None:
        saved = self._recorded()
        return saved if saved and saved.get("job") == self.job else None

    def _recorded(self) -> dict | None:
        try:
            saved = json.loads((self.path / PROGRESS).read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else None

    def record(self, sinks: dict, chunks: int, position: tuple, seen: int) -> None:
        """The chunks done so far, once their bytes are on disk."""
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
        progress = {"job": self.job, "chunks": chunks, "position": list(position), "seen": seen,
                    "splits": {s: sinks[s].state() for s in self.splits}}
        self._write(progress)

    def finish(self) -> None:
        """Record that `done` is complete (on disk): the part files are in it, no chunk is left."""
        self._write({"job": self.job, "finished": True})

    def _write(self, progress: dict) -> None:
        temp = self.path / f".{PROGRESS}.tmp"
        with open(temp, "w") as f:  # on disk before the rename: a power cut leaves the old record or this one
            f.write(json.dumps(progress))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path / PROGRESS)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []

    def starts_to_npy(self, split: str, dest: Path) -> None:
        """The document starts as the .npy file a run loads, copied through the page cache."""
        part = self.path / f"part.{split}.starts"
        n = part.stat().st_size // 8
        starts = np.memmap(part, dtype="<i8", mode="r", shape=(n,)) if n else np.zeros(0, "<i8")
        with open(dest, "wb") as f:
            np.save(f, starts)

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
