"""`python -m nljax`: the commands, one line each, and the version; `python -m nljax COMMAND ...`
runs `python -m nljax.COMMAND ...` (each command's `--help` gives its options; every option of
every command is in docs/reference/commands.md). Imports nothing heavy: no JAX before a command."""

from __future__ import annotations

import difflib
import runpy
import sys

from nljax.version import __version__

# each command of nljax (`nljax.<name>`, with a `main`), in the order a user meets them, and what
# it does in one line (nljax.refdoc documents the same commands)
COMMANDS = {
    "train": "train a model: a packaged config or a YAML file, key=value overrides, --resume",
    "evaluate": "a trained run's held-out loss and bits per byte, on its held-out text or any other",
    "generate": "sample text (or a MeanFlow model's images) from a trained run or an export",
    "export": "a trained run's parameters as safetensors, with its config and tokenizer",
    "prepare": "tokenize a corpus once, with every core, into a memory-mapped directory",
    "lm_eval": "score a trained run with EleutherAI's lm-evaluation-harness",
    "comm": "the bytes each compiled step variant moves, read from its HLO",
    "bench": "compile and step time, tokens/s, MFU and memory of a config",
    "launch": "start the processes of one multi-process run on this machine",
}

USAGE = "usage: python -m nljax COMMAND [ARGS ...]   (the same as python -m nljax.COMMAND [ARGS ...])"


def listing() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"nljax {__version__}: nested-learning models and MeanFlow on one SPMD program", "", USAGE, "",
             "commands:", *(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()), "",
             "python -m nljax.COMMAND --help lists a command's options; docs/reference/commands.md has them all."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(listing())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"nljax {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name.replace("-", "_"), COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"nljax: error: unknown command {name!r}{hint}; the commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # as `python -m nljax.NAME` runs it: its `if __name__ == "__main__"`, argv[0] its file (alter_sys)
    sys.argv = [name, *argv[1:]]
    runpy.run_module(f"nljax.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
