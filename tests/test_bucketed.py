"""Explicit data parallelism: flat-buffer collectives (one all-gather / reduce-scatter per group of
leaves, same values as per leaf) and the residuals the per-layer wrapper keeps."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import collectives
from jaxpar.parallel import bucketed_all_gather, bucketed_reduce_scatter

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


# ---------------------------------------------------------------- the explicit wrapper's residuals
E = 32


def _residuals(block, dtype=jnp.float32, remat=None):
    """Per-device residuals that data_parallel_block keeps for the backward (fsdp=8, ZeRO-3)."""
    from helpers import setup
    from jaxpar.parallel import data_parallel_block
    from jaxpar.rules import use_rules
    mesh, _, layout, _ = setup({"fsdp": 8})
    shapes = {"w": jax.ShapeDtypeStruct((E, 3 * E), dtype)}
    with use_rules(mesh, layout.rules):
        wrapped = data_parallel_block(block, {"w": ("embed", "mlp")}, mesh, layout.rules, 0, shapes, remat=remat)
        _, (_, res) = jax.eval_shape(wrapped.fwd, {"w": jnp.ones((E, 3 * E), dtype)}, jnp.ones((16, E), dtype))
    return res


def test_gathered_weights_are_never_residuals_even_when_split():
    """A layer that splits a fused weight (q, k, v = split(w)) must not keep the pieces: they are
    the whole gathered weight. Only batch-leading activations (2 rows per device) are kept."""
    def fused(p, x):
        q, k, v = jnp.split(p["w"], 3, axis=1)
        return jnp.tanh(x @ q) + jnp.tanh(x @ k) * (x @ v)

    res = _residuals(fused)
    assert res and all(r.shape[:2] == (8, 2) for r in res), [r.shape for r in res]


def test_casts_of_activations_are_saved_in_their_narrow_dtype():
    """b * b with b = bf16(x @ w): the backward needs b; saving its fp32 input instead would
    double the bytes (casts are not 'data movement' for the remat policy)."""
    def block(p, x):
        b = (x @ p["w"][:, :E]).astype(jnp.bfloat16)
        return (b * b).astype(jnp.float32)

    res = _residuals(block)   # the layer input x (for the weight gradient) and the bf16 value
    assert sorted(str(r.dtype) for r in res) == ["bfloat16", "float32"] and all(r.shape == (8, 2, E) for r in res)


def test_model_remat_policy_is_applied_inside_the_wrapper():
    def mlp(p, x):
        return jnp.tanh(jnp.tanh(x @ p["w"]) @ p["w"].T)

    full = _residuals(mlp, remat=jax.checkpoint_policies.nothing_saveable)
    assert [r.shape for r in full] == [(8, 2, E)]           # the layer input only
    assert len(_residuals(mlp)) > 1


def test_negative_dims_and_bare_axis_names():
    mesh = mesh_for({"data": 2, "fsdp": 4})
    x = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
    f = jax.jit(jax.shard_map(lambda a: bucketed_all_gather([a], [-1], ["fsdp"])[0], mesh=mesh,
                              in_specs=P(None, None, "fsdp"), out_specs=P(), check_vma=False))
    np.testing.assert_array_equal(f(x), x)
    g = jax.jit(jax.shard_map(lambda a: bucketed_reduce_scatter([a], [-1], ["fsdp"])[0], mesh=mesh,
                              in_specs=P(), out_specs=P(None, None, "fsdp"), check_vma=False))
    np.testing.assert_array_equal(g(x), 4 * x)
