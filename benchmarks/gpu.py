"""One GPU, one call: fused attention against XLA's, the GPT-124M and Llama-3-8B-shaped train steps, FP8.

Run on one H100 or H200 (``python benchmarks/gpu.py --out DIR``, at most 8 minutes); ``--small`` runs tiny
shapes on any backend (a smoke test: on the CPU the Pallas kernel runs in its interpreter). Sections, each
skipped once ``--budget`` seconds have passed, each written to ``DIR/gpu.json`` as it finishes:

- ``checks``: each fused kernel against XLA's path, bf16 inputs, the forward and the three input gradients,
  relative L2 error against XLA's path run in fp32 (the reference), beside XLA's own bf16 error;
- ``kernels``: milliseconds per attention (forward + backward) per kernel and shape;
- ``gpt124m``: ``configs/gpt124m_gpu.yaml``'s model, optimizer and strategy (GPT 12 x 768, 16 x 1024 tokens,
  bf16 compute, fp32 master weights, AdamW, clip 1, remat save-matmuls) per attention kernel;
- ``decoder``: a Llama-3-8B-shaped Decoder cut to ``--layers`` layers at ``--seq`` tokens, bf16 and FP8
  (tensorwise), XLA's attention and the default, and bf16 with the loss in 8 pieces of the vocabulary;
- ``flags``: the GPT step again in a fresh process per XLA_FLAGS setting;
- ``calibrate``: the cost model's GEMM efficiency and memory bandwidth measured on the card
  (:func:`jaxpar.devices.calibrate_device`), written to ``DIR/cluster.yaml``.

Each step row: ms (median), tokens/s, MFU (6 x parameters + 12 x layers x seq x width FLOPs a token, recompute
excluded, over ``--peak``), the compiled program's memory, and the cost model's step time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar import cost
from jaxpar.models import GPT, Decoder, DecoderConfig, GPTConfig, decoder_loss, lm_loss
from jaxpar.options import Fp8
from jaxpar.analysis._fused_attention import attention_report
from jaxpar.devices._device_rates import _median_seconds as median_seconds
from jaxpar.attention import _kernels as kernels_module
from jaxpar.attention import attention, use_attention_kernel
from jaxpar.strategy import Strategy

GPT124M = dict(vocab=50304, seq_len=1024, embed=768, heads=12, layers=12, remat="save-matmuls")
LLAMA3_8B = dict(vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336)
FLAGS = {"none": "", "latency-hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
         "no-command-buffers": "--xla_gpu_enable_command_buffer="}
START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def median_ms(fn, *args, reps: int) -> float:
    """Median milliseconds of ``fn(*args)`` over ``reps`` runs after one warm-up, each run waited for."""
    return 1e3 * median_seconds(fn, args, reps)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def qkv(shape, kv_heads, dtype, seed=0):
    b, t, h, d = shape
    k0, k1, k2, k3 = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k0, (b, t, h, d), dtype), jax.random.normal(k1, (b, t, kv_heads, d), dtype),
            jax.random.normal(k2, (b, t, kv_heads, d), dtype), jax.random.normal(k3, (b, t, h, d), dtype))


def attention_vjp(causal=True, segment_ids=None, window=None, softcap=None):
    """A jitted ``(q, k, v, dout) -> (out, dq, dk, dv)`` of :func:`attention`: call it inside
    ``use_attention_kernel`` (entering one clears JAX's caches: time inside it)."""
    def f(q, k, v, dout):
        def out(q, k, v):
            return attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window, softcap=softcap)
        o, vjp = jax.vjp(out, q, k, v)
        return (o, *vjp(dout.astype(o.dtype)))
    return jax.jit(f)


def segments(b, t, pieces=4, seed=0):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, t), pieces - 1, replace=False))
    return jnp.asarray(np.tile(np.searchsorted(cuts, np.arange(t), side="right"), (b, 1)), jnp.int32)


