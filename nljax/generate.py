"""Sample from a trained run.

    python -m nljax.generate run.dir=runs/default prompt="def " max_new_tokens=200 \\
        temperature=0.8 top_k=40 top_p=0.95 seed=0 [checkpoint=STEP|PATH] [--cpu-devices N]
    python -m nljax.generate run.dir=runs/default/export prompt="def "   # an export (nljax.export)
    python -m nljax.generate run.dir=runs/meanflow_digits [samples=16] [out=FILE.png] [seed=N]

A language model's text streams to the terminal as it is sampled, read window by window with the
neural memory carried as training reads the stream; an image model (MeanFlow) writes a PNG grid
of one-step and multi-step samples (its noise keyed by seed=, default the run's seed). The same
checkpoint and seed give the same tokens on any device count. `checkpoint=` is a step number
(400: the run's checkpoint at step 400) or a step directory; run.dir= may also be an export
directory, read as `nljax.load` reads it (one device; the same text as from its run). How the
stream is read and sampled: nljax/run/sampling.py.

Any other `key=value` is a config override on top of the run's own config.yaml.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nljax import cli, trained_model
from nljax.errors import ConfigError
from nljax.measure.figures import written_by_nljax
from nljax.models import registry
from nljax.run import trained as trained_lib
from nljax.run.sampling import generate_images, generate_text, parse, write_text


def main(argv=None) -> int:
    p = cli.Parser(allow_abbrev=False, prog="nljax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    p.add_argument("settings", nargs="*", metavar="key=value",
                   help="run.dir=DIR (required: a run directory, or an export directory); prompt=, max_new_tokens=, "
                        "temperature=, top_k=, top_p=, seed=, checkpoint= (latest, a step number or a step "
                        "directory); for a MeanFlow run samples= and out=FILE.png; any other key=value: a config "
                        "override")
    args = p.parse_intermixed_args(argv)  # key=value before or after a flag, as train's
    return cli.tool("nljax.generate", lambda: _generate(args), cli.stdout_to_devnull)


def _generate(args) -> int:
    cli.setup_devices(args.cpu_devices)
    s, overrides, run_dir = parse(args.settings)
    given = {pair.partition("=")[0] for pair in args.settings}
    if trained_model.kind_of(Path(os.path.expanduser(run_dir))) == "export":  # as nljax.load reads a directory
        return _from_export(run_dir, s, given, overrides)
    cfg = trained_lib.config_of(run_dir, s.checkpoint, overrides)
    images = registry.task_of(cfg) == "images"  # a denoiser's grid, or a language model's text
    _check(cfg.model.name, images, given, s)  # before anything is restored
    if images and "seed" in given:  # the grid's noise is keyed by the config's seed (default: the run's)
        overrides = [*overrides, f"seed={s.seed}"]
    t = trained_lib.load(run_dir, s.checkpoint, overrides)
    for line in [*t.warnings("nljax.generate"), f"nljax.generate: {t.path} (step {t.step})"]:
        print(line, file=sys.stderr)
    if images:
        path = Path(s.out) if s.out else Path(t.cfg.run.dir) / "generated.png"
        if path.exists() and not written_by_nljax(path):  # a user's picture of the same name
            raise ConfigError(f"out={path} exists and is not a PNG nljax.generate wrote; give another out= or "
                              "move it")
        held = len(t.run.task.data.eval_x)
        if s.samples > held:  # one sample per held-out label: the grid was cut to them in silence
            print(f"nljax.generate: samples={s.samples}: the run holds {held} held-out images, one sample for each "
                  f"one's label: drawing {held}", file=sys.stderr)
        try:
            generate_images(t, s, path)
        except OSError as e:  # permissions, a full disk, a directory that does not exist
            print(f"nljax.generate: error: {cli.cannot_write(path, e)}", file=sys.stderr)
            return 1
        print(f"nljax.generate: wrote {path}", file=sys.stderr)
    else:
        generate_text(t, s, _write)
        print()
    return 0


def _from_export(path: str, s, given: set[str], overrides: list[str]) -> int:
    """A language model's export (nljax.export), loaded as `nljax.load` loads it (one device,
    the tokenizer beside it): the same text as from the run it came from."""
    # run.dir= is how the directory was named; any other override, or checkpoint=, is refused there
    lm = trained_model.load(path, s.checkpoint, [o for o in overrides if not o.startswith("run.dir=")])
    images = registry.task_of(lm.config) == "images"  # not `makes_text`: a text model without logits is no image model
    _check(lm.config.model.name, images, given, s)
    if images:  # the grid sets samples beside the run's held-out images, which an export lacks
        raise ConfigError(f"{path} is the export of an image model (model.name={lm.config.model.name}): "
                          "nljax.generate draws its grid from the run directory (beside the held-out images); "
                          "an export samples from Python: nljax.load(DIR).generate(labels=[...])")
    print(f"nljax.generate: {lm.source} (export, step {lm.step})", file=sys.stderr)
    write_text(lm.sampler(), lm.tokenizer, s, _write)
    print()
    return 0


def _check(model_name: str, images: bool, given: set[str], s) -> None:
    """Settings that do not fit the model (checked before its parameters are read)."""
    if not images and (s.out or "samples" in given):
        raise ConfigError(f"out= and samples= are for a MeanFlow (model.name=dit) run's image grid; "
                          f"this run's model is {model_name}: its text goes to the terminal")
    text_only = sorted(given & {"prompt", "max_new_tokens", "temperature", "top_k", "top_p"})
    if images and text_only:  # ignored before, with exit 0
        raise ConfigError(f"{', '.join(k + '=' for k in text_only)} {'is' if len(text_only) == 1 else 'are'} for "
                          f"a language model; this run's model is {model_name}: it draws an image grid "
                          "(samples=, out=, seed=)")
    if not images and sys.stdout is None:  # started with standard output closed (>&-)
        raise ConfigError("standard output is closed: the text has nowhere to go")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
