"""Sampling from a trained model: the library behind `python -m nljax.generate` (nljax/generate.py).

Language models read the stream the way training read it: in windows of `train.seq_len` tokens,
attention inside a window, the neural memory carried from window to window (written by every
full window; reset at the start, and after a window that holds a document's end token, as
training resets a row's memory). The prompt's full windows are written into the memory first;
then each new token is predicted from the memory of the windows before it and the tokens of its
own window so far (the model is causal, so what pads the window after them changes nothing), and
once a window is full it is written into the memory in turn. Tokens are
bytes, or with data.source=files the tokens of the run's tokenizer (nljax/data/tokenization.py);
the text streams to the terminal as it is sampled.

Sampling is on the host in float64 from the logits (temperature, then top-k, then top-p), with a
numpy generator seeded by `seed`: the same checkpoint and seed give the same tokens on any device
count (the parameters are replicated, so every device computes the same logits).

Many prompts (`prompts=FILE`, `completions`) are decoded together, `batch_size` rows at a time, by
the lm-evaluation-harness's reader (nljax/run/scoring.py: `StreamReader.generate`): each row reads
its own stream exactly as above (its own windows, its own memory, written only when its own
window is full, its own resets), so a prompt's left end needs no padding. Each completion draws
from its own generator, keyed by (seed, the prompt's index, the sample's index) (`seeded`): a
prompt's completions do not depend on the other prompts, and prompt 0's sample 0 is the text
`prompt=` gives with the same seed.

A completion ends at the document-end token (`stop_at_eos`, on by default), before the first of
the `stop` strings in its text, or after `max_new_tokens` (nljax/run/stopping.py): the tokens
before its end are drawn as without them, and in a batch a row that has ended is not extended.

A MeanFlow run (model.name=dit) writes a PNG grid instead: one-step and multi-step
(`meanflow.sample_steps`) samples side by side, for the labels of held-out images spread over
them, or for the classes `labels=` names (2-D toy data: scatter plots over the held-out points).

Any other `key=value` is a config override on top of the run's own config.yaml.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nljax.data import prepared
from nljax.errors import ConfigError
from nljax.models.registry import checked_logits
from nljax.parallel.hostdev import put, replica
from nljax.run import trained as trained_lib
from nljax.run.stopping import Completion, Ending, ending, pieces
from nljax.runtime import resultfile


MAX_NEW_TOKENS = 65_536  # as train.sample_tokens
# in each record prompts= writes: an existing out= holding them is an earlier result, replaced
# ("finish_reason" and "new_tokens", written since, are not asked for: a result written before
# them is one too)
RESULT_KEYS = frozenset({"prompt", "completion", "index", "sample"})


@dataclasses.dataclass(frozen=True)
class Settings:
    prompt: str = ""
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1: all
    seed: int = 0
    stop_at_eos: bool = True  # a completion ends at the document-end token (nljax/run/stopping.py)
    stop: tuple[str, ...] = ()  # a completion ends before the first of these in its text
    prompts: str = ""  # a .txt (a prompt a line) or .jsonl file (nljax/run/prompts.py); the results go to out=
    samples_per_prompt: int = 1  # prompts=: completions of each prompt
    batch_size: int = 8  # prompts=: completions decoded together (rounded up to a multiple of the devices)
    checkpoint: str = "latest"  # or a step number, a step directory, or a checkpoints directory
    # under optim.ema_decay: average (the parameters' moving average) or trained (the optimizer's
    # own); empty: the average where the run keeps one (nljax.run.trained.PARAMS)
    params: str = ""
    samples: int = 16  # DiT: images in the grid
    # DiT: the grid's classes, one sample each (numbers or a folder's class names, comma-separated
    # or a JSON list); empty: the labels of `samples` held-out images
    labels: str = ""
    out: str = ""  # DiT: the PNG written (default: <run.dir>/generated.png); prompts=: the results (.jsonl)

    def check(self) -> "Settings":
        # from Python (`TrainedModel.generate`) a value of another type: one line, not the TypeError
        # of a comparison below ("'<' not supported between instances of 'str' and 'int'")
        for key, kind in (("max_new_tokens", numbers.Integral), ("top_k", numbers.Integral), ("seed", numbers.Integral),
                          ("samples_per_prompt", numbers.Integral), ("batch_size", numbers.Integral),
                          ("temperature", numbers.Real), ("top_p", numbers.Real)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is numbers.Integral else "a number"
                raise ConfigError(f"{key} must be {what}, got {type(value).__name__} {value!r:.60}")
        if self.max_new_tokens > MAX_NEW_TOKENS:  # token by token on the host: a huge count never ends
            raise ConfigError(f"max_new_tokens must be <= {MAX_NEW_TOKENS:,}, got {self.max_new_tokens:,}")
        # each its own line with its value: one naming all four left the user to match them up
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be finite and >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in 0 < top_p <= 1, got {self.top_p}")
        if not 0 <= self.seed < 2**63:  # NumPy's generator alone reads it (no JAX key)
            raise ConfigError(f"seed must be in [0, 2^63), got {self.seed}")
        if not isinstance(self.stop_at_eos, bool):  # "false" would be true
            raise ConfigError(f"stop_at_eos must be true or false, got {self.stop_at_eos!r}")
        if isinstance(self.stop, (str, list)):  # one string, or a list (Python's lm.generate(stop=...))
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            return dataclasses.replace(self, stop=stop).check()
        if not isinstance(self.stop, tuple):
            raise ConfigError(f"stop must be a str or a list of str, got {type(self.stop).__name__} {self.stop!r:.60}")
        for i, stop in enumerate(self.stop):
            check_stop(stop, f"stop[{i}]" if len(self.stop) > 1 else "stop")
        if self.samples < 1:
            raise ConfigError(f"samples must be >= 1, got {self.samples}")
        label_items(self.labels)  # its form; the classes are the run's, checked on load
        trained_lib.reads_average(self.params, None)  # the value; what the run keeps is checked on load
        if self.samples_per_prompt < 1:
            raise ConfigError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        try:  # bytes that are not UTF-8 reach Python's argv as lone surrogates
            self.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"prompt= is not UTF-8 text (at character {e.start})") from None
        if self.prompts:  # the results file: checked before anything slow runs
            if not self.out:
                raise ConfigError("prompts= needs out=FILE.jsonl: the file the completions are written to")
            resultfile.check(Path(self.out), f"out={self.out}", "nljax.generate", RESULT_KEYS, lines=True)
            return self
        if self.out and Path(self.out).suffix.lower() == ".jsonl":
            raise ConfigError(f"out={self.out}: JSON lines are the results of prompts=FILE, which is not given (a "
                              "language model's); a MeanFlow (model.name=dit) run's out= is its image grid, a .png file")
        if self.out and Path(self.out).is_dir():
            raise ConfigError(f"out={self.out} is a directory: give the PNG file to write")
        if self.out and Path(self.out).suffix.lower() != ".png":  # never over a file of another kind
            # the model is not known yet: a language model's user (out=text.txt) learns where text goes too
            raise ConfigError(f"out={self.out}: the image grid is a PNG, give a file name ending in .png (a language "
                              "model's out= is the results of prompts=FILE, a .jsonl file; the text of prompt= goes "
                              "to the terminal)")
        if self.out and not Path(self.out).parent.is_dir():
            raise ConfigError(f"out={self.out}: directory {Path(self.out).parent} does not exist")
        if self.out and (where := resultfile.unwritable(Path(self.out).absolute().parent)):
            # else said after the checkpoint was read and the samples drawn
            raise ConfigError(f"out={self.out}: {where} is not writable")
        return self


def parse(pairs: list[str]) -> tuple[Settings, list[str], str]:
    """(generation settings, config overrides, run directory) from `key=value` arguments."""
    cast = {"str": str, "int": int, "float": float, "bool": _bool, "tuple[str, ...]": stops_of}
    known = {f.name: cast[f.type] for f in dataclasses.fields(Settings)}
    given = [pair.partition("=")[0] for pair in pairs]
    if given.count("stop") > 1:  # the last would win in silence
        raise ConfigError("stop= is given more than once: give the stop strings in one JSON list, "
                          "stop='[\"A\", \"B\"]'")
    values, overrides, run_dir = trained_lib.split_args(pairs, known)
    return Settings(**values).check(), overrides, run_dir


def _bool(value: str) -> bool:
    if value not in ("true", "false"):  # as prepare's overwrite=
        raise ConfigError(f"stop_at_eos={value!r}: give true or false")
    return value == "true"


def stops_of(value: str) -> tuple[str, ...]:
    """`stop=`'s strings: a JSON list of strings (`stop='["\\n\\n", "def "]'`: JSON's escapes, a
    line's end among them), or else one string as it stands (`stop=###`)."""
    if not value.startswith("["):
        return (value,)
    try:
        stops = json.loads(value)
    except ValueError as e:
        text = json.dumps([value])  # the list that stops at the text as written
        raise ConfigError(f"stop={value}: a value that begins with [ is a JSON list of strings, and this is not "
                          f"JSON ({e}); to stop at the text itself, give it in a list: stop='{text}'") from None
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise ConfigError(f"stop={value}: give a JSON list of strings, as stop='[\"\\n\\n\", \"def \"]'")
    return tuple(stops)


