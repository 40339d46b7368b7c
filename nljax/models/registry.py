"""The model registry: `model.name` -> how to build the model, its config section and its task.

Every model, nljax's own included, comes in through `nljax.register_model` (nljax/models/specs.py):
nljax's three (`nljax.models.builtin`) when the registry is first read, then every entry point
of the group `nljax.models` of the installed packages (the convention pytest's and JAX's plugins
use):

    # mypkg's pyproject.toml
    [project.entry-points."nljax.models"]
    mymodel = "mypkg.model:register"      # the name is the model's; the object is called once

    # mypkg/model.py
    def register():
        nljax.register_model("mymodel", build, settings=MyModelConfig)

After `pip install mypkg`, `python -m nljax.train model.name=mymodel model.mymodel.width=64`
trains it; so do `nljax.comm`, `nljax.bench`, `nljax.generate`, `nljax.export` and
`nljax.load_model`. A plugin that fails to import, does not register the name of its entry point
or registers a name twice is refused with one line naming it, before anything is allocated, and
so is a model whose parameters fall outside `cms.periods` or whose memory has no rows axis
(`check_model`).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import numbers
import re
import sys
from importlib import metadata
from typing import Any

from nljax.errors import ConfigError, first_line
from nljax.models import base, builtin
from nljax.models.specs import _ORIGIN, _SPECS, GROUP, ModelSpec, shared_keys

Config = Any  # nljax.config.Config (not imported: no cycle)
Model = base.Model


# ---------------------------------------------------------------------------------------------
# Discovery


TRACEBACK = "NLJAX_TRACEBACK"  # set (to anything but "" or 0): a one-line error prints its traceback too (nljax.cli)
HINT = f" ({TRACEBACK}=1 shows the traceback)"  # ends the line of an exception a plugin's own code raised

_DONE: set[str] = set()  # what `_loaded` has registered: "nljax", then "plugins"


def _loaded() -> None:
    """nljax's own models, then every plugin of the entry-point group, registered once (a
    refusal is raised again on the next read, not forgotten)."""
    if "nljax" not in _DONE:
        _DONE.add("nljax")
        builtin.register()
    if "plugins" not in _DONE:
        for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name):
            if ep.name in _SPECS and _SPECS[ep.name].origin != describe_entry_point(ep):
                raise ConfigError(f"model '{ep.name}' is registered twice: by {_SPECS[ep.name].origin} and by "
                                  f"{describe_entry_point(ep)}")
            if ep.name not in _SPECS:
                load_entry_point(ep)
        _DONE.add("plugins")


def describe_entry_point(ep) -> str:
    dist = getattr(ep, "dist", None)
    of = f" of {dist.metadata['Name']} {dist.version}" if dist is not None else ""
    return f"plugin '{ep.name} = {ep.value}'{of} (entry point group {GROUP})"


def load_entry_point(ep) -> None:
    """Import the entry point's object and call it; it must register the model named `ep.name`."""
    who = describe_entry_point(ep)
    _ORIGIN.append(who)
    try:
        try:
            register = ep.load()
        except Exception as e:  # anything the plugin's import raises: one line naming it
            raise ConfigError(f"{who} failed to import: {type(e).__name__}: {first_line(e)}{_where(e)}{HINT}") from e
        if not callable(register):
            raise ConfigError(f"{who} names {register!r}, not a function to call")
        if ep.name not in _SPECS:
            try:
                register()
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(f"{who} failed to register: {type(e).__name__}: {first_line(e)}{_where(e)}{HINT}") from e
        if ep.name not in _SPECS:
            raise ConfigError(f"{who} did not register a model named '{ep.name}' (registered: "
                              f"{', '.join(sorted(_SPECS))})")
    finally:
        _ORIGIN.pop()


LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "optax", "einops")  # whose frames `_where` passes over


