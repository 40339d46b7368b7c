"""`data.eval_sets`: named held-out sets, scored at every evaluation beside the run's main
held-out text (nljax/run/tasks.py), as Levanter's trainer scores several evaluation datasets.

Each set is `name=glob`: files in any form data.eval reads (.txt, .jsonl, Parquet, Arrow,
save_to_disk folders: data/documents.py), every document held out, tokenized once at start-up by
the run's own tokenization (bytes, data.tokenizer, or data.prepared's copy: the ids the model was
trained on) into memory, as data.eval's files are; or a directory nljax.prepare wrote, whose
held-out split (memory-mapped) is the set, its token ids checked to be the run's. The source of
the run's own text does not matter: a run on the standard library or the recall probe reads its
sets as bytes.

Each set has a content digest (`EvalSet.digest`: its token ids, document ends, byte count and the
tokenization), as the run's data has (`Task.fingerprint`): the processes of a run compare it at
start-up (nljax/run/startup.py), checkpoints record it and a resume warns of a set that changed
(nljax/checkpoint/lifecycle.py), and summary.json reports it: scores of an edited set are not
comparable with its earlier ones.

Problems are one line before anything is trained or scored: a glob that matches no file, a set
shorter than train.seq_len + 1 tokens (not one window), and whatever data.eval's reader refuses
(the file named); the names themselves are checked with the config (`settings.eval_sets`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from nljax.data import documents, prepared, tokenization
from nljax.data.outdir import is_prepared
from nljax.data.settings import DataConfig, eval_sets
from nljax.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class EvalSet:
    name: str
    tokens: np.ndarray  # [N] token ids, documents back to back
    ends: np.ndarray  # int64 [D]: each document's last token
    tokens_per_byte: float  # bits per token x this = bits per byte
    digest: str  # sha256 of the content scored (`content_digest`), whatever the files' paths


# (set's glob, text key, tokenization, its files now) -> EvalSet: a run's local copy
# (`Run.local`, the throughput timing) reads the sets of its run without tokenizing them again
_CACHE: dict = {}


def load(d: DataConfig, seq_len: int) -> list[EvalSet]:
    """The sets of `d.eval_sets`, in their order, tokenized as the run's text (`d`'s)."""
    named = eval_sets(d.eval_sets)
    if not named:
        return []
    tok = prepared.tokenization_of(d)  # bytes for stdlib and recall
    info = json.dumps(tok.info(), sort_keys=True)
    out, kept = [], {}
    for name, pattern in named:
        folder = Path(os.path.expanduser(pattern))
        ready = folder.is_dir() and is_prepared(folder)  # nljax.prepare's output: its held-out split
        files = sorted(folder.iterdir()) if ready else documents.expand([pattern], f"data.eval_sets {name}")
        stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file())
        key = (name, pattern, d.text_key, info, stats)
        s = _CACHE.get(key)
        if s is None:
            split, rec = _prepared(name, folder, tok) if ready else prepared.tokenized(d, files, tok)
            s = EvalSet(name, split.tokens, split.ends, rec["tokens"] / max(rec["bytes"], 1),
                        content_digest(rec, tok.info()))
        if len(s.tokens) < seq_len + 1:  # not one window to score
            what = (f"in the held-out split of {pattern}, shorter than train.seq_len+1={seq_len + 1}: prepare it "
                    "with a larger data.eval_fraction" if ready else
                    f"in {len(files)} file(s) ({pattern}), shorter than train.seq_len+1={seq_len + 1}: give more text")
            raise ConfigError(f"data.eval_sets {name}: {len(s.tokens)} tokens {what}")
        kept[key] = s
        out.append(s)
    _CACHE.clear()  # the sets of one run at a time
    _CACHE.update(kept)
    return out


def _prepared(name: str, folder: Path, tok) -> tuple[prepared.Split, dict]:
    """The held-out split of the prepared directory `folder` (memory-mapped, checked as a run
    checks it; train.bin is not opened) and its record, whose token ids must be the run's."""
    try:
        c = prepared.load(folder, ("eval",))
    except ConfigError as e:  # its line names data.prepared=, which this set is not
        raise ConfigError(f"data.eval_sets {name}: {str(e).replace(f'data.prepared={folder}: ', f'{folder}: ')}") \
            from None
    theirs, mine = tokenization.identity(c.manifest["tokenizer"]), tokenization.identity(tok.info())
    if theirs != mine:
        raise ConfigError(f"data.eval_sets {name}: {folder} was prepared with {tokenization.describe(theirs)}, the "
                          f"run's text is {tokenization.describe(mine)}: its token ids would stand for other text")
    return c.eval, c.manifest["eval"]


def content_digest(rec: dict, tokenizer: dict) -> str:
    """The digest of what a set's scores depend on: its token ids and document starts (the sha256s
    the tokenization takes as it writes them, `prepared.tokenized`'s record), its bytes (bits per
    byte) and what the ids are (`tokenizer`, its `info()`: the ids' dtype follows its size)."""
    content = {k: rec[k] for k in ("sha256", "docs_sha256", "tokens", "bytes")}
    return hashlib.sha256(json.dumps({**content, "tokenizer": tokenizer}, sort_keys=True).encode()).hexdigest()
