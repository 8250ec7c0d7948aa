"""FP8 against bf16: a Llama-3-8B-shaped train step compiled for 8 H100s on this machine, without the GPUs.

For each mesh (FSDP8, FSDP4 x TP2) and precision (bf16; FP8 tensorwise, ``Strategy(fp8=Fp8())``), builds
jaxpar's train step (AdamW, fp32 master weights, bf16 compute) of a :class:`jaxpar.models.Decoder` with
Llama-3-8B's widths over the abstract devices of ``h100:1x8`` (:mod:`jaxpar.devices._targets`) and compiles
it with XLA:GPU. Reports, per step and per device, read from the compiled program's text: the covered
matmuls' GEMMs that run in FP8 (and the forwards that ``remat`` recomputes) against those the model has
(forward, input gradient and weight gradient of each covered weight in each layer), the all-gathers' bytes (all of them, and the covered weights'), the
compiled peak memory, the compile time, and beside them the cost model's FP8 / bf16 step-time ratio
(``jaxpar.cost.step_time`` of the same plan with ``Plan.fp8``, on the ``h100`` preset).

Usage::

    python benchmarks/fp8_deviceless.py [--layers 32] [--seq 8192] [--batch 8] [--json out.json]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import re
import sys
import time
from collections import Counter

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar import cost
from jaxpar.analysis import format_bytes, memory_report
from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
from jaxpar.analysis._gemms import gemms
from jaxpar.analysis._hlo_text import array_shapes, parse_instructions, shape_bytes
from jaxpar.analysis._loops import trip_counts
from jaxpar.batch import batch_sharding
from jaxpar.devices import parse_target, target_devices
from jaxpar.models import Decoder, DecoderConfig, RoPE, decoder_loss
from jaxpar.options import Fp8
from jaxpar.parallel._fp8 import is_covered
from jaxpar.strategy import Strategy

from _common import environment, markdown_table, write_json

#: Llama-3-8B's widths (config.json of meta-llama/Meta-Llama-3-8B); ``layers`` is the option's.
LLAMA3_8B = dict(vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, norm_eps=1e-5,
                 rope=RoPE(theta=500000.0))
MESHES = {"FSDP8": {"fsdp": 8}, "FSDP4 x TP2": {"fsdp": 4, "tensor": 2}}
PRECISIONS = {"bf16": None, "FP8 tensorwise": Fp8(recipe="tensorwise")}
#: Published FP8 / bf16 step-time ratios: MaxText Llama3-70B on 128 H100 (9.07 / 15.56 s per step,
#: NVIDIA dgxc-benchmarking) and torchtitan float8 Llama3-8B on 8 H100 (1 / 1.28).
PUBLISHED = {"MaxText, Llama3-70B, 128 H100": 9.07 / 15.56, "torchtitan, Llama3-8B, 8 H100": 1 / 1.28}
_COMPUTATION = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def covered_matmuls(layout) -> int:
    """The covered matmuls per step from the model's parameters: one per covered weight per layer
    (a stacked weight's leading dimension is its layers)."""
    shapes = jax.tree.leaves(layout.shapes)
    logical = jax.tree.leaves(layout.logical, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    return sum(s.shape[0] if "layers" in tuple(names) else 1
               for s, names in zip(shapes, logical) if is_covered(tuple(names)))


def gemms_per_step(hlo: str) -> Counter:
    """The compiled program's GEMMs per step, each counted as often as its computation runs (a
    scanned layer's body once per layer): ``{(named after a covered weight, FP8 operands, a forward
    recomputed by remat): count}``."""
    runs = trip_counts(hlo)
    out: Counter = Counter()
    for block in re.split(r"\n(?=\S)", hlo):
        head = _COMPUTATION.match(block)
        for g in gemms(block) if head else ():
            out["fp8[" in g.op_name, g.fp8, "rematted_computation" in g.op_name] += runs.get(head.group(1), 1)
    return out


def gathered(hlo: str) -> list[tuple[str, tuple[int, ...], int, float]]:
    """Every array an all-gather of the compiled program delivers: ``(dtype, dims, bytes, times per
    step)``, one row per element of a combined (tuple) all-gather."""
    runs = trip_counts(hlo)
    out = []
    for ins in parse_instructions(hlo):
        if ins.opcode not in ("all-gather", "all-gather-done"):
            continue
        for array in array_shapes(ins.shape):
            dtype, dims = _ARRAY.fullmatch(array).groups()
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d), shape_bytes(array),
                        runs.get(ins.computation, 1)))
    return out


def gather_bytes(rows, dims=None) -> dict[str, float]:
    """Bytes per step by dtype of :func:`gathered`'s rows (only arrays whose sorted dims are in
    ``dims``, when given)."""
    out: dict[str, float] = {}
    for dtype, shape, nbytes, times in rows:
        if dims is None or tuple(sorted(shape)) in dims:
            out[dtype] = out.get(dtype, 0.0) + nbytes * times
    return out


def compile_step(cfg: DecoderConfig, axes: dict, fp8, batch: int, seq: int):
    """jaxpar's train step compiled for ``h100:1x8``: ``(compiled, layout, seconds)``."""
    mesh = jaxpar.make_mesh(axes, devices=target_devices(parse_target("h100:1x8")))
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", fp8=fp8)
    tx = optax.adamw(3e-4, weight_decay=0.1)
    layout = jaxpar.state_layout(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(decoder_loss, tx, layout, strategy)
    tokens = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=batch_sharding(mesh))
    jax.clear_caches()
    start = time.perf_counter()
    compiled = step.lower(layout.abstract_state(), {"tokens": tokens, "targets": tokens}).compile()
    return compiled, layout, time.perf_counter() - start


