"""`train.sample_every`: a short text sample from the training state, for the terminal and the trackers.

The sample is `nljax.generate`'s windowed decoding (the memory carried from window to window)
with its default sampling settings and the run's seed, continuing `train.sample_prompt` by
`train.sample_tokens` tokens. Every process runs it: the parameters are gathered over the data
axes (under fsdp; under tensor parallelism they stay split over `model`) and the forward runs on
the whole mesh, so the processes' device programs stay in lockstep;
the logits are replicated, so each samples the same tokens from its own copy, and only process
0 prints them. The forward is compiled once, at the first sample. Text models only: a DiT's
samples are the `samples_<step>.png` of its evaluations (the config refuses the key for it).
"""

from __future__ import annotations

from nljax.run.core import Run
from nljax.run.sampling import Settings, TextSampler, prompt_ids, tokenization_of


class TrainingSampler:
    def __init__(self, run: Run):
        t = run.cfg.train
        self.run = run
        self.settings = Settings(prompt=t.sample_prompt, max_new_tokens=t.sample_tokens, seed=run.cfg.seed)
        self._sampler: TextSampler | None = None
        self.codec = tokenization_of(run.cfg)  # bytes, or the tokenizer of the run's files
        self.prompt = prompt_ids(self.codec, t.sample_prompt, "train.sample_prompt")

    def sample(self, stored_params) -> str:
        """The prompt and the text sampled after it, from the parameters as the strategy stores them."""
        eng = self.run.engine
        params = eng.strategy.gather_params(stored_params)
        if self._sampler is None:
            self._sampler = TextSampler(eng.model, params, self.run.mesh, self.run.cfg.train.seq_len, self.codec.end_id)
        self._sampler.params = params  # the same compiled forward, this step's parameters
        tokens = self._sampler.tokens(self.prompt, self.settings)
        return self.settings.prompt + "".join(self.codec.decode_stream(tokens, context=self.prompt))
