"""What an `nljax.export` directory holds, and how to tell one from a user's files: shared by
the exporter (nljax/export.py) and `run.overwrite=true` (nljax/runtime/rundir.py), which removes the
earlier run's `<run.dir>/export`. No JAX here: the run directory reads it before anything else."""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS, CONFIG = "model.safetensors", "config.json"
TOKENIZER = "tokenizer.json"  # a text model's tokenizer.json, when its run had one (nljax.load reads it)
DEFAULT = "export"  # out= by default: <run.dir>/export


def is_export(path: Path) -> bool:
    """Whether `path`'s config.json is one nljax.export wrote."""
    if not (path / CONFIG).is_file():  # a FIFO would block the read for ever
        return False
    try:
        info = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and {"config", "step", "dtype", "checkpoint"} <= info.keys()


def exported_from(path: Path) -> str | None:
    """The checkpoint the export in `path` was written from, as its config.json records it; None
    where it records none."""
    try:
        came = json.loads((path / CONFIG).read_text()).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return came if isinstance(came, str) and came else None


def not_a_checkpoint(given: str, path: Path) -> str:
    """The line refusing the export in `path`, given as `given` (`checkpoint.resume=DIR`), where a
    checkpoint is asked for: its parameters are there, but not a checkpoint."""
    came = exported_from(path)
    return (f"{given} is an export directory (nljax.export wrote it), not a checkpoint: give the checkpoint it was "
            f"exported from{f' ({came})' if came else ''}")


def remove(out: Path) -> None:
    """Removes the export in `out` (its files; the directory too if that leaves it empty).
    A directory holding anything else than an nljax export is left as it is."""
    if out.is_dir() and is_export(out):
        for n in (WEIGHTS, TOKENIZER, CONFIG):
            (out / n).unlink(missing_ok=True)
        if not any(out.iterdir()):
            out.rmdir()
