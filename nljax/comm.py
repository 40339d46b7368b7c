"""Communication accounting: what each compiled step variant sends, read from its HLO.

    python -m nljax.comm [--config FILE] [--cpu-devices N] [--json] [key=value ...]

compiles every Pulse variant of the configured train step and prints each collective and the
mean bytes per step next to a DDP-style all-reduce of every parameter (nljax/measure/comm.py says
how the bytes and projected times are counted).
"""

from __future__ import annotations

import json
import sys

import jax

from nljax import cli
from nljax.config import Config
from nljax.measure.comm import comm_per_step, format_report
from nljax.run.core import Run


def _run(args, cfg: Config) -> int:
    run = Run.create(cfg)
    report = comm_per_step(run.cache, run.init_state(), run.batch(0))
    if jax.process_index() == 0:  # only process 0 prints
        print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def main(argv=None) -> int:
    p = cli.parser("nljax.comm", "Bytes moved by every compiled step variant, read from the HLO.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return cli.main(_run, p, argv)


if __name__ == "__main__":
    sys.exit(main())
