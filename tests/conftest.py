"""Root test configuration: 8 simulated CPU devices, set once before any backend use."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower tests, not in the default run")


def need_devices(n: int):
    """Skip a test that needs more devices than the backend has."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")
