"""``jaxpar inspect --target`` under memory offloading (jaxpar/commands/_inspect_command.py): the host-held bytes, the
device peak with and without offload, and the transfers per step, compiled deviceless for H100."""
from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest

from jaxpar.config import load_config
from jaxpar.analysis._compiled_memory import host_transfers, memory_report
from jaxpar.commands import inspect_config

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
SMALL = ["model.layers=2", "model.embed=64", "model.seq_len=32", "train.devices=0"]


@pytest.mark.slow          # three deviceless compiles (~20 s on 2 cores)
def test_inspect_reports_host_bytes_device_peaks_and_transfers(capsys):
    """The optimizer state and the master weights offloaded, updated on the host (DP2 x FSDP2 x TP2 on
    h100:1x8): the host holds the parameters and both moments of each device's shard, the gradients and the
    parameters go to the host and the parameters come to the device twice per step, and the device peak falls."""
    cfg = load_config(QUICKSTART, SMALL + ["parallel.offload={optimizer: true, master: true, update: host}"])
    assert inspect_config(cfg, target="h100:1x8") == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith(("offload", "         device peak", "         per step"))]
    assert len(lines) == 3, out
    from jaxpar.config._job import build_job
    from jaxpar.devices import parse_target, target_devices

    job = build_job(cfg, target_devices(parse_target("h100:1x8")), data=False)
    layout = job.state_layout()
    shard = lambda tree: sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize    # noqa: E731
                             for a in jax.tree.leaves(tree))
    abstract = layout.abstract_state()
    params = shard(abstract.params)
    with jax.set_mesh(job.mesh):
        compiled = job.compile(layout)["step"]
    stats = compiled.memory_analysis()
    assert stats.host_argument_size_in_bytes == params + shard(abstract.opt_state)
    scalars = 4 * (cfg.optimizer.clip_norm is not None) + 1 * (cfg.train.on_nonfinite == "skip")   # f32 scale, flag
    # to the device: the streamed parameters, and the host update's result (written to device memory, the
    # memory kind its input came in; jaxpar.cost._host_link counts both), and whether the update was applied
    flag = 1 * (cfg.train.on_nonfinite == "skip")
    assert host_transfers(compiled.as_text()) == {"to_host": 2 * params + scalars, "to_device": 2 * params + flag}
    # XLA's peak counts the host-resident arguments and temporaries; the device's does not
    report = memory_report(compiled)
    assert report.xla_peak_bytes == stats.peak_memory_in_bytes - stats.host_argument_size_in_bytes - \
        stats.host_temp_size_in_bytes
    assert report.peak_bytes <= report.required_bytes < stats.peak_memory_in_bytes
    assert (report.host_argument_bytes, report.host_temp_bytes) == (stats.host_argument_size_in_bytes,
                                                                     stats.host_temp_size_in_bytes)
    saved = lines[1].split("(")[1]
    assert "saved" in saved and not saved.startswith("-"), lines[1]