def _where(e: BaseException) -> str:
    """' (at FILE:LINE)': the innermost line of the plugin's own code that raised `e` (not Python's
    import machinery, not nljax, not the libraries a model is written with: a shape error raised
    inside flax's Dense or JAX's initializers is the model's line that called them), so that the
    one line still says where to look; '' if none."""
    import os
    import sysconfig
    import traceback

    paths = sysconfig.get_paths()
    packages = (paths["purelib"], paths["platlib"])  # under the stdlib's folder where Python has no venv
    nljax_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libraries = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in map(sys.modules.get, LIBRARIES)
                      if getattr(m, "__file__", None))

    def theirs(name: str) -> bool:
        name = os.path.abspath(name)
        stdlib = name.startswith(paths["stdlib"]) and not name.startswith(packages)
        return not (stdlib or name.startswith((nljax_dir + os.sep, *libraries)))

    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<") and theirs(f.filename)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def rediscover() -> None:
    """Read the entry points again (after a package was put on this process's path): the models
    registered so far are kept, each new plugin is loaded."""
    _DONE.discard("plugins")
    _loaded()


def names() -> list[str]:
    _loaded()
    return sorted(_SPECS)


def specs() -> list[ModelSpec]:
    """Every registered model, in the order they were registered (nljax's own first)."""
    _loaded()
    return list(_SPECS.values())


def spec(name: str) -> ModelSpec:
    """The registered model `name`; an unknown name is one line with the nearest registered one."""
    _loaded()
    if name not in _SPECS:
        near = difflib.get_close_matches(name, list(_SPECS), n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"unknown model.name '{name}'{hint} (registered: {', '.join(sorted(_SPECS))}; a model "
                          f"from a package is found through its '{GROUP}' entry point)")
    return _SPECS[name]


def task_of(cfg: Any) -> str:
    """The task of the model `cfg` selects ("text" or "images")."""
    return spec(cfg.model.name).task


# ---------------------------------------------------------------------------------------------
# Building


# the class of each model built -> the registered model's name, for the calls made outside the
# engine's step that are not given the run's config (`checked_logits`)
_BUILT: dict[type, str] = {}


def build(cfg: Config) -> Model:
    """The model `cfg.model.name` names, checked against the contract (`check_model`); shared
    keys set that it does not read are said once (`warn_unread`)."""
    s = spec(cfg.model.name)
    with plugin_code(s.name):
        model = s.build(cfg)
        check_model(s, model, len(cfg.cms.periods))
    _BUILT[type(model)] = s.name
    warn_unread(cfg)
    return model


def checked_logits(model: Model, params, memory, batch: dict, *key, vocab: int) -> tuple:
    """`base.checked_logits` (what evaluation, generation and the harness read), a plugin's
    `logits` raising one line as its `apply` does in the step (`plugin_code`), named by the class
    that `build` or `rebuild` made (a model built by hand: its traceback, as nljax's own)."""
    name = _BUILT.get(type(model), "")
    with plugin_code(name, "logits", who=f"model '{name}'"):
        return base.checked_logits(model, params, memory, batch, *key, vocab=vocab)


