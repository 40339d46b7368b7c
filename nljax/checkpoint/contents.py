"""What a checkpoint holds: the state as named arrays, their checksums, the JSON metadata beside
them, and the checks a checkpoint's metadata must pass before any array is read.

Errors are one line: `Damaged` for a checkpoint whose files cannot be read or do not match
their checksums (a resume skips it for an older one), a plain ConfigError for one that does not
fit this run (an older one would not fit either).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nljax.config import to_dict
from nljax.data import tokenization
from nljax.engine.conductor import Conductor
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.errors import ConfigError
from nljax.models import registry
from nljax.parallel import mesh as meshlib
from nljax.parallel.hostdev import replica
from nljax.version import __version__

FORMAT = 1
STATE, META = "state", "nljax"  # item names inside a step directory

# Config sections that decide the shapes and meaning of the saved arrays: a checkpoint only
# fits a run that agrees on them (`model`: every model.* key but HOW_COMPUTED's, model.nl_lm.*
# and model.dit.* included; a checkpoint saved before those subsections is read with its keys
# moved, `storage.read_meta`). Everything else may change on resume: settings that do not change
# the result silently, the rest (strategy included) with a warning. `optim.momentum`: whether sgd
# keeps a momentum buffer in the optimizer state at all (and a momentum never restarts silently);
# `optim.ema_decay`: whether it holds the parameters' moving average (and that average's meaning).
MUST_MATCH = ("model", "cms", "optim.name", "optim.momentum", "optim.ema_decay")
# model keys that change how the step computes, not what a checkpoint holds: they may change on
# resume (a run that ran out of memory resumes with remat). Recomputation and unrolling give the
# same bits (SAME_BITS: silent); the compute dtype, the attention's form, the embedding's
# gradient, the chunked loss and the inner loop's implementation compute the same sums in another
# order (a warning: float rounding differs, as with another device count).
SAME_BITS = ("model.remat", "model.nl_lm.memory_unroll")
HOW_COMPUTED = (*SAME_BITS, "model.dtype", "model.nl_lm.memory_impl", "model.nl_lm.attention", "model.nl_lm.embed_grad",
                "model.nl_lm.loss_chunk")
# data.eval_sets trains nothing, as eval.* does: a set added, left out or given another glob is
# no change of settings; a set whose content changed, or left out, is warned of by its digests
# (`Checkpoints.check_data`)
SILENT = (*SAME_BITS, "run", "checkpoint", "mesh", "eval", "train.log_every", "train.dispatch_ahead",
          "train.profile_steps", "train.profile_start", "train.sample_every", "train.sample_prompt",
          "train.sample_tokens", "throughput", "distributed", "prepare", "data.eval_sets")


class Damaged(ConfigError):
    """A checkpoint whose files cannot be read, or do not match their checksums (as opposed to
    one that does not fit this run's config): `--resume` skips it for an older one. Its line:
    "checkpoint <path>: <kind of damage>", then `DETAIL` and the reader's own words where it
    raised (`storage.damage`)."""


DETAIL = " -- "  # in a Damaged line: the kind of damage, then the reader's words (cut short)


def passed_over(path: Path, why: str, then: str) -> str:
    """The one warning line for the step directory `path` skipped as damaged (`why`: its Damaged
    line), `then` ("resuming from", "using") an older one: the step and the kind of damage first,
    the reader's words last; in a multi-process run, the process that found it
    (`distributed.first_failure` appends it to the line)."""
    process = re.search(r" \(process (\d+)\)$", why)
    why = why[:process.start()] if process else why
    kind, _, detail = why.removeprefix(f"checkpoint {path}: ").partition(DETAIL)
    step = f" (step {int(path.name)})" if path.name.isdigit() else ""
    found = f" (as process {process[1]} reads it)" if process else ""
    return (f"checkpoint {path}{step} is damaged{found}: {kind}; {then} an older one"
            + (DETAIL + detail if detail else ""))


# ---------------------------------------------------------------------------------------------
# The state as named arrays


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_arrays(state: TrainState) -> dict[str, Any]:
    """Every leaf of `state` by its path, e.g. 'opt_state/1/0/mu/block0/cms1/Dense_0/kernel'."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {"/".join(_key_name(k) for k in path): x for path, x in leaves}


def is_empty(x) -> bool:
    """Whether `x` (an array or its ShapeDtypeStruct) holds no element: the state of a CMS level
    the model puts no parameter in (its optimizer state, error buffer, flat shards). Orbax refuses
    to save a zero-size array and there is nothing in it to save: a checkpoint leaves it out, and
    a read makes it again from its shape (`empty_array`)."""
    return math.prod(x.shape) == 0


def empty_array(x) -> jax.Array:
    """The zero-size array `x` describes (shape, dtype, sharding). Made directly, not computed: a
    computation's zero-size output may come back with another sharding than the one asked for."""
    return jax.make_array_from_callback(x.shape, x.sharding, lambda idx: np.zeros(x.shape, x.dtype)[idx])


def nest(flat: dict[str, Any]) -> dict:
    """{'a/b': x} -> {'a': {'b': x}}: the tree Orbax saves."""
    tree: dict = {}
    for name, x in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return tree


def unnest(tree: dict, prefix: str = "") -> dict[str, Any]:
    """The inverse of `nest`."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(unnest(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Parameters whose shape changed in a release while their values (in order) did not: a checkpoint
# saved before reads them reshaped. The attention and memory qkv kernels [D, 3 * H * hd] took a
# head axis, [D, 3, H, hd], and the memory's depthwise conv kernel [K, 1, 3 * H * dk] and bias
# [3 * H * dk] became [K, 3, H, dk] and [3, H, dk], so that tensor parallelism splits them by head;
# so did the DiT's qkv kernel and bias (`block<i>/attn/qkv`: [D, 3, H, hd] and [3, H, hd]).
RESHAPED = re.compile(r"(^|/)(attn\d*|mem\d+)/(qkv|conv)/(kernel|bias)$")


def rows_of(name: str) -> bool:
    """An array with one row per stream row of the global batch (the inner-loop memory)."""
    return name.startswith("memory/")


def of_params(name: str) -> bool:
    """An array of the model's parameters (what a restore of the parameters alone reads, with the
    step that checks it)."""
    return name.startswith("params/")


def per_device(name: str) -> bool:
    """An array with one row per device (the error buffers of frozen levels)."""
    return name.startswith("err_buf/")


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the bits of `x`, modulo 2^32. Integer addition is associative, so
    the value is exact whatever the sharding and the reduction order: a checkpoint restored onto
    another mesh checks against the sum computed when it was saved."""
    if x.dtype == jnp.bool_ or x.dtype.itemsize not in _UINT:
        u = x.astype(jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    weight = jnp.arange(u.size, dtype=jnp.uint32).reshape(u.shape) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(u * weight, dtype=jnp.uint32)


@jax.jit
def _checksums(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: _leaf_checksum(x) for k, x in arrays.items()}


def checksums(arrays: dict[str, jax.Array]) -> dict[str, int]:
    out = _checksums(arrays)
    # replicated scalars: read this process's copy (works when other processes hold the rest)
    return {k: int(replica(v)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Metadata


# (model, fingerprint) of the latest model asked for: a run saves one model's checkpoints. One
# entry, not one per model: a notebook's runs and nljax.load calls each make a model, and a
# dict of them all kept every model of the process alive (one more per run, never freed).
_fingerprint: tuple[Any, dict] | None = None


def fingerprint(model) -> dict[str, list]:
    """The model's parameters by path, with shape and dtype, as `model.init` makes them: the same
    whatever the strategy stores (a checkpoint of another model differs here). Traced once per
    model: tracing `init` costs more than the rest of a save's blocking part."""
    global _fingerprint
    if _fingerprint is None or _fingerprint[0] is not model:
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        _fingerprint = (model, {k: [list(x.shape), str(x.dtype)] for k, x in named_arrays(shapes).items()})
    return _fingerprint[1]


def metadata(engine: Engine, step: int, arrays: dict[str, jax.Array], trackers: dict[str, str] | None = None,
             data_digest: str | None = None, tokenizer: dict | None = None,
             eval_sets: dict[str, str] | None = None) -> dict:
    """`trackers`: tracker name -> the run id a resume continues (`nljax.run.trackers.Trackers.ids`).
    `tokenizer`: what the data's token ids are (`nljax.data.tokenization.identity`; None: no text).
    `eval_sets`: the content digest of each data.eval_sets set, by name."""
    cfg, mesh = engine.cfg, engine.mesh
    sums = checksums(arrays)
    meta = {
        "format": FORMAT,
        "nljax_version": __version__,
        "step": step,
        "conductor": Conductor(cfg.cms.periods, step).state_dict(),
        # ContextStream row r at step s: a pure function of (seed, step, row) -> nothing else to save
        # the digest of the data's content (`Task.fingerprint`): a resume on other data is told so;
        # and of each data.eval_sets set's: a resume whose set changed is told its scores differ
        "data": {"step": step, "seed": cfg.seed, "rows": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                 "digest": data_digest, "tokenizer": tokenizer, "eval_sets": dict(eval_sets or {})},
        "rng": {"seed": cfg.seed, "device_key": "fold_in(fold_in(key(seed), step), global device index)"},
        "mesh": {**{k: int(v) for k, v in mesh.shape.items()}, "devices": meshlib.data_size(mesh),
                 "processes": jax.process_count()},
        "strategy": cfg.sync.strategy,
        "config": to_dict(cfg),
        # beside the state it belongs to: a resume from this step continues the same tracker run
        "trackers": dict(trackers or {}),
        "model": fingerprint(engine.model),
        # what the data decided when the model was built (a DiT: image shape, classes), which the
        # parameters' shapes need not show: a use of the model on other data is refused (`check_built`)
        "built": registry.record(engine.model, cfg.model.name),
        # how its `auto` settings computed here (nl_lm's inner loop: the parallel form on a GPU, the
        # scan on a CPU): a resume that computes another way under the same settings is told so
        "forms": registry.forms_of(engine.model),
        "arrays": {
            k: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": sums[k]} for k, x in arrays.items()
        },
    }
    return {**meta, "seal": seal(meta)}


def seal(meta: dict) -> str:
    """sha256 of the metadata's canonical JSON, its own seal left out. The arrays' checksums live in
    the metadata, so they only vouch for the arrays if the metadata itself is what was written: a
    checkpoint whose metadata was edited or damaged since is refused (`check_well_formed`)."""
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != "seal"}))  # as read back: lists, str keys
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def get(tree: dict, dotted: str):
    """`tree['a']['b']` for 'a.b', or None where a key is missing."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def differences(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """Dotted keys where the plain config trees `a` (saved) and `b` (this run) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [(prefix, a, b)]


