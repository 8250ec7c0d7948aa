"""The cost model against the real GPU and TPU compilers: memory and collective bytes per device.

For each (GPT, plan, target) case, compiles jaxpar's train step (fp32 parameters, fp32 Adam, fp32
compute) for the target's abstract devices with the target's own compiler (deviceless AOT,
:mod:`jaxpar.devices._targets`; nothing runs) and sets beside it the cost model's prediction:

* bytes per step per mesh axis: :func:`jaxpar.cost.comms` (``xla`` lowering) against the
  compiled collectives counted through the loops
  (:func:`jaxpar.analysis._axis_bytes.compiled_bytes_per_axis`);
* argument bytes: :func:`jaxpar.cost.device_argument_bytes` with the target's layout
  (:func:`jaxpar.cost._device_bytes.layout_for_platform`) against ``memory_analysis()``;
* peak bytes: :func:`jaxpar.cost.memory_per_device` (fp32, the target compiler's measured tables) against what the
  program allocates on a device (arguments + outputs + temporaries - aliased,
  :attr:`jaxpar.analysis._compiled_memory.MemoryReport.peak_bytes`), with XLA's own peak of live bytes
  (``peak_memory_in_bytes``) beside it: the two agree on GPUs, and libtpu's allocation is 5-33 % above its live peak.

``--precision`` runs :data:`PRECISION_CASES` instead: the same GPTs in bf16 compute (fp32 master weights
and Adam), each without and with FP8 (:class:`jaxpar.options.Fp8`, tensorwise, min_dim 1024), on the GPU
compiler: bytes per axis, and the all-gathers' bytes per step by element type against the cost model's
parameter gathers (:func:`jaxpar.analysis._gemms.all_gather_dtypes`); the FP8 GEMMs are checked
(:func:`jaxpar.analysis._gemms.check_fp8_gemms`).

The measured side of every case is written to the JSON (``--out``); ``--measured FILE`` reuses it
and recomputes only the predictions (seconds instead of minutes). ``--hlo DIR`` keeps each compiled
program's HLO text (``DIR/<case>.hlo.gz``) and, for a case whose text is there, counts the compiled
collectives again from it (a change in :mod:`jaxpar.analysis` without compiling again).

Usage::

    JAX_PLATFORMS=cpu python benchmarks/cost_vs_compiler.py --out cost_vs_compiler.json [--only tpu] [--hlo DIR]
    JAX_PLATFORMS=cpu python benchmarks/cost_vs_compiler.py --precision --out precision.json
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402

from jaxpar import cost  # noqa: E402
from jaxpar.cost import device_argument_bytes, memory_per_device
from jaxpar.cost._device_bytes import layout_for_platform  # noqa: E402
from jaxpar.cost import comms
from jaxpar.cost._traffic import bytes_per_axis, lowering_for_platform  # noqa: E402
from jaxpar.cost._parallel import AXES  # noqa: E402
from jaxpar.options import Fp8  # noqa: E402
from jaxpar.strategy import Strategy  # noqa: E402


def P(remat: str = "none", **kw) -> cost.Plan:
    """A plan from its mesh sizes and its strategy's fields, by keyword (the table below)."""
    sizes = {a: kw.pop(a) for a in AXES if a in kw}
    return cost.Plan(**sizes, remat=remat, strategy=Strategy(**kw))


#: GPT sizes (layers, hidden, heads, seq), vocab 50304: GPT-3 paper's 125M ... 13B, and a 70B.
MODELS = {"125M": (12, 768, 12, 1024), "350M": (24, 1024, 16, 1024), "1.3B": (24, 2048, 16, 2048),
          "2.7B": (32, 2560, 32, 2048), "6.7B": (32, 4096, 32, 2048), "13B": (40, 5120, 40, 2048),
          "70B": (80, 8192, 64, 2048)}
