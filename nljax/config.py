"""Typed, frozen configuration: YAML files plus `dotted.key=value` overrides.

Every section is a frozen dataclass declared beside the code that owns it, with a `check()` for
its own rules and `RANGES` for the bounds of its float fields; `Config` composes them, one field
per section. Loading is generic: it walks the dataclass fields, so an unknown key or a value of
the wrong type is rejected with one line that names the key (and the nearest valid one) instead
of surfacing later as a shape error deep inside a jitted step. Rules that tie sections together
are in `nljax/crosschecks.py`; keys that moved are in `MOVED`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from nljax.checkpoint.settings import CheckpointConfig
from nljax.crosschecks import check_across_sections
from nljax.data.images import ImagesConfig
from nljax.data.settings import DataConfig, PrepareConfig
from nljax.engine.conductor import CMSConfig
from nljax.engine.optim import UNREAD, OptimConfig
from nljax.engine.sync import SyncConfig
from nljax import yamlread
from nljax.errors import ConfigError, first_line
from nljax.models.meanflow import MeanFlowConfig
from nljax.models.settings import ModelConfig
from nljax.parallel.mesh import MeshConfig
from nljax.runtime.runsettings import DistributedConfig, EvalConfig, RunConfig, ThroughputConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Config:
    """The registry of sections: config key -> section, each declared where the comment says."""

    seed: int = 0  # the seed of parameters, data order and every random draw: same seed, same mesh, same losses
    run: RunConfig = RunConfig()  # nljax/runtime/runsettings.py, like train, eval, distributed, throughput
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()  # nljax/parallel/mesh.py
    cms: CMSConfig = CMSConfig()  # nljax/engine/conductor.py
    sync: SyncConfig = SyncConfig()  # nljax/engine/sync.py
    # nljax/models/settings.py (model.nl_lm, model.dit, a plugin's model.<name>: beside each model)
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig.resolved()())
    optim: OptimConfig = OptimConfig()  # nljax/engine/optim.py
    data: DataConfig = DataConfig()  # nljax/data/settings.py, like prepare
    prepare: PrepareConfig = PrepareConfig()
    eval: EvalConfig = EvalConfig()
    distributed: DistributedConfig = DistributedConfig()
    throughput: ThroughputConfig = ThroughputConfig()
    images: ImagesConfig = ImagesConfig()  # nljax/data/images.py
    meanflow: MeanFlowConfig = MeanFlowConfig()  # nljax/models/meanflow.py
    checkpoint: CheckpointConfig = CheckpointConfig()  # nljax/checkpoint/settings.py


# Keys that moved, old -> new. Loading an old key is an error naming the new one; a saved config
# (a checkpoint's metadata) is read through `migrate`, so checkpoints written before still restore.
_NL_LM_KEYS = ("window", "memory_layers", "memory_kind", "memory_heads", "memory_dim", "memory_hidden", "memory_chunk",
               "memory_lr_max", "memory_conv", "memory_out_norm", "memory_out_gate", "memory_unroll")
MOVED = {**{f"model.{k}": f"model.nl_lm.{k}" for k in _NL_LM_KEYS}, "model.patch_size": "model.dit.patch_size",
         "data.corpus": "data.source", "run.tensorboard": "run.trackers"}
# Moved keys whose value changed form: old key -> (the new key's value from the old one, how the
# new key is written, for the error line).
CONVERTED = {"run.tensorboard": (lambda on: ["tensorboard"] if on else [],
                                 "a list: run.trackers=[tensorboard], [tensorboard,wandb] or []")}

# Keys added to sections that a checkpoint must match (`model`, `cms`), and keys whose default
# is not what the code did before they existed (optim.decay_params: weight decay applied to every
# parameter), with the value that does what the code did then: a checkpoint saved before reads as
# having it, and its run resumes as it trained. Other absent keys stay absent (a resume names them:
# "(checkpoint: (absent))").
ADDED = {"model.nl_lm.scan_layers": False, "model.nl_lm.memory_embed": False, "model.nl_lm.memory_impl": "scan",
         "model.nl_lm.attention": "blocked", "model.nl_lm.embed_grad": "scatter", "model.nl_lm.loss_chunk": 0,
         "optim.decay_params": "all", "optim.min_lr_ratio": 0.1, "optim.decay_fraction": 0.2,
         "optim.eps": 1e-8, "optim.momentum": 0.0, "optim.ema_decay": 0.0}

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


def _moved(old: str) -> str:
    how = f" ({CONVERTED[old][1]})" if old in CONVERTED else ""
    return f"{old} moved to {MOVED[old]}{how}"


# ---------------------------------------------------------------------------------------------
# The generic loader


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Checks `value` against annotation `tp`, converting only lossless cases (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    tp = _resolved(tp)
    if value is None and origin not in (typing.Union, types.UnionType) and tp is not type(None):
        raise ConfigError(_no_value(key))  # `steps:` with nothing after it: "must be int, got NoneType None"
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        if isinstance(value, str) and elem is not str and ("," in value or value.startswith("(")):
            # a list in another syntax (cms.periods=1,2 or (1,2)): read as a list of one string, the
            # line named its first item ("'cms.periods[0]' must be int, got str '1,2'")
            raise ConfigError(f"config key '{key}' must be a list, written [a, b, ...]: got {value!r}")
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            value = [value]  # one entry is a list of one: run.trackers=wandb, data.train=corpus/*.txt
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", elem, v) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, arm, value)
            except ConfigError:
                pass
        arms = [f"one of {list(typing.get_args(a))}" if typing.get_origin(a) is typing.Literal else _type_name(a)
                for a in typing.get_args(tp) if a is not type(None)]
        raise ConfigError(f"config key '{key}' must be {' or '.join(arms)}, got {value!r}")
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


def _no_value(key: str) -> str:
    return f"config key '{key}' has no value (null): give one, or leave the key out for its default"


def _first_null(tree: dict, prefix: str = "") -> str | None:
    """The first key of `tree` left without a value (`steps:` with nothing after it), sections
    aside (`train:` alone is an empty section)."""
    for k, v in tree.items():
        if isinstance(v, dict):
            if (found := _first_null(v, f"{prefix}{k}.")) is not None:
                return found
        elif v is None and f"{prefix}{k}" not in SECTIONS:
            return f"{prefix}{k}"
    return None


def _resolved(tp: Any) -> Any:
    """The class a section is built as: its `resolved()` where it has one (`model`: a field per
    registered model's settings, nljax/models/settings.py), else itself."""
    return tp.resolved() if isinstance(tp, type) and hasattr(tp, "resolved") else tp


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            if f"{prefix}{key}" in MOVED:
                raise ConfigError(_moved(prefix + key))
            section, dot, leaf = str(key).partition(".")
            if dot and section in names:  # `train.steps: 3` in a file: the override's spelling
                raise ConfigError(f"config key '{prefix}{key}': a config file nests its keys ({section}: then "
                                  f"'{leaf}: ...' indented under it); the dotted form is for command-line overrides")
            near = [prefix + n for n in difflib.get_close_matches(str(key), names, n=1)]
            # a key of another section under this one (train.lr: optim.lr) is named where no key
            # here is close: the list of this section's keys would not show it
            near = near or _in_other_sections(str(key), prefix)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def _in_other_sections(key: str, prefix: str) -> list[str]:
    """The dotted names of the sections' keys spelt `key`, in sections other than `prefix`."""
    found = []
    for section, tp in typing.get_type_hints(Config).items():
        tp = _resolved(tp)
        if dataclasses.is_dataclass(tp) and f"{section}." != prefix and key in {f.name for f in dataclasses.fields(tp)}:
            found.append(f"{section}.{key}")
    return found


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""

    def conv(x):
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return own_model(conv(dataclasses.asdict(cfg)))


def own_model(tree: dict) -> dict:
    """`tree` (a config as a dict) with only its selected model's own section under `model`
    (`model.<model.name>`), beside the keys every model shares: the other registered models'
    sections say nothing about the run. Kept, they made what a run saved depend on which models
    the process had registered: a plugin registered (or installed, or removed) since made every
    earlier run's checkpoint "not fit" (`model.tiny=(absent) there`) or its config.yaml an
    "unknown config key"."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return tree
    name = model.get("name", ModelConfig.name)
    return {**tree, "model": {k: v for k, v in model.items() if not isinstance(v, dict) or k == name}}


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """`tree` with the override `dotted=value` applied. A section given whole (`cms={periods:
    [1,8]}`) updates the keys it names, as a config file's section does; the section's other keys
    keep the values below it (a resume's saved ones), not their defaults."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = child
    old = node.get(parts[-1])
    node[parts[-1]] = _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=1` -> ('a.b', 1); the value is parsed as YAML so lists and numbers keep their types,
    except that a string setting (or one string of a list setting) takes the text as written,
    unless quoted: run.dir=007, checkpoint.resume=4, data.train=2024, run.dir=a #b,
    data.doc_end_token=[SEP] (YAML would read 7, 4, 2024, a comment and a list)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yamlread.load(raw, f"override {key}") if raw.strip() else ""
    except yaml.YAMLError as e:
        if raw.lstrip().startswith(("[", "{")) and _field_type(key) not in (str, None):
            # a list or mapping meant, not a string: say so, not that its first item is a string
            raise ConfigError(f"override {key}={raw}: not a valid list or mapping "
                              f"({getattr(e, 'problem', None) or first_line(e)})") from None
        value = raw
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
    tp = _field_type(key)
    # a string setting takes [..] as written too (data.doc_end_token=[SEP], a BERT tokenizer's end
    # token, read as the list ['SEP'] was refused as "must be str"); a list setting reads it as a list
    if not quoted and (tp is str or (tp == tuple[str, ...] and not isinstance(value, list))):
        value = raw
    return key, value


def _field_type(dotted: str) -> Any:
    """The annotation of the config key `dotted` (section.key), or None where there is none."""
    node: Any = Config
    for part in dotted.strip().split("."):
        if not dataclasses.is_dataclass(node):
            return None
        node = _resolved(typing.get_type_hints(node).get(part))
    return node


# The configs shipped with the package (`--config NAME` finds one by name: nl_gpu, nl_gpu.yaml)
PACKAGED = Path(__file__).parent / "configs"


def packaged_configs() -> list[str]:
    """The names of the packaged configs (nljax/configs/NAME.yaml)."""
    return sorted(p.stem for p in PACKAGED.glob("*.yaml"))


def config_path(path: str) -> Path:
    """The config file `path` names: an existing file (it wins), else a packaged config by name
    (`nl_gpu`, `nl_gpu.yaml`, or `configs/nl_gpu.yaml`, where the configs were before they moved
    into the package, so that older commands keep working)."""
    p = Path(os.path.expanduser(path))
    if p.exists():
        return p
    stem = p.name[: -len(p.suffix)] if p.suffix in (".yaml", ".yml") else p.name
    bare = p.parent == Path(".") or (not p.is_absolute() and p.parent == Path("configs"))
    if bare and (PACKAGED / f"{stem}.yaml").is_file():
        return PACKAGED / f"{stem}.yaml"
    raise ConfigError(f"config file not found: {path} (neither a file nor a packaged config: "
                      f"{', '.join(packaged_configs())})")


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line that still says where: its problem and line/column, then what it
    was parsing and where that began (the message's first line alone, 'while parsing a flow
    sequence', named neither the problem nor a line)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return first_line(e)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, begun = getattr(e, "context", None), getattr(e, "context_mark", None)
    within = f" ({context} at line {begun.line + 1}, column {begun.column + 1})" if context and begun else ""
    return f"{at}{problem}{within}"


def _settings_in(tree: Any) -> bool:
    """Whether a loaded YAML tree sets anything (`train: {}` or `train:` alone sets nothing)."""
    return any(_settings_in(v) for v in tree.values()) if isinstance(tree, dict) else tree is not None


def _read_yaml(path: str, saved: bool = False, label: str | None = None) -> dict:
    """The settings in the YAML file `path` (`saved`: a run's config.yaml, which nljax wrote;
    `label`: how its lines name it, `path` by default)."""
    p = config_path(path)
    path = path if label is None else label
    if not p.is_file():  # a directory, /dev/null, a pipe
        raise ConfigError(f"config file {path} is not a regular file")
    try:
        loaded = yamlread.load(p.read_bytes().decode("utf-8"), f"config file {path}")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(e)}") from None
    if loaded is None or not _settings_in(loaded):  # a file saved before it was written, the wrong file
        if isinstance(loaded, dict) and (null := _first_null(loaded)) is not None:  # `steps:` alone: a key, no value
            raise ConfigError(f"config file {path}: {_no_value(null)}")
        if isinstance(loaded, dict) and (empty := _empty_sections(loaded)):  # `model:` alone: named, as beside others
            raise ConfigError(f"config file {path}: {_empty_section(empty[0])}")
        hint = ("a run's config.yaml holds every setting, this is not the one nljax.train wrote" if saved
                else "give some, or leave --config out for the defaults")
        raise ConfigError(f"config file {path} holds no settings: {hint}")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    empty = _empty_sections(loaded)
    if empty:  # `train:` with nothing under it: an override of train.x would be blamed for it
        raise ConfigError(f"config file {path}: {_empty_section(empty[0])}")
    return loaded


def _empty_sections(tree: dict) -> list[str]:
    """The sections of a loaded file left without a value (`train:` with nothing indented under it)."""
    return [k for k, v in tree.items() if v is None and k in SECTIONS]


def _empty_section(name: str) -> str:
    return f"section '{name}' is empty (nothing indented under '{name}:')"


def as_files(path: str | typing.Sequence[str] | None) -> list[str]:
    """The config files `path` names, in order: none, one, or several (`--config A --config B`)."""
    return [] if path is None else [str(path)] if isinstance(path, (str, os.PathLike)) else [str(p) for p in path]


def load(path: str | typing.Sequence[str] | None = None, overrides: typing.Sequence[str] = (), saved: bool = False,
         base: str | None = None, check: bool = True) -> Config:
    """Default config, updated by the YAML file at `path` (or by several, each updating the ones
    before it key by key: `--config A --config B`), then by `key=value` overrides. A user's file
    may name a `base_config` of its own, read first (`_read_layers`).
    `saved`: the file is one nljax wrote (a run's config.yaml), read with its moved keys in their
    new place (`migrate`) like a checkpoint's config; a user's file with an old key is refused.
    `base`: a config.yaml nljax wrote, read first (migrated), which the files then update key by key
    (`--resume` with `--config`: the run's saved config, then the user's files, then overrides).
    `check`: validate the settings together (False: each key's type only)."""
    ModelConfig.resolved()  # the model registry first: a plugin that fails to load is its own line, not the file's
    tree: dict = {}
    for one in as_files(path):  # each file alone first: a wrong key or value there names that file
        if saved:
            layer = _built_from(one, _saved(one))
        else:
            layer = _read_layers(config_path(one), one, ())
        tree = _merged(tree, layer)
    if base is not None:  # a run's config.yaml too: the line named a key the command line did not hold
        tree = _merged(_built_from(base, _saved(base)), tree)
    _override(tree, overrides)
    cfg = _home_expanded(_build(Config, tree))
    if check:
        validate(cfg)
    return cfg


def _override(tree: dict, overrides: typing.Sequence[str]) -> None:
    """Sets each `key=value` of `overrides` in `tree`, in order."""
    for text in overrides:
        key, value = parse_override(text)
        if key == BASE_KEY:  # read from a file's top level only: the command line names the file instead
            raise ConfigError(f"{BASE_KEY} is a config file's key (a YAML file's top-level '{BASE_KEY}: {value}'); "
                              f"on the command line give the file itself: --config {value}")
        if key.lower() in INHERITS:  # as in a file (`_built_from`): its line listed the sections alone
            raise ConfigError(f"unknown config key '{key}' (a config builds on another with a YAML file's top-level "
                              f"'{BASE_KEY}: {value}'; on the command line give the file itself: --config {value})")
        _set_dotted(tree, key, value)


def _saved(path: str) -> dict:
    """The settings of the config.yaml nljax wrote at `path`, migrated (`migrate`); a model this
    process has not registered is said as such (its section was an "unknown config key")."""
    tree = migrate(_read_yaml(path, saved=True))
    name = tree.get("model", {}).get("name") if isinstance(tree.get("model"), dict) else None
    if isinstance(name, str):
        from nljax.models import registry

        registered = sorted(s.name for s in registry.specs())
        if name not in registered:
            raise ConfigError(
                f"config file {path}: the run's model '{name}' is not registered in this process (registered: "
                f"{', '.join(registered)}): run the command where it is, a script's model through that "
                f"script as the run's last lines say (python SCRIPT COMMAND, ./SCRIPT COMMAND), a package's "
                f"through its '{registry.GROUP}' entry point") from None
    return tree


BASE_KEY = "base_config"  # a user's file's top-level key: the config it updates (`_read_layers`)


def _read_layers(path: Path, shown: str, chain: tuple[tuple[Path, str], ...], includer: str | None = None) -> dict:
    """The settings of the user's config file `path` (`shown`: as the user would name it;
    `includer`: the file whose base_config it is) on top of its `base_config`, and that one's on
    top of its own, in turn. Each file's own keys are checked alone, so that a wrong one names its
    file. `chain`: the files including this one, each (resolved, shown): one met again is a cycle."""
    label = shown if includer is None else f"{shown} (the base_config of {includer})"
    tree = _read_yaml(str(path), label=label)
    given = BASE_KEY in tree
    name = tree.pop(BASE_KEY, None)
    _built_from(label, tree)
    if not given:
        return tree
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"config file {label}: {BASE_KEY} must name a packaged config or a YAML file, got {name!r}")
    chain = (*chain, (path.resolve(), shown))
    found, base_shown = _base_path(name, path, shown, label)
    if any(found.resolve() == seen for seen, _ in chain):
        loop = " -> ".join([*(s for _, s in chain), base_shown])
        raise ConfigError(f"config file {label}: {BASE_KEY} {name} makes a cycle ({loop}): a config cannot "
                          "build on itself")
    return _merged(_read_layers(found, base_shown, chain, shown), tree)


def set_in(files: str | typing.Sequence[str] | None, dotted: str) -> str | None:
    """Where the config files `files` (in order, each on top of the ones before) set the key
    `dotted`, as a line names it: "--config B" (the last file that sets it), or "A.yaml (the
    base_config of --config B)" where B's base_config chain set it; None where none sets it. For a
    refusal naming a key (a resume's), so that a user of layered configs knows which file to edit."""
    for one in reversed(as_files(files)):
        path, shown, label = config_path(one), one, f"--config {one}"
        seen: set[Path] = set()
        while path.resolve() not in seen:  # a cycle is refused by `load` before any refusal names a key
            seen.add(path.resolve())
            tree = _read_yaml(str(path), label=label)
            if _holds(tree, dotted):
                return label
            name = tree.get(BASE_KEY)
            if not isinstance(name, str) or not name.strip():
                break
            path, shown = _base_path(name, path, shown, label)
            label = f"{shown} (the base_config of {label})"
    return None


def _holds(tree: dict, dotted: str) -> bool:
    """Whether the settings `tree` (a file's) hold the key `dotted` (section.key)."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _base_path(name: str, including: Path, shown: str, label: str) -> tuple[Path, str]:
    """The file that `base_config: name` in the file `including` (shown as `shown`, named in a
    line as `label`) names, and how a line shows it: a YAML path, relative to `including`'s
    folder, else a packaged config by name (a file there wins, as it does for `--config`)."""
    p = Path(os.path.expanduser(name))
    local = p if p.is_absolute() else including.parent / p
    mine = Path(os.path.expanduser(shown))
    # as the user would write it from where they are (a packaged includer: where it is)
    here = p if p.is_absolute() else (mine.parent / p if mine == including else local)
    if local.is_file():  # a folder of the same name (runs/nl_gpu) is not the base
        return local, str(here)
    stem = p.name[: -len(p.suffix)] if p.suffix in (".yaml", ".yml") else p.name
    bare = not p.is_absolute() and p.parent == Path(".")  # a name alone may be a packaged config's
    if bare and (PACKAGED / f"{stem}.yaml").is_file():
        return PACKAGED / f"{stem}.yaml", name
    # the path tried, its '..' folded (../base.yaml from conf/a.yaml: base.yaml, not conf/../base.yaml)
    # unless a symbolic link makes the folded path another file
    tried = os.path.normpath(here)
    tried = tried if Path(os.path.normpath(local)).resolve() == local.resolve() else str(here)
    if not bare:  # a path: no packaged config was looked for, so none is offered
        where = "" if p.is_absolute() else f" (a relative {BASE_KEY} is read from the folder of the file naming it)"
        raise ConfigError(f"config file {label}: {BASE_KEY} {name} not found: no file {tried}{where}")
    near = difflib.get_close_matches(stem, packaged_configs(), n=1)  # a misspelt packaged name: nl_gpuu
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ConfigError(f"config file {label}: {BASE_KEY} {name} not found (neither {tried} nor a packaged "
                      f"config: {', '.join(packaged_configs())}){hint}")


# Settings naming a path of the run's: `~` expanded, as the shell does in an assignment but
# not in an argument (`run.dir=~/runs/x`): a run wrote into a folder named '~' in the current
# directory, and generate, export and --resume looked there; images.path was "not found". The text
# data paths' readers expand theirs.
HOME_EXPANDED = (("run", "dir"), ("run", "compile_cache"), ("checkpoint", "dir"), ("checkpoint", "resume"),
                 ("images", "path"))


def _home_expanded(cfg: Config) -> Config:
    for section, key in HOME_EXPANDED:
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and value.startswith("~"):  # not "auto", "none", "latest"
            part = dataclasses.replace(getattr(cfg, section), **{key: os.path.expanduser(value)})
            cfg = dataclasses.replace(cfg, **{section: part})
    return cfg


# other tools' keys for the config a file builds on (Hydra's defaults, OmegaConf/YAML habits):
# the file's own unknown-key line listed the sections alone, which base_config is not among
INHERITS = frozenset({"base", "bases", "extends", "extend", "defaults", "inherit", "inherits", "include",
                      "parent", "base_cfg", "baseconfig", "base-config"})


def _built_from(path: str, tree: dict) -> dict:
    """`tree`, the settings of the file `path`, once they build a config; else one line naming the file."""
    for key in tree:
        if isinstance(key, str) and key.lower() in INHERITS:
            raise ConfigError(f"config file {path}: unknown config key '{key}' (did you mean '{BASE_KEY}'? a file "
                              f"builds on another config with '{BASE_KEY}: NAME', a packaged config or a YAML file)")
    try:
        _build(Config, tree)
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    return tree


def _merged(tree: dict, update: dict) -> dict:
    """`tree` with every key of `update` set, section by section (a copy)."""
    out = copy.deepcopy(tree)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def migrate(tree: dict) -> dict:
    """A copy of the saved config `tree` with every key of `MOVED` in its new place (its value
    converted where `CONVERTED` says), the keys of `ADDED` it lacks at their values, and a
    setting it holds that was never read (images.path of another images.source) left out."""
    tree = copy.deepcopy(tree)
    for old, new in MOVED.items():
        node, leaf = _parent(tree, old, create=False)
        if isinstance(node, dict) and leaf in node:
            value = node.pop(leaf)
            if old in CONVERTED:
                value = CONVERTED[old][0](value)
            node, leaf = _parent(tree, new, create=True)
            if isinstance(node, dict):  # else a malformed tree: `_build` names the key
                node.setdefault(leaf, value)  # a key saved in both places keeps its new one
    for key, value in ADDED.items():
        node, leaf = _parent(tree, key, create=False)
        if isinstance(node, dict):
            node.setdefault(leaf, value)
    images = tree.get("images")
    # images.path beside another images.source was never read (the run trained on that source);
    # refused since 2026-11-29 in a user's config, it is left out of a saved one, so that such a
    # run still resumes, evaluates, samples and loads as it trained
    if isinstance(images, dict) and images.get("path") and images.get("source", "digits") != "file":
        images["path"] = ""
    # optim.momentum and optim.nesterov beside adamw or lion were never read (refused since
    # 2026-12-01 in a user's config): left out of a saved one, so that such a run still resumes,
    # evaluates and loads (a checkpoint's config and its run's config.yaml alike: they must match)
    optim = tree.get("optim")
    if isinstance(optim, dict) and optim.get("name", "adamw") != "sgd":
        optim.update({k: v for k, v in (("momentum", 0.0), ("nesterov", False)) if k in optim})
    # likewise adamw's b1, b2 and eps beside a rule that reads them not (refused since 2026-12-02)
    if isinstance(optim, dict):
        optim.update({k: getattr(OptimConfig, k) for k in UNREAD.get(optim.get("name", "adamw"), ()) if k in optim})
    # model.dtype=bfloat16 beside cms_mlp was never read (refused since 2026-12-02): left out of a
    # saved one likewise
    model = tree.get("model")
    if isinstance(model, dict) and model.get("name") == "cms_mlp" and "dtype" in model:
        model["dtype"] = "float32"
    # data.source other than stdlib beside an images model was never read (it trained on images.*;
    # refused since 2026-12-02): the data section is left out of a saved one likewise
    data = tree.get("data")
    if isinstance(model, dict) and isinstance(data, dict) and data.get("source", "stdlib") != "stdlib":
        from nljax.models import registry

        if any(s.name == model.get("name") and s.task == "images" for s in registry.specs()):
            tree.pop("data")
    # the sections of models other than its own, which a config saved before 2026-11-29 holds
    # (every model registered in that process): another process need not have them
    return own_model(tree)


def _parent(tree: dict, key: str, create: bool) -> tuple[Any, str]:
    """(the node holding dotted `key` in `tree`, its last part); sections missing on the way are
    made with `create`, else the node is None (as it is where the tree is malformed)."""
    *path, leaf = key.split(".")
    node: Any = tree
    for part in path:
        if not isinstance(node, dict):
            return None, leaf
        node = node.setdefault(part, {}) if create else node.get(part)
    return node, leaf


def from_dict(tree: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """A config from a plain nested dict (e.g. one saved in a checkpoint or an export, old keys
    moved), with `key=value` overrides on top as `load` applies them, checked like `load`."""
    tree = migrate(tree)  # a copy: `tree` itself is left as it is
    _override(tree, overrides)
    cfg = _home_expanded(_build(Config, tree))
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Checks: float bounds, each section's own rules, then the rules across sections


def _check_floats(node: Any, prefix: str = "") -> None:
    """Every float setting (list entries included) is finite and inside its section's `RANGES`."""
    ranges = getattr(type(node), "RANGES", {})
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_floats(value, key + ".")
            continue
        entries = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, tuple) else [(key, value)]
        for k, v in entries:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config key '{k}' must be a finite number, got {v}")
            if isinstance(v, float) and abs(v) > FLOAT32_MAX:
                # settings reach the device as float32: a larger one is inf there (NaN steps, exit 0)
                raise ConfigError(f"config key '{k}' must be a finite number within float32's range "
                                  f"(|x| <= 3.4e38), got {v}")
        if isinstance(value, float) and f.name in ranges:
            low, high, low_in, high_in = ranges[f.name]
            if (low is not None and (value < low or (value == low and not low_in))) or (
                    high is not None and (value > high or (value == high and not high_in))):
                lo = "-inf" if low is None else f"{'[' if low_in else '('}{low}"
                hi = "inf)" if high is None else f"{high}{']' if high_in else ')'}"
                raise ConfigError(f"config key '{key}' must be in {lo}, {hi}, got {value}")


def validate(cfg: Config) -> None:
    """Semantic checks that types alone cannot express."""
    _check_floats(cfg)
    if not 0 <= cfg.seed < 2**32:  # jax.random.key keeps 32 bits (64-bit mode off): 2^32 + 7 would be 7
        raise ConfigError(f"seed must be in [0, 2^32), got {cfg.seed}")
    for f in dataclasses.fields(cfg):
        check = getattr(getattr(cfg, f.name), "check", None)
        if check is not None:
            check()
    check_across_sections(cfg)


SECTIONS = frozenset(k for k, t in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(t))
TOP_LEVEL = frozenset(f.name for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(f.default))


def check_setting(key: str, known) -> None:
    """A tool's `key=value` that is neither one of its `known` settings nor a config key (config
    keys are dotted, section.key, or top-level like `seed`): one line, with the nearest setting."""
    if key not in known and "." not in key and key not in TOP_LEVEL:
        near = difflib.get_close_matches(key, list(known), n=1)
        hint = f": did you mean '{near[0]}'?" if near else ""  # none: no colon before the list ("'x': (settings")
        raise ConfigError(f"unknown setting '{key}'{hint} (settings: {', '.join(known)}; config "
                                 "overrides are dotted, e.g. model.dim=128)")
