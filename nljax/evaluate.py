"""Score a trained run's checkpoint on held-out data.

    python -m nljax.evaluate run.dir=runs/default [checkpoint=latest|STEP|PATH] [out=FILE.json]
        [params=average|trained]
        [eval.batches=N] [eval.stream_steps=N] [data.eval=GLOB | data.prepared=DIR | data.KEY=...]
        [data.eval_sets=[NAME=GLOB,...]]
        [--cpu-devices N]
    python -m nljax.evaluate run.dir=runs/default/export [data.eval=GLOB ...]   # an export (nljax.export)

prints the held-out metrics that the run's own evaluation computes (`Task.evaluate`,
nljax/run/tasks.py), for one checkpoint: a language model's loss in nats per token, bits per
byte and bits per token, each window from a fresh memory (`eval_loss`, `eval_bpb`, `eval_bpt`)
and, with eval.stream_steps > 0, with the memory carried from window to window (`*_stream`); a
MeanFlow model's energy distances (and its unweighted error); each set of data.eval_sets (the
run's, or given here) is scored as the main held-out text, under the same keys with /<name>
after them (`eval_loss/wiki`). The run's settings are kept
(train.batch_size rows, train.seq_len, eval.batches, eval.stream_steps) unless overridden, so
the numbers are those the run reported for that checkpoint, to float rounding on any device
count (it reads on as many of the local devices as divide train.batch_size).

The held-out data are the run's own. `data.eval=GLOB` alone scores those files, tokenized as the
run's text (its tokenizer; the run's training text is not read); `data.prepared=DIR` alone scores
that directory's held-out split; any other `data.KEY=` is an override on the run's config. Of a
data.prepared directory only the manifest, the tokenizer copy and the held-out split are read:
train.bin is never opened (`Run.create(trains=False)`), and may be gone, as may the text it was
prepared from (data.train). Data whose token ids are
not the checkpoint's (another tokenizer) are refused. A MeanFlow run's other held-out images are
`images.*` overrides; data of the other kind (`data.*` for an image model, `images.*` for a
language model) is refused.

run.dir= may be an export directory (nljax.export): its parameters scored as its run scored the
checkpoint they came from (its config.json's settings; text tokenized by the export's own copy of
the tokenizer; `trained.load_export`); checkpoint= and params= are then refused.

Under optim.ema_decay a run keeps its parameters' moving average beside them: it is scored, as
the run's own evaluation scores it, unless `params=trained` (the optimizer's own parameters).

`out=FILE.json` also writes the result, whole or not at all; an existing file is replaced only
when it is an earlier result of this command.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

# nljax.cli imports JAX first, turning an environment variable JAX cannot read into one line
from nljax import cli  # noqa: I001

import jax

from nljax import config
from nljax import export as export_lib
from nljax.checkpoint.contents import check_built, check_tokenizer
from nljax.data import imagefolder
from nljax.data.prepared import MANIFEST, tokenization_of
from nljax.data.settings import EVAL_FRACTION
from nljax.data.tokenization import identity
from nljax.errors import ConfigError
from nljax.models import registry
from nljax.run import trained as trained_lib
from nljax.run.core import Run
from nljax.runtime import filedigest, resultfile
from nljax.runtime.exportdir import TOKENIZER, exported_from, is_export
from nljax.version import __version__

# keys every result has: an existing out= file with them is an earlier result, replaced
RESULT_KEYS = frozenset({"command", "run_dir", "checkpoint", "step"})


def main(argv=None) -> int:
    p = cli.Parser(allow_abbrev=False, prog="nljax.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    p.add_argument("settings", nargs="*", metavar="key=value",
                   help="run.dir=DIR (required: a run directory, or an export directory); checkpoint= "
                        "(latest, a step number or a step directory); out=FILE.json; params= (average or "
                        "trained: under optim.ema_decay, the parameters' moving average, the default, or the "
                        "optimizer's own); any other "
                        "key=value: a config override (eval.batches=, eval.stream_steps=, data.eval=, "
                        "data.prepared=, ...)")
    argv = cli.listed(argv)
    args = cli.parse(p, argv)  # key=value before or after a flag, as train's
    if isinstance(args, int):  # refused, or --help
        return args
    return cli.tool("nljax.evaluate", lambda: _evaluate(args, argv), cli.stdout_to_devnull)


def _evaluate(args, argv: list[str]) -> int:
    cli.setup_devices(args.cpu_devices)
    mine, overrides, run_dir = trained_lib.split_args(args.settings, {"checkpoint": str, "out": str, "params": str})
    out = Path(mine["out"]) if mine.get("out") else None
    if out is not None:
        resultfile.check(out, f"out={out}", "nljax.evaluate", RESULT_KEYS)  # before the slow load: writes nothing
    # building the model, reading the held-out data (a run on data.train tokenizes its text again)
    # and restoring the checkpoint take seconds to minutes: said once the settings are checked
    what = f"the export {run_dir}" if is_export(Path(run_dir)) else f"the checkpoint of {run_dir}"
    reading = f"nljax.evaluate: reading {what} and its held-out data ..."
    t = load(run_dir, mine.get("checkpoint", "latest"), overrides,
             announce=lambda: print(reading, file=sys.stderr, flush=True), params=mine.get("params", ""))
    n, local = t.run.engine.n_devices, len(jax.local_devices())
    on = f"{n} device{'s' if n > 1 else ''}" + (
        f" (of {local}: as many as divide train.batch_size={t.cfg.train.batch_size})" if n < local else "")
    notes = [f"nljax.evaluate: {note}" for note in getattr(t.run.task, "notes", ())]  # held-out data too short
    export = is_export(t.path)
    read = f"nljax.evaluate: {t.path} ({'export, ' if export else ''}step {t.step}{t.which}) on {on}{_data(t)}"
    for line in [*t.warnings("nljax.evaluate"), *notes, read]:
        print(line, file=sys.stderr)
    # compiling the evaluation takes seconds to a minute, with nothing else to show meanwhile
    print("nljax.evaluate: evaluating (compiling its step first) ...", file=sys.stderr, flush=True)
    metrics = scores(t)
    for key, value in metrics.items():
        print(f"{key:<24} {value}")
    if out is not None:
        # an export's: the checkpoint it was exported from, as its config.json records it
        came = (exported_from(t.path) or str(t.path)) if export else str(t.path)
        result = {"command": " ".join(["python -m nljax.evaluate", *argv]), "run_dir": run_dir,
                  **({"export": str(t.path)} if export else {}), "checkpoint": came, "step": t.step,
                  "params": t.params_read,
                  "devices": n, **metrics, "nljax_version": __version__}
        describe = getattr(t.run.task, "describe", None)  # source, tokens or images, digest (as summary.json)
        if describe is not None:
            result["data"] = describe()
        try:
            resultfile.write(out, result)
        except OSError as e:  # permissions, a full disk
            print(f"nljax.evaluate: error: {cli.cannot_write(out, e)}", file=sys.stderr)
            return 1
        print(f"nljax.evaluate: wrote {out}", file=sys.stderr)
    return 0


def load(run_dir: str, checkpoint: str | int = "latest", overrides: Sequence[str] = (),
         devices=None, announce=None, params: str = "") -> trained_lib.Trained:
    """The run's checkpoint, set up to be evaluated as the run evaluated it (`trained.load` with
    `evaluates`): its rows and evaluation settings, the held-out data of `overrides`
    (`data_overrides`), on as many of `devices` (default: this process's) as divide its rows.
    `announce`, `params`: as `trained.load`'s."""
    export = is_export(Path(run_dir))
    if export and (str(checkpoint) != "latest" or params):
        raise ConfigError(f"{run_dir} is an export (one set of parameters): checkpoint= and params= are for a run "
                          "directory")
    _check_data_kind(run_dir, overrides)
    given = list(overrides)
    overrides = data_overrides(run_dir, overrides)
    rows = _saved_config(run_dir, overrides).train.batch_size
    devices = list(devices or jax.local_devices())
    n = max(d for d in range(1, len(devices) + 1) if rows % d == 0)
    try:
        if export:
            t = load_export(run_dir, overrides, devices[:n], announce=announce)
        else:
            t = trained_lib.load(run_dir, checkpoint, overrides, devices[:n], evaluates=True, announce=announce,
                                 params=params)
    except ConfigError as e:
        if (hint := _gone_hint(str(e), given, run_dir)) is None:
            raise
        raise ConfigError(f"{e} ({hint})") from None
    if hasattr(t.run.task, "samples_dir"):  # an image task's evaluation draws no PNG into the run directory
        t.run.task.samples_dir = None
    return t


def _gone_hint(line: str, given: Sequence[str], run_dir: str) -> str | None:
    """What to give instead when `line`, a refusal of the key it starts with, is of the run's own
    data, named by no one on this command line (gone since, or moved); None otherwise. Its
    tokenizer and its data.eval_sets are not replaced by data.eval=, which the line named."""
    key = re.match(r"(data|images)\.\w+", line)
    keys = {o.partition("=")[0].strip() for o in given}
    if key is None or key[0] in keys:
        return None
    saved = "config.json" if is_export(Path(run_dir)) else "config.yaml"
    if key[0] == "data.tokenizer":  # an export's own copy: checked as the export's file (`load_export`)
        return f"the run's tokenizer, as its {saved} names it: give data.tokenizer= where it is now"
    if key[0] == "data.eval_sets":
        return (f"the run's own held-out sets, as its {saved} names them: give data.eval_sets= to score others, "
                "[] for none")
    if any(k.startswith(("data.", "images.")) for k in keys):
        return None
    other = "images.path=" if registry.task_of(_saved_config(run_dir)) == "images" else "data.eval="
    return f"the run's own held-out data, as its {saved} names them: give {other} to score others"


def load_export(path: str | Path, overrides: Sequence[str] = (), devices=None,
                announce: Callable[[], None] | None = None) -> trained_lib.Trained:
    """The export (`nljax.export`) in `path` set up to be evaluated as its run was: its run's
    config (config.json's) with `overrides`, its rows and evaluation settings kept, the data it
    names read (a text model's held-out text, an image model's held-out images), on `devices`
    (default: this process's; their count must divide train.batch_size), its parameters
    replicated there in the model's dtypes (a bfloat16 export's values exactly). The data must
    be the export's: its token ids (bytes, or its tokenizer's sha256) and, for an image model,
    what they build (`check_built`) are checked before its weights are read. `announce`: as
    `trained.load`'s."""
    path = Path(path)
    info, _ = export_lib.read_config(path)
    devices = list(devices or jax.local_devices())
    placed = trained_lib.placed_settings(overrides, len(devices), True, "the export")
    trained_cfg = config.from_dict(info["config"], overrides)
    fields = {k: v for k, v in info.items() if k not in ("config", "sha256", "digest")}  # its record among them
    cfg = config.from_dict(info["config"], [*overrides, "checkpoint.resume=", *placed])
    cfg = trained_lib.used_here(cfg, overrides, True, fields)
    recorded = info.get("sha256")
    copy = path / TOKENIZER
    if isinstance(recorded, dict) and TOKENIZER in recorded and cfg.data.tokenizer and \
            Path(cfg.data.tokenizer).absolute() == copy.absolute():
        # the data read with the export's copy, checked first: one gone or changed is the export's
        # line ("data.tokenizer: cannot read", "trained on the tokenizer of sha256 ..." misled)
        filedigest.check(path, {TOKENIZER: recorded[TOKENIZER]}, "the export")
    tokens = info.get("tokenizer")
    if isinstance(tokens, dict) and registry.task_of(cfg) == "text":
        # before the data are read: another tokenizer of a larger vocabulary was refused as
        # "model.vocab_size=274 is smaller than the 285 tokens ...; leave it at 256" instead
        check_tokenizer(path, identity(tokens), identity(tokenization_of(cfg.data).info()), "the data now use",
                        kind="export")
    if announce is not None:
        announce()
    run = Run.create(cfg, devices, trains=False, average=False)  # the budget of the parameters alone
    here = registry.record(run.engine.model, cfg.model.name)
    check_built(path, {"built": {k: fields[k] for k in here if k in fields}}, here, kind="export")
    weights = export_lib.read_weights(path, info, run.engine.model)
    layout, _ = run.engine.strategy.state_layout()  # replicated: the model's own tree, on run.mesh
    params = jax.tree.map(lambda w, s: jax.device_put(w.astype(s.dtype), s.sharding), weights, layout)
    return trained_lib.Trained(cfg, trained_cfg, run, params, int(info["step"]), path,
                               average=info.get("params") == "average")


def scores(t: trained_lib.Trained) -> dict:
    """The run's evaluation of `t`'s parameters (`Run.evaluate`, as the trainer calls it), with a
    text model's bits per token beside its bits per byte (equal for byte tokens), of the main
    held-out text and of each data.eval_sets set (`eval_bpt/<name>`)."""
    metrics = {}
    for key, value in t.run.evaluate(t.params, t.step).items():
        metrics[key] = value
        base, slash, name = key.partition("/")  # a set's name is not read: it may hold "bpb"
        if base in ("eval_bpb", "eval_bpb_stream"):
            loss = metrics[base.replace("bpb", "loss") + slash + name]
            metrics[base.replace("bpb", "bpt") + slash + name] = loss / math.log(2)
    return metrics


def _check_data_kind(run_dir: str, overrides: Sequence[str]) -> None:
    """Held-out data of the other kind is refused: a MeanFlow run's `data.eval=` (text) or a
    language model's `images.path=` was ignored, and the run's own held-out data scored, exit 0."""
    cfg = _saved_config(run_dir)
    images = registry.task_of(cfg) == "images"
    other = "data." if images else "images."
    given = [o.partition("=")[0] for o in overrides if o.startswith(other)]
    if given:
        reads = "its held-out images are images.* (images.path=...)" if images else "it reads text (data.eval=, ...)"
        raise ConfigError(f"{given[0]}= is {'text' if images else 'image'} data, and this run's model is "
                          f"{cfg.model.name}: {reads}")


def _saved_config(run_dir: str, overrides: Sequence[str] = ()):
    """The config the run trained with (a run directory's config.yaml, an export's config.json),
    with `overrides`."""
    if is_export(Path(run_dir)):
        return config.from_dict(export_lib.read_config(run_dir)[0]["config"], overrides)
    return trained_lib.trained_config(run_dir, overrides)


def data_overrides(run_dir: str, overrides: Sequence[str]) -> list[str]:
    """`overrides` with what naming other held-out data implies. `data.eval=` without data.train
    or data.prepared: those files alone (data.source=files; `nljax.data.prepared.held_out`: the
    run's training text is not read), tokenized as the run's text was (its data.tokenizer, or its
    data.prepared directory's copy; an export's own copy); `data.prepared=` without data.train:
    that directory alone. An export's run's own data (no data named) are tokenized by the
    export's copy of data.tokenizer (the run's file may be gone)."""
    given = {o.partition("=")[0]: o.partition("=")[2] for o in overrides}
    export = _export_tokenizer(run_dir)
    d = _saved_config(run_dir).data
    if "data.train" in given or not {"data.eval", "data.prepared"} & given.keys():
        if export and d.source == "files" and d.tokenizer and not {"data.tokenizer", "data.prepared"} & given.keys():
            return [*export, *overrides]
        return list(overrides)
    if "data.prepared" in given:  # the run's file keys would be checked against the directory's (and its split)
        return ["data.source=files", "data.train=[]", "data.eval=[]", "data.tokenizer=", "data.doc_end_token=",
                f"data.eval_fraction={EVAL_FRACTION}", *overrides]
    prepared = []
    if d.source == "files" and d.prepared:
        prepared = _prepared_settings(d.prepared)
        if export:  # its tokenizer: the export's copy (the directory's text_key still read from there)
            prepared = [*export, *(o for o in prepared if o.startswith("data.text_key="))]
    elif export:
        prepared = export
    prepared = [o for o in prepared if o.partition("=")[0] not in given]
    return ["data.source=files", "data.train=[]", "data.prepared=", *prepared, *overrides]


def _export_tokenizer(run_dir: str) -> list[str]:
    """data.tokenizer and data.doc_end_token for the tokenization an export in `run_dir` records
    (bytes, or the tokenizer.json beside it); none for a run directory, or an export recording none."""
    if not is_export(Path(run_dir)):
        return []
    info = export_lib.read_config(run_dir)[0].get("tokenizer")
    if not isinstance(info, dict) or "kind" not in info:
        return []
    if info["kind"] == "bytes":
        return ["data.tokenizer=", "data.doc_end_token="]
    # quoted: a token such as [EOS] is a string, not a YAML list
    end = json.dumps(info.get("doc_end_token") or "")
    return [f"data.tokenizer={Path(run_dir) / TOKENIZER}", f"data.doc_end_token={end}"]


def _prepared_settings(prepared: str) -> list[str]:
    """data.tokenizer and data.doc_end_token for the tokenizer a data.prepared directory holds
    (none for bytes, or when the directory is gone: the tokenizer check then says what differs),
    and the data.text_key its files were read with (the run's own config holds the default: the
    key was prepare's, and another .jsonl of the same fields read no text)."""
    home = Path(os.path.expanduser(prepared))
    try:
        manifest = json.loads((home / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    key = manifest.get("settings", {}).get("text_key") if isinstance(manifest.get("settings"), dict) else None
    out = [f"data.text_key={json.dumps(key)}"] if isinstance(key, str) and key else []
    try:
        info = manifest["tokenizer"]
        if info["kind"] == "bytes":
            return out
        # quoted: a token such as [EOS] is a string, not a YAML list
        end = json.dumps(info.get("doc_end_token") or "")
        return [f"data.tokenizer={home / info['file']}", f"data.doc_end_token={end}", *out]
    except (KeyError, TypeError):
        return out


def _data(t: trained_lib.Trained) -> str:
    describe = getattr(t.run.task, "describe", None)
    if describe is None:
        return ""
    d = describe()
    if "eval_images" in d:  # a MeanFlow run's images (a folder's: its class names, as at start-up)
        names = f", classes {d['num_classes']} ({imagefolder.short_list(d['classes'])})" if "classes" in d else ""
        return f", images {d['source']} ({d['eval_images']:,} held-out{names}, digest {d['digest'][:12]})"
    digests = d.get("eval_set_digests", {})  # data.eval_sets: what the run's checkpoints record
    sets = "".join(f", set {k} ({n:,} tokens" + (f", digest {digests[k][:12]})" if k in digests else ")")
                   for k, n in d.get("eval_sets", {}).items())
    return f", data {d['source']} ({d['eval_tokens']:,} held-out tokens, digest {d['digest'][:12]}){sets}"


if __name__ == "__main__":
    cli.leave(main())
