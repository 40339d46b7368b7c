"""`register_model` and `ModelSpec`: how a model, nljax's own or a plugin's, enters the registry.

The lookups (`model.name` -> spec) and the discovery of plugins through the `nljax.models`
entry-point group are in `nljax.models.registry`; this module holds only the table they fill.
No JAX at import: a plugin's module imports this one at its own import.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from typing import Any, Callable, Iterable

from nljax.errors import ConfigError

Config = Model = Any  # nljax.config.Config and nljax.models.base.Model (not imported: no cycle)

GROUP = "nljax.models"  # the entry-point group plugins register under
TASKS = ("text", "images")  # nljax.run.tasks: what each task reads and how it is evaluated


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model: what the commands need to know of it without building it."""

    name: str  # `model.name`
    build: Callable[[Config], Model]  # the model of a config (its data are read here where they decide shapes)
    settings: type | None = None  # frozen dataclass: the config section `model.<name>.*`; None: shared keys only
    task: str = "text"  # "text": a language model (logits; generate writes text); "images": a MeanFlow denoiser
    check: Callable[[Config], None] | None = None  # rules of the whole config when this model is selected
    # entries for an export's config.json: what the model's data decided when it was built (the
    # DiT: {"images": {"shape", "num_classes"}}), so that `nljax.load_model` reads no data ...
    describe: Callable[[Model], dict] | None = None
    # ... and the model rebuilt from the config and the export's config.json (None: `build`)
    rebuild: Callable[[Config, dict], Model] | None = None
    # training FLOPs terms beyond 6 x matmul parameters (nljax.measure.flops), flops(cfg, model,
    # param_shapes) -> {"context": tokens a token attends to, "inner_memory_per_token": FLOPs,
    # and for a model whose unit is not a token "tokens_per_unit", "per_unit_param": name -> bool}
    flops: Callable[..., dict] | None = None
    # tokens back that attention alone reaches (the recall probe's gap must exceed it); None: 0
    reach: Callable[[Config], int] | None = None
    # the shared keys of `model` (dim, depth, heads, ...) that `build` reads; None: not said (any
    # may be). Said, those set to other than their defaults and not read are warned of (registry)
    shared: frozenset[str] | None = None
    origin: str = "nljax"  # who registered it, for messages: the plugin's entry point, or the build's module


_SPECS: dict[str, ModelSpec] = {}
# the registrant being loaded: an entry point while its module runs (else the build function's module)
_ORIGIN: list[str] = ["nljax"]


