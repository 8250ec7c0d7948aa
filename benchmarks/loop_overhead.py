"""Host overhead of the training loop: ``jaxpar.run._loop.train`` vs the jitted step in a bare loop.

Both run the same config (``configs/quickstart.yaml`` + overrides, 8 simulated CPU
devices) with the same compiled step, in one process:

* ``bare``: ``for i in range(N): state, m = step(state, batches[i])`` over batches
  placed on the mesh beforehand, at most 2 steps in flight (as in ``train``: with
  dozens queued, XLA:CPU's collectives on simulated devices can deadlock). This
  is the device's own throughput: no data loading, no metrics, no checkpoints.
* ``loop``: ``train(...)`` as ``jaxpar train`` calls it: host batches built from
  ``(seed, step)`` and placed every step, metrics fetched every ``log_every``
  steps to ``metrics.jsonl`` and TensorBoard, async Orbax checkpoints every
  ``--ckpt-every`` steps and at the end (waited for), SIGTERM handlers; no eval,
  no PNG (end-of-run work).

Timing: one untimed warm-up of each (compiles), then ``--reps`` rounds, each
running ``bare`` and ``loop`` for ``--steps`` steps in alternating order; a
round's ratio is ``tokens/s(loop) / tokens/s(bare)`` (wall time of the whole
call). Reported: the median over rounds (paired, so drifts of a shared machine cancel) and
the ratio of the best (least disturbed) call of each.

Usage::

    python benchmarks/loop_overhead.py [--steps 200] [--reps 5] [--json out.json] [key=value ...]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxpar import config as C
from jaxpar.run import Checkpointer
from jaxpar.run import LogOptions, train
from jaxpar.run._metrics import flops_per_token
from jaxpar.step import init_train_state
from jaxpar.step import make_train_step, shard_batch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--steps", type=int, default=200, help="steps per timed call")
    p.add_argument("--reps", type=int, default=5, help="paired rounds")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.layers=4")
    args = p.parse_args()

    cfg = C.load_config(args.config, args.overrides)
    C.check(cfg, num_devices=jax.device_count())
    mesh, strategy = C.build_mesh(cfg.mesh), C.build_strategy(cfg.parallel)
    tx, _ = C.build_optimizer(cfg.optimizer, args.steps)
    state, layout = init_train_state(C.build_model_fn(cfg.model, cfg.train.seed), tx, mesh, strategy)
    step = make_train_step(C.build_loss_fn(cfg.model), tx, layout, strategy, clip_norm=cfg.optimizer.clip_norm,
                           skip_nonfinite=True)
    batch_fn, _ = C.build_data(cfg.data, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab, eval_batches=0)
    tokens = cfg.data.batch_size * cfg.model.seq_len
    n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
    m = cfg.model
    fpt = flops_per_token(n_params - (m.vocab + m.seq_len) * m.embed, layers=m.layers, seq_len=m.seq_len,
                          embed=m.embed)
    placed = [shard_batch(batch_fn(i), mesh) for i in range(args.steps)]
    work = Path(tempfile.mkdtemp(prefix="jaxpar-loop-overhead-"))

    def copy(s):
        return jax.tree.map(lambda a: a.copy(), s)

    def bare() -> float:
        s = copy(state)
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        queued = []
        for b in placed:
            if len(queued) >= 2:
                jax.block_until_ready(queued[-2])
            s, m = step(s, b)
            queued.append(m)
        jax.block_until_ready(s)
        return time.perf_counter() - t0

    saves: list[float] = []

    def loop(tag: str) -> float:
        s = copy(state)
        jax.block_until_ready(s)
        out = work / tag
        shutil.rmtree(out, ignore_errors=True)
        ck = Checkpointer(out / "checkpoints", every=args.ckpt_every, keep=2, async_save=True)
        t0 = time.perf_counter()
        log = LogOptions(log_every=args.log_every, out_dir=out, progress="none", plot=False, tensorboard=True,
                         tokens_per_batch=tokens, flops_per_token=fpt)
        train(step, s, batch_fn, mesh=mesh, steps=args.steps, checkpointer=ck, checkpoint_meta={"config": cfg.name},
              on_nonfinite="skip", log=log)
        dt = time.perf_counter() - t0          # includes waiting for the last checkpoint
        saves.extend(ck.save_seconds)
        ck.close()
        return dt

    print(f"config {cfg.name}: {n_params:,} params, batch {cfg.data.batch_size} x {cfg.model.seq_len}, "
          f"mesh {dict(mesh.shape)}, {args.steps} steps per call, log every {args.log_every}, "
          f"checkpoint every {args.ckpt_every} + end")
    bare(), loop("warmup")                      # compile + first-use costs
    saves.clear()
    rows, ratios, times = [], [], {"bare": [], "loop": []}
    for r in range(args.reps):
        order = ("bare", "loop") if r % 2 == 0 else ("loop", "bare")
        t = {name: (bare() if name == "bare" else loop(f"r{r}")) for name in order}
        ratio = t["bare"] / t["loop"]
        for name in t:
            times[name].append(t[name])
        ratios.append(ratio)
        rows.append((r, f"{tokens * args.steps / t['bare']:,.0f}", f"{tokens * args.steps / t['loop']:,.0f}",
                     f"{ratio:.4f}"))
        print(f"round {r}: bare {t['bare']:.3f} s, loop {t['loop']:.3f} s, ratio {ratio:.4f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print()
    print(_common.markdown_table(["round", "bare tokens/s", "train() tokens/s", "ratio"], rows))
    med = statistics.median(ratios)
    best = min(times["bare"]) / min(times["loop"])
    n_saves = len(saves) // max(args.reps, 1)
    # what the loop adds per call, spread over its saves (all of it, when the loop itself is free)
    extra = statistics.median(lo - b for lo, b in zip(times["loop"], times["bare"]))
    print(f"\nmedian ratio train()/bare {med:.4f}, best-of ratio {best:.4f} (target >= 0.97); "
          f"checkpoint save() blocking: median {statistics.median(saves) * 1e3:.1f} ms over {len(saves)} saves; "
          f"train() - bare: median {extra:.3f} s per call = {extra / max(n_saves, 1) * 1e3:.0f} ms per save "
          f"({n_saves} saves per call)")
    _common.write_json(args.json, {"env": _common.environment(), "config": cfg.name, "steps": args.steps,
                                   "rounds": rows, "median_ratio": med, "best_ratio": best, "save_blocking_s": saves,
                                   "extra_s_per_call": extra, "saves_per_call": n_saves})


if __name__ == "__main__":
    main()
