"""benchmarks/gpu_compile.py and what it builds on: a training step compiled for a platform
other than the one this process runs on (`nljax.models.platform.compiling_for`), from shapes
alone. Compiling for a GPU needs XLA:GPU's compiler (jax's CUDA plugin, about 4 GB), not a test
dependency: here the same path compiles for a CPU device, and its program is checked against
the one a run trains with. The GPU figures are in docs/guides/gpu.md."""

import re
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, TINY

from nljax import config
from nljax.errors import ConfigError
from nljax.models import attention_kernel, compiles, memory_forms, platform
from nljax.run.core import Run

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gpu_compile
    import step_hlo
finally:
    sys.path.pop(0)


@pytest.mark.slow  # two compilations of a step: 17 s
def test_a_step_from_shapes_alone_is_the_program_a_run_trains_with():
    """The state from jax.eval_shape and the batch's shapes (nothing placed on the target device)
    compile the same program as the run's own arrays."""
    cfg = config.load(None, ["cms.periods=[1,4]", "train.batch_size=2"])  # a memory, attention, two levels
    device = jax.devices()[1]  # not the default device: nothing may assume it
    run, fn = gpu_compile.compiled_step(cfg, device, jax.devices()[0])
    assert list(run.mesh.devices.flat) == [device]
    real = Run.create(cfg, [device])
    concrete = real.cache.train_fn(tuple(True for _ in cfg.cms.periods), real.init_state(), real.batch(0))
    # the module's first line names the module and its fingerprint, which may differ
    strip = lambda text: step_hlo.without_sources(text).split("\n", 1)[1]
    assert strip(fn.as_text()) == strip(concrete.as_text())

    report = gpu_compile.report(run, fn)
    assert report["compiled"] is True and report["forms"]["attention"] == "blocked"
    k, m = report["launches"], report["memory"]
    assert k["total"] == sum(v for n, v in k.items() if n != "total") == sum(report["launches_by_scope"].values()) > 0
    assert {"forward mem", "backward mem", "step"} <= set(report["launches_by_scope"])
    assert m["peak"] == m["arguments"] + m["outputs"] + m["temporaries"] and m["arguments"] > 0


