"""Export a trained run's parameters, and load them back without nljax's training machinery.

    python -m nljax.export run.dir=runs/default [--format safetensors] [dtype=float32|bfloat16]
                           [out=DIR] [checkpoint=STEP|PATH] [params=average|trained]

writes DIR (default <run.dir>/export) with

- `model.safetensors`: the model's parameter tree in its own layout, gathered from whatever
  strategy trained it, one tensor per leaf named by its path ("block0/cms1/down/kernel");
- `config.json`: the run's config (what `nljax.models.build` needs; a DiT's image shape and label
  count too), the step, the dtype, which parameters (`params`: under optim.ema_decay their moving
  average unless `params=trained`), and a text model's tokenization (bytes, or a tokenizer);
- `tokenizer.json`: a copy of the run's tokenizer, when it trained on one (data.source=files).

`nljax.load(DIR)` gives the model with its tokenizer, `generate` and `logits`
(nljax/trained_model.py);

`nljax.load_model(DIR)` returns the bare (model, params) on one device; `model.logits(params,
model.init_memory(rows), {"tokens": [B, T+1], "reset": [B]})` is the language model's forward
(the same call `nljax.generate` makes). A bfloat16 export halves the file and is loaded as
bfloat16 (the model computes in `model.dtype` whatever the parameters' dtype).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

# nljax.cli imports JAX first, turning an environment variable JAX cannot read into one line
from nljax import cli  # noqa: I001

import jax
import jax.numpy as jnp

from nljax import config
from nljax.checkpoint.contents import RESHAPED
from nljax.checkpoint.taken import checkpoints_around, where
from nljax.data.outdir import is_prepared
from nljax.errors import ConfigError, few
from nljax.models import registry
from nljax.models.builtin import for_this_backend
from nljax.parallel.levels import path_str
from nljax.run import trained as trained_lib
from nljax.run.core import refuse_x64
from nljax import writable
from nljax.runtime import filedigest, resultfile
from nljax.runtime.exportdir import CONFIG, DEFAULT, TOKENIZER, WEIGHTS, is_export

FORMATS = ("safetensors",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def export(t: trained_lib.Trained, out: Path, dtype: str = "float32") -> Path:
    """Write `t`'s parameters and config to `out` (a directory)."""
    from safetensors.flax import save_file

    check_dtype(dtype)
    flat = named(jax.device_get(t.params))
    out.mkdir(parents=True, exist_ok=True)
    # written under temporary names and renamed into place, config.json last: an export cut short
    # (Ctrl-C, a full disk) leaves the previous one whole
    tok = _tokenization(t)
    names = (WEIGHTS, TOKENIZER, CONFIG) if hasattr(tok, "raw") else (WEIGHTS, CONFIG)
    temp = {n: resultfile.temp_for(out / n) for n in names}
    try:
        _save_weights(save_file, {k: jnp.asarray(v, DTYPES[dtype]) for k, v in flat.items()}, temp[WEIGHTS])
        info = {"config": config.to_dict(t.trained_cfg), "step": t.step, "dtype": dtype, "checkpoint": str(t.path),
                "params": t.params_read}
        if tok is not None:  # how text becomes tokens, for nljax.load (a tokenizer's file beside it)
            info["tokenizer"] = tok.info()
        if TOKENIZER in temp:
            temp[TOKENIZER].write_bytes(tok.raw)
        # what the model's data decided (a DiT's image shape and labels): load_model reads no data
        info.update(registry.record(t.model, t.cfg.model.name))
        info["sha256"] = filedigest.record({n: p for n, p in temp.items() if n != CONFIG})  # load_model checks them
        info["digest"] = filedigest.seal(info)  # last: of everything above, checked by load_model
        temp[CONFIG].write_text(json.dumps(info, indent=1))
        os.chmod(temp[WEIGHTS], temp[CONFIG].stat().st_mode & 0o777)  # safetensors writes 0600
        for n in names:
            os.replace(temp[n], out / n)
        if TOKENIZER not in temp:  # an earlier export's tokenizer is not this one's
            (out / TOKENIZER).unlink(missing_ok=True)
    finally:
        for path in temp.values():
            path.unlink(missing_ok=True)
    return out


