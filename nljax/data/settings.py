"""Config section `data`: the text corpora of the text task (data/text.py, data/recall.py).

The recall layout's sizes also bound model and train settings (the gap against the attention's
reach, a document against train.seq_len): those rules sit with the other cross-section rules in
`nljax.config.check_across_sections`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from nljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # stdlib: the standard library's modules (data/text.py); recall: synthetic associative-recall
    # documents, the long-context probe (data/recall.py)
    corpus: Literal["stdlib", "recall"] = "stdlib"
    eval_fraction: float = 0.05  # every round(1/eval_fraction)-th document is held out
    # probability that a training row starts a step from a fresh memory, drawn from (seed, step,
    # row): the model also learns to predict without carried context, as at a document start
    reset_prob: float = 0.25  # measured: README, "Does the memory help?"
    recall_docs: int = 4096  # recall: documents generated (training + held out), each train.seq_len bytes
    recall_pairs: int = 4  # recall: key=value pairs shown, then queried, per document
    recall_key_len: int = 2  # recall: lowercase letters per key (keys are distinct)
    recall_value_len: int = 2  # recall: digits per value; every value digit is scored
    # recall: filler bytes between the last pair and the first query; at least the attention's
    # reach model.depth * (model.nl_lm.window - 1), so only the memory can carry a value to its query
    recall_gap: int = 128
    # recall: the training loss's targets. values: the queried value bytes only (the protocol of
    # multi-query associative recall, MQAR: the random keys, values and filler are unpredictable,
    # and their loss's gradient noise drowns the recall signal, README "The recall probe");
    # all: every byte, as a language model
    recall_loss: Literal["values", "all"] = "values"

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader
    RANGES: ClassVar[dict] = {"reset_prob": (0, 1, True, True)}

    def check(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be between 0 and 1 (exclusive), got {self.eval_fraction}")
        if self.corpus == "recall":
            self._check_recall()

    def _check_recall(self) -> None:
        if self.recall_docs < 2 or self.recall_pairs < 1:
            raise ConfigError(f"data.recall_docs must be >= 2 and data.recall_pairs >= 1, got {self.recall_docs}, "
                              f"{self.recall_pairs}")
        if not 1 <= self.recall_key_len <= 8 or not 1 <= self.recall_value_len <= 64:
            raise ConfigError(f"data.recall_key_len must be in [1, 8] and data.recall_value_len in [1, 64], got "
                              f"{self.recall_key_len}, {self.recall_value_len}")
        if self.recall_pairs > 26**self.recall_key_len:
            raise ConfigError(f"data.recall_pairs={self.recall_pairs} distinct keys of data.recall_key_len="
                              f"{self.recall_key_len} letters: at most {26**self.recall_key_len}")
