"""`auto` takes a fused form on a GPU only where it compiles (nljax/models/compiles.py).

This machine has no GPU, so the GPU's choice is reached by standing in for `select`'s backend
test or for the probe's answer; the probes that do run here compile for real (a Pallas kernel
outside interpret mode and cuDNN's attention do not compile on a CPU, the interpreted Pallas
attention does)."""

import jax
import jax.numpy as jnp
import pytest

from nljax import config
from nljax.models import attention, builtin, compiles, platform
from nljax.models import memory_forms as forms
from nljax.models import memory_kernel as mk


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(compiles, "_SEEN", {})


def test_refusal_is_none_when_it_compiles_and_the_first_line_when_not():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    assert compiles.refusal(("double",), lambda a: 2 * a, x) is None
    state = {p: {"W": jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.float32)} for p in "MS"}
    xs = [jax.ShapeDtypeStruct((1, 1, 32, 16), jnp.float32)] * 3 + [jax.ShapeDtypeStruct((1, 1, 32), jnp.float32)] * 3
    kernel = lambda s, *a: mk.memory_kernel(s, *a, kind="linear", chunk=16, interpret=False)
    why = compiles.refusal(("kernel",), compiles.grad_of_sum(kernel), (state, *xs))
    assert why == "ValueError: Only interpret mode is supported on CPU backend."
    # once per key: a second probe under the same key compiles nothing
    assert compiles.refusal(("kernel",), lambda a: 1 / 0, x) == why


def probe_answers(monkeypatch, refused: dict):
    """The probe answers from `refused` (a key's last entry -> the error), compiling nothing."""
    asked = []
    monkeypatch.setattr(compiles, "refusal", lambda key, fn, *args: asked.append(key) or refused.get(key[-1]))
    return asked


def probe_for_real_except(monkeypatch, refused: dict):
    """The probes compile for real, except those of the forms in `refused` (form -> the error)."""
    real = compiles.refusal
    monkeypatch.setattr(compiles, "refusal", lambda key, fn, *args: refused.get(key[-1]) or real(key, fn, *args))


def test_memory_auto_is_the_parallel_form_on_a_gpu(monkeypatch):
    """Built for a GPU, auto takes the parallel form (plain XLA: nothing to probe), never a kernel
    (both slower than the scan on an H200); on a CPU the scan."""
    monkeypatch.setattr(compiles, "refusal", lambda *a: pytest.fail("probed"))
    assert forms.select("auto", "mlp", 32, 64, 128) == "scan"
    with platform.compiling_for("gpu"):
        assert forms.select("auto", "mlp", 32, 64, 128) == "parallel"
        assert forms.select("pallas", "mlp", 32, 64, 128) == "pallas"


def test_attention_auto_takes_the_first_form_that_compiles(monkeypatch, capsys):
    # for real: the Pallas kernel (interpreted here) compiles, no warning
    assert attention.resolve("auto", jnp.bfloat16, 64, True, 64) == "pallas"
    assert capsys.readouterr().err == ""
    # for real: cuDNN does not compile on a CPU
    probe_for_real_except(monkeypatch, {"pallas": "E0"})
    assert attention.resolve("auto", jnp.bfloat16, 64, True, 128) == "blocked"
    assert capsys.readouterr().err.splitlines() == [
        "nljax: warning: model.nl_lm.attention=auto: the Pallas attention kernel does not compile on this device "
        "(E0); using cudnn",
        "nljax: warning: model.nl_lm.attention=auto: cuDNN's flash attention does not compile on this device "
        "(RuntimeError: cuDNN is not detected.); using blocked"]
    asked = probe_answers(monkeypatch, {})
    assert attention.resolve("auto", jnp.bfloat16, 64, True, 512) == "pallas" and len(asked) == 1
    probe_answers(monkeypatch, {"pallas": "E1"})
    assert attention.resolve("auto", jnp.bfloat16, 64, True, 512) == "cudnn"
    probe_answers(monkeypatch, {"cudnn": "E1", "pallas": "E2"})
    assert attention.resolve("auto", jnp.bfloat16, 64, True, 512) == "blocked"
    err = capsys.readouterr().err.splitlines()
    assert [line.split("(")[-1] for line in err] == ["E1); using cudnn", "E2); using cudnn", "E1); using blocked"]
    asked = probe_answers(monkeypatch, {})
    assert attention.resolve("auto", jnp.bfloat16, 48, True, 512) == "cudnn"  # the kernel refuses 48 by shape
    assert [k[-1] for k in asked] == ["cudnn"]
    assert attention.resolve("pallas", jnp.bfloat16, 64, True, 512) == "pallas" and len(asked) == 1  # not probed


def test_a_cpu_build_probes_nothing(monkeypatch):
    """On a CPU `auto` is the scan and the blocked form by rule, without a compilation."""
    monkeypatch.setattr(compiles, "refusal", lambda *a: pytest.fail("probed on a CPU"))
    cfg = config.load(None, ["model.nl_lm.memory_layers=[0]", "model.depth=1", "model.dim=32", "model.heads=2"])
    net = builtin.nl_lm(cfg).net
    assert net.attention == "blocked" and net.memory["impl"] == "scan"
