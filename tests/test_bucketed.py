"""Flat-buffer collectives: one all-gather / reduce-scatter per group of leaves, same values as per leaf."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import collectives
from jaxpar.data_parallel import bucketed_all_gather, bucketed_reduce_scatter

from helpers import mesh_for

# (shape of the full leaf, dimension split, axes): mixed dims, ranks and two axis groups
LEAVES = [((8, 6), 0, ("data", "fsdp")), ((3, 16, 4), 1, ("data", "fsdp")), ((5, 8), 1, ("data", "fsdp")),
          ((4, 2), 0, ("fsdp",)), ((2, 12), 1, ("fsdp",)), ((7,), None, ())]


def _spec(d, axes, ndim):
    if d is None:
        return P()
    e = [None] * ndim
    e[d] = axes
    return P(*e)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s, _, _ in LEAVES]


def test_bucketed_all_gather_equals_per_leaf_gathers():
    mesh = mesh_for({"data": 2, "fsdp": 4})
    xs = _inputs()
    dims, axes = [d for _, d, _ in LEAVES], [a for _, _, a in LEAVES]
    in_specs = (tuple(_spec(d, a, len(s)) for s, d, a in LEAVES),)

    def per_leaf(xs):
        return [jax.lax.all_gather(x, a, axis=d, tiled=True) if a else x for x, d, a in zip(xs, dims, axes)]

    def run(f):
        g = jax.jit(jax.shard_map(lambda xs: tuple(f(list(xs))), mesh=mesh, in_specs=in_specs,
                                  out_specs=tuple(P() for _ in xs), check_vma=False))
        return g, g(tuple(xs))

    fb, bucketed = run(lambda xs: bucketed_all_gather(xs, dims, axes))
    _, reference = run(per_leaf)
    for b, r, x in zip(bucketed, reference, xs):
        np.testing.assert_array_equal(b, r)
        np.testing.assert_array_equal(b, x)          # gathering the shards gives the array back
    colls = collectives(fb.lower(tuple(xs)).compile(), mesh)
    assert sorted(c.axes for c in colls if c.kind == "all-gather") == [("data", "fsdp"), ("fsdp",)]   # one per group


def test_bucketed_reduce_scatter_equals_per_leaf_scatters():
    mesh = mesh_for({"data": 2, "fsdp": 4})
    xs = _inputs(1)
    dims, axes = [d for _, d, _ in LEAVES], [a for _, _, a in LEAVES]
    out_specs = tuple(_spec(d, a, len(s)) for s, d, a in LEAVES)

    def local(xs):   # a different gradient on every device: the input scaled by the device number
        i = (jax.lax.axis_index("data") * 4 + jax.lax.axis_index("fsdp") + 1).astype(jnp.float32)
        return [x * i for x in xs]

    def per_leaf(gs):
        return [jax.lax.psum_scatter(g, a, scatter_dimension=d, tiled=True) if a else g
                for g, d, a in zip(gs, dims, axes)]

    def run(f):
        g = jax.jit(jax.shard_map(lambda xs: tuple(f(local(list(xs)))), mesh=mesh,
                                  in_specs=(tuple(P() for _ in xs),), out_specs=out_specs, check_vma=False))
        return g, g(tuple(xs))

    fb, bucketed = run(lambda gs: bucketed_reduce_scatter(gs, dims, axes))
    _, reference = run(per_leaf)
    for b, r in zip(bucketed, reference):
        np.testing.assert_allclose(b, r, rtol=1e-6)
    np.testing.assert_allclose(bucketed[0], xs[0] * 36, rtol=1e-6)     # summed over devices i = 1..8
    colls = collectives(fb.lower(tuple(xs)).compile(), mesh)
    assert sorted(c.axes for c in colls if c.kind == "reduce-scatter") == [("data", "fsdp"), ("fsdp",)]
