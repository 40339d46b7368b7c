"""Communication accounting: what each compiled step variant sends, read from its HLO.

    python -m nljax.comm [--config FILE] [--cpu-devices N] [--json] [key=value ...]

compiles every Pulse variant of the configured train step and prints each collective and the
mean bytes per step next to a DDP-style all-reduce of every parameter (nljax/measure/comm.py says
how the bytes and projected times are counted). On one device no step communicates: nothing is
compiled and every variant's bytes are zero.
"""

from __future__ import annotations

import json
import sys

# nljax.cli imports JAX first, turning an environment variable JAX cannot read into one line
from nljax import cli  # noqa: I001

import jax

from nljax.config import Config
from nljax.measure.comm import comm_per_step, format_report
from nljax.run.core import Run
from nljax.run.phases import compile_announcer


def _run(args, cfg: Config) -> int:
    # what it is doing, on stderr (--json stays JSON): building the run, then each variant's compilation
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if jax.process_index() == 0 else (lambda text: None)
    say(f"nljax.comm: building the run (model {cfg.model.name}) ...")
    run = Run.create(cfg)
    run.cache.announce = compile_announcer(cfg.cms.periods, say)
    report = comm_per_step(run.cache, run.init_state(), run.batch(0))
    if jax.process_index() == 0:  # only process 0 prints
        print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def main(argv=None) -> int:
    p = cli.parser("nljax.comm", "Bytes moved by every compiled step variant, read from the HLO.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return cli.main(_run, p, argv)


if __name__ == "__main__":
    cli.leave(main())
