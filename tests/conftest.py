"""Eight emulated CPU devices, configured before JAX creates its backends."""

import os

# The LLVM flags halve XLA:CPU compile time, which dominates this suite; they change code
# generation effort, not the arithmetic, and the single-device references use them too.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


def pytest_configure(config):
    assert jax.device_count() == 8, f"tests need 8 emulated CPU devices, got {jax.device_count()}"