@contextlib.contextmanager
def plugin_code(name: str, doing: str = "building it", who: str | None = None):
    """Around a call into the code of the registered model `name`: its rules (`check(cfg)`, its
    settings' `check()`), its `build` or `rebuild` and what `check_model` calls (`init`,
    `level_of`, `init_memory`, `describe`), its `tensor_parallel` shard, its `apply` while a step
    is traced (`base.checked_apply`). An exception raised there, other than a ConfigError, is one
    line naming the model (`who`: `model 'name' (origin)`), what it was `doing`, the exception and
    where the model's code raised, as a plugin that fails to register is (an error in a model
    being written is the common case, and the traceback ran through nljax's and JAX's frames
    first). The exception stays its cause: in Python the traceback shows it, and the commands
    print it with NLJAX_TRACEBACK=1. nljax's own models, and a model the registry does not hold
    (built by hand), keep their traceback: an exception there is nljax's bug."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        s = _SPECS.get(name)
        if s is None or nljax_own(s):
            raise
        raise ConfigError(f"{who or f'model {s.name!r} ({s.origin})'}: {doing} raised {type(e).__name__}: "
                          f"{first_line(e) or 'no message'}{_where(e)}{HINT}") from e


def nljax_own(s: ModelSpec) -> bool:
    """Whether nljax registered the model itself (nljax.models.builtin), not a plugin or a user."""
    return s.origin.split(".")[0] == "nljax"


def unread_shared(cfg: Config) -> list[str]:
    """The shared keys of `cfg.model` set to other than their defaults that the selected model
    does not read, as it declared them (`register_model(shared=...)`); [] when it declared none."""
    s = spec(cfg.model.name)
    if s.shared is None:
        return []
    default = type(cfg.model)()  # the section's defaults (ModelConfig, not imported: it reads this module)
    return [k for k in shared_keys() if k not in s.shared and getattr(cfg.model, k) != getattr(default, k)]


_WARNED: set[tuple] = set()  # (model, keys) said in this process: a run builds its model more than once


def warn_unread(cfg: Config) -> None:
    """One line on standard error (process 0, once) naming the shared keys a run sets that its
    model does not read: `model.heads=8` for a model without heads was accepted in silence."""
    import jax

    keys = unread_shared(cfg)
    said = (cfg.model.name, tuple(keys))
    if not keys or said in _WARNED:
        return
    _WARNED.add(said)
    if jax.process_index() == 0:
        s, one = spec(cfg.model.name), len(keys) == 1
        reads = ", ".join(k for k in shared_keys() if k in s.shared) or "none"
        print(f"nljax: warning: {', '.join(f'model.{k}={getattr(cfg.model, k)}' for k in keys)} "
              f"{'is' if one else 'are'} set, and model '{s.name}' does not read {'it' if one else 'them'}: "
              f"{'it changes' if one else 'they change'} nothing (the shared keys it reads: {reads})",
              file=sys.stderr)


def rebuild(cfg: Config, info: dict) -> Model:
    """The model of an export: its config and its config.json `info` (`ModelSpec.rebuild`)."""
    s = spec(cfg.model.name)
    with plugin_code(s.name):
        model = s.rebuild(cfg, info) if s.rebuild is not None else s.build(cfg)
        check_model(s, model, len(cfg.cms.periods))
    _BUILT[type(model)] = s.name
    return model


def record(model: Model, name: str) -> dict:
    """The entries the model `name` adds to an export's config.json and to every checkpoint
    (`ModelSpec.describe`), as JSON reads them back: a checkpoint's record is compared with this
    run's (`check_built`), and a tuple saved is a list read ((16, 2) != [16, 2] refused every load).
    One line where `describe` gives what JSON cannot hold (checked when the model is built:
    `check_model`), not a traceback at the first checkpoint's save."""
    s = spec(name)
    if s.describe is None:
        return {}
    out = s.describe(model)
    try:
        back = json.loads(json.dumps(out))
    except (TypeError, ValueError) as e:  # a numpy integer, a set, an object
        raise ConfigError(f"model '{s.name}' ({s.origin}): describe() must give a dict of JSON values (str, int, "
                          f"float, bool, None, lists and dicts of them): {e}") from None
    if not isinstance(back, dict):
        raise ConfigError(f"model '{s.name}' ({s.origin}): describe() must give a dict, got {type(out).__name__}")
    return back


def forms_of(model: Model) -> dict | None:
    """The forms the model's `auto` settings resolved to here (nl_lm: attention, the inner loop's
    implementation, ...; on a GPU the inner loop is the parallel form, on a CPU the scan), or None
    for a model without such settings. Saved with every checkpoint (a resume that computes another
    way is told so) and in benchmarks' records. The builtin nl_lm's `forms()`; anything else by
    that name (a model of one's own may have one, with another meaning) that is not a method
    giving a dict of JSON values is no record: None."""
    method = getattr(model, "forms", None)
    out = method() if callable(method) else None
    try:
        return json.loads(json.dumps(out)) if isinstance(out, dict) else None
    except (TypeError, ValueError):
        return None


