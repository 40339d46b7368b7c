"""Sample from a trained run.

    python -m nljax.generate run.dir=runs/default prompt="def " max_new_tokens=200 \\
        temperature=0.8 top_k=40 top_p=0.95 seed=0 [stop=TEXT|stop='["\\n\\n", "def "]'] \\
        [stop_at_eos=false] [checkpoint=STEP|PATH] [params=average|trained] [--cpu-devices N]
    python -m nljax.generate run.dir=runs/default prompts=FILE.txt|FILE.jsonl out=RESULTS.jsonl \\
        [samples_per_prompt=N] [batch_size=8] [the sampling settings above]
    python -m nljax.generate run.dir=runs/default/export prompt="def "   # an export (nljax.export)
    python -m nljax.generate run.dir=runs/meanflow_digits [samples=16 | labels=3,3,7] [out=FILE.png] [seed=N]
    python -m nljax.generate run.dir=runs/meanflow_digits/export labels=3,3,7 out=FILE.png   # its export

A language model's text streams to the terminal as it is sampled, read window by window with the
neural memory carried as training reads the stream; an image model (MeanFlow) writes a PNG grid
of one-step and multi-step samples (its noise keyed by seed=, default the run's seed): for the
classes of `samples=` held-out images spread over them, or for the classes `labels=` names, one
sample each (numbers or a folder's class names, comma-separated or a JSON list; K, the number of
classes, for a sample of no class), as `nljax.load(run.dir).generate(labels=[...], seed=)` draws
them (an export holds no held-out images: it draws labels=, out= given). The same checkpoint and
seed give the same tokens on any device count. `checkpoint=` is a step number
(400: the run's checkpoint at step 400) or a step directory; under optim.ema_decay the parameters'
moving average is sampled unless `params=trained` (the optimizer's own); run.dir= may also be an export
directory, read as `nljax.load` reads it (one device; the same text as from its run). How the
stream is read and sampled: nljax/run/sampling.py.

A completion ends at the first of: the document-end token (bytes: NUL; a tokenizer: its
data.doc_end_token, if the run has one), not part of the text, as Hugging Face's generate stops at
eos_token_id (stop_at_eos=false samples past it, its text then part of the completion); one of the
stop= strings in its text, cut before it (the stop string is not part of the text, as with the stop
of OpenAI's API and vLLM); max_new_tokens. stop=TEXT is one stop string as it stands (no escapes);
a value in [ ] is a JSON list of them (JSON's escapes: "\\n" is a line's end). The terminal's text
holds back what may begin a stop string until the next token settles it (nljax/run/stopping.py).

prompts=FILE samples many prompts: a .txt file holds one a line (as it stands, spaces kept; empty
lines skipped; no escapes: a prompt with a line break goes in a .jsonl file), a .jsonl file a JSON
object a line with a string "prompt" (its other fields are copied to the prompt's results). Every
line is read and encoded before the checkpoint is. batch_size= completions are decoded together,
one row each (nljax/run/scoring.py; a row that has ended is not extended, and a batch ends when all
of its rows have), and out= receives one JSON line per completion, {"prompt", "completion",
"index" (the prompt's place, from 0), "sample" (from 0), "finish_reason" ("eos": the
document-end token; "stop": a stop string; "length": max_new_tokens), "new_tokens" (the tokens
drawn: an end token's and a stop string's counted, as lm.generate(details=True) gives them), the
input's other fields}, written whole or not at all; progress goes to standard error. Each
completion draws from its own generator, keyed by (seed, index, sample), and each row is decoded
on its own (its own windows and memory; every batch padded to the same rows): a completion does
not depend on the other prompts or their number, and prompt 0's sample 0 is the text prompt=
gives with the same seed (docs/guides/generation-and-export.md: what batch_size= and the device
count may change).

Any other `key=value` is a config override on top of the run's own config.yaml.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from nljax import cli, trained_model
from nljax import export as export_lib
from nljax.errors import ConfigError
from nljax.data import images as images_lib
from nljax.measure.figures import write_samples, written_by_nljax
from nljax.models import registry
from nljax.run import prompts as prompts_lib
from nljax.run import trained as trained_lib
from nljax.run.sampling import (completions, generate_images, generate_text, grid_labels, parse, prompt_ids,
                                tokenization_of, write_text)
from nljax.run.scoring import StreamReader
from nljax.runtime import resultfile


def main(argv=None) -> int:
    p = cli.Parser(allow_abbrev=False, prog="nljax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    p.add_argument("settings", nargs="*", metavar="key=value",
                   help="run.dir=DIR (required: a run directory, or an export directory); prompt=, max_new_tokens=, "
                        "temperature=, top_k=, top_p=, seed=, stop= (a string, or a JSON list of them: a "
                        "completion ends before the first in its text), stop_at_eos= (true: a completion ends at "
                        "the document-end token; false: sampled past it), checkpoint= (latest, a step number or a "
                        "step directory), params= (average or trained: under optim.ema_decay, the parameters' "
                        "moving average, the default, or the optimizer's own); many prompts: prompts=FILE (.txt, "
                        "a prompt a line; .jsonl, a \"prompt\" field a line), out=FILE.jsonl, samples_per_prompt=, batch_size=; for a MeanFlow run "
                        "samples= or labels= (classes, one sample each: 3,3,7 or class names) and out=FILE.png; any "
                        "other key=value: a config override")
    args = cli.parse(p, argv)  # key=value before or after a flag, as train's
    if isinstance(args, int):  # refused, or --help
        return args
    return cli.tool("nljax.generate", lambda: _generate(args), cli.stdout_to_devnull)


def _generate(args) -> int:
    cli.setup_devices(args.cpu_devices)
    given = {pair.partition("=")[0] for pair in args.settings}
    if {"prompt", "prompts"} <= given:  # which one to sample: neither wins in silence
        raise ConfigError("prompt= and prompts= together: give one prompt (prompt=) or a file of them (prompts=)")
    s, overrides, run_dir = parse(args.settings)
    if trained_model.kind_of(Path(os.path.expanduser(run_dir))) == "export":  # as nljax.load reads a directory
        return _from_export(run_dir, s, given, overrides)
    cfg = trained_lib.config_of(run_dir, s.checkpoint, overrides)
    images = registry.task_of(cfg) == "images"  # a denoiser's grid, or a language model's text
    _check(cfg.model.name, images, given, s, cfg.meanflow.class_cond)  # before anything is restored
    codec = tokenization_of(cfg) if s.prompts else None  # the run's tokenization, read without the checkpoint
    batch = _prompts(s, codec) if s.prompts else None  # each line checked before the load
    label = None
    if images and s.labels:  # a class the run lacks: said before the load (its images then in memory for the grid)
        data = images_lib.load(cfg.images)
        label = grid_labels(s.labels, data.classes, data.num_classes)
    if images and "seed" in given:  # the grid's noise is keyed by the config's seed (default: the run's)
        overrides = [*overrides, f"seed={s.seed}"]
    path = (Path(s.out) if s.out else Path(cfg.run.dir) / "generated.png") if images else None
    if path is not None:
        _refuse_a_users_picture(path)
    # building the model and restoring its parameters takes seconds (2-5 s after the imports on a
    # 2-core CPU), said before it as the other commands say their slow phases, once the settings
    # are checked (a refusal of them is one line)
    reading = f"reading the checkpoint of {run_dir} ..."
    # a grid is drawn beside the held-out images (their labels, the reference row): they are read
    t = trained_lib.load(run_dir, s.checkpoint, overrides, announce=lambda: _say(reading), params=s.params,
                         reads_data=images)
    for line in [*t.warnings("nljax.generate"), f"nljax.generate: {t.path} (step {t.step}{t.which})"]:
        print(line, file=sys.stderr)
    if images:
        held = len(t.run.task.data.eval_x)
        if s.samples > held and not s.labels:  # one sample per held-out label: the grid was cut to them in silence
            print(f"nljax.generate: samples={s.samples}: the run holds {held} held-out images, one sample for each "
                  f"one's label: drawing {held}", file=sys.stderr)
        _say("drawing the grid (compiling the sampler first) ...")
        try:
            generate_images(t, s, path, label)
        except OSError as e:  # permissions, a full disk, a directory that does not exist
            print(f"nljax.generate: error: {cli.cannot_write(path, e)}", file=sys.stderr)
            return 1
        print(f"nljax.generate: wrote {path}", file=sys.stderr)
    elif batch is not None:
        reader = StreamReader(t.model, t.params, t.run.mesh, t.cfg.train.seq_len, codec.end_id, s.batch_size,
                              vocab=t.cfg.model.vocab_size)
        return _write_completions(reader, codec, s, *batch)
    else:
        _say("sampling (compiling the model first) ...")  # seconds before the first token
        generate_text(t, s, _write)
        print()
    return 0


def _say(line: str) -> None:
    """A progress line before a slow phase, on standard error (the text goes to standard output)."""
    print(f"nljax.generate: {line}", file=sys.stderr, flush=True)


def _from_export(path: str, s, given: set[str], overrides: list[str]) -> int:
    """An export (nljax.export), loaded as `nljax.load` loads it (one device, a language model's
    tokenizer beside it): the same text, or grid, as from the run it came from."""
    # run.dir= is how the directory was named; any other override, or checkpoint=, is refused there
    overrides = [o for o in overrides if not o.startswith("run.dir=")]
    where = Path(os.path.expanduser(path))
    trained_model.check_export_args(where, s.checkpoint, overrides, s.params)
    _, cfg = export_lib.read_config(where)  # the settings checked against it before the weights are read
    images = registry.task_of(cfg) == "images"  # not `makes_text`: a text model without logits is no image model
    _check(cfg.model.name, images, given, s, cfg.meanflow.class_cond)
    if images:
        return _grid_of_export(path, where, s, given)
    batch = _prompts(s, export_lib.tokenization_of_export(where, cfg)) if s.prompts else None
    _say(f"reading the export {path} ...")  # its weights checked, the model built: seconds, as a checkpoint's
    lm = trained_model.load(where, s.checkpoint, overrides)
    print(f"nljax.generate: {lm.source} (export, step {lm.step})", file=sys.stderr)
    if batch is not None:
        return _write_completions(lm.stream_reader(s.batch_size), lm.tokenizer, s, *batch)
    _say("sampling (compiling the model first) ...")
    write_text(lm.sampler(), lm.tokenizer, s, _write)
    print()
    return 0


def _grid_of_export(path: str, where: Path, s, given: set[str]) -> int:
    """An image model's export: the grid of the classes labels= names (or of samples= samples of an
    unconditional model), drawn as `nljax.load(DIR).generate(labels=, seed=)` draws them; an
    export holds no held-out images to draw samples= for."""
    model = export_lib.built_model(where)  # its classes, before the weights are read
    conditional = getattr(model, "conditional", False)
    if conditional and not s.labels:
        raise ConfigError(f"{path} is the export of a class-conditional image model: give the classes to draw, "
                          "labels=0,1,2 (samples= draws for held-out images, which the run directory has)")
    # an export directory holds its model alone: a grid there made nljax.export refuse to write
    # that directory again ("holds grid.png, which an export does not write")
    out = Path(os.path.expanduser(s.out)) if s.out else None
    if out is None or out.absolute().parent.resolve() == where.resolve():
        raise ConfigError(f"{path} is an export: give out=FILE.png, the grid's file (outside the export directory)")
    _refuse_a_users_picture(out)
    if s.labels:  # refused for a model that reads no labels
        label = grid_labels(s.labels, getattr(model, "classes", None), trained_model.label_classes(model))
    else:
        label = np.zeros(s.samples, int)  # an unconditional model's: not read
    _say(f"reading the export {path} ...")
    lm = trained_model.load(where)
    print(f"nljax.generate: {lm.source} (export, step {lm.step})", file=sys.stderr)
    _say("drawing the grid (compiling the sampler first) ...")
    seed = s.seed if "seed" in given else None  # default: the run's, as its evaluation's samples
    steps = lm.config.meanflow.sample_steps
    one, multi = (lm.generate(labels=label.tolist(), steps=n, seed=seed) for n in (1, steps))
    try:  # no held-out images beside it: 2-D toy data are drawn without the grey points
        write_samples(out, one, multi, one[:0], steps, label if conditional else None, f"{path}, step {lm.step}",
                      getattr(model, "classes", None))
    except OSError as e:
        print(f"nljax.generate: error: {cli.cannot_write(out, e)}", file=sys.stderr)
        return 1
    print(f"nljax.generate: wrote {out}", file=sys.stderr)
    return 0


def _refuse_a_users_picture(out: Path) -> None:
    """A user's picture of the grid's name is never replaced (one nljax.generate wrote is)."""
    if out.exists() and not written_by_nljax(out):
        raise ConfigError(f"out={out} exists and is not a PNG nljax.generate wrote; give another out= or move it")


def _prompts(s, codec) -> tuple[list[prompts_lib.Prompt], list[list[int]]]:
    """The file's prompts and their tokens: every line read and encoded before anything slow runs
    (a line the tokenizer cannot encode is named, as prompt= is refused)."""
    records = prompts_lib.read(s.prompts)
    if held := prompts_lib.settings_in(records):  # a vLLM user's per-request stop: copied, never applied
        settings = dict.fromkeys(prompts_lib.SETTING_NAMES.get(k, k) + "=" for k in held)  # OpenAI's max_tokens
        print(f"nljax.generate: warning: prompts={s.prompts}: the records' fields {', '.join(held)} are copied to "
              f"the results, not read: the command line's settings ({', '.join(settings)}) apply to every prompt",
              file=sys.stderr)
    return records, [prompt_ids(codec, r.text, where=f"prompts={s.prompts} line {r.line}: ") for r in records]


def _write_completions(reader, codec, s, records: list[prompts_lib.Prompt], ids: list[list[int]]) -> int:
    """The completions of every prompt as JSON lines in out=, written whole or not at all."""
    out, start = Path(s.out), time.perf_counter()
    total = len(records) * s.samples_per_prompt
    # a batch_size that the devices do not divide is rounded up (each decodes its share of rows): said why
    why = (f" (batch_size={s.batch_size} rounded up to {reader.rows}, a multiple of {reader.devices} devices)"
           if reader.rows != s.batch_size else "")
    print(f"nljax.generate: {len(records)} prompt{'s' if len(records) > 1 else ''} x {s.samples_per_prompt} "
          f"sample{'s' if s.samples_per_prompt > 1 else ''}, {reader.rows} at a time{why} -> {out}", file=sys.stderr)

    def done(n: int, total: int, tokens: int) -> None:
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        first = " (the first batch compiles too)" if n <= reader.rows else ""
        print(f"nljax.generate: {n}/{total} completions, {tokens:,} tokens, {rate:,.1f} tokens/s{first}",
              file=sys.stderr)

    results = ({"prompt": records[i].text, "completion": c.text, "index": i, "sample": j,
                "finish_reason": c.finish_reason, "new_tokens": c.new_tokens, **records[i].fields}
               for i, j, c in completions(reader, codec, ids, s, done))
    try:
        resultfile.write_lines(out, results)
    except OSError as e:  # permissions, a full disk, a directory that does not exist
        print(f"nljax.generate: error: {cli.cannot_write(out, e)}", file=sys.stderr)
        return 1
    print(f"nljax.generate: wrote {total} completion{'s' if total > 1 else ''} to {out}", file=sys.stderr)
    return 0


def _check(model_name: str, images: bool, given: set[str], s, conditional: bool = False) -> None:
    """Settings that do not fit the model (checked before its parameters are read)."""
    for key in sorted(given & {"samples", "labels"}):
        if not images:
            raise ConfigError(f"{key}= is for a MeanFlow (model.name=dit) run's image grid; this run's model is "
                              f"{model_name}" + (": completions per prompt of prompts=FILE are samples_per_prompt="
                                                 if key == "samples" else ""))
    if images and {"samples", "labels"} <= given:
        raise ConfigError("samples= and labels= together: labels= draws one sample per class it names")
    if images and "labels" in given and not conditional:  # its samples read no label: the grid would lie
        raise ConfigError(f"labels=: this run's model ({model_name}) is unconditional (meanflow.class_cond=false): "
                          "its samples have no class; samples=N draws N")
    if not images and s.out and not s.prompts:
        raise ConfigError(f"out= names the results of prompts=FILE (.jsonl) or a MeanFlow (model.name=dit) run's "
                          f"image grid; this run's model is {model_name}: the text of prompt= goes to the terminal")
    batched = sorted(given & {"samples_per_prompt", "batch_size"})
    if not images and batched and not s.prompts:  # ignored in silence otherwise
        raise ConfigError(f"{', '.join(k + '=' for k in batched)} {'is' if len(batched) == 1 else 'are'} for "
                          "prompts=FILE (many prompts); prompt= samples one completion")
    text_only = sorted(given & {"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "prompts",
                                "samples_per_prompt", "batch_size", "stop", "stop_at_eos"})
    if images and text_only:  # ignored before, with exit 0
        raise ConfigError(f"{', '.join(k + '=' for k in text_only)} {'is' if len(text_only) == 1 else 'are'} for "
                          f"a language model; this run's model is {model_name}: it draws an image grid "
                          "(samples=, out=, seed=)")
    if not images and not s.prompts and sys.stdout is None:  # started with standard output closed (>&-)
        raise ConfigError("standard output is closed: the text has nowhere to go")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    cli.leave(main())