#: (model, global batch, target, plan)
CASES = [
    ("125M", 16, "h100:1x8", P(data=8)),
    ("125M", 16, "h100:1x8", P(data=8, zero=1)),
    ("350M", 16, "h100:1x8", P(data=8, zero=2)),
    ("1.3B", 16, "h100:1x8", P(data=8, zero=3, remat="full")),
    ("1.3B", 16, "h100:1x8", P(fsdp=8, remat="full")),
    ("1.3B", 8, "h100:1x8", P(tensor=8)),
    ("2.7B", 8, "h100:1x8", P(tensor=8, sequence_parallel=True, remat="save-matmuls")),
    ("1.3B", 8, "h100:1x8", P(data=2, tensor=4, sequence_parallel=True)),
    ("1.3B", 16, "h100:1x8", P(pipe=2, data=4, microbatches=4, schedule="1f1b")),
    ("1.3B", 16, "h100:1x8", P(pipe=4, tensor=2, microbatches=8, schedule="gpipe", remat="full")),
    ("6.7B", 16, "h100:2x8", P(data=2, tensor=8, zero=1, sequence_parallel=True, remat="save-matmuls")),
    ("6.7B", 32, "h100:2x8", P(fsdp=16, remat="full")),
    ("2.7B", 16, "h100:2x8", P(pipe=2, tensor=8, microbatches=8, schedule="1f1b", remat="full")),
    ("13B", 64, "h100:8x8", P(data=8, tensor=8, zero=1, sequence_parallel=True, remat="full")),
    ("70B", 64, "h100:8x8", P(fsdp=8, tensor=8, sequence_parallel=True, remat="full")),
    ("70B", 64, "h100:8x8", P(pipe=8, tensor=8, microbatches=16, schedule="1f1b", remat="full")),
    ("125M", 16, "tpu-v5e:4x4", P(data=16)),
    ("125M", 16, "tpu-v5e:4x4", P(data=16, zero=2)),
    ("1.3B", 16, "tpu-v5e:4x4", P(fsdp=16, remat="full")),
    ("1.3B", 16, "tpu-v5e:4x4", P(data=4, tensor=4, sequence_parallel=True, remat="save-matmuls")),
    ("6.7B", 16, "tpu-v5p:2x2x4", P(fsdp=16, remat="full")),
    ("2.7B", 16, "tpu-v5p:2x2x4", P(data=2, tensor=8, zero=1, sequence_parallel=True, remat="full")),
    ("1.3B", 32, "tpu-v5p:2x2x4", P(pipe=4, data=4, microbatches=8, schedule="1f1b", remat="full")),
    ("350M", 16, "tpu-v5e:2x4", P(fsdp=8)),
    ("125M", 16, "tpu-v5e:2x4", P(data=8, zero=2)),
    ("125M", 32, "tpu-v5e:4x8", P(data=32, zero=2)),
    ("125M", 64, "tpu-v5p:4x4x4", P(data=64, zero=2)),
]


#: (model, global batch, target, plan): compiled in bf16, then with FP8 (``plan.with_strategy(fp8=Fp8())``).
PRECISION_CASES = [
    ("350M", 16, "h100:1x8", P(fsdp=8)),
    ("350M", 16, "h100:1x8", P(data=8)),
    ("1.3B", 16, "h100:1x8", P(data=8, zero=3, remat="full")),
    ("1.3B", 8, "h100:1x8", P(tensor=8)),
    ("1.3B", 16, "h100:1x8", P(fsdp=4, tensor=2)),
    ("1.3B", 8, "h100:1x8", P(tensor=8, sequence_parallel=True)),
]


def case_model(name: str, batch: int) -> cost.ModelSpec:
    layers, hidden, heads, seq = MODELS[name]
    return cost.gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=50304, batch=batch, name=name)


def case_key(name: str, batch: int, target: str, plan: cost.Plan) -> str:
    return f"{name} b{batch} {target} {plan.name()}"


def measure(model: cost.ModelSpec, target: str, plan: cost.Plan, hlo: str | None = None) -> dict:
    """Compile the case and read the compiled side (imports JAX and the target's compiler); ``hlo``: a
    path to write the compiled program's HLO text to (gzip)."""
    from flax import nnx

    from jaxpar.analysis import memory_report
    from jaxpar.models import GPT, GPTConfig
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.analysis import compile_plan

    remat = plan.remat
    cfg = GPTConfig(vocab=model.vocab, seq_len=model.seq, embed=model.hidden, heads=model.heads,
                    layers=model.layers, mlp=model.mlp, remat=remat)
    t0 = time.perf_counter()
    mesh, compiled = compile_plan(lambda: GPT(cfg, rngs=nnx.Rngs(0)), plan, model.batch, model.seq,
                                  devices=target_devices(parse_target(target)))
    seconds = time.perf_counter() - t0
    rep = memory_report(compiled)
    if hlo:
        with gzip.open(hlo, "wt") as f:
            f.write(compiled.as_text())
    return {"arguments": rep.argument_bytes, "temp": rep.temp_bytes, "peak": rep.peak_bytes,
            "xla_peak": rep.xla_peak_bytes,
            "compile_s": round(seconds, 1), **count(compiled, mesh, plan)}


