"""One GPU, one call: context parallelism's fused blocks (the flash block kernel) against XLA's blocks.

A context axis of C devices is emulated on one GPU: the methods' per-device code
(``jaxpar.parallel.context._methods``: ring, all-gather, Ulysses) runs under
``jax.vmap(axis_name="context", axis_size=C)``, so its ``ppermute``, ``all_gather`` and ``axis_index`` are
the real ones, batched. Each row is the whole context axis's work on one GPU. Sections, each skipped once
``--budget`` seconds have passed, each written to ``DIR/context_gpu.json`` as it finishes:

- ``checks``: C = 4, 8,192 tokens, 32 / 8 heads of 128 (GQA), bf16 inputs: the fused blocks
  (``kernel="pallas"``) and XLA's blocks (``kernel="xla"``), forward and the three input gradients, relative L2
  error against one device's whole-sequence XLA attention in fp32 at ``highest`` matmul precision; ``ok``
  when each fused error is at most twice XLA's own (or 1e-2, as ``benchmarks/gpu.py``'s checks);
- ``vma``: the ring in a real ``shard_map`` with ``check_vma=True`` on a one-device ``context`` mesh (the
  kernels' outputs typed as varying), against the same call without the check;
- ``times``: C = 8, 32,768 and 65,536 tokens: milliseconds per forward + backward of the whole context axis,
  fused and XLA's blocks, the compiled temporaries, and one device's cuDNN attention over the whole sequence
  as the yardstick (the same FLOPs);
- ``tune``: the flash block kernel's tile and Triton launch settings, on the balanced causal ring at 32,768.

Usage: ``python benchmarks/context_gpu.py --out DIR`` on one H100 or H200 (at most 7 minutes); ``--small``
runs tiny shapes on any backend (on the CPU the kernel runs in Pallas's interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

from jaxpar.attention import attention, dense_attention, use_attention_kernel
from jaxpar.devices._device_rates import _median_seconds as median_seconds
from jaxpar.parallel import context as cp
from jaxpar.parallel.context import _flash
from jaxpar.parallel.context._methods import _LOCAL, _Call

from gpu import run_sections

PARTS = ("out", "dq", "dk", "dv")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(t, heads, kv_heads, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((1, t, heads, d), (1, t, kv_heads, d), (1, t, kv_heads, d), (1, t, heads, d))
    return [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes)]


def packed(t, documents=6, seed=0):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, t), documents - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(t), side="right")[None], jnp.int32)


def emulated(method, size, *, causal, balance, kernel, segments):
    """A jitted ``(q, k, v, dout) -> (out, dq, dk, dv)`` of ``method`` over an emulated context axis of
    ``size``: inputs and outputs in the natural order, whole sequences."""
    on_gpu = jax.default_backend() == "gpu"
    interpret = kernel == "pallas" and not on_gpu

    def local(q, k, v, seg):
        call = _Call(size, causal, q.shape[-1] ** -0.5, balance, dense=dense_attention, kernel=kernel,
                     interpret=interpret)
        return _LOCAL[method](call, q, k, v, seg, None)

    def shards(x):
        x = cp.to_balanced(x, 1, size) if balance else x
        return jnp.moveaxis(x.reshape(x.shape[0], size, -1, *x.shape[2:]), 1, 0)

    def whole(x):
        x = jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])
        return cp.from_balanced(x, 1, size) if balance else x

    ring = jax.vmap(local, axis_name=cp.CONTEXT, axis_size=size)

    def f(q, k, v, dout):
        seg = shards(segments) if segments is not None else None
        out, vjp = jax.vjp(lambda q, k, v: whole(ring(shards(q), shards(k), shards(v), seg)), q, k, v)
        return (out, *vjp(dout.astype(out.dtype)))
    return jax.jit(f)


def reference(causal, segments):
    def f(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=segments), q, k, v)
        return (out, *vjp(dout))
    return jax.jit(f)


CHECKS = [  # name, method, causal, balance, packed, kv_heads (of 32)
    ("ring causal", "ring", True, False, False, 8),
    ("ring causal balanced", "ring", True, True, False, 8),
    ("ring packed", "ring", True, False, True, 8),
    ("ring packed balanced", "ring", True, True, True, 8),
    ("ring full (not causal)", "ring", False, False, False, 8),
    ("ring causal MHA", "ring", True, False, False, 32),
    ("all-gather causal", "all_gather", True, False, False, 8),
    ("all-gather packed balanced", "all_gather", True, True, True, 8),
    ("ulysses packed", "ulysses", True, False, True, 8),
]


def run_checks(small: bool) -> list[dict]:
    size, t, heads, d = (4, 512, 4, 16) if small else (4, 8192, 32, 128)
    rows = []
    for name, method, causal, balance, pack, kv in CHECKS:
        kv = max(kv * heads // 32, 1)
        q, k, v, do = inputs(t, heads, kv, d, jnp.bfloat16)
        seg = packed(t) if pack else None
        with use_attention_kernel("xla"), jax.default_matmul_precision("highest"):
            want = reference(causal, seg)(*[x.astype(jnp.float32) for x in (q, k, v, do)])
        row = {"case": name, "tokens": t, "context": size}
        for kernel in ("xla", "pallas"):
            try:
                with use_attention_kernel("xla" if kernel == "xla" else "auto"):   # Ulysses: the one-device kernel
                    got = emulated(method, size, causal=causal, balance=balance, kernel=kernel, segments=seg)(
                        q, k, v, do)
                row[kernel] = {p: rel(g, w) for p, g, w in zip(PARTS, got, want)}
            except Exception as e:                       # noqa: BLE001 - report, go on
                row[kernel] = f"{type(e).__name__}: {str(e)[:400]}"
        if isinstance(row["xla"], dict) and isinstance(row["pallas"], dict):
            row["ok"] = all(row["pallas"][p] <= max(2 * row["xla"][p], 1e-2) for p in PARTS)
            row["fused_over_xla"] = {p: round(row["pallas"][p] / row["xla"][p], 3) for p in PARTS}
        rows.append(row)
        print("check", json.dumps(row), flush=True)
        del want
    return rows


def run_vma(small: bool) -> dict:
    t, heads, d = (128, 4, 16) if small else (4096, 32, 128)
    q, k, v, do = inputs(t, heads, heads // 4, d, jnp.bfloat16)
    seg = packed(t)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("context",))
    seq = jax.sharding.PartitionSpec(None, "context")
    interpret = jax.default_backend() != "gpu"
    results = {}
    for check in (True, False):
        ring = functools.partial(cp.ring_attention, axis_name="context", kernel="pallas", interpret=interpret)
        call = jax.shard_map(lambda q, k, v, s: ring(q, k, v, s, s), mesh=mesh, in_specs=(seq,) * 4, out_specs=seq,
                             check_vma=check)

        def f(q, k, v, do):
            out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, seg), q, k, v)
            return (out, *vjp(do))
        try:
            results[check] = jax.jit(f)(q, k, v, do)
        except Exception as e:                           # noqa: BLE001
            return {"check_vma": True, "error": f"{type(e).__name__}: {str(e)[:600]}"}
    row = {"check_vma": True, "max_abs_diff": max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                                                 for a, b in zip(results[True], results[False]))}
    print("vma", row, flush=True)
    return row


def attention_flops(t, heads, d, causal=True) -> float:
    """Forward + backward matmul FLOPs of one attention over ``t`` tokens (2 + 5 GEMMs; causal: half)."""
    return 2 * t * t * heads * d * 7 / (2 if causal else 1)


def timed(fn, args, reps) -> dict:
    compiled = fn.lower(*args).compile()
    ms = 1e3 * median_seconds(compiled, args, reps)
    temps = compiled.memory_analysis().temp_size_in_bytes
    return {"ms": round(ms, 3), "temp_gib": round(temps / 2**30, 3)}


TIMES = [  # method, balance, packed
    ("ring", False, False), ("ring", True, False), ("ring", True, True), ("all_gather", True, False),
]


def run_times(small: bool, reps: int, lengths: list[int]) -> list[dict]:
    size, heads, kv, d = (4, 4, 1, 16) if small else (8, 32, 8, 128)
    rows = []
    for t in ([512] if small else lengths):
        q, k, v, do = inputs(t, heads, kv, d, jnp.bfloat16)
        flops = attention_flops(t, heads, d)
        base = {"tokens": t, "context": size, "heads": f"{heads}/{kv}x{d}"}
        for one in ("cudnn", "pallas") if jax.default_backend() == "gpu" else ():
            row = {**base, "case": f"one device, {one}, whole sequence"}
            try:
                with use_attention_kernel(one):
                    row.update(timed(reference(True, None), (q, k, v, do), reps))
                row["tflops"] = round(flops / row["ms"] / 1e9, 1)
            except Exception as e:                       # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print("time", json.dumps(row), flush=True)
        for method, balance, pack in TIMES:
            seg = packed(t) if pack else None
            for kernel in ("pallas", "xla"):
                name = f"{method}{' balanced' if balance else ''}{' packed' if pack else ''}, {kernel} blocks"
                row = {**base, "case": name}
                try:
                    with use_attention_kernel("xla" if kernel == "xla" else "auto"):
                        fn = emulated(method, size, causal=True, balance=balance, kernel=kernel, segments=seg)
                        row.update(timed(fn, (q, k, v, do), reps))
                    row["tflops"] = round(flops / row["ms"] / 1e9, 1)
                except Exception as e:                   # noqa: BLE001 - XLA's blocks may not fit
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print("time", json.dumps(row), flush=True)
    return rows


TUNE = [(64, 4, 2), (128, 4, 2), (128, 8, 2), (64, 4, 3), (128, 8, 3), (64, 8, 2)]  # tile, warps, stages


def run_tune(small: bool, reps: int, length: int) -> list[dict]:
    size, t, heads, kv, d = (4, 512, 4, 1, 16) if small else (8, length, 32, 8, 128)
    q, k, v, do = inputs(t, heads, kv, d, jnp.bfloat16)
    saved = (_flash.TILE, _flash._TRITON)
    rows = []
    for tile, warps, stages in TUNE:
        _flash.TILE, _flash._TRITON = tile, plgpu.CompilerParams(num_warps=warps, num_stages=stages)
        row = {"tile": tile, "num_warps": warps, "num_stages": stages, "tokens": t}
        try:
            row.update(timed(emulated("ring", size, causal=True, balance=True, kernel="pallas", segments=None),
                             (q, k, v, do), reps))
        except Exception as e:                           # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            _flash.TILE, _flash._TRITON = saved
        rows.append(row)
        print("tune", json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default="out/context_gpu")
    ap.add_argument("--sections", default="checks,vma,times,tune")
    ap.add_argument("--lengths", default="32768,65536")
    ap.add_argument("--tune-length", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=360.0)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "sections_s": {}}
    runs = {"checks": lambda: run_checks(args.small), "vma": lambda: run_vma(args.small),
            "times": lambda: run_times(args.small, args.reps, [int(x) for x in args.lengths.split(",")]),
            "tune": lambda: run_tune(args.small, args.reps, args.tune_length)}
    run_sections(runs, args.sections.split(","), args.budget, out_dir / "context_gpu.json", result)

if __name__ == "__main__":
    main()
