"""benchmarks/continual.py, which docs/experiments/2026-11-27-continual-learning.md reads: its two corpora
and the chain of its three runs (the runs themselves are the benchmark, not a test)."""

import sys

from helpers import ROOT

from nljax import config

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import continual
finally:
    sys.path.pop(0)


def test_corpora_and_the_three_phases_chain(tmp_path):
    dirs = continual.write_corpora(tmp_path / "data")
    a, b = sorted(dirs["A"].glob("*.txt")), sorted(dirs["B"].glob("*.txt"))
    assert len(a) > 100 and len(b) > 50  # every stdlib module, every pydoc topic
    assert "def " in (dirs["A"] / "os.txt").read_text() and "statement" in (dirs["B"] / "assert.txt").read_text()
    runs = tmp_path / "runs"
    cmds = continual.commands(dirs, runs, 7, 3, ["cms.periods=[1]"])
    cfg = {phase: config.load(None, [c for c in cmd if not c.startswith("run.")]) for phase, cmd in cmds.items()}
    assert [cfg[p].train.steps for p in continual.PHASES] == [7, 14, 14]  # AA trains no step: it evaluates A
    assert cfg["B"].checkpoint.resume == str(runs / "A" / "checkpoints" / "7")
    assert cfg["AA"].checkpoint.resume == str(runs / "B" / "checkpoints" / "14")
    assert cfg["A"].data.train == cfg["AA"].data.train != cfg["B"].data.train
    assert all(c.seed == 3 and tuple(c.cms.periods) == (1,) and c.optim.schedule == "constant" for c in cfg.values())
    assert [c for c in cmds["A"] if c.startswith("run.dir=")] == [f"run.dir={runs / 'A'}"]
    assert continual.main(["--steps", "0", ""]) == 2