def check_cases(small: bool):
    b, t, h, d = (2, 128, 4, 32) if small else (2, 1024, 8, 128)
    seg = segments(b, t)
    return [  # name, kv_heads, mask kwargs, kernels
        ("causal", h, {}, ("cudnn", "pallas")),
        ("full", h, {"causal": False}, ("cudnn", "pallas")),
        ("gqa causal", h // 4, {}, ("cudnn", "pallas")),
        ("packed segments", h // 4, {"segment_ids": seg}, ("pallas",)),
        ("window 256", h // 4, {"window": 32 if small else 256}, ("cudnn",)),
        ("soft-cap 50", h // 4, {"softcap": 50.0}, ("auto",)),
    ], (b, t, h, d)


def run_checks(small: bool, kernels_here) -> list[dict]:
    cases, shape = check_cases(small)
    rows = []
    for name, kv, kw, kernels in cases:
        q, k, v, do = qkv(shape, kv, jnp.bfloat16)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        with use_attention_kernel("xla"):
            ref = attention_vjp(**kw)(*f32)
            xla16 = attention_vjp(**kw)(q, k, v, do)
        for kernel in kernels:
            if kernel not in kernels_here and kernel != "auto":
                continue
            try:
                with use_attention_kernel(kernel):
                    got = attention_vjp(**kw)(q, k, v, do)
            except Exception as e:                       # noqa: BLE001 - report, go on
                rows.append({"case": name, "kernel": kernel, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            errs = {part: rel(g, r) for part, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
            base = {part: rel(g, r) for part, g, r in zip(("out", "dq", "dk", "dv"), xla16, ref)}
            rows.append({"case": name, "kernel": kernel, "rel_err": errs, "xla_bf16_rel_err": base,
                         "ok": all(errs[p] <= max(2 * base[p], 1e-2) for p in errs)})
            print(f"check {name:16s} {kernel:6s} " + " ".join(f"{p} {errs[p]:.2e} (xla {base[p]:.2e})" for p in errs),
                  flush=True)
    return rows


def run_kernels(small: bool, kernels_here, reps: int) -> list[dict]:
    shapes = [("gpt124m 16x1024 12h d64", (16, 1024, 12, 64), 12, {}),
              ("llama 2x4096 32/8h d128", (2, 4096, 32, 128), 8, {}),
              ("llama packed 2x4096", (2, 4096, 32, 128), 8, {"segment_ids": segments(2, 4096, 8)}),
              ("llama 1x32768 causal", (1, 32768, 32, 128), 8, {})]
    if small:
        shapes = [("small 2x128 4h d32", (2, 128, 4, 32), 2, {})]
    rows = []
    for name, shape, kv, kw in shapes:
        q, k, v, do = qkv(shape, kv, jnp.bfloat16)
        for kernel in ("xla",) + tuple(kernels_here) + (("pallas-b32",) if "pallas" in kernels_here else ()):
            if kernel == "xla" and shape[1] > 8192:
                rows.append({"shape": name, "kernel": kernel, "skipped": "[S, S] scores do not fit"})
                continue
            saved = dict(kernels_module.PALLAS_BLOCKS)
            if kernel == "pallas-b32":                   # jax's default backward blocks (32 x 32)
                kernels_module.PALLAS_BLOCKS.update(block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
            try:
                with use_attention_kernel(kernel.split("-")[0]):
                    ms = median_ms(attention_vjp(**kw), q, k, v, do, reps=reps)
            except Exception as e:                       # noqa: BLE001
                rows.append({"shape": name, "kernel": kernel, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            finally:
                kernels_module.PALLAS_BLOCKS.update(saved)
            b, t, h, d = shape
            flops = 2 * b * t * t * h * d * 7 / 2                # 2 forward + 5 backward GEMMs, causal: half
            rows.append({"shape": name, "kernel": kernel, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
            print(f"kernel {name:28s} {kernel:6s} {ms:8.3f} ms", flush=True)
    return rows


def tokens_batch(vocab, b, t, seed=1):
    tokens = np.random.default_rng(seed).integers(0, vocab, (b, t + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def step_row(name, *args, kernel, **kw):
    """:func:`time_step`, or the error it raised (the other rows still run)."""
    try:
        return time_step(name, *args, kernel=kernel, **kw)
    except Exception as e:                               # noqa: BLE001
        print(f"step {name} {kernel}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        return {"step": name, "kernel": kernel, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        gc.collect()


def time_step(name, model_fn, loss, tx, strategy, batch, *, kernel, reps, flops_per_token, peak, predicted):
    mesh = jaxpar.make_mesh({"data": len(jax.devices())})
    with use_attention_kernel(kernel):
        state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
        step = jaxpar.make_train_step(loss, tx, layout, strategy, clip_norm=1.0)
        compiled, compile_s, state, m, times = run_steps(step, state, jaxpar.shard_batch(batch, mesh), warmup=2,
                                                         reps=reps)
    ms = 1e3 * statistics.median(times)
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    tokens = batch["tokens"].size
    row = {"step": name, "kernel": kernel, "ms": round(ms, 2), "tokens_per_s": round(tokens / ms * 1e3),
           "mfu": round(tokens * flops_per_token / (ms / 1e3) / peak, 4), "loss": float(m["loss"]),
           "compile_s": round(compile_s, 1),
           "peak_gib": round((mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                              + mem.temp_size_in_bytes) / 2**30, 2),
           "temp_gib": round(mem.temp_size_in_bytes / 2**30, 2),
           "fused_forwards": attention_report(text, batch["tokens"].shape[1]).fused,
           "cost_model_ms": None if predicted is None else round(predicted * 1e3, 2)}
    row["measured_over_model"] = None if predicted is None else round(ms / 1e3 / predicted, 3)
    del state
    print(f"step {name:28s} {kernel:6s} {ms:8.2f} ms  MFU {row['mfu']:.3f}  peak {row['peak_gib']} GiB  "
          f"model {row['cost_model_ms']} ms  compile {row['compile_s']} s", flush=True)
    return row


def run_steps(step, state, data, *, warmup: int, reps: int):
    """Compile ``step`` for ``(state, data)``, run ``warmup`` steps, then time ``reps`` (each waited for):
    ``(compiled, compile seconds, state, the last metrics, seconds per timed step)``."""
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, m = step(state, data)
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    return compiled, compile_s, state, m, times


def n_params(model_fn) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(model_fn), nnx.Param)))


def predicted_seconds(spec, plan) -> float | None:
    """The cost model's step time on the card's preset (``h200`` on an H200, else ``h100``)."""
    card = "h200" if "H200" in jax.devices()[0].device_kind else "h100"
    try:
        return cost.evaluate(spec, plan, cost.load_cluster(card).with_devices(1), dtype="bfloat16",
                             lowering="xla").time.total
    except Exception as e:                                # noqa: BLE001 - the table says none
        print("cost model:", type(e).__name__, e, flush=True)
        return None


def run_gpt(small, kernels_here, reps, peak, remat_none=True) -> list[dict]:
    sizes = dict(GPT124M, vocab=256, seq_len=128, embed=64, heads=4, layers=2) if small else GPT124M
    b = 2 if small else 16
    cfg = GPTConfig(**sizes)
    model_fn = lambda: GPT(cfg, rngs=nnx.Rngs(0))        # noqa: E731
    n = n_params(model_fn)
    fpt = 6 * n + 12 * cfg.layers * cfg.seq_len * cfg.embed
    sched = optax.warmup_cosine_decay_schedule(0.0, 6e-4, 100, 500)
    tx = optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1)
    spec = cost.gpt(layers=cfg.layers, hidden=cfg.embed, heads=cfg.heads, seq=cfg.seq_len, vocab=cfg.vocab, batch=b)
    predicted = predicted_seconds(spec, cost.Plan(remat=cfg.remat))
    batch = tokens_batch(cfg.vocab, b, cfg.seq_len)
    strategy = jaxpar.Strategy(compute_dtype="bfloat16")
    rows = [step_row("gpt124m", model_fn, lm_loss, tx, strategy, batch, kernel=k, reps=reps,
                     flops_per_token=fpt, peak=peak, predicted=predicted)
            for k in kernels_here]
    if not remat_none:
        return rows
    cfg = GPTConfig(**dict(sizes, remat="none"))
    predicted = predicted_seconds(spec, cost.Plan(remat="none"))
    rows.append(step_row("gpt124m remat none", lambda: GPT(cfg, rngs=nnx.Rngs(0)), lm_loss, tx, strategy, batch,
                         kernel="auto", reps=reps, flops_per_token=fpt, peak=peak, predicted=predicted))
    return rows


#: ``precision-kernel[-piecesN]``: ``piecesN``, the loss in N pieces of the vocabulary (``loss_chunks``).
DECODER_VARIANTS = ("bf16-xla", "bf16-auto", "bf16-pallas", "fp8-auto", "bf16-auto-pieces8")


def run_decoder(small, layers, seq, batch_rows, reps, peak, variants=DECODER_VARIANTS) -> list[dict]:
    sizes = dict(vocab=256, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=128) if small else LLAMA3_8B
    cfg = DecoderConfig(**sizes, layers=layers)
    n = n_params(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    fpt = 6 * n + 12 * layers * seq * cfg.heads * cfg.head_dim
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    batch = tokens_batch(cfg.vocab, batch_rows, seq)
    # jaxpar.cost's GPT with the Decoder's parameters per layer: its gated MLP and GQA have no terms of their own
    mlp = (n - 2 * cfg.vocab * cfg.embed) // layers // (2 * cfg.embed) - 2 * cfg.embed
    spec = cost.gpt(layers=layers, hidden=cfg.embed, heads=cfg.heads, seq=seq, vocab=cfg.vocab, batch=batch_rows,
                    mlp=mlp)
    rows = []
    recipe = Fp8(min_dim=0 if small else 1024)
    for variant in variants:
        precision, kernel, *pieces = variant.split("-")
        chunks = int(pieces[0].removeprefix("pieces")) if pieces else 1
        name, fp8 = ("bf16", None) if precision == "bf16" else ("fp8 tensorwise", recipe)
        name += f", the loss in {chunks} pieces" if chunks > 1 else ""
        strategy = jaxpar.Strategy(compute_dtype="bfloat16", fp8=fp8)
        predicted = predicted_seconds(replace(spec, loss_chunks=chunks), cost.Plan(strategy=Strategy(fp8=fp8)))
        pieced = replace(cfg, loss_chunks=chunks)
        model_fn = lambda: Decoder(pieced, rngs=nnx.Rngs(0))    # noqa: E731
        rows.append(step_row(f"decoder {layers}L {name}", model_fn, decoder_loss, tx, strategy, batch,
                             kernel=kernel, reps=reps, flops_per_token=fpt, peak=peak, predicted=predicted))
    return rows


def run_calibrate(args) -> dict:
    """The device's GEMM efficiency curve and memory bandwidth (``jaxpar calibrate --device``), written as a
    cluster YAML beside gpu.json: the cost model's check on the steps it was not fitted on is done from it."""
    from jaxpar.devices import calibrate_device
    small = dict(shapes=((256, 256, 256), (512, 512, 512)), stream_bytes=2**22, host_bytes=2**22) if args.small else {}
    got = calibrate_device(Path(args.out) / "cluster.yaml", reps=args.reps, **small)
    return {"fit": got["fit"], "stream_gbps": round(got["stream_gbps"]), "gemms": got["gemms"], "host": got["host"]}


def run_flags(args) -> list[dict]:
    rows = []
    for name, flags in FLAGS.items():
        if elapsed() > args.budget - 60:
            rows.append({"flags": name, "skipped": "budget"})
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(),
                   XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")    # beside this process's 75%
        cmd = [sys.executable, __file__, "--sections", "gpt124m", "--gpt-kernels", "auto", "--no-gpt-remat-none",
               "--reps", str(args.reps),
               "--out", str(Path(args.out) / f"flags-{name}")] + (["--small"] if args.small else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(60, args.budget - elapsed()))
        try:
            got = json.loads((Path(args.out) / f"flags-{name}" / "gpu.json").read_text())["gpt124m"]
            rows.append({"flags": name, "xla_flags": flags, **got[-1]})
        except (OSError, KeyError, IndexError, ValueError):
            rows.append({"flags": name, "error": proc.stderr[-500:]})
        print(f"flags {name:20s} {rows[-1].get('ms')} ms", flush=True)
    return rows


def run_sections(runs: dict, sections: list[str], budget: float, path: Path, result: dict) -> None:
    """Run each of ``sections`` (``runs[name]()``) into ``result`` while ``budget`` seconds have not passed,
    an error recorded and the next one run, ``result`` written to ``path`` after each."""
    for section in sections:
        if elapsed() > budget:
            result[section] = "skipped: budget"
            continue
        t = time.perf_counter()
        try:
            result[section] = runs[section]()
        except Exception as e:                            # noqa: BLE001 - the other sections still run
            result[section] = f"error: {type(e).__name__}: {str(e)[:1000]}"
            print(section, result[section], flush=True)
        result.setdefault("sections_s", {})[section] = round(time.perf_counter() - t, 1)
        path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["sections_s"]), f"total {elapsed():.0f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--sections", default="checks,gpt124m,decoder,kernels,flags")
    ap.add_argument("--gpt-kernels", default="xla,cudnn,pallas")
    ap.add_argument("--gpt-remat-none", default=True, action=argparse.BooleanOptionalAction)
    ap.add_argument("--decoder-variants", default=",".join(DECODER_VARIANTS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=989e12)
    ap.add_argument("--budget", type=float, default=420.0)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    kernels_here = ("cudnn", "pallas") if on_gpu else ("pallas",)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "sections_s": {}}
    runs = {"checks": lambda: run_checks(args.small, kernels_here),
            "kernels": lambda: run_kernels(args.small, kernels_here, args.reps),
            "gpt124m": lambda: run_gpt(args.small, tuple(k for k in args.gpt_kernels.split(",") if on_gpu or k != "cudnn"),
                                       args.reps, args.peak, args.gpt_remat_none),
            "decoder": lambda: run_decoder(args.small, 2 if args.small else args.layers, 128 if args.small else args.seq,
                                           args.batch, args.reps, args.peak, args.decoder_variants.split(",")),
            "flags": lambda: run_flags(args),
            "calibrate": lambda: run_calibrate(args)}
    run_sections(runs, args.sections.split(","), args.budget, out_dir / "gpu.json", result)

if __name__ == "__main__":
    main()