def register_model(name: str, build: Callable[[Config], Model], settings: type | None = None, *,
                   task: str = "text", check: Callable[[Config], None] | None = None,
                   describe: Callable[[Model], dict] | None = None,
                   rebuild: Callable[[Config, dict], Model] | None = None,
                   flops: Callable[..., dict] | None = None,
                   reach: Callable[[Config], int] | None = None,
                   shared: Iterable[str] | None = None) -> ModelSpec:
    """Register a model under `model.name=name`.

    `build(cfg) -> Model` makes it from a config (`nljax.models.base.Model`); `settings`, a frozen
    dataclass with a default for every field, becomes the config section `model.<name>`, loaded
    and checked like nljax's own (unknown key: one line with the nearest one; wrong type: one
    line; its `check()`, if any, runs on every load; its `RANGES` bound its floats). `task`:
    "text" or "images". `check(cfg)`: rules that apply only when this model is selected (raise
    `nljax.errors.ConfigError`). `describe`, `rebuild`, `flops`, `reach`: see `ModelSpec`.
    `shared`: the keys of the shared section `model.*` that `build` reads ("vocab_size", "dim",
    "hidden_mult", "depth", "heads", "dtype", "remat"); given, a run that sets one of the others
    gets one warning line naming it (it changes nothing); None: any may be read, nothing said.
    A name registered again by another registrant is refused; by the same one (a notebook's cell
    run again, the script or module that registered it), the new registration replaces the old."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"register_model: the name must be an identifier (it is the config key model.<name>), "
                          f"got {name!r}")
    # the script run registering it at its top level is its origin, wherever `build` is defined (a
    # launcher that imports the model's module): its closing commands go through that script
    caller = sys._getframe(1).f_globals.get("__name__")
    origin = "__main__" if caller == "__main__" and len(_ORIGIN) == 1 else _who(build)
    # the same registrant again replaces its model: a notebook's cell run again after an edit, a
    # module reloaded (refused, only a new process took the edit); another registrant is refused
    if name in _SPECS and _SPECS[name].origin != origin:
        raise ConfigError(f"model '{name}' is registered twice: by {_SPECS[name].origin} and by {_who(build)}")
    if name in ("name", *SHARED_KEYS):  # else every config load after it is refused, whatever model it selects
        raise ConfigError(f"model '{name}' ({_who(build)}): its name is a key of the model section (model.{name}): "
                          "register it under another")
    if not callable(build):  # else a TypeError when a run first builds it
        raise ConfigError(f"model '{name}': build must be a function of the config that returns the model, got "
                          f"{build!r}")
    if task not in TASKS:
        raise ConfigError(f"model '{name}' ({_who(build)}): task must be one of {', '.join(TASKS)}, got {task!r}")
    if settings is not None:
        _check_settings(f"model '{name}' ({_who(build)})", settings)
    if shared is not None:
        shared = _check_shared(f"model '{name}' ({_who(build)})", shared)
    spec = ModelSpec(name, build, settings, task, check, describe, rebuild, flops, reach, shared, origin)
    _SPECS[name] = spec
    return spec


def _who(build) -> str:
    """Who is registering: the plugin being loaded, else the module of the build function."""
    return _ORIGIN[-1] if len(_ORIGIN) > 1 else getattr(build, "__module__", None) or "nljax"


def _check_settings(where: str, settings: type) -> None:
    """The settings class must be a frozen dataclass whose fields all have defaults (the
    section's name must not be a shared key of `model`: nljax.models.settings checks it)."""
    if not dataclasses.is_dataclass(settings) or not isinstance(settings, type):
        raise ConfigError(f"{where}: settings must be a dataclass class, got {settings!r}")
    if not settings.__dataclass_params__.frozen:
        raise ConfigError(f"{where}: settings {settings.__name__} must be a frozen dataclass (configs are hashable)")
    try:
        settings()
    except TypeError as e:
        raise ConfigError(f"{where}: settings {settings.__name__} needs a default for every field ({e})") from None


# The keys of the section `model` that every model shares: `ModelConfig`'s fields but `name`
# (nljax/models/settings.py), written out because that module reads the registry (`resolved`),
# which reads this one: tests/test_model_registry.py checks that the two agree.
SHARED_KEYS = ("vocab_size", "dim", "hidden_mult", "depth", "heads", "dtype", "remat")


def shared_keys() -> tuple[str, ...]:
    """The keys of the section `model` that every model shares (`ModelConfig`'s, but `name`)."""
    return SHARED_KEYS


def _check_shared(where: str, shared: Iterable[str]) -> frozenset[str]:
    """`shared` as a set of shared keys of `model`; a name that is none is refused, with the
    nearest (a misspelt "hedas" would have model.heads, which the model reads, warned of)."""
    if isinstance(shared, str):  # shared="dim" would be the letters d, i, m
        raise ConfigError(f"{where}: shared must be a list of key names, got the string {shared!r}")
    shared, keys = tuple(shared), shared_keys()  # a generator is read once
    for key in shared:
        if key not in keys:
            near = difflib.get_close_matches(str(key), keys, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{where}: shared names {key!r}, not a shared key of model{hint}; they are: "
                              f"{', '.join(keys)}")
    return frozenset(shared)


def unregister(name: str) -> None:
    """Take the model `name` out of the registry (tests, notebooks that register a model again
    after editing it); the config class loses its section at the next load."""
    _SPECS.pop(name, None)
