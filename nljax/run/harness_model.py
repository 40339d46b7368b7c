"""nljax's model for EleutherAI's lm-evaluation-harness (the `lm_eval` package, 0.4.x): the
`LM` that answers lm-eval's requests with a trained nljax language model. `python -m nljax.lm_eval`
(nljax/lm_eval.py) registers it as `--model nljax`, loaded from a run or export directory; the
trainer's `eval.harness_tasks` (nljax/run/harness.py) uses it on the parameters it is training.

The three request types are answered with `nljax.run.scoring.StreamReader`: each request is one
stream read as training reads a row (windows of `train.seq_len`, the neural memory carried from
window to window, never truncated); requests are batched, rows split over the devices, and the
scores are the same on any device count. Tokens come from the run's own tokenizer (bytes or its
tokenizer.json); a continuation's tokens are those of context + continuation after the
context's (lm-eval's `TemplateLM` split), and an empty context, like every rolling request,
starts with the run's document-end token (`end_id`: bytes 0), as lm-eval's models start with
theirs.

`generate_until` ends a text as lm-eval's Hugging Face model (HFLM) does: at the document-end
token, which is not part of it (HF's `generate` stops at `eos_token_id`), before the first of the
request's `until` strings and the end token's text (HFLM adds it to `until`: that text spelled
by other tokens ends it too), or after `max_gen_toks` tokens. The rule is nljax.generate's
(nljax/run/stopping.py: `Ending`, each token read once as it comes), which reads special tokens
as their text (a special token's text in `until`, `<|im_end|>`, ends an answer, as HFLM's
stopping criteria); the answer returned is then decoded as HFLM's `tok_decode` decodes one,
without special tokens (`skip_special_tokens=True`), and cut before the first `until` string
of that text (`_answer`).

This module imports lm_eval: nothing imports it at start-up (the trainer only for
`eval.harness_tasks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM

from nljax.errors import ConfigError
from nljax.run.sampling import Settings, sample_token
from nljax.run.scoring import StreamReader
from nljax.run.stopping import Completion, ending

NAME = "nljax"  # --model nljax
MAX_GEN_TOKS = 256  # generate_until's default max_gen_toks, as lm-eval's own models


@dataclasses.dataclass(frozen=True)
class Reading:
    """What an `NLJaxLM` reads with: the stream reader, the run's tokenizer and a name for lm-eval's records."""

    reader: StreamReader
    tokenizer: Any  # nljax.data.tokenization.Bytes or HFTokenizer
    name: str  # the run directory or export


class NLJaxLM(TemplateLM):
    """An nljax language model as lm-eval's `LM`: `loglikelihood` (lm-eval's `TemplateLM` splits
    context and continuation at the token boundary), `loglikelihood_rolling` and
    `generate_until`, read with `reading` (the command's model, built from --model_args, is
    nljax.lm_eval.FromRun)."""

    def __init__(self, reading: Reading, progress: bool = True):
        super().__init__()
        self.reading, self.progress = reading, progress  # progress: lm-eval's bar while tokenizing

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    @property
    def reader(self) -> StreamReader:
        return self.reading.reader

    @property
    def eot_token_id(self) -> int | None:
        return self.reading.tokenizer.end_id

    @property
    def prefix_token_id(self) -> int:
        """The token a stream with no context starts from: the run's document end."""
        if self.eot_token_id is None:
            raise ConfigError("this run's tokenizer has no document-end token (data.doc_end_token): a request with an "
                              "empty context and rolling loglikelihood (perplexity) need one to start from")
        return self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return f"{NAME}:{self.reading.name}"

    def get_model_info(self) -> dict:
        return {"nljax_model": self.reading.name, "seq_len": self.reader.t}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.reading.tokenizer.encode(string)

    def tok_decode(self, ids, context=()) -> str:
        # once per generated token (the stop check): one decoding, not one per token as the stream's
        return self.reading.tokenizer.decode([int(i) for i in ids], context=[int(i) for i in context])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation's tokens given the context's, whether each is
        the most likely one) for each ((context, continuation), context ids, continuation ids)."""
        streams = [list(ctx) + list(cont) for _, ctx, cont in requests]
        out = []
        for (pair, _, cont), scored in zip(requests, self._score(streams)):
            logp, hits = scored
            n = len(cont)
            answer = (float(logp[len(logp) - n :].sum()) if n else 0.0, bool(hits[len(hits) - n :].all()))
            out.append(answer)
            self.cache_hook.add_partial("loglikelihood", pair, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text after the document-end token, every token
        predicted once with all the text before it (the memory carries what the window cannot)."""
        texts = [req.args[0] for req in requests]
        streams = [[self.prefix_token_id, *self.tok_encode(text)] for text in texts]
        out = []
        for text, (logp, _) in zip(texts, self._score(streams)):
            out.append(float(logp.sum()))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
        return out

    def _score(self, streams: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        scored = self.reader.score([s for s in streams if len(s) > 1])
        it = iter(scored)
        empty = (np.zeros(0), np.zeros(0, bool))
        return [next(it) if len(s) > 1 else empty for s in streams]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The text after each context until the end token (not included), one of `until` (cut
        before it) or `max_gen_toks` tokens, without the tokenizer's special tokens, as lm-eval's
        Hugging Face model answers (module docstring); greedy unless `do_sample` (then
        `temperature`, `top_k`, `top_p` as nljax.generate, seeded by `seed` and the request's
        place)."""
        contexts = [req.args[0] for req in requests]
        kwargs = [dict(req.args[1]) if len(req.args) > 1 and req.args[1] else {} for req in requests]
        prompts = [self.tok_encode(c) or [self.prefix_token_id] for c in contexts]
        eot = self.tok_decode([self.eot_token_id]) if self.eot_token_id is not None else None
        # nljax.generate's rule (nljax/run/stopping.py), each request's own: the end token, its stop strings
        untils = [_until(k, eot) for k in kwargs]
        ends = [ending(self.reading.tokenizer, p, u, stop_at_eos=True) for p, u in zip(prompts, untils)]
        settings = [_settings(k) for k in kwargs]
        rngs = [np.random.default_rng([s.seed, i]) for i, s in enumerate(settings)]
        limits = [int(k.get("max_gen_toks", MAX_GEN_TOKS)) for k in kwargs]

        def pick(logits, i):
            return sample_token(logits, rngs[i], settings[i])

        def stop(i, tokens):  # each token is read once, as it comes
            return ends[i].feed(tokens[: limits[i]]) or len(tokens) >= limits[i]

        new = self.reader.generate(prompts, max(limits), pick, stop) if requests else []
        out = []
        for i, tokens in enumerate(new):
            out.append(self._answer(prompts[i], tokens, ends[i].finish(tokens[: limits[i]]), untils[i]))
            self.cache_hook.add_partial("generate_until", (contexts[i], kwargs[i]), out[-1])
        return out

    def _answer(self, prompt: list[int], tokens, done: Completion, until: list[str]) -> str:
        """The answer as HFLM returns it: the tokens the stop check took (`done`; the end token
        aside) decoded after the prompt without the tokenizer's special tokens (HFLM's
        `tok_decode`, skip_special_tokens=True), cut before the first of `until` in that text (its
        `postprocess_generated_text`). With no special token drawn that is `done`'s own text."""
        codec = self.reading.tokenizer
        drawn = [int(t) for t in tokens[: done.new_tokens - (done.finish_reason == "eos")]]
        if not codec.special_ids.intersection(drawn):
            return done.text
        text = codec.decode(drawn, context=prompt, skip_special=True)
        return text[: min((at for at in map(text.find, until) if at >= 0), default=len(text))]


