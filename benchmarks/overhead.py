"""Step-time overhead of jaxpar's train step vs the same step written by hand.

For every strategy (8 simulated CPU devices) four programs train the same GPT
from the same sharded state on the same sharded batch:

* ``hand``:  plain ``jax.jit`` + ``jax.value_and_grad`` + optax with the same
  in/out shardings (``layout.shardings()`` and the batch sharding); the model is
  rebuilt with ``nnx.merge`` under ``jaxpar.use_rules`` so activations get the
  same constraints; data-axis collectives are left to XLA.
* ``hand-grads``: the same, with the gradients also constrained to the
  strategy's gradient layout (``layout.grads``). Only ZeRO-1 differs: without the
  pin XLA shards its gradients like the optimizer state (a ZeRO-2 program).
* ``jaxpar``: ``jaxpar.make_train_step`` with its default ``explicit_dp=None``:
  explicit per-layer data-parallel collectives where
  ``jaxpar.parallel._data_parallel.explicit_by_default`` says so (ZeRO-2/3 / FSDP without
  tensor parallelism), XLA's otherwise.
* ``jaxpar-noexp``: ``make_train_step(..., explicit_dp=False)``.

Timing: compile + warm up all four, then ``--reps`` rounds; in each round
every variant runs ``--steps`` steps back to back (order rotated each round,
``block_until_ready`` at the end of a block). The per-step time of a block is
one sample; the table shows the median sample of each variant and the median
over rounds of the per-round ratio ``variant / hand`` (paired within a round,
so slow drifts of a shared machine cancel).

Usage::

    python benchmarks/overhead.py --steps 2 --reps 30 [--only DP8,TP8] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import sys
import time

import jax

import jaxpar
from jaxpar.analysis import collectives, collectives_table
from jaxpar.models import lm_loss

from _common import STRATEGIES, GPTConfig, build, copy_state, environment, make_batch, make_hand_step, \
    markdown_table, write_json

VARIANTS = ("hand", "hand-grads", "jaxpar", "jaxpar-noexp")


def bench_strategy(bs, cfg, batch_size, steps, reps, warmup, show_hlo):
    mesh, strategy, state, layout, tx = build(cfg, bs)
    batch = jaxpar.shard_batch(make_batch(cfg, batch_size), mesh)
    fns = {
        "hand": make_hand_step(layout, tx),
        "hand-grads": make_hand_step(layout, tx, pin_grads=True),
        "jaxpar": jaxpar.make_train_step(lm_loss, tx, layout, strategy),
        "jaxpar-noexp": jaxpar.make_train_step(lm_loss, tx, layout, strategy, explicit_dp=False),
    }
    states = {v: copy_state(state) for v in VARIANTS}
    del state
    compile_s, colls, losses = {}, {}, {}
    for v in VARIANTS:
        t0 = time.perf_counter()
        compiled = fns[v].lower(states[v], batch).compile()
        compile_s[v] = time.perf_counter() - t0
        colls[v] = collectives(compiled, mesh) if mesh.devices.size > 1 else []
        for _ in range(warmup):
            states[v], metrics = fns[v](states[v], batch)
        jax.block_until_ready((states[v], metrics))
        losses[v] = float(metrics["loss"])   # sanity: all three train the same model

    samples = {v: [] for v in VARIANTS}
    for r in range(reps):
        k = r % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]
        for v in order:
            s = states[v]
            t0 = time.perf_counter()
            for _ in range(steps):
                s, m = fns[v](s, batch)
            jax.block_until_ready((s, m))
            samples[v].append((time.perf_counter() - t0) / steps)
            states[v] = s
    med = {v: statistics.median(samples[v]) for v in VARIANTS}
    ratio = {v: statistics.median(a / h for a, h in zip(samples[v], samples["hand"])) for v in VARIANTS}
    ratio_pinned = {v: statistics.median(a / h for a, h in zip(samples[v], samples["hand-grads"])) for v in VARIANTS}
    hlo = {v: collectives_table(colls[v]) for v in VARIANTS} if colls["hand"] or colls["jaxpar"] else {}
    if show_hlo and hlo:
        for v in VARIANTS:
            print(f"\n[{bs.name}] collectives of {v}:\n{hlo[v]}", flush=True)
    return {
        "name": bs.name, "mesh": bs.mesh, "zero": bs.zero, "sequence_parallel": bs.sequence_parallel,
        "median_s": med, "ratio_vs_hand": ratio, "ratio_vs_hand_grads": ratio_pinned, "ratio_of_medians": {v: med[v] / med["hand"] for v in VARIANTS},
        "samples_s": samples, "compile_s": compile_s, "loss_after_warmup": losses, "collectives": hlo,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2, help="steps per timed block")
    p.add_argument("--reps", type=int, default=30, help="interleaved rounds (samples per variant)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--only", default="", help="comma-separated strategy names to run (default: all)")
    p.add_argument("--hlo", action="store_true", help="print the collectives table of every program")
    p.add_argument("--threshold", type=float, default=1.03, help="flag ratios above this")
    p.add_argument("--json", default=None, help="write all results (incl. raw samples) here")
    args = p.parse_args(argv)

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq, embed=args.embed, heads=args.heads, layers=args.layers)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    env = environment()
    print(f"# jaxpar step overhead  ({env['devices']}, nproc={env['nproc']}, jax {env['jax']}, "
          f"jaxpar @ {env['git']})")
    print(f"# GPT {cfg}; global batch {args.batch}; {args.steps} steps/block x {args.reps} interleaved rounds",
          flush=True)
    results = []
    t_all = time.perf_counter()
    for bs in STRATEGIES:
        if only and bs.name not in only:
            continue
        t0 = time.perf_counter()
        r = bench_strategy(bs, cfg, args.batch, args.steps, args.reps, args.warmup, args.hlo)
        results.append(r)
        m, q = r["median_s"], r["ratio_vs_hand"]
        print(f"{bs.name:>16}: hand {m['hand'] * 1e3:7.2f} ms  hand-grads {m['hand-grads'] * 1e3:7.2f} ms  "
              f"jaxpar {m['jaxpar'] * 1e3:7.2f} ms (x{q['jaxpar']:.3f}, "
              f"x{r['ratio_vs_hand_grads']['jaxpar']:.3f} vs hand-grads)  noexp {m['jaxpar-noexp'] * 1e3:7.2f} ms (x{q['jaxpar-noexp']:.3f})  "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)

    headers = ["strategy", "hand-written ms", "hand-written, gradients pinned ms", "jaxpar ms",
               "jaxpar explicit_dp=False ms", "jaxpar / hand", "jaxpar / hand (gradients pinned)",
               "explicit_dp=False / hand", "jaxpar / hand (ratio of medians)"]
    rows = []
    for r in results:
        m, q, qg, qm = r["median_s"], r["ratio_vs_hand"], r["ratio_vs_hand_grads"], r["ratio_of_medians"]
        rows.append([r["name"], f"{m['hand'] * 1e3:.2f}", f"{m['hand-grads'] * 1e3:.2f}", f"{m['jaxpar'] * 1e3:.2f}",
                     f"{m['jaxpar-noexp'] * 1e3:.2f}", f"{q['jaxpar']:.3f}", f"{qg['jaxpar']:.3f}",
                     f"{q['jaxpar-noexp']:.3f}", f"{qm['jaxpar']:.3f}"])
    print()
    print(markdown_table(headers, rows))
    # flagged: slower than the hand-written step with the same shardings (gradients included)
    flagged = [r for r in results if r["ratio_vs_hand_grads"]["jaxpar"] > args.threshold]
    if flagged:
        print(f"\nAbove {args.threshold}: " + ", ".join(f"{r['name']} (x{r['ratio_vs_hand_grads']['jaxpar']:.3f})"
                                                     for r in flagged))
        for r in flagged:
            if r["collectives"] and not args.hlo:
                for v in ("hand", "jaxpar"):
                    print(f"\n[{r['name']}] collectives of {v}:\n{r['collectives'][v]}")
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"env": env, "config": vars(args), "gpt": cfg.__dict__, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
