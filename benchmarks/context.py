"""Context parallelism on the 8 simulated CPU devices: step time of ring vs all-gather vs Ulysses by
sequence length, the compiled temporaries against one device's, and the planner's ranking.

For each sequence length T, the GPT (embed 64, 8 heads, 2 layers, vocab 256, one sequence per step,
fp32, SGD) is compiled

* on one device (``data=1``): only its temporaries (``memory_analysis``), against the cpu_sim
  cluster's per-device memory budget (``configs/clusters/cpu_sim.yaml``: 3 GiB);
* on ``context=8`` with each method (ring and all-gather balanced, Ulysses in the natural order):
  temporaries, and the median step time over ``--reps`` rounds in which the three methods run in
  turn (the ratios to the ring are taken within each round: the machine is noisy); above
  ``--time-max`` tokens only the ring runs (the others' [T/8, T] or [1, T, T] scores on 8 devices
  would take more host memory than this machine has) and the others are compiled only;
* the planner's predicted step time of each method (``jaxpar.cost._planner.evaluate`` on cpu_sim).

Usage::

    python benchmarks/context.py [--lengths 1024,2048,4096,8192] [--reps 5] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.options import ContextParallel
from jaxpar.cost import load_cluster
from jaxpar.cost import gpt
from jaxpar.cost import Plan
from jaxpar.cost import evaluate
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.strategy import Strategy

from _common import environment, markdown_table, write_json

METHODS = (("ring", True), ("all_gather", True), ("ulysses", False))
CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "cpu_sim.yaml"


def _batch(length: int) -> dict:
    t = np.random.default_rng(0).integers(0, 256, (1, length + 1)).astype(np.int32)
    return {"tokens": t[:, :-1], "targets": t[:, 1:]}


def _step(length: int, axes: dict, strategy: jaxpar.Strategy):
    cfg = GPTConfig(vocab=256, seq_len=length, embed=64, heads=8, layers=2)
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    tx = optax.sgd(1e-3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout)
    batch = jaxpar.shard_batch(_batch(length), mesh)
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    return step, state, batch, temp


def _one_device_temp(length: int) -> int:
    cfg = GPTConfig(vocab=256, seq_len=length, embed=64, heads=8, layers=2)
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    layout = jaxpar.state_layout(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(1e-3), mesh)
    step = jaxpar.make_train_step(lm_loss, optax.sgd(1e-3), layout)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch(length).items()}
    return step.lower(layout.abstract_state(), batch).compile().memory_analysis().temp_size_in_bytes


def bench(length: int, reps: int, cluster, time_max: int) -> list[dict]:
    runs = {}
    for method, balance in METHODS:
        runs[method] = list(_step(length, {"context": 8}, jaxpar.Strategy(context=ContextParallel(method, balance))))
    timed = [m for m in runs if length <= time_max or m == "ring"]     # beyond: compiled only (host memory)
    times = {m: [] for m in runs}
    for _ in range(reps + 1):                      # the first round warms up
        for m in timed:
            run = runs[m]
            step, state, batch, _ = run
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times[m].append(time.perf_counter() - t)
            run[1] = state
    spec = gpt(2, 64, 8, length, 256, 1)
    one = _one_device_temp(length)
    rows = []
    for method, balance in METHODS:
        plan = Plan(context=8, strategy=Strategy(context=ContextParallel(method, balance=balance)))
        predicted = evaluate(spec, plan, cluster,
                             dtype="float32", precision="fp32").time.total
        ratios = [a / b for a, b in zip(times[method][1:], times["ring"][1:])]
        rows.append({"length": length, "method": method,
                     "step_ms": 1e3 * statistics.median(times[method][1:]) if ratios else None,
                     "vs_ring": statistics.median(ratios) if ratios else None, "temp_bytes": runs[method][3], "one_device_temp": one,
                     "predicted_ms": 1e3 * predicted})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-max", type=int, default=4096, help="longer sequences: the ring alone is timed")
    ap.add_argument("--json")
    args = ap.parse_args()
    cluster = load_cluster(CLUSTER)
    budget = cluster.memory_bytes
    rows = [r for n in map(int, args.lengths.split(",")) for r in bench(n, args.reps, cluster, args.time_max)]
    fmt = lambda v, f: "-" if v is None else format(v, f)    # noqa: E731
    table = [[r["length"], r["method"], fmt(r["step_ms"], ".0f"), fmt(r["vs_ring"], ".2f"), f"{r['predicted_ms']:.0f}",
              f"{r['temp_bytes'] / 2 ** 20:.1f}", f"{r['one_device_temp'] / 2 ** 20:.1f}",
              f"{r['one_device_temp'] / r['temp_bytes']:.1f}",
              "yes" if r["temp_bytes"] <= budget else "no", "yes" if r["one_device_temp"] <= budget else "no"]
             for r in rows]
    print(environment())
    print(markdown_table(["T", "method", "step ms", "vs ring", "planner ms", "temp MiB (CP8)", "temp MiB (1 dev)",
                          "1 dev / CP8", "CP8 fits 3 GiB", "1 dev fits"], table))
    write_json(args.json, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
