"""A trained model for use from Python: `nljax.load(path)`.

    import nljax

    lm = nljax.load("runs/default")                  # a run directory, or an export directory
    print(lm.generate("def ", max_new_tokens=100, temperature=0.8, top_k=40, seed=0))
    c = lm.generate("def ", stop="\\n\\n", details=True)  # nljax.Completion: text, finish_reason, new_tokens
    ids = lm.encode("def f(x):")                     # the run's own tokenizer: bytes or tokenizer.json
    logits, memory = lm.logits([ids])                # [1, T, V] and the neural memory after them

`path` is either a run directory that `python -m nljax.train` wrote (its newest intact
checkpoint, or the one `checkpoint=` names, is restored onto one device) or an export directory
that `python -m nljax.export` wrote (model.safetensors, config.json; no checkpoint machinery).

The model reads a stream in windows of `train.seq_len` tokens with a per-row inner-loop memory
(the neural memory M and its momentum S) carried from window to window. `reset` is that memory's
per-row reset flag: `reset[b]` True makes row b start its window from the model's fresh memory
(as training does at a row's start and after a document's end), False continues from the memory
passed in. `generate` does all of this itself, exactly as `python -m nljax.generate` does
(nljax/run/sampling.py: the same windows, memory resets and sampling rules).

Everything here imports JAX on call: `import nljax` stays light.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from nljax.config import Config
from nljax.data import images
from nljax.errors import ConfigError, few
from nljax.models.registry import checked_logits
from nljax.parallel.mesh import replicated
from nljax.runtime.exportdir import is_export


@dataclasses.dataclass(eq=False)
class TrainedModel:
    """A trained model, its parameters on one device, and its run's tokenizer."""

    model: Any  # the nljax model (nljax/models/base.py: init, init_memory, logits or generate)
    params: Any  # its parameter tree
    config: Config  # the run's config as it trained
    step: int  # optimizer steps the parameters had taken
    source: Path  # the checkpoint's step directory, or the export directory
    tokenizer: Any = None  # text models: nljax.data.tokenization.Bytes or HFTokenizer; else None
    _mesh: Any = dataclasses.field(default=None, repr=False)  # one device: where generation runs
    _sampler: Any = dataclasses.field(default=None, repr=False)
    _readers: dict = dataclasses.field(default_factory=dict, repr=False)  # rows -> StreamReader
    _forward: Any = dataclasses.field(default=None, repr=False)
    _draws: dict = dataclasses.field(default_factory=dict, repr=False)  # an image model's seed -> its jitted generate
    _memory_shapes: dict = dataclasses.field(default_factory=dict, repr=False)  # rows -> init_memory's shapes

    def __repr__(self) -> str:
        """One line of what a user wants at a glance (the dataclass's own repr printed every
        parameter array, then the whole config: thousands of lines)."""
        leaves = jax.tree.leaves(self.params)
        dtypes = "/".join(sorted({str(np.dtype(x.dtype)) for x in leaves}))
        kind = f"text, seq_len {self.seq_len}, {_tokenizer_name(self.tokenizer)}" if self.makes_text else "images"
        return (f"<nljax.TrainedModel {self.config.model.name} ({kind}): {sum(int(np.size(x)) for x in leaves):,} "
                f"parameters ({dtypes}), step {self.step}, from {self.source}>")

    @property
    def makes_text(self) -> bool:
        """Whether the model is a language model (its registered task is text and it has `logits`)."""
        from nljax.models import registry

        return registry.task_of(self.config) == "text" and hasattr(self.model, "logits")

    @property
    def seq_len(self) -> int:
        """Tokens per window (`train.seq_len`): the window `logits` reads and `generate` slides."""
        return self.config.train.seq_len

    def _needs_logits(self, what: str) -> None:
        """A text model registered without `logits` (optional in nljax.Model) is refused as one,
        not as the image model `makes_text` alone would call it. The registered task decides (a
        model need not carry a `task` attribute)."""
        from nljax.models import registry

        if registry.task_of(self.config) == "text" and not hasattr(self.model, "logits"):
            raise ConfigError(f"{what} needs the model's logits(); model.name={self.config.model.name} has none "
                              "(nljax.Model: logits(params, memory, batch, key) -> (logits, new_memory))")

    def _text_only(self, what: str) -> None:
        self._needs_logits(what)
        if not self.makes_text:
            raise ConfigError(f"{what} is for language models; model.name={self.config.model.name} makes images "
                              "(generate(labels=...) samples them)")

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` under the run's tokenization (UTF-8 bytes, or its tokenizer.json)."""
        self._text_only("encode")
        if not isinstance(text, str):  # an AttributeError of the tokenizer's before
            raise ConfigError(f"encode takes a str, got {type(text).__name__} {text!r:.60}")
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (a byte that is not whole UTF-8 reads as U+FFFD)."""
        self._text_only("decode")
        given = ids
        try:
            ids = np.asarray(ids)
        except ValueError:  # ragged
            ids = np.asarray(None)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):  # 1.7 was read as 1, "a" was int()'s line
            got = f"{ids.dtype} of shape {ids.shape}" if ids.ndim else f"{type(given).__name__} {given!r:.60}"
            raise ConfigError(f"decode takes a list of integer token ids, got {got}")
        self._in_vocabulary(ids)  # -1 was bytes()'s ValueError, or the tokenizer's OverflowError
        return self.tokenizer.decode([int(i) for i in ids])

    def _in_vocabulary(self, ids: np.ndarray) -> None:
        """Integer token `ids`, refused in one line where one is outside the model's vocabulary."""
        vocab = self.config.model.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ConfigError(f"token ids must be in [0, {vocab}), got {int(bad[0])}")

    @property
    def end_id(self) -> int | None:
        """The token that ends a document (bytes: 0; a tokenizer: data.doc_end_token's, or None)."""
        return self.tokenizer.end_id if self.makes_text else None

    def init_memory(self, rows: int = 1):
        """A fresh inner-loop memory for `rows` stream rows (a pytree of arrays, leading axis rows)."""
        return self.model.init_memory(rows)

    def logits(self, tokens, memory=None, reset=None):
        """(next-token logits [B, T, V], the memory after the tokens) of `tokens` [B, T].
        `memory`: the memory to continue from (default: a fresh one for B rows); `reset` [B]
        bool: the per-row memory reset flag of the first window (default: True for every row
        when no memory is given, else False). The tokens are read as training reads a stream:
        in windows of `seq_len`, the memory written by each window and carried to the next,
        and reset after a window that holds a document's end (`end_id`). A last window shorter
        than `seq_len` is padded (the model is causal: the logits of the tokens given do not
        change), but the memory returned has then read the padding too: to continue a text
        later, carry the memory after full windows only, as `generate` does."""
        self._text_only("logits")
        _refuse_x64()
        try:
            tokens = np.asarray(tokens)
        except (TypeError, ValueError):  # ragged rows
            raise ConfigError("tokens must be [rows, T] integer ids, rows of one length") from None
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ConfigError(f"tokens must be [rows, T] with T >= 1, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":  # 1.7 was read as token 1, "a" raised numpy's ValueError
            raise ConfigError(f"tokens must be integer ids, got {tokens.dtype} (encode(text) gives them)")
        # outside the vocabulary, the embedding's gather would read some other row (or NaN): logits of nothing
        self._in_vocabulary(tokens)
        tokens = tokens.astype(np.int32)
        rows = tokens.shape[0]
        if reset is not None and np.size(reset) != rows:
            raise ConfigError(f"reset must hold one flag per row ({rows}), got {np.size(reset)}")
        reset = np.full((rows,), memory is None) if reset is None else np.asarray(reset, bool).reshape(rows)
        memory = self.init_memory(rows) if memory is None else self._checked_memory(memory, rows)
        out = []
        for start in range(0, tokens.shape[1], self.seq_len):
            window = tokens[:, start : start + self.seq_len]
            logits, memory = self._window(window, memory, reset)
            out.append(logits)  # read after the last window: the device does not wait for the host's copy
            # as training reads a stream (ContextStream): a window with a document's end resets the next
            reset = np.isin(window, [self.end_id]).any(axis=1) if self.end_id is not None else np.zeros(rows, bool)
        return np.concatenate([np.asarray(x) for x in out], axis=1), memory

    def _checked_memory(self, memory, rows: int):
        """`memory` if it is a memory of `rows` rows: another row count's reached the model as a
        reshape's TypeError, another pytree as a KeyError of its leaves."""
        if rows not in self._memory_shapes:  # traced once per row count: a third of a small model's call
            self._memory_shapes[rows] = jax.eval_shape(lambda: self.model.init_memory(rows))
        want = self._memory_shapes[rows]
        shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(memory)]
        if jax.tree.structure(memory) != jax.tree.structure(want) or shapes != [x.shape for x in jax.tree.leaves(want)]:
            raise ConfigError(f"memory must be a memory of {rows} row(s), as init_memory(rows={rows}) or logits of "
                              f"{rows} row(s) return it; got leaves shaped {few(shapes)} where "
                              f"{few(x.shape for x in jax.tree.leaves(want))}")
        return memory

    def _window(self, tokens: np.ndarray, memory, reset: np.ndarray):
        """Logits [B, T, V] of one window of T <= seq_len tokens (padded), and the memory after it."""
        rows, t = tokens.shape
        window = np.zeros((rows, self.seq_len + 1), np.int32)  # T inputs read; the last column is a target
        window[:, :t] = tokens
        # The memory goes in placed as it comes out: a fresh one (init_memory's, on the default
        # device) and one a window returned (replicated over the run's mesh) were two input types,
        # and the forward compiled a second time for the second window of a row count.
        where = replicated(self._mesh)
        if self._forward is None:
            model, vocab = self.model, self.config.model.vocab_size
            self._forward = jax.jit(lambda p, m, x, r: checked_logits(model, p, m, {"tokens": x, "reset": r},
                                                                      vocab=vocab), out_shardings=where)
        logits, memory = self._forward(self.params, jax.device_put(memory, where), window, reset)
        return logits[:, :t], memory

    def generate(self, prompt: str | Sequence[str] = "", max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stream: Callable[[str], Any] | None = None, labels: Sequence[int | str] | None = None, steps: int = 1,
                 batch_size: int = 8, samples_per_prompt: int = 1, stop: str | Sequence[str] | None = (),
                 stop_at_eos: bool = True, details: bool = False):
        """A language model: the text sampled after `prompt` (not including it), with
        `python -m nljax.generate`'s settings and rules (temperature, then top-k, then top-p;
        temperature 0 is greedy; the same seed gives the same text); `stream(text)` is called
        with each piece as it is sampled. An empty prompt starts a new document. `seed`: 0 by default.
        A text ends at the document-end token (`end_id`; not part of the text) unless
        `stop_at_eos=False`, before the first of the `stop` strings it holds (a str or a list;
        the stop string is not part of the text), or after `max_new_tokens` tokens
        (nljax/run/stopping.py; a stream is held back while its end may begin a stop string).
        `details=True`: an `nljax.Completion` in place of each str: the `text`, why it ended
        (`finish_reason`: "eos", "stop" or "length") and the tokens drawn (`new_tokens`).
        A list of prompts gives a list of texts, one each, `batch_size` decoded together as
        `nljax.generate prompts=` decodes them: the i-th drawn as prompts= draws prompt i's sample
        0, so the first is what the prompt alone gives, and none depends on the others; an empty
        list gives []. `samples_per_prompt=N` > 1 (a list of prompts only): a list, per prompt, of N
        texts, sample j of prompt i keyed as prompts= keys it (`sampling.seeded(seed, i, j)`).
        An image model (MeanFlow): samples [len(labels), H, W, C] at the training data's scale
        (uint8 images and the digits were trained in [-1, 1]; the samples are not clipped to it:
        clip before converting to pixels) for the class
        `labels` (numbers, or a folder's class names: `model.classes`), in `steps` steps (1:
        MeanFlow's one-step sampling), from noise keyed by `seed` (default: the run's seed, as its
        evaluation's samples) and the sample's position."""
        self._needs_logits("generate")
        _refuse_x64()
        if not isinstance(details, bool):  # a truthy string would change what is returned
            raise ConfigError(f"details must be True or False, got {details!r:.60}")
        # the other kind's arguments are refused, as nljax.generate refuses them (they were ignored)
        if not self.makes_text:
            if prompt or stream is not None:
                raise ConfigError(f"prompt= and stream= are for a language model; model.name={self.config.model.name} "
                                  "makes images: generate(labels=[...], steps=, seed=)")
            if details:
                raise ConfigError(f"details= tells why each text ended, for a language model; model.name="
                                  f"{self.config.model.name} makes images (an array of samples)")
            return self._images(labels, steps, seed)
        if labels is not None or steps != 1:
            raise ConfigError(f"labels= and steps= are for an image model; model.name={self.config.model.name} makes "
                              "text: generate(prompt, max_new_tokens=, ...)")
        from nljax.run.sampling import Settings, ending_of, prompt_ids
        from nljax.run.stopping import pieces

        stop = () if stop is None else stop  # as OpenAI's API reads a null stop
        if not isinstance(prompt, str):  # a list of prompts: one text each
            if stream is not None:
                raise ConfigError("stream= follows one prompt's text as it is sampled: give one prompt (a str)")
            s = Settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=0 if seed is None else seed, batch_size=batch_size,
                         samples_per_prompt=samples_per_prompt, stop=stop, stop_at_eos=stop_at_eos).check()
            return self._generate_many(prompt, s, details)
        if samples_per_prompt != 1:  # one prompt, one text (a str): more are asked for with a list
            raise ConfigError(f"samples_per_prompt={samples_per_prompt} is for a list of prompts (one prompt gives "
                              f"one text): generate([prompt], samples_per_prompt={samples_per_prompt})")
        s = Settings(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=0 if seed is None else seed, stop=stop, stop_at_eos=stop_at_eos).check()
        prompt_tokens = prompt_ids(self.tokenizer, prompt)
        end = ending_of(self.tokenizer, prompt_tokens, s)
        for piece in pieces(self.sampler().tokens(prompt_tokens, s), end):
            if stream is not None and piece:
                stream(piece)
        return end.completion() if details else end.text  # the pieces joined

    def sampler(self):
        """The windowed decoder `generate` uses (nljax.run.sampling.TextSampler), compiled once."""
        from nljax.run.sampling import TextSampler

        self._text_only("sampler")
        if self._sampler is None:
            self._sampler = TextSampler(self.model, self.params, self._mesh, self.seq_len, self.end_id,
                                        vocab=self.config.model.vocab_size)
        return self._sampler

    def _generate_many(self, prompts, s, details: bool = False) -> list | list[list]:
        """The text after each of `prompts` (a list or tuple of str), as `nljax.generate prompts=`
        samples each prompt's samples (nljax/run/sampling.py: `completions`): a str each (`details`:
        a `Completion`), or with `s.samples_per_prompt` > 1 a list of that many each."""
        from nljax.run.sampling import completions, prompt_ids

        if not isinstance(prompts, (list, tuple)):
            raise ConfigError(f"prompt must be a str or a list of str, got {type(prompts).__name__} "
                              f"{prompts!r:.60}")
        if not prompts:  # nothing to sample: nothing compiled either
            return []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise ConfigError(f"prompt[{i}] must be a str, got {type(p).__name__} {p!r:.60}")
            try:  # a lone surrogate: refused as prompt= is
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"prompt[{i}] is not UTF-8 text (at character {e.start})") from None
        ids = [prompt_ids(self.tokenizer, p, where=f"prompt[{i}]: ") for i, p in enumerate(prompts)]
        texts = [c if details else c.text
                 for _, _, c in completions(self.stream_reader(s.batch_size), self.tokenizer, ids, s)]
        n = s.samples_per_prompt  # completions gives prompt 0's samples, then prompt 1's, ...
        return texts if n == 1 else [texts[i * n:(i + 1) * n] for i in range(len(prompts))]

    def stream_reader(self, rows: int = 8):
        """The batched decoder `generate` uses for a list of prompts (nljax.run.scoring.StreamReader,
        `rows` streams at a time, on this model's one device), compiled once per row count."""
        from nljax.parallel.mesh import make_mesh, replicated
        from nljax.run.scoring import StreamReader

        self._text_only("stream_reader")
        if rows not in self._readers:
            mesh = make_mesh(1, 1, list(self._mesh.devices.flat)[:1])  # the data axes StreamReader splits rows over
            params = jax.device_put(self.params, replicated(mesh))
            self._readers[rows] = StreamReader(self.model, params, mesh, self.seq_len, self.end_id, rows,
                                               vocab=self.config.model.vocab_size)
        return self._readers[rows]

    def _images(self, labels: Sequence[int | str] | None, steps: int, seed: int | None) -> np.ndarray:
        if not hasattr(self.model, "generate"):
            raise ConfigError(f"model.name={self.config.model.name} neither makes text nor has generate()")
        conditional = getattr(self.model, "conditional", False)
        if isinstance(labels, str) or (labels is not None and np.ndim(labels) == 0):
            # one label, not a list of them: a name was read letter by letter ("got 'c'" for
            # "cat"), a number raised len()'s TypeError
            raise ConfigError(f"labels is a list, one sample each: labels=[{labels!r:.60}] for one sample")
        if labels is None or len(labels) == 0 or steps < 1:
            # an unconditional model reads no label, but takes one per sample: say which to give
            which = "labels=[class, ...]" if conditional else "labels=[0] * n (unconditional: the labels are not read)"
            raise ConfigError(f"an image model's generate needs {which}, one sample each, and steps >= 1")
        label = images.label_ids(labels, getattr(self.model, "classes", None), label_classes(self.model))
        model = self.model
        if seed is not None:  # ignored before: every seed gave the run's samples
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:  # as the config's seed
                raise ConfigError(f"seed must be an integer in [0, 2^32), got {seed!r}")
            if not (dataclasses.is_dataclass(model) and hasattr(model, "seed")):
                raise ConfigError(f"model.name={self.config.model.name} keys its noise itself: seed= is not for it")
            model = dataclasses.replace(model, seed=seed)
        index = np.arange(len(label), dtype=np.int32)  # each sample's noise, keyed by (seed, index)
        # kept: a jit made at each call compiled at each call, the same labels and steps too
        if seed not in self._draws:
            self._draws[seed] = jax.jit(model.generate, static_argnums=3)
        out = self._draws[seed](self.params, index, label, int(steps))
        return np.asarray(out)


def label_classes(model) -> int:
    """The classes an image model's labels take: a conditional DiT's 0 .. n-1 (and n, its null
    label); 0 for a model that reads none."""
    return getattr(getattr(model, "net", None), "num_classes", 0) if getattr(model, "conditional", False) else 0


def _tokenizer_name(tokenizer) -> str:
    path = getattr(tokenizer, "path", None)
    return f"tokenizer {path}" if path else "byte tokens"


def load(path: str | Path, checkpoint: str | int = "latest", overrides: Sequence[str] = (),
         params: str = "") -> TrainedModel:
    """The trained model in `path`: an export directory (`python -m nljax.export`) or a run
    directory (`python -m nljax.train`'s run.dir; `checkpoint`: "latest", a step number (300 or
    "300": the run's checkpoint at that step), a step directory or a checkpoints directory;
    `overrides`: config overrides on top of the run's config.yaml; `params`: under
    optim.ema_decay, "average" (the parameters' moving average, the default there) or "trained"
    (the optimizer's own))."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"nljax.load takes a directory path, got {type(path).__name__} {path!r}")
    if isinstance(overrides, Mapping):  # its keys alone were read: "override 'train.seq_len' must look like key=value"
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got a dict: give "
                          f"{[f'{k}={v}' for k, v in overrides.items()]!r:.200}")
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):  # a string is a sequence too
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    path = Path(os.path.expanduser(path))
    if kind_of(path) == "export":
        check_export_args(path, checkpoint, overrides, params)
        return _from_export(path)
    return _from_run(path, checkpoint, overrides, params)


def check_export_args(path: Path, checkpoint: str | int = "latest", overrides: Sequence[str] = (),
                      params: str = "") -> None:
    """An export is one set of parameters: no checkpoint or parameters to choose, no config to override."""
    if checkpoint != "latest" or overrides or params:
        raise ConfigError(f"{path} is an export (one set of parameters): checkpoint=, params= and overrides are for "
                          "a run directory")


def kind_of(path: Path) -> str:
    """What `path` holds: "export" (python -m nljax.export wrote it) or "run" (a run directory,
    with its config.yaml); neither is one line. `nljax.generate` reads a directory as this does."""
    if is_export(path):
        return "export"
    if (path / "config.yaml").is_file():
        return "run"
    raise ConfigError(f"{path} is neither an export directory (python -m nljax.export) nor a run directory "
                      "(python -m nljax.train's run.dir, with its config.yaml)")


def _from_run(run_dir: Path, checkpoint: str | int, overrides: Sequence[str], params: str) -> TrainedModel:
    from nljax.run import trained
    from nljax.run.sampling import tokenization_of

    t = trained.load(run_dir, checkpoint, overrides, devices=jax.local_devices()[:1], params=params)
    for line in t.warnings("nljax.load"):
        print(line, file=sys.stderr)
    out = TrainedModel(t.model, t.params, t.trained_cfg, t.step, t.path, _mesh=t.run.mesh)
    out.tokenizer = tokenization_of(t.cfg) if out.makes_text else None
    return out


def _refuse_x64() -> None:
    """JAX's 64-bit mode turned on after the model was loaded (loading refuses it): its float32
    parameters and memory would meet float64 arrays of the calls' own making."""
    from nljax.run.core import refuse_x64

    refuse_x64()


def _from_export(path: Path) -> TrainedModel:
    from nljax.export import load_model, read_config, tokenization_of_export

    model, params = load_model(path)
    info, cfg = read_config(path)
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("rows",))
    out = TrainedModel(model, params, cfg, int(info["step"]), path.absolute(), _mesh=mesh)
    out.tokenizer = tokenization_of_export(path, out.config) if out.makes_text else None
    return out
