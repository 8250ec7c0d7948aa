"""PipeDream-2BW without flushes vs flushed 1F1B and flushed 2BW: time per optimizer step.

At p=4 stages x DP2 on 8 simulated CPU devices, the GPT of ``benchmarks/pipeline.py`` (vocab
256, seq 64, embed 128, 4 heads, 8 layers, AdamW, 8 rows per micro-batch), the same ``m``:

* ``1f1b``: the flushed 1F1B step, one optimizer step per call (``2m + 2(p-1)`` ticks);
* ``2bw (flush)``: ``make_train_step`` with ``schedule='pipedream-2bw'``, one step per call
  (the same ticks as 1F1B, one more weight version);
* ``2bw (no flush, K)``: ``steps_per_call=K``: ``K`` optimizer steps in one program,
  ``2Km + 2(p-1)`` ticks in all (``2m`` per step after the first);
* ``stashing (K, k=m)``: PipeDream weight stashing (``schedule='pipedream'``) on the same
  no-flush table, each stage updating after every ``m`` of its backwards (one update per
  optimizer step, as 1F1B), ``K`` steps per call.

``ms / step`` is the median over rounds of a call's time divided by its optimizer steps; ``vs
1F1B`` the median over rounds of the paired ratio to 1F1B timed in the same round (the variants
run interleaved, in a rotating order). Every variant runs ``K`` optimizer steps per round.

Usage::

    python benchmarks/pipeline_2bw.py [--reps 5] [--k 4] [--ms 4,8] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxpar
from jaxpar.mesh import batch_axes
from jaxpar.models import lm_loss
from jaxpar.parallel.pipeline import pipedream, pipedream_2bw
from jaxpar.parallel.pipeline._schedules import num_ticks

from _common import GPTConfig, environment, make_batch, make_tx, markdown_table, write_json


def _variants(cfg, m, k, rows, p=4):
    mesh = jaxpar.make_mesh({"pipe": p, "data": 8 // p})
    tx = make_tx()
    batches = [make_batch(cfg, m * rows, seed=s) for s in range(k)]
    one = [jaxpar.shard_batch(b, mesh) for b in batches]
    stacked = jax.device_put(jax.tree.map(lambda *b: np.stack(b), *batches),
                             NamedSharding(mesh, PartitionSpec(None, batch_axes(mesh) or None)))
    out = {}
    for name, schedule, per_call in (("1f1b", "1f1b", 1), ("2bw (flush)", "pipedream-2bw", 1),
                                     (f"2bw (no flush, K={k})", "pipedream-2bw", k),
                                     (f"stashing (K={k}, k=m)", "pipedream", k)):
        extra = {"update_every": m} if schedule == "pipedream" else {}
        strategy = jaxpar.Strategy(microbatches=m, schedule=schedule, **extra)
        state, layout = jaxpar.init_train_state(lambda: _common.GPT(cfg, rngs=_common.nnx.Rngs(0)), tx, mesh,
                                                strategy)
        step = jaxpar.make_train_step(lm_loss, tx, layout, strategy, steps_per_call=per_call)
        ticks = num_ticks((pipedream if schedule == "pipedream" else pipedream_2bw)(p, m, per_call))
        out[name] = dict(step=step, state=state, per_call=per_call, ticks=ticks,
                         inputs=[stacked] if per_call > 1 else one)
    return out


def _round(v):
    """``K`` optimizer steps of variant ``v``; returns seconds per optimizer step."""
    t = time.perf_counter()
    for b in v["inputs"]:
        v["state"], metrics = v["step"](v["state"], b)
    jax.block_until_ready(metrics["loss"])
    return (time.perf_counter() - t) / (len(v["inputs"]) * v["per_call"])


def bench(cfg, m, k, rows, reps):
    variants = _variants(cfg, m, k, rows)
    for name, v in variants.items():
        t = time.perf_counter()
        compiled = v["step"].lower(v["state"], v["inputs"][0]).compile()
        v["compile_s"], v["temp"] = time.perf_counter() - t, compiled.memory_analysis().temp_size_in_bytes
        _round(v)                      # warm up
    names, times = list(variants), {n: [] for n in variants}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_round(variants[name]))
    out = []
    for name, v in variants.items():
        ratio = statistics.median(a / b for a, b in zip(times[name], times["1f1b"]))
        out.append({"variant": name, "m": m, "ms_per_step": statistics.median(times[name]) * 1e3,
                    "vs_1f1b": ratio, "ticks_per_step": v["ticks"] / v["per_call"], "temp": v["temp"],
                    "compile_s": v["compile_s"], "times": times[name]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="optimizer steps per call of the no-flush program")
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--ms", default="4,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=256, seq_len=64, embed=128, heads=4, layers=8)
    print(environment())
    results = []
    for m in map(int, args.ms.split(",")):
        results += bench(cfg, m, args.k, args.rows, args.reps)
        print(f"m={m} done", flush=True)
    headers = ["variant", "m", "ms / optimizer step", "vs 1F1B (paired)", "ticks / step", "temp MiB", "compile s"]
    print(markdown_table(headers, [[r["variant"], r["m"], f"{r['ms_per_step']:.0f}", f"{r['vs_1f1b']:.3f}",
                                    f"{r['ticks_per_step']:g}", f"{r['temp'] / 2**20:.1f}", f"{r['compile_s']:.1f}"]
                                   for r in results]))
    write_json(args.json, {"env": environment(), "results": results})


if __name__ == "__main__":
    main()