def fmt(v: Any) -> str:
    return "(absent)" if v is None else repr(v) if isinstance(v, str) else str(v)


# ---------------------------------------------------------------------------------------------
# Checks on a checkpoint's metadata


def check_well_formed(path: Path, meta: Any) -> dict:
    """`meta` if it matches its seal and every field a restore reads is there, with its type; else
    `Damaged`. Metadata without a seal was written before seals (2026-11-28) and is read as before."""
    if isinstance(meta, dict) and "seal" in meta and meta["seal"] != seal(meta):
        raise Damaged(f"checkpoint {path}: metadata does not match its seal (edited or damaged after it was written)")
    if not _well_formed(meta):
        raise Damaged(f"checkpoint {path}: metadata is not an nljax checkpoint of format {FORMAT}")
    return meta


def _well_formed(meta: Any) -> bool:
    try:
        arrays_ok = all(
            isinstance(a["shape"], list) and all(isinstance(d, int) for d in a["shape"])
            and isinstance(a["dtype"], str) and np.dtype(a["dtype"]) is not None and isinstance(a["checksum"], int)
            for a in meta["arrays"].values()
        )
        return (
            meta["format"] == FORMAT and isinstance(meta["step"], int) and arrays_ok and "step" in meta["arrays"]
            and isinstance(meta["mesh"]["devices"], int) and isinstance(meta["config"]["train"]["batch_size"], int)
            # the device count divides the error buffers on resume: it must be their first dimension
            and all(a["shape"][:1] == [meta["mesh"]["devices"]] for k, a in meta["arrays"].items() if per_device(k))
            and all(isinstance(v, list) and len(v) == 2 for v in meta["model"].values())
        )
    except (KeyError, TypeError, AttributeError):
        return False


