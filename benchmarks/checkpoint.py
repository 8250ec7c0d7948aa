"""Checkpoint save time, size on disk and restore time vs parameter bytes (Orbax via jaxpar's Checkpointer).

For GPTs of growing size on DP2 x FSDP2 x TP2 (8 simulated CPU devices), after
two train steps (so the Adam moments are not all zeros, which would compress to
nothing): the saved state is the parameters plus Adam's two moments, ~3x the
parameter bytes.

* ``save() blocks``: wall time of :meth:`Checkpointer.save` with async writes
  (device -> host copy and dispatch; training can go on after it);
* ``async total``: from ``save()`` until the checkpoint is committed on disk (``wait()``);
* ``sync save``: the same with ``async_save=False``;
* ``on disk``: bytes of the step directory (OCDBT + zstd);
* ``restore (same)``: :meth:`Checkpointer.restore` into the same layout;
* ``restore (FSDP8)``: into a ZeRO-3 layout on ``fsdp=8`` (resharding).

Each number is the median of ``--reps`` repetitions (fresh directory each time).

Usage::

    python benchmarks/checkpoint.py [--reps 3] [--sizes 128x2,256x4,512x8] [--json out.json]
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

from flax import nnx

from jaxpar import Strategy, make_mesh
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.run import Checkpointer
from jaxpar.step import init_train_state
from jaxpar.step import make_train_step, shard_batch


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", default="128x2,256x4,512x8", help="comma-separated EMBEDxLAYERS")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    tx = _common.make_tx()
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    other = make_mesh({"fsdp": 8})
    rows, results = [], []
    for spec in args.sizes.split(","):
        embed, layers = map(int, spec.split("x"))
        cfg = GPTConfig(vocab=256, seq_len=64, embed=embed, heads=8, layers=layers)
        state, layout = init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, Strategy())
        _, layout_fsdp = init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, other, Strategy(zero=3))
        step = make_train_step(lm_loss, tx, layout, Strategy())
        for i in range(2):
            state, _ = step(state, shard_batch(_common.make_batch(cfg, 16, seed=i), mesh))
        n_params = sum(a.size for a in jax.tree.leaves(layout.shapes))
        state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
        jax.block_until_ready(state)
        m: dict[str, list[float]] = {k: [] for k in ("block", "async", "sync", "disk", "restore", "reshard")}
        for rep in range(args.reps + 1):                 # rep 0 warms up (first-use costs), not counted
            work = Path(tempfile.mkdtemp(prefix="jaxpar-ckpt-bench-"))
            with Checkpointer(work / "a", async_save=True) as ck:
                t0 = time.perf_counter()
                ck.save(2, state)   # the step must match state.step
                t1 = time.perf_counter()
                ck.wait()
                t2 = time.perf_counter()
            with Checkpointer(work / "s", async_save=False) as ck:
                t3 = time.perf_counter()
                ck.save(2, state)   # the step must match state.step
                ck.wait()
                t4 = time.perf_counter()
            disk = _dir_bytes(work / "a" / "2")
            with Checkpointer(work / "a") as ck:
                t5 = time.perf_counter()
                jax.block_until_ready(ck.restore(layout).state)
                t6 = time.perf_counter()
                jax.block_until_ready(ck.restore(layout_fsdp).state)
                t7 = time.perf_counter()
            shutil.rmtree(work, ignore_errors=True)
            if rep:
                for k, v in (("block", t1 - t0), ("async", t2 - t0), ("sync", t4 - t3), ("disk", disk),
                             ("restore", t6 - t5), ("reshard", t7 - t6)):
                    m[k].append(v)
        med = {k: statistics.median(v) for k, v in m.items()}
        results.append({"embed": embed, "layers": layers, "params": n_params, "param_bytes": 4 * n_params,
                        "state_bytes": state_bytes, **med})
        rows.append((f"{embed}x{layers}", f"{n_params:,}", _mib(4 * n_params), _mib(state_bytes),
                     f"{med['block'] * 1e3:.0f} ms", f"{med['async']:.2f} s", f"{med['sync']:.2f} s",
                     f"{_mib(med['disk'])} ({med['disk'] / state_bytes:.2f}x)", f"{med['restore']:.2f} s",
                     f"{med['reshard']:.2f} s"))
        print(" | ".join(rows[-1]), flush=True)
    print()
    print(_common.markdown_table(
        ["GPT embed x layers", "params", "param bytes", "state bytes (params + Adam)", "save() blocks",
         "async total", "sync save", "on disk (/ state)", "restore (same)", "restore (FSDP8)"], rows))
    _common.write_json(args.json, {"env": _common.environment(), "results": results})


if __name__ == "__main__":
    main()
