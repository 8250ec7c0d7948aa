"""The measured peak memory per device beside the compiled step's and the cost model's (issue 56 item 4).

* a tiny run's ``summary.memory``: the measured peak exceeds the state's bytes per device and stays within the
  device's memory (the host's on CPU); on CPU (live arrays) it is at least the compiled step's argument bytes;
  the compiled peak is there; the records carry the peak; the closing line shows both;
* :func:`~jaxpar.run._memory_meter.live_bytes` counts a sharded and a replicated array exactly and no deleted one;
* the ``memory_stats`` path (GPU / TPU) keeps the busiest device's peak and its limit;
* a step function that cannot be lowered has no compiled peak; the cost model's prediction is shown when given.
"""
from __future__ import annotations

import gc
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from jaxpar.errors import LoopError
from jaxpar.models._mlp import MLPClassifier, classifier_loss
from jaxpar.run import train
from jaxpar.run import LogOptions
from jaxpar.run._memory_meter import MemoryMeter, describe_memory, live_bytes
from jaxpar.step._state import TrainState


def _bytes_per_device(tree, device) -> int:
    """The bytes of ``tree``'s arrays held on ``device``."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
               if device in a.sharding.addressable_devices)


def _batch_fn(i):
    x = np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}


def test_a_run_reports_its_measured_peak_beside_the_compiled_one(tmp_path):
    mesh = jaxpar.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    tx = optax.adam(0.01)
    state, layout = jaxpar.init_train_state(
        lambda: MLPClassifier(features=8, embed=64, mlp=128, classes=2, depth=1, rngs=nnx.Rngs(0)), tx, mesh)
    step = jaxpar.make_train_step(classifier_loss, tx, layout)
    state_bytes = max(_bytes_per_device(state, d) for d in mesh.devices.flat)
    state, summary = train(step, state, _batch_fn, mesh=mesh, steps=4, log_every=2, out_dir=tmp_path,
                           progress="none", plot=False)
    mem = summary.memory
    assert mem["measured_peak_bytes"] > state_bytes
    limit = mem["device_bytes_limit"] or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert mem["measured_peak_bytes"] <= limit
    assert mem["compiled_peak_bytes"] >= mem["compiled_argument_bytes"] > state_bytes   # + the batch
    if mem["measured_by"] == "live_arrays":             # CPU: the step's state, batch and metrics were live
        assert jax.devices()[0].memory_stats() is None
        assert mem["measured_peak_bytes"] >= mem["compiled_argument_bytes"]
    assert mem["measures"] == 4 and mem["predicted_peak_bytes"] is None   # steps 1, 2, 4 and the end
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["memory_peak"] for r in records if r["kind"] == "train"]
    assert len(peaks) == 3 and peaks == sorted(peaks) and peaks[-1] <= mem["measured_peak_bytes"]
    assert describe_memory(mem) in summary.line() and " / compiled " in summary.line()


def test_live_bytes_counts_each_device_s_shards_and_no_deleted_array():
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((4,), ("x",), devices=devices)
    gc.collect()            # an earlier test's arrays held in reference cycles must not be freed in between
    gc.disable()
    try:
        before = live_bytes(devices)
        sharded = jax.device_put(jnp.zeros((64, 8), jnp.float32), NamedSharding(mesh, P("x")))   # 512 B a device
        replicated = jax.device_put(jnp.zeros((10,), jnp.bfloat16), NamedSharding(mesh, P()))     # 20 B on each
        gone = jax.device_put(jnp.zeros((4, 100), jnp.float32), NamedSharding(mesh, P("x")))
        gone.delete()
        after = live_bytes(devices)
    finally:
        gc.enable()
    assert {d: after[d] - before[d] for d in devices} == dict.fromkeys(devices, 16 * 8 * 4 + 10 * 2)
    del sharded, replicated


class _Device:
    """A device whose allocator reports ``peaks`` one after another (the GPU / TPU path)."""

    def __init__(self, peaks, limit):
        self.peaks, self.limit, self.process_index = list(peaks), limit, jax.process_index()

    def memory_stats(self):
        peak = self.peaks.pop(0) if len(self.peaks) > 1 else self.peaks[0]
        return {"peak_bytes_in_use": peak, "bytes_in_use": peak // 2, "bytes_limit": self.limit}


def test_memory_stats_keep_the_busiest_device_s_peak_and_its_limit():
    meter = MemoryMeter([_Device([1, 5, 7], 100), _Device([2, 9], 100)])   # the first device's 1: the source
    assert meter.source == "memory_stats" and meter.limit == 100
    assert [meter.measure(), meter.measure()] == [5, 9]                    # the busiest device each time
    out = meter.summary(predicted=8.0)
    assert out["measured_peak_bytes"] == 9 and out["measured_by"] == "memory_stats"
    assert out["device_bytes_limit"] == 100 and out["predicted_peak_bytes"] == 8.0
    assert out["compiled_peak_bytes"] is None and out["measures"] == 2 and out["measure_s"] >= 0
    assert MemoryMeter([]).summary() is None                    # nothing measured: nothing reported


def test_a_plain_step_function_has_no_compiled_peak_and_the_prediction_is_shown():
    def step(state, batch):                 # a plain Python function: nothing to lower
        new = state._replace(step=state.step + 1, params=state.params + batch.mean())
        return new, {"loss": jnp.mean(batch), "grad_norm": jnp.float32(0.0)}

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    state = TrainState(jnp.int32(0), jnp.zeros(256), ())
    _, summary = train(step, state, lambda i: np.ones((2, 2), np.float32), mesh=mesh, steps=2, progress="none",
                       log=LogOptions(log_every=1, predicted_peak_bytes=2.0**20))
    mem = summary.memory
    assert mem["compiled_peak_bytes"] is None and mem["measured_peak_bytes"] >= 256 * 4
    assert summary.line().endswith("/ predicted 1.0 MiB") or "/ predicted 1.0 MiB;" in summary.line()
    with pytest.raises(LoopError, match=r"predicted_peak_bytes=-1.*not predicted"):
        LogOptions(predicted_peak_bytes=-1)