def check_fits(path: Path, meta: dict, engine: Engine) -> None:
    """One-line errors for a checkpoint of another model or an incompatible config."""
    here = to_dict(engine.cfg)
    for key in MUST_MATCH:
        for k, a, b in differences(get(meta["config"], key), get(here, key), key):
            if k in HOW_COMPUTED:
                continue
            # a key the user may never have set: the data's tokenization decides it
            tok = data_tokenizer(meta) if k == "model.vocab_size" else None
            told = (f" (it was trained on {tokenization.describe(tok)}; this run's data decide its vocabulary)"
                    if tok else "")
            raise ConfigError(f"checkpoint {path} does not fit this run: {k}={fmt(a)} there, {fmt(b)} here{told}")
    saved, mine = meta["model"], fingerprint(engine.model)
    # a model may say what a parameter's shape means (a DiT: classes, channels of its data)
    explain = getattr(engine.model, "mismatch", lambda *_: "")
    why = lambda name: (lambda s: f": {s}" if s else "")(explain(name, saved.get(name), mine.get(name)))  # noqa: E731
    for name in sorted(set(saved) | set(mine)):
        if name not in saved:
            raise ConfigError(f"checkpoint {path} is from another model: it has no parameter '{name}'{why(name)}")
        if name not in mine:
            raise ConfigError(f"checkpoint {path} is from another model: parameter '{name}' has no place here"
                              f"{why(name)}")
        (s1, d1), (s2, d2) = saved[name], mine[name]
        if saved[name] != mine[name] and not (d1 == d2 and math.prod(s1) == math.prod(s2) and RESHAPED.search(name)):
            raise ConfigError(
                f"checkpoint {path} is from another model: parameter '{name}' is {d1}{tuple(s1)} there, "
                f"{d2}{tuple(s2)} here{why(name)}"
            )


