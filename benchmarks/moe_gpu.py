"""One GPU, one call: MoE's routed experts by the grouped kernels (``jaxpar.parallel.moe._grouped``, Pallas
Triton), by the tile loop and as the dense twin, at Qwen3-30B-A3B's shape (embed 2048, 128 gated SwiGLU experts of
hidden 768, top-8; the twin a dense SwiGLU MLP of hidden 8 x 768 on the same tokens), bf16.

Sections, each skipped once ``--budget`` seconds have passed, each written to ``DIR/moe_gpu.json`` as it ends:

- ``numerics``: the routed MLP's output and its gradients (x, the combine weights, w1, w2, w3), bf16, by the
  grouped kernels and by the tile loop, each against the tile loop in fp32 at ``highest`` matmul precision
  (relative L2 error), at three routings: balanced, skewed, one expert empty;
- ``gemms``: each grouped kernel alone over the routed rows (``--tokens`` tokens x top-8, balanced): the forward
  ``X W`` (D -> M), the input gradient ``G W^T`` (M <- D) and the weight gradient ``X^T G``: ms and TFLOP/s
  (the routed rows' FLOPs, padding not counted);
- ``layer``: the routed MLP forward, and forward + backward, by the grouped kernels, the tile loop and the dense
  twin: ms, TFLOP/s of the routed rows (the twin: its own FLOPs, the same), per routing: ``balanced`` (forced:
  token t's j-th choice is expert ``(t k + j) mod E``, each expert gets ``N k / E`` rows), ``router`` (a
  randomly initialised router's top-k of random tokens: the load CV is reported) and ``skewed`` (experts
  drawn with lognormal popularity of load CV about 0.6, what aux-free training reached on the CPU,
  docs/benchmarks.md §12);
- ``step``: the MoE GPT (``--layers`` layers, embed 2048, 16 heads, the experts above, dropless) against its
  dense twin, one train step (bf16 compute, fp32 master weights, SGD) by each kernel: ms, tokens/s and MFU
  on active parameters (``6 x active parameters + 12 x layers x seq x width`` FLOPs a token over ``--peak``;
  the routed experts count ``top_k`` of ``experts``), the router as initialised (not forced to balance).

Usage: ``python benchmarks/moe_gpu.py --out DIR`` on one H100 or H200 (at most 8 minutes); ``--small`` runs the
same code at tiny shapes on any backend (off a GPU the grouped kernels run in Pallas's interpreter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import GPT, GPTConfig, MoESettings, lm_loss
from jaxpar.devices._device_rates import _median_seconds as median_seconds
from jaxpar.parallel.moe import routed_mlp, use_moe_kernel
from jaxpar.parallel.moe._dispatch import _padded, _sorted, _tiles
from jaxpar.parallel.moe._grouped import Groups, grouped_matmul, grouped_weight_grad

SHAPE = dict(embed=2048, heads=16, mlp=768, experts=128, top_k=8, tile=128)
SMALL = dict(embed=64, heads=4, mlp=32, experts=8, top_k=2, tile=16)
KERNELS = ("grouped", "loop")
ROUTINGS = ("balanced", "router", "skewed")
START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def median_ms(fn, *args, reps: int) -> float:
    """Median milliseconds of ``fn(*args)`` over ``reps`` runs after one warm-up, each run waited for."""
    return 1e3 * median_seconds(fn, args, reps)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def routing(kind: str, tokens: int, s: dict, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Each choice's expert (``[tokens x k]``, token-major) and combine weight (see the module docstring)."""
    E, k, rng = s["experts"], s["top_k"], np.random.default_rng(seed)
    weight = jnp.asarray(rng.dirichlet(np.ones(k), tokens).reshape(-1), jnp.float32)
    if kind == "balanced":
        expert = (np.arange(tokens * k)) % E
    elif kind == "router":
        x = jax.random.normal(jax.random.key(seed), (tokens, s["embed"]))
        router = jax.random.normal(jax.random.key(seed + 1), (s["embed"], E)) * s["embed"] ** -0.5
        probs, top = jax.lax.top_k(jax.nn.softmax(x @ router), k)
        return top.reshape(-1).astype(jnp.int32), (probs / probs.sum(-1, keepdims=True)).reshape(-1)
    elif kind == "skewed":
        popularity = rng.lognormal(0.0, 0.55, E)
        expert = np.stack([rng.choice(E, k, replace=False, p=popularity / popularity.sum()) for _ in range(tokens)])
    else:                                                   # "one-empty": balanced over all but expert 0
        expert = 1 + np.arange(tokens * k) % (E - 1)
    return jnp.asarray(np.asarray(expert).reshape(-1), jnp.int32), weight


