"""`train.sample_every`: a short text sample from the training state, for the terminal and the trackers.

The sample is `nljax.generate`'s windowed decoding (the memory carried from window to window)
with its default sampling settings and the run's seed, continuing `train.sample_prompt` by
`train.sample_tokens` tokens: what `nljax.generate prompt=... max_new_tokens=... seed=...` writes
from that step's parameters. So it ends, as generate does by default, at the document-end token
(not shown; the line printed says so): what would follow is another document, read from a reset
memory, not a continuation of the prompt, and drawing it would spend training time on text the
prompt did not ask for.

Every process runs it: the parameters are gathered over the data axes (under fsdp; under tensor
parallelism they stay split over `model`) and the forward runs on the whole mesh, so the
processes' device programs stay in lockstep; the logits are replicated, so each samples the same
tokens from its own copy (and stops at the same one), and only process 0 prints them. The forward
is compiled once, at the first sample. Text models only: a DiT's samples are the
`samples_<step>.png` of its evaluations (the config refuses the key for it).
"""

from __future__ import annotations

import json

from nljax.run.core import Run
from nljax.run.sampling import Settings, TextSampler, ending_of, prompt_ids, tokenization_of
from nljax.run.stopping import pieces


def sample_line(step: int, text: str, why: str) -> str:
    """The console line of a sample after step `step` (0-based, as the progress lines count),
    `why` as `TrainingSampler.sample` gives it: a sample that stopped at the document end says so,
    so that a short one is not taken for one cut off (the trackers get the text alone)."""
    ended = "  (ended at the document end)" if why == "eos" else ""
    return f"step {step:6d}  sample: {json.dumps(text, ensure_ascii=False)}{ended}"


class TrainingSampler:
    def __init__(self, run: Run):
        t = run.cfg.train
        self.run = run
        self.settings = Settings(prompt=t.sample_prompt, max_new_tokens=t.sample_tokens, seed=run.cfg.seed)
        self._sampler: TextSampler | None = None
        self.codec = tokenization_of(run.cfg)  # bytes, or the tokenizer of the run's files
        self.prompt = prompt_ids(self.codec, t.sample_prompt, "train.sample_prompt")

    def sample(self, stored_params) -> tuple[str, str]:
        """(the prompt and the text sampled after it, why the text ended: "eos" or "length"), from
        the parameters as the strategy stores them."""
        eng = self.run.engine
        params = eng.strategy.gather_params(stored_params)
        if self._sampler is None:
            self._sampler = TextSampler(eng.model, params, self.run.mesh, self.run.cfg.train.seq_len, self.codec.end_id,
                                        vocab=self.run.cfg.model.vocab_size)
        self._sampler.params = params  # the same compiled forward, this step's parameters
        end = ending_of(self.codec, self.prompt, self.settings)  # generate's: the end token ends it
        text = "".join(pieces(self._sampler.tokens(self.prompt, self.settings), end))
        return self.settings.prompt + text, end.reason
