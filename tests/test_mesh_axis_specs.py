"""Models annotated with the mesh's own axis names (``P("fsdp", "tensor")``), the style of JAX's
and Flax's sharding guides: no rules needed, a user rule still wins, ZeRO / FSDP never repeats an
axis the model already uses, and a conflict is a named error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

import jaxpar
from jaxpar import RulesError, Strategy, logical_to_spec
from jaxpar.parallel import add_zero_axes

from conftest import need_devices

RULES = (("batch", ("data", "fsdp")), ("embed", None), ("mlp", "tensor"))
MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_a_mesh_axis_name_means_that_axis():
    assert logical_to_spec(("fsdp", "tensor"), RULES, MESH, shape=(8, 8)) == P("fsdp", "tensor")
    assert logical_to_spec((("data", "fsdp"), None), RULES, MESH, shape=(8, 8)) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "tensor"), RULES, MESH, shape=(8, 8)) == P(None, "tensor")   # mixed


def test_a_rule_for_the_name_wins_over_the_mesh_axis():
    rules = (("tensor", None),) + RULES
    assert logical_to_spec(("fsdp", "tensor"), rules, MESH, shape=(8, 8)) == P("fsdp", None)


def test_mesh_axis_conflicts_are_named():
    with pytest.raises(RulesError, match=r"parameter 'w'.*pinned to mesh axes \('tensor',\).*does not divide.*5"):
        logical_to_spec(("fsdp", "tensor"), RULES, MESH, shape=(8, 5), what="parameter 'w'")
    with pytest.raises(RulesError, match="names mesh axis 'fsdp', which dimension 0 already uses"):
        logical_to_spec(("fsdp", "fsdp"), RULES, MESH, shape=(8, 8))
    with pytest.raises(RulesError, match="'model', which no rule maps and which is not a mesh axis.*mesh axes"):
        logical_to_spec(("model", None), RULES, MESH, shape=(8, 8))


@pytest.mark.parametrize("spec,axes,want", [
    (P("fsdp", None), ("fsdp",), P("fsdp", None)),                        # FSDP: already there
    (P(None, "fsdp"), ("fsdp", "data"), P("data", "fsdp")),                # ZeRO's data on a free dim
    (P("tensor", "fsdp"), ("fsdp", "data"), P("tensor", ("fsdp", "data"))),  # no free dim: minor on fsdp's
    (P("data", "tensor"), ("data",), P("data", "tensor")),
])
def test_zero_never_repeats_an_axis(spec, axes, want):
    got = add_zero_axes(spec, (8, 16), (None, None), axes, {"data": 2, "fsdp": 2, "tensor": 2})
    assert got == want
    used = [a for e in got for a in ((e,) if isinstance(e, str) else e or ())]
    assert len(used) == len(set(used))


class MeshAxisMLP(nnx.Module):
    """Parameters annotated with mesh axes only; no activation pins (those need the mesh set)."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.1)
        self.up = nnx.Param(nnx.with_partitioning(init, P("fsdp", "tensor"))(rngs.params(), (16, 32)))
        self.down = nnx.Param(nnx.with_partitioning(init, P("tensor", "fsdp"))(rngs.params(), (32, 16)))
        self.bias = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros_init(), P(None))(rngs.params(), (16,)))

    def __call__(self, x):
        return jnp.tanh(x @ self.up[...]) @ self.down[...] + self.bias[...]


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch():
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)}


def _train(axes, strategy, steps=3):
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    tx = optax.adam(1e-2)
    state, layout = jaxpar.init_train_state(lambda: MeshAxisMLP(nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(_loss, tx, layout)
    losses = []
    for _ in range(steps):
        state, m = step(state, jaxpar.shard_batch(_batch(), mesh))
        losses.append(float(m["loss"]))
    return state, layout, losses


@need_devices(8)
@pytest.mark.parametrize("axes,zero", [({"data": 8}, 3), ({"fsdp": 8}, 0), ({"fsdp": 4, "tensor": 2}, 0),
                                       ({"data": 2, "fsdp": 2, "tensor": 2}, 3),
                                       ({"data": 2, "fsdp": 2, "tensor": 2}, 1)])
def test_mesh_axis_model_trains_exactly_without_rules(axes, zero):
    ref_state, _, ref = _train({"data": 1}, Strategy())
    state, layout, losses = _train(axes, Strategy(zero=zero))
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    # Adam: |Δp| <= lr per step, so 3 steps at lr 1e-2 differ by float error only
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    sizes = dict(layout.mesh.shape)
    up = layout.params["up"]
    assert up[1] == ("tensor" if sizes["tensor"] > 1 else up[1])
    for spec in jax.tree.leaves(layout.params, is_leaf=lambda x: isinstance(x, P)):
        used = [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]
        assert len(used) == len(set(used)), spec
    # the state's bytes are what its shardings hold
    real = sum(s.data.nbytes for a in jax.tree.leaves(state.params) for s in a.addressable_shards[:1])
    assert layout.analytic_bytes()["params"] == pytest.approx(real)


@need_devices(8)
def test_explicit_dp_is_refused_for_a_model_that_splits_over_data_axes_itself():
    from jaxpar.step._grads import ExplicitDPError

    mesh = jaxpar.make_mesh({"fsdp": 8}, devices=jax.devices()[:8])
    tx = optax.adam(1e-2)
    state, layout = jaxpar.init_train_state(lambda: MeshAxisMLP(nnx.Rngs(0)), tx, mesh, Strategy())
    step = jaxpar.make_train_step(_loss, tx, layout, explicit_dp=True)
    with pytest.raises(ExplicitDPError, match=r"model's own specs shard parameters \['down', 'up'\]"):
        step(state, jaxpar.shard_batch(_batch(), mesh))
