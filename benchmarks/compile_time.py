"""Compile time of jaxpar's GPT train step vs depth, scanned vs unrolled layers.

Lowers and compiles ``jaxpar.make_train_step`` on abstract inputs
(``layout.abstract_state()`` and batch ``ShapeDtypeStruct``s) on the
DP2xFSDP2xTP2 mesh (8 simulated CPU devices) for ``scan_layers=True`` at
4/8/16/32 layers and ``scan_layers=False`` at 4/8/16 layers. ``lower`` is
trace + lowering to StableHLO, ``compile`` is XLA (SPMD partitioning +
optimisation + codegen). Each configuration is compiled ``--reps`` times,
with ``jax.clear_caches()`` before every repetition; the table shows the median.

Usage::

    python benchmarks/compile_time.py [--reps 3] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import sys
import time

import jax

import jaxpar
from jaxpar.models import lm_loss

from _common import BenchStrategy, GPTConfig, abstract_batch, build, environment, markdown_table, write_json

MESH = BenchStrategy("DP2xFSDP2xTP2", {"data": 2, "fsdp": 2, "tensor": 2})


def time_compile(cfg, batch_size, reps):
    mesh, strategy, state, layout, tx = build(cfg, MESH)
    del state
    abs_state, abs_batch = layout.abstract_state(), abstract_batch(cfg, batch_size, mesh)
    lower_s, compile_s = [], []
    for _ in range(reps):
        jax.clear_caches()
        step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
        t0 = time.perf_counter()
        lowered = step.lower(abs_state, abs_batch)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        lower_s.append(t1 - t0)
        compile_s.append(t2 - t1)
    total = [a + b for a, b in zip(lower_s, compile_s)]
    return {"layers": cfg.layers, "scan_layers": cfg.scan_layers, "lower_s": lower_s, "compile_s": compile_s,
            "total_s": total, "median_lower_s": statistics.median(lower_s),
            "median_compile_s": statistics.median(compile_s), "median_total_s": statistics.median(total)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="compilations per configuration (median reported)")
    p.add_argument("--scan", default="4,8,16,32", help="layer counts with scan_layers=True")
    p.add_argument("--unrolled", default="4,8,16", help="layer counts with scan_layers=False")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    env = environment()
    print(f"# jaxpar train-step compile time on {MESH.name}  ({env['devices']}, nproc={env['nproc']}, "
          f"jax {env['jax']}, jaxpar @ {env['git']})")
    print(f"# GPT vocab {args.vocab}, seq {args.seq}, embed {args.embed}, heads {args.heads}; global batch "
          f"{args.batch}; median of {args.reps} compilation(s)", flush=True)
    t_all = time.perf_counter()
    configs = [(int(n), True) for n in args.scan.split(",") if n.strip()]
    configs += [(int(n), False) for n in args.unrolled.split(",") if n.strip()]
    results = []
    for layers, scan in configs:
        cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq, embed=args.embed, heads=args.heads, layers=layers,
                        scan_layers=scan)
        r = time_compile(cfg, args.batch, args.reps)
        results.append(r)
        print(f"  layers={layers:>2} scan_layers={scan!s:<5}: lower {r['median_lower_s']:.2f} s, compile "
              f"{r['median_compile_s']:.2f} s  [{time.perf_counter() - t_all:.0f} s]", flush=True)
    headers = ["layers", "scan_layers", "lower s (median)", "compile s (median)", "lower + compile s (median)",
               "all runs: lower + compile s"]
    rows = [[r["layers"], r["scan_layers"], f"{r['median_lower_s']:.2f}", f"{r['median_compile_s']:.2f}",
             f"{r['median_total_s']:.2f}", ", ".join(f"{t:.2f}" for t in r["total_s"])] for r in results]
    print()
    print(markdown_table(headers, rows))
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"env": env, "config": vars(args), "mesh": MESH.mesh, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