def compile_precision(model: cost.ModelSpec, target: str, plan: cost.Plan):
    """Compile jaxpar's GPT train step in bf16 compute (fp32 master weights, AdamW), with the plan's FP8's
    FP8 when set: ``(mesh, compiled)``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxpar.batch import batch_sharding
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.mesh import make_mesh
    from jaxpar.models import GPT, GPTConfig
    from jaxpar.models._gpt import lm_loss
    from jaxpar.step._compose import make_train_step
    from jaxpar.step._init import state_layout

    remat = plan.remat
    cfg = GPTConfig(vocab=model.vocab, seq_len=model.seq, embed=model.hidden, heads=model.heads,
                    layers=model.layers, mlp=model.mlp, remat=remat)
    mesh = make_mesh({k: v for k, v in plan.sizes.items() if v > 1}, devices=target_devices(parse_target(target)))
    strategy = dataclasses.replace(plan.strategy, zero=plan.strategy.zero if plan.data > 1 else 0,
                                   compute_dtype="bfloat16")
    tx = optax.adamw(1e-3, weight_decay=0.1)
    layout = state_layout(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = make_train_step(lm_loss, tx, layout, strategy)
    spec = jax.ShapeDtypeStruct((model.batch, model.seq), jnp.int32, sharding=batch_sharding(mesh))
    return mesh, step.lower(layout.abstract_state(), {"tokens": spec, "targets": spec}).compile()


def measure_precision(model: cost.ModelSpec, target: str, plan: cost.Plan) -> dict:
    """The compiled side of a precision case: bytes per axis, all-gather bytes per element type, FP8 GEMMs."""
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
    from jaxpar.analysis._gemms import all_gather_dtypes, check_fp8_gemms

    t0 = time.perf_counter()
    mesh, compiled = compile_precision(model, target, plan)
    seconds = time.perf_counter() - t0
    gathers: dict[str, float] = {}
    for (_, dtype), v in all_gather_dtypes(compiled, mesh).items():
        gathers[dtype] = gathers.get(dtype, 0.0) + v["bytes"]
    counts = check_fp8_gemms(compiled.as_text()) if plan.strategy.fp8 else {}
    return {"axes": compiled_bytes_per_axis(compiled, mesh, plan), "gathers": gathers,
            "fp8_gemms": sum(int(c["fp8"]) for c in counts.values()), "compile_s": round(seconds, 1)}


def predict_precision(model: cost.ModelSpec, plan: cost.Plan) -> dict:
    """The cost model's side of a precision case (lowering ``xla``, bf16 activations and gradients)."""
    cs = comms(model, plan, lowering="xla", compute_bytes=2, grad_bytes=2)
    return {"axes": bytes_per_axis(cs), "gathers": sum(c.bytes * c.count for c in cs if c.kind == "all-gather")}


def precision_rows(args) -> list[dict]:
    """Compile (or reuse) every precision case, bf16 then FP8, and set the prediction beside it."""
    measured = json.load(open(args.measured))["measured"] if args.measured else {}
    if args.out and os.path.exists(args.out) and not args.measured:
        measured = json.load(open(args.out))["measured"]
    rows = []
    for name, batch, target, base in PRECISION_CASES:
        for plan in (base, base.with_strategy(fp8=Fp8())):
            key = case_key(name, batch, target, plan) + " bf16"
            if args.only not in key or (key not in measured and args.measured):
                continue
            model = case_model(name, batch)
            if key not in measured:
                measured[key] = measure_precision(model, target, plan)
                print(f"compiled {key}: {measured[key]['compile_s']}", file=sys.stderr, flush=True)
            got, pred = measured[key], predict_precision(model, plan)
            axes = {a: {"predicted": pred["axes"].get(a, 0.0), "compiled": got["axes"].get(a, 0.0),
                        "error": _err(pred["axes"].get(a, 0.0), got["axes"].get(a, 0.0))}
                    for a in sorted(set(pred["axes"]) | set(got["axes"]))}
            rows.append({"case": key, "axes": axes, "gathers": got["gathers"], "gathers_predicted": pred["gathers"],
                         "fp8_gemms": got["fp8_gemms"], "compile_s": got["compile_s"]})
            if args.out:
                _write(args.out, rows, measured)
    return rows


def precision_table(rows: list[dict]) -> str:
    """The Markdown table of the precision cases."""
    lines = ["| case | bytes per axis: predicted / compiled (compiled GB) | all-gathers GB: predicted / compiled "
             "(f8e4m3fn GB of them) | FP8 GEMMs | compile s |", "|---|---|---:|---:|---:|"]
    for r in rows:
        ax = ", ".join(f"{a} {v['predicted'] / v['compiled']:.3f} ({v['compiled'] / 1e9:.3g})" if v["compiled"]
                       else f"{a} -" for a, v in r["axes"].items())
        got = sum(r["gathers"].values())
        f8 = r["gathers"].get("f8e4m3fn", 0.0)
        gathers = f"{r['gathers_predicted'] / 1e9:.3g} / {got / 1e9:.3g} ({f8 / 1e9:.3g})" if got else "-"
        lines.append(f"| {r['case']} | {ax} | {gathers} | {r['fp8_gemms'] or '-'} | {r['compile_s']} |")
    return "\n".join(lines)


