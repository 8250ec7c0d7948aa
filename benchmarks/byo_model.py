"""A user's own model under jaxpar vs the same step written by hand (8 simulated CPU devices).

The model is ``examples/patch_attention.py`` (conv stem, ``nnx.MultiHeadAttention`` blocks
stacked with ``nnx.vmap`` and run by ``jaxpar.scan_blocks``, classifier head). Per strategy:

* ``hand``: ``jax.jit`` + ``jax.value_and_grad`` + optax with the same in/out shardings,
  the model rebuilt with ``nnx.merge``; XLA chooses every collective.
* ``jaxpar``: ``jaxpar.make_train_step`` with its default ``explicit_dp=None`` (explicit
  per-layer flat-buffer gather / reduce-scatter for ZeRO-2/3 and FSDP without TP).
* ``jaxpar-noexp``: ``explicit_dp=False``.

Timing as in ``overhead.py``: ``--reps`` rounds, each variant ``--steps`` steps per round in
rotated order; the table gives the median per-step time and the median per-round ratio to
``hand``. Also the first-call time (trace + compile + one step): jaxpar traces the loss once
more, abstractly, to find the stacked blocks. Collectives in the layer loops are counted from
the compiled HLO.

Usage::

    python benchmarks/byo_model.py --steps 3 --reps 15 [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import jax
import optax
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives

from _common import copy_state, environment, make_hand_step, markdown_table, write_json

_path = Path(__file__).resolve().parents[1] / "examples" / "patch_attention.py"
_spec = importlib.util.spec_from_file_location("patch_attention", _path)
pa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pa)

MODEL = dict(image=16, patch=2, embed=96, heads=4, mlp=192, layers=4, classes=10)
STRATEGIES = {
    "DP8": ({"data": 8}, {}),
    "ZeRO-2 (data=8)": ({"data": 8}, {"zero": 2}),
    "ZeRO-3 (data=8)": ({"data": 8}, {"zero": 3}),
    "FSDP8": ({"fsdp": 8}, {}),
    "DP2xFSDP2xTP2": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
}
VARIANTS = ("hand", "jaxpar", "jaxpar-noexp")


def _loop_collectives(compiled, mesh) -> str:
    found = [c for c in collectives(compiled, mesh) if c.in_loop and c.kind in ("all-gather", "reduce-scatter")]
    return ", ".join(f"{sum(c.kind == k for c in found)} {k}" for k in ("all-gather", "reduce-scatter"))


def bench(name, batch_size, steps, reps):
    sizes, kw = STRATEGIES[name]
    mesh = jaxpar.make_mesh(sizes)
    strategy = jaxpar.Strategy(**kw)
    tx = optax.adamw(1e-3)
    state, layout = jaxpar.init_train_state(lambda: pa.PatchAttentionNet(rngs=nnx.Rngs(0), **MODEL), tx, mesh,
                                            strategy)
    batch = jaxpar.shard_batch(pa.batches(0, batch_size=batch_size, image=MODEL["image"],
                                          classes=MODEL["classes"]), mesh)
    fns = {"hand": make_hand_step(layout, tx, loss_fn=pa.loss),
           "jaxpar": jaxpar.make_train_step(pa.loss, tx, layout, strategy),
           "jaxpar-noexp": jaxpar.make_train_step(pa.loss, tx, layout, strategy, explicit_dp=False)}
    states, first, loops = {}, {}, {}
    for v, fn in fns.items():
        s = copy_state(state)
        t0 = time.perf_counter()
        s, m = fn(s, batch)
        jax.block_until_ready(m)
        first[v] = time.perf_counter() - t0
        loops[v] = _loop_collectives(fn.lower(s, batch).compile(), mesh)
        states[v] = s
    samples = {v: [] for v in VARIANTS}
    ratios = {v: [] for v in VARIANTS}
    for r in range(reps):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        now = {}
        for v in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                states[v], m = fns[v](states[v], batch)
            jax.block_until_ready(m)
            now[v] = (time.perf_counter() - t0) / steps
            samples[v].append(now[v])
        for v in VARIANTS:
            ratios[v].append(now[v] / now["hand"])
    med = {v: statistics.median(samples[v]) for v in VARIANTS}
    rat = {v: statistics.median(ratios[v]) for v in VARIANTS}
    return {"strategy": name, "ms": {v: 1e3 * med[v] for v in VARIANTS}, "ratio": rat, "first_s": first,
            "loop_collectives": loops}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    names = [n for n in STRATEGIES if not args.only or n in args.only.split(",")]
    results = [bench(n, args.batch, args.steps, args.reps) for n in names]
    rows = [[r["strategy"], *(f"{r['ms'][v]:.2f}" for v in VARIANTS), f"{r['ratio']['jaxpar']:.3f}",
             f"{r['ratio']['jaxpar-noexp']:.3f}", f"{r['first_s']['hand']:.1f}", f"{r['first_s']['jaxpar']:.1f}",
             r["loop_collectives"]["jaxpar"], r["loop_collectives"]["hand"]] for r in results]
    print(environment())
    print(markdown_table(["strategy", "hand ms", "jaxpar ms", "jaxpar explicit_dp=False ms", "jaxpar / hand",
                          "explicit_dp=False / hand", "first call hand s", "first call jaxpar s",
                          "loop collectives jaxpar", "loop collectives hand"], rows))
    write_json(args.json, {"env": environment(), "model": MODEL, "batch": args.batch, "results": results})


if __name__ == "__main__":
    main()
