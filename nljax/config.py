"""Typed, frozen configuration: YAML files plus `dotted.key=value` overrides.

Every section is a frozen dataclass. Loading walks the dataclass fields, so an unknown key or a
value of the wrong type is rejected with one line that names the key (and the nearest valid
one) instead of surfacing later as a shape error deep inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from nljax.errors import ConfigError, first_line


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    overwrite: bool = False  # replace the files of an earlier run in run.dir
    quiet: bool = False
    tensorboard: bool = True  # TensorBoard event files in run.dir
    plots: bool = True  # loss.png and step_time.png in run.dir at the end
    # JAX's persistent compilation cache (nljax/compile_cache.py): auto (the user's cache
    # directory, ~/.cache/nljax/jax) | off | a directory
    compile_cache: str = "auto"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global rows per optimizer step
    seq_len: int = 128
    accum_steps: int = 1  # micro-batches per optimizer step, accumulated on each device
    # stop (one line, exit 2) when this many steps in a row were skipped: nothing is training; 0: off
    max_skipped: int = 20
    log_every: int = 10
    profile_steps: int = 0  # record a jax.profiler trace of this many steps into run.dir/profile
    profile_start: int = 10  # first profiled step (after compilation)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    # optimizer instances / hosts (slow network); -1 fills in the rest, and with intra=-1 too
    # means one instance per process (1 in a single-process run)
    inter: int = -1
    intra: int = -1  # devices inside one instance (fast interconnect); -1 fills in the rest


@dataclasses.dataclass(frozen=True)
class CMSConfig:
    periods: tuple[int, ...] = (1, 8, 64, 512)
    frozen_grads: Literal["accumulate", "skip"] = "accumulate"
    # What `accumulate` buffers while a level is frozen (nljax/frozen.py): `gradients`, one sum
    # applied as one optimizer step at the firing; `updates`, every step's gradient, on which the
    # optimizer runs step by step at the firing (the paper's sum of per-step optimizer outputs).
    accumulate: Literal["gradients", "updates"] = "gradients"


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    reduce: Literal["flat", "hierarchical"] = "hierarchical"
    mean: bool = True  # average gradients over devices (True) or sum them (False)
    # Where parameters and optimizer state live (nljax/strategy.py): replicated | zero1 | fsdp.
    strategy: Literal["replicated", "zero1", "fsdp"] = "replicated"
    # Skip a step (on every device) whose synchronized gradient is not finite.
    check_grads: bool = True
    # Per level: also skip a level's update whose synchronized gradient norm exceeds this (0: off).
    max_grad_norm: float = 0.0
    # Link bandwidths in GB/s (gigabytes) per device and direction, for the time projection of
    # `nljax.comm`. Defaults: NVLink 4 on H100 SXM, 900 GB/s bidirectional = 450 GB/s per
    # direction (NVIDIA H100 datasheet); InfiniBand NDR, 400 Gb/s per GPU = 50 GB/s (NVIDIA
    # ConnectX-7 / DGX H100: one 400 Gb/s NIC per GPU).
    intra_bandwidth_gbps: float = 450.0
    inter_bandwidth_gbps: float = 50.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "nl_lm"  # registry key: nl_lm | cms_mlp | dit
    vocab_size: int = 256
    dim: int = 128
    hidden_mult: int = 4
    depth: int = 2  # blocks, each ending in one CMS chain of len(cms.periods) levels
    # attention + neural memory (models/nl_lm.py)
    heads: int = 4
    window: int = 64
    memory_layers: tuple[int, ...] = (1,)  # 0-based block indices that carry a neural memory
    memory_kind: Literal["linear", "mlp"] = "linear"  # linear: as good on held-out text, cheaper (README)
    memory_heads: int = 4
    memory_dim: int = 32  # per-head key/value width of the memory
    memory_hidden: int = 64  # hidden width of the 2-layer MLP memory
    memory_chunk: int = 16  # mini-batch b of the chunk-parallel inner loop
    # largest inner-loop step theta, in units of the inner problem's curvature bound; <= 1
    # keeps every chunk's step inside it (stability argument: nljax/models/memory.py)
    memory_lr_max: float = 1.0
    memory_conv: int = 4  # causal depthwise conv + SiLU on the memory's q, k, v (kernel size); 0: off
    memory_out_norm: bool = True  # RMS-normalise each memory head's read
    memory_out_gate: bool = True  # gate the read with sigmoid(W x)
    # compute dtype of nl_lm's matmuls and activations; parameters, optimizer state, the
    # inner-loop memory (state, gates, normalisers), losses and gradient reductions stay float32
    dtype: Literal["float32", "bfloat16"] = "float32"
    # jax.checkpoint: none | block (recompute attention, memory and CMS sub-blocks in the backward
    # pass) | memory (only the inner loop's per-chunk internals); exact, since all are pure functions
    remat: Literal["none", "block", "memory"] = "none"
    memory_unroll: int = 1  # inner-loop chunks per loop iteration (larger: fewer, fused kernels; longer compile)
    patch_size: int = 2  # DiT (models/dit.py): patch side; dim, depth, heads, hidden_mult size it too


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    level_lr_scale: tuple[float, ...] = ()  # per-level multiplier; empty means 1 for every level
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    clip_norm: float = 0.0  # clip each active level's synchronized gradient by its own norm; 0: off
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # lr x (B/B0) or x sqrt(B/B0), B = train.batch_size
    base_batch_size: int = 16  # B0: the global batch that optim.lr was tuned for


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
    # reach model.depth * (model.window - 1), so only the memory can carry a value to its query
    recall_gap: int = 128
    # recall: the training loss's targets. values: the queried value bytes only (the protocol of
    # multi-query associative recall, MQAR: the random keys, values and filler are unpredictable,
    # and their loss's gradient noise drowns the recall signal, README "The recall probe");
    # all: every byte, as a language model
    recall_loss: Literal["values", "all"] = "values"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 100
    batches: int = 4  # fresh-memory evaluation: batches of train.batch_size independent windows
    # streaming evaluation: train.batch_size rows each read this many consecutive held-out
    # windows with the memory carried between them (0: off; data.corpus=recall needs it)
    stream_steps: int = 4


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (nljax/distributed.py)."""

    timeout_s: int = 60  # a dead process is noticed, and the others stopped, within this long
    check_every: int = 100  # loop iterations between lockstep checks of the step and Pulse; 0: off


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
    reps: int = 5  # timed repetitions of every pulse pattern at the end of a run (medians reported)
    split: bool = True  # also time each pattern without its collectives: compute vs communication
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: from the device kind when known