def data_digest(meta: dict) -> str | None:
    """The digest of the data a checkpoint was trained on; None in one saved before it was."""
    digest = get(meta, "data.digest")
    return digest if isinstance(digest, str) else None


def data_eval_sets(meta: dict) -> dict[str, str]:
    """The content digest of each data.eval_sets set a checkpoint's run scored, by name; {} in one
    saved before they were recorded (or without sets)."""
    sets = get(meta, "data.eval_sets")
    return {k: v for k, v in sets.items() if isinstance(v, str)} if isinstance(sets, dict) else {}


def data_tokenizer(meta: dict) -> dict | None:
    """What the token ids a checkpoint was trained on are (`nljax.data.tokenization.identity`);
    None for images, and in one saved before it was recorded."""
    tok = get(meta, "data.tokenizer")
    return tok if isinstance(tok, dict) and isinstance(tok.get("kind"), str) else None


def check_tokenizer(path: Path, saved: dict | None, here: dict | None, what: str = "this run's data use",
                    kind: str = "checkpoint") -> None:
    """One line (ConfigError) when the checkpoint at `path` (or what `kind` says: an export),
    trained on the token ids `saved` (`data_tokenizer`), does not read them as `here` (this run's)
    does: its embedding rows would stand for other text."""
    if saved is not None and here is not None and saved != here:
        raise ConfigError(f"{kind} {path} was trained on {tokenization.describe(saved)}, {what} "
                          f"{tokenization.describe(here)}: its token ids would stand for other text")


