"""Mixture of experts on the 8 simulated CPU devices: step time of expert parallelism 1/2/4/8 against
the cost model, and convergence of an MoE GPT against the dense GPT with the same active parameters.

**Speed.** The GPT (embed 64, 4 heads, 2 layers, every MLP an MoE layer of 8 experts of hidden 128,
top-2, capacity factor 1.25, 128 tokens, 32 sequences per step, fp32, SGD) on ``expert=E x data=8/E``
for E = 1, 2, 4, 8: the median step time over ``--reps`` rounds in which the four meshes run in turn
(ratios to E = 1 taken within each round: the machine is noisy), beside the cost model's prediction
(``jaxpar.cost._planner.evaluate`` on the cpu_sim cluster) and the compiled step's all-to-all bytes.

**The loads pass.** The exact balancing loss with 4 micro-batches (accumulation on data 2 x expert 4,
and 1F1B on pipe 2 x expert 2 x data 2) runs a forward pass over the micro-batches first: the step
time with the aux loss against aux 0 (no pass), as the median of per-round ratios.

**The dispatch** (``--baseline``, default ``e46ff18``: the dense one-hot dispatch, its
``jaxpar/parallel/moe/_dispatch.py`` loaded from git into this process in place of today's): the GPT
(embed 128, 4 heads, 2 layers unrolled, 32 experts of hidden 256, top-4, 32 x 256 tokens, fp32, SGD)
on ``data 2 x expert 4``, dropless and at capacity 1.25, against its dense twin (the same GPT with a
dense MLP of hidden 4 x 256, on ``data 8``: the same tokens per device): each compiled step's GEMM FLOPs per device
(:func:`jaxpar.analysis.dot_flops`; a tile loop's trips are known only at run time, so its FLOPs per
trip are counted ``rows / tile + E / E_p`` times, ``rows`` = the device's mean kept rows from the step's
drop rate: the most its tiles can be; the exchange's further rounds are not counted: at ``S = 1.25 x``
the mean rows a peer, none runs here), its temporaries, and the step time as the median of per-round
ratios to the twin's.

**Deviceless on ``h100:1x8``** (``--h100``): the same comparison compiled by the GPU compiler for a
Qwen3-30B-A3B-shaped GPT (embed 2048, 16 heads, 128 experts of hidden 768, top-8, dropless, 2 layers,
8 x 2048 tokens, bf16) on ``expert 8``, beside its dense twin (MLP 8 x 768) on ``data 8``: GEMM FLOPs
per device (tiles of 128 rows) and temporaries.

**Convergence.** ``jaxpar train configs/quickstart.yaml`` (``--steps``, the same batches and tokens)
for the dense GPT (MLP hidden 512), the MoE GPT (8 experts of hidden 256, top-2: 2 x 256 = 512 active
MLP hidden per token, the dense GPT's; capacity factor ``--capacity``) with the load-balancing loss
(weight 0.01), the same without it (weight 0), and without it balanced by the aux-loss-free router bias
(rate 0.001 and 0.01), on ``data=2 x expert=4``: the final eval loss, the load CV over the first and
last 25 steps, and the mean drop rate.

Usage::

    python benchmarks/moe.py [--reps 5] [--steps 300] [--capacity 1.25 | null] [--skip-speed]
        [--skip-loads-pass] [--skip-convergence] [--skip-dispatch] [--baseline COMMIT] [--h100] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import contextlib
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives, tile_loop_flops
from jaxpar.batch import batch_sharding
from jaxpar.cost import load_cluster
from jaxpar.cost import gpt
from jaxpar.cost import Plan
from jaxpar.cost import evaluate
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.models import MoESettings
from jaxpar.parallel.moe import _layer as moe_layer
from jaxpar.parallel.moe import tile_rows

from _common import environment, markdown_table, quickstart_run, write_json

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "cpu_sim.yaml"
SEQ, ROWS, EMBED, HEADS, LAYERS, EXPERT_MLP, EXPERTS = 128, 32, 64, 4, 2, 128, 8


def _step(ep: int, axes: dict | None = None, strategy: jaxpar.Strategy | None = None, aux: float = 0.01):
    moe = MoESettings(experts=EXPERTS, top_k=2, capacity_factor=1.25, aux_weight=aux)
    cfg = GPTConfig(vocab=256, seq_len=SEQ, embed=EMBED, heads=HEADS, layers=LAYERS, mlp=EXPERT_MLP, moe=moe)
    mesh = jaxpar.make_mesh(axes or {"data": 8 // ep, "expert": ep}, devices=jax.devices()[:8])
    tx = optax.sgd(1e-3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout)
    t = np.random.default_rng(0).integers(0, 256, (ROWS, SEQ + 1)).astype(np.int32)
    batch = jaxpar.shard_batch({"tokens": t[:, :-1], "targets": t[:, 1:]}, mesh)
    a2a = [c for c in collectives(step.lower(state, batch).compile().as_text(), mesh)
           if c.kind == "all-to-all" and c.axes and "expert" in c.axes]
    return [step, state, batch, sum(c.bytes for c in a2a), len(a2a)]


def _timed(runs: dict, reps: int) -> dict:
    """Each run's step times over ``reps`` rounds (the runs in turn each round, after a warm-up round)."""
    times = {k: [] for k in runs}
    for _ in range(reps + 1):                      # the first round warms up
        for k, run in runs.items():
            t = time.perf_counter()
            run[1], metrics = run[0](run[1], run[2])
            jax.block_until_ready(metrics["loss"])
            times[k].append(time.perf_counter() - t)
    return {k: v[1:] for k, v in times.items()}


