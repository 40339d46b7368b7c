"""How the user's text becomes token ids, and ids text again: bytes (UTF-8, the default) or a
Hugging Face `tokenizers` tokenizer.json (the optional extra: pip install 'nljax[text]').

The tokenizer is read from its file, never downloaded; its sha256 goes into the manifest and the
content digest, so data tokenized another way never passes for the same data. Documents are
encoded without the tokenizer's own special tokens (a BERT-style post-processor would wrap every
document in [CLS] ... [SEP]); what ends a document is decided here: NUL for bytes, as in the
stdlib corpus, and `data.doc_end_token` (or nothing) with a tokenizer.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from nljax.errors import ConfigError, first_line

BYTE_END = 0  # NUL ends every document of the byte tokenization


def identity(info: dict) -> dict:
    """What makes token ids mean the same text, of a tokenization's `info()` (or a manifest's
    record of it): its kind and, for a tokenizer, its file's sha256. Checkpoints record it, so that
    a resume or a load with another tokenizer is refused rather than reading ids as other text."""
    return {k: info[k] for k in ("kind", "sha256") if k in info}


def describe(identity: dict) -> str:
    """An `identity` in words, for messages."""
    if identity.get("kind") == "bytes":
        return "byte tokens"
    return f"the tokenizer of sha256 {str(identity.get('sha256'))[:12]}"


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned little-endian integer that holds every id below `vocab_size`."""
    for dt in ("<u1", "<u2", "<u4"):
        if vocab_size - 1 <= np.iinfo(np.dtype(dt)).max:
            return np.dtype(dt)
    raise ConfigError(f"a vocabulary of {vocab_size} tokens does not fit in 32-bit token ids")


class Bytes:
    """UTF-8 bytes, one token each, and NUL after every document."""

    vocab_size = 256
    end_id: int | None = BYTE_END
    special_ids: frozenset[int] = frozenset()  # no byte is a special token

    def info(self) -> dict:
        return {"kind": "bytes", "vocab_size": self.vocab_size}

    def encode_flat(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the ids of all `texts` back to back [N] `dtype`, each one's token count [D], its UTF-8
        bytes + 1 [D]): a chunk of documents as the prepare pipeline writes it."""
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(r) + 1 for r in raw), np.int64, len(raw))
        ids = np.frombuffer(b"\0".join(raw) + b"\0", np.uint8) if raw else np.zeros(0, np.uint8)
        return ids.astype(dtype, copy=False), lengths, lengths.copy()

    def spec(self) -> tuple:
        """What a worker process needs to build the same tokenization (`from_spec`)."""
        return ("bytes",)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def lost(self, text: str) -> str:
        """The characters of `text` its tokens do not hold: none, every character is bytes."""
        return ""

    def decoder(self, context: Sequence[int] = ()) -> "ByteDecoder":
        """A decoder that is given the ids one at a time (`decode_stream` is its pieces)."""
        return ByteDecoder()

    def decode_stream(self, ids: Iterable[int], context: Sequence[int] = ()) -> Iterator[str]:
        """The text of `ids` as they come (a character once all of its bytes are there); a byte
        reads the same after any `context`."""
        decoder = self.decoder(context)
        for token in ids:
            yield decoder.push(token)
        yield decoder.end()

    def decode(self, ids: Iterable[int], context: Sequence[int] = (), skip_special: bool = False) -> str:
        """The text of `ids` after `context`, whole: `decode_stream`'s pieces joined (no byte is
        a special token: `skip_special` changes nothing)."""
        return "".join(self.decode_stream(ids, context))


class HFTokenizer:
    """A `tokenizers` tokenizer.json; `end_token` (optional) is appended after every document."""

    def __init__(self, path: str | Path, end_token: str = "", raw: bytes | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("data.tokenizer needs the `tokenizers` package: pip install 'nljax[text]'") from None
        path = Path(os.path.expanduser(path))
        try:  # `raw` given: the bytes read once by the parent process, so every worker has the same
            self.raw = path.read_bytes() if raw is None else raw
        except OSError as e:
            # a bare name that is no file (gpt2, meta-llama/...) is a Hub name, which Levanter's and
            # MaxText's tokenizer settings take: nljax reads a file and downloads nothing
            hub = "" if path.exists() or path.suffix == ".json" else (
                " (a tokenizer.json file, not a Hub name: nljax downloads nothing; the guide "
                "'Train on your own text', section Tokenizer, says how to get one)")
            if path.is_dir() and (path / "tokenizer.json").is_file():  # a model's folder, as downloaded from the Hub
                hub = f" (give the tokenizer.json in it: data.tokenizer={path / 'tokenizer.json'})"
            raise ConfigError(f"data.tokenizer: cannot read {path}: {e.strerror or e}{hub}") from None
        try:
            self.tok = Tokenizer.from_str(self.raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception types
            raise ConfigError(f"data.tokenizer: {path} is not a tokenizers tokenizer.json "
                              f"({first_line(e) or type(e).__name__})") from None
        self.path, self.end_token = path, end_token
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.end_id = self.tok.token_to_id(end_token) if end_token else None
        # the ids `decode(skip_special=True)` leaves out (the tokenizer.json's added tokens marked special)
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        if end_token and self.end_id is None:
            raise ConfigError(f"data.doc_end_token={end_token!r} is not a token of data.tokenizer {path}")

    def info(self) -> dict:
        return {"kind": "tokenizers", "vocab_size": self.vocab_size, "sha256": hashlib.sha256(self.raw).hexdigest(),
                "doc_end_token": self.end_token or None}

    def encode_flat(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As `Bytes.encode_flat`: the ids back to back, each document's token count, its bytes + 1."""
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        extra = 1 if self.end_id is not None else 0
        lengths = np.fromiter((len(e.ids) + extra for e in encodings), np.int64, len(encodings))
        ids = np.empty(int(lengths.sum()), np.int64)
        at = 0
        for e, n in zip(encodings, lengths.tolist()):
            ids[at:at + n - extra] = e.ids
            if extra:
                ids[at + n - 1] = self.end_id
            at += n
        if len(ids) and int(ids.max()) >= self.vocab_size:  # a tokenizer.json whose ids skip numbers
            raise ConfigError(f"data.tokenizer {self.path} gave token id {int(ids.max())}, not below its vocabulary "
                              f"size {self.vocab_size}")
        nbytes = np.fromiter((len(t.encode("utf-8")) + 1 for t in texts), np.int64, len(texts))
        return ids.astype(dtype), lengths, nbytes

    def spec(self) -> tuple:
        return ("tokenizers", str(self.path), self.end_token, self.raw)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def lost(self, text: str) -> str:
        """The characters of `text` that no token of its encoding holds (whitespace aside: a
        pre-tokenizer that splits on it drops it by design): a model without byte fallback drops a
        character its vocabulary lacks (BPE without an unknown token), or reads it as its unknown
        token (WordPiece's [UNK]). Offsets are characters of `text`, as normalized text maps back."""
        e = self.tok.encode(text, add_special_tokens=False)
        unk = getattr(self.tok.model, "unk_token", None)
        held = [False] * len(text)
        for token, (a, b) in zip(e.tokens, e.offsets):
            if unk is None or token != unk:
                held[a:b] = [True] * (b - a)
        return "".join(c for c, h in zip(text, held) if not h and not c.isspace())

    def decoder(self, context: Sequence[int] = ()) -> "TokenizerDecoder":
        """A decoder that is given the ids one at a time, after `context` (`decode_stream` is its
        pieces)."""
        return TokenizerDecoder(self.tok, context)

    def decode_stream(self, ids: Iterable[int], context: Sequence[int] = ()) -> Iterator[str]:
        """The text of `ids` as they come, after `context` (the prompt's ids: a decoder may read
        a token differently at the start, SentencePiece's dropping its leading space): the
        whole sequence is decoded again at every token (a token may change how the ones before
        it read) and what extends the text shown is written; the rest comes at the end (after
        the longest prefix already shown: what was written cannot be taken back)."""
        decoder = self.decoder(context)
        for token in ids:
            yield decoder.push(token)
        yield decoder.end()

    def decode(self, ids: Iterable[int], context: Sequence[int] = (), skip_special: bool = False) -> str:
        """The text of `ids` after `context`, whole, in two decodings (`decode_stream` decodes the
        sequence again at every token: joined, its pieces cost time quadratic in the tokens): what
        context + ids read, after what the context reads alone. The same text as the stream's
        pieces joined, but where a token changed how text already shown reads: then as it reads
        at the end. Special tokens read as their text, as the stream's do, unless `skip_special`
        (the `special_ids` left out of both decodings, as Hugging Face's skip_special_tokens=True:
        lm-eval's answers, nljax/run/harness_model.py)."""
        ctx = list(context)
        shown = self.tok.decode(ctx, skip_special_tokens=skip_special) if ctx else ""
        text = self.tok.decode(ctx + [int(i) for i in ids], skip_special_tokens=skip_special)
        return text[len(os.path.commonprefix([shown, text])):]