def _measure_or_refusal(model: cost.ModelSpec, target: str, plan: cost.Plan, hlo: str | None) -> dict:
    """:func:`measure`, or ``{"compile_error": ...}`` when the compiler refuses a program that does not fit
    (libtpu does; the GPU compiler compiles it and its peak says so)."""
    try:
        return measure(model, target, plan, hlo)
    except Exception as e:                 # jax.errors.JaxRuntimeError; JAX is imported only inside measure
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"compile_error": next(line for line in str(e).splitlines() if "RESOURCE_EXHAUSTED" in line)}


def count(compiled, mesh, plan: cost.Plan) -> dict:
    """The compiled side's collectives: ``axes`` (bytes per mesh axis; ``axes_error`` when they cannot
    be counted) and ``inventory`` (bytes by kind and axes) of ``compiled`` (or its HLO text)."""
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis

    try:
        return {"axes": compiled_bytes_per_axis(compiled, mesh, plan), "inventory": _inventory(compiled, mesh, plan)}
    except ValueError as e:     # the pipelined inventory reads jaxpar's tick loop
        return {"axes": {}, "axes_error": str(e), "inventory": {}}


def recount(target: str, plan: cost.Plan, path: str) -> dict:
    """:func:`count` from a case's HLO text (a deviceless program: partition ``i`` is ``mesh.devices.flat[i]``)."""
    from jaxpar.mesh import make_mesh
    from jaxpar.devices import parse_target, target_devices

    mesh = make_mesh({k: v for k, v in plan.sizes.items() if v > 1} or {"data": 1},
                     devices=target_devices(parse_target(target)))
    with gzip.open(path, "rt") as f:
        return count(f.read(), mesh, plan)


def _inventory(compiled, mesh, plan) -> dict:
    """Bytes per step by (kind, axes), loops counted by trip count; for a pipelined plan, on the device
    of the stage that moves the most bytes (the tick loop's branches weighted as in ``axes``)."""
    from jaxpar.analysis._axis_bytes import stage_branch_weights
    from jaxpar.analysis import collectives
    from jaxpar.analysis import trip_counts

    text = compiled if isinstance(compiled, str) else compiled.as_text()
    colls = collectives(compiled, mesh)
    weights = stage_branch_weights(compiled, mesh, plan) if plan.pipe > 1 else [None]
    best: dict[str, float] = {}
    for w in weights:
        mult, out = trip_counts(text, w), {}
        for c in colls:
            key = f"{c.kind} {','.join(c.axes or ())}"
            out[key] = out.get(key, 0.0) + c.bytes * mult.get(c.computation, 1)
        best = max(best, out, key=lambda d: sum(d.values()))
    return best


def predict(model: cost.ModelSpec, target: str, plan: cost.Plan) -> dict:
    """The cost model's side: bytes per axis, argument bytes and peak bytes on one device."""
    platform = "tpu" if target.startswith("tpu") else "cuda"
    lowering = lowering_for_platform(platform)
    return {"axes": bytes_per_axis(comms(model, plan, lowering=lowering, compute_bytes=4, grad_bytes=4)),
            "arguments": device_argument_bytes(model, plan.sizes, plan.strategy.zero,
                                               layout=layout_for_platform(platform)),
            "peak": memory_per_device(model, plan, precision="fp32", activation_bytes=4, keeps=platform).total}


def _err(p: float, g: float) -> float:
    return abs(p - g) / g if g else float(p > 0)


def row(key: str, pred: dict, got: dict, capacity: float | None = None) -> dict:
    axes = {a: {"predicted": pred["axes"].get(a, 0.0), "compiled": got["axes"].get(a, 0.0),
                "error": _err(pred["axes"].get(a, 0.0), got["axes"].get(a, 0.0))}
            for a in sorted(set(pred["axes"]) | set(got["axes"]))}
    if got.get("axes_error"):
        axes = {}
    return {"case": key, "axes": axes, "axes_error": got.get("axes_error"),
            "arguments": {"predicted": pred["arguments"], "compiled": got["arguments"],
                          "error": _err(pred["arguments"], got["arguments"])},
            "peak": {"predicted": pred["peak"], "compiled": got["peak"], "error": _err(pred["peak"], got["peak"]),
                     "fits": capacity is None or got["peak"] <= capacity, "live": got.get("xla_peak")},
            "compile_s": got.get("compile_s"), "inventory": got.get("inventory", {})}