def check_stop(stop, named: str) -> None:
    """One stop string: text, not empty (it would end every completion before its first character)."""
    if not isinstance(stop, str):
        raise ConfigError(f"{named} must be a str, got {type(stop).__name__} {stop!r:.60}")
    if not stop:
        raise ConfigError(f"{named} is empty: a stop string ends a completion where it appears, and an empty one "
                          "appears before the first character")
    try:  # bytes that are not UTF-8 reach Python's argv as lone surrogates
        stop.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{named} is not UTF-8 text (at character {e.start})") from None


def label_items(value: str) -> list[int | str]:
    """`labels=`'s classes, one sample each: comma-separated (`labels=3,3,7`, `labels=cat,dog`), or
    a JSON list (`labels='["a, b", 2]'`: a class name holding a comma). A name in digits stays a
    str: a folder's class `10` is read by name first (`grid_labels`)."""
    if not value:
        return []
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"labels={value}: a value that begins with [ is a JSON list of classes, and this is not "
                              f"JSON ({e})") from None
        if not isinstance(items, list) or not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in items):
            raise ConfigError(f"labels={value}: give a JSON list of class numbers or names, as labels='[3, 7]'")
    else:
        items = [x.strip() for x in value.split(",")]
    if not items or any(x == "" for x in items):
        raise ConfigError(f"labels={value}: an empty class; give classes separated by commas, as labels=3,3,7")
    return items


