"""The start-up lockstep check of a built run: every process agrees on the config, the software
versions, the mesh and the data before the first step (nljax/runtime/distributed.py's `agree`)."""

from __future__ import annotations

from typing import Callable

import jax

from nljax.config import Config, to_dict
from nljax.run.tasks import Task
from nljax.runtime.distributed import agree, mesh_layout, mesh_record, versions


def data_fingerprint(task: Task) -> str:
    """A task's own fingerprint of its data (`task.fingerprint()`), else its class name."""
    fp = getattr(task, "fingerprint", None)
    return fp() if callable(fp) else type(task).__name__


def eval_set_digests(task: Task) -> dict[str, str]:
    """The content digest of each data.eval_sets set of a task (`EvalSet.digest`), by name: {}
    for a task without sets. Each process tokenizes its own copy of the files, so they are
    compared at start-up, as the data's fingerprint is, and saved with every checkpoint."""
    return {s.name: s.digest for s in getattr(task, "eval_sets", ())}


def tokenizer_identity(task: Task) -> dict | None:
    """What a text task's token ids are (`nljax.data.tokenization.identity`), saved with every
    checkpoint; None for a task without text or one of a user's that does not say."""
    ident = getattr(task, "tokenizer_identity", None)
    return ident if isinstance(ident, dict) else None


def check_startup(cfg: Config, mesh: jax.sharding.Mesh, task: Task, say: Callable[[str], None]) -> None:
    """Start-up lockstep check of a built run: config, versions, mesh, data (the data.eval_sets
    sets' content too: a set's files edited on one host would be scored otherwise there)."""
    if jax.process_count() == 1:
        return
    record = {"config": to_dict(cfg), "versions": versions(), "mesh": mesh_record(mesh),
              "data": data_fingerprint(task), "data.eval_sets": eval_set_digests(task)}
    d = agree("start-up state (config, versions, mesh, data)", record)
    layout = ", ".join(f"{k} {v}" for k, v in mesh_layout(mesh).items())
    say(f"lockstep: {jax.process_count()} processes agree on config, versions, mesh and data "
        f"(sha256 {d[:12]}); mesh axes: {layout}")
