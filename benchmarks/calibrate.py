"""Calibrate the cost model on this machine's simulated CPU mesh and write ``configs/clusters/cpu_sim.yaml``.

What is measured (8 simulated XLA:CPU devices, one ``data`` axis, ``shard_map`` programs):

* each collective of :mod:`jaxpar.cost._collectives` -- all-reduce, all-gather, reduce-scatter,
  all-to-all, collective-permute (a ring shift) -- over a sweep of buffer sizes ``n`` (the
  cost model's convention: the all-reduce / reduce-scatter input, the all-gather output,
  the all-to-all send buffer, the permute message; bytes per device). To leave out the
  dispatch of a jitted call, a program runs ``K`` dependent collectives back to back and the
  time per collective is ``(T(K_hi) - T(K_lo)) / (K_hi - K_lo)`` (the median over interleaved
  rounds of the per-round difference);
* a matmul chain ``[rows, 128] x [128, 512] x [512, 128]`` on all 8 devices at once (rows 128 and
  1024: the compute rate of one simulated device while the others are busy, as in a training
  step), and at rows 1024 on one device alone (how much faster a lone device runs:
  ``shared_compute``);
* an in-place ``x * c + 1`` over 32 MiB per device on all 8 devices (``memory_gbps``, for the
  optimizer update).

Fits:

* per collective, ``t = alpha + n * beta`` by least squares over the sweep (recorded in the
  preset's ``fit`` section with the relative residuals);
* one shared-memory link ``(alpha, beta, gamma)`` for the preset: the values for which the cost
  model's own prediction (:func:`jaxpar.cost.collective_time`, best one-shot algorithm per size)
  is closest to the measurements of all-reduce, all-gather, reduce-scatter and permute, by robust
  least squares on ``log t`` (scipy); its residuals are recorded too. All-to-all is fitted on its
  own only (its timings did not repeat from run to run here);
* the peak FLOP/s and ``gemm_half_gflop`` through the two 8-device matmul points.

Then the calibrated preset predicts the step time of the 11 strategies of
``benchmarks/overhead.py`` (GPT 4 layers, embed 128, 8 heads, seq 64, vocab 256, batch 16, fp32,
``lowering='xla-cpu'``) and the predicted order is compared with the measured one (Spearman's rho).
Measured times: ``--overhead-json`` (what ``benchmarks/overhead.py --json`` writes), else the
``jaxpar ms`` column of the table in docs/benchmarks.md §1, read from the file
(:func:`doc_measured_step_times`, with the section's date, commit and machine). Without
measuring, :func:`doc_spearman` gives the figure that README.md, docs/benchmarks.md §7 and
docs/planning.md §6 quote (``tests/test_docs_figures.py`` checks that they do).

Usage::

    python benchmarks/calibrate.py [--reps 9] [--write configs/clusters/cpu_sim.yaml] [--json out.json]
                                   [--overhead-json overhead.json]
    python benchmarks/calibrate.py --predict-only [--preset configs/clusters/cpu_sim.yaml]
                                   [--overhead-json overhead.json] [--json out.json]   # measures nothing
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from _common import environment, write_json

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SIZES = tuple(2 ** k for k in range(10, 25, 2))          # 1 KiB ... 16 MiB (bytes per device)
K_LO, K_HI = 1, 5
#: The collectives the link is fitted to: those jaxpar's train steps use. All-to-all is measured and
#: fitted on its own (recorded), but its timings on this backend were not reproducible from run to run.
LINK_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")

#: The measured step times used when no --overhead-json is given: the "jaxpar ms" column of the table
#: in this section of docs/benchmarks.md (read from the file, never copied here).
DOC = ROOT / "docs" / "benchmarks.md"
DOC_SECTION = "1"
DOC_COLUMN = "jaxpar ms"
DEFAULT_PRESET = ROOT / "configs" / "clusters" / "cpu_sim.yaml"


# ----------------------------------------------------------------------------- programs
def collective_program(kind: str, nbytes: int, k: int, mesh, p: int):
    """``(jitted fn, input)``: ``k`` dependent ``kind`` collectives of ``nbytes`` per device."""
    n = nbytes // 4                                   # fp32 elements of the buffer ``n``
    ax = "data"

    if kind == "all-reduce":
        def body(x):
            for _ in range(k):
                x = jax.lax.psum(x, ax)          # values grow p**k: fine in fp32 for k <= 5
            return x
        local = n
    elif kind == "all-gather":                       # n = the gathered output; input n / p
        def body(x):
            for _ in range(k):
                x = jax.lax.all_gather(x, ax, tiled=True)[: x.shape[0]]
            return x
        local = n // p
    elif kind == "reduce-scatter":                   # n = the input; output n / p written back in place
        def body(x):
            for _ in range(k):
                y = jax.lax.psum_scatter(x, ax, scatter_dimension=0, tiled=True)
                x = jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)
            return x
        local = n
    elif kind == "all-to-all":
        def body(x):
            for _ in range(k):
                x = jax.lax.all_to_all(x.reshape(p, -1), ax, 0, 0, tiled=True).reshape(-1)
            return x
        local = n
    else:                                             # collective-permute: a ring shift of the whole buffer
        perm = [(i, (i + 1) % p) for i in range(p)]

        def body(x):
            for _ in range(k):
                x = jax.lax.ppermute(x, ax, perm)
            return x
        local = n
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax), check_vma=False))
    x = jax.device_put(jnp.ones((p * local,), jnp.float32), NamedSharding(mesh, P(ax)))
    return fn, x


def matmul_program(rows: int, k: int, mesh):
    """``k`` dependent ``[rows, 128] x [128, 512] x [512, 128]`` matmul pairs on every device of ``mesh``."""
    p = mesh.devices.size
    w1 = jax.device_put(jnp.full((p * 128, 512), 0.01, jnp.float32), NamedSharding(mesh, P("data")))
    w2 = jax.device_put(jnp.full((p * 512, 128), 0.01, jnp.float32), NamedSharding(mesh, P("data")))
    x = jax.device_put(jnp.ones((p * rows, 128), jnp.float32), NamedSharding(mesh, P("data")))

    def body(x, a, b):
        for _ in range(k):
            x = jnp.tanh((x @ a) @ b)
        return x
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=False))
    return (lambda: fn(x, w1, w2)), 2 * 2 * rows * 128 * 512


def timed_pairs(programs: dict, reps: int, samples_out: dict | None = None) -> dict:
    """Median seconds of each zero-argument callable, interleaved over ``reps`` rounds (rotating order);
    ``samples_out`` receives every sample."""
    names = list(programs)
    for name in names:                                # compile + warm up
        for _ in range(2):
            jax.block_until_ready(programs[name]())
    samples = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            jax.block_until_ready(programs[name]())
            samples[name].append(time.perf_counter() - t0)
    if samples_out is not None:
        samples_out.update(samples)
    return {n: statistics.median(s) for n, s in samples.items()}


def per_repeat(programs: dict, reps: int, lo: int, hi: int) -> tuple[float, dict]:
    """Seconds per repeat: the median over rounds of ``(T_hi - T_lo) / (hi - lo)`` (paired within a round)."""
    samples: dict = {}
    med = timed_pairs(programs, reps, samples)
    diffs = [(b - a) / (hi - lo) for a, b in zip(samples[lo], samples[hi])]
    return statistics.median(diffs), med


def measure_collectives(reps: int, sizes=SIZES) -> dict[str, list[tuple[int, float]]]:
    mesh = jax.make_mesh((8,), ("data",))
    p = 8
    out = {}
    for kind in KINDS:
        rows = []
        for nbytes in sizes:
            progs = {}
            for k in (K_LO, K_HI):
                fn, x = collective_program(kind, nbytes, k, mesh, p)
                progs[k] = (lambda fn=fn, x=x: fn(x))
            t, med = per_repeat(progs, reps, K_LO, K_HI)
            t = max(t, 1e-6)
            rows.append((nbytes, t))
            print(f"  {kind:>18} {nbytes:>10,} B  {t * 1e6:10.1f} us   (K={K_LO}: {med[K_LO] * 1e3:.3f} ms, "
                  f"K={K_HI}: {med[K_HI] * 1e3:.3f} ms)", flush=True)
        out[kind] = rows
    return out


def measure_compute(reps: int) -> dict:
    """FLOP/s per device of the matmul chain: ``rows`` 128 (the benchmark GPT's tokens per device under
    DP8) and 1024 on all 8 devices, 1024 on one device alone; and ``rate(w) = R * w / (w + w_half)``
    through the two 8-device points (``w`` = FLOPs of the largest matmul, as the cost model uses)."""
    out = {}
    for label, n, rows in (("8 devices busy, rows 128", 8, 128), ("8 devices busy, rows 1024", 8, 1024),
                           ("1 device alone, rows 1024", 1, 1024)):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        progs, flops = {}, None
        for k in (1, 4):
            fn, flops = matmul_program(rows, k, mesh)
            progs[k] = fn
        t, _ = per_repeat(progs, reps, 1, 4)
        t = max(t, 1e-9)
        out[label] = {"rows": rows, "gemm_flops": 2 * rows * 128 * 512, "flops_per_s": flops / t}
        print(f"  matmul chain [{rows},128]x[128,512]x[512,128] on {label}: {t * 1e3:.3f} ms -> "
              f"{flops / t / 1e9:.2f} GFLOP/s per device", flush=True)
    a, b = out["8 devices busy, rows 128"], out["8 devices busy, rows 1024"]
    # 1/rate = 1/R + w_half / (R w): a line in 1/w through the two points
    x1, y1, x2, y2 = 1 / a["gemm_flops"], 1 / a["flops_per_s"], 1 / b["gemm_flops"], 1 / b["flops_per_s"]
    slope = (y1 - y2) / (x1 - x2)
    inv_r = y2 - slope * x2
    if slope <= 0 or inv_r <= 0:        # the small matmul was not slower (noise): no size effect
        out["peak"], out["w_half"] = max(a["flops_per_s"], b["flops_per_s"]), 0.0
    else:
        out["peak"], out["w_half"] = 1 / inv_r, slope / inv_r
    print(f"  fit rate(w) = R w / (w + w_half): R {out['peak'] / 1e9:.2f} GFLOP/s, w_half "
          f"{out['w_half'] / 1e9:.4f} GFLOP", flush=True)
    return out


def measure_memory(reps: int, nbytes: int = 32 * 2**20) -> float:
    """Bytes/s one device streams while all 8 do: ``x = x * c + 1`` over ``nbytes`` per device, in place
    (donated), read + write; the median over ``reps`` calls (the dispatch, ~0.2 ms, is left in)."""
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((8 * nbytes // 4,), jnp.float32), NamedSharding(mesh, P("data")))
    fn = jax.jit(jax.shard_map(lambda x: x * 0.999 + 1.0, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                               check_vma=False), donate_argnums=0)
    x = jax.block_until_ready(fn(x))
    ts = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        x = jax.block_until_ready(fn(x))
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    bw = 2 * nbytes / t
    print(f"  x * c + 1 in place over {nbytes / 2**20:.0f} MiB per device on 8 devices: {t * 1e3:.3f} ms -> "
          f"{bw / 1e9:.2f} GB/s per device", flush=True)
    return bw


# ----------------------------------------------------------------------------- fits
def linear_fit(rows) -> dict:
    n = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    w = 1.0 / t                                                 # relative errors: every size counts
    A = np.stack([np.ones_like(n), n], 1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    pred = alpha + beta * n
    res = (pred - t) / t
    return {"alpha_us": float(alpha * 1e6), "beta_ns_per_byte": float(beta * 1e9),
            "max_rel_residual": float(np.max(np.abs(res))), "rms_rel_residual": float(np.sqrt(np.mean(res ** 2))),
            "points": [[int(a), float(b * 1e6)] for a, b in rows]}


def link_fit(meas: dict, p: int = 8, shared_memory: bool = True) -> dict:
    """One ``Link(alpha, beta, gamma, shared_memory)`` for which the cost model's best-algorithm times are
    closest to the measurements (least squares on log time)."""
    from scipy.optimize import least_squares

    from jaxpar.cost import _collectives as C

    pts = [(kind, n, t) for kind, rows in meas.items() if kind in LINK_KINDS for n, t in rows]

    def link(x):
        a, b, g = np.exp(x)
        return C.Link(a, b, g, shared_memory)

    def resid(x):
        L = link(x)
        return np.array([math.log(C.time(kind, n, p, L) / t) for kind, n, t in pts])

    x0 = np.log([2e-5, 1e-9, 1e-10])
    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.3)     # robust: a noisy point weighs less
    L = link(sol.x)
    res = {kind: [float(C.time(kind, n, p, L) / t - 1) for n, t in rows] for kind, rows in meas.items()}
    allres = np.concatenate([np.abs(v) for k, v in res.items() if k in LINK_KINDS])
    return {"link": L, "residuals": res, "max_rel_residual": float(allres.max()),
            "median_rel_residual": float(np.median(allres)),
            "algorithms": {kind: sorted({C.best(kind, n, p, L)[0] for n, _ in rows}) for kind, rows in meas.items()}}


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


# ----------------------------------------------------------------------------- ranking
def predicted_step_times(cluster) -> dict[str, dict]:
    from jaxpar import cost
    from jaxpar.cost import evaluate

    from _common import STRATEGIES

    model = cost.gpt(layers=4, hidden=128, heads=8, seq=64, vocab=256, batch=16)
    out = {}
    for bs in STRATEGIES:
        plan = cost.Plan(**bs.mesh, zero=bs.zero, sequence_parallel=bs.sequence_parallel)
        c = cluster.with_devices(plan.devices)
        e = evaluate(model, plan, c, dtype="float32", precision="fp32", lowering="xla-cpu")
        t = e.time
        out[bs.name] = {"step_s": t.total, "compute_s": t.compute, "data_s": t.data, "tensor_s": t.tensor,
                        "optimizer_s": t.optimizer, "elementwise_s": t.elementwise}
    return out


def doc_section(text: str, number: str) -> str:
    """The text of section ``## <number>.`` of a markdown file, up to the next ``## `` heading."""
    import re

    m = re.search(rf"^## {re.escape(number)}\. .*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise ValueError(f"no section '## {number}.' in the document")
    return m.group(0)


def section_provenance(section: str) -> dict[str, str]:
    """The date, commit and machine a results section states in its first paragraph (the command line)."""
    import re

    head = " ".join((section.split("\n\n")[1] if "\n\n" in section else section).split())
    date = re.search(r"\d{4}-\d{2}-\d{2}(?: (?:about )?\d{2}:\d{2}(?:[–-]\d{2}:\d{2})?(?: UTC)?)?", head)
    commit = re.search(r"commit `([0-9a-f]{7,40})`", head)
    machine = re.search(r"the 2-core machine[^,.:;]*", head)
    if not (date and commit and machine):
        raise ValueError(f"the section does not state its date, commit and machine: {head[:200]!r}")
    return {"date": date.group(0), "commit": commit.group(1), "machine": machine.group(0)}


def markdown_table(section: str, column: str) -> list[dict[str, str]]:
    """The rows of the first table in ``section`` that has a column headed ``column``, as dicts."""
    lines = section.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and column in cells:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (c.strip().strip("*") for c in row.strip().strip("|").split("|")))))
            return rows
    raise ValueError(f"no table with a column {column!r}")


