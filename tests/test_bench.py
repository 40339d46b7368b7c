"""`python -m nljax.bench` as a user runs it: a smoke test of its JSON, not a benchmark."""

import json
import math

from helpers import TINY_NL, cli

# TINY_NL with the defaults elsewhere (the optimizer, the MLP width, 4 memory heads)
NL = [*TINY_NL, "model.dim=16", "model.depth=1", "model.nl_lm.memory_heads=4", "train.batch_size=4", "train.seq_len=16"]


def test_bench_json_fields_are_sane(tmp_path):
    """Two emulated devices, a tiny nl_lm with a memory layer, two patterns, 2 timed rounds."""
    out = tmp_path / "bench.json"
    p = cli("nljax.bench", "--cpu-devices", "2", "--steps", "2", "--warmup", "1", "--out", str(out), *NL)
    assert "tokens/s per device" in p.stdout and not list(tmp_path.glob("runs"))
    r = json.loads(out.read_text())
    assert r["devices"] == 2 and r["unit"] == "tokens" and r["units_per_device_step"] == 2 * 16
    assert set(r["per_pattern"]) == {"L0", "L0+1"}
    for p in r["per_pattern"].values():
        assert p["compile_s"] > 0 and p["step_time"]["samples"] == 2
        assert 0 < p["step_time"]["min_ms"] <= p["step_time"]["median_ms"] <= p["step_time"]["max_ms"]
        assert p["units_per_s_per_device"] > 0 and p["xla_flops_per_unit"] > 0
        assert 0 < p["mfu"] < 1 and 0 < p["mfu_analytic"] < 1
    fl = r["flops"]
    assert fl["params"] > fl["matmul_params"] > 0 and fl["inner_memory_per_token"] > 0
    assert fl["total_per_unit"] == fl["outer_per_token"] + fl["attention_per_token"] + fl["inner_memory_per_token"]
    assert r["units_per_s_per_device_mean"] > 0 and r["units_per_s_per_device_worst"] > 0
    assert r["units_per_s_per_device_worst"] <= r["units_per_s_per_device_mean"] * (1 + 1e-9)
    assert r["peak_flops_per_device"] > 1e8 and "measured" in r["peak_source"]
    assert r["memory"]["peak_bytes"] > 0 and math.isfinite(r["memory"]["peak_bytes"])
    assert r["environment"]["jax"] and r["environment"]["device_kind"]
