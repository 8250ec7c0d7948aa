"""One GPU, one call: the MoE GPT's step against its dense twin, MFU counted on active parameters, per tile size.

Run on one H100 or H200 (``python benchmarks/moe_gpu.py --out DIR``, a few minutes); ``--small`` runs tiny
shapes on any backend (a smoke test). The model is the GPT with Qwen3-30B-A3B's MoE shape (embed 2048, 16
heads, 128 experts of hidden 768, top-8, dropless) cut to ``--layers`` layers, ``--rows`` x ``--seq``
tokens, bf16 compute, fp32 master weights, SGD; its dense twin has an MLP of hidden 8 x 768. The MoE step runs
once per expert tile (``--tiles``, rows per tile of the sorted dispatch's loop), to say which tile wins.

Each row: ms (median of ``--reps``), tokens/s, MFU (``6 x active parameters + 12 x layers x seq x width``
FLOPs a token over ``--peak``: the routed experts count ``top_k`` of ``experts``), the compiled peak memory.
Written to ``DIR/moe_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import GPT, GPTConfig, MoESettings, lm_loss
from jaxpar.parallel.moe import TILE_ROWS

SHAPE = dict(embed=2048, heads=16, mlp=768, experts=128, top_k=8)
SMALL = dict(embed=64, heads=4, mlp=32, experts=8, top_k=2)


def config(shape: dict, layers: int, seq: int, dense: bool) -> GPTConfig:
    """The MoE GPT (``dense``: its twin, an MLP of ``top_k x mlp``)."""
    moe = None if dense else MoESettings(experts=shape["experts"], top_k=shape["top_k"], capacity_factor=None)
    return GPTConfig(vocab=256, seq_len=seq, embed=shape["embed"], heads=shape["heads"], layers=layers,
                     mlp=shape["mlp"] * (shape["top_k"] if dense else 1), moe=moe)


def active_flops_per_token(cfg: GPTConfig, shape: dict) -> float:
    """``6 x active parameters + 12 L T d``: attention, the top-k experts' and the router's weights a token uses."""
    d, L = cfg.embed, cfg.layers
    mlp = 2 * d * shape["mlp"] * shape["top_k"] + (0 if cfg.moe is None else d * shape["experts"])
    return 6.0 * L * (4 * d * d + mlp) + 12.0 * L * cfg.seq_len * d


def time_step(cfg: GPTConfig, rows: int, reps: int) -> dict:
    """The compiled step's median ms over ``reps`` calls after one, and its peak memory."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    strategy, tx = jaxpar.Strategy(compute_dtype="bfloat16"), optax.sgd(1e-3)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    t = np.random.default_rng(0).integers(0, 256, (rows, cfg.seq_len + 1)).astype(np.int32)
    batch = jaxpar.shard_batch({"tokens": t[:, :-1], "targets": t[:, 1:]}, mesh)
    compiled = jaxpar.make_train_step(lm_loss, tx, layout, strategy).lower(state, batch).compile()
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    mem = compiled.memory_analysis()
    return {"ms": 1e3 * statistics.median(times[1:]), "loss": float(metrics["loss"]),
            "peak_gib": (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                         + mem.temp_size_in_bytes) / 2 ** 30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--small", action="store_true", help="tiny shapes, any backend")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tiles", default="64,128,256")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=989e12)
    args = ap.parse_args()
    shape = SMALL if args.small else SHAPE
    seq, rows = (64, 4) if args.small else (args.seq, args.rows)
    platform = jax.devices()[0].platform
    runs = [("dense twin", True, None)] + [(f"moe, tile {t}", False, int(t)) for t in args.tiles.split(",")]
    out = []
    for name, dense, tile in runs:
        cfg = config(shape, args.layers, seq, dense)
        saved = TILE_ROWS.get(platform)
        if tile:
            TILE_ROWS[platform] = tile
        try:
            row = time_step(cfg, rows, args.reps)
        finally:
            TILE_ROWS[platform] = saved
        tokens_s = rows * seq / (row["ms"] / 1e3)
        row |= {"run": name, "tokens_per_s": tokens_s,
                "mfu_active": tokens_s * active_flops_per_token(cfg, shape) / args.peak}
        print(f"{name:16s} {row['ms']:9.2f} ms  {tokens_s:10.0f} tok/s  MFU {row['mfu_active']:.3f}  "
              f"peak {row['peak_gib']:.1f} GiB  loss {row['loss']:.4f}", flush=True)
        out.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_gpu.json").write_text(json.dumps({"device": str(jax.devices()[0]), "rows": out},
                                                            indent=1))


if __name__ == "__main__":
    main()
