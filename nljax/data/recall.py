"""A synthetic associative-recall corpus: the long-context probe (`data.source=recall`).

Every document is exactly `doc_len` bytes (= `train.seq_len`, so that each held-out window of
the streaming evaluation is one whole document) and reads

    ab=48;qf=09;...        K pairs: distinct keys of `key_len` lowercase letters, values of
                           `value_len` digits (here 2 and 2)
    QWE RTYU ...           `gap` filler bytes (uppercase letters and spaces)
    qf?09;ab?48;...        every key queried once, in a random order
    ASD ...                filler up to the end, then the NUL separator

The gap is at least the attention's reach, model.depth x (model.nl_lm.window - 1) tokens (stacked
sliding windows see that far back), so a query's value can only come from what the inner-loop
memory wrote while it read the pairs. The filler alphabet shares no byte with keys, values or
the `=?;` markers, so nothing in it can be mistaken for a pair.

Generated with numpy from the seed alone (no download): the same seed gives the same bytes.
"""

from __future__ import annotations

import functools
import string

import numpy as np

from nljax.data.text import SEPARATOR

KEY_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), np.uint8)
VALUE_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)
FILLER = np.frombuffer((string.ascii_uppercase + " ").encode(), np.uint8)
CHANCE = 1.0 / len(VALUE_DIGITS)  # accuracy of guessing a value byte uniformly


def attention_reach(depth: int, window: int) -> int:
    """How many tokens back stacked causal sliding-window attention can see."""
    return depth * (window - 1)


def pair_len(key_len: int, value_len: int) -> int:
    """Bytes of one `key=value;` (and of one `key?value;`)."""
    return key_len + 1 + value_len + 1


def _keys(rng: np.random.Generator, k: int, key_len: int) -> list[bytes]:
    keys: list[bytes] = []
    while len(keys) < k:
        key = KEY_LETTERS[rng.integers(0, 26, size=key_len)].tobytes()
        if key not in keys:
            keys.append(key)
    return keys


def document(rng: np.random.Generator, doc_len: int, pairs: int, gap: int, reach: int, key_len: int,
             value_len: int) -> tuple[bytes, np.ndarray]:
    """One document and its score mask: float32 [doc_len], 1 at the value bytes of queries whose
    pair ends more than `reach` tokens before the position that predicts the byte."""
    keys = _keys(rng, pairs, key_len)
    values = [VALUE_DIGITS[rng.integers(0, 10, size=value_len)].tobytes() for _ in keys]
    filler = lambda n: FILLER[rng.integers(0, len(FILLER), size=n)].tobytes()
    doc = bytearray()
    pair_end = {}  # key -> position of its pair's `;`
    for key, value in zip(keys, values):
        doc += key + b"=" + value + b";"
        pair_end[key] = len(doc) - 1
    doc += filler(gap)
    score = np.zeros(doc_len, np.float32)
    for i in rng.permutation(pairs):
        doc += keys[i] + b"?"
        for j in range(value_len):
            # byte at len(doc) is predicted from position len(doc) - 1
            score[len(doc)] = float(len(doc) - 1 - pair_end[keys[i]] > reach)
            doc.append(values[i][j])
        doc += b";"
    if len(doc) >= doc_len:
        raise ValueError(f"a recall document needs {len(doc) + 1} bytes, more than {doc_len}")
    doc += filler(doc_len - 1 - len(doc)) + bytes([SEPARATOR])
    return bytes(doc), score


@functools.lru_cache(maxsize=4)
def recall_corpus(docs: int, doc_len: int, pairs: int, gap: int, reach: int, eval_fraction: float,
                  seed: int, key_len: int, value_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train bytes uint8 [N], train score float32 [N], held-out bytes uint8 [M], held-out score
    float32 [M]); every round(1 / eval_fraction)-th document is held out, as for the stdlib corpus."""
    rng = np.random.default_rng([seed, 0x7265_6361])  # a stream of its own, not the model's
    every = round(1 / eval_fraction)
    train, train_score, held, held_score = [], [], [], []
    for i in range(docs):
        doc, s = document(rng, doc_len, pairs, gap, reach, key_len, value_len)
        docs_to, scores_to = (held, held_score) if i % every == every - 1 else (train, train_score)
        docs_to.append(doc)
        scores_to.append(s)
    as_bytes = lambda parts: np.frombuffer(b"".join(parts), np.uint8)
    return as_bytes(train), np.concatenate(train_score), as_bytes(held), np.concatenate(held_score)
