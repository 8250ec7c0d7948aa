"""FP8 against bf16 on one GPU: a Llama-3-8B-shaped decoder's train step (forward and backward), timed.

Run on a machine with a Hopper GPU (``python benchmarks/fp8_gpu.py``); ``--small`` runs a tiny model on
any backend (a smoke test). Prints, per precision: milliseconds per step (median of alternating runs),
the ratio to bf16, the compiled program's GEMMs by operand types, the FP8 GEMMs' FLOPs over the covered
matmuls' (one layer: the layers run as one scanned body), and the loss against bf16's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import Decoder, DecoderConfig, decoder_loss
from jaxpar.analysis._gemms import fp8_gemms, gemms
from jaxpar.parallel._fp8 import Fp8, fp8_loss

LLAMA3_8B = dict(vocab=32000, embed=4096, layers=4, heads=32, kv_heads=8, head_dim=128, mlp=14336)
SMALL = dict(vocab=256, embed=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128)


def dot_dtypes(hlo: str) -> dict[str, int]:
    """How many compiled GEMMs (dots and cuBLAS calls) take each pair of operand types."""
    return dict(Counter(f"{g.lhs} x {g.rhs}" for g in gemms(hlo)))


def step_fn(graphdef, fp8):
    scored = fp8_loss(decoder_loss, fp8)        # what Strategy(fp8=...) runs in the train step

    def loss(state, batch):
        return scored(nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)), batch)
    return jax.jit(jax.value_and_grad(loss))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    args = ap.parse_args()
    sizes, batch, seq = (SMALL, 2, 32) if args.small else (LLAMA3_8B, args.batch, args.seq)
    cfg = DecoderConfig(**sizes)
    with nnx.use_eager_sharding(False):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    variants = {"bf16": None} | {f"fp8-{r}": Fp8(recipe=r, min_dim=0 if args.small else 1024)
                                 for r in args.recipes.split(",")}
    c = cfg        # one layer's covered weights and their GEMMs' FLOPs (the scanned program holds one layer)
    covered = c.embed * c.head_dim * (2 * c.heads + 2 * c.kv_heads) + 3 * c.embed * c.mlp
    out_covered = 3 * 2 * batch * seq * covered
    steps = {k: step_fn(graphdef, v) for k, v in variants.items()}
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "sizes": sizes,
           "batch": batch, "seq": seq, "rows": {}}
    losses = {}
    for name, f in steps.items():
        compiled = f.lower(state, data).compile()
        hlo = compiled.as_text()
        named = fp8_gemms(hlo)
        out["rows"][name] = {"dots": dot_dtypes(hlo),
                             "fp8_flops_of_covered": sum(v["fp8_flops"] for v in named.values()) / out_covered,
                             "other_flops_of_covered": sum(v["other_flops"] for v in named.values()) / out_covered}
        loss, grads = f(state, data)
        jax.block_until_ready(grads)
        losses[name] = float(loss)
    times = {k: [] for k in steps}
    for _ in range(args.runs):                       # alternate, so drift hits every variant alike
        for name, f in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(f(state, data))
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["bf16"])
    flops = 6 * batch * seq * sum(a.size for a in jax.tree.leaves(state))
    for name in steps:
        med = statistics.median(times[name])
        out["rows"][name].update(ms=round(med * 1e3, 3), ratio=round(med / base, 3),
                                 tflops=round(flops / med / 1e12, 1), loss=losses[name],
                                 loss_vs_bf16=round(losses[name] / losses["bf16"] - 1, 5))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
