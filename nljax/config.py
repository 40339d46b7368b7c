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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global rows per optimizer step
    seq_len: int = 128
    accum_steps: int = 1  # micro-batches per optimizer step, accumulated on each device
    log_every: int = 10


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    inter: int = 1  # optimizer instances / hosts (slow network); -1 fills in the rest
    intra: int = -1  # devices inside one instance (fast interconnect); -1 fills in the rest


@dataclasses.dataclass(frozen=True)
class CMSConfig:
    periods: tuple[int, ...] = (1, 8, 64, 512)
    frozen_grads: Literal["accumulate", "skip"] = "accumulate"


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    reduce: Literal["flat", "hierarchical"] = "hierarchical"
    mean: bool = True  # average gradients over devices (True) or sum them (False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "nl_lm"  # registry key: nl_lm | cms_mlp
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
    clip_norm: float = 0.0  # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class DataConfig:
    corpus: Literal["stdlib"] = "stdlib"
    eval_fraction: float = 0.05


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 100
    batches: int = 4


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


def validate(cfg: Config) -> None:
    """Semantic checks that types alone cannot express."""
    if not cfg.cms.periods or any(p < 1 for p in cfg.cms.periods):
        raise ConfigError(f"cms.periods must be a non-empty list of positive integers, got {list(cfg.cms.periods)}")
    if cfg.train.steps < 0 or cfg.train.batch_size < 1 or cfg.train.seq_len < 1 or cfg.train.accum_steps < 1:
        raise ConfigError("train.steps must be >= 0 and train.batch_size, train.seq_len, train.accum_steps >= 1")
    if cfg.train.log_every < 1 or cfg.eval.every < 0 or cfg.eval.batches < 0:
        raise ConfigError("train.log_every must be >= 1, eval.every and eval.batches >= 0")
    if cfg.mesh.inter == 0 or cfg.mesh.inter < -1 or cfg.mesh.intra == 0 or cfg.mesh.intra < -1:
        raise ConfigError(f"mesh.inter and mesh.intra must be positive or -1, got {cfg.mesh.inter}, {cfg.mesh.intra}")
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