def check_built(path: Path, meta: dict, here: dict, then: str = "", kind: str = "checkpoint") -> None:
    """One line (ConfigError) where the checkpoint at `path` was trained on data that built its
    model otherwise than this run's data build it (`here`: `registry.record` of this run's model):
    a DiT's parameters fit images of any size (its positions are computed, not learned), so a
    model trained on 32x32 images scored or sampled 64x64 ones without a word, and a folder whose
    class subfolders are others gave its label k another class than the one it trained as. Called
    before `check_fits`: images of another channel count change the output layer's shape too, and
    the line names the images, not that parameter. An entry one side lacks is not compared: a
    checkpoint saved before the record (or the entry: a DiT's `classes`) was kept, data that do
    not name their labels (an .npz's). `then`: added to the line (a resume's way out). `kind`: what
    `path` is, for the line (an export's `meta` is its config.json, its record under "built")."""
    saved = meta.get("built")
    if not isinstance(saved, dict):
        return
    found = [d for d in differences(saved, here, "") if d[1] is not None and d[2] is not None]
    # names last: another class count (which changes the names too) or image shape is said first
    found.sort(key=lambda d: _names(d[1]))
    names = next(((t, m) for _, t, m in found if _names(t) and _names(m)), None)
    for key, there, mine in found[:1]:
        line = _built_difference(key, there, mine)
        if key.endswith("num_classes") and names:  # which subfolders came or went: the user's terms
            line += _classes_apart(*names)
        raise ConfigError(f"{kind} {path} was trained on data with {line}{then}")


def _classes_apart(there: list[str], mine: list[str], most: int = 3) -> str:
    """' (classes here, not there: 'eel'; there, not here: ...)': where another class count came
    from, at most `most` names each side."""
    def some(names: list[str]) -> str:
        return ", ".join(fmt(x) for x in names[:most]) + (f", ... ({len(names)})" if len(names) > most else "")

    parts = [f"{side}: {some(d)}" for side, d in (("here, not there", [x for x in mine if x not in there]),
                                                  ("there, not here", [x for x in there if x not in mine])) if d]
    return f" (classes {'; '.join(parts)})" if parts else ""


def _names(v: Any) -> bool:
    """Whether a record's entry is a list of names (a DiT's class names, in label order)."""
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)


def _built_difference(key: str, there: Any, mine: Any) -> str:
    """The middle of `check_built`'s line: the entry there and here, or of two lists of names
    (as many) the first that differs (1000 class names would fill the screen)."""
    if _names(there) and _names(mine) and len(there) == len(mine):
        k = next(i for i, (a, b) in enumerate(zip(there, mine)) if a != b)
        return (f"{key}[{k}]={fmt(there[k])}, this run's data give {key}[{k}]={fmt(mine[k])}: label {k} would "
                "stand for another class (a folder's labels are its class subfolders in sorted order, or in "
                "images.classes' order)")
    line = f"{key}={fmt(there)}, this run's data give {key}={fmt(mine)}"
    if key.endswith("num_classes") and 0 in (there, mine):  # 0 may be a setting, not the data: say which can be
        side = "here" if mine == 0 else "there"
        line += (f" (0 {side}: a model that reads no labels, by meanflow.class_cond=false or from images without "
                 "labels)")
    if key == "images.shape" and isinstance(there, list) and isinstance(mine, list) and there[-1:] != mine[-1:]:
        line += f" ({fmt(there[-1])}-channel images there, {fmt(mine[-1])}-channel here)"
    return line


def tracker_ids(meta: dict) -> dict[str, str]:
    """The tracker run ids a checkpoint saved; none in one saved before they were (or malformed)."""
    ids = meta.get("trackers")
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def check_arrays(path: Path, meta: dict, sums: dict[str, int], step: int) -> None:
    """`Damaged` unless the arrays read (`sums`: all of the checkpoint's, or those a restore of the
    parameters alone reads) match their checksums in `meta`, and the step read the step saved there."""
    for name, total in sums.items():
        if total != meta["arrays"][name]["checksum"]:
            raise Damaged(f"checkpoint {path}: array '{name}' does not match its checksum (corrupted)")
    if step != meta["step"]:
        raise Damaged(f"checkpoint {path}: state step disagrees with its metadata")
