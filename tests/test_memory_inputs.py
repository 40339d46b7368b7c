"""benchmarks/memory_inputs.py, which docs/experiments/2026-11-27-where-the-memory-goes.md reads: its
statistics on inputs whose answer is known, and its report on a fresh model."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, TINY_NL

from nljax import config
from nljax.errors import ConfigError
from nljax.models import build

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import memory_inputs
finally:
    sys.path.pop(0)


def test_shared_fraction_and_key_stats_on_known_inputs():
    x = jax.random.normal(jax.random.key(0), (2, 1, 8))
    assert memory_inputs.shared_fraction(jnp.tile(x, (1, 32, 1))) == pytest.approx(1.0)  # every position alike
    alternating = jnp.stack([x[:, 0], -x[:, 0]] * 16, axis=1)  # mean over positions zero
    assert memory_inputs.shared_fraction(alternating) == pytest.approx(0.0, abs=1e-6)
    # keys are silu(conv output) normalised: the same vector at every position gives identical
    # keys, cosine 1 and lambda = chunk; one-hot keys of distinct positive channels, orthogonal
    same = jnp.broadcast_to(jnp.abs(x[:, :, None, None, :]) + 0.5, (2, 16, 3, 2, 8))
    assert memory_inputs.key_stats(same, 8) == pytest.approx((1.0, 1.0, 8.0), rel=1e-4)
    onehot = jnp.broadcast_to((10.0 * jnp.eye(8))[None, :, None, None, :], (2, 8, 3, 2, 8))
    _, cos, lam = memory_inputs.key_stats(onehot, 8)
    assert cos == pytest.approx(0.0, abs=1e-4) and lam == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow
def test_report_on_a_fresh_model(capsys):
    """Both memories of a fresh model read the same input (every block starts as the identity),
    and every sub-block but the embedding outputs zero."""
    cfg = config.load(None, [*TINY_NL, "model.depth=2", "model.nl_lm.memory_layers=[0,1]", "train.seq_len=16"])
    model = build(cfg)
    memory_inputs.report(cfg, model, model.init(jax.random.key(0)), rows=2)
    out = capsys.readouterr().out.splitlines()
    stats = {line.split(":")[0]: line.split("input shared ")[1].split()[0] for line in out if line.startswith("mem")}
    assert set(stats) == {"mem0", "mem1"} and stats["mem0"] == stats["mem1"]
    rms = {line.split()[0]: float(line.split()[3]) for line in out if "output rms" in line}
    assert rms["embed"] > 0 and all(v == 0 for k, v in rms.items() if k != "embed")
    with pytest.raises(ConfigError, match="fewer than --rows"):
        memory_inputs.report(cfg, model, model.init(jax.random.key(0)), rows=10**6)
    np.testing.assert_equal(len(rms), 1 + 2 * (1 + 1 + len(cfg.cms.periods)))  # embed; attn, mem, cms per block


def test_bad_rows_is_one_line(capsys):
    assert memory_inputs.main(["--init", "--rows", "0"]) == 2
    assert capsys.readouterr().err.strip() == "memory_inputs.py: error: --rows must be >= 1, got 0"
