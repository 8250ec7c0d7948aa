"""Choosing real accelerators or simulated CPU devices (jaxpar.mesh.use_devices), and format_bytes."""
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxpar import mesh as M
from jaxpar.analysis import format_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh(monkeypatch):
    """Pretend the backend is not up yet; record what use_devices would simulate."""
    calls = []
    monkeypatch.setattr(M, "_backend_initialized", lambda: False)
    monkeypatch.setattr(M, "simulate_cpu_devices", calls.append)
    monkeypatch.setattr(M, "_requested_platform", lambda: None)
    return calls


def test_accelerator_found_uses_real_devices(fresh, monkeypatch):
    monkeypatch.setattr(M, "accelerator_platform", lambda: "cuda")
    assert M.use_devices(8) == "cuda" and fresh == []
    # the CLI (detect=False): only an explicit JAX_PLATFORMS wins over train.devices
    assert M.use_devices(8, detect=False) == "cpu" and fresh == [8]


def test_no_accelerator_simulates(fresh, monkeypatch):
    monkeypatch.setattr(M, "accelerator_platform", lambda: None)
    assert M.use_devices(4) == "cpu" and fresh == [4]


def test_jax_platforms_decides_before_detection(fresh, monkeypatch):
    monkeypatch.setattr(M, "accelerator_platform", lambda: pytest.fail("detection must not run"))
    monkeypatch.setattr(M, "_requested_platform", lambda: "tpu")
    assert M.use_devices(8) == "tpu" and M.use_devices(8, detect=False) == "tpu" and fresh == []
    monkeypatch.setattr(M, "_requested_platform", lambda: "cpu")
    assert M.use_devices(8) == "cpu" and fresh == [8]


def test_requested_platform_reads_the_live_flag():
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", " CUDA ,cpu")
        assert M._requested_platform() == "cuda"
    finally:
        jax.config.update("jax_platforms", before)
    assert M._requested_platform() == "cpu"            # conftest


@pytest.mark.parametrize("plugins,hardware,expected", [
    (set(), {"nvidia": True, "amd": 1, "tpu": 4}, None),                     # hardware, no plugin
    ({"xla_cuda12", "jax_cuda12_plugin"}, {"nvidia": False}, None),          # plugin, no GPU
    ({"xla_cuda12", "jax_cuda12_plugin"}, {"nvidia": True}, "cuda"),
    ({"jax_cuda13_plugin"}, {"nvidia": True}, "cuda"),
    ({"xla_rocm7", "jax_rocm7_plugin"}, {"amd": 1}, "rocm"),
    ({"libtpu"}, {"tpu": 4}, "tpu"),
    ({"openxla-cpu", "jax_plugins.openxla_cpu"}, {"nvidia": True, "amd": 1, "tpu": 4}, None),   # not guessed at
])
def test_accelerator_platform(monkeypatch, plugins, hardware, expected):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(M, "_installed_plugins", lambda: plugins)
    monkeypatch.setattr(M, "_nvidia_gpu_visible", lambda: hardware.get("nvidia", False))
    monkeypatch.setattr(M, "_amd_gpus", lambda: hardware.get("amd", 0))
    monkeypatch.setattr(M, "_tpu_chips", lambda: hardware.get("tpu", 0))
    assert M.accelerator_platform() == expected


def test_cuda_visible_devices_can_hide_every_gpu(monkeypatch):
    from jax._src import hardware_utils

    monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert M._nvidia_gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not M._nvidia_gpu_visible()


def test_backend_already_up():
    assert jax.device_count() == 8                     # start the backend (conftest: 8 CPU devices)
    assert M.use_devices(8) == "cpu"                   # conftest: 8 CPU devices, nothing to change
    with pytest.raises(M.BackendStartedError, match="already initialised with 8 device"):
        M.use_devices(4)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "8"])
def test_use_devices_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match=r"use_devices\(n_simulated=.*positive int"):
        M.use_devices(bad)


def test_fresh_process_without_accelerator_and_with_one():
    """In a new interpreter: no backend start before the count is set, both branches."""
    code = textwrap.dedent("""
        import os
        import jaxpar.mesh as M
        from jax._src import xla_bridge
        M.accelerator_platform = lambda: "cuda"            # as if a CUDA plugin and a GPU were found
        assert M.use_devices(8) == "cuda"
        assert not xla_bridge.backends_are_initialized() and "JAX_PLATFORMS" not in os.environ
        M.accelerator_platform = lambda: None
        assert M.use_devices(4) == "cpu" and not xla_bridge.backends_are_initialized()
        import jax
        print(os.environ["JAX_PLATFORMS"], jax.default_backend(), jax.device_count())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "cpu", "4"]


def test_format_bytes():
    values = (0, 512, 511.6, 4096, np.int64(1536 * 1024), np.float32(2.5 * 2**30), -2048, 3 * 2**50, 5 * 2**60)
    assert [format_bytes(v) for v in values] == ["0 B", "512 B", "512 B", "4.0 KiB", "1.5 MiB", "2.5 GiB",
                                                 "-2.0 KiB", "3.0 PiB", "5120.0 PiB"]
    for bad in ("12", None, True, float("nan")):
        with pytest.raises(ValueError, match=r"format_bytes\(n=.*\): n must be a number of bytes"):
            format_bytes(bad)


def test_distributed_initialize_uses_the_same_decision(fresh, monkeypatch):
    from jax._src import xla_bridge

    from jaxpar.devices import _distributed as dist

    for name in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "JOB_COMPLETION"))]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert dist.initialize(local_device_count=4).method == "single" and fresh == [4]
    monkeypatch.setattr(M, "_requested_platform", lambda: "cuda")
    with pytest.raises(dist.DistributedError, match=r"--local-devices \(local_device_count\)=4 .* asks for 'cuda'"):
        dist.initialize(local_device_count=4)
    assert fresh == [4]
