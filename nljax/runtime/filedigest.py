"""The sha256 of each file of a directory written as several files (an `nljax.export`), recorded
in the file written last (its config.json) and checked when the directory is read: a file changed
since (a flipped byte, an edited safetensors header) or a mix of two writes (an export whose
last rename failed: new weights beside the old config.json) is refused in one line instead of
being loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nljax.errors import ConfigError


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def record(files: dict[str, Path]) -> dict[str, str]:
    """name -> sha256 of each of `files` (name -> where it is now: a temporary name)."""
    return {name: sha256_of(path) for name, path in files.items()}


def check(directory: Path, recorded, what: str) -> None:
    """Each file `recorded` (name -> sha256) in `directory` has that sha256. Nothing recorded (a
    directory written before checksums were): nothing to check."""
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise ConfigError(f"{what} {directory}: its sha256 record is not a mapping of file names (edited?)")
    for name, digest in recorded.items():
        path = directory / str(name)
        try:
            ok = Path(name).name == name and sha256_of(path) == digest
        except OSError as e:
            raise ConfigError(f"{what} {directory}: {name} cannot be read ({e.strerror or e})") from None
        if not ok:
            raise ConfigError(f"{path} is not the file that was written with {what} (its sha256 differs from the "
                              "recorded one: changed since, or the write was cut short): write it again")


def seal(record: dict) -> str:
    """The digest of `record` (a JSON object) less its own "digest" key: kept in it as "digest",
    so that an edit to the record itself (a setting of an export's config.json) is caught too."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_seal(path: Path, record: dict) -> None:
    """`record` (read from `path`) is as sealed, when it was (an older one carries no digest, and
    no sha256 record either: the two came together, so one without the other was edited)."""
    if "digest" not in record and "sha256" in record:
        raise ConfigError(f"{path} has its files' sha256 record but not the digest sealing it (edited?): "
                          "write it again")
    if "digest" in record and record["digest"] != seal(record):
        raise ConfigError(f"{path} was changed since it was written (its digest does not match its content): "
                          "write it again")
