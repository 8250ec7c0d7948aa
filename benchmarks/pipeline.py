"""Pipeline schedules run by the executor: step time, memory, bubble, overhead.

For each schedule (GPipe, 1F1B, interleaved v=2, ZB-H1) at p=4 stages x DP2 on
8 simulated CPU devices and m in {4, 8, 16} micro-batches of the same size:

* ``step ms``: median per-step time of the pipelined train step;
* ``vs DP8``: median over rounds of the paired ratio to the non-pipelined step
  (the same model, global batch and optimizer on ``data=8``) timed in the same
  round: the executor's overhead. On simulated CPU devices all 8 "devices"
  share the host's cores, so idle stages free cores for busy ones: the ratio
  measures the executor's own cost (switch, buffers, sends), not the bubble;
* ``temp``: compiled peak temporary bytes (``memory_analysis``);
* ``bubble``: the table's bubble fraction (cost model F=1, B=2 or B=W=1);
* ``ticks run / table``: scan iterations the executor runs vs the table's
  rows (equal: one iteration per tick); ``busy``: the share of (tick, stage)
  slots doing F/B/W: idle slots run the empty switch branch, no compute.

With ``--sp``: sequence parallelism inside the pipeline (a lockstep program,
docs/pipeline.md#lockstep-programs) against the same schedule without it (the per-stage
program), on pipe2 x data2 x tensor2: the paired step-time ratio and the temporaries' ratio.

Usage::

    python benchmarks/pipeline.py [--reps 7] [--steps 2] [--json out.json]
    python benchmarks/pipeline.py --sp [--ms 4,8] [--kinds 1f1b,gpipe]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time

import jax

import jaxpar
from jaxpar.models import lm_loss
from jaxpar.parallel.pipeline import lower, sends
from jaxpar.parallel.pipeline import bubble_fraction, get_schedule, lockstep
from jaxpar.parallel.pipeline._schedules import num_ticks

from _common import BenchStrategy, GPTConfig, build, environment, make_batch, markdown_table, write_json

KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def _timed(fn, state, batch, steps):
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = fn(state, batch)
    jax.block_until_ready(metrics["loss"])
    return state, (time.perf_counter() - t) / steps


def bench(cfg, m, rows, reps, steps, p=4, kinds=KINDS):
    base = BenchStrategy("DP8", {"data": 8})
    mesh, strategy, state, layout, tx = build(cfg, base)
    batch = jaxpar.shard_batch(make_batch(cfg, m * rows), mesh)
    variants = {"DP8": (jaxpar.make_train_step(lm_loss, tx, layout, strategy), state, batch, None)}
    for kind, v in kinds:
        bs = BenchStrategy(kind, {"pipe": p, "data": 8 // p})
        pmesh = bs.make_mesh()
        pstrat = jaxpar.Strategy(microbatches=m, schedule=kind, virtual_stages=v)
        pstate, playout = jaxpar.init_train_state(lambda: _common.GPT(cfg, rngs=_common.nnx.Rngs(0)), tx, pmesh,
                                                  pstrat)
        step = jaxpar.make_train_step(lm_loss, tx, playout, pstrat)
        variants[kind] = (step, pstate, jaxpar.shard_batch(make_batch(cfg, m * rows), pmesh),
                          lower(get_schedule(kind, p, m, v)))
    info, states, samples = {}, {}, {k: [] for k in variants}
    for name, (step, st, b, program) in variants.items():
        t = time.perf_counter()
        compiled = step.lower(st, b).compile()
        info[name] = {"compile_s": time.perf_counter() - t,
                      "temp": compiled.memory_analysis().temp_size_in_bytes}
        states[name], _ = _timed(step, st, b, 1)          # warm up
    for r in range(reps):
        order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
        times = {}
        for name in order:
            step, _, b, _ = variants[name]
            states[name], times[name] = _timed(step, states[name], b, steps)
        for name in variants:
            samples[name].append(times[name] / times["DP8"])
            info[name].setdefault("times", []).append(times[name])
    rows_out = []
    for name, (_, _, _, program) in variants.items():
        med = statistics.median(info[name]["times"]) * 1e3
        row = {"schedule": name, "m": m, "step_ms": med, "ratio": statistics.median(samples[name]),
               "temp": info[name]["temp"], "compile_s": info[name]["compile_s"]}
        if program is not None:
            sched = program.schedule
            busy = sum(a is not None for t in sched.table for a in t)
            row.update(bubble=bubble_fraction(sched), ticks_run=len(program.ticks), ticks_table=num_ticks(sched),
                       busy=busy / (num_ticks(sched) * p), sends=sum(sends(program).values()),
                       residual_slots=program.n_res)
        rows_out.append(row)
    return rows_out


def bench_sp(cfg, m, rows, reps, steps, kinds=KINDS):
    """SP inside each schedule (lockstep) against the schedule without SP, pipe2 x data2 x tensor2."""
    tx, out = _common.make_tx(), []
    for kind, v in kinds:
        variants = {}
        for sp in (False, True):
            bs = BenchStrategy(kind, {"pipe": 2, "data": 2, "tensor": 2})
            mesh = bs.make_mesh()
            strat = jaxpar.Strategy(microbatches=m, schedule=kind, virtual_stages=v, sequence_parallel=sp)
            state, layout = jaxpar.init_train_state(lambda: _common.GPT(cfg, rngs=_common.nnx.Rngs(0)), tx, mesh,
                                                    strat)
            step, batch = jaxpar.make_train_step(lm_loss, tx, layout, strat), jaxpar.shard_batch(
                make_batch(cfg, m * rows), mesh)
            temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
            state, _ = _timed(step, state, batch, 1)           # warm up
            variants[sp] = [step, state, batch, temp, []]
        ratios = []
        for r in range(reps):
            for sp in ((False, True) if r % 2 == 0 else (True, False)):
                step, state, batch, _, times = variants[sp]
                variants[sp][1], t = _timed(step, state, batch, steps)
                times.append(t)
            ratios.append(variants[True][4][-1] / variants[False][4][-1])
        table = lockstep(get_schedule(kind, 2, m, v))
        out.append({"schedule": kind, "m": m, "plain_ms": statistics.median(variants[False][4]) * 1e3,
                    "sp_ms": statistics.median(variants[True][4]) * 1e3, "ratio": statistics.median(ratios),
                    "temp_ratio": variants[True][3] / variants[False][3],
                    "ticks": f"{num_ticks(table)} / {num_ticks(get_schedule(kind, 2, m, v))}"})
    return out


def main_sp(args, cfg):
    kinds = [(k, v) for k, v in KINDS if k in args.kinds.split(",")]
    results = []
    for m in map(int, args.ms.split(",")):
        results += bench_sp(cfg, m, args.rows, args.reps, args.steps, kinds)
        print(f"m={m} done", flush=True)
    headers = ["schedule", "m", "no SP ms", "SP (lockstep) ms", "SP / no SP (paired)", "temp SP / no SP",
               "ticks lockstep / table"]
    print(markdown_table(headers, [[r["schedule"], r["m"], f"{r['plain_ms']:.1f}", f"{r['sp_ms']:.1f}",
                                    f"{r['ratio']:.3f}", f"{r['temp_ratio']:.2f}", r["ticks"]] for r in results]))
    write_json(args.json, {"env": environment(), "results": results})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch (same for every m)")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--kinds", default=",".join(k for k, _ in KINDS), help="schedules to time against DP8")
    ap.add_argument("--json")
    ap.add_argument("--sp", action="store_true", help="SP inside the pipeline vs the same schedule without it")
    args = ap.parse_args()
    kinds = [(k, v) for k, v in KINDS if k in args.kinds.split(",")]
    cfg = GPTConfig(vocab=256, seq_len=64, embed=128, heads=4, layers=8)
    print(environment())
    if args.sp:
        return main_sp(args, cfg)
    results = []
    for m in map(int, args.ms.split(",")):
        results += bench(cfg, m, args.rows, args.reps, args.steps, kinds=kinds)
        print(f"m={m} done", flush=True)
    headers = ["schedule", "m", "step ms", "vs DP8", "temp MiB", "bubble", "ticks run / table", "busy",
               "sends", "residual slots", "compile s"]
    table = []
    for r in results:
        table.append([r["schedule"], r["m"], f"{r['step_ms']:.1f}", f"{r['ratio']:.3f}",
                      f"{r['temp'] / 2**20:.2f}", f"{r['bubble']:.3f}" if "bubble" in r else "-",
                      f"{r['ticks_run']} / {r['ticks_table']}" if "ticks_run" in r else "-",
                      f"{r['busy']:.2f}" if "busy" in r else "-", r.get("sends", "-"),
                      r.get("residual_slots", "-"), f"{r['compile_s']:.1f}"])
    print(markdown_table(headers, table))
    write_json(args.json, {"env": environment(), "results": results})


if __name__ == "__main__":
    main()
