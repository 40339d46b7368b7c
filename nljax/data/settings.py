"""Config sections `data`: the text corpora of the text task (data/text.py, data/recall.py, and
the user's own files: data/documents.py, data/prepared.py); and `prepare`: how nljax.prepare
tokenizes them (data/chunks.py).

The recall layout's sizes also bound model and train settings (the gap against the attention's
reach, a document against train.seq_len): those rules sit with the other cross-section rules in
`nljax.config.check_across_sections`. What the files hold (documents, tokens, the vocabulary) is
checked when they are read, before the model is built (`nljax.data.prepared`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar, Literal

from nljax.errors import ConfigError

# What data.train and data.eval read, in the messages that name them all (one list: a message
# that named only .txt/.jsonl sent users of Parquet away)
TEXT_FORMATS = (".txt, .jsonl, .txt.gz, .jsonl.gz, .parquet, .arrow or .feather files, or folders datasets' "
                "save_to_disk wrote")

# the keys that describe the user's own files: read only with data.source=files
FILE_KEYS = ("train", "eval", "tokenizer", "prepared", "doc_end_token")
# a data.eval_sets name: it ends metric names (eval_loss/<name>), which trackers take as they are
# (TensorBoard tags allow letters, digits, _ . - /; a / would nest the name, a space is not allowed)
EVAL_SET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def eval_sets(entries: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, glob) of each `name=glob` of data.eval_sets, in order; one line for an entry
    without `=`, a name that is empty, not a simple identifier or given twice, an empty glob."""
    out: list[tuple[str, str]] = []
    for entry in entries:
        name, eq, pattern = entry.partition("=")
        if not eq:
            raise ConfigError(f"data.eval_sets: '{entry}' must be name=glob (e.g. wiki=data/wiki/*.jsonl)")
        if not name:
            raise ConfigError(f"data.eval_sets: '{entry}' has an empty name (name=glob, e.g. wiki=data/wiki/*.jsonl)")
        if not EVAL_SET_NAME.fullmatch(name):
            raise ConfigError(f"data.eval_sets: '{name}' is not a simple name (letters, digits and _, not starting "
                              "with a digit): it ends the metric names, eval_loss/<name>")
        if not pattern:
            raise ConfigError(f"data.eval_sets: '{entry}' names no files (name=glob, e.g. wiki=data/wiki/*.jsonl)")
        if name in (n for n, _ in out):
            raise ConfigError(f"data.eval_sets names the set '{name}' twice")
        out.append((name, pattern))
    return out