def test_a_variant_that_does_not_compile_is_one_line(monkeypatch, capsys):
    def fails(*_):
        raise RuntimeError("INTERNAL: ptxas exited with non-zero error code 255\nthe compiler's traceback")

    monkeypatch.setattr(gpu_compile, "compiled_step", fails)
    monkeypatch.setattr(gpu_compile, "gpu_device", lambda gpu: jax.devices()[0])
    assert gpu_compile.main(["--config", "titans_demo", "--variant", "small:train.batch_size=2"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [f"{name}: DOES NOT COMPILE: RuntimeError: INTERNAL: ptxas exited with non-zero error code 255"
                       for name in ("config", "small")]


def test_a_variant_the_card_cannot_hold_fails_the_command(monkeypatch, capsys):
    """The card's memory is checked here: nljax's start-up check cannot read a compile-only device."""
    asked = []

    def compiles(cfg, device, host, memory_bytes, save=None):
        asked.append(memory_bytes)
        peak = 2 * memory_bytes if cfg.train.batch_size == 128 else memory_bytes // 2
        return dict(compiled=True, compile_s=1.0, forms=None, launches={"fusion": 10, "total": 10},
                    launches_by_scope={"step": 10}, memory=dict(arguments=1, outputs=0, temporaries=peak - 1,
                                                                peak=peak, fits=peak <= memory_bytes))

    monkeypatch.setattr(gpu_compile, "compile_step", compiles)
    monkeypatch.setattr(gpu_compile, "gpu_device", lambda gpu: jax.devices()[0])
    assert gpu_compile.main(["--gpu", "h100", "--config", "titans_demo"]) == 0
    assert gpu_compile.main(["--gpu", "h100", "--config", "titans_demo", "--variant", "b128:train.batch_size=128"]) == 1
    assert asked == [gpu_compile.GPUS["h100"][1]["device_memory_size"]] * 3
    lines = capsys.readouterr().out.splitlines()
    assert "MORE THAN THE CARD HAS" in lines[-2] and lines[-2].startswith("b128: 10 kernels per step")
    assert "MORE THAN" not in "".join(lines[:-2])


def test_without_xla_gpu_the_tool_says_what_to_install(monkeypatch):
    from jax.experimental import topologies

    def missing(**_):
        raise RuntimeError("Unknown backend: 'cuda' requested")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    with pytest.raises(SystemExit, match=r'XLA:GPU.s compiler is not installed here \(RuntimeError\); '
                                         rf'pip install "jax\[cuda13\]=={re.escape(jax.__version__)}"'):
        gpu_compile.gpu_device("h200")


def test_a_probe_is_answered_per_platform_and_device_built_for():
    """`auto`'s probes (compiles.refusal) compile for the device `compiling_for` names, and a
    probe's answer for one platform or device is not taken for another's."""
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    key = ("probe-test", id(x))
    assert compiles.refusal(key, lambda x: x * 2, x) is None
    with platform.compiling_for("cpu", device=jax.devices()[3]):
        assert compiles.refusal(key, lambda x: x * 2, x) is None
    with platform.compiling_for("gpu"):  # no device: JAX's default one, here a CPU
        assert compiles.refusal(key, lambda x: x * 2, x) is None
    assert {k[:2] for k in compiles._SEEN if k[2:] == key} == {("cpu", None), ("cpu", "cpu"), ("gpu", None)}


def test_a_program_built_for_a_device_is_lowered_with_it_as_the_default():
    """Pallas's GPU lowering asks JAX's default device which card it compiles for (jax 0.11
    refuses a CPU): inside compiling_for, `lowering()` makes the target that device, and a probe
    compiles under it; outside, JAX's default device stays."""
    target, seen = jax.devices()[5], []
    with platform.compiling_for("cpu", device=target), platform.lowering():
        assert jnp.zeros(2).devices() == {target}
    with platform.lowering():
        assert jnp.zeros(2).devices() == {jax.devices()[0]}
    with platform.compiling_for("cpu", device=target):
        assert compiles.refusal(("lowering-test",), lambda x: seen.append(jax.config.jax_default_device) or x,
                                jnp.ones(2)) is None
    assert seen == [target]


def test_target_config_names_the_card():
    text = gpu_compile.target_config("h100")
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text and "core_count: 132" in text
    assert "device_memory_size: 150754820096" in gpu_compile.target_config("h200")
    # the host's CUDA driver and toolkit: XLA's command buffers take cuDNN, loops and dynamic
    # slices only above a version (the thunks of titans_demo's step differ without them)
    assert 'driver_version: "13.0.0"' in text and 'compile_time_toolkit_version: "13.0.0"' in text


def test_compiling_for_a_gpu_decides_as_on_the_gpu():
    """Inside compiling_for("gpu") the forms and kernels are chosen as on a GPU (compiled
    kernels, the GPU's shape rules), whatever JAX's default backend; outside, as before."""
    q = jnp.zeros((1, 128, 1, 64))
    assert platform.backend() == jax.default_backend() == "cpu" and not platform.on_cuda()
    assert attention_kernel.prepare(q, 64, attention_kernel.Tuning(), None)[2] is True  # interpreted here
    assert memory_forms.select("pallas", "mlp", 6, 64, 128) == "pallas"  # interpreted: any shape
    with platform.compiling_for("gpu", device=jax.devices()[2]):
        assert platform.backend() == "gpu" and platform.on_cuda() and platform.device() == jax.devices()[2]
        assert attention_kernel.prepare(q, 64, attention_kernel.Tuning(), None)[2] is False  # compiled
        with pytest.raises(ConfigError, match="memory_impl=pallas"):
            memory_forms.select("pallas", "mlp", 6, 64, 128)
        with platform.compiling_for("cpu"):
            assert platform.backend() == "cpu" and not platform.on_cuda()
        assert platform.backend() == "gpu"
    assert platform.backend() == "cpu" and platform.device() is None
    with pytest.raises(ValueError, match="'gpu', 'cpu' or 'tpu'"):
        with platform.compiling_for("cuda"):
            pass


def test_a_saved_executable_is_the_one_a_run_loads(tmp_path, monkeypatch):
    """--save-executables writes the step under the key a run of the same config computes: the
    run loads it instead of compiling (here for a CPU device; a GPU's is docs/guides/gpu.md's)."""
    from pathlib import Path

    from nljax.engine import executables

    cfg = config.load(None, [*TINY, "cms.periods=[1,2]"])
    device = jax.devices()[1]
    r = gpu_compile.compile_step(cfg, device, jax.devices()[0], save=tmp_path)
    saved = Path(r["executable"]["file"])
    assert r["compiled"] is True and saved.parent == tmp_path and r["executable"]["bytes"] == saved.stat().st_size > 0
    monkeypatch.setenv(executables.ENV, str(tmp_path))
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self: pytest.fail("compiled, not loaded"))
    run = Run.create(cfg, [device])
    every = tuple(True for _ in cfg.cms.periods)
    run.cache.train_fn(every, run.init_state(), run.batch(0))
    assert list(run.cache.loaded.values()) == [saved]