@dataclasses.dataclass(frozen=True)
class ImagesConfig:
    """Image data of the `images` task (nljax/data/images.py)."""

    source: Literal["digits", "file", "moons", "gaussians"] = "digits"  # digits: scikit-learn's 8x8 set
    path: str = ""  # source=file: a .npy (images) or .npz ('x' or 'images', optional 'y' or 'labels')
    eval_fraction: float = 0.2  # every round(1/eval_fraction)-th example is held out
    toy_points: int = 8192  # size of the 2-D toy sets


@dataclasses.dataclass(frozen=True)
class MeanFlowConfig:
    """Loss and sampling of the DiT denoiser (nljax/meanflow.py)."""

    loss: Literal["meanflow", "flow_matching"] = "meanflow"
    r_fraction: float = 0.25  # fraction of examples with r != t (the rest have r = t)
    time_mu: float = -0.4  # logit-normal (t, r): sigmoid(mu + sigma * N(0, 1))
    time_sigma: float = 1.0
    adaptive_p: float = 1.0  # loss weight 1 / (||delta||^2 + c)^p, detached; p = 0: plain squared error
    adaptive_c: float = 1e-3
    class_cond: bool = True  # condition on labels when the data has them
    label_dropout: float = 0.1  # labels replaced by the null class (classifier-free guidance)
    cfg_omega: float = 1.0  # guided target w v + kappa u_cond + (1 - w - kappa) u_uncond; 1, 0: off
    cfg_kappa: float = 0.0
    cfg_t_min: float = 0.0  # guidance applies for t in [cfg_t_min, cfg_t_max]
    cfg_t_max: float = 1.0
    sample_steps: int = 4  # steps of the multi-step evaluation (one-step is always reported)
    eval_samples: int = 0  # samples per evaluation; 0: as many as held-out images


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run.dir>/checkpoints
    every: int = 100  # save every N steps and at the end; 0: never save
    keep: int = 3  # newest checkpoints kept on disk
    resume: str = ""  # "" (fresh run) | "latest" (newest in checkpoint.dir) | a checkpoint or checkpoints directory
    async_save: bool = True  # write in the background while training continues


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    run: RunConfig = RunConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    cms: CMSConfig = CMSConfig()
    sync: SyncConfig = SyncConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    distributed: DistributedConfig = DistributedConfig()
    throughput: ThroughputConfig = ThroughputConfig()
    images: ImagesConfig = ImagesConfig()
    meanflow: MeanFlowConfig = MeanFlowConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Checks `value` against annotation `tp`, converting only lossless cases (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", elem, v) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, arm, value)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' has the wrong type: {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads exponents without a dot ("1e-9") as strings; a number is meant.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(
            f"config key '{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return value


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{near[0]}'?)" if near else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""

    def conv(x):
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(dataclasses.asdict(cfg))


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=1` -> ('a.b', 1); the value is parsed as YAML so lists and numbers keep their types."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Default config, updated by the YAML file at `path`, then by `key=value` overrides."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {path}")
        if not p.is_file():  # a directory, /dev/null, a pipe
            raise ConfigError(f"config file {path} is not a regular file")
        try:
            loaded = yaml.safe_load(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {first_line(e)}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def from_dict(tree: dict) -> Config:
    """A config from a plain nested dict (e.g. one saved in a checkpoint), checked like `load`."""
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def _floats(node: Any, prefix: str = ""):
    """(dotted key, value) of every float setting, list entries included."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _floats(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, tuple):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))


# (low, high, low inclusive, high inclusive) of float settings whose range the types cannot say;
# finiteness is checked for every float.
RANGES = {
    "optim.lr": (0, None, False, None), "optim.weight_decay": (0, None, True, None),
    "optim.b1": (0, 1, True, False), "optim.b2": (0, 1, True, False), "optim.clip_norm": (0, None, True, None),
    "model.memory_lr_max": (0, 1, False, True),
    "data.reset_prob": (0, 1, True, True), "meanflow.cfg_t_min": (0, 1, True, True), "meanflow.cfg_t_max": (0, 1, True, True),
}


def _check_range(key: str, value: float) -> None:
    low, high, low_in, high_in = RANGES[key]
    if (low is not None and (value < low or (value == low and not low_in))) or (
            high is not None and (value > high or (value == high and not high_in))):
        lo = "-inf" if low is None else f"{'[' if low_in else '('}{low}"
        hi = "inf)" if high is None else f"{high}{']' if high_in else ')'}"
        raise ConfigError(f"config key '{key}' must be in {lo}, {hi}, got {value}")


def _validate_numbers(cfg: Config) -> None:
    for key, value in _floats(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}' must be a finite number, got {value}")
        if key in RANGES:
            _check_range(key, value)
    if any(v < 0 for v in cfg.optim.level_lr_scale):
        raise ConfigError(f"optim.level_lr_scale entries must be >= 0, got {list(cfg.optim.level_lr_scale)}")
    if not 0 <= cfg.seed < 2**63:  # JAX keys and NumPy generators take it as a non-negative int64
        raise ConfigError(f"seed must be in [0, 2^63), got {cfg.seed}")
    if cfg.meanflow.eval_samples < 0 or cfg.meanflow.eval_samples == 1:
        # the energy distance needs two samples: found here, not after training
        raise ConfigError(f"meanflow.eval_samples must be 0 (all) or >= 2, got {cfg.meanflow.eval_samples}")
    if cfg.train.max_skipped < 0:
        raise ConfigError(f"train.max_skipped must be >= 0, got {cfg.train.max_skipped}")
    if cfg.model.name != "dit" and cfg.model.vocab_size < 256:
        # the text task reads bytes: token ids 0..255 index the embedding
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the 256 byte values of the text data")


def validate(cfg: Config) -> None:
    """Semantic checks that types alone cannot express."""
    _validate_numbers(cfg)
    if not cfg.cms.periods or any(p < 1 for p in cfg.cms.periods):
        raise ConfigError(f"cms.periods must be a non-empty list of positive integers, got {list(cfg.cms.periods)}")
    if cfg.train.steps < 0 or cfg.train.batch_size < 1 or cfg.train.seq_len < 1 or cfg.train.accum_steps < 1:
        raise ConfigError("train.steps must be >= 0 and train.batch_size, train.seq_len, train.accum_steps >= 1")
    if cfg.train.log_every < 1 or cfg.eval.every < 0 or cfg.eval.batches < 0 or cfg.eval.stream_steps < 0:
        raise ConfigError("train.log_every must be >= 1, eval.every, eval.batches and eval.stream_steps >= 0")
    if cfg.train.profile_steps < 0 or cfg.train.profile_start < 0:
        raise ConfigError("train.profile_steps and train.profile_start must be >= 0")
    if cfg.optim.clip_norm < 0:
        raise ConfigError(f"optim.clip_norm must be >= 0 (0: off), got {cfg.optim.clip_norm}")
    if cfg.optim.base_batch_size < 1:
        raise ConfigError(f"optim.base_batch_size must be >= 1, got {cfg.optim.base_batch_size}")
    if cfg.throughput.reps < 1 or cfg.throughput.peak_tflops < 0:
        raise ConfigError("throughput.reps must be >= 1 and throughput.peak_tflops >= 0")
    if cfg.mesh.inter == 0 or cfg.mesh.inter < -1 or cfg.mesh.intra == 0 or cfg.mesh.intra < -1:
        raise ConfigError(f"mesh.inter and mesh.intra must be positive or -1, got {cfg.mesh.inter}, {cfg.mesh.intra}")
    if cfg.distributed.timeout_s < 1 or cfg.distributed.check_every < 0:
        raise ConfigError("distributed.timeout_s must be >= 1 and distributed.check_every >= 0")
    if cfg.optim.level_lr_scale and len(cfg.optim.level_lr_scale) != len(cfg.cms.periods):
        raise ConfigError(
            f"optim.level_lr_scale has {len(cfg.optim.level_lr_scale)} entries but cms.periods has "
            f"{len(cfg.cms.periods)} levels"
        )
    if cfg.model.vocab_size < 1 or cfg.model.dim < 1 or cfg.model.depth < 1:
        raise ConfigError("model.vocab_size, model.dim and model.depth must be >= 1")
    m = cfg.model
    for key in ("hidden_mult", "heads", "window", "memory_heads", "memory_dim", "memory_hidden", "memory_chunk",
                "memory_unroll"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} must be >= 1, got {getattr(m, key)}")
    if cfg.sync.max_grad_norm < 0 or cfg.sync.intra_bandwidth_gbps <= 0 or cfg.sync.inter_bandwidth_gbps <= 0:
        raise ConfigError("sync.max_grad_norm must be >= 0 and sync.intra/inter_bandwidth_gbps > 0")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(
            f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {cfg.checkpoint.every}, {cfg.checkpoint.keep}"
        )
    if not 0 < cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction must be between 0 and 1 (exclusive), got {cfg.data.eval_fraction}")
    if cfg.data.corpus == "recall":
        _validate_recall(cfg)
    if m.name == "nl_lm":
        if m.dim % m.heads or (m.dim // m.heads) % 2:
            raise ConfigError(f"model.dim={m.dim} must split into model.heads={m.heads} heads of even width")
        bad = [i for i in m.memory_layers if not 0 <= i < m.depth]
        if bad:
            raise ConfigError(f"model.memory_layers {bad} out of range for model.depth={m.depth}")
        if m.memory_conv < 0:
            raise ConfigError(f"model.memory_conv must be >= 0, got {m.memory_conv}")
        if m.memory_layers and m.memory_chunk > m.window:
            # inside a chunk every write is a gradient taken at the chunk start (scaled down when
            # the chunk's keys overlap): attention must cover the chunk in full
            raise ConfigError(
                f"model.memory_chunk={m.memory_chunk} must be <= model.window={m.window}: otherwise tokens "
                "inside a chunk are reachable by neither attention nor the memory"
            )
        if m.memory_layers and cfg.train.seq_len % m.memory_chunk:
            raise ConfigError(
                f"train.seq_len={cfg.train.seq_len} must be a multiple of model.memory_chunk={m.memory_chunk}"
            )
    if m.name == "dit":
        _validate_dit(cfg)


def _validate_recall(cfg: Config) -> None:
    from nljax.data.recall import attention_reach, pair_len  # the layout's sizes live there

    d, m = cfg.data, cfg.model
    if d.recall_docs < 2 or d.recall_pairs < 1:
        raise ConfigError(f"data.recall_docs must be >= 2 and data.recall_pairs >= 1, got {d.recall_docs}, {d.recall_pairs}")
    if not 1 <= d.recall_key_len <= 8 or not 1 <= d.recall_value_len <= 64:
        raise ConfigError(f"data.recall_key_len must be in [1, 8] and data.recall_value_len in [1, 64], got "
                          f"{d.recall_key_len}, {d.recall_value_len}")
    if d.recall_pairs > 26**d.recall_key_len:
        raise ConfigError(f"data.recall_pairs={d.recall_pairs} distinct keys of data.recall_key_len={d.recall_key_len} "
                          f"letters: at most {26**d.recall_key_len}")
    reach = attention_reach(m.depth, m.window)
    if d.recall_gap < reach:
        raise ConfigError(f"data.recall_gap={d.recall_gap} must be >= the attention's reach model.depth * "
                          f"(model.window - 1) = {reach}, or attention alone could answer the queries")
    need = 2 * d.recall_pairs * pair_len(d.recall_key_len, d.recall_value_len) + d.recall_gap + 1
    if need > cfg.train.seq_len:
        raise ConfigError(f"a recall document of data.recall_pairs={d.recall_pairs} pairs and data.recall_gap="
                          f"{d.recall_gap} needs up to {need} bytes, more than train.seq_len={cfg.train.seq_len}")
    if cfg.eval.stream_steps < 1:
        raise ConfigError("data.corpus=recall is evaluated by the streaming evaluation: eval.stream_steps must be >= 1")


def _validate_dit(cfg: Config) -> None:
    m, mf, im = cfg.model, cfg.meanflow, cfg.images
    if len(cfg.cms.periods) != 1:
        raise ConfigError(
            f"model.name=dit keeps every parameter at level 0: set cms.periods to one period (e.g. [1]), "
            f"got {list(cfg.cms.periods)}"
        )
    if m.dim % m.heads or m.patch_size < 1:
        raise ConfigError(f"model.dim={m.dim} must split into model.heads={m.heads} heads; model.patch_size >= 1")
    if not 0 <= mf.r_fraction <= 1 or not 0 <= mf.label_dropout < 1:
        raise ConfigError("meanflow.r_fraction must be in [0, 1] and meanflow.label_dropout in [0, 1)")
    if mf.time_sigma <= 0 or mf.adaptive_p < 0 or mf.adaptive_c <= 0:
        raise ConfigError("meanflow.time_sigma and meanflow.adaptive_c must be > 0, meanflow.adaptive_p >= 0")
    if mf.sample_steps < 1:
        raise ConfigError("meanflow.sample_steps must be >= 1")
    if mf.cfg_t_min > mf.cfg_t_max:
        raise ConfigError(f"meanflow.cfg_t_min={mf.cfg_t_min} must be <= meanflow.cfg_t_max={mf.cfg_t_max}")
    if not 0 < im.eval_fraction < 1 or im.toy_points < 2:
        raise ConfigError("images.eval_fraction must be in (0, 1) and images.toy_points >= 2")
    if im.source == "file" and not im.path:
        raise ConfigError("images.source=file needs images.path (a .npy or .npz file)")