EVAL_FRACTION = 0.05  # data.eval_fraction's default (a data.prepared directory's split is its own)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # stdlib: the standard library's modules (data/text.py); recall: synthetic associative-recall
    # documents, the long-context probe (data/recall.py); files: the user's own text (data.train).
    # Text models' data: an images model (dit) reads images.* (refused with recall or files)
    source: Literal["stdlib", "recall", "files"] = "stdlib"
    # every round(1/eval_fraction)-th document is held out (files: without data.eval)
    eval_fraction: float = EVAL_FRACTION
    # files: paths or globs of .txt (one document per file) and .jsonl (one per line, its
    # data.text_key field) files, each optionally .gz; .parquet and .arrow files (one document per
    # row: pip install 'nljax[parquet]'); folders datasets' save_to_disk wrote. A string: a list of one
    train: tuple[str, ...] = ()
    # files: the held-out documents; empty: split from data.train by document. Alone (no data.train):
    # held-out text only, which nljax.evaluate scores a checkpoint on (a training run refuses it)
    eval: tuple[str, ...] = ()
    # named held-out sets, each `name=glob`: [wiki=data/wiki/*.jsonl,code=src/*.txt] (a name:
    # letters, digits, _; the glob: files as data.eval reads them, or a directory nljax.prepare
    # wrote, whose held-out split is the set), tokenized once at start-up as
    # the run's text is, scored at every evaluation as the main held-out text is and logged as
    # eval_loss/<name>, eval_bpb/<name>, ... (docs/guides/evaluation.md). Any text data.source. Each
    # set's content digest is compared across processes at start-up and warned of on resume when it changed;
    # a set the checkpoint scored that is left out on resume is warned of too (its curve stops there)
    eval_sets: tuple[str, ...] = ()
    text_key: str = "text"  # files: the field of a .jsonl line, the column of a Parquet or Arrow file, that holds the text
    # files: a Hugging Face `tokenizers` tokenizer.json (pip install 'nljax[text]'); empty: bytes.
    # model.vocab_size left at 256 takes the tokenizer's size
    tokenizer: str = ""
    # files with a tokenizer: a token of its vocabulary appended after every document (e.g.
    # "<|endoftext|>"); empty: none. Bytes always end a document with NUL, as the stdlib corpus
    doc_end_token: str = ""
    # files: a directory `python -m nljax.prepare` wrote (memory-mapped tokens + manifest.json);
    # empty: the files of data.train are read and tokenized into memory at start
    prepared: str = ""
    # probability that a training row starts a step from a fresh memory, drawn from (seed, step,
    # row): the model also learns to predict without carried context, as at a document start
    reset_prob: float = 0.25  # (measured: docs/experiments/2026-11-23-memory-block-ablations.md)
    # recall: documents generated (training + held out), each train.seq_len bytes; at most 1,000,000
    recall_docs: int = 4096
    recall_pairs: int = 4  # recall: key=value pairs shown, then queried, per document
    recall_key_len: int = 2  # recall: lowercase letters per key (keys are distinct)
    recall_value_len: int = 2  # recall: digits per value; every value digit is scored
    # recall: filler bytes between the last pair and the first query; at least the attention's
    # reach model.depth * (model.nl_lm.window - 1), so only the memory can carry a value to its query
    recall_gap: int = 128
    # recall: the training loss's targets. values: the queried value bytes only (the protocol of
    # multi-query associative recall, MQAR: the random keys, values and filler are unpredictable,
    # and their loss's gradient noise drowns the recall signal, docs/experiments/2026-11-27-recall-probe.md);
    # all: every byte, as a language model
    recall_loss: Literal["values", "all"] = "values"

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader
    RANGES: ClassVar[dict] = {"reset_prob": (0, 1, True, True)}

    @property
    def held_out_only(self) -> bool:
        """data.eval alone (no data.train, no data.prepared): held-out text only, which
        nljax.evaluate scores (`nljax.data.prepared.held_out`) and a training run refuses."""
        return self.source == "files" and bool(self.eval) and not self.train and not self.prepared

    def check(self) -> None:
        # one document in a billion: 1/x stays a number; at most every 2nd document (above 2/3,
        # round(1/x) is 1, and every 2nd was held out without a word: 0.99 held out half)
        if not 1e-9 <= self.eval_fraction <= 0.5:
            raise ConfigError(f"data.eval_fraction must be in [1e-9, 0.5] (every round(1/x)-th document is held "
                              f"out), got {self.eval_fraction}")
        eval_sets(self.eval_sets)
        if self.source == "recall":
            self._check_recall()
        if self.source == "files":
            self._check_files()
        else:  # a path given for another source would be ignored without a word
            given = [k for k in FILE_KEYS if getattr(self, k)]
            if given:
                raise ConfigError(f"data.{given[0]} is read only with data.source=files (data.source={self.source})")

    def _check_files(self) -> None:
        if not self.train and not self.prepared and not self.eval:
            raise ConfigError(f"data.source=files needs data.train (paths or globs of {TEXT_FORMATS}) or "
                              "data.prepared (a directory nljax.prepare wrote)")
        if self.eval and self.prepared and not self.train:  # the directory holds its own held-out split
            raise ConfigError("data.eval with data.prepared needs data.train (or give data.prepared alone)")
        if self.doc_end_token and not self.tokenizer and not self.prepared:
            raise ConfigError("data.doc_end_token needs data.tokenizer (bytes end every document with NUL)")
        if not self.text_key:
            raise ConfigError("data.text_key must not be empty")

    def _check_recall(self) -> None:
        if self.recall_docs < 2 or self.recall_pairs < 1:
            raise ConfigError(f"data.recall_docs must be >= 2 and data.recall_pairs >= 1, got {self.recall_docs}, "
                              f"{self.recall_pairs}")
        if self.recall_docs > MAX_RECALL_DOCS:  # made one by one at start-up: 10^13 never finished
            raise ConfigError(f"data.recall_docs must be <= {MAX_RECALL_DOCS:,}, got {self.recall_docs:,}")
        if not 1 <= self.recall_key_len <= 8 or not 1 <= self.recall_value_len <= 64:
            raise ConfigError(f"data.recall_key_len must be in [1, 8] and data.recall_value_len in [1, 64], got "
                              f"{self.recall_key_len}, {self.recall_value_len}")
        if self.recall_pairs > 26**self.recall_key_len:
            raise ConfigError(f"data.recall_pairs={self.recall_pairs} distinct keys of data.recall_key_len="
                              f"{self.recall_key_len} letters: at most {26**self.recall_key_len}")


# data.recall_docs: the documents are generated in Python at start-up, about 0.25 ms each (4 minutes
# per million on a 2026 CPU core), and held in memory with a float32 score per byte
MAX_RECALL_DOCS = 1_000_000


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Config section `prepare`: how `python -m nljax.prepare` works (data/prepared.py,
    data/chunks.py); what it prepares is the `data` section. No setting here changes the files
    it writes."""

    workers: int = 0  # processes that tokenize with a tokenizer.json (bytes: one); 0: all cores
    # bytes of text (UTF-8) per chunk, the unit of work and of resume (a chunk ends at the
    # document that reaches it); memory holds about 2 x workers + 1 chunks of text and tokens
    # (docs/guides/own-text-data.md)
    chunk_bytes: int = 8 << 20

    def check(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"prepare.workers must be >= 0 (0: all cores), got {self.workers}")
        if self.chunk_bytes < 1:
            raise ConfigError(f"prepare.chunk_bytes must be >= 1, got {self.chunk_bytes}")