def doc_measured_step_times(path: str | Path = DOC, section: str = DOC_SECTION,
                            column: str = DOC_COLUMN) -> tuple[dict[str, float], str]:
    """``{strategy: ms}`` from the ``column`` of the table in ``section`` of docs/benchmarks.md, and a
    description of the source (the section's date, commit and machine)."""
    sec = doc_section(Path(path).read_text(), section)
    rows = markdown_table(sec, column)
    prov = section_provenance(sec)
    times = {r["strategy"]: float(r[column]) for r in rows}
    return times, (f"docs/benchmarks.md §{section} ({prov['date']}, commit {prov['commit']}, {prov['machine']}), "
                   f"{column} column")


def measured_step_times(path: str | None) -> tuple[dict[str, float], str]:
    if path:
        import json

        data = json.loads(Path(path).read_text())
        return ({r["name"]: r["median_s"]["jaxpar"] * 1e3 for r in data["results"]},
                f"{path} ({data['env'].get('date', '?')}, commit {data['env'].get('git', '?')})")
    return doc_measured_step_times()


def rank_correlations(pred: dict, measured: dict) -> tuple[float, float]:
    """Spearman's rho of the predicted step times against the measured ones, and the same without the
    cost model's elementwise term (the predicted total minus ``elementwise_s``)."""
    names = [n for n in pred if n in measured]
    m = [measured[n] for n in names]
    return (spearman([pred[n]["step_s"] for n in names], m),
            spearman([pred[n]["step_s"] - pred[n]["elementwise_s"] for n in names], m))


