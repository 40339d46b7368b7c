"""The documented examples run as a user runs them, and print what their header comments promise:
examples/library_usage.py (a Run stepped by the Conductor: losses, an evaluation, the
communication report) and the docs' hand-written copy of its loop (docs/concepts/how-a-step-works.md,
extracted from the page at test time), and examples/python_api.py (`nljax.load` of a run and of
its export). Each in a subprocess, in its own temporary directory: about a minute each on a
2-core CPU, so in the slow tier."""

from __future__ import annotations

import ast
import re

import pytest
from helpers import ROOT, python_block, run_python

LIBRARY_USAGE = ROOT / "examples" / "library_usage.py"
PYTHON_API = ROOT / "examples" / "python_api.py"
STEP_PAGE = ROOT / "docs" / "concepts" / "how-a-step-works.md"
# the page that quotes the communication report of library_usage.py's setting, bytes exact
COMM_PAGE = ROOT / "docs" / "concepts" / "hierarchical-reduction.md"
STEP_LINE = re.compile(r"^step +(\d+) (\S+) +loss (\d+\.\d+)$", re.M)


def quoted_report() -> list[str]:
    """The lines of the communication report COMM_PAGE quotes for library_usage.py's setting,
    less its elision ("..."), which the run's full report does not have."""
    text = COMM_PAGE.read_text().split("(the setting of `examples/library_usage.py`", 1)[1]
    block = re.search(r"```text\n(.*?)```", text, re.S)
    assert block, f"{COMM_PAGE} quotes no report after naming examples/library_usage.py"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.endswith("...")]


def check_library_run(out: str) -> None:
    """What library_usage.py (and the docs' copy of its loop) print: 20 steps whose patterns
    follow periods [1, 4, 16] and whose loss falls, an evaluation, and the communication report
    that hierarchical-reduction.md quotes (exact bytes, so exact text), with its ratio to DDP."""
    steps = STEP_LINE.findall(out)
    assert [int(s) for s, _, _ in steps] == list(range(20)), out
    names = {int(s): name for s, name, _ in steps}
    assert (names[0], names[1], names[4], names[16]) == ("L0+1+2", "L0", "L0+1", "L0+1+2"), names
    losses = [float(loss) for _, _, loss in steps]
    assert losses[0] > 5 and losses[-1] < losses[0] - 1, losses  # ln 256 = 5.5 at the start, then learning
    evaluation = ast.literal_eval(next(line for line in out.splitlines() if line.startswith("{'eval_loss'")))
    assert 0 < evaluation["eval_loss"] < losses[0] and evaluation["eval_tokens"] > 0, evaluation
    lines = out.splitlines()
    missing = [line for line in quoted_report() if line not in lines]
    assert not missing, f"the report differs from {COMM_PAGE.name}'s; not printed: {missing}\n{out}"
    ratio = float(re.search(r"^ratio nljax / DDP: (\d+\.\d+)$", out, re.M).group(1))
    assert 0 < ratio < 1, ratio  # the slow levels' bytes move only when they fire


@pytest.mark.slow
def test_library_usage_steps_a_run_and_reports_its_communication(tmp_path):
    p = run_python(str(LIBRARY_USAGE), cwd=tmp_path)
    check_library_run(p.stdout)
    assert not list(tmp_path.iterdir()), "the example writes nothing"


@pytest.mark.slow
def test_the_docs_hand_written_loop_runs_as_written(tmp_path):
    """The page's ```python block, run as the page says the script runs it: after setting 8
    emulated CPU devices (the block itself starts at the imports)."""
    code = python_block(STEP_PAGE, "## Driving the steps yourself")
    assert "mean_loss(metrics)" in code  # the page shows the library's helper, not the sum by hand
    script = tmp_path / "loop.py"
    script.write_text('import jax\njax.config.update("jax_num_cpu_devices", 8)\n'
                      'jax.config.update("jax_platforms", "cpu")\n' + code)
    check_library_run(run_python(str(script), cwd=tmp_path).stdout)


@pytest.mark.slow
def test_python_api_loads_a_run_and_its_export(tmp_path):
    """python_api.py trains 20 steps, exports, and prints the loaded model, a round trip of its
    tokenizer, a sample, the logits with the memory carried, and that the export samples alike;
    its temporary directory (here under tmp_path) is gone afterwards."""
    work = tmp_path / "tmp"
    work.mkdir()
    p = run_python(str(PYTHON_API), cwd=tmp_path, env={"TMPDIR": str(work)})
    # the export command's line comes first, on stdout; the example's own lines follow
    exported = [line for line in p.stdout.splitlines() if line.startswith("nljax.export: ")]
    run = rf"{re.escape(str(work))}/\w+/run"  # its run directory, in the temporary directory
    assert len(exported) == 1 and re.fullmatch(rf"nljax\.export: {run}/checkpoints/20 \(step 20\) -> "
                                               rf"{run}/export/model\.safetensors, {run}/export/config\.json",
                                               exported[0]), p.stdout
    out = [line for line in p.stdout.splitlines() if not line.startswith("nljax.export: ")]
    assert out[0] == "nl_lm after 20 steps, windows of 32 tokens", p.stdout
    text = "def f(x):\n    return x"
    assert out[1] == f"tokens: {list(text.encode())[:12]} ... -> {text!r}", out[1]
    sampled = ast.literal_eval(out[2].removeprefix("sampled: "))
    assert out[2].startswith("sampled: ") and isinstance(sampled, str) and sampled, out[2]
    # the text 3 times over, read as windows of 32 tokens: one row of 66 positions over 256 bytes
    assert out[3].startswith(f"logits (1, {3 * len(text.encode())}, 256) memory leaves [("), out[3]
    memory = float(out[4].rpartition(": ")[2])
    assert out[4].startswith("what the memory adds") and memory > 0, out[4]
    assert out[5] == "the export samples the same text: True", p.stdout
    assert len(out) == 6, p.stdout
    assert not list(work.iterdir()) and not [f for f in tmp_path.iterdir() if f != work], "left files behind"
