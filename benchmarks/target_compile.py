"""Compiling a config's train step for real GPU / TPU targets on this machine: time and what it finds.

For each config and target, builds the job ``jaxpar train`` runs (``jaxpar.config._job.build_job``)
over the target's abstract devices (``jaxpar.devices._targets``), compiles every program of its train step
ahead of time with the target's real compiler, and reports the compile time (median of ``--reps``,
caches cleared before each), the peak memory per device against the device's capacity, and the
collectives (how many the compiler made async). The same config on 8 simulated CPU devices is the
baseline: ``vs cpu`` is the compile-time ratio, taken in the same run.

Usage::

    python benchmarks/target_compile.py [--reps 3] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax

from jaxpar.analysis import collectives
from jaxpar.analysis import format_bytes, memory_report
from jaxpar.config import load_config
from jaxpar.config import build_job
from jaxpar.devices import parse_target, target_devices

from _common import environment, markdown_table, write_json

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
JOBS = {"quickstart (dp2-fsdp2-tp2, 0.5M)": ("quickstart.yaml", []),
        "gpt124m_gpu (dp8 bf16, 163M)": ("gpt124m_gpu.yaml", ["mesh.data=8"])}
TARGETS = ["cpu", "h100:1x8", "a100-80gb:1x8", "b200:1x8", "tpu-v5e:2x4", "tpu-v6e:2x4"]


def compile_once(config: str, overrides: list[str], target: str) -> tuple[float, dict, object]:
    devices = jax.devices()[:8] if target == "cpu" else target_devices(parse_target(target))
    cfg = load_config(CONFIGS / config, ["train.devices=0", *overrides])
    job = build_job(cfg, devices, data=False)
    layout = job.state_layout()
    jax.clear_caches()
    t0 = time.perf_counter()
    compiled = job.compile(layout)
    return time.perf_counter() - t0, compiled, job.mesh


def measure(config: str, overrides: list[str], target: str, reps: int) -> dict:
    times = []
    for _ in range(reps):
        t, compiled, mesh = compile_once(config, overrides, target)
        times.append(t)
    step = compiled["step"]
    colls = collectives(step, mesh)
    rep = memory_report(step)
    capacity = None if target == "cpu" else parse_target(target).capacity_bytes
    return {"compile_s": statistics.median(times), "peak_bytes": rep.required_bytes, "capacity_bytes": capacity,
            "collectives": len(colls), "async": sum(c.asynchronous for c in colls)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows, results = [], []
    for label, (config, overrides) in JOBS.items():
        base = None
        for target in TARGETS:
            r = measure(config, overrides, target, args.reps)
            base = base or r["compile_s"]
            results.append({"job": label, "target": target, **r})
            cap = "-" if r["capacity_bytes"] is None else format_bytes(r["capacity_bytes"])
            rows.append([label, target, f"{r['compile_s']:.1f}", f"{r['compile_s'] / base:.2f}",
                         format_bytes(r["peak_bytes"]), cap, f"{r['async']} / {r['collectives']}"])
            print(rows[-1], file=sys.stderr, flush=True)
    print(markdown_table(["job", "target", "compile s", "vs cpu", "peak / device", "capacity", "async / collectives"],
                         rows))
    write_json(args.json, {"environment": environment(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
