"""Command-line plumbing shared by `nljax.train`, `nljax.comm` and friends.

`--cpu-devices N` must take effect before JAX creates its backends, so it is applied here,
before any module touches `jax.devices()`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

import jax

from nljax import config


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="YAML config file (defaults apply to keys it leaves out)")
    p.add_argument("--cpu-devices", type=int, metavar="N", help="emulate N devices on the CPU")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. train.steps=50")
    return p


def setup_devices(cpu_devices: int | None) -> None:
    if cpu_devices is not None:
        if cpu_devices < 1:
            raise config.ConfigError(f"--cpu-devices must be >= 1, got {cpu_devices}")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def main(run: Callable[[argparse.Namespace, config.Config], int | None], p: argparse.ArgumentParser,
         argv: Sequence[str] | None = None) -> int:
    """Parse, configure devices, load the config and call `run`; user errors become one line."""
    args = p.parse_args(argv)
    try:
        setup_devices(args.cpu_devices)
        cfg = config.load(args.config, args.overrides)
        return run(args, cfg) or 0
    except config.ConfigError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