def loads_pass(reps: int) -> list[dict]:
    """What the exact balancing loss costs when a step splits its batch: 4 micro-batches on data 2 x
    expert 4 (accumulation: a forward pre-pass) and on pipe 2 x expert 2 x data 2 (1F1B: a forward sweep
    through the stages), each with the aux loss (the pass runs) against aux 0 (it does not)."""
    meshes = {"accumulation, data 2 x expert 4": ({"data": 2, "expert": 4}, jaxpar.Strategy(microbatches=4)),
              "1F1B, pipe 2 x expert 2 x data 2": ({"pipe": 2, "data": 2, "expert": 2},
                                                   jaxpar.Strategy(microbatches=4, schedule="1f1b"))}
    runs = {(name, aux): _step(0, axes, strategy, aux) for name, (axes, strategy) in meshes.items() for aux in (0.01, 0.0)}
    times = _timed(runs, reps)
    return [{"mesh": name, "with_pass_ms": 1e3 * statistics.median(times[(name, 0.01)]),
             "without_ms": 1e3 * statistics.median(times[(name, 0.0)]),
             "ratio": statistics.median(a / b for a, b in zip(times[(name, 0.01)], times[(name, 0.0)]))}
            for name in meshes]


def speed(reps: int, cluster) -> list[dict]:
    eps = (1, 2, 4, 8)
    runs = {ep: _step(ep) for ep in eps}
    times = _timed(runs, reps)
    spec = gpt(LAYERS, EMBED, HEADS, SEQ, 256, ROWS, experts=EXPERTS, top_k=2, capacity_factor=1.25,
               expert_mlp=EXPERT_MLP)
    rows = []
    for ep in eps:
        predicted = evaluate(spec, Plan(data=8 // ep, expert=ep), cluster, dtype="float32", precision="fp32").time.total
        ratio = [a / b for a, b in zip(times[ep], times[1])]
        rows.append({"expert": ep, "step_ms": 1e3 * statistics.median(times[ep]),
                     "vs_ep1": statistics.median(ratio), "predicted_ms": 1e3 * predicted,
                     "a2a_bytes": runs[ep][3], "a2a_count": runs[ep][4]})
    pred1 = rows[0]["predicted_ms"]
    for r in rows:
        r["predicted_vs_ep1"] = r["predicted_ms"] / pred1
    return rows


def _baseline_dispatch(commit: str):
    """The ``dispatch_combine`` of ``commit``'s ``jaxpar/parallel/moe/_dispatch.py`` (it imports today's
    jaxpar modules, whose names it shares)."""
    text = subprocess.run(["git", "show", f"{commit}:jaxpar/parallel/moe/_dispatch.py"], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_dispatch.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_dispatch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dispatch_combine


@contextlib.contextmanager
def _dispatching(fn):
    """Trace the MoE layers with ``fn`` as their dispatch (None: today's)."""
    saved = moe_layer.dispatch_combine
    moe_layer.dispatch_combine = fn or saved
    try:
        yield
    finally:
        moe_layer.dispatch_combine = saved


DISPATCH = dict(seq=256, rows=32, embed=128, heads=4, layers=2, mlp=256, experts=32, top_k=4,
                axes={"data": 2, "expert": 4})


def _dispatch_step(capacity, dense: bool, baseline=None) -> dict:
    """One compiled step of the dispatch table's GPT (``dense``: its twin), with what it compiles to."""
    d = DISPATCH
    moe = None if dense else MoESettings(experts=d["experts"], top_k=d["top_k"], capacity_factor=capacity)
    cfg = GPTConfig(vocab=256, seq_len=d["seq"], embed=d["embed"], heads=d["heads"], layers=d["layers"],
                    mlp=d["mlp"] * (d["top_k"] if dense else 1), scan_layers=False, moe=moe)
    mesh = jaxpar.make_mesh({"data": 8} if dense else d["axes"], devices=jax.devices()[:8])
    tx = optax.sgd(1e-3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh)
    t = np.random.default_rng(0).integers(0, 256, (d["rows"], d["seq"] + 1)).astype(np.int32)
    batch = jaxpar.shard_batch({"tokens": t[:, :-1], "targets": t[:, 1:]}, mesh)
    with _dispatching(baseline):
        compiled = jaxpar.make_train_step(lm_loss, tx, layout).lower(state, batch).compile()
    text = compiled.as_text()
    state, metrics = compiled(state, batch)
    kept = d["rows"] * d["seq"] * d["top_k"] / 8 * (1 - float(metrics.get("moe/drop_rate", 0.0)))
    tiles = kept / tile_rows(mesh) + d["experts"] / d["axes"]["expert"]
    other, per_trip = tile_loop_flops(text)         # the further rounds run 0 times here
    flops = other + tiles * per_trip
    return {"run": [compiled, state, batch], "flops": flops,
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "a2a": sum(c.bytes for c in collectives(text, mesh) if c.kind == "all-to-all")}


def dispatch(reps: int, baseline: str) -> list[dict]:
    """The dispatch table (the module docstring): sorted against the baseline's dense dispatch."""
    old = _baseline_dispatch(baseline)
    runs = {"dense twin": _dispatch_step(None, True)}
    for cf in (None, 1.25):
        name = "dropless" if cf is None else f"capacity {cf}"
        runs[f"{name}, sorted"] = _dispatch_step(cf, False)
        runs[f"{name}, dense dispatch ({baseline})"] = _dispatch_step(cf, False, old)
    times = _timed({k: r["run"] for k, r in runs.items()}, reps)
    twin = runs["dense twin"]
    return [{"run": k, "flops_vs_twin": r["flops"] / twin["flops"], "temp_vs_twin": r["temp"] / twin["temp"],
             "temp_mib": r["temp"] / 2 ** 20, "a2a_mib": r["a2a"] / 2 ** 20,
             "step_ms": 1e3 * statistics.median(times[k]),
             "time_vs_twin": statistics.median(a / b for a, b in zip(times[k], times["dense twin"]))}
            for k, r in runs.items()]


QWEN3 = dict(seq=2048, rows=8, embed=2048, heads=16, mlp=768, experts=128, top_k=8, layers=2)


def _h100_step(dense: bool, baseline=None) -> dict:
    """The Qwen3-shaped step compiled for ``h100:1x8`` (``dense``: its twin): GEMM FLOPs and temporaries."""
    from jaxpar.devices import parse_target, target_devices
    q = QWEN3
    moe = None if dense else MoESettings(experts=q["experts"], top_k=q["top_k"], capacity_factor=None)
    cfg = GPTConfig(vocab=256, seq_len=q["seq"], embed=q["embed"], heads=q["heads"], layers=q["layers"],
                    mlp=q["mlp"] * (q["top_k"] if dense else 1), scan_layers=False, moe=moe)
    mesh = jaxpar.make_mesh({"data": 8} if dense else {"expert": 8}, devices=target_devices(parse_target("h100:1x8")))
    strategy, tx = jaxpar.Strategy(compute_dtype="bfloat16"), optax.sgd(1e-3)
    layout = jaxpar.state_layout(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    tokens = jax.ShapeDtypeStruct((q["rows"], q["seq"]), np.int32, sharding=batch_sharding(mesh))
    with _dispatching(baseline):
        compiled = jaxpar.make_train_step(lm_loss, tx, layout, strategy).lower(
            layout.abstract_state(), {"tokens": tokens, "targets": tokens}).compile()
    text = compiled.as_text()
    tiles = q["rows"] * q["seq"] * q["top_k"] / 8 / tile_rows(mesh) + q["experts"] / 8
    other, per_trip = tile_loop_flops(text)
    return {"flops": other + tiles * per_trip, "temp": compiled.memory_analysis().temp_size_in_bytes}


def h100(baseline: str) -> list[dict]:
    """The deviceless table (the module docstring)."""
    runs = {"dense twin": _h100_step(True), "dropless, sorted": _h100_step(False),
            f"dropless, dense dispatch ({baseline})": _h100_step(False, _baseline_dispatch(baseline))}
    twin = runs["dense twin"]
    return [{"run": k, "flops_vs_twin": r["flops"] / twin["flops"], "tflops": r["flops"] / 1e12,
             "temp_vs_twin": r["temp"] / twin["temp"], "temp_gib": r["temp"] / 2 ** 30} for k, r in runs.items()]


def convergence(steps: int, capacity: str) -> list[dict]:
    base = [f"train.steps={steps}", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"]
    moe = ["mesh.expert=4", "model.mlp=256", "model.moe.experts=8", "model.moe.top_k=2",
           f"model.moe.capacity_factor={capacity}"]
    runs = {"dense (mlp 512)": base + ["mesh.data=8"],
            "moe 8x256 top-2, aux 0.01": base + moe + ["model.moe.aux_weight=0.01"],
            "moe 8x256 top-2, aux 0": base + moe + ["model.moe.aux_weight=0.0"],
            "moe 8x256 top-2, bias 0.001 (aux 0)": base + moe + ["model.moe.aux_weight=0.0",
                                                                   "model.moe.bias_rate=0.001"],
            "moe 8x256 top-2, bias 0.01 (aux 0)": base + moe + ["model.moe.aux_weight=0.0",
                                                                  "model.moe.bias_rate=0.01"]}
    rows = []
    for name, overrides in runs.items():
        train, eval_loss = quickstart_run(overrides, name)
        row = {"run": name, "eval_loss": eval_loss, "final_train_loss": float(np.mean([r["loss"] for r in train[-25:]]))}
        if "moe/load_cv" in train[0]:
            row.update(cv_first=float(np.mean([r["moe/load_cv"] for r in train[:25]])),
                       cv_last=float(np.mean([r["moe/load_cv"] for r in train[-25:]])),
                       drop_rate=float(np.mean([r["moe/drop_rate"] for r in train])))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--capacity", default="1.25", help="the MoE runs' capacity factor (null: dropless)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-convergence", action="store_true")
    ap.add_argument("--skip-loads-pass", action="store_true")
    ap.add_argument("--skip-dispatch", action="store_true")
    ap.add_argument("--baseline", default="e46ff18", help="the commit of the dense dispatch to compare with")
    ap.add_argument("--h100", action="store_true", help="the deviceless h100:1x8 table (needs `make targets`)")
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = h100(args.baseline) if args.h100 else []
    if gpu:
        print(markdown_table(["h100:1x8, deviceless", "GEMM TFLOP per device", "vs twin", "temporaries GiB",
                              "vs twin"],
                             [[r["run"], f"{r['tflops']:.2f}", f"{r['flops_vs_twin']:.2f}", f"{r['temp_gib']:.1f}",
                               f"{r['temp_vs_twin']:.2f}"] for r in gpu]))
    table = [] if args.skip_dispatch else dispatch(args.reps, args.baseline)
    if table:
        print(markdown_table(["run", "GEMM FLOPs vs twin", "temporaries vs twin", "temporaries MiB",
                              "all-to-all MiB", "step ms", "step vs twin"],
                             [[r["run"], f"{r['flops_vs_twin']:.2f}", f"{r['temp_vs_twin']:.2f}",
                               f"{r['temp_mib']:.1f}", f"{r['a2a_mib']:.2f}", f"{r['step_ms']:.0f}",
                               f"{r['time_vs_twin']:.2f}"]
                              for r in table]))
    fast = [] if args.skip_speed else speed(args.reps, load_cluster(CLUSTER))
    print(environment())
    if fast:
        print(markdown_table(["expert x data", "step ms", "vs EP1", "predicted ms", "predicted vs EP1",
                              "all-to-alls", "all-to-all MiB"],
                             [[f"{r['expert']} x {8 // r['expert']}", f"{r['step_ms']:.0f}", f"{r['vs_ep1']:.2f}",
                               f"{r['predicted_ms']:.1f}", f"{r['predicted_vs_ep1']:.2f}", r["a2a_count"],
                               f"{r['a2a_bytes'] / 2 ** 20:.2f}"] for r in fast]))
    passes = [] if args.skip_loads_pass else loads_pass(args.reps)
    if passes:
        print(markdown_table(["4 micro-batches on", "aux 0.01 (with the loads pass) ms", "aux 0 ms", "ratio"],
                             [[r["mesh"], f"{r['with_pass_ms']:.0f}", f"{r['without_ms']:.0f}", f"{r['ratio']:.2f}"]
                              for r in passes]))
    conv = [] if args.skip_convergence else convergence(args.steps, args.capacity)
    if conv:
        fmt = lambda r, k, f: format(r[k], f) if k in r else "-"    # noqa: E731
        print(markdown_table(["run", "eval loss", "train loss (last 25)", "load CV (first 25)", "load CV (last 25)",
                              "drop rate"],
                             [[r["run"], f"{r['eval_loss']:.4f}", f"{r['final_train_loss']:.4f}", fmt(r, "cv_first", ".3f"),
                               fmt(r, "cv_last", ".3f"), fmt(r, "drop_rate", ".4f")] for r in conv]))
    write_json(args.json, {"environment": environment(), "dispatch": table, "h100": gpu, "speed": fast, "loads_pass": passes, "convergence": conv})


if __name__ == "__main__":
    main()
