"""FP8 matmuls (jaxpar.parallel._fp8): the quantization against NumPy, the three GEMMs' dimension
numbers, the rewrite of a layer's covered matmuls, and FP8 operands in the real H100 compiler's program."""

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxpar.errors import Fp8Error
from jaxpar.models._gpt import BLOCK_LOGICAL
from jaxpar.models._gpt_layers import block_apply
from jaxpar.parallel import _fp8
from jaxpar.analysis._gemms import check_fp8_gemms, fp8_gemms
from jaxpar.options import Fp8
from jaxpar.parallel._fp8 import fp8_dot_general, fp8_layer

MATMUL = (((1,), (0,)), ((), ()))
#: einsum specs of the models' matmuls and their dimension numbers (jnp.einsum's own).
SPECS = ["ij,jk->ik", "bte,ehd->bthd", "bthd,hde->bte", "ebm,emn->ebn", "bte,me->btm"]
SHAPES = {"ij,jk->ik": ((6, 8), (8, 5)), "bte,ehd->bthd": ((2, 3, 8), (8, 4, 2)),
          "bthd,hde->bte": ((2, 3, 4, 2), (4, 2, 8)), "ebm,emn->ebn": ((3, 4, 8), (3, 8, 5)),
          "bte,me->btm": ((2, 3, 8), (5, 8))}


def _dims(spec, a, b):
    eqns = jax.make_jaxpr(lambda x, y: jnp.einsum(spec, x, y))(a, b).jaxpr.eqns
    return next(e for e in eqns if e.primitive.name == "dot_general").params["dimension_numbers"]


def _numpy_fp8(x, axis):
    """x's e4m3 values (as float64) and its scales: the absolute maximum over ``axis`` over 448."""
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64), scale.astype(np.float64)


@pytest.mark.parametrize("rowwise", [False, True])
def test_one_fp8_matmul_equals_numpy_with_the_same_quantization(rowwise):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(64, 32)).astype(np.float32)
    qa, sa = _numpy_fp8(a, 1 if rowwise else None)
    qb, sb = _numpy_fp8(b, 0 if rowwise else None)
    want = (qa @ qb) * sa * sb
    got = np.asarray(fp8_dot_general(jnp.asarray(a), jnp.asarray(b), MATMUL, rowwise=rowwise))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = a.astype(np.float64) @ b
    assert np.abs(got - exact).max() > 1e-3 * np.abs(exact).max()      # it did quantize


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("spec", SPECS)
def test_the_three_gemms_follow_the_dimension_numbers(spec, rowwise):
    """Small integers are exact in e4m3 and e5m2 once scaled, so the FP8 product and both gradients
    equal the plain ones up to fp32 round-off of the scales: a wrong dimension number is O(1) off."""
    rng = np.random.default_rng(1)
    a, b = (rng.integers(-2, 3, s).astype(np.float32) for s in SHAPES[spec])
    dn = _dims(spec, a, b)
    c = rng.integers(-2, 3, jax.eval_shape(lambda: jax.lax.dot_general(a, b, dn)).shape).astype(np.float32)
    plain = jax.value_and_grad(lambda x, y: jnp.sum(jax.lax.dot_general(x, y, dn) * c), (0, 1))(a, b)
    fp8 = jax.value_and_grad(lambda x, y: jnp.sum(fp8_dot_general(x, y, dn, rowwise=rowwise) * c), (0, 1))(a, b)
    for want, got in zip(jax.tree.leaves(plain), jax.tree.leaves(fp8)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (np.abs(want).max() + 1))


def _block(embed=32, heads=4, head_dim=8, mlp=64, dtype=jnp.float32):
    shapes = {"wq": (embed, heads, head_dim), "wk": (embed, heads, head_dim), "wv": (embed, heads, head_dim),
              "wo": (heads, head_dim, embed), "w1": (embed, mlp), "w2": (mlp, embed), "b1": (mlp,), "b2": (embed,),
              "ln1_scale": (embed,), "ln1_bias": (embed,), "ln2_scale": (embed,), "ln2_bias": (embed,)}
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return {k: (0.2 * jax.random.normal(key, s)).astype(dtype) for key, (k, s) in zip(keys, shapes.items())}