def _save_weights(save_file, tensors: dict, path: Path) -> None:
    """safetensors' `save_file`, its I/O errors as the OSError they are (a full disk: 'Error while
    serializing: I/O error: ... (os error 28)', a traceback before)."""
    try:
        save_file(tensors, str(path))
    except Exception as e:  # noqa: BLE001 - safetensors' Rust error type
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def _tokenization(t: trained_lib.Trained):
    """How the run's text became tokens (bytes, or its tokenizer), or None for a model that
    makes no text."""
    from nljax.run.sampling import tokenization_of

    makes_text = registry.task_of(t.cfg) == "text" and hasattr(t.model, "logits")
    return tokenization_of(t.cfg) if makes_text else None


def tokenization_of_export(path: Path, cfg: config.Config):
    """The tokenization of a text model's export: bytes, or the tokenizer.json beside it (an
    export written before they were recorded: the run's, read from where its config names it)."""
    from nljax.data import tokenization
    from nljax.run.sampling import tokenization_of

    record = json.loads((Path(path) / CONFIG).read_text())
    info = record.get("tokenizer")
    if info is None:
        return tokenization_of(cfg)
    if info["kind"] == "bytes":
        return tokenization.Bytes()
    # its file checked against the export's record before it is parsed: nljax.generate reads it for
    # prompts= before `load_model` checks every file, and a damaged one is named as such, not as a
    # data.tokenizer that is no tokenizer.json
    sums = record.get("sha256")
    filedigest.check(Path(path), {TOKENIZER: sums[TOKENIZER]} if isinstance(sums, dict) and TOKENIZER in sums else None,
                     "the export")
    return tokenization.HFTokenizer(Path(path) / TOKENIZER, info.get("doc_end_token") or "")


def check_out(out: Path) -> None:
    """Refuses an `out` the export would damage or mix with: a file, or a directory holding
    anything but an earlier nljax export (which is replaced): a user's folder, a run directory."""
    if writable.dangling(out):  # mkdir would say only "File exists"
        raise ConfigError(writable.broken_link(out, f"out={out}"))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file: the export is a directory (model.safetensors, config.json)")
    if is_prepared(out):  # its tokenizer.json was said to be "of something else than an nljax export"
        raise ConfigError(f"out={out} holds prepared data (nljax.prepare wrote it): choose another directory")
    theirs = [n for n in (WEIGHTS, CONFIG, TOKENIZER) if (out / n).exists()]
    if theirs and not is_export(out):
        raise ConfigError(f"out={out} holds {' and '.join(theirs)} of something else than an nljax export; "
                          "choose another directory")
    # an export's names, and the temporary ones an export killed part-way leaves (`export`); any
    # other hidden name is a user's too (out=~, a home directory of dotfiles, took the export),
    # except in an earlier export (a desktop's .DS_Store, a notebook's .ipynb_checkpoints)
    names = "|".join(map(re.escape, (WEIGHTS, CONFIG, TOKENIZER)))
    ours = re.compile(rf"({names})|\.({names})\.tmp-\d+")
    hidden_too = not is_export(out)
    others = sorted(p.name for p in out.iterdir() if not ours.fullmatch(p.name)
                    and (hidden_too or not p.name.startswith("."))) if out.is_dir() else []
    if others:
        raise ConfigError(f"out={out} holds {few(others)}, which an "
                          "export does not write: give an empty or new directory (or an earlier export's)")


def read_config(path: str | Path) -> tuple[dict, config.Config]:
    """An export directory's config.json (checked: both files there, parsed, its seal intact) and
    the run config it holds: what the export is, read without its weights."""
    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise ConfigError(f"{path / name} not found: not a directory written by nljax.export")
    try:
        info = json.loads((path / CONFIG).read_text())
        cfg = config.from_dict(info["config"])
    except (ValueError, KeyError, TypeError) as e:  # damaged or edited
        raise ConfigError(f"{path / CONFIG} is not an nljax export's config ({type(e).__name__}: {e})") from None
    filedigest.check_seal(path / CONFIG, info)
    return info, cfg


def built_model(path: str | Path):
    """The model of an export directory, built from its config.json without reading its weights:
    with what its data decided (a DiT's image shape and classes), as recorded; GPU-only forms off
    a GPU: auto's."""
    return _rebuilt(*read_config(path))


def _rebuilt(info: dict, cfg: config.Config):
    return registry.rebuild(for_this_backend(cfg), info)


def load_model(path: str | Path):
    """(model, params) of an export directory, the parameters on the default device."""
    refuse_x64()  # as a run's checkpoint is (nljax.run.core.Run.create)
    path = Path(path)
    info, cfg = read_config(path)
    model = _rebuilt(info, cfg)
    return model, read_weights(path, info, model)