def table(rows: list[dict], refused: list[tuple[str, str]] = ()) -> str:
    """The Markdown table of ``rows``, then a line for each case the compiler ``refused`` (case, error)."""
    lines = ["| case | bytes per axis: error (compiled GB) | args error | peak pred / compiled GB (error) | "
             "XLA's live peak GB (error) | compile s |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        ax = ", ".join(f"{a} {v['error']:.2%} ({v['compiled'] / 1e9:.3g})" for a, v in r["axes"].items())
        ax = ax or f"not counted ({r['axes_error']})"
        pk = r["peak"]
        live = pk.get("live")
        near = not live or live >= 0.99 * pk["compiled"]
        live = "same" if near else f"{live / 1e9:.2f} ({_err(pk['predicted'], live):.1%})"
        lines.append(f"| {r['case']} | {ax} | {r['arguments']['error']:.2%} | {pk['predicted'] / 1e9:.2f} / "
                     f"{pk['compiled'] / 1e9:.2f} ({pk['error']:.1%}{'' if pk['fits'] else ', does not fit'}) | "
                     f"{live} | {r['compile_s']} |")
    lines += [f"| {key} | not compiled: {error} | - | - | - | - |" for key, error in refused]
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    worst_axis = max(((v["error"], r["case"], a) for r in rows for a, v in r["axes"].items()), default=None)
    worst_args = max((r["arguments"]["error"], r["case"]) for r in rows)
    fit = [r for r in rows if r["peak"]["fits"]]
    worst_peak = max(((r["peak"]["error"], r["case"]) for r in fit), default=None)
    return {"worst_axis": worst_axis, "worst_arguments": worst_args, "worst_peak_fitting": worst_peak,
            "axes_within_2pct": sum(v["error"] <= 0.02 for r in rows for v in r["axes"].values()),
            "axes_total": sum(len(r["axes"]) for r in rows),
            "peak_within_10pct": sum(r["peak"]["error"] <= 0.10 for r in fit), "fitting": len(fit)}


def _capacity(target: str) -> float:
    from jaxpar.devices import parse_target

    return parse_target(target).capacity_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows and the measured side as JSON")
    ap.add_argument("--measured", help="reuse the measured side of this JSON (no compiling)")
    ap.add_argument("--only", default="", help="run only the cases whose key contains this text")
    ap.add_argument("--hlo", help="keep each compiled program's HLO text in this folder, and count the "
                                  "collectives of a case from its text when it is there")
    ap.add_argument("--precision", action="store_true", help="run the bf16 and FP8 cases (PRECISION_CASES)")
    args = ap.parse_args(argv)
    if args.precision:
        print(precision_table(precision_rows(args)))
        return 0
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
    measured = json.load(open(args.measured))["measured"] if args.measured else {}
    if args.out and os.path.exists(args.out) and not args.measured:
        measured = json.load(open(args.out))["measured"]          # resume
    rows, refused = [], []
    for name, batch, target, plan in CASES:
        key = case_key(name, batch, target, plan)
        if args.only not in key:
            continue
        model = case_model(name, batch)
        if key not in measured and args.measured:
            continue
        hlo = os.path.join(args.hlo, key.replace(" ", "_").replace(":", "-") + ".hlo.gz") if args.hlo else None
        if key not in measured:
            measured[key] = _measure_or_refusal(model, target, plan, hlo)
            print(f"compiled {key}: {measured[key].get('compile_s', measured[key].get('compile_error'))}",
                  file=sys.stderr, flush=True)
        elif hlo and os.path.exists(hlo):
            measured[key] = {k: v for k, v in measured[key].items() if k != "axes_error"} | recount(target, plan, hlo)
        if "compile_error" in measured[key]:
            refused.append((key, measured[key]["compile_error"]))
        else:
            rows.append(row(key, predict(model, target, plan), measured[key], _capacity(target)))
        if args.out:
            _write(args.out, rows, measured)
    print(table(rows, refused))
    print(json.dumps(summary(rows), indent=1))
    return 0


def _write(path: str, rows: list[dict], measured: dict) -> None:
    """The rows, their summary (when they have peaks), the measured side and where they were measured."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"date": date.today().isoformat(), "commit": head, "machine": f"{platform.machine()} {platform.node()}",
           "cpus": os.cpu_count()}
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows, "summary": summary(rows) if rows and "peak" in rows[0] else {},
                   "measured": measured}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
