"""Calibrate the cost model on this machine's simulated CPU mesh (``jaxpar calibrate``): measure, fit, and
write the ``cpu_sim`` cluster description (``configs/clusters/cpu_sim.yaml``).

What is measured (8 simulated XLA:CPU devices, one ``data`` axis, ``shard_map`` programs):

* each collective of :func:`jaxpar.cost.collective_time` (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute as a ring shift) over buffer sizes ``n`` from 1 KiB to 16 MiB per device (the cost
  model's convention: the all-reduce / reduce-scatter input, the all-gather output, the all-to-all send
  buffer, the permute message). To leave out a jitted call's dispatch, a program runs ``K`` dependent
  collectives back to back; the time per collective is the median over interleaved rounds of
  ``(T(K_hi) - T(K_lo)) / (K_hi - K_lo)``;
* a matmul chain ``[rows, 128] x [128, 512] x [512, 128]`` on all 8 devices at once (rows 128 and 1024), and
  at rows 1024 on one device alone (``shared_compute``: how much faster a lone device runs);
* an in-place ``x * c + 1`` over 32 MiB per device on all 8 devices (``memory_gbps``).

Fits: per collective ``t = alpha + n * beta`` (a record in the file's ``fit`` section); one shared-memory
link ``(alpha, beta, gamma)`` for which :func:`jaxpar.cost.collective_time` is closest to the all-reduce,
all-gather, reduce-scatter and permute measurements (robust least squares on ``log t``, scipy; all-to-all's
timings did not repeat from run to run here); the peak FLOP/s and ``gemm_half_gflop`` through the two
8-device matmul points. docs/planning.md §6 has the method and its residuals.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.cost import Link, best_algorithm, collective_time
from jaxpar.errors import CostModelError, check_int

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SIZES = tuple(2 ** k for k in range(10, 25, 2))          # 1 KiB ... 16 MiB (bytes per device)
K_LO, K_HI = 1, 5
#: The collectives the link is fitted to: those jaxpar's train steps use.
LINK_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
DEVICES = 8


def _mesh(n: int = DEVICES):
    if len(jax.devices()) < n:
        raise CostModelError(f"calibrate: needs {n} devices, JAX has {len(jax.devices())}; run `jaxpar calibrate` "
                             f"(it simulates {n} CPU devices) or set XLA_FLAGS=--xla_force_host_platform_device_count"
                             f"={n} before JAX starts.")
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _collective_body(kind: str, k: int, p: int) -> tuple[Callable, int]:
    """``(body, divisor)``: ``k`` dependent ``kind`` collectives over ``data``; the local input is ``n / divisor``."""
    ax = "data"
    perm = [(i, (i + 1) % p) for i in range(p)]

    def body(x):
        for _ in range(k):
            if kind == "all-reduce":
                x = jax.lax.psum(x, ax)          # values grow p**k: fine in fp32 for k <= 5
            elif kind == "all-gather":           # n = the gathered output; input n / p
                x = jax.lax.all_gather(x, ax, tiled=True)[: x.shape[0]]
            elif kind == "reduce-scatter":       # n = the input; output n / p written back in place
                y = jax.lax.psum_scatter(x, ax, scatter_dimension=0, tiled=True)
                x = jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)
            elif kind == "all-to-all":
                x = jax.lax.all_to_all(x.reshape(p, -1), ax, 0, 0, tiled=True).reshape(-1)
            else:                                # collective-permute: a ring shift of the whole buffer
                x = jax.lax.ppermute(x, ax, perm)
        return x
    return body, p if kind == "all-gather" else 1


def collective_program(kind: str, nbytes: int, k: int, mesh) -> Callable[[], Any]:
    """A zero-argument call of ``k`` dependent ``kind`` collectives of ``nbytes`` per device on ``mesh``.

    Args:
      kind: one of :data:`KINDS`.
      nbytes: the buffer ``n`` of the cost model's convention, bytes per device.
      k: collectives per call.
      mesh: a one-axis (``data``) mesh.

    Returns:
      The call (it returns the device array).
    """
    p = mesh.devices.size
    body, divisor = _collective_body(kind, k, p)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    x = jax.device_put(jnp.ones((p * (nbytes // 4) // divisor,), jnp.float32), NamedSharding(mesh, P("data")))
    return lambda: fn(x)


def matmul_program(rows: int, k: int, mesh) -> tuple[Callable[[], Any], int]:
    """``k`` dependent ``[rows, 128] x [128, 512] x [512, 128]`` matmul pairs on every device of ``mesh``, and
    the FLOPs of one pair."""
    p, spec = mesh.devices.size, NamedSharding(mesh, P("data"))
    w1 = jax.device_put(jnp.full((p * 128, 512), 0.01, jnp.float32), spec)
    w2 = jax.device_put(jnp.full((p * 512, 128), 0.01, jnp.float32), spec)
    x = jax.device_put(jnp.ones((p * rows, 128), jnp.float32), spec)

    def body(x, a, b):
        for _ in range(k):
            x = jnp.tanh((x @ a) @ b)
        return x
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=False))
    return (lambda: fn(x, w1, w2)), 2 * 2 * rows * 128 * 512


def per_repeat(programs: dict, reps: int, lo: int, hi: int) -> tuple[float, dict]:
    """Seconds per repeat: the median over ``reps`` interleaved rounds (rotating order, after two warm-up
    calls each) of ``(T_hi - T_lo) / (hi - lo)``, and each program's median seconds.

    Args:
      programs: ``{lo: call, hi: call}``, zero-argument calls.
      reps: rounds.
      lo, hi: the repeat counts of the two programs.

    Returns:
      ``(seconds per repeat, {repeats: median seconds})``.
    """
    names = list(programs)
    for name in names:
        for _ in range(2):
            jax.block_until_ready(programs[name]())
    samples = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            jax.block_until_ready(programs[name]())
            samples[name].append(time.perf_counter() - t0)
    diffs = [(b - a) / (hi - lo) for a, b in zip(samples[lo], samples[hi])]
    return statistics.median(diffs), {n: statistics.median(s) for n, s in samples.items()}


def measure_collectives(reps: int, sizes=SIZES, say: Callable[[str], None] = print) -> dict[str, list]:
    """``{kind: [(bytes per device, seconds per collective), ...]}`` on 8 devices (see the module doc)."""
    mesh = _mesh()
    out = {}
    for kind in KINDS:
        rows = []
        for nbytes in sizes:
            progs = {k: collective_program(kind, nbytes, k, mesh) for k in (K_LO, K_HI)}
            t, med = per_repeat(progs, reps, K_LO, K_HI)
            rows.append((nbytes, max(t, 1e-6)))
            say(f"  {kind:>18} {nbytes:>10,} B  {max(t, 1e-6) * 1e6:10.1f} us   (K={K_LO}: {med[K_LO] * 1e3:.3f} ms, "
                f"K={K_HI}: {med[K_HI] * 1e3:.3f} ms)")
        out[kind] = rows
    return out


def measure_compute(reps: int, say: Callable[[str], None] = print) -> dict:
    """FLOP/s per device of the matmul chain at rows 128 and 1024 on all 8 devices, at 1024 on one alone, and
    ``rate(w) = R * w / (w + w_half)`` through the two 8-device points (``peak`` R, ``w_half``)."""
    out = {}
    for label, n, rows in (("8 devices busy, rows 128", 8, 128), ("8 devices busy, rows 1024", 8, 1024),
                           ("1 device alone, rows 1024", 1, 1024)):
        mesh = _mesh(n)
        progs, flops = {}, 0
        for k in (1, 4):
            progs[k], flops = matmul_program(rows, k, mesh)
        t = max(per_repeat(progs, reps, 1, 4)[0], 1e-9)
        out[label] = {"rows": rows, "gemm_flops": 2 * rows * 128 * 512, "flops_per_s": flops / t}
        say(f"  matmul chain [{rows},128]x[128,512]x[512,128] on {label}: {t * 1e3:.3f} ms -> "
            f"{flops / t / 1e9:.2f} GFLOP/s per device")
    a, b = out["8 devices busy, rows 128"], out["8 devices busy, rows 1024"]
    # 1/rate = 1/R + w_half / (R w): a line in 1/w through the two points
    x1, y1, x2, y2 = 1 / a["gemm_flops"], 1 / a["flops_per_s"], 1 / b["gemm_flops"], 1 / b["flops_per_s"]
    slope = (y1 - y2) / (x1 - x2)
    inv_r = y2 - slope * x2
    if slope <= 0 or inv_r <= 0:        # the small matmul was not slower (noise): no size effect
        out["peak"], out["w_half"] = max(a["flops_per_s"], b["flops_per_s"]), 0.0
    else:
        out["peak"], out["w_half"] = 1 / inv_r, slope / inv_r
    say(f"  fit rate(w) = R w / (w + w_half): R {out['peak'] / 1e9:.2f} GFLOP/s, "
        f"w_half {out['w_half'] / 1e9:.4f} GFLOP")
    return out


def measure_memory(reps: int, nbytes: int = 32 * 2**20, say: Callable[[str], None] = print) -> float:
    """Bytes/s one device streams while all 8 do: ``x = x * c + 1`` over ``nbytes`` per device, in place
    (donated), read + write; the median over ``max(reps, 5)`` calls (the dispatch, ~0.2 ms, is left in)."""
    mesh = _mesh()
    x = jax.device_put(jnp.ones((DEVICES * nbytes // 4,), jnp.float32), NamedSharding(mesh, P("data")))
    fn = jax.jit(jax.shard_map(lambda x: x * 0.999 + 1.0, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                               check_vma=False), donate_argnums=0)
    x = jax.block_until_ready(fn(x))
    ts = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        x = jax.block_until_ready(fn(x))
        ts.append(time.perf_counter() - t0)
    bw = 2 * nbytes / statistics.median(ts)
    say(f"  x * c + 1 in place over {nbytes / 2**20:.0f} MiB per device on 8 devices: "
        f"{statistics.median(ts) * 1e3:.3f} ms -> {bw / 1e9:.2f} GB/s per device")
    return bw


def linear_fit(rows) -> dict:
    """``t = alpha + n * beta`` by least squares on relative errors over ``[(n, t), ...]``, with its residuals."""
    n = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    w = 1.0 / t                                                 # relative errors: every size counts
    A = np.stack([np.ones_like(n), n], 1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    res = (alpha + beta * n - t) / t
    return {"alpha_us": float(alpha * 1e6), "beta_ns_per_byte": float(beta * 1e9),
            "max_rel_residual": float(np.max(np.abs(res))), "rms_rel_residual": float(np.sqrt(np.mean(res ** 2))),
            "points": [[int(a), float(b * 1e6)] for a, b in rows]}


def link_fit(meas: dict, p: int = DEVICES, shared_memory: bool = True) -> dict:
    """One ``Link(alpha, beta, gamma, shared_memory)`` for which the cost model's best-algorithm times of the
    :data:`LINK_KINDS` are closest to the measurements (robust least squares on log time), with residuals."""
    from scipy.optimize import least_squares

    pts = [(kind, n, t) for kind, rows in meas.items() if kind in LINK_KINDS for n, t in rows]

    def link(x):
        a, b, g = np.exp(x)
        return Link(a, b, g, shared_memory)

    def resid(x):
        L = link(x)
        return np.array([math.log(collective_time(kind, n, p, L) / t) for kind, n, t in pts])

    sol = least_squares(resid, np.log([2e-5, 1e-9, 1e-10]), loss="soft_l1", f_scale=0.3)   # a noisy point weighs less
    L = link(sol.x)
    res = {kind: [float(collective_time(kind, n, p, L) / t - 1) for n, t in rows] for kind, rows in meas.items()}
    allres = np.concatenate([np.abs(v) for k, v in res.items() if k in LINK_KINDS])
    return {"link": L, "residuals": res, "max_rel_residual": float(allres.max()),
            "median_rel_residual": float(np.median(allres)),
            "algorithms": {kind: sorted({best_algorithm(kind, n, p, L)[0] for n, _ in rows})
                           for kind, rows in meas.items()}}


def environment() -> dict[str, Any]:
    """The machine and versions the calibration ran on (the preset's ``sources``)."""
    import subprocess

    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    return {"git": git, "jax": jax.__version__, "devices": f"{DEVICES} x {jax.devices()[0].platform}",
            "nproc": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def preset_yaml(env: dict, fits: dict, lf: dict, net: dict, compute: dict, reps: int, load: tuple) -> str:
    """The ``cpu_sim`` cluster description: the calibrated link, compute and memory rates, and a record of
    the measurements and fits."""
    L = lf["link"]
    busy, alone = compute["8 devices busy, rows 1024"], compute["1 device alone, rows 1024"]
    lines = [
        "# This machine's simulated CPU mesh: 8 XLA CPU devices in one process sharing the machine's cores.",
        "# WRITTEN BY jaxpar calibrate -- run it again to re-calibrate; do not edit the numbers by hand.",
        "name: cpu_sim",
        f"description: {env['devices']} (jax_num_cpu_devices=8) on a {os.cpu_count()}-core "
        f"{platform.processor() or platform.machine()}, one process",
        "sources:",
        f"  - \"jaxpar calibrate (jaxpar/devices/_calibrate.py; benchmarks/calibrate.py adds the strategies' ranking), "
        f"{env['date']}, jax {env['jax']}, jaxpar @ {env['git']}, nproc {env['nproc']}, load average {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min): the machine was shared, the numbers are noisy\"",
        f"  - \"link: shared memory (one rendezvous, then each device reads its peers' buffers: one-shot "
        f"collectives); alpha, beta, gamma for which jaxpar.cost.collective_time (best algorithm per size, p = 8) "
        f"is closest to {sum(len(v) for k, v in fits.items() if k in LINK_KINDS)} measurements of {len(LINK_KINDS)} "
        f"collectives (all-to-all left out: its timings were not reproducible; its own fit is under fit:) "
        f"(1 KiB .. 16 MiB per device; robust least squares on log time); median |relative residual| "
        f"{lf['median_rel_residual']:.1%}, max {lf['max_rel_residual']:.1%} (the message-passing algorithms "
        f"of Thakur et al. fit worse: median {net['median_rel_residual']:.1%}, max {net['max_rel_residual']:.1%})\"",
        f"  - \"peak_tflops.float32 and gemm_half_gflop: a [rows,128]x[128,512]x[512,128] fp32 matmul chain on all "
        f"8 devices at once, {compute['8 devices busy, rows 128']['flops_per_s'] / 1e9:.2f} GFLOP/s per device at "
        f"rows 128 and {busy['flops_per_s'] / 1e9:.2f} at rows 1024, fitted to R w / (w + w_half) (one device "
        f"alone, rows 1024: {alone['flops_per_s'] / 1e9:.2f} GFLOP/s: see shared_compute); efficiency 1.0: the "
        f"peak is the measured rate\"",
        f"  - \"memory_gbps: x * c + 1 over 32 MiB per device on all 8 devices at once (read + write), "
        f"{compute['memory_bandwidth'] / 1e9:.2f} GB/s per device; shared_compute: the 8 devices share the cores: one "
        f"device alone ran the rows-1024 matmul chain that many times faster than each of 8 busy ones\"",
        "  - \"device_memory_gib: an assumption (the simulated devices share the host's memory)\"",
        "devices_per_node: 8",
        "nodes: 1",
        "device_memory_gib: 3",
        f"peak_tflops: {{float32: {compute['peak'] / 1e12:.6g}}}",
        "efficiency: 1.0",
        f"gemm_half_gflop: {compute['w_half'] / 1e9:.4g}",
        f"memory_gbps: {compute['memory_bandwidth'] / 1e9:.4g}",
        f"shared_compute: {alone['flops_per_s'] / busy['flops_per_s']:.3g}",
        f"intra_node: {{alpha_us: {L.alpha * 1e6:.4g}, bandwidth_gbps: {1 / L.beta / 1e9:.4g}, "
        + (f"reduce_gbps: {1 / L.gamma / 1e9:.4g}, " if L.gamma > 1e-13 else "") + "shared_memory: true}",
        "fit:     # per collective: t = alpha + n * beta over the sweep (n: bytes per device); a record, not read",
        f"  date: \"{env['date']}\"",
        f"  reps: {reps}",
        f"  repeats_per_program: [{K_LO}, {K_HI}]",
    ]
    for kind, f in fits.items():
        lines.append(f"  {kind}: {{alpha_us: {f['alpha_us']:.4g}, beta_ns_per_byte: {f['beta_ns_per_byte']:.4g}, "
                     f"max_rel_residual: {f['max_rel_residual']:.3f}, rms_rel_residual: {f['rms_rel_residual']:.3f}}}")
    lines.append("  measured_us:     # [bytes per device, microseconds per collective]")
    lines += [f"    {kind}: {[[n, round(t, 1)] for n, t in f['points']]}" for kind, f in fits.items()]
    lines.append("  link_residuals:  # cost model (calibrated link, best algorithm) / measured - 1, per size "
                 "(all-to-all: not fitted)")
    lines += [f"    {kind}: {[round(x, 3) for x in r]}" for kind, r in lf["residuals"].items()]
    return "\n".join(lines) + "\n"


def calibrate(out: str | Path | None = None, *, reps: int = 9, sizes=SIZES,
              say: Callable[[str], None] = print) -> dict:
    """Measure this machine's 8 simulated CPU devices, fit the cost model's constants, write the ``cpu_sim``
    cluster description (``jaxpar calibrate``).

    Args:
      out: the YAML to write (None: none), e.g. ``configs/clusters/cpu_sim.yaml``.
      reps: interleaved rounds per measurement.
      sizes: the collectives' buffer sizes, bytes per device.
      say: where progress lines go.

    Returns:
      ``{"yaml": text, "measured_s": {kind: [(n, s)]}, "fits", "link": {"alpha", "beta", "gamma", "residuals"},
      "compute", "env", "load": [start, end], "seconds": wall time}``.

    Raises:
      CostModelError: JAX has fewer than 8 devices, or ``reps`` < 1.
    """
    check_int("calibrate", "reps", reps, 1, CostModelError)
    _mesh()
    env, load, t0 = environment(), os.getloadavg(), time.perf_counter()
    say(f"# calibrate  ({env['devices']}, nproc={env['nproc']}, jax {env['jax']}, jaxpar @ {env['git']}, "
        f"load {load[0]:.2f})\ncollectives (time per collective):")
    meas = measure_collectives(reps, sizes, say)
    say("compute:")
    compute = measure_compute(reps, say)
    compute["memory_bandwidth"] = measure_memory(reps, say=say)
    fits = {kind: linear_fit(rows) for kind, rows in meas.items()}
    lf, net = link_fit(meas), link_fit(meas, shared_memory=False)
    L = lf["link"]
    say(f"link for the cost model: alpha {L.alpha * 1e6:.2f} us, beta {L.beta * 1e9:.4f} ns/B "
        f"({1 / L.beta / 1e9:.3f} GB/s), gamma {L.gamma * 1e9:.4f} ns/B; |residual| median "
        f"{lf['median_rel_residual']:.1%}, max {lf['max_rel_residual']:.1%}")
    load_end = os.getloadavg()
    text = preset_yaml(env, fits, lf, net, compute, reps, load_end)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        say(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return {"yaml": text, "measured_s": meas, "fits": fits, "compute": compute, "env": env, "load": [load, load_end],
            "link": {"alpha": L.alpha, "beta": L.beta, "gamma": L.gamma, "residuals": lf["residuals"]},
            "seconds": time.perf_counter() - t0}
