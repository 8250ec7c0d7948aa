"""Root test configuration: 8 simulated CPU devices, set once before any backend use."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Test speed: with the default partitionable threefry, XLA:CPU takes ~2 s to compile the random
# initialiser of each distinct parameter shape of rank >= 3 (a small GPT's sharded init: 6.4 s,
# against 2.1 s without it). Every test compares runs that share one initialisation, so which
# (sharding-independent) bit generator makes it does not matter to them.
jax.config.update("jax_threefry_partitionable", False)

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower tests, not in the default run")


def need_devices(n: int):
    """Skip a test that needs more devices than the backend has."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")
