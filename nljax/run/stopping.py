"""Where a sampled completion ends (`nljax.generate`'s `stop_at_eos=` and `stop=`, `lm.generate`).

A completion ends at the first of these (its `reason`, the results' "finish_reason"):

- **eos**: the model samples the document-end token (bytes: NUL; a tokenizer: `data.doc_end_token`'s,
  none without it), as Hugging Face's `generate` stops at `eos_token_id`. The token is not part of
  the text. On by default; `stop_at_eos=false` samples past it (its text, NUL or the token's
  string, then part of the completion as before).
- **stop**: the completion's text so far holds one of the stop strings; the text is cut before
  the one that begins first, which is not part of it (as the `stop` of OpenAI's API and vLLM). A stop string
  is looked for in the decoded text, so one may span several tokens, or end inside one (what the
  token adds after it is dropped too).
- **length**: `max_new_tokens` tokens were sampled.

Text that may yet turn out to begin a stop string is held back from a stream until the next
token settles it (a stream of `"\\n\\n"`-stopped text shows a line's end one token late); the
stream's pieces joined are always the returned text. The tokens drawn before the end are those
a run without stops draws: a completion that meets none of them is the same text as before.

`Completion` is what ended (`lm.generate(..., details=True)`, `sampling.completions`): the text,
the reason and the tokens drawn, as OpenAI's API gives `finish_reason` and `completion_tokens`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: its `text` (without the prompt, the end token or a stop string),
    why it ended (`finish_reason`: "eos", "stop" or "length", the reasons above) and how many
    tokens were drawn for it (`new_tokens`: the end token that ended it counted, as are the
    tokens of a stop string; at most `max_new_tokens`)."""

    text: str
    finish_reason: str
    new_tokens: int


class Ending:
    """One completion's text as its tokens come (`push`), and why it ended (`reason`: None while
    it runs). `decoder`: the tokenization's (`decoder(context)`: `push(token)` and `end()`);
    `end_id`: the token that ends it (None: no such stop); `stops`: non-empty strings."""

    def __init__(self, decoder, stops: Sequence[str] = (), end_id: int | None = None):
        self._decoder, self.stops, self.end_id = decoder, tuple(stops), end_id
        self._longest = max(map(len, self.stops), default=0)
        self.reason: str | None = None
        self.pushed = 0  # the tokens taken so far
        self._given: list[str] = []  # the pieces `push` gave out
        # the text after them: held back while it may begin a stop string. No stop string can
        # begin in text given out (it would have been held), so only this is searched.
        self._pending = ""

    @property
    def text(self) -> str:
        """The completion's text so far (once ended: the whole of it, cut before a stop string)."""
        return "".join(self._given) + self._pending

    def push(self, token: int) -> str:
        """Take the next token; the text it lets out (none once the completion has ended)."""
        if self.reason is not None:
            return ""
        self.pushed += 1
        if token == self.end_id:  # the end token's own text is not part of the completion
            self.reason = "eos"
            return self._add(self._decoder.end(), last=True)
        return self._add(self._decoder.push(token))

    def feed(self, tokens: Sequence[int]) -> bool:
        """Take the tokens of `tokens` not taken yet (a row's tokens so far); whether it has ended."""
        for token in tokens[self.pushed:]:
            if self.reason is not None:
                break
            self.push(int(token))
        return self.reason is not None

    def end(self) -> str:
        """The token budget is spent: the text left (the decoder's rest, what was held back)."""
        if self.reason is not None:
            return ""
        self.reason = "length"
        return self._add(self._decoder.end(), last=True)

    def finish(self, tokens: Sequence[int]) -> Completion:
        """What ended, once a row's `tokens` are all drawn: those not taken yet fed (a batched
        reader asks its `stop` of no row's last token within the budget), then the budget's end
        where nothing ended it first."""
        self.feed(tokens)
        self.end()
        return self.completion()

    def completion(self) -> Completion:
        """What ended (`end` first, once the tokens are spent): its text, reason and tokens drawn."""
        if self.reason is None:
            raise ValueError("Ending.completion: the completion has not ended (call end() once its tokens are spent)")
        return Completion(self.text, self.reason, self.pushed)

    def _add(self, piece: str, last: bool = False) -> str:
        pending = self._pending + piece
        found = [at for at in (pending.find(s) for s in self.stops) if at >= 0]
        if found:  # the earliest stop string: the text ends before it
            pending, self.reason, last = pending[: min(found)], "stop", True
        keep = len(pending) if last else len(pending) - self._held(pending)
        out, self._pending = pending[:keep], pending[keep:]
        self._given.append(out)
        return out

    def _held(self, text: str) -> int:
        """How many characters at `text`'s end begin a stop string (held back from a stream)."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0


def ending(codec, context: Sequence[int], stops: Sequence[str], stop_at_eos: bool) -> Ending:
    """A completion's `Ending` after the prompt `context` (its ids) under `codec`, the tokenization."""
    return Ending(codec.decoder(context), stops, codec.end_id if stop_at_eos else None)


def pieces(tokens: Iterable[int], end: Ending) -> Iterator[str]:
    """The text of `tokens` as they come, until `end` says the completion has ended (the tokens
    after it are not drawn: `tokens` is left unread); then the rest of the text."""
    for token in tokens:
        yield end.push(token)
        if end.reason is not None:
            return
    yield end.end()
