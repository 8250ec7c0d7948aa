"""Does a one-step gradient delay alone cost what PipeDream-2BW costs? An independent check.

Plain optax AdamW on one device, no jaxpar step, pipeline or mesh: the quickstart GPT at 4 layers
(the model of ``benchmarks/pipeline_2bw_convergence.py``), global batch 32 x 64 bytes of the
stdlib's sources, 300 steps. ``--delay 1`` applies the gradient taken at the previous weights,
``W(t+1) = W(t) - update(grad f_t(W(t-1)))``, the rule 2BW implements; ``--delay 0`` is plain
training. ``--predict`` (with ``--delay 1``) takes the gradient at the weights extrapolated one step,
``2 W(t-1) - W(t-2)`` (weight prediction, as in SpecTrain and XPipe: only versions a 2BW stage already
holds). Prints the mean loss of the last 20 steps.

Usage::

    python benchmarks/delayed_gradient.py --delay 1 [--predict] [--lr 3e-3 --warmup 20 --clip 1.0] [--steps 300]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.models import GPT, GPTConfig, lm_loss  # noqa: E402
from jaxpar.data._windows import load_bytes, split_holdout, text_batch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=int, choices=(0, 1), default=1)
    ap.add_argument("--predict", action="store_true",
                    help="with --delay 1: the gradient at 2 W(t-1) - W(t-2) instead of W(t-1)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: none)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    graphdef, params = nnx.split(GPT(GPTConfig(vocab=256, seq_len=64, embed=128, heads=4, layers=4), rngs=nnx.Rngs(0)))
    data, _ = split_holdout(load_bytes(max_bytes=4_000_000), 0.05)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps)
    tx = optax.chain(*([optax.clip_by_global_norm(args.clip)] if args.clip else []),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    opt = tx.init(params)

    @jax.jit
    def step(p, p_grad, opt, batch):
        loss, g = jax.value_and_grad(lambda q: lm_loss(nnx.merge(graphdef, q), batch))(p_grad)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    if args.predict and not args.delay:
        ap.error("--predict extrapolates the delayed weights: use it with --delay 1")
    prev2, prev, losses = params, params, []      # W(t-2), W(t-1)
    for t in range(args.steps):
        batch = jax.tree.map(jnp.asarray, text_batch(data, t, batch_size=32, seq_len=64, seed=0))
        at = prev if args.delay else params
        if args.predict:
            at = jax.tree.map(lambda a, b: 2 * a - b, prev, prev2)
        new, opt, loss = step(params, at, opt, batch)
        prev2, prev, params = prev, params, new
        losses.append(float(loss))
    print(f"delay={args.delay} predict={args.predict} lr={args.lr} warmup={args.warmup} clip={args.clip}: "
          f"final loss (mean of the last 20 steps) {np.mean(losses[-20:]):.3f}")


if __name__ == "__main__":
    main()