def _f8_dots(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all("float8" in str(v.aval.dtype) for v in eqn.invars):
            count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _f8_dots(sub)
    return count


def test_a_layer_runs_exactly_its_covered_matmuls_in_fp8():
    p, x = _block(), jax.random.normal(jax.random.key(1), (2, 8, 32))
    layer = fp8_layer(block_apply, BLOCK_LOGICAL, Fp8(min_dim=0))
    grad = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(layer(q, x) ** 2)))(p).jaxpr
    assert _f8_dots(grad) == 6 * 3                         # wq wk wv wo w1 w2: forward and two gradients
    small = fp8_layer(block_apply, BLOCK_LOGICAL, Fp8(min_dim=64))   # only the MLP's 32 x 64 GEMMs fall short
    assert _f8_dots(jax.make_jaxpr(small)(p, x).jaxpr) == 0
    y, want = layer(p, x), block_apply(p, x)
    assert 0 < float(jnp.max(jnp.abs(y - want))) < 0.05 * float(jnp.max(jnp.abs(want)))


def test_a_covered_weight_that_reaches_no_matmul_is_named():
    p, x = _block(), jnp.ones((2, 8, 32))
    with pytest.raises(Fp8Error, match=r"\['w1', 'w2', 'wk', 'wo', 'wq', 'wv'\] reach no matmul"):
        fp8_layer(lambda q, h: h + sum(jnp.sum(v) for v in q.values()), BLOCK_LOGICAL, Fp8())(p, x)


@pytest.mark.parametrize("kwargs, says", [({"recipe": "delayed"}, "recipes are tensorwise, rowwise"),
                                          ({"min_dim": -1}, "min_dim=-1")])
def test_bad_options_are_named(kwargs, says):
    with pytest.raises(Fp8Error, match=says):
        Fp8(**kwargs)


def _h100_block_grad():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jaxpar.devices import parse_target, target_devices
    mesh = Mesh(target_devices(parse_target("h100:1x1")), ("x",))
    spec = NamedSharding(mesh, PartitionSpec())
    p = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=spec) for k, v in _block(256, 4, 64, 1024).items()}
    x = jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16, sharding=spec)
    layer = fp8_layer(block_apply, BLOCK_LOGICAL, Fp8(min_dim=0))
    loss = lambda q, h: jnp.sum(layer(q, h).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p, x).compile().as_text()


def test_the_h100_compiler_runs_every_covered_flop_in_fp8(monkeypatch):
    """The deviceless H100 program: the FP8 GEMMs' FLOPs are the covered matmuls' (forward and both
    gradients), and a quantize-dequantize GEMM (bf16 operands) is caught by the weight's name."""
    counts = check_fp8_gemms(_h100_block_grad())
    tokens, e, h, d, m = 2 * 128, 256, 4, 64, 1024
    assert sum(c["fp8_flops"] for c in counts.values()) == 3 * 2 * tokens * (4 * e * h * d + 2 * e * m)
    assert set(counts) == {"wq", "wk", "wv", "wo", "w1", "w2"}

    real = jax.lax.dot_general
    dequantized = lambda a, b, dn, preferred_element_type=None: real(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                                                                     preferred_element_type=preferred_element_type)
    monkeypatch.setattr(_fp8.jax.lax, "dot_general", dequantized)
    hlo = _h100_block_grad()
    monkeypatch.undo()
    assert all(c["fp8"] == 0 for c in fp8_gemms(hlo).values())
    with pytest.raises(Fp8Error, match=r"compiled without FP8 operands: \{.*'w1': 3"):
        check_fp8_gemms(hlo)