def read_weights(path: Path, info: dict, model):
    """The parameters of the export in `path` (its config.json `info`, read by `read_config`) in
    `model`'s tree, on the default device: its files checked against their recorded sha256, each
    tensor's name and shape against the model's."""
    from safetensors.flax import load_file

    filedigest.check(path, info.get("sha256"), "the export")
    flat = load_file(str(path / WEIGHTS))
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    template = named(shapes)
    if set(flat) != set(template):
        missing, extra = sorted(set(template) - set(flat))[:3], sorted(set(flat) - set(template))[:3]
        raise ConfigError(f"{path / WEIGHTS} does not fit its config.json (missing {missing}, unexpected {extra})")
    for k, v in template.items():
        if flat[k].shape != v.shape and RESHAPED.search(k) and flat[k].size == v.size:
            flat[k] = flat[k].reshape(v.shape)  # written before the qkv kernels took a head axis
        if flat[k].shape != v.shape:
            raise ConfigError(f"{path / WEIGHTS}: '{k}' is {flat[k].shape}, the model needs {v.shape}")
    return jax.tree.unflatten(jax.tree.structure(shapes), [flat[k] for k in template])


def named(params) -> dict:
    """The parameters by their paths ('block0/cms1/up/kernel'), the tensors' names in the
    safetensors file: of any pytree the model's `init` gives (flax's dicts, a NamedTuple, a list),
    in its leaves' order; flax's flatten_dict took dicts alone (an AssertionError's traceback for a
    model of plain JAX whose parameters are a NamedTuple, which trains and checkpoints)."""
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def main(argv=None) -> int:
    p = cli.Parser(allow_abbrev=False, prog="nljax.export", description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    p.add_argument("settings", nargs="*", metavar="key=value",
                   help="run.dir=DIR (required), dtype=, out=, checkpoint= (latest, a step number or a step "
                        "directory), params= (average or trained: under optim.ema_decay, the parameters' moving "
                        "average, the default, or the optimizer's own), config overrides")
    args = cli.parse(p, argv)  # key=value before or after a flag, as train's
    if isinstance(args, int):  # refused, or --help
        return args
    return cli.tool("nljax.export", lambda: _export(args))


def _export(args) -> int:
    cli.setup_devices(args.cpu_devices)
    # dtype is checked before the checkpoint is read
    mine, overrides, run_dir = trained_lib.split_args(args.settings, {"dtype": check_dtype, "out": str,
                                                                      "checkpoint": str, "params": str})
    mine = {"dtype": "float32", "out": "", "checkpoint": "latest", "params": "", **mine}
    trained_lib.reads_average(mine["params"], None)  # its value, before anything is read
    if not mine["out"] and not (Path(run_dir) / "config.yaml").is_file():
        # out= is <run.dir>/export: a run.dir that is no run (a file) was named as a bad out=
        trained_lib.trained_config(run_dir)  # its line: no config.yaml, an export's directory, ...
    out = Path(mine["out"] or Path(run_dir) / DEFAULT)
    check_out(out)
    if holder := checkpoints_around(out):  # a run's resume would stop at a step folder it did not write
        raise ConfigError(f"out={out} {where(out, holder)} a run's checkpoints (its resume would stop at the export's "
                          "folder): choose another directory")
    writable.refuse_unwritable(f"out={out}", out)  # before the checkpoint is read: exit 2, as train's run.dir
    # restoring the checkpoint, gathering its parameters and writing them take seconds (more for a
    # large model), said once the settings are checked, as nljax.generate says its reading
    reading = f"nljax.export: reading the checkpoint of {run_dir} ..."
    t = trained_lib.load(run_dir, mine["checkpoint"], overrides, devices=jax.local_devices()[:1],
                         announce=lambda: print(reading, file=sys.stderr, flush=True), params=mine["params"])
    for line in t.warnings("nljax.export"):
        print(line, file=sys.stderr)
    try:
        export(t, out, mine["dtype"])
    except OSError as e:  # permissions, a full disk, a directory that cannot be made
        print(f"nljax.export: error: {cli.cannot_write(f'the export to {out}', e)}", file=sys.stderr)
        return 1
    print(f"nljax.export: {t.path} (step {t.step}{t.which}) -> {out}/{WEIGHTS}, {out}/{CONFIG}")
    return 0


if __name__ == "__main__":
    cli.leave(main())
