"""FP8 on the CPU mesh: the quickstart (DP2 x FSDP2 x TP2, 300 steps) in bf16 and with every covered
matmul in FP8 (XLA:CPU emulates the FP8 GEMMs), the same data, seed and schedule: the loss curves, the
final train loss (the mean of the last 10% of steps) and the eval loss, FP8 / bf16.

    .venv/bin/python benchmarks/fp8_convergence.py [--json out.json]
"""
from __future__ import annotations

import argparse

from _common import convergence_rows, environment, markdown_table, write_json

RUNS = {"bf16": ["parallel.compute_dtype=bfloat16"],
        "bf16 + FP8 tensorwise": ["parallel.compute_dtype=bfloat16", "parallel.fp8={recipe: tensorwise, min_dim: 0}"],
        "bf16 + FP8 rowwise": ["parallel.compute_dtype=bfloat16", "parallel.fp8={recipe: rowwise, min_dim: 0}"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = environment()
    rows = convergence_rows(RUNS, "bf16")
    print(f"{env['date']}, commit {env['git']}, {env['devices']}, jax {env['jax']}, {env['nproc']} cores")
    print(markdown_table(["run", "step 1", "50", "100", "200", "300", "final train", "eval", "train / bf16",
                          "eval / bf16"], rows))
    write_json(args.json, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
