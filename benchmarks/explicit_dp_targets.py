"""jaxpar's explicit data-parallel collectives against XLA's, per backend: CPU, an H100 GPU, a TPU v5e.

For each target and each strategy where ``explicit_dp`` applies (DP, ZeRO-1/2/3, FSDP, DP x TP on 8
devices), builds the GPT train step of ``configs/quickstart.yaml`` (grown: 4 layers, embed 512, 8 heads,
256 tokens, batch 16; ``--set`` changes it) with ``make_train_step(explicit_dp=True)`` and with
``explicit_dp=False`` (XLA's SPMD partitioner inserts the data-axis collectives), compiles both ahead of
time for the target's real compiler (deviceless: :mod:`jaxpar.devices._targets`; ``cpu``: 8 simulated CPU
devices) and compares what the compiler made of them:

* the collectives per kind and mesh axes: instructions and bytes per step (loop bodies times their
  trip counts), how many are async (a start / done pair the scheduler can overlap);
* the compute scheduled under the async collectives (:mod:`jaxpar.analysis._overlap`): dot / convolution
  FLOPs under at least one async collective, as a fraction of the step's; the bytes of collectives with
  no FLOPs under them (synchronous, or async with nothing to overlap: *exposed*);
* compile time and peak memory per device.

``default`` is what ``explicit_dp=None`` picks today (:func:`jaxpar.parallel.explicit_by_default`).

Usage::

    python benchmarks/explicit_dp_targets.py [--out results.json] [--targets cpu h100:1x8 tpu-v5e:2x4]
        [--strategies DP8 ZeRO-3] [--set parallel.compute_dtype=bfloat16 ...]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax

from jaxpar.analysis import collectives
from jaxpar.analysis import format_bytes, memory_report
from jaxpar.analysis._overlap import overlap
from jaxpar.config import load_config
from jaxpar.config import build_job
from jaxpar.parallel import explicit_by_default
from jaxpar.devices import parse_target, target_devices
from jaxpar.step import make_train_step

from _common import environment, markdown_table, write_json

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
MODEL = ["model.layers=4", "model.embed=512", "model.heads=8", "model.seq_len=256", "data.batch_size=16"]
TARGETS = ["cpu", "h100:1x8", "tpu-v5e:2x4"]
#: name -> (mesh sizes, ZeRO stage)
STRATEGIES = {
    "DP8": ({"data": 8}, 0),
    "ZeRO-1": ({"data": 8}, 1),
    "ZeRO-2": ({"data": 8}, 2),
    "ZeRO-3": ({"data": 8}, 3),
    "FSDP8": ({"fsdp": 8}, 0),
    "DP4xTP2": ({"data": 4, "tensor": 2}, 0),
}
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "collective-permute": "CP", "all-to-all": "A2A"}


def build(target: str, mesh: dict, zero: int, extra: list[str]):
    devices = jax.devices()[:8] if target == "cpu" else target_devices(parse_target(target))
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    overrides = ["train.devices=0", *MODEL, f"parallel.zero={zero}", *[f"mesh.{k}={v}" for k, v in sizes.items()],
                 *extra]
    job = build_job(load_config(CONFIG, overrides), devices, data=False)
    return job, job.state_layout()


def inventory(compiled, mesh) -> tuple[list[dict], object]:
    """One record per collective instruction: kind, axes, async, bytes, runs per step, FLOPs under it."""
    axes = {c.name: ",".join(c.axes) if c.axes else ("-" if c.axes == () else "?") for c in collectives(compiled, mesh)}
    rep = overlap(compiled)
    recs = [dict(kind=a.kind, axes=axes.get(a.collective, "?"), asynchronous=True, bytes=a.bytes, runs=a.runs,
                 flops=a.flops) for a in rep.asynchronous]
    recs += [dict(kind=s.kind, axes=axes.get(s.name, "?"), asynchronous=False, bytes=s.bytes, runs=s.runs, flops=0.0)
             for s in rep.synchronous]
    return recs, rep


def measure(target: str, name: str, explicit: bool, extra: list[str]) -> dict:
    mesh_sizes, zero = STRATEGIES[name]
    job, layout = build(target, mesh_sizes, zero, extra)
    step = make_train_step(job.loss_fn, job.tx, layout, job.strategy, **{**job.step_options, "explicit_dp": explicit})
    lowered = step.lower(layout.abstract_state(), job.abstract_batch())
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    recs, rep = inventory(compiled, job.mesh)
    by_kind: dict[str, dict] = defaultdict(lambda: {"count": 0, "async": 0, "bytes_per_step": 0.0})
    per_axis: dict[str, float] = defaultdict(float)
    for r in recs:
        row = by_kind[f"{r['kind']}[{r['axes']}]"]
        row["count"] += 1
        row["async"] += r["asynchronous"]
        row["bytes_per_step"] += r["bytes"] * r["runs"]
        per_axis[r["axes"]] += r["bytes"] * r["runs"]
    return {"collectives": len(recs), "async": sum(r["asynchronous"] for r in recs),
            "async_exposed": len(rep.exposed), "by_kind_axes": dict(by_kind), "bytes_per_axis": dict(per_axis),
            "exposed_bytes": rep.exposed_bytes, "hidden_bytes": rep.hidden_bytes, "step_gflops": rep.step_flops / 1e9,
            "overlapped_gflops": rep.overlapped_flops / 1e9, "overlapped_fraction": rep.overlapped_fraction,
            "compile_s": compile_s, "peak_bytes": memory_report(compiled).required_bytes}


def kinds_label(by_kind: dict) -> str:
    return " ".join(f"{SHORT.get(k.split('[')[0], k)}[{k.split('[')[1]}x{v['count']}" +
                    (f" ({v['async']} async)" if 0 < v["async"] < v["count"] else " async" if v["async"] else "")
                    for k, v in sorted(by_kind.items()))


def row(target: str, name: str, explicit: bool, default: bool, r: dict) -> list[str]:
    if "error" in r:
        return [target, name, str(explicit), "yes" if explicit == default else "", "-", "-", r["error"][:80],
                "-", "-", "-", "-"]
    axes = " ".join(f"{a} {format_bytes(b)}" for a, b in sorted(r["bytes_per_axis"].items()))
    return [target, name, str(explicit), "yes" if explicit == default else "", f"{r['compile_s']:.1f}",
            format_bytes(r["peak_bytes"]), kinds_label(r["by_kind_axes"]), axes,
            f"{r['async']}/{r['collectives']} ({r['async_exposed']} bare)", format_bytes(r["exposed_bytes"]),
            f"{r['overlapped_gflops']:.1f}/{r['step_gflops']:.1f} ({r['overlapped_fraction']:.0%})"]


HEADERS = ["target", "strategy", "explicit_dp", "default", "compile s", "peak", "collectives [axes]x count",
           "bytes / step per axis", "async / all (bare)", "exposed bytes", "GFLOPs under async / step"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--targets", nargs="+", default=TARGETS)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    args = p.parse_args(argv)
    rows, results = [], []
    for target in args.targets:
        for name in args.strategies:
            mesh_sizes, zero = STRATEGIES[name]
            platform = "cpu" if target == "cpu" else parse_target(target).spec.platform
            default = explicit_by_default({"data": 1, "fsdp": 1, "tensor": 1, **mesh_sizes}, zero, platform)
            for explicit in (True, False):
                try:
                    r = measure(target, name, explicit, args.set)
                except Exception as e:       # a strategy the target's compiler refuses is a result too
                    r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                results.append({"target": target, "strategy": name, "explicit_dp": explicit,
                                "default_explicit_dp": default, **r})
                rows.append(row(target, name, explicit, default, r))
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(markdown_table(HEADERS, rows))
    write_json(args.out, {"environment": environment(), "model": MODEL + args.set, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
