"""The command lines of the README's quickstart and tour are valid as written, and each command
they use is run by the test suite.

Running every line as written would train for minutes each; instead each line goes through the
command's own argument parser (the one its `main` builds, nljax/refdoc.py) and its config
overrides through the config loader, so a renamed flag, key or packaged config fails here; and
the suite's test files are read (with `ast`) for a run of each command: `python -m nljax.X` in a
subprocess, or its `main` called. The quickstart's test command itself is what `.ci/run` runs.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from nljax import config, refdoc
from nljax.run import sampling

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
# what runs a command line in the tests: tests/helpers.py's cli and run_python, subprocess's functions
RUNNERS = {"cli", "run_python", "run", "Popen", "check_output", "check_call", "call"}
CONFIG_COMMANDS = {"train", "comm", "bench"}  # --config FILE and key=value config overrides


def readme_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, argv) of every `python -m nljax.<command> ...` in the ```bash blocks of `text`,
    each `&&`-joined part apart, comments dropped, quotes read as the shell reads them."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            parts, part = [], []
            for w in words + ["&&"]:
                if w == "&&":
                    parts.append(part)
                    part = []
                else:
                    part.append(w)
            out += [(p[2].removeprefix("nljax."), p[3:]) for p in parts
                    if len(p) >= 3 and p[:2] == ["python", "-m"] and p[2].startswith("nljax.")]
    return out


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_shows_every_command_and_the_ci_marker():
    assert {name for name, _ in COMMANDS} == set(refdoc.COMMANDS)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- test-command -->\n```bash\n" in text and len(text.splitlines()) <= 250
    assert readme_commands("```bash\npip install x && python -m nljax.train a=1  # c\n```\n") == [("train", ["a=1"])]


@pytest.mark.parametrize("name,argv", COMMANDS, ids=[" ".join([n, *a])[:60] for n, a in COMMANDS])
def test_a_readme_command_line_is_valid(name, argv):
    parser = refdoc.parser_of(name)
    if name == "lm_eval":  # its own flags; the rest is lm-eval's command line, with nljax's model
        assert argv[argv.index("--model") + 1] == "nljax" and parser.parse_known_args(argv)[1]
        return
    args = parser.parse_args(argv) if name == "launch" else parser.parse_intermixed_args(argv)
    if name in CONFIG_COMMANDS:
        config.load(args.config, args.overrides)  # the flags' config and keys exist, values have their types
    elif name == "generate":
        sampling.parse(args.settings)
    elif name == "launch":
        assert args.command[1:4] == ["python", "-m", "nljax.train"]


def runs_in(path: Path) -> set[str]:
    """The nljax commands the test file `path` runs: "nljax.X" among the words of a command line
    (a call of one of `RUNNERS`), or `X.main(...)` / `main(...)` of a command imported from nljax."""
    tree, out = ast.parse(path.read_text(encoding="utf-8")), set()
    modules, mains = {}, {}  # local name -> command: `from nljax import export`; `from nljax.prepare import main`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nljax":
            modules.update({(a.asname or a.name): a.name for a in node.names if a.name in refdoc.COMMANDS})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").removeprefix("nljax.") in refdoc.COMMANDS:
            mains.update({(a.asname or a.name): node.module.removeprefix("nljax.") for a in node.names
                          if a.name == "main"})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if called in RUNNERS:  # a command line: its words anywhere in the call's arguments
            for c in ast.walk(node):
                m = re.fullmatch(r"nljax\.(\w+)", c.value) if isinstance(c, ast.Constant) and \
                    isinstance(c.value, str) else None
                out.update({m.group(1)} & set(refdoc.COMMANDS) if m else set())
        elif isinstance(f, ast.Attribute) and f.attr == "main" and getattr(f.value, "id", None) in modules:
            out.add(modules[f.value.id])
        elif isinstance(f, ast.Name) and f.id in mains:
            out.add(mains[f.id])
    return out


def test_every_readme_command_is_run_by_the_suite():
    run = set().union(*(runs_in(p) for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name))
    missing = sorted({name for name, _ in COMMANDS} - run)
    assert not missing, f"README commands no test runs: {missing}"


def test_runs_in_sees_subprocesses_and_mains(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text('from nljax import export\nfrom nljax.prepare import main as prep\n'
                 'cli("nljax.bench", "--steps", "1")\nexport.main([])\nprep([])\nprint("nljax.comm")\n')
    assert runs_in(f) == {"bench", "export", "prepare"}  # printing "nljax.comm" runs nothing


@pytest.mark.parametrize("name,argv", [
    ("generate", ["run.dir={d}", "--cpu-devices", "2", "max_new_tokens=5"]),
    ("export", ["run.dir={d}", "--format", "safetensors", "out={d}/x"]),
    ("prepare", ["data.train={d}/*.txt", "--config", "{d}/c.yaml", "out={d}/p"]),
])
def test_key_value_settings_may_follow_a_flag(name, argv, tmp_path):
    """As train's: `generate run.dir=D --cpu-devices 2 max_new_tokens=5` reads both settings
    (argparse's plain parse stopped at the flag: 'unrecognized arguments: max_new_tokens=5'); the
    run directory here is empty, so the command goes on to refuse it, in one line."""
    from helpers import cli

    (tmp_path / "c.yaml").write_text("data:\n  eval_fraction: 0.5\n")
    p = cli(f"nljax.{name}", *[a.format(d=tmp_path) for a in argv], check=False)
    assert p.returncode == 2 and "unrecognized arguments" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