def test_shards_of_a_manual_region_share_one_scale_and_the_region_is_rewritten():
    """A layer whose matmul runs inside a ``shard_map`` over the batch (as explicit data parallelism and
    tensor parallelism's row-parallel regions do): the covered weight is found inside it, and the
    tensorwise scale is the whole activation's, so the result equals the unsharded FP8 layer."""
    from jax.sharding import AxisType, PartitionSpec
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.key(0), (16, 32)) * jnp.arange(1.0, 17.0)[:, None]   # rows' maxima differ
    w = jax.random.normal(jax.random.key(1), (32, 64))
    local = lambda p, h: h @ p["w1"]                                            # noqa: E731
    sharded = lambda p, h: jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("data")),
                                         out_specs=PartitionSpec("data"))(p, h)  # noqa: E731
    logical = {"w1": ("embed", "mlp")}
    want = fp8_layer(local, logical, Fp8(min_dim=0))({"w1": w}, x)
    got = jax.jit(fp8_layer(sharded, logical, Fp8(min_dim=0)))({"w1": w}, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    per_shard = jax.jit(jax.shard_map(lambda h: fp8_dot_general(h, w, MATMUL), mesh=mesh,
                                      in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))(x)
    np.testing.assert_allclose(per_shard, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))


def test_fp8_residuals_survive_a_saving_remat_policy():
    """Under ``jax.checkpoint`` with a policy that saves them, the FP8 residuals are not passed through
    ``reduce_precision`` with IEEE e4m3 semantics (which turns e4m3fn values above 240 into inf): the
    product and the gradients equal those without remat."""
    x = jnp.linspace(-3.0, 3.0, 48).reshape(6, 8)
    w = jnp.linspace(-1.0, 2.0, 40).reshape(8, 5)
    f = lambda w, x: jnp.sum(jnp.tanh(fp8_dot_general(x, w, MATMUL)))     # noqa: E731
    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable)
    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(w, x)
    got = jax.jit(jax.value_and_grad(remat, argnums=(0, 1)))(w, x)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


def test_the_strategy_and_the_config_take_fp8_options_or_name_the_field():
    import jaxpar
    from jaxpar.config import ConfigError
    from jaxpar.config._build import build_option
    from jaxpar.parallel import fp8_loss

    s = jaxpar.Strategy(fp8=Fp8(recipe="rowwise"), compute_dtype="bfloat16")
    assert s.name({"fsdp": 8}) == "fsdp8-bfloat16-fp8-rowwise"
    with pytest.raises(jaxpar.errors.StrategyError, match="Strategy.fp8='tensorwise'"):
        jaxpar.Strategy(fp8="tensorwise")
    assert build_option("fp8", {}) is None
    assert build_option("fp8", {"recipe": "rowwise", "min_dim": 0}) == Fp8("rowwise", 0)
    with pytest.raises(ConfigError, match=r"parallel.fp8 has unknown keys \['amax_history'\]"):
        build_option("fp8", {"amax_history": 16})
    with pytest.raises(ConfigError, match=r"parallel.fp8.recipe='delayed': the recipes are"):
        build_option("fp8", {"recipe": "delayed"})
    loss = lambda model, batch: 0.0      # noqa: E731
    assert fp8_loss(loss, None) is loss


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_fp8_after_a_context_parallel_step_of_the_same_shapes_is_unchanged():
    """JAX caches a function's trace by its identity and shapes, not by the jaxpar contexts the trace reads:
    the GPT's layer traced for a ring-attention step must not come back in a later FP8 trace of the same shapes
    (run_layers traces each call's layer afresh). Seen as an FP8 loss 1e-5 off after such a step."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.models import GPT, GPTConfig
    from jaxpar.models._gpt import lm_loss
    from jaxpar.parallel import fp8_loss
    from jaxpar.options import ContextParallel
    from helpers import make_batch

    cfg = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    batch = make_batch(16, cfg)

    def fp8_value():
        loss = fp8_loss(lm_loss, Fp8(min_dim=0))
        return float(jax.jit(lambda p, b: loss(nnx.merge(graphdef, p), b))(params, batch))

    mesh = jaxpar.make_mesh({"data": 4, "context": 2})
    strategy = jaxpar.Strategy(context=ContextParallel(method="ring", balance=True))
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)
    jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout)(state, jaxpar.shard_batch(batch, mesh))
    after = fp8_value()
    jax.clear_caches()          # JAX's caches as in a fresh process
    assert after == fp8_value()
