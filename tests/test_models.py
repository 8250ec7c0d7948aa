"""Models: a user-style nnx.Linear MLP under TP / FSDP, remat policies, bf16 compute."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import MLPClassifier, classifier_loss

from helpers import CFG, assert_runs_match, mesh_for, run

P = jax.sharding.PartitionSpec


def mlp_run(sizes, strategy=jaxpar.Strategy(), steps=3):
    mesh = mesh_for(sizes)
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(
        lambda: MLPClassifier(features=16, embed=32, mlp=64, classes=8, depth=2, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(classifier_loss, tx, layout, strategy)
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), "y": jnp.asarray(rng.integers(0, 8, 16))}
    losses = []
    for _ in range(steps):
        state, m = step(state, jaxpar.shard_batch(batch, mesh))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params), layout


_RUNS = {}


def cached_run(sizes, steps=3):
    """``run(sizes, steps=steps)`` with the default strategy and model, computed once per module."""
    key = (tuple(sorted(sizes.items())), steps)
    if key not in _RUNS:
        _RUNS[key] = run(sizes, steps=steps)
    return _RUNS[key]


@pytest.fixture(scope="module")
def mlp_reference():
    return mlp_run({})


# (up kernel, down kernel) specs: Megatron pairing (column- then row-parallel) on a user's
# nnx.Linear layers; FSDP shards the other dimension; ZeRO-2 keeps parameters unsharded.
MLP_CASES = [({"tensor": 8}, 0, (P(None, "tensor"), P("tensor", None))),
             ({"fsdp": 4, "tensor": 2}, 0, (P("fsdp", "tensor"), P("tensor", "fsdp"))),
             ({"data": 8}, 2, (P(None, "tensor"), P("tensor", None)))]   # tensor=1: a no-op axis


@pytest.mark.parametrize("sizes,zero,specs", MLP_CASES, ids=["tp8", "fsdp4-tp2", "dp8-zero2"])
def test_mlp_classifier_matches_single_device(sizes, zero, specs, mlp_reference):
    """SGD (no normalised step): parameters move by lr x gradient, so they stay within fp32 round-off."""
    ref_losses, ref_params, _ = mlp_reference
    losses, params, layout = mlp_run(sizes, jaxpar.Strategy(zero=zero))
    assert losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params)
    for i in range(2):
        assert (layout.params["up"][i]["kernel"], layout.params["down"][i]["kernel"]) == specs


# One policy per mesh in the default run, the other two in the exhaustive tier.
@pytest.mark.parametrize("remat, sizes", [
    pytest.param("full", {"fsdp": 8}, id="full-fsdp8-explicit"),
    pytest.param("save-matmuls", {"data": 2, "tensor": 4}, id="save-matmuls-dp2-tp4"),
    pytest.param("full", {"data": 2, "tensor": 4}, id="full-dp2-tp4", marks=pytest.mark.exhaustive),
    pytest.param("save-matmuls", {"fsdp": 8}, id="save-matmuls-fsdp8-explicit", marks=pytest.mark.exhaustive)])
def test_remat_policies_do_not_change_numbers(remat, sizes):
    """Losses, first-step gradients and parameters after 3 AdamW steps (tolerances: helpers.adam_atol)."""
    base = cached_run(sizes)
    other = run(sizes, cfg=dataclasses.replace(CFG, remat=remat))
    assert_runs_match(other, base)


def test_scan_and_loop_agree():
    """One AdamW step: same loss, gradients and parameters whether the layers are scanned or looped."""
    a = run({}, steps=1)
    b = run({}, steps=1, cfg=dataclasses.replace(CFG, scan_layers=False))
    assert_runs_match(b, a, loss_rtol=1e-6)


@pytest.mark.parametrize("sizes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8}],
                         ids=["dp2-fsdp2-tp2", "fsdp8-explicit"])
def test_bf16_compute_keeps_fp32_master_weights(sizes):
    losses, params, *_ = run(sizes, jaxpar.Strategy(compute_dtype="bfloat16"), steps=4)
    ref_losses = cached_run({}, steps=4).losses
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))
    np.testing.assert_allclose(losses, ref_losses, rtol=3e-2)   # bf16 rounding, same trajectory
    assert losses[-1] < losses[0]


def test_sharded_init_never_materialises_full_copies():
    """Each parameter shard lives only on its devices: per-device bytes == analytic."""
    from helpers import setup
    mesh, state, layout, _ = setup({"fsdp": 8})
    wq = state.params["blocks"]["wq"]
    assert wq.sharding.spec == layout.params["blocks"]["wq"]
    per_device = {s.device: s.data.nbytes for s in wq.addressable_shards}
    assert len(per_device) == 8 and all(b == wq.nbytes // 8 for b in per_device.values())
    abstract = layout.abstract_state()
    assert abstract.params["blocks"]["wq"].sharding == wq.sharding


class Tiny(nnx.Module):
    """A user's own model: one nnx.Linear annotated with nnx.with_partitioning."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, rngs=rngs,
                              kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")))

    def __call__(self, x):
        return self.lin(x)


def tiny_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def tiny_run(sizes, steps=5):
    """``steps`` SGD steps of a least-squares fit; returns (losses, params on host, the kernel's spec)."""
    mesh = mesh_for(sizes)
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(lambda: Tiny(nnx.Rngs(0)), tx, mesh)
    step = jaxpar.make_train_step(tiny_loss, tx, layout)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batch = jaxpar.shard_batch({"x": x, "y": np.tanh(x @ rng.normal(size=(8, 16))).astype(np.float32)}, mesh)
    spec = state.params["lin"]["kernel"].sharding.spec
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params), spec


def test_user_model_with_flax_partitioning_annotations():
    """A user's own nnx model using nnx.with_partitioning is built without a mesh context,
    placed by its annotations, trains, and matches the single-device run."""
    ref_losses, ref_params, _ = tiny_run({})
    losses, params, spec = tiny_run({"data": 4, "tensor": 2})
    assert spec == P(None, "tensor")
    assert losses[-1] < 0.9 * losses[0], losses
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, ref_params)


@pytest.mark.exhaustive
@pytest.mark.parametrize("explicit_dp", [True, False], ids=["explicit", "xla"])
def test_remat_lowers_temporaries_on_both_data_parallel_paths(explicit_dp):
    """The model's remat policy is honoured also inside jaxpar's explicit FSDP layer wrapper."""
    from helpers import compile_step
    temp = {}
    for remat in ("none", "save-matmuls", "full"):
        cfg = dataclasses.replace(CFG, remat=remat, layers=8)
        _, _, c = compile_step({"fsdp": 8}, jaxpar.Strategy(), cfg=cfg, explicit_dp=explicit_dp)
        temp[remat] = c.memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["save-matmuls"] < temp["none"], temp
    assert temp["full"] < 0.3 * temp["none"], temp