def predicted(cfg: DecoderConfig, axes: dict, batch: int, seq: int) -> dict[str, dict] | None:
    """The cost model's step time and bytes per mesh axis for both precisions on the ``h100`` preset
    (None: this cost model has no FP8, ``Plan.fp8``)."""
    if "fp8" not in cost.Plan.__dataclass_fields__:
        return None
    model = cost.from_nnx(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), layers=cfg.layers, hidden=cfg.embed,
                          heads=cfg.heads, seq=seq, vocab=cfg.vocab, batch=batch, mlp=cfg.mlp, name="llama3-8b")
    cluster = cost.load_cluster("h100")
    out = {}
    for name, fp8 in PRECISIONS.items():
        plan = cost.Plan(**axes, remat=cfg.remat, strategy=Strategy(fp8=fp8))
        t = cost.step_time(model, plan, cluster, dtype="bfloat16", lowering="xla")   # the GPU compiler's
        out[name] = {"step_s": t.total, "compute_s": t.compute, "bytes_per_axis": t.bytes_per_axis}
    return out


def measure(cfg: DecoderConfig, axes: dict, batch: int, seq: int) -> dict[str, dict]:
    """Both precisions on one mesh: the numbers of the module docstring."""
    out, texts = {}, {}
    for name, fp8 in PRECISIONS.items():
        compiled, layout, seconds = compile_step(cfg, axes, fp8, batch, seq)
        texts[name] = compiled.as_text()
        counted = gemms_per_step(texts[name])
        out[name] = {"compile_s": seconds, "covered_matmuls": covered_matmuls(layout),
                     "compiled_bytes_per_axis": compiled_bytes_per_axis(texts[name], layout.mesh),
                     "fp8_gemms": counted[True, True, False], "fp8_recomputed": counted[True, True, True],
                     "named_bf16_gemms": counted[True, False, False] + counted[True, False, True],
                     "unnamed_fp8_gemms": counted[False, True, False] + counted[False, True, True],
                     "gemms": sum(counted.values()),
                     "peak_bytes": memory_report(compiled).required_bytes}
        print(name, axes, out[name], file=sys.stderr, flush=True)
    fp8_rows = gathered(texts["FP8 tensorwise"])
    covered = {tuple(sorted(shape)) for dtype, shape, _, _ in fp8_rows if dtype == "f8e4m3fn"}
    for name, text in texts.items():
        rows = gathered(text)
        out[name].update(gather_by_dtype=gather_bytes(rows), gather_covered=gather_bytes(rows, covered))
    for name, p in (predicted(cfg, axes, batch, seq) or {}).items():
        out[name]["predicted"] = p
    return out


def _predicted_ratio(result: dict[str, dict], name: str) -> str:
    if "predicted" not in result[name]:
        return "-"
    return f"{result[name]['predicted']['step_s'] / result['bf16']['predicted']['step_s']:.3f}"


def table_rows(label: str, result: dict[str, dict]) -> list[list[str]]:
    """One mesh's two rows of the table."""
    rows = []
    base = sum(result["bf16"]["gather_covered"].values())
    for name, r in result.items():
        covered = sum(r["gather_covered"].values())
        dtypes = ", ".join(f"{d} {format_bytes(b)}" for d, b in sorted(r["gather_by_dtype"].items(), key=lambda x: -x[1]))
        rows.append([label, name, f"{r['fp8_gemms']} + {r['fp8_recomputed']}", f"{3 * r['covered_matmuls']}",
                     f"{r['named_bf16_gemms']}",
                     format_bytes(sum(r["gather_by_dtype"].values())), dtypes,
                     f"{format_bytes(covered)} ({covered / base:.3f})", format_bytes(r["peak_bytes"]),
                     f"{r['compile_s']:.0f}", _predicted_ratio(result, name)])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--remat", default="full", choices=["none", "full", "save-matmuls"])
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--json")
    args = p.parse_args(argv)
    cfg = DecoderConfig(**LLAMA3_8B, layers=args.layers, remat=args.remat)
    rows, results = [], {}
    for label in args.meshes.split(","):
        results[label] = measure(cfg, MESHES[label], args.batch, args.seq)
        rows += table_rows(label, results[label])
    print(markdown_table(["mesh", "precision", "FP8 GEMMs + recomputed", "covered GEMMs", "covered GEMMs not FP8",
                          "all-gather / step / device", "by dtype", "covered weights' all-gathers (vs bf16)",
                          "peak / device", "compile s", "cost model: step time vs bf16"], rows))
    for label, result in results.items():
        for name, r in result.items():
            pred = r.get("predicted", {}).get("bytes_per_axis", {})
            print(f"bytes per step per axis, {label}, {name}: compiled " + ", ".join(
                f"{a} {format_bytes(b)}" + (f" (cost model {format_bytes(pred[a])})" if a in pred else "")
                for a, b in r["compiled_bytes_per_axis"].items()))
    print("\npublished FP8 / bf16 step time: " + "; ".join(f"{k} {v:.2f}" for k, v in PUBLISHED.items()))
    write_json(args.json, {"environment": environment(), "config": {**vars(args)}, "results": results,
                           "published": PUBLISHED})
    return 0


if __name__ == "__main__":
    sys.exit(main())
