"""Prepare your own text once, for training with data.source=files data.prepared=DIR:

    python -m nljax.prepare [--config FILE] data.train=GLOB [data.eval=GLOB] [data.text_key=text]
                            [data.tokenizer=tokenizer.json [data.doc_end_token=TOKEN]]
                            [prepare.workers=N] out=DIR [overwrite=true]

data.eval alone (no data.train) prepares held-out text only: a held-out set to score
(data.eval_sets=[NAME=DIR], nljax.evaluate data.prepared=DIR), which no run trains on.

reads and tokenizes the files (.txt, .jsonl, .gz, Parquet, Arrow, save_to_disk folders:
nljax/data/documents.py) in chunks, with `prepare.workers` processes (nljax/data/chunks.py), and
writes DIR: each split's tokens as a file to memory-map, its document starts, a copy of the
tokenizer and manifest.json (nljax/data/prepared.py). Input and output are streamed, so memory
stays bounded whatever the corpus size. The data.* keys are the config's, so one config file can
prepare and then train. Bad data (a missing file, no text, bytes that are not UTF-8, a token id
beyond the vocabulary) is one line and exit 2, and DIR is left as it was; so is an out= that cannot
be written (a read-only folder or file system), before any text is tokenized. Interrupted (Ctrl-C,
a kill), the same command resumes from the chunks done (nljax/data/workdir.py) and writes the same
files. They are written beside DIR, in .DIR.prepare-work, made into a complete directory there and
read back, then put in place of DIR whole (nljax/data/outdir.py): DIR holds the previous prepared
data until the new ones replace it, never a mix. A prepare stopped between the two renames of that
replacement leaves DIR absent and the previous data whole in .DIR.prepare-old; the next
nljax.prepare into DIR puts them back first (one warning line), or removes them when it stopped
after the new data were in place.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from nljax import cli, config
from nljax.data import chunks, prepared
from nljax.errors import ConfigError

OWN = ("out", "overwrite")  # this tool's keys; every other key=value is a config override


def parse(pairs: list[str]) -> tuple[Path | None, bool, list[str]]:
    """(out, overwrite, config overrides) from `key=value` arguments; out None: not given."""
    own, overrides = {}, []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {pair!r}")
        if key in OWN:
            own[key] = value
        else:
            config.check_setting(key, OWN)
            overrides.append(pair)
    if own.get("overwrite", "false") not in ("true", "false"):
        raise ConfigError(f"overwrite must be true or false, got {own['overwrite']!r}")
    # `~` is the home directory whether the shell expanded it or not (nljax.load reads it so too);
    # os.path's expanduser: `~name` of no user stays as typed, as a shell leaves it (pathlib's raises)
    out = Path(os.path.expanduser(own["out"])) if own.get("out") else None
    return out, own.get("overwrite") == "true", overrides


def describe(c: prepared.Corpus) -> str:
    m = c.manifest
    tok = m["tokenizer"]
    kind = "bytes" if tok["kind"] == "bytes" else f"tokenizer {tok['sha256'][:12]}"
    return (f"{m['train']['tokens']:,} training tokens in {m['train']['documents']:,} documents, "
            f"{m['eval']['tokens']:,} held-out tokens in {m['eval']['documents']:,}, {m['dtype']}, vocabulary "
            f"{m['vocab_size']} ({kind}), digest {m['digest'][:12]}")


def main(argv=None) -> int:
    p = cli.Parser(allow_abbrev=False, prog="nljax.prepare", description="Prepare your own text once (tokenized, "
                   "memory-mapped), for training with data.source=files data.prepared=DIR.")
    p.add_argument("--config", action="append", metavar="FILE", help="YAML config file whose data.* keys name the "
                   "text; given again, each file updates the ones before it key by key")
    p.add_argument("settings", nargs="*", metavar="key=value", help="out=DIR (required), overwrite=true, data.* keys")
    args = cli.parse(p, argv)  # key=value before or after a flag, as train's
    if isinstance(args, int):  # refused, or --help
        return args
    # Ctrl-C, SIGTERM, a full disk, a quota, a read-only file system: the chunks done are kept, to resume
    with cli.sigterm_as_ctrl_c():
        return cli.tool("nljax.prepare", lambda: _prepare(args.config, args.settings),
                        after_ctrl_c=": the same command resumes where it stopped")


def _prepare(config_file: list[str] | None, settings: list[str]) -> int:
    out, overwrite, overrides = parse(settings)
    cfg = config.load(config_file, ["data.source=files", *overrides])
    if not cfg.data.train and not cfg.data.eval:
        raise ConfigError("data.train is required: the paths or globs of the text to prepare (or data.eval alone: "
                          "held-out text only, a held-out set)")
    # one config file for both steps: its data.prepared is where the data go, unless out= says
    out = out or (Path(os.path.expanduser(cfg.data.prepared)) if cfg.data.prepared else None)
    if out is None:
        raise ConfigError("out=DIR is required (or data.prepared in the config): the directory to write to")
    workers = cfg.prepare.workers or chunks.default_workers()
    try:
        c = prepared.build(dataclasses.replace(cfg.data, prepared=""), out, overwrite, workers, cfg.prepare.chunk_bytes)
    except chunks.WorkerDied as e:  # the chunks done are kept
        print(f"nljax.prepare: error: {e}", file=sys.stderr)
        return 1
    print(f"nljax.prepare: wrote {out}: {describe(c)}")
    if not cfg.data.train:  # held-out text alone
        print(f"nljax.prepare: score it beside a run's held-out text with data.eval_sets=[NAME={out}], or alone with "
              f"python -m nljax.evaluate run.dir=RUN data.prepared={out}")
    else:
        print(f"nljax.prepare: train with data.source=files data.prepared={out}")
    return 0


if __name__ == "__main__":
    cli.leave(main())
