"""Typed, frozen configuration: YAML files plus `dotted.key=value` overrides.

Every section is a frozen dataclass. Loading walks the dataclass fields, so an unknown key or a
value of the wrong type is rejected with one line that names the key (and the nearest valid
one) instead of surfacing later as a shape error deep inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    overwrite: bool = False  # replace the files of an earlier run in run.dir
    quiet: bool = False
    tensorboard: bool = True  # TensorBoard event files in run.dir
    plots: bool = True  # loss.png and step_time.png in run.dir at the end


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global rows per optimizer step
    seq_len: int = 128
    accum_steps: int = 1  # micro-batches per optimizer step, accumulated on each device
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
    memory_kind: Literal["linear", "mlp"] = "mlp"
    memory_heads: int = 4
    memory_dim: int = 32  # per-head key/value width of the memory
    memory_hidden: int = 64  # hidden width of the 2-layer MLP memory
    memory_chunk: int = 16  # mini-batch b of the chunk-parallel inner loop
    memory_lr_max: float = 0.01  # cap of the inner loop's data-dependent step size theta
    memory_momentum_max: float = 0.9  # cap of its momentum eta (effective step ~ theta * chunk / (1 - eta))
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
    corpus: Literal["stdlib"] = "stdlib"
    eval_fraction: float = 0.05


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 100
    batches: int = 4


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
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}")
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


def validate(cfg: Config) -> None:
    """Semantic checks that types alone cannot express."""
    if not cfg.cms.periods or any(p < 1 for p in cfg.cms.periods):
        raise ConfigError(f"cms.periods must be a non-empty list of positive integers, got {list(cfg.cms.periods)}")
    if cfg.train.steps < 0 or cfg.train.batch_size < 1 or cfg.train.seq_len < 1 or cfg.train.accum_steps < 1:
        raise ConfigError("train.steps must be >= 0 and train.batch_size, train.seq_len, train.accum_steps >= 1")
    if cfg.train.log_every < 1 or cfg.eval.every < 0 or cfg.eval.batches < 0:
        raise ConfigError("train.log_every must be >= 1, eval.every and eval.batches >= 0")
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
    for key in ("hidden_mult", "heads", "window", "memory_heads", "memory_dim", "memory_hidden", "memory_chunk"):
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
    if m.name == "nl_lm":
        if m.dim % m.heads or (m.dim // m.heads) % 2:
            raise ConfigError(f"model.dim={m.dim} must split into model.heads={m.heads} heads of even width")
        bad = [i for i in m.memory_layers if not 0 <= i < m.depth]
        if bad:
            raise ConfigError(f"model.memory_layers {bad} out of range for model.depth={m.depth}")
        if m.memory_layers and cfg.train.seq_len % m.memory_chunk:
            raise ConfigError(
                f"train.seq_len={cfg.train.seq_len} must be a multiple of model.memory_chunk={m.memory_chunk}"
            )
    if m.name == "dit":
        _validate_dit(cfg)


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
    if mf.sample_steps < 1 or mf.eval_samples < 0:
        raise ConfigError("meanflow.sample_steps must be >= 1 and meanflow.eval_samples >= 0")
    if not 0 < im.eval_fraction < 1 or im.toy_points < 2:
        raise ConfigError(f"images.eval_fraction must be in (0, 1) and images.toy_points >= 2")
    if im.source == "file" and not im.path:
        raise ConfigError("images.source=file needs images.path (a .npy or .npz file)")