def load_preset(preset: str | Path = DEFAULT_PRESET):
    from jaxpar import cost

    return cost._cluster.cluster_from_dict(__import__("yaml").safe_load(Path(preset).read_text()), "cpu_sim")


def doc_spearman(preset: str | Path = DEFAULT_PRESET, doc: str | Path = DOC) -> tuple[float, float, str]:
    """Spearman's rho of the ranking that README.md quotes: ``preset``'s predictions against the measured
    step times of docs/benchmarks.md §1; also without the elementwise term, and the source. Measures
    nothing (a few seconds)."""
    measured, source = doc_measured_step_times(doc)
    rho, rho_no_elementwise = rank_correlations(predicted_step_times(load_preset(preset)), measured)
    return rho, rho_no_elementwise, source


# ----------------------------------------------------------------------------- preset
def preset_yaml(env: dict, fits: dict, lf: dict, net: dict, compute: dict, reps: int, load: tuple) -> str:
    L = lf["link"]
    peak8 = compute["peak"] / 1e12
    lines = [
        "# This machine's simulated CPU mesh: 8 XLA CPU devices in one process sharing the machine's cores.",
        "# WRITTEN BY benchmarks/calibrate.py -- re-run it to re-calibrate; do not edit the numbers by hand.",
        "name: cpu_sim",
        f"description: {env['devices']} (jax_num_cpu_devices=8) on a {os.cpu_count()}-core "
        f"{platform.processor() or platform.machine()}, one process",
        "sources:",
        f"  - \"benchmarks/calibrate.py, {env['date']}, jax {env['jax']}, jaxpar @ {env['git']}, "
        f"nproc {env['nproc']}, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min): "
        f"the machine was shared, the numbers are noisy\"",
        f"  - \"link: shared memory (one rendezvous, then each device reads its peers' buffers: one-shot "
        f"collectives); alpha, beta, gamma for which jaxpar.cost.collective_time (best algorithm per size, p = 8) "
        f"is closest to {len(LINK_KINDS) * len(SIZES)} measurements of {len(LINK_KINDS)} collectives x {len(SIZES)} "
        f"sizes (all-to-all left out: its timings were not reproducible; its own fit is under fit:) "
        f"(1 KiB .. 16 MiB per device; robust least squares on log time); median |relative residual| "
        f"{lf['median_rel_residual']:.1%}, max {lf['max_rel_residual']:.1%} (the message-passing algorithms "
        f"of Thakur et al. fit worse: median {net['median_rel_residual']:.1%}, max {net['max_rel_residual']:.1%})\"",
        f"  - \"peak_tflops.float32 and gemm_half_gflop: a [rows,128]x[128,512]x[512,128] fp32 matmul chain on all "
        f"8 devices at once, {compute['8 devices busy, rows 128']['flops_per_s'] / 1e9:.2f} GFLOP/s per device at "
        f"rows 128 and {compute['8 devices busy, rows 1024']['flops_per_s'] / 1e9:.2f} at rows 1024, fitted to "
        f"R w / (w + w_half) (one device alone, rows 1024: "
        f"{compute['1 device alone, rows 1024']['flops_per_s'] / 1e9:.2f} GFLOP/s: see shared_compute); "
        f"efficiency 1.0: the peak is the measured rate\"",
        f"  - \"memory_gbps: x * c + 1 over 32 MiB per device on all 8 devices at once (read + write), "
        f"{compute['memory_bandwidth'] / 1e9:.2f} GB/s per device; shared_compute: the 8 devices share the cores: one "
        f"device alone ran the rows-1024 matmul chain that many times faster than each of 8 busy ones\"",
        "  - \"device_memory_gib: an assumption (the simulated devices share the host's memory)\"",
        "devices_per_node: 8",
        "nodes: 1",
        "device_memory_gib: 3",
        f"peak_tflops: {{float32: {peak8:.6g}}}",
        "efficiency: 1.0",
        f"gemm_half_gflop: {compute['w_half'] / 1e9:.4g}",
        f"memory_gbps: {compute['memory_bandwidth'] / 1e9:.4g}",
        f"shared_compute: {compute['1 device alone, rows 1024']['flops_per_s'] / compute['8 devices busy, rows 1024']['flops_per_s']:.3g}",
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
    for kind, f in fits.items():
        lines.append(f"    {kind}: {[[n, round(t, 1)] for n, t in f['points']]}")
    lines.append("  link_residuals:  # cost model (calibrated link, best algorithm) / measured - 1, per size (all-to-all: not fitted)")
    for kind, r in lf["residuals"].items():
        lines.append(f"    {kind}: {[round(x, 3) for x in r]}")
    return "\n".join(lines) + "\n"


def ranking(cluster, overhead_json: str | None) -> tuple[dict, dict, str, float]:
    """Predict the 11 strategies on ``cluster``, compare with the measured order, print the table."""
    pred = predicted_step_times(cluster)
    measured, source = measured_step_times(overhead_json)
    names = [n for n in pred if n in measured]
    rho, rho_no_elementwise = rank_correlations(pred, measured)
    print(f"\nranking of the {len(names)} strategies (measured: {source}):")
    order_m = sorted(names, key=lambda n: measured[n])
    order_p = sorted(names, key=lambda n: pred[n]["step_s"])
    print(f"  {'strategy':>16}  {'measured ms':>11}  {'rank':>4}  {'predicted ms':>12}  {'rank':>4}  "
          f"{'compute':>8}  {'elementw':>8}  {'data':>7}  {'tensor':>7}  {'update':>7}")
    for n in names:
        q = pred[n]
        print(f"  {n:>16}  {measured[n]:11.2f}  {order_m.index(n) + 1:4d}  {q['step_s'] * 1e3:12.2f}  "
              f"{order_p.index(n) + 1:4d}  {q['compute_s'] * 1e3:8.2f}  {q['elementwise_s'] * 1e3:8.2f}  "
              f"{q['data_s'] * 1e3:7.2f}  {q['tensor_s'] * 1e3:7.2f}  {q['optimizer_s'] * 1e3:7.2f}")
    print(f"  Spearman rho = {rho:.3f} (without the elementwise term: {rho_no_elementwise:.3f})")
    return pred, measured, source, rho


def predict_only(preset: str, overhead_json: str | None, json_out: str | None) -> int:
    """The ranking alone, from a preset already written (nothing is measured)."""
    pred, measured, source, rho = ranking(load_preset(preset), overhead_json)
    write_json(json_out, {"env": environment(), "preset": preset, "predicted": pred, "measured_ms": measured,
                          "measured_source": source, "spearman": rho})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per program pair")
    p.add_argument("--write", default=str(DEFAULT_PRESET),
                   help="preset to write ('' to skip)")
    p.add_argument("--json", help="write measurements and fits here")
    p.add_argument("--overhead-json", help="benchmarks/overhead.py --json output (default: docs/benchmarks.md §1)")
    p.add_argument("--predict-only", action="store_true",
                   help="measure nothing: rank the strategies with --preset against --overhead-json")
    p.add_argument("--preset", default=str(DEFAULT_PRESET),
                   help="the preset --predict-only reads")
    args = p.parse_args(argv)
    if args.predict_only:
        return predict_only(args.preset, args.overhead_json, args.json)

    env = environment()
    load = os.getloadavg()
    print(f"# calibrate  ({env['devices']}, nproc={env['nproc']}, jax {env['jax']}, jaxpar @ {env['git']}, "
          f"load {load[0]:.2f})", flush=True)
    t_all = time.perf_counter()
    print("collectives (time per collective):", flush=True)
    meas = measure_collectives(args.reps)
    print("compute:", flush=True)
    compute = measure_compute(args.reps)
    compute["memory_bandwidth"] = measure_memory(args.reps)
    fits = {kind: linear_fit(rows) for kind, rows in meas.items()}
    print("\nper-collective fit t = alpha + n * beta:")
    for kind, f in fits.items():
        print(f"  {kind:>18}: alpha {f['alpha_us']:8.2f} us  beta {f['beta_ns_per_byte']:7.4f} ns/B "
              f"({1 / max(f['beta_ns_per_byte'], 1e-12):.3f} GB/s)  max |residual| {f['max_rel_residual']:.1%}  "
              f"rms {f['rms_rel_residual']:.1%}")
    lf = link_fit(meas)
    L = lf["link"]
    net = link_fit(meas, shared_memory=False)
    print(f"\n(the message-passing algorithms fitted the same way: alpha {net['link'].alpha * 1e6:.2f} us, "
          f"beta {net['link'].beta * 1e9:.4f} ns/B; |residual| median {net['median_rel_residual']:.1%}, max "
          f"{net['max_rel_residual']:.1%}; not used)")
    print(f"\nlink for the cost model: alpha {L.alpha * 1e6:.2f} us, beta {L.beta * 1e9:.4f} ns/B "
          f"({1 / L.beta / 1e9:.3f} GB/s), gamma {L.gamma * 1e9:.4f} ns/B; |residual| median "
          f"{lf['median_rel_residual']:.1%}, max {lf['max_rel_residual']:.1%}; algorithms chosen: {lf['algorithms']}")
    load_end = os.getloadavg()
    text = preset_yaml(env, fits, lf, net, compute, args.reps, load_end)
    if args.write:
        Path(args.write).write_text(text)
        print(f"\nwrote {args.write}")

    from jaxpar import cost

    cluster = cost._cluster.cluster_from_dict(__import__("yaml").safe_load(text), "cpu_sim")
    pred, measured, source, rho = ranking(cluster, args.overhead_json)
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"env": env, "load": [load, load_end], "measured_us": meas, "fits": fits,
                           "link": {"alpha": L.alpha, "beta": L.beta, "gamma": L.gamma,
                                    "residuals": lf["residuals"]},
                           "compute_flops": compute, "predicted": pred, "measured_ms": measured,
                           "measured_source": source, "spearman": rho})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
