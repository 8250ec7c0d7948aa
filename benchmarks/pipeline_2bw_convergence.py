"""PipeDream-2BW and weight stashing vs flushed 1F1B: loss at equal tokens on the quickstart GPT, pipe=4 x data=2.

Runs ``jaxpar train configs/quickstart.yaml`` once per schedule (same data, seed, global batch 32,
so equal steps = equal tokens) on 8 simulated devices as pipe=4 x data=2, the model at 4 layers
(one per stage), 4 micro-batches: ``1f1b``; ``pipedream-2bw`` (the gradient one step late:
``W(t+1) = W(t) - update(grad f_t(W(t-1)))``); ``pipedream`` (weight stashing, each stage
updating once per step, ``update_every=4``). Final loss = mean of the last 20 steps' logged
losses; ``ratio`` = the schedule's / 1F1B's (target: <= 1.03); ``step time`` = median
seconds per step after the first, and its ratio to 1F1B's in the same invocation.
``--lr``, ``--warmup`` and ``--clip`` set the recipe for every schedule (weight stashing takes
no global-norm clipping, so it runs with ``--clip 0`` only).

Usage::

    python benchmarks/pipeline_2bw_convergence.py [--steps 300] [--lr 3e-3 --warmup 20 --clip 1.0] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse

from _common import environment, markdown_table, quickstart_run, write_json

SCHEDULES = {"1f1b": [], "pipedream-2bw": [], "pipedream": ["parallel.update_every=4"]}


def run(schedule: str, steps: int, recipe: list[str]) -> list[dict]:
    """The ``train`` records of one ``jaxpar train`` run on pipe=4 x data=2 (the last one also holds
    the final ``eval_loss``)."""
    train, evaluated = quickstart_run(["mesh.pipe=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "model.layers=4",
                                       "parallel.microbatches=4", f"parallel.schedule={schedule}",
                                       f"train.steps={steps}", *recipe, *SCHEDULES[schedule]], f"schedule={schedule}")
    train[-1]["eval_loss"] = evaluated
    return train


def final(recs: list[dict], last: int = 20) -> float:
    return sum(r["loss"] for r in recs[-last:]) / last


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: none)")
    ap.add_argument("--only", default=",".join(SCHEDULES))
    ap.add_argument("--json")
    args = ap.parse_args()
    print(environment())
    recipe = [f"optimizer.lr={args.lr}", f"optimizer.warmup_steps={args.warmup}",
              f"optimizer.clip_norm={args.clip if args.clip else 'null'}"]
    results = {}
    for schedule in args.only.split(","):
        if schedule == "pipedream" and args.clip:
            print("pipedream: skipped (weight stashing takes no global-norm clipping; run with --clip 0)")
            continue
        recs = run(schedule, args.steps, recipe)
        times = sorted(r["step_time"] for r in recs[1:])
        results[schedule] = {"final_loss": final(recs), "eval_loss": recs[-1]["eval_loss"],
                             "step_time": times[len(times) // 2], "losses": [r["loss"] for r in recs]}
    base = results["1f1b"]
    for r in results.values():
        r["ratio"], r["time_ratio"] = r["final_loss"] / base["final_loss"], r["step_time"] / base["step_time"]
    print(markdown_table(["schedule", "final loss (last 20 steps)", "vs 1F1B", "eval loss", "s/step", "time vs 1F1B"],
                         [[k, f"{r['final_loss']:.4f}", f"{r['ratio']:.4f}", f"{r['eval_loss']:.4f}",
                           f"{r['step_time']:.3f}", f"{r['time_ratio']:.2f}"] for k, r in results.items()]))
    write_json(args.json, {"env": environment(), "steps": args.steps, "recipe": recipe, "results": results})


if __name__ == "__main__":
    main()
