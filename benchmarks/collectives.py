"""Cost of single collectives on this backend, and of per-leaf vs flat-buffer collectives.

Why jaxpar's explicit data-parallel path runs one all-gather / reduce-scatter per
layer over a flat buffer (``jaxpar.parallel._data_parallel.bucketed_*``) instead of one per
parameter leaf. All programs are ``shard_map``s over a ``data`` axis of the 8
simulated CPU devices:

* single collectives on one ``[4, 128, 512]`` fp32 array per device (1 MiB):
  all-reduce, all-reduce + dynamic-slice (what XLA:CPU emits for a sharded
  gradient), reduce-scatter, all-gather;
* the 12 leaves of one GPT block (embed 128, mlp 512) reduce-scattered / gathered
  per leaf, and as one flat buffer.

Timing: ``--reps`` rounds; every round runs each program once in a rotating order
(``block_until_ready``). Reported: the median time of each, and the median per-round
ratio per-leaf / bucketed.

Usage::

    python benchmarks/collectives.py [--reps 50] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel import bucketed_all_gather, bucketed_reduce_scatter
from flax import nnx

from jaxpar.models import GPT, GPTConfig


def block_leaves():
    """Shapes of one GPT block's parameters (the scanned blocks without their layer axis)."""
    model = nnx.eval_shape(lambda: GPT(GPTConfig(vocab=256, seq_len=64, embed=128, heads=8, layers=1),
                                       rngs=nnx.Rngs(0)))
    return [tuple(a.shape[1:]) for a in jax.tree.leaves(model.block_params())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    mesh = jax.make_mesh((8,), ("data",))
    n = 8

    def smap(f, in_spec, out_spec):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))

    big = jax.device_put(jnp.ones((n, 4, 128, 512)), NamedSharding(mesh, P("data")))
    programs = {
        "all-reduce": (smap(lambda a: jax.lax.psum(a[0], "data"), P("data"), P()), big),
        "all-reduce + slice": (smap(lambda a: jax.lax.dynamic_slice_in_dim(
            jax.lax.psum(a[0], "data"), jax.lax.axis_index("data") * (128 // n), 128 // n, axis=1),
            P("data"), P(None, "data")), big),
        "reduce-scatter": (smap(lambda a: jax.lax.psum_scatter(a[0], "data", scatter_dimension=1, tiled=True),
                                P("data"), P(None, "data")), big),
        "all-gather": (smap(lambda a: jax.lax.all_gather(a[0][:, :128 // n], "data", axis=1, tiled=True),
                            P("data"), P()), big),
    }
    shapes = [s for s in block_leaves() if s[0] % n == 0]   # the leaves ZeRO splits on dim 0 (here: all)
    grads = tuple(jax.device_put(jnp.ones((n, *s)), NamedSharding(mesh, P("data"))) for s in shapes)
    dims, axes = [0] * len(shapes), [("data",)] * len(shapes)
    local = (tuple(P("data") for _ in shapes),)
    scattered = tuple(P("data") for _ in shapes)
    programs["block reduce-scatter, per leaf"] = (smap(
        lambda gs: tuple(jax.lax.psum_scatter(g[0], "data", scatter_dimension=0, tiled=True) for g in gs),
        local, scattered), grads)
    programs["block reduce-scatter, one flat buffer"] = (smap(
        lambda gs: tuple(bucketed_reduce_scatter([g[0] for g in gs], dims, axes)), local, scattered), grads)
    shards = tuple(jax.device_put(jnp.ones(s), NamedSharding(mesh, P("data"))) for s in shapes)
    programs["block all-gather, per leaf"] = (smap(
        lambda ps: tuple(jax.lax.all_gather(q, "data", axis=0, tiled=True) for q in ps),
        (scattered,), tuple(P() for _ in shapes)), shards)
    programs["block all-gather, one flat buffer"] = (smap(
        lambda ps: tuple(bucketed_all_gather(list(ps), dims, axes)), (scattered,), tuple(P() for _ in shapes)),
        shards)

    for f, x in programs.values():
        jax.block_until_ready(f(x))
    names = list(programs)
    samples = {k: [] for k in names}
    for r in range(args.reps):
        k0 = r % len(names)
        for k in names[k0:] + names[:k0]:
            f, x = programs[k]
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            samples[k].append(time.perf_counter() - t0)

    env = _common.environment()
    print(f"# collectives on {env['devices']} (nproc={env['nproc']}, jax {env['jax']}, jaxpar @ {env['git']}); "
          f"{len(shapes)} block leaves, {sum(int(jnp.prod(jnp.array(s))) for s in shapes):,} floats")
    rows = [(k, f"{statistics.median(v) * 1e3:.3f}") for k, v in samples.items()]
    print(_common.markdown_table(["program", "median ms"], rows))
    ratios = {}
    for kind in ("reduce-scatter", "all-gather"):
        a, b = samples[f"block {kind}, per leaf"], samples[f"block {kind}, one flat buffer"]
        ratios[kind] = statistics.median(x / y for x, y in zip(a, b))
        print(f"block {kind}: per leaf / one flat buffer = {ratios[kind]:.2f} (median of per-round ratios)")
    _common.write_json(args.json, {"env": env, "reps": args.reps, "leaf_shapes": shapes,
                                   "samples_s": samples, "per_leaf_over_bucketed": ratios})


if __name__ == "__main__":
    main()