def load_cv(expert, E: int) -> float:
    load = np.bincount(np.asarray(expert), minlength=E)[:E]
    return float(load.std() / load.mean())


def weights(s: dict, dtype, seed: int = 1) -> tuple:
    keys = jax.random.split(jax.random.key(seed), 3)
    E, D, M = s["experts"], s["embed"], s["mlp"]
    return tuple((jax.random.normal(key, shape) * shape[1] ** -0.5).astype(dtype)
                 for key, shape in zip(keys, ((E, D, M), (E, M, D), (E, D, M))))


def mlp_loss(tile: int, with_output: bool = False):
    """``(x, weight, w1, w2, w3, rows, expert, probe) -> sum(routed_mlp(...) * probe)`` (and the output)."""
    def loss(x, weight, w1, w2, w3, rows, expert, probe):
        y = routed_mlp(x, rows, weight, expert, w1, w2, w3, activation="silu", tile=tile)
        total = jnp.sum(y.astype(jnp.float32) * probe)
        return (total, y) if with_output else total
    return loss


def compiled(kernel: str, fn, *args):
    """``jax.jit(fn)`` compiled for ``args`` with the routed experts of ``kernel``."""
    with use_moe_kernel(kernel):
        return jax.jit(fn).lower(*args).compile()


def dense_loss(x, w1, w2, w3, probe):
    """The twin: a dense SwiGLU MLP on every token."""
    return jnp.sum(((jax.nn.silu(x @ w1) * (x @ w3)) @ w2).astype(jnp.float32) * probe)


def layer_inputs(kind: str, tokens: int, s: dict, dtype):
    expert, weight = routing(kind, tokens, s)
    x = jax.random.normal(jax.random.key(3), (tokens, s["embed"]), dtype)
    probe = jax.random.normal(jax.random.key(4), x.shape, jnp.float32)
    return (x, weight, *weights(s, dtype), jnp.repeat(jnp.arange(tokens), s["top_k"]), expert, probe)


def run_numerics(s: dict, tokens: int) -> list[dict]:
    rows = []
    for kind in ("balanced", "skewed", "one-empty"):
        args = layer_inputs(kind, tokens, s, jnp.float32)
        grad = jax.value_and_grad(mlp_loss(s["tile"], True), argnums=(0, 1, 2, 3, 4), has_aux=True)
        with jax.default_matmul_precision("highest"):
            want = jax.tree.leaves(compiled("loop", grad, *args)(*args))
        bf16 = tuple(a.astype(jnp.bfloat16) if i in (0, 2, 3, 4) else a for i, a in enumerate(args))
        for kernel in KERNELS:
            got = jax.tree.leaves(compiled(kernel, grad, *bf16)(*bf16))
            row = {"routing": kind, "kernel": kernel} | {          # leaves: the loss, y, then the gradients
                name: round(rel(g, w), 5) for name, g, w in zip(("loss", "y", "dx", "dweight", "dw1", "dw2", "dw3"),
                                                                got, want) if name != "loss"}
            print("numerics", row, flush=True)
            rows.append(row)
    return rows