def grid_labels(value: str, names, classes: int) -> np.ndarray:
    """`labels=` as class ids of a model of `classes` classes named `names` (a folder's, in label
    order; or none): a class name first, else a number (`images.label_ids`). Checked before the
    checkpoint is read: a class the run lacks is one line before anything is restored."""
    from nljax.data import images

    if not classes:  # the model reads no label: the grid would name classes it never drew
        raise ConfigError("labels=: the model reads no labels (its images have none): its samples have no class; "
                          "samples=N draws N")
    names = tuple(names or ())
    # a number as int() reads it: -1 said as out of range, not as an unknown name; '²' (isdigit, not
    # a number to int()) an unknown name, not a ValueError's traceback
    items = [int(x) if isinstance(x, str) and x not in names and re.fullmatch(r"[+-]?\d+", x) else x
             for x in label_items(value)]
    return images.label_ids(items, names, classes)


def seeded(seed: int, index: int = 0, sample: int = 0) -> np.random.Generator:
    """The generator of prompt `index`'s completion `sample` under `seed`: keyed by these three
    alone, so that a prompt's completions do not depend on the other prompts of a file, their
    number or their order around it. The key is four 32-bit words (seed's low and high halves,
    index, sample); NumPy's SeedSequence reads a key shorter than its pool of four words as if
    padded with zeros, so (seed, 0, 0) draws what `np.random.default_rng(seed)` draws: the single
    prompt's generator, as it always was."""
    return np.random.default_rng([seed & 0xFFFF_FFFF, seed >> 32, index, sample])


def sample_token(logits: np.ndarray, rng: np.random.Generator, s: Settings) -> int:
    """One token from logits [V]: temperature, then top-k, then top-p (nucleus)."""
    logits = np.asarray(logits, np.float64)
    if s.temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):  # <= 0: a tiny temperature gives -inf (not inf - inf = NaN)
        z = (logits - logits.max()) / s.temperature
    if s.top_k:  # exactly k: ties at the k-th place (common in bfloat16 logits) go to the lower ids
        z[np.argsort(-z, kind="stable")[s.top_k :]] = -np.inf
    p = np.exp(z)
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # probability of the tokens ranked above each
        p[order[before >= s.top_p]] = 0.0
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


