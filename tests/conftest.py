"""Eight emulated CPU devices, configured before JAX creates its backends."""

import os
import tempfile

# The LLVM flags halve XLA:CPU compile time, which dominates this suite; they change code
# generation effort, not the arithmetic, and the single-device references use them too.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# run.compile_cache=auto writes under $XDG_CACHE_HOME: a directory of this session's own, so the
# suite never reads or fills the user's cache (subprocesses inherit it)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="nljax_test_cache_")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    assert jax.device_count() == 8, f"tests need 8 emulated CPU devices, got {jax.device_count()}"


# Tests that take over a minute on the 2-core CI machine. pytest-xdist hands tests to workers
# in collection order, so these go first: started last, one of them would leave a worker running
# alone at the end (longest first keeps the workers' finishing times close).
LONGEST_FIRST = ("test_configs.py::test_first_steps_at_real_shapes",)


# Cases moved to the `slow` tier (.ci/run runs it after the suite) so that the suite fits 15
# minutes on the 2-core CI machine: each is a variant whose check the suite makes on another mesh,
# memory kind or strategy (measured: each 35-60 s there).
SLOW_CASES = (
    "test_nl_model.py::test_matches_single_device_including_memory[1-2-mlp]",
    "test_nl_model.py::test_matches_single_device_including_memory[2-4-mlp]",
    "test_nl_model.py::test_logits_are_causal[mlp]",
    "test_precision.py::test_bf16_matches_single_device[1-2]",
    "test_meanflow.py::test_meanflow_fsdp_matches_replicated[fsdp]",
    "test_export.py::test_export_load_gives_the_training_states_logits[fsdp]",
    "test_tp.py::test_tensor_parallel_matches_one_device[shape0-fsdp-flat-skip-more0]",
    "test_gated_delta.py::test_matches_single_device_under_every_strategy[2-4-hierarchical-replicated]",
)


@pytest.hookimpl(tryfirst=True)  # before the `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))  # stable