def run_gemms(s: dict, tokens: int, reps: int) -> list[dict]:
    """Each grouped kernel on the padded rows of a balanced routing."""
    E, D, M, tile = s["experts"], s["embed"], s["mlp"], s["tile"]
    expert, weight = routing("balanced", tokens, s)
    order, used, *table = _tiles(expert, E, tile)
    _, _, _, valid = _padded(table, used, tile, _sorted(jnp.arange(expert.shape[0]), order, tile),
                             _sorted(weight, order, tile))
    groups = Groups.of(table[0], used, E)
    x = jnp.where(valid[:, None], jax.random.normal(jax.random.key(5), (valid.shape[0], D), jnp.bfloat16), 0)
    h = jnp.where(valid[:, None], jax.random.normal(jax.random.key(6), (valid.shape[0], M), jnp.bfloat16), 0)
    w1, w2, _ = weights(s, jnp.bfloat16)
    run = dict(tile=tile, interpret=jax.default_backend() != "gpu")
    cases = {"forward X W1 (D->M)": jax.jit(lambda x, w: grouped_matmul(x, w, groups, **run)).lower(x, w1),
             "input grad G W2^T (D->M)": jax.jit(lambda x, w: grouped_matmul(x, w, groups, transpose=True, **run)
                                                 ).lower(x, w2),
             "forward H W2 (M->D)": jax.jit(lambda h, w: grouped_matmul(h, w, groups, **run)).lower(h, w2),
             "weight grad X^T H (D x M)": jax.jit(lambda x, h: grouped_weight_grad(x, h, groups, **run)).lower(x, h)}
    inputs = {"forward X W1 (D->M)": (x, w1), "input grad G W2^T (D->M)": (x, w2), "forward H W2 (M->D)": (h, w2),
              "weight grad X^T H (D x M)": (x, h)}
    flops = 2.0 * tokens * s["top_k"] * D * M
    out = []
    for name, lowered in cases.items():
        ms = median_ms(lowered.compile(), *inputs[name], reps=reps)
        out.append({"gemm": name, "ms": round(ms, 3), "tflops": _sig(flops / ms / 1e9)})
        print("gemm", out[-1], flush=True)
    return out


def run_layer(s: dict, tokens: int, reps: int) -> list[dict]:
    out, D, k, M = [], s["embed"], s["top_k"], s["mlp"]
    flops = 2.0 * tokens * k * D * M * 3                     # forward: three GEMMs over the routed rows
    for kind in ROUTINGS:
        args = layer_inputs(kind, tokens, s, jnp.bfloat16)
        cv = load_cv(args[6], s["experts"])
        loss = mlp_loss(s["tile"])
        for kernel in KERNELS:
            fwd = compiled(kernel, loss, *args)
            both = compiled(kernel, jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
            row = {"routing": kind, "load_cv": round(cv, 3), "run": kernel,
                   "fwd_ms": round(median_ms(fwd, *args, reps=reps), 3),
                   "fwd_bwd_ms": round(median_ms(both, *args, reps=reps), 3)}
            out.append(row | _rates(row, flops))
            print("layer", out[-1], flush=True)
    x, probe = args[0], args[7]
    w1, w2, w3 = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) * shape[0] ** -0.5
                  for i, shape in enumerate(((D, k * M), (k * M, D), (D, k * M))))
    row = {"routing": "-", "run": "dense twin",
           "fwd_ms": round(median_ms(jax.jit(dense_loss), x, w1, w2, w3, probe, reps=reps), 3),
           "fwd_bwd_ms": round(median_ms(jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2, 3))), x, w1, w2,
                                         w3, probe, reps=reps), 3)}
    out.append(row | _rates(row, flops))
    print("layer", out[-1], flush=True)
    return out


def _sig(v: float) -> float:
    return float(f"{v:.3g}")


def _rates(row: dict, flops: float) -> dict:
    """Forward and backward TFLOP/s (the backward: 2x the forward's FLOPs in fwd_bwd - fwd; None when the
    difference is not positive, timing noise at tiny shapes)."""
    bwd = row["fwd_bwd_ms"] - row["fwd_ms"]
    return {"fwd_tflops": _sig(flops / row["fwd_ms"] / 1e9),
            "bwd_tflops": _sig(2 * flops / bwd / 1e9) if bwd > 0 else None}