class ByteDecoder:
    """UTF-8 bytes given one at a time: a character once all of its bytes are there."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text `token` completes ("" inside a character)."""
        # a token past the byte values (a padded model.vocab_size) is no text
        return self._utf8.decode(bytes([token])) if token < 256 else "\ufffd"

    def end(self) -> str:
        """What is left: a character cut short reads as U+FFFD."""
        return self._utf8.decode(b"", final=True)


class TokenizerDecoder:
    """A tokenizer's ids given one at a time after `context` (`HFTokenizer.decode_stream`): the
    whole sequence decoded again at each, what extends the text shown so far given out."""

    def __init__(self, tok, context: Sequence[int] = ()):
        self.tok, self.seen = tok, list(context)
        self.shown = tok.decode(self.seen, skip_special_tokens=False) if self.seen else ""

    def push(self, token: int) -> str:
        """The text `token` adds ("" while the text so far does not extend what was shown)."""
        self.seen.append(token)
        text = self.tok.decode(self.seen, skip_special_tokens=False)
        if not text.startswith(self.shown) or text.endswith("\ufffd"):  # inside a character
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def end(self) -> str:
        """The rest: after the longest prefix already shown (what was given out stays)."""
        text = self.tok.decode(self.seen, skip_special_tokens=False)
        return text[len(os.path.commonprefix([self.shown, text])):]


def from_spec(spec: tuple) -> Bytes | HFTokenizer:
    """The tokenization `spec()` described, built again (in a worker process)."""
    return Bytes() if spec[0] == "bytes" else HFTokenizer(spec[1], spec[2], raw=spec[3])


def load(tokenizer: str, end_token: str = "") -> Bytes | HFTokenizer:
    """The tokenization `data.tokenizer` names: bytes when it is empty."""
    return HFTokenizer(tokenizer, end_token) if tokenizer else Bytes()
