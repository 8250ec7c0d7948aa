"""PipeDream-2BW vs flushed 1F1B: loss at equal tokens on the quickstart GPT, pipe=4 x data=2.

Runs ``jaxpar train configs/quickstart.yaml`` twice (same data, seed, global batch 32, so equal
steps = equal tokens) on 8 simulated devices as pipe=4 x data=2, the model at 4 layers (one per
stage), 4 micro-batches, with ``parallel.schedule`` 1f1b and pipedream-2bw (the gradient one step
late: ``W(t+1) = W(t) - update(grad f_t(W(t-1)))``). Final loss = mean of the last 20 steps'
logged losses; ``ratio`` = 2BW's / 1F1B's (acceptance: <= 1.03).

Usage::

    python benchmarks/pipeline_2bw_convergence.py [--steps 300] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse

from _common import environment, markdown_table, quickstart_run, write_json

SCHEDULES = ("1f1b", "pipedream-2bw")


def run(schedule: str, steps: int) -> list[dict]:
    """The ``train`` records of one ``jaxpar train`` run on pipe=4 x data=2 (the last one also holds
    the final ``eval_loss``)."""
    train, evaluated = quickstart_run(["mesh.pipe=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "model.layers=4",
                                       "parallel.microbatches=4", f"parallel.schedule={schedule}",
                                       f"train.steps={steps}"], f"schedule={schedule}")
    train[-1]["eval_loss"] = evaluated
    return train


def final(recs: list[dict], last: int = 20) -> float:
    return sum(r["loss"] for r in recs[-last:]) / last


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(environment())
    results = {}
    for schedule in SCHEDULES:
        recs = run(schedule, args.steps)
        results[schedule] = {"final_loss": final(recs), "eval_loss": recs[-1]["eval_loss"],
                             "losses": [r["loss"] for r in recs]}
    base = results["1f1b"]["final_loss"]
    for r in results.values():
        r["ratio"] = r["final_loss"] / base
    print(markdown_table(["schedule", "final loss (last 20 steps)", "vs 1F1B", "eval loss"],
                         [[k, f"{r['final_loss']:.4f}", f"{r['ratio']:.4f}", f"{r['eval_loss']:.4f}"]
                          for k, r in results.items()]))
    write_json(args.json, {"env": environment(), "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
