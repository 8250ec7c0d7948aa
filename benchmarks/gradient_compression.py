"""Compressed gradient exchange: bytes on the wire, codec cost, step time, and where it pays.

Per codec, on the quickstart-sized GPT over 8 simulated CPU devices (DP8, one exchange per step):

* **wire bytes per step** each device sends, from the codec's plan and read back from the
  compiled step's data-axis collectives (ring algorithms), and the ratio to the fp32 exchange;
* **encode + decode** time of the whole gradient on one device (jitted, median);
* **step time** against the uncompressed step (DP8, XLA's all-reduce), rotated rounds, the
  median per-round ratio (these machines are noisy: ratios are taken in one run);
* **modelled exchange time** for the same codec on GPT-2 124M (ψ = 124M fp32 gradients) over
  8 and 64 workers at 10 and 100 Gb/s, from the α-β formulas of :mod:`jaxpar.cost._collectives`
  (α = 10 µs; ring all-reduce / all-gather, pairwise all-to-all), against the fp32 ring all-reduce.
  The codec's own compute is not in it: on an accelerator it is a few passes over the gradient.

Usage::

    python benchmarks/gradient_compression.py --steps 3 --reps 7 [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives
from jaxpar.analysis import trip_counts
from jaxpar.parallel.compression import cast, onebit, powersgd, qsgd, randomk, sign, terngrad, topk
from jaxpar.cost import Link
from jaxpar.cost._collectives import time as coll_time
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.step import compression_plan

from _common import copy_state, environment, make_batch, markdown_table, write_json

CFG = GPTConfig(vocab=256, seq_len=64, embed=128, heads=4, layers=4)
CODECS = {"none": None, "cast-bf16": cast("bfloat16"), "cast-fp8": cast("float8_e4m3fn"), "qsgd-int8": qsgd(),
          "terngrad": terngrad(), "sign (EF)": sign(), "onebit (EF)": onebit(), "topk 1%": topk(0.01),
          "topk 1% partitioned": topk(0.01, partitioned=True), "randomk 1%": randomk(0.01),
          "powersgd r4": powersgd(rank=4)}
_SENT = {"all-reduce": lambda b, n: 2 * (n - 1) / n * b, "all-gather": lambda b, n: (n - 1) / n * b,
         "all-to-all": lambda b, n: (n - 1) / n * b, "reduce-scatter": lambda b, n: (n - 1) * b}
GPT2_PARAMS = 124_439_808


def compiled_wire_bytes(step, state, batch, mesh) -> float:
    """Bytes each device sends per step over ``data``, collectives in loops counted per trip."""
    compiled = step.lower(state, batch).compile()
    trips = trip_counts(compiled.as_text())
    return sum(_SENT[c.kind](c.bytes, 8) * trips.get(c.computation, 1)
               for c in collectives(compiled, mesh) if c.axes and "data" in c.axes)


def codec_seconds(codec, n: int, reps: int = 5) -> float:
    """Median time of encode + decode of ``n`` values on one device (jitted)."""
    if codec is None:
        return 0.0
    plan = jaxpar.parallel.compression.exchange_plan(codec, [(n,)], dims=[None], grad_axes=[()], stacked=[False],
                                            mesh_sizes={"data": 8})
    x = jax.random.normal(jax.random.key(0), (plan.flat_size,))
    if codec.kind == "quantize":
        f = jax.jit(lambda x, k: codec.decode(codec.encode(x.reshape(8, -1), k)))
    elif codec.kind == "sparse":
        f = jax.jit(lambda x, k: codec.decode(codec.encode(x, k), x.shape[0]))
    else:
        mat = (1, 8, plan.flat_size // 8)
        q = codec.init_q(jax.random.key(1), (*mat, codec.rank))
        f = jax.jit(lambda x, k: codec.compress([x.reshape(mat)], [q], [], lambda v: v)[0][0])
    key = jax.random.key(1)
    jax.block_until_ready(f(x, key))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, key))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def modelled_seconds(codec, workers: int, gbit: float) -> float:
    """α-β time of one exchange of GPT-2 124M's gradients (see the module docstring)."""
    link = Link.from_bandwidth(alpha=10e-6, bandwidth=gbit * 1e9 / 8)
    n = GPT2_PARAMS
    if codec is None:
        return coll_time("all-reduce", 4 * n, workers, link, "ring")
    if codec.kind == "quantize":
        k = codec.padded(n, workers) // workers
        row = codec.row_bytes(k)
        return (coll_time("all-to-all", workers * row, workers, link, "pairwise")
                + coll_time("all-gather", workers * row, workers, link, "ring"))
    if codec.kind == "sparse":
        k = codec.k(n, replicas=workers)
        if codec.name == "randomk":
            return coll_time("all-reduce", 4 * k, workers, link, "ring")
        if codec.partitioned:       # the indices, then every replica's values at all N k of them
            return (coll_time("all-gather", workers * 4 * k, workers, link, "ring")
                    + coll_time("all-reduce", 4 * workers * k, workers, link, "ring"))
        return coll_time("all-gather", workers * 8 * k, workers, link, "ring")
    # PowerSGD on GPT-2's matrices: 12 layers of 768x2304, 768x768, 768x3072, 3072x768, the 50257x768 embedding
    mats = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12 + [(50257, 768)]
    p = sum(m * codec.rank for m, _ in mats)
    q = sum(n_ * codec.rank for _, n_ in mats)
    rest = n - sum(a * b for a, b in mats)
    return (coll_time("all-reduce", 4 * (p + rest), workers, link, "ring")
            + coll_time("all-reduce", 4 * q, workers, link, "ring"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default="")
    ap.add_argument("--only", default="", help="comma-separated codec names (the uncompressed one always runs)")
    args = ap.parse_args()
    codecs = {n: c for n, c in CODECS.items() if n == "none" or not args.only or n in args.only.split(",")}
    mesh = jaxpar.make_mesh({"data": 8})
    tx = optax.adamw(1e-3)
    batch = jaxpar.shard_batch(make_batch(CFG, args.batch), mesh)
    steps, states, rows = {}, {}, {}
    for name, codec in codecs.items():
        strategy = jaxpar.Strategy(compression=codec)
        state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
        step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
        n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
        if codec is None:           # the fp32 ring all-reduce XLA runs (per layer, inside the layer loop)
            planned = 2 * 7 / 8 * 4 * n_params
            fp32 = planned
        else:
            plan = compression_plan(codec, layout, 0)
            planned, fp32 = plan.wire_bytes(), plan.uncompressed_bytes()
        rows[name] = {"planned_bytes": planned, "compiled_bytes": compiled_wire_bytes(step, state, batch, mesh),
                      "ratio": planned / fp32, "codec_ms": 1e3 * codec_seconds(codec, n_params),
                      "modelled_ms": {f"{w}w@{g}G": 1e3 * modelled_seconds(codec, w, g)
                                      for w in (8, 64) for g in (10, 100)}}
        s, m = step(copy_state(state), batch)
        jax.block_until_ready(m)
        steps[name], states[name] = step, s
    names = list(codecs)
    samples = {n: [] for n in names}
    ratios = {n: [] for n in names}
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        now = {}
        for n in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[n], m = steps[n](states[n], batch)
            jax.block_until_ready(m)
            now[n] = (time.perf_counter() - t0) / args.steps
            samples[n].append(now[n])
        for n in names:
            ratios[n].append(now[n] / now["none"])
    for n in names:
        rows[n]["step_ms"] = 1e3 * statistics.median(samples[n])
        rows[n]["step_ratio"] = statistics.median(ratios[n])
    print(environment())
    print(f"GPT {CFG}, {n_params:,} parameters, DP8, batch {args.batch}")
    table = [[n, f"{r['planned_bytes'] / 1024:,.0f}", f"{r['compiled_bytes'] / 1024:,.0f}", f"{r['ratio']:.4f}",
              f"{r['codec_ms']:.2f}", f"{r['step_ms']:.1f}", f"{r['step_ratio']:.2f}",
              *(f"{v:.1f}" for v in r["modelled_ms"].values())] for n, r in rows.items()]
    print(markdown_table(["codec", "wire KiB/step (plan)", "wire KiB/step (compiled)", "vs fp32",
                          "encode+decode ms", "step ms (CPU)", "step / uncompressed",
                          *(f"124M exchange ms {k}" for k in rows["none"]["modelled_ms"])], table))
    write_json(args.json, {"env": environment(), "model": str(CFG), "batch": args.batch, "results": rows})


if __name__ == "__main__":
    main()
