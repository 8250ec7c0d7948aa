"""Calibrate the cost model's compute and memory rates on one attached accelerator (``jaxpar calibrate
--device``): time bf16 GEMMs from 2 GFLOP to 1 TFLOP and a streaming kernel, fit the roofline's matmul
efficiency curve (:func:`jaxpar.cost.fit_gemm_efficiency`) and the memory bandwidth, time the host link and the
host update (memory offloading, :func:`measure_host`), and write a cluster description that keeps a base
preset's links between devices. docs/planning.md §6 has the method; docs/benchmarks.md §21 the check against
train steps the fit never saw.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import SingleDeviceSharding

from jaxpar.cost import fit_gemm_efficiency, presets

#: ``(m, k, n)`` of the timed GEMMs: square ones, the GPT-124M MLP's and the Llama-3-8B MLP's at 8k tokens.
GEMMS = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 768, 3072),
         (16384, 3072, 768), (8192, 4096, 14336), (8192, 14336, 4096))
#: Bytes of the streaming kernel's array (each of the K_HI programs' arrays).
STREAM_BYTES = 2 ** 29
#: Bytes of the arrays :func:`measure_host` copies and updates.
HOST_BYTES = 2 ** 30


#: Programs of ``K_LO`` and ``K_HI`` independent kernels: their time difference over ``K_HI - K_LO`` is one
#: kernel's, without the call's dispatch (about 0.1-0.2 ms from Python: a 2 GFLOP GEMM's time several times).
K_LO, K_HI = 1, 4


def _median_seconds(fn: Callable, args: tuple, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def per_kernel_seconds(kernel: Callable, inputs: list[tuple], reps: int) -> float:
    """Seconds of one ``kernel(*inputs[i])``: programs of :data:`K_LO` and :data:`K_HI` calls on distinct
    inputs (no call can be shared or hoisted), timed, their difference over ``K_HI - K_LO``.

    Args:
      kernel: the computation.
      inputs: ``K_HI`` argument tuples.
      reps: timed runs of each program (the median).

    Returns:
      The seconds of one call inside a program.
    """
    def program(count):
        return jax.jit(lambda *args: [kernel(*a) for a in args[:count]])
    lo = _median_seconds(program(K_LO), tuple(inputs[:K_LO]), reps)
    hi = _median_seconds(program(K_HI), tuple(inputs), reps)
    return max(hi - lo, 1e-9) / (K_HI - K_LO)


def measure_gemms(shapes=GEMMS, reps: int = 10, say: Callable[[str], None] = print) -> list[tuple[float, float]]:
    """``[(FLOPs, seconds)]`` of one bf16 GEMM per shape (fp32 accumulation), random inputs
    (:func:`per_kernel_seconds`).

    Args:
      shapes: ``(m, k, n)`` per GEMM.
      reps: timed runs per program (the median).
      say: where the lines go.

    Returns:
      The points.
    """
    out = []
    for m, k, n in shapes:
        keys = jax.random.split(jax.random.key(m + k + n), 2 * K_HI)
        inputs = [(jax.random.normal(keys[2 * i], (m, k), jnp.bfloat16),
                   jax.random.normal(keys[2 * i + 1], (k, n), jnp.bfloat16)) for i in range(K_HI)]
        t = per_kernel_seconds(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                               inputs, reps)
        out.append((2.0 * m * k * n, t))
        say(f"  GEMM {m} x {k} x {n}: {t * 1e3:.3f} ms -> {2 * m * k * n / t / 1e12:.1f} TFLOP/s")
    return out


def measure_stream(nbytes: int = STREAM_BYTES, reps: int = 10, say: Callable[[str], None] = print) -> float:
    """Bytes per second of ``x * c + 1`` over ``nbytes`` of fp32, each byte read and written once
    (:func:`per_kernel_seconds`).

    Args:
      nbytes: one array's bytes.
      reps: timed runs per program (the median).
      say: where the line goes.

    Returns:
      Read plus written bytes per second.
    """
    inputs = [(jnp.full((nbytes // 4,), float(i), jnp.float32),) for i in range(K_HI)]
    t = per_kernel_seconds(lambda x: x * 0.999 + 1.0, inputs, reps)
    bw = 2 * nbytes / t
    say(f"  x * c + 1 over {nbytes / 2**20:.0f} MiB: {t * 1e3:.3f} ms -> {bw / 1e9:.0f} GB/s")
    return bw


def measure_host(nbytes: int = HOST_BYTES, reps: int = 10, say: Callable[[str], None] = print) -> dict[str, float]:
    """The rates memory offloading runs at (docs/planning.md §12): the host link, from copies of ``nbytes``
    between ``pinned_host`` and device memory (each direction's median; the link's rate is their harmonic
    mean, as the cost model adds the two directions' times), and the host update, from Adam's update of fp32
    arrays of ``nbytes``: the offloaded step's own arithmetic (:func:`jaxpar.step._update.optimizer_arithmetic`
    of ``optax.adamw`` with the clip's scale and the skip flag) computed in host memory as that step computes
    it (:func:`jaxpar.parallel._offload.on_host`), counted as the cost model counts it (28 bytes an element:
    the gradient, the moments and the master read, the moments and the master written).

    Args:
      nbytes: one array's bytes.
      reps: timed runs per measurement (the median; at most 3 of the update).
      say: where the lines go.

    Returns:
      ``{"to_device_gbps", "to_host_gbps", "link_gbps", "update_gbps"}``.
    """
    from jaxpar.parallel._offload import on_host
    from jaxpar.step._update import optimizer_arithmetic

    dev = jax.devices()[0]
    host, device = (SingleDeviceSharding(dev, memory_kind=k) for k in ("pinned_host", "device"))
    x = jax.device_put(np.full(nbytes // 4, 0.5, np.float32), host)
    to_device = _median_seconds(lambda a: jax.device_put(a, device), (x,), reps)
    to_host = _median_seconds(lambda a: jax.device_put(a, host), (jax.device_put(x, device),), reps)
    tx = optax.adamw(1e-4, weight_decay=0.1)
    state = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), host), jax.eval_shape(tx.init, x))
    arithmetic = jax.jit(lambda g, s, p, scale, ok: optimizer_arithmetic(tx, ("scale", "ok"), g, s, p, scale, ok)[:2])
    scalars = tuple(jax.device_put(np.asarray(v), host) for v in (np.float32(0.5), True))
    update = jax.jit(lambda *a: on_host(arithmetic)(*a), out_shardings=host)
    seconds = _median_seconds(update, (x, state, x, *scalars), min(reps, 3))
    out = {"to_device_gbps": nbytes / to_device / 1e9, "to_host_gbps": nbytes / to_host / 1e9,
           "link_gbps": 2 * nbytes / (to_device + to_host) / 1e9, "update_gbps": 7 * nbytes / seconds / 1e9}
    say(f"  host link over {nbytes / 2**20:.0f} MiB: {out['to_device_gbps']:.1f} GB/s to the device, "
        f"{out['to_host_gbps']:.1f} GB/s to the host; Adam in host memory: {out['update_gbps']:.1f} GB/s")
    return out


def calibrate_device(out: str | Path | None = None, *, base: str = "h100", reps: int = 10, shapes=GEMMS,
                     stream_bytes: int = STREAM_BYTES, host_bytes: int | None = HOST_BYTES,
                     say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure the attached device, fit, and write a cluster description: ``base``'s preset (its links, its
    peaks, its node shape) with the measured ``efficiency``, ``gemm_half_gflop`` and ``memory_gbps``, and
    with ``host_bytes`` the measured ``host_link_gbps`` and ``host_memory_gbps`` (:func:`measure_host`).

    Args:
      out: the YAML to write (None: none).
      base: the preset whose other keys the description keeps.
      reps: timed runs per measurement.
      shapes: the GEMMs (:data:`GEMMS`).
      stream_bytes: the streaming kernel's bytes.
      host_bytes: the host measurement's array bytes (None: the base preset's host rates are kept).
      say: where the progress lines go.

    Returns:
      ``{"yaml": text, "gemms": points, "fit": ..., "stream_gbps": ..., "host": ... or None, "device": kind}``.
    """
    data = yaml.safe_load(presets()[base].read_text())
    device = jax.devices()[0]
    say(f"calibrating {device.device_kind} against the {base} preset's peak ({data['peak_tflops']['bfloat16']} TFLOP/s)")
    gemms = measure_gemms(shapes, reps, say)
    fit = fit_gemm_efficiency(gemms, data["peak_tflops"]["bfloat16"] * 1e12)
    gbps = measure_stream(stream_bytes, reps, say) / 1e9
    host = measure_host(host_bytes, reps, say) if host_bytes else None
    stamp = time.strftime("%Y-%m-%d")
    data.update(name=f"{base}_measured", efficiency=fit["efficiency"], gemm_half_gflop=fit["gemm_half_gflop"],
                memory_gbps=round(gbps), memory_efficiency=1.0,
                description=f"{data.get('description', base)}; compute and memory rates measured on one "
                            f"{device.device_kind} ({stamp}, jax {jax.__version__}, jaxpar calibrate --device)")
    data["sources"] = list(data.get("sources", [])) + [
        f"measured {stamp} on one {device.device_kind}: bf16 GEMMs {[list(s) for s in shapes]} at "
        f"{[round(w / t / 1e12, 1) for w, t in gemms]} TFLOP/s, fitted e * w / (w + h) with e {fit['efficiency']}, "
        f"h {fit['gemm_half_gflop']} GFLOP (max residual {fit['max_rel_residual']}); x * c + 1 over "
        f"{stream_bytes / 2**30:g} GiB at {round(gbps)} GB/s read + written; each the difference of programs of "
        f"{K_LO} and {K_HI} kernels"]
    if host:
        data.update(host_link_gbps=round(host["link_gbps"], 1), host_memory_gbps=round(host["update_gbps"], 1))
        data["sources"].append(
            f"measured {stamp}: copies of {host_bytes / 2**30:g} GiB between pinned host and device memory at "
            f"{host['to_device_gbps']:.1f} GB/s to the device and {host['to_host_gbps']:.1f} to the host "
            f"(host_link_gbps: their harmonic mean); Adam's update in host memory (the offloaded host update's "
            f"computation) at "
            f"{host['update_gbps']:.1f} GB/s of 28 bytes an element (host_memory_gbps)")
    data.pop("fit", None)
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    if out is not None:
        Path(out).write_text(text)
        say(f"wrote {out}")
    return {"yaml": text, "gemms": gemms, "fit": fit, "stream_gbps": gbps, "host": host,
            "device": device.device_kind}