def gpt_config(s: dict, layers: int, seq: int, dense: bool) -> GPTConfig:
    """The MoE GPT (``dense``: its twin, an MLP of ``top_k x mlp``)."""
    moe = None if dense else MoESettings(experts=s["experts"], top_k=s["top_k"], capacity_factor=None)
    return GPTConfig(vocab=256, seq_len=seq, embed=s["embed"], heads=s["heads"], layers=layers,
                     mlp=s["mlp"] * (s["top_k"] if dense else 1), moe=moe)


def active_flops_per_token(cfg: GPTConfig, s: dict) -> float:
    """``6 x active parameters + 12 L T d``: attention, the top-k experts' and the router's weights a token uses."""
    d, L = cfg.embed, cfg.layers
    mlp = 2 * d * s["mlp"] * s["top_k"] + (0 if cfg.moe is None else d * s["experts"])
    return 6.0 * L * (4 * d * d + mlp) + 12.0 * L * cfg.seq_len * d


def time_step(cfg: GPTConfig, rows: int, reps: int, kernel: str) -> dict:
    """The compiled step's median ms over ``reps`` calls after one, and its peak memory."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    strategy, tx = jaxpar.Strategy(compute_dtype="bfloat16"), optax.sgd(1e-3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    t = np.random.default_rng(0).integers(0, 256, (rows, cfg.seq_len + 1)).astype(np.int32)
    batch = jaxpar.shard_batch({"tokens": t[:, :-1], "targets": t[:, 1:]}, mesh)
    with use_moe_kernel(kernel):
        step = jaxpar.make_train_step(lm_loss, tx, layout, strategy).lower(state, batch).compile()
    times = []
    for _ in range(reps + 1):                     # the state is donated: each call takes the last one's
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    mem = step.memory_analysis()
    return {"ms": round(1e3 * statistics.median(times[1:]), 2), "loss": float(metrics["loss"]),
            "peak_gib": round((mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                               + mem.temp_size_in_bytes) / 2 ** 30, 2)}


def run_step(s: dict, layers: int, rows: int, seq: int, reps: int, peak: float) -> list[dict]:
    out = []
    for name, dense, kernel in (("dense twin", True, "auto"), ("moe, grouped", False, "grouped"),
                                ("moe, tile loop", False, "loop")):
        cfg = gpt_config(s, layers, seq, dense)
        row = {"run": name} | time_step(cfg, rows, reps, kernel)
        tokens_s = rows * seq / (row["ms"] / 1e3)
        row |= {"tokens_per_s": round(tokens_s), "mfu_active": _sig(tokens_s * active_flops_per_token(cfg, s) / peak)}
        print("step", row, flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/moe_gpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, any backend")
    ap.add_argument("--sections", default="numerics,gemms,layer,step")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the layer sections")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=989e12)
    ap.add_argument("--budget", type=float, default=420.0)
    args = ap.parse_args()
    s = SMALL if args.small else SHAPE
    tokens, seq, rows, reps = (64, 32, 2, 2) if args.small else (args.tokens, args.seq, args.rows, args.reps)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": s, "sections_s": {}}
    runs = {"numerics": lambda: run_numerics(s, min(tokens, 2048)),
            "gemms": lambda: run_gemms(s, tokens, reps),
            "layer": lambda: run_layer(s, tokens, reps),
            "step": lambda: run_step(s, args.layers, rows, seq, reps, args.peak)}
    for section in args.sections.split(","):
        if elapsed() > args.budget:
            result[section] = "skipped: budget"
            continue
        t = time.perf_counter()
        try:
            result[section] = runs[section]()
        except Exception as e:                            # noqa: BLE001 - the other sections still run
            result[section] = f"error: {type(e).__name__}: {str(e)[:1000]}"
            print(section, result[section], flush=True)
        result["sections_s"][section] = round(time.perf_counter() - t, 1)
        (out_dir / "moe_gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["sections_s"]), f"total {elapsed():.0f} s")


if __name__ == "__main__":
    main()
