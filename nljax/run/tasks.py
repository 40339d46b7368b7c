"""Tasks: where a run's batches come from and how it is evaluated.

A model names its task (`Model.task`); the trainer asks the task for the global batch of a step
and for held-out metrics, and otherwise does not care what it trains. Every task's batch is a
pure function of (seed, step), so resumed and re-sharded runs read the same data.

| task     | data                                   | evaluation                             |
|----------|----------------------------------------|----------------------------------------|
| `text`   | ContextStream over `data.source`       | held-out loss, bits per byte, fresh    |
|          | (stdlib text, the recall probe or the  | and streaming memory; recall accuracy  |
|          | user's files, data/prepared.py)        |                                        |
| `images` | epochs of image arrays (data/images)   | energy distance of generated samples   |
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nljax.config import Config
from nljax.data import evalsets, imagefolder, images, prepared, tokenization
from nljax.data.recall import CHANCE, attention_reach, recall_corpus
from nljax.data.text import ContextStream, HeldOutStream, eval_batches, eval_windows, stdlib_corpus
from nljax.errors import ConfigError
from nljax.measure.energy import energy_distance
from nljax.measure.figures import write_samples
from nljax.models import registry
from nljax.parallel import mesh as meshlib
from nljax.parallel.hostdev import gather_rows, host_sum, put_batch, reset_all_rows
from nljax.parallel.mesh import ROWS


class Task(Protocol):
    unit: str  # what throughput counts: "tokens", "images"
    units_per_row: int  # units in one batch row (seq_len for text)

    def batch(self, step: int, reset_all: bool = False) -> dict[str, jax.Array]:
        """The global batch of `step`, split over the data axes (each device builds its rows):
        `train.batch_size` rows, or, at the end of a data pass, fewer: a multiple of the
        micro-batch `train.batch_size / train.accum_steps` (the tail, trained, not dropped; only
        for models without inner-loop memory). `reset_all`: every row starts from a fresh
        inner-loop memory (the first step after a resume that restarted every row's memory)."""
        ...

    def evaluate(self, cache, params, step: int) -> dict:
        """Held-out metrics as plain floats, reduced as sums and counts over all devices."""
        ...


@dataclasses.dataclass(frozen=True, eq=False)
class TextData:
    """A text task's token arrays: training and held-out ids, and what else its source supplies."""

    train: np.ndarray | None  # [N] token ids; None: not read (a run that evaluates only, of data.prepared)
    held: np.ndarray  # [M]
    train_weight: np.ndarray | None = None  # float32 [N]: training-loss weight per token (recall)
    held_score: np.ndarray | None = None  # float32 [M]: the scored held-out tokens (recall)
    train_ends: np.ndarray | None = None  # int64: each document's last token (files); None: SEPARATOR bytes
    held_ends: np.ndarray | None = None
    tokens_per_byte: float = 1.0  # held-out tokens per byte: bits per token x this = bits per byte
    unit: str = "bytes"  # what a token is, in messages
    digest: str | None = None  # the content digest of the files' manifest (files)
    tokenizer: dict = dataclasses.field(default_factory=lambda: {"kind": "bytes"})  # what the ids are (`identity`)
    train_size: int | None = None  # tokens in the training split, read or not (None: len(train))
    notes: tuple[str, ...] = ()  # lines on the data the start-up says (`prepared.split_notes`)

    @property
    def train_tokens(self) -> int:
        return len(self.train) if self.train_size is None else self.train_size


def text_data(cfg: Config, trains: bool = True) -> TextData:
    """The token arrays of `data.source`. `trains=False`: what an evaluation reads: of the user's
    files, no training split where none need be read (`prepared.corpus(evaluates=True)`)."""
    d = cfg.data
    if d.source == "recall":
        reach = attention_reach(cfg.model.depth, cfg.model.nl_lm.window)
        train, train_score, held, held_score = recall_corpus(
            d.recall_docs, cfg.train.seq_len, d.recall_pairs, d.recall_gap, reach, d.eval_fraction, cfg.seed,
            d.recall_key_len, d.recall_value_len)
        # every document has the same number of scored bytes, so every row (and every device's
        # rows) weighs the same in the mean loss: N devices still compute 1 device's gradient
        return TextData(train, held, train_score if d.recall_loss == "values" else None, held_score)
    if d.source == "files":
        c = prepared.corpus(d, evaluates=not trains)
        train, ends = (c.train.tokens, c.train.ends) if c.train is not None else (None, None)
        return TextData(train, c.eval.tokens, train_ends=ends, held_ends=c.eval.ends,
                        tokens_per_byte=c.tokens_per_byte, unit="tokens", digest=c.digest,
                        tokenizer=tokenization.identity(c.manifest["tokenizer"]),
                        train_size=c.manifest["train"]["tokens"], notes=tuple(prepared.split_notes(c.manifest, d)))
    return TextData(*stdlib_corpus(d.eval_fraction))


def check_trains(cfg: Config) -> None:
    """A run that trains needs training text: data.eval alone is held-out text only (what
    nljax.evaluate scores a checkpoint on), refused before anything is read."""
    if registry.task_of(cfg) == "text" and cfg.data.held_out_only:
        raise ConfigError("data.eval alone is held-out text only (for nljax.evaluate): training needs data.train "
                          "(or data.prepared)")


def resolve(cfg: Config, trains: bool = True) -> Config:
    """`cfg` with what its data decide: with data.source=files, model.vocab_size from the files'
    vocabulary (bytes: 256; a tokenizer: its size) when the config leaves it at its default.
    `trains=False`: the data read as an evaluation reads them (`text_data`)."""
    if cfg.data.source != "files" or registry.task_of(cfg) != "text":
        return cfg
    default = type(cfg.model)().vocab_size
    vocab = prepared.model_vocab(prepared.corpus(cfg.data, evaluates=not trains), cfg.model.vocab_size, default)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def every_nth(fraction: float) -> int:
    """The split an eval fraction makes: every round(1/fraction)-th example held out (the text
    readers' and the image sets' rule; data.eval_fraction is at most 0.5, so at least every 2nd)."""
    return round(1 / fraction)


class TextTask:
    """Language modelling on `data.source`: the standard library's source (see
    `nljax.data.text`), the associative-recall probe (`nljax.data.recall`) or the user's own
    files (`nljax.data.prepared`). `trains=False`: built to evaluate (`nljax.evaluate`), with
    no batches where the training text is not read (`text_data`)."""

    unit = "tokens"

    def __init__(self, cfg: Config, mesh: Mesh, trains: bool = True):
        self.cfg, self.mesh = cfg, mesh
        # `fingerprint`'s digest, kept here: a functools.cache on the method kept every task of
        # the process (a notebook's runs), and the data each one read, alive for its whole life
        self._digest: str | None = None
        self.units_per_row = cfg.train.seq_len
        self.data = data = text_data(cfg, trains)
        self.eval_data, self.eval_score = data.held, data.held_score
        self.bpb_per_nat = data.tokens_per_byte / math.log(2)  # a loss in nats per token -> bits per byte
        if len(eval_windows(self.eval_data, cfg.train.seq_len, 1)) == 0:  # before step 0, not after training
            d = cfg.data  # prepared alone: what DIR holds out, whatever data.eval_fraction says now
            source = (f"data.eval={', '.join(d.eval)}" if d.eval else f"data.prepared={d.prepared}"
                      if d.prepared and not d.train else f"data.eval_fraction={d.eval_fraction}")
            raise ConfigError(f"the held-out text ({len(self.eval_data)} {data.unit} from {source}) is shorter than "
                              f"train.seq_len+1={cfg.train.seq_len + 1}")
        # a row would repeat a few tokens over and over (not read: an evaluation, which trains on none)
        if data.train is not None and len(data.train) < cfg.train.seq_len + 1:
            raise ConfigError(f"the training text ({len(data.train)} {data.unit}) is shorter than "
                              f"train.seq_len+1={cfg.train.seq_len + 1}: give more text or a shorter train.seq_len")
        self.notes: list[str] = list(data.notes)  # said once at start-up by the trainer (and by nljax.evaluate)
        self.stream_steps = self._stream_steps()  # the streaming evaluation's windows per row
        # data.eval_sets: tokenized once, here; each with its own streaming windows per row (as
        # many of eval.stream_steps as fit in it)
        self.eval_sets = evalsets.load(cfg.data, cfg.train.seq_len)
        self.set_stream_steps = {s.name: self._stream_steps(self._held_stream(s.tokens, s.ends), f"data.eval_sets {s.name}")
                                 for s in self.eval_sets}
        # recall documents are exactly seq_len long: aligned rows read one whole document per step
        align = cfg.train.seq_len if cfg.data.source == "recall" else 1
        self.stream = None if data.train is None else ContextStream(
            data.train, cfg.train.batch_size, cfg.train.seq_len, cfg.seed, cfg.data.reset_prob, align,
            data.train_weight, data.train_ends)

    def batch(self, step: int, reset_all: bool = False) -> dict[str, jax.Array]:
        if self.stream is None:
            raise TypeError("a run built to evaluate (Run.create(trains=False)) read no training text: no batches")
        batch = self.stream.global_batch(step, meshlib.rows_sharding(self.mesh))
        return reset_all_rows(batch) if reset_all else batch

    def held_out_by(self) -> dict[str, Callable]:
        """The config keys that decide which of the data's examples are held out, each with the
        split its value makes (two fractions that round to the same every-n-th split hold out the
        same examples): another split at evaluation (`nljax.evaluate data.eval_fraction=0.1`)
        scores other text than the run scored, which `trained.load` warns of. data.eval's files,
        and a data.prepared directory's split (made when it was prepared), are not cut by
        data.eval_fraction."""
        d = self.cfg.data
        if d.source == "files" and (d.eval or d.prepared):
            return {}
        return {"data.eval_fraction": every_nth}

    def fingerprint(self) -> str:
        """Digest of the training and held-out tokens, compared across processes at start-up:
        the files' content digest (their manifest's), or of the bytes themselves."""
        if self._digest is None:  # asked for at start-up, by the checkpoints and in the reports: hashed once
            d = self.data
            self._digest = d.digest if d.digest is not None else hashlib.sha256(
                d.train.tobytes() + b"|" + self.eval_data.tobytes()).hexdigest()
        return self._digest

    @property
    def tokenizer_identity(self) -> dict:
        """What the token ids are (`nljax.data.tokenization.identity`): checkpoints record it, and
        a resume or a load with other ids is refused."""
        return self.data.tokenizer

    def describe(self) -> dict:
        """What summary.json records of the data: source, token counts, vocabulary, digest (and
        the tokens and content digest of each data.eval_sets set)."""
        d = self.cfg.data
        out = {"source": d.source, "train_tokens": 0 if d.held_out_only else self.data.train_tokens,
               "eval_tokens": len(self.eval_data), "vocab_size": self.cfg.model.vocab_size,
               "digest": self.fingerprint()}
        if self.eval_sets:
            out["eval_sets"] = {s.name: len(s.tokens) for s in self.eval_sets}
            out["eval_set_digests"] = {s.name: s.digest for s in self.eval_sets}
        return out

    def evaluate(self, cache, params, step: int) -> dict:
        """Fresh-memory held-out loss and, with eval.stream_steps, the streaming one; then the
        same of each data.eval_sets set, under its keys with /<name> after them."""
        out = self.evaluate_fresh(cache, params)
        if self.stream_steps:
            out.update(self.evaluate_stream(cache, params, self.held_out().batches(self.stream_steps)))
        for s in self.eval_sets:
            out.update({f"{k}/{s.name}": v for k, v in self.evaluate_set(cache, params, s).items()})
        return out

    def evaluate_set(self, cache, params, s: evalsets.EvalSet) -> dict:
        """A data.eval_sets set scored as the main held-out text is, under the same keys."""
        out = self.evaluate_fresh(cache, params, s.tokens, s.tokens_per_byte)
        if steps := self.set_stream_steps[s.name]:
            out.update(self.evaluate_stream(cache, params, self._held_stream(s.tokens, s.ends).batches(steps),
                                            s.tokens_per_byte))
        return out

    def _stream_steps(self, held: HeldOutStream | None = None, what: str = "the held-out text") -> int:
        """eval.stream_steps, or as many windows per row as the held-out text (`held`, default the
        main one) holds when it holds fewer (a small corpus of one's own: said once, in `notes`);
        none fitting turns the streaming evaluation off, except where it is the evaluation
        (data.source=recall's main held-out text: one line)."""
        main = held is None
        held, asked = held or self.held_out(), self.cfg.eval.stream_steps
        fits = held.span // held.seq_len
        if asked <= fits:
            return asked
        if fits == 0 and main and self.cfg.data.source == "recall":
            held.check_fits(asked)  # raises
        t = self.cfg.train
        more = " (hold out more text, data.eval_fraction or data.eval, for more)" if main else ""
        self.notes.append(
            f"note: eval.stream_steps={asked} windows of train.seq_len={t.seq_len} per row do not fit in {what} "
            f"({len(held.data):,} tokens over train.batch_size={t.batch_size} rows): {'the' if main else 'its'} streaming "
            + (f"evaluation reads {fits} per row" if fits else "evaluation is off") + more)
        return fits

    def held_out(self) -> HeldOutStream:
        t = self.cfg.train
        return HeldOutStream(self.eval_data, t.batch_size, t.seq_len, ends=self.data.held_ends, score=self.eval_score)

    def _held_stream(self, tokens: np.ndarray, ends: np.ndarray) -> HeldOutStream:
        """A data.eval_sets set read as `held_out` reads the main held-out text (no score mask)."""
        t = self.cfg.train
        return HeldOutStream(tokens, t.batch_size, t.seq_len, ends=ends)

    def evaluate_stream(self, cache, params, batches, tokens_per_byte: float | None = None) -> dict:
        """Loss over consecutive held-out windows per row with the memory carried from window to
        window (a fresh eval memory, reset at the first window and at document boundaries), and
        with a score mask (the recall probe) the greedy accuracy at the scored positions.
        `tokens_per_byte`: of the text read (default: the main held-out text's)."""
        tokens_per_byte = self.data.tokens_per_byte if tokens_per_byte is None else tokens_per_byte
        memory, sums = cache.eval_memory(), []
        for b in batches:
            m, memory = cache.eval_stream(params, memory, put_batch(b, self.mesh))
            sums.append(m)  # reduced on the host after the last window: no sync per window
        total = {k: sum(host_sum(m[k]) for m in sums) for k in sums[0]}
        mean = total["loss_sum"] / max(total["count"], 1.0)
        out = {"eval_loss_stream": mean, "eval_bpb_stream": mean * tokens_per_byte / math.log(2),
               "eval_tokens_stream": int(total["count"])}
        if "hits" in total:
            out["eval_recall_acc"] = total["hits"] / max(total["scored"], 1.0)
            out["eval_recall_chance"] = CHANCE
            out["eval_recall_scored"] = int(total["scored"])
        return out

    def evaluate_fresh(self, cache, params, tokens: np.ndarray | None = None,
                       tokens_per_byte: float | None = None) -> dict:
        """Held-out loss over every eval example exactly once (padded rows are masked), every
        window from a fresh memory; at most eval.batches batches of them (0: all). `tokens` and
        their `tokens_per_byte`: other held-out text (a data.eval_sets set) than the main one."""
        if tokens is None:
            tokens, tokens_per_byte = self.eval_data, self.data.tokens_per_byte
        rows = self.cfg.train.batch_size
        # one at least: refused at start-up otherwise (__init__ for the main text, evalsets.load for a set)
        windows = eval_windows(tokens, self.cfg.train.seq_len, self.cfg.eval.batches * rows)
        # every batch dispatched before any is read, as evaluate_stream: a read per batch made the
        # devices wait for the host to build and send the next one (the sums and their order unchanged)
        sums = [cache.eval(params, put_batch(b, self.mesh)) for b in eval_batches(windows, rows)]
        loss = count = 0.0
        for m in sums:
            loss += host_sum(m["loss_sum"])
            count += host_sum(m["count"])
        mean = loss / max(count, 1.0)
        bpb = mean * tokens_per_byte / math.log(2)
        return {"eval_loss": mean, "eval_bpb": bpb, "eval_tokens": int(count)}


class _Unread:
    """A task of a run loaded for use without its data (`Run.create(reads_data=False)`): no
    batches, no evaluation."""

    def batch(self, step: int, reset_all: bool = False):
        raise TypeError("a run loaded without its data (Run.create(reads_data=False)) has no batches")

    def evaluate(self, cache, params, step: int) -> dict:
        raise TypeError("a run loaded without its data (Run.create(reads_data=False)) cannot evaluate")


class LoadedText(_Unread):
    """A text model loaded for use (`nljax.load`, generate, export, lm_eval): no text is read, so
    the run's data may have moved or grown since; what its token ids are comes from the
    tokenizer's file (data.prepared's manifest, data.tokenizer) alone. Not for training or
    evaluating (`Run.create(reads_data=True)` builds the `TextTask`)."""

    unit = "tokens"

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.units_per_row = cfg, cfg.train.seq_len

    @property
    def tokenizer_identity(self) -> dict:
        return tokenization.identity(prepared.tokenization_of(self.cfg.data).info())


class LoadedImages(_Unread):
    """An image model loaded for use (`nljax.load`, export): no image is read, so the run's images
    may have moved since; its model is built from what its checkpoint recorded of them
    (`nljax.run.trained`: the image shape, the labels and their names). Not for training,
    evaluating or nljax.generate's grid, drawn beside the held-out images (`ImageTask`)."""

    unit = "images"
    units_per_row = 1

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg = cfg


class ImageTask:
    """Images generated by the DiT (`nljax.models.dit`), scored by energy distance."""

    unit = "images"
    units_per_row = 1

    def __init__(self, cfg: Config, mesh: Mesh, trains: bool = True):
        self.cfg, self.mesh = cfg, mesh
        self._digest: str | None = None  # `fingerprint`'s (see TextTask)
        self.data = images.load(cfg.images)
        # `trains=False` (nljax.evaluate, generate, export, load): the held-out images alone are
        # used, so a small set of other images is not refused for the run's training batch size
        self.sampler = images.EpochSampler(len(self.data.train_x), cfg.train.batch_size, cfg.seed) if trains else None
        if len(self.data.eval_x) < 2:  # the evaluation's energy distance: found before step 0
            raise ConfigError(f"evaluation needs at least 2 held-out images, got {len(self.data.eval_x)}")
        self.notes: list[str] = []  # said once at start-up by the trainer (and by nljax.evaluate)
        held, asked = len(self.data.eval_x), cfg.meanflow.eval_samples
        if asked > held:  # capped at every evaluation, as eval.stream_steps is: said once
            self.notes.append(f"note: meanflow.eval_samples={asked} is more than the {held} held-out images: each "
                              f"evaluation draws {held} (hold out more, images.eval_fraction, for more)")
        if others := self.data.passed_over:  # a .jfif or .heic photo among the .jpg ones left out in silence
            self.notes.append(f"note: images.path {cfg.images.path}: {len(others):,} file{'s' * (len(others) > 1)} "
                              f"passed over, not of an image type read here (e.g. {others[0]}; read: "
                              f"{', '.join(imagefolder.EXTENSIONS)})")
        if missing := images.missing_labels(self.data) if cfg.meanflow.class_cond else []:
            # labels numbered from 1 (or with gaps): a class per number up to the largest, some never trained
            where = cfg.images.path if cfg.images.source == "file" else cfg.images.source
            more = f", ... ({len(missing):,} in all)" if len(missing) > 8 else ""
            if cfg.images.classes:  # named by the user (or by the run, for a test set of some of its classes)
                shown = ", ".join(repr(cfg.images.classes[k]) for k in missing[:8]) + more
                self.notes.append(f"note: images.path {where}: no class folder for {shown} of images.classes (the "
                                  "model keeps a class for each)")
            else:
                shown = ", ".join(map(str, missing[:8])) + more
                self.notes.append(f"note: images {where}: no image has label {shown}; the model has a class for each "
                                  f"of 0 .. {self.data.num_classes - 1} (number the labels from 0 without gaps)")
        names = () if cfg.images.classes else self.data.classes or ()  # images.classes: the user's order
        numeric = sorted(names, key=int) if all(n.isdigit() for n in names) else list(names)
        if list(names) != numeric:
            # torchvision's order too, but a folder `10` labelled 2 surprises: said, with an example
            k = next(k for k, (n, m) in enumerate(zip(names, numeric)) if n != m)
            self.notes.append(f"note: images.path {cfg.images.path}: the class folders are numbers, labelled in the "
                              f"order of their names as text (label {k} is folder {names[k]}); for labels in number "
                              f"order name them 00, 01, ..., or give images.classes={_quoted(numeric)}")
        self._generate = self._error = None
        # where each evaluation draws its samples_<step>.png; None: nowhere (nljax.evaluate
        # scores a checkpoint and leaves the run directory as it is)
        self.samples_dir: Path | None = Path(cfg.run.dir)

    def batch(self, step: int, reset_all: bool = False) -> dict[str, jax.Array]:
        # no inner-loop memory: there is no row to reset
        if self.sampler is None:
            raise TypeError("a run built to evaluate (Run.create(trains=False)) draws no training batches")
        return images.global_batch(self.data, self.sampler, step, meshlib.rows_sharding(self.mesh))

    def held_out_by(self) -> dict[str, Callable]:
        """The config keys that decide which examples are held out (`TextTask.held_out_by`): the
        split, and the toy sets' size (other points, drawn from one generator)."""
        return {"images.eval_fraction": every_nth,
                **({"images.toy_points": lambda n: n} if self.cfg.images.source in ("moons", "gaussians") else {})}

    def fingerprint(self) -> str:
        """Digest of the training and held-out arrays, compared across processes at start-up."""
        if self._digest is None:  # asked for at start-up and by the checkpoints: hashed once
            d = self.data
            parts = [np.ascontiguousarray(a).tobytes() for a in (d.train_x, d.train_y, d.eval_x, d.eval_y)
                     if a is not None]
            self._digest = hashlib.sha256(b"|".join(parts)).hexdigest()
        return self._digest

    def describe(self) -> dict:
        """What summary.json records of the images (and the start-up line says): source (the
        file's path, or the set's name), training and held-out counts, shape [H, W, C], classes
        (0: unconditional), their names in label order where the data name them (a folder's
        class subfolders: `classes`, absent otherwise), digest."""
        c, d = self.cfg.images, self.data
        names = {"classes": list(d.classes)} if d.classes is not None else {}
        return {"source": c.path if c.source == "file" else c.source, "train_images": len(d.train_x),
                "eval_images": len(d.eval_x), "shape": list(d.train_x.shape[1:]), "num_classes": d.num_classes,
                **names, "digest": self.fingerprint()}

    def generator(self, eng):
        """(one-step, multi-step) samples for rows (index, label) split over the data axes, by the
        model's tensor-parallel shard where `mesh.model` > 1; traced and compiled once per sample
        count."""
        if self._generate is None:
            steps, model = self.cfg.meanflow.sample_steps, eng.local_model

            def local(params, index, label):  # index, label [n/devices]
                return model.generate(params, index, label, 1), model.generate(params, index, label, steps)

            self._generate = jax.jit(
                lambda params, index, label: jax.shard_map(
                    local, mesh=self.mesh, in_specs=(eng.split.params, ROWS, ROWS),
                    out_specs=(ROWS, ROWS), check_vma=False,
                )(params, index, label)
            )
        return self._generate

    def chosen(self, n: int) -> np.ndarray:
        """The held-out images (their positions) that n samples are drawn for and scored against:
        n spread over the held-out set (`images.spread`), all of them for n = the held-out count."""
        return images.spread(len(self.data.eval_x), n)

    def generate(self, eng, params, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n samples conditioned on the labels of the held-out images `chosen(n)`, one-step and
        multi-step, gathered; each sample's noise keyed by its image's position, so a sample is the
        same whatever n. `eng`: the run's engine; `params`: the model's parameter tree
        (`Strategy.gather_params`)."""
        index = self.chosen(n)
        return self.draw(eng, params, index, self.data.eval_y[index])

    def draw(self, eng, params, index: np.ndarray, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(one-step, multi-step) samples [n, ...] gathered, sample i of class label[i] from noise
        keyed by (the run's seed, index[i])."""
        n, rows = len(index), meshlib.data_size(self.mesh)
        padded = -(-n // rows) * rows
        # tail rows are padding
        batch = {"index": np.resize(index, padded).astype(np.int32), "label": np.resize(label, padded).astype(np.int32)}
        batch = put_batch(batch, self.mesh)
        one, multi = self.generator(eng)(params, batch["index"], batch["label"])
        return gather_rows(one, n), gather_rows(multi, n)

    def error_fn(self, eng):
        """Per-device (sum, count) of the model's unweighted per-example error (`per_example_error`)
        over rows split over the data axes, masked rows left out; compiled once."""
        if self._error is None:
            model = eng.local_model

            def local(params, image, label, index, mask):  # [n/devices, ...]
                e = model.per_example_error(params, {"image": image, "label": label, "index": index})
                w = mask.astype(e.dtype)
                return jnp.sum(e * w)[None], jnp.sum(w)[None]

            self._error = jax.jit(lambda params, *rows: jax.shard_map(
                local, mesh=self.mesh, in_specs=(eng.split.params, ROWS, ROWS, ROWS, ROWS),
                out_specs=(ROWS, ROWS), check_vma=False)(params, *rows))
        return self._error

    def held_out_error(self, eng, params, n: int) -> float:
        """The mean unweighted error of the loss on the held-out images `chosen(n)` (their draws
        keyed by their position, as training's are by the row's): what the adaptively weighted
        loss (near 1 with the default weight) hides."""
        padded = -(-n // meshlib.data_size(self.mesh)) * meshlib.data_size(self.mesh)
        index = np.resize(self.chosen(n), padded).astype(np.int32)  # tail rows are padding, masked
        rows = put_batch({"image": self.data.eval_x[index], "label": self.data.eval_y[index].astype(np.int32),
                          "index": index, "mask": np.arange(padded) < n}, self.mesh)
        total, count = self.error_fn(eng)(params, rows["image"], rows["label"], rows["index"], rows["mask"])
        return host_sum(total) / max(host_sum(count), 1.0)

    def evaluate(self, cache, params, step: int) -> dict:
        """Energy distance between n generated samples and the n held-out images they are drawn for
        (n: all held-out images, or meanflow.eval_samples spread over them: `chosen`), for one-step
        and multi-step sampling; a PNG of samples;
        with a model that has `per_example_error`, its unweighted error on those images."""
        mf = self.cfg.meanflow
        held = len(self.data.eval_x)
        n = min(mf.eval_samples, held) if mf.eval_samples else held  # >= 2: __init__ and MeanFlowConfig.check
        # Sampling needs the model's parameter tree (split over `model` only): under fsdp it is
        # gathered over the data axes here.
        whole = cache.eng.strategy.gather_params(params)
        one, multi = self.generate(cache.eng, whole, n)
        drawn = self.chosen(n)  # the held-out images the samples are drawn for
        ref = self.data.eval_x[drawn]
        if jax.process_index() == 0 and self.samples_dir is not None:
            run_dir = self.samples_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            from nljax.runtime.runlog import note_written

            name = f"samples_{step:06d}.png"
            labels = self.data.eval_y[drawn] if self.data.num_classes else None
            write_samples(run_dir / name, one, multi, ref, mf.sample_steps, labels, f"after {step} steps",
                          self.data.classes)
            note_written(run_dir, name)
        error = {}
        if hasattr(cache.eng.local_model, "per_example_error"):
            error["eval_mse"] = self.held_out_error(cache.eng, whole, n)
        return {
            **error,
            "eval_energy_1step": energy_distance(one, ref),
            "eval_energy_multistep": energy_distance(multi, ref),
            "eval_sample_steps": mf.sample_steps,
            "eval_samples": n,
        }


TASKS: dict[str, Callable[..., Task]] = {  # (cfg, mesh, trains=...)
    "text": TextTask,
    "images": ImageTask,
}
UNREAD: dict[str, Callable[..., Task]] = {"text": LoadedText, "images": LoadedImages}  # (cfg, mesh)


def _quoted(names: list[str], most: int = 16) -> str:
    """A YAML list of names as strings ('0', '1'), quoted for a shell: a value to paste (up to
    `most` names; more are cut, ... after the first ones)."""
    shown = [f"'{n}'" for n in names[:most]] + (["..."] if len(names) > most else [])
    return '"[' + ", ".join(shown) + ']"'


def build(name: str, cfg: Config, mesh: Mesh, reads_data: bool = True, trains: bool = True) -> Task:
    """The task `name` of a run; `reads_data=False`: `LoadedText` or `LoadedImages`, which read
    none; `trains=False`: built to evaluate, it reads only what its evaluation scores."""
    if not reads_data and name in UNREAD:
        return UNREAD[name](cfg, mesh)
    try:
        make = TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task '{name}' (available: {', '.join(sorted(TASKS))})")
    return make(cfg, mesh, trains=trains)