def check_model(s: ModelSpec, model: Model, n_levels: int) -> None:
    """What the engine relies on, checked from shapes alone (nothing allocated): the methods of the
    contract, every parameter's level inside `cms.periods`, every memory leaf with a leading
    rows axis, and the model's `task` (if it says one) the registered one."""
    who = f"model '{s.name}' ({s.origin})"
    missing = [m for m in ("init", "level_of", "init_memory", "apply") if not callable(getattr(model, m, None))]
    if missing:
        raise ConfigError(f"{who}: build returned {type(model).__name__}, which lacks {', '.join(missing)} "
                          "(nljax.Model)")
    if getattr(model, "task", s.task) != s.task:
        raise ConfigError(f"{who}: the model's task is '{model.task}' but it was registered with task='{s.task}'")
    _check_shapes(who, model, n_levels)
    if not nljax_own(s):  # nljax's own draw from the key alone (their tests compare runs)
        _check_deterministic(who, model)
    record(model, s.name)  # what every checkpoint saves: JSON, or one line now


def _check_deterministic(who: str, model: Model) -> None:
    """`init(key)` must be a function of the key alone: every process of a multi-process run calls
    it and must hold the same replicas, and a seed must give a run's parameters again. Numbers
    drawn at trace time (numpy's or Python's random generator, the time) are constants of the
    traced program: two traces with the same key then differ, in a literal or a constant. Without
    this, each process of a run trained replicas of its own, silently (nothing else compares
    them), and a rerun with the same seed did not repeat. From the traces alone: nothing is
    computed. (What is the same within a process but not across processes, `hash()` of a str, is
    not seen here.)"""
    import jax
    import numpy as np

    def traced():  # a new function each time: a cached trace would compare with itself
        return jax.make_jaxpr(lambda key: model.init(key))(jax.random.key(0))

    def data(x):  # a constant's bytes (a typed PRNG key's too)
        key = jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(x) if key else x).tobytes()

    def text(closed):  # a function in a primitive's parameters may print with its address
        return re.sub(r" at 0x[0-9a-fA-F]+", "", str(closed.jaxpr))

    a, b = traced(), traced()
    same = text(a) == text(b) and len(a.consts) == len(b.consts) and all(
        np.shape(x) == np.shape(y) and data(x) == data(y) for x, y in zip(a.consts, b.consts))
    if not same:
        raise ConfigError(f"{who}: init(key) gave two different parameter trees for the same key: it must draw "
                          "them from the key alone (jax.random), not from numpy's or Python's random generator "
                          "or the time; else the processes of a run hold different replicas and a seed does "
                          "not repeat a run")


def _check_shapes(who: str, model: Model, n_levels: int) -> None:
    import jax

    from nljax.parallel.levels import path_str

    import jax.numpy as jnp

    shapes = jax.eval_shape(model.init, jax.random.key(0))
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = path_str(path)
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):  # else jax.grad's TypeError, deep in the first step
            raise ConfigError(f"{who}: init's parameter '{name}' is {leaf.dtype}: every parameter is trained, and "
                              "gradients need floats (keep an integer in the model's fields or in init_memory)")
        level = model.level_of(name)
        if isinstance(level, bool) or not isinstance(level, numbers.Integral):  # np.int64 is one (a rule on arrays)
            raise ConfigError(f"{who}: level_of('{name}') = {level!r}, a {type(level).__name__}: a level is an int "
                              f"in 0..{n_levels - 1}")
        if not 0 <= level < n_levels:
            raise ConfigError(f"{who}: level_of('{name}') = {level!r}, outside cms.periods ({n_levels} level"
                              f"{'s' if n_levels > 1 else ''}: 0..{n_levels - 1})")
    for rows in (2, 3):
        memory = jax.eval_shape(lambda: model.init_memory(rows))
        for path, leaf in jax.tree_util.tree_flatten_with_path(memory)[0]:
            if not leaf.shape or leaf.shape[0] != rows:
                raise ConfigError(f"{who}: init_memory({rows}) leaf '{path_str(path)}' has shape {tuple(leaf.shape)}: "
                                  f"the inner-loop state needs the rows axis first ([{rows}, ...]), since each "
                                  "stream row owns its state")
