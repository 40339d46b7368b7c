"""A config's compiled all-levels train step as HLO text, source metadata removed: to check that a
change leaves a config's program as it was.

    python benchmarks/step_hlo.py [--checkout DIR] CONFIG|default OUT.txt [key=value ...]

`--checkout DIR` imports nljax from another checkout (default: this one), so that

    python benchmarks/step_hlo.py default new.txt
    python benchmarks/step_hlo.py --checkout ../main default old.txt && diff old.txt new.txt

compares the program before and after a change. XLA's text carries each op's source file and line
(`metadata={...}`, the file, function and frame tables, stack frame ids); they differ between
checkouts whatever the program, so they are removed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def step_hlo(name: str | None, overrides: list[str]) -> str:
    from nljax import config
    from nljax.bench import unevaluated
    from nljax.run.core import Run

    run = Run.create(unevaluated(config.load(name, overrides)))
    batch, state = run.batch(0), run.init_state()
    every = tuple(True for _ in run.cfg.cms.periods)
    return without_sources(run.cache.train_fn(every, state, batch).as_text())


def without_sources(text: str) -> str:
    """Compiled HLO text without what names source files and lines (the same program in two
    checkouts prints the same)."""
    if "StackFrames" in text:  # the tables between the module's first line and its body
        text = text.split("\n", 1)[0] + text[text.index("\n\n", text.index("StackFrames")):]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r", stack_frame_id=\d+", "", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent), help="nljax from here")
    p.add_argument("config", help="a packaged config, a YAML file, or 'default'")
    p.add_argument("out", help="the HLO text goes here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.checkout).resolve()))
    text = step_hlo(None if args.config == "default" else args.config, args.overrides)
    Path(args.out).write_text(text)
    import nljax

    print(f"{args.out}: {text.count(chr(10)):,} lines, nljax from {Path(nljax.__file__).parent.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