def _until(kwargs: dict, eot: str | None) -> list[str]:
    """The stop strings of a request: its `until` (a string or a list) and the end token's text,
    as lm-eval's `handle_stop_sequences` gives its Hugging Face model (so the end token's text
    spelled by other tokens ends a text too); an empty one, which lm-eval skips, is left out."""
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    until = until + ([eot] if eot and eot not in until else [])
    return [s for s in until if s]


def _settings(kwargs: dict) -> Settings:
    """A request's sampling settings: greedy unless do_sample with a temperature above 0."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0) if kwargs.get("do_sample", False) else 0.0
    return Settings(temperature=temperature, top_k=int(kwargs.get("top_k", 0) or 0),
                    top_p=float(kwargs.get("top_p", 1.0) or 1.0), seed=int(kwargs.get("seed", 0) or 0)).check()


def results_of(results: dict) -> dict[str, float]:
    """The numbers of lm-eval's results as flat `harness_<task>_<metric>` keys (the filter name
    `none` left out, standard errors too)."""
    out = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or metric == "sample_len" or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(float(value)):  # a perplexity can overflow: JSON and trackers take finite numbers
                continue
            name = f"harness_{task}_{metric}" + ("" if filt in ("", "none") else f"_{filt}")
            out[name] = float(value)
    return out