class TextSampler:
    """Windowed decoding of a trained language model (module docstring). `params`: the model's
    parameter tree, whole over the data axes of `mesh` (split over `model` under tensor
    parallelism: XLA partitions the global model's forward to match); a sampler that is kept
    (`nljax.run.samples`) may be given new ones, and its compiled forward serves them. `vocab`:
    the run's model.vocab_size, which the model's logits must cover (`checked_logits`)."""

    def __init__(self, model, params, mesh, seq_len: int, end_id: int | None, *, vocab: int):
        self.params, self.t, self.end_id = params, seq_len, end_id
        self.rep = NamedSharding(mesh, P())
        # Inputs made from host arrays (`put`) and outputs replicated, each process reading its
        # own copy (`replica`): the sampler also runs on a mesh that spans processes (training).
        self.memory0 = jax.tree.map(lambda x: put(np.asarray(x), self.rep), model.init_memory(1))
        self._forward = jax.jit(lambda params, memory, tokens, reset, at: _row(checked_logits(
            model, params, memory, {"tokens": tokens, "reset": reset}, vocab=vocab), at), out_shardings=self.rep)

    def forward(self, memory, window: list[int], fresh: bool):
        """The logits [V] after `window`'s last token (`window`: <= T tokens, padded), on the
        devices, and the memory after the window. Only that row is kept: the window's [T, V]
        logits read back for every token cost T times the copy (a 2048-token window and a vocabulary
        of 50k: 400 MB a token)."""
        tokens = np.zeros((1, self.t + 1), np.int32)  # the model reads T inputs (the last is a target)
        tokens[0, : len(window)] = window
        reset, at = np.array([fresh]), np.array(len(window) - 1, np.int32)
        return self._forward(self.params, memory, put(tokens, self.rep), put(reset, self.rep), put(at, self.rep))

    def tokens(self, prompt: list[int], s: Settings, rng: np.random.Generator | None = None) -> Iterator[int]:
        """The sampled tokens after `prompt`, one at a time, drawn by `rng` (default: `seed`'s,
        which is np.random.default_rng(seed); `seeded(seed, i, j)`: prompts= prompt i's sample j)."""
        rng = seeded(s.seed) if rng is None else rng
        memory, fresh, window = self.memory0, True, list(prompt)  # at least one token: `prompt_ids`
        for _ in range(s.max_new_tokens):
            while len(window) > self.t:  # full windows go into the memory, as in training
                full, window = window[: self.t], window[self.t :]
                _, memory = self.forward(memory, full, fresh)
                # as in training (ContextStream): a window that holds a document's end resets the
                # memory before the next one
                fresh = self.end_id is not None and self.end_id in full
            logits, _ = self.forward(memory, window, fresh)
            token = sample_token(replica(logits), rng, s)
            window.append(token)
            yield token


def _row(out: tuple, at: jax.Array) -> tuple:
    """(logits [1, T, V], memory) -> (the logits at position `at` [V], memory)."""
    logits, memory = out
    return jax.lax.dynamic_index_in_dim(logits[0], at, keepdims=False), memory


def generate_text(t: trained_lib.Trained, s: Settings, write: Callable[[str], None]) -> list[int]:
    """Sample from a language model, writing the text as it comes; returns the new tokens."""
    if not hasattr(t.model, "logits"):
        raise ConfigError(f"model.name={t.cfg.model.name} has no logits(): it cannot generate text")
    codec = tokenization_of(t.cfg)
    sampler = TextSampler(t.model, t.params, t.run.mesh, t.cfg.train.seq_len, codec.end_id,
                          vocab=t.cfg.model.vocab_size)
    return write_text(sampler, codec, s, write)


def write_text(sampler: TextSampler, codec, s: Settings, write: Callable[[str], None]) -> list[int]:
    """The prompt, then the text `sampler` samples after it, written as it comes (`codec`: the
    tokenization, bytes or a tokenizer) until it ends (`s.stop_at_eos`, `s.stop`:
    nljax/run/stopping.py); returns the new tokens (an end token that stopped it among them). A
    run's sampler and an export's (`nljax.load(...).sampler()`) write alike."""
    out: list[int] = []

    prompt = prompt_ids(codec, s.prompt)

    def sampled() -> Iterator[int]:
        for token in sampler.tokens(prompt, s):
            out.append(token)
            yield token

    write(s.prompt)
    for text in pieces(sampled(), ending_of(codec, prompt, s)):  # read after the prompt, as sampled
        write(text)
    return out


