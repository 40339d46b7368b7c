"""`data.eval_sets`: named held-out sets, scored at every evaluation beside the run's main
held-out text (nljax/run/tasks.py), as Levanter's trainer scores several evaluation datasets.

Each set is `name=glob`: files in any form data.eval reads (.txt, .jsonl, Parquet, Arrow,
save_to_disk folders: data/documents.py), every document held out, tokenized once at start-up by
the run's own tokenization (bytes, data.tokenizer, or data.prepared's copy: the ids the model was
trained on) into memory, as data.eval's files are. The source of the run's own text does not
matter: a run on the standard library or the recall probe reads its sets as bytes.

Problems are one line before anything is trained or scored: a glob that matches no file, a set
shorter than train.seq_len + 1 tokens (not one window), and whatever data.eval's reader refuses
(the file named); the names themselves are checked with the config (`settings.eval_sets`).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from nljax.data import documents, prepared
from nljax.data.settings import DataConfig, eval_sets
from nljax.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class EvalSet:
    name: str
    pattern: str  # the glob as given
    tokens: np.ndarray  # [N] token ids, documents back to back
    ends: np.ndarray  # int64 [D]: each document's last token
    tokens_per_byte: float  # bits per token x this = bits per byte
    files: int


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
        files = documents.expand([pattern], f"data.eval_sets {name}")
        stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        key = (name, pattern, d.text_key, info, stats)
        s = _CACHE.get(key)
        if s is None:
            split, rec = prepared.tokenized(d, files, tok)
            s = EvalSet(name, pattern, split.tokens, split.ends, rec["tokens"] / max(rec["bytes"], 1), len(files))
        if len(s.tokens) < seq_len + 1:  # not one window to score
            raise ConfigError(f"data.eval_sets {name}: {len(s.tokens)} tokens in {len(files)} file(s) ({pattern}), "
                              f"shorter than train.seq_len+1={seq_len + 1}: give more text")
        kept[key] = s
        out.append(s)
    _CACHE.clear()  # the sets of one run at a time
    _CACHE.update(kept)
    return out
