"""Step-time cost of measuring the gradient noise scale every 10 steps (target: at most 2 %).

For each strategy (8 simulated CPU devices) three steps train the same GPT from copies of the
same sharded state on the same sharded batch:

* ``plain``: ``jaxpar.make_train_step`` on the state without the noise-scale part (no measurement);
* ``every10``: the state with ``with_noise_scale(state, layout, every=10)``: the measuring program on
  one step in ten;
* ``every1``: ``with_noise_scale(..., every=1)``: the measuring program alone (its own cost per step).

Timing: compile and warm up all three (a full cycle of 10 steps each), then ``--reps`` rounds;
in each round every variant runs ``--steps`` steps (a multiple of 10, so each block holds the
same number of measuring steps) back to back, order rotated each round, ``block_until_ready``
at the end of a block. The per-step time of a block is one sample; the table shows the median
of each variant and the median over rounds of the per-round ratio ``variant / plain`` (paired
within a round, so slow drifts of a shared machine cancel). The amortised prediction is
``1 + (every1 / plain - 1) / 10``. XLA's cost analysis of the two compiled programs (FLOPs and
bytes accessed per device) gives the same comparison without timing noise.

Usage::

    python benchmarks/noise_scale.py --reps 15 [--only DP8] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time

import jax

import jaxpar
from jaxpar.models import lm_loss
from jaxpar.step import with_noise_scale

from _common import STRATEGIES, GPTConfig, build, copy_state, environment, make_batch, markdown_table, write_json

VARIANTS = ("plain", "every10", "every1")
EVERY = {"plain": None, "every10": 10, "every1": 1}
BENCHED = ("DP8", "ZeRO-2 (data=8)", "ZeRO-3 (data=8)", "DP2xFSDP2xTP2")


def bench_strategy(bs, cfg, batch_size, steps, reps):
    mesh, strategy, state, layout, tx = build(cfg, bs)
    parts = {v: with_noise_scale(state, layout, every=EVERY[v]) if EVERY[v] else (state, layout) for v in VARIANTS}
    batch = jaxpar.shard_batch(make_batch(cfg, batch_size), mesh)
    fns = {v: jaxpar.make_train_step(lm_loss, tx, parts[v][1], strategy) for v in VARIANTS}
    states = {v: copy_state(parts[v][0]) for v in VARIANTS}
    del state, parts
    warm_s = {}
    for v in VARIANTS:
        t0 = time.perf_counter()
        for _ in range(10):          # compiles both programs of every10
            states[v], m = fns[v](states[v], batch)
        jax.block_until_ready((states[v], m))
        warm_s[v] = time.perf_counter() - t0
    samples = {v: [] for v in VARIANTS}
    for r in range(reps):
        k = r % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            s = states[v]
            t0 = time.perf_counter()
            for _ in range(steps):
                s, m = fns[v](s, batch)
            jax.block_until_ready((s, m))
            samples[v].append((time.perf_counter() - t0) / steps)
            states[v] = s
    programs = fns["every10"].programs
    cost = {name: _cost(programs[key].lower(states["every10"], batch).compile())
            for name, key in (("usual", "step"), ("measuring", "measure"))}
    med = {v: statistics.median(samples[v]) for v in VARIANTS}
    ratio = {v: statistics.median(a / p for a, p in zip(samples[v], samples["plain"])) for v in VARIANTS}
    return {"name": bs.name, "mesh": bs.mesh, "zero": bs.zero, "median_s": med, "ratio_vs_plain": ratio,
            "predicted_every10": 1 + (ratio["every1"] - 1) / 10, "warmup_s": warm_s, "samples_s": samples,
            "cost": cost, "flops_ratio": cost["measuring"]["flops"] / cost["usual"]["flops"],
            "bytes_ratio": cost["measuring"]["bytes"] / cost["usual"]["bytes"]}


def _cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program (per device): FLOPs and bytes accessed."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="steps per timed block (a multiple of 10)")
    p.add_argument("--reps", type=int, default=15, help="interleaved rounds (samples per variant)")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--only", default="", help="comma-separated strategy names (default: " + ", ".join(BENCHED) + ")")
    p.add_argument("--json", default=None, help="write all results (incl. raw samples) here")
    args = p.parse_args(argv)
    if args.steps % 10:
        p.error(f"--steps={args.steps}: must be a multiple of 10 (each block then holds the same measuring steps)")

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq, embed=args.embed, heads=args.heads, layers=args.layers)
    only = {s.strip() for s in args.only.split(",") if s.strip()} or set(BENCHED)
    env = environment()
    print(f"# noise-scale measurement cost  ({env['devices']}, nproc={env['nproc']}, jax {env['jax']}, "
          f"jaxpar @ {env['git']})")
    print(f"# GPT {cfg}; global batch {args.batch}; {args.steps} steps/block x {args.reps} interleaved rounds",
          flush=True)
    results = []
    for bs in STRATEGIES:
        if bs.name not in only:
            continue
        t0 = time.perf_counter()
        r = bench_strategy(bs, cfg, args.batch, args.steps, args.reps)
        results.append(r)
        m, q = r["median_s"], r["ratio_vs_plain"]
        print(f"{bs.name:>16}: plain {m['plain'] * 1e3:7.2f} ms  every10 {m['every10'] * 1e3:7.2f} ms "
              f"(x{q['every10']:.4f})  every1 {m['every1'] * 1e3:7.2f} ms (x{q['every1']:.3f}; predicted every10 "
              f"x{r['predicted_every10']:.4f}; XLA cost of the measuring program: FLOPs x{r['flops_ratio']:.4f}, "
              f"bytes x{r['bytes_ratio']:.4f})  [{time.perf_counter() - t0:.0f} s]", flush=True)
    headers = ["strategy", "plain ms/step", "every 10 ms/step", "every 10 / plain", "every 1 (measuring) ms/step",
               "measuring / plain", "predicted every 10 / plain", "measuring / usual FLOPs (XLA)",
               "measuring / usual bytes (XLA)"]
    rows = [[r["name"], f"{r['median_s']['plain'] * 1e3:.2f}", f"{r['median_s']['every10'] * 1e3:.2f}",
             f"{r['ratio_vs_plain']['every10']:.4f}", f"{r['median_s']['every1'] * 1e3:.2f}",
             f"{r['ratio_vs_plain']['every1']:.3f}", f"{r['predicted_every10']:.4f}", f"{r['flops_ratio']:.4f}",
             f"{r['bytes_ratio']:.4f}"] for r in results]
    print()
    print(markdown_table(headers, rows))
    write_json(args.json, {"env": env, "config": vars(args), "results": results})


if __name__ == "__main__":
    main()
