"""Per-device memory of jaxpar's GPT train step: measured vs analytic.

Three tables (bytes per device, from ``compiled.memory_analysis()`` of the
jitted train step, lowered on abstract inputs so nothing is allocated):

1. Every strategy at 8 devices: measured argument bytes vs the analytic
   parameter + optimizer bytes of ``layout.analytic_bytes()`` (+ the batch shard
   and the step counter, which are arguments too), the closed-form ZeRO figure
   (``12Ψ`` DP, ``4Ψ + 8Ψ/N`` ZeRO-1/2, ``12Ψ/N`` ZeRO-3 / FSDP; Ψ = parameter
   count; only for strategies that use data axes alone), and temp bytes with
   ``explicit_dp=True`` and ``False``.
2. Scaling over N = 2, 4, 8 devices (the first N devices) for DP, ZeRO-1/2/3.
3. ZeRO-2 vs ZeRO-1 temporaries at each N: ZeRO-2 keeps only a 1/N shard of
   the gradients, so its peak temporaries should be below ZeRO-1's by at least
   ``2Ψ`` bytes (the full fp32 gradient is ``4Ψ``).

Usage::

    python benchmarks/memory.py [--layers 8] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import math
import sys
import time

import jaxpar
from jaxpar.analysis import format_bytes, memory_report
from jaxpar.models import lm_loss

from _common import STRATEGIES, BenchStrategy, GPTConfig, abstract_batch, build, environment, markdown_table, \
    write_json


def closed_form(bs: BenchStrategy, psi: int, n: int) -> tuple[str, float] | None:
    """``(formula, bytes)`` of the ZeRO closed form for pure data-axis strategies."""
    axes = {k for k, v in bs.mesh.items() if v > 1}
    if not axes:
        return "12Ψ", 12 * psi
    if axes == {"fsdp"} or (axes == {"data"} and bs.zero == 3):
        return "12Ψ/N", 12 * psi / n
    if axes == {"data"} and bs.zero in (1, 2):
        return "4Ψ+8Ψ/N", 4 * psi + 8 * psi / n
    if axes == {"data"} and bs.zero == 0:
        return "12Ψ", 12 * psi
    return None


def measure(cfg, bs, batch_size, n_devices=None):
    mesh, strategy, state, layout, tx = build(cfg, bs, n_devices)
    del state
    abs_state, abs_batch = layout.abstract_state(), abstract_batch(cfg, batch_size, mesh)
    out = {"name": bs.name, "n": mesh.devices.size, "mesh": dict(mesh.shape)}
    for label, explicit in (("explicit", True), ("noexp", False)):
        step = jaxpar.make_train_step(lm_loss, tx, layout, strategy, explicit_dp=explicit)
        rep = memory_report(step.lower(abs_state, abs_batch).compile())
        out[label] = {"argument": rep.argument_bytes, "output": rep.output_bytes, "temp": rep.temp_bytes,
                      "alias": rep.alias_bytes, "peak": rep.peak_bytes}
    analytic = layout.analytic_bytes()
    n_batch = math.prod(mesh.shape[a] for a in jaxpar.data_axes(mesh))
    extra = 2 * (batch_size // n_batch) * cfg.seq_len * 4 + 4   # tokens + targets shard, int32 step counter
    out.update(analytic=analytic, extra_args=extra)
    cf = closed_form(bs, analytic["psi"], mesh.devices.size)
    out["closed_form"] = None if cf is None else {"formula": cf[0], "bytes": cf[1]}
    return out


def fmt(n):
    return f"{format_bytes(n)} ({int(round(n)):,})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--scaling", default="2,4,8", help="device counts for the scaling table")
    p.add_argument("--only", default="", help="comma-separated strategy names for table 1 (default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq, embed=args.embed, heads=args.heads, layers=args.layers)
    env = environment()
    print(f"# jaxpar per-device memory  ({env['devices']}, nproc={env['nproc']}, jax {env['jax']}, "
          f"jaxpar @ {env['git']})")
    print(f"# GPT {cfg}; global batch {args.batch}; Adam(W) fp32 (4 B params + 8 B moments)", flush=True)
    t_all = time.perf_counter()
    only = {s.strip() for s in args.only.split(",") if s.strip()}

    # 1. every strategy at 8 devices
    results = []
    for bs in STRATEGIES:
        if only and bs.name not in only:
            continue
        r = measure(cfg, bs, args.batch)
        results.append(r)
        print(f"  measured {bs.name} [{time.perf_counter() - t_all:.0f} s]", flush=True)
    psi = results[0]["analytic"]["psi"]
    print(f"\nΨ = {psi:,} parameters; 4Ψ (fp32 gradients) = {fmt(4 * psi)}; 2Ψ = {fmt(2 * psi)}\n")
    headers = ["strategy", "devices", "measured args", "analytic params+opt", "analytic + batch + step",
               "measured / analytic(+batch)", "closed form", "closed form bytes", "temp (explicit_dp)",
               "temp (explicit_dp=False)", "peak (explicit_dp)"]
    rows = []
    for r in results:
        a, m = r["analytic"], r["explicit"]
        full = a["total"] + r["extra_args"]
        cf = r["closed_form"]
        rows.append([r["name"], r["n"], fmt(m["argument"]), fmt(a["total"]), fmt(full),
                     f"{m['argument'] / full:.4f}", cf["formula"] if cf else "n/a", fmt(cf["bytes"]) if cf else "n/a",
                     fmt(m["temp"]), fmt(r["noexp"]["temp"]), fmt(m["peak"])])
    print("## Per-device memory at 8 devices\n")
    print(markdown_table(headers, rows))

    # 2. scaling over N
    ns = [int(x) for x in args.scaling.split(",") if x.strip()]
    scale_strats = [BenchStrategy("DP", {"data": 8}), BenchStrategy("ZeRO-1", {"data": 8}, zero=1),
                    BenchStrategy("ZeRO-2", {"data": 8}, zero=2), BenchStrategy("ZeRO-3", {"data": 8}, zero=3)]
    scaling = []
    for bs in scale_strats:
        for n in ns:
            sb = BenchStrategy(bs.name, {"data": n}, zero=bs.zero)
            r = measure(cfg, sb, args.batch, n)
            scaling.append(r)
            print(f"  measured {bs.name} N={n} [{time.perf_counter() - t_all:.0f} s]", flush=True)
    headers = ["strategy", "N", "measured args", "analytic params+opt", "closed form", "closed form bytes",
               "measured / analytic(+batch)", "temp (explicit_dp)", "temp (explicit_dp=False)"]
    rows = []
    for r in scaling:
        a, m, cf = r["analytic"], r["explicit"], r["closed_form"]
        rows.append([r["name"], r["n"], fmt(m["argument"]), fmt(a["total"]), cf["formula"], fmt(cf["bytes"]),
                     f"{m['argument'] / (a['total'] + r['extra_args']):.4f}", fmt(m["temp"]),
                     fmt(r["noexp"]["temp"])])
    print("\n## Scaling from 2 to 8 devices (data axis)\n")
    print(markdown_table(headers, rows))

    # 3. ZeRO-2 vs ZeRO-1 temporaries
    by = {(r["name"], r["n"]): r for r in scaling}
    headers = ["N", "ZeRO-1 temp", "ZeRO-2 temp", "ZeRO-1 − ZeRO-2", "2Ψ", "4Ψ (full grads)",
               "saving ≥ 2Ψ?", "same, explicit_dp=False: ZeRO-1 − ZeRO-2"]
    rows, zcmp = [], []
    for n in ns:
        z1, z2 = by[("ZeRO-1", n)], by[("ZeRO-2", n)]
        d = z1["explicit"]["temp"] - z2["explicit"]["temp"]
        dn = z1["noexp"]["temp"] - z2["noexp"]["temp"]
        zcmp.append({"n": n, "zero1_temp": z1["explicit"]["temp"], "zero2_temp": z2["explicit"]["temp"],
                     "diff": d, "diff_noexp": dn, "two_psi": 2 * psi, "four_psi": 4 * psi, "ok": d >= 2 * psi})
        rows.append([n, fmt(z1["explicit"]["temp"]), fmt(z2["explicit"]["temp"]), fmt(d), fmt(2 * psi),
                     fmt(4 * psi), "yes" if d >= 2 * psi else "NO", fmt(dn)])
    print("\n## ZeRO-2 vs ZeRO-1 peak temporaries\n")
    print(markdown_table(headers, rows))
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"env": env, "config": vars(args), "gpt": cfg.__dict__, "psi": psi,
                           "strategies": results, "scaling": scaling, "zero2_vs_zero1": zcmp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