def ending_of(codec, prompt: list[int], s: Settings) -> Ending:
    """Where the completion after `prompt` (its ids) ends under `s` (nljax/run/stopping.py)."""
    return ending(codec, prompt, s.stop, s.stop_at_eos)


def completions(reader, codec, prompts: Sequence[list[int]], s: Settings,
                done: Callable[[int, int, int], None] = lambda n, total, tokens: None,
                ) -> Iterator[tuple[int, int, Completion]]:
    """(prompt index, sample index, completion) of `s.samples_per_prompt` completions of each of
    `prompts` (token ids, from `prompt_ids`), in that order: a `stopping.Completion`, the text
    sampled after the prompt as `write_text` writes it after the prompt, why it ended ("stop",
    "eos" or "length": nljax/run/stopping.py) and the tokens drawn for it. `reader`: a
    `StreamReader` (nljax/run/scoring.py) whose `rows` completions are decoded together, in the
    file's order; a row that has ended is not extended, and a batch ends when all of its rows
    have; `done(completions so far, all of them, tokens so far)` after each such batch."""
    jobs = [(i, j) for i in range(len(prompts)) for j in range(s.samples_per_prompt)]
    tokens = 0
    for start in range(0, len(jobs), reader.rows):
        batch = jobs[start : start + reader.rows]
        rngs = [seeded(s.seed, i, j) for i, j in batch]  # each its own: no draw depends on another row
        ends = [ending_of(codec, prompts[i], s) for i, _ in batch]  # each row's own text and stops
        new = reader.generate([prompts[i] for i, _ in batch], s.max_new_tokens,
                              lambda logits, b: sample_token(logits, rngs[b], s), lambda b, toks: ends[b].feed(toks),
                              lead_end_resets=True)  # an empty prompt's end token resets, as `tokens` reads it
        for (i, j), ids, end in zip(batch, new, ends):
            yield i, j, end.finish(ids)
        tokens += sum(map(len, new))
        done(start + len(batch), len(jobs), tokens)


def prompt_ids(codec, prompt: str, what: str = "prompt", where: str = "") -> list[int]:
    """The prompt's tokens; an empty prompt starts a document: the token that ends one (bytes:
    NUL). A tokenizer without `data.doc_end_token` has no such token: it needs a prompt. A
    character the tokenizer has no token for is refused (`what`: the setting, in the line;
    `where`: what begins the line, "prompts=FILE line N: " for a file's prompt)."""
    lost = codec.lost(prompt)
    if lost:  # dropped by the encoding: the text would continue another prompt, or a document start
        raise ConfigError(f"{where}{what} {prompt!r}: this run's tokenizer has no token for {lost!r} (the model would "
                          f"not see it): {codec.path}")
    ids = codec.encode(prompt)
    if not ids and codec.end_id is None:
        raise ConfigError(f"{where}an empty prompt starts a document after data.doc_end_token, which this run's "
                          "tokenizer has none of: give a prompt")
    return ids or [codec.end_id]


def tokenization_of(cfg):
    """How the run's text became tokens: bytes, or the tokenizer of its files (data.source=files)."""
    return prepared.tokenization_of(cfg.data)


def generate_images(t: trained_lib.Trained, s: Settings, path: Path, label: np.ndarray | None = None) -> None:
    """A MeanFlow run's one-step and multi-step samples side by side, as a PNG at `path`: for the
    classes `label` (`grid_labels`), or for `s.samples` held-out images."""
    from nljax.measure.figures import write_samples

    task, data = t.run.task, t.run.task.data
    if label is not None:  # the classes asked for, sample i's noise keyed by i (as Python's generate(labels=))
        index, reference = np.arange(len(label)), data.eval_x  # 2-D toy data: over every held-out point
    else:  # the held-out images drawn for: spread over them, as an evaluation's
        index = task.chosen(min(s.samples, len(data.eval_x)))
        label, reference = data.eval_y[index], data.eval_x[index]
    one, multi = task.draw(t.run.engine, t.params, index, label)
    write_samples(path, one, multi, reference, t.cfg.meanflow.sample_steps, label if data.num_classes else None,
                  f"{t.cfg.run.dir}, step {t.step}", data.classes)
