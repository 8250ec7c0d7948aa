"""Meshes, logical rules and their errors: each names the field, the values and the fix."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import MeshError, MeshSpec, RulesError, logical_to_spec, resolve

from helpers import GLOBAL_BATCH, make_batch, setup

RULES = (("batch", ("data", "fsdp")), ("embed", None), ("mlp", "tensor"), ("heads", "tensor"),
         ("vocab", "tensor"), ("vocab", None))


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh(MeshSpec(data=2, fsdp=2, tensor=2))


def test_mesh_axes_and_fill():
    mesh = jaxpar.make_mesh(MeshSpec(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"pipe": 1, "data": 2, "fsdp": 2, "tensor": 2}
    mesh = jaxpar.make_mesh({"data": 4, "experts": 2})
    assert mesh.axis_names[-1] == "experts" and mesh.shape["experts"] == 2


def test_mesh_errors():
    with pytest.raises(MeshError, match=r"multiply to 6, but there are 8 devices"):
        jaxpar.make_mesh(MeshSpec(data=3, tensor=2))
    with pytest.raises(MeshError, match="only one axis may be -1"):
        jaxpar.make_mesh(MeshSpec(data=-1, tensor=-1))
    with pytest.raises(MeshError, match=r"cannot fill axis 'data'.*multiply to 3"):
        jaxpar.make_mesh(MeshSpec(data=-1, tensor=3))
    with pytest.raises(MeshError, match=r"MeshSpec.tensor=0"):
        jaxpar.make_mesh(MeshSpec(tensor=0))
    with pytest.raises(MeshError, match="clashes with a standard axis"):
        MeshSpec(extra={"data": 2}).sizes(8)
    with pytest.raises(MeshError, match=r"dcn\['tensor'\]=3"):
        MeshSpec(tensor=8, dcn={"tensor": 3}).sizes(8)


def test_simulate_cpu_devices_after_init_is_clear():
    with pytest.raises(jaxpar.BackendStartedError, match="already initialised with 8 device"):
        jaxpar.simulate_cpu_devices(4)
    jaxpar.simulate_cpu_devices(8)   # same count: fine


def test_first_match_wins_and_fallback(mesh):
    assert logical_to_spec(("batch", "embed"), RULES, mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "vocab"), RULES, mesh, shape=(4, 8)) == P(None, "tensor")
    assert logical_to_spec(("embed", "vocab"), RULES, mesh, shape=(4, 7)) == P(None, None)   # fallback


def test_resolve_mirrors_the_tree(mesh):
    tree = {"a": P("embed", "mlp"), "b": {"c": ("vocab",)}}
    shapes = {"a": jax.ShapeDtypeStruct((4, 8), np.float32), "b": {"c": jax.ShapeDtypeStruct((6,), np.float32)}}
    out = resolve(tree, RULES, mesh, shapes)
    assert out == {"a": P(None, "tensor"), "b": {"c": P("tensor")}}


def test_unknown_logical_name(mesh):
    with pytest.raises(RulesError, match=r"parameter 'w'.*logical name 'hidden'.*no rule maps.*\('hidden', None\)"):
        resolve({"w": P("embed", "hidden")}, RULES, mesh, {"w": jax.ShapeDtypeStruct((4, 4), np.float32)})


def test_mesh_axis_used_twice(mesh):
    rules = (("mlp", "tensor"), ("heads", "tensor"))
    with pytest.raises(RulesError, match=r"reuses mesh axis 'tensor', already used by dimension 0"):
        logical_to_spec(("mlp", "heads"), rules, mesh, what="parameter 'w'")


def test_indivisible_dimension(mesh):
    rules = (("mlp", "tensor"),)
    with pytest.raises(RulesError, match=r"parameter 'blocks/w1' of shape \(4, 5\).*size 5 is not divisible.*"
                                         r"tensor=2.*\('mlp', None\)"):
        resolve({"blocks": {"w1": P(None, "mlp")}}, rules, mesh,
                {"blocks": {"w1": jax.ShapeDtypeStruct((4, 5), np.float32)}})


def test_rule_names_missing_mesh_axis(mesh):
    with pytest.raises(RulesError, match=r"mesh axes \['expert'\] that the mesh does not have"):
        logical_to_spec(("mlp",), (("mlp", "expert"),), mesh)


def test_rank_mismatch(mesh):
    with pytest.raises(RulesError, match="2 logical names .* rank 3"):
        logical_to_spec(("embed", "mlp"), RULES, mesh, shape=(1, 2, 3))


def test_model_dimension_not_divisible_by_tensor_axis():
    from jaxpar.models import GPTConfig
    with pytest.raises(RulesError, match=r"'blocks/w[kqv]'.*'heads'.*size 4 is not divisible.*tensor=8"):
        setup({"tensor": 8}, cfg=GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2))


def test_batch_not_divisible_by_data_axes():
    mesh, state, layout, step = setup({"data": 8})
    with pytest.raises(ValueError, match=r"global batch size 12 is not divisible by the data axes \(data=8, fsdp=1"):
        step(state, make_batch(batch=12))
    mesh, state, layout, step = setup({"data": 4, "tensor": 2}, jaxpar.Strategy(microbatches=3))
    with pytest.raises(ValueError, match=r"x microbatches \(3\) = 12\. Use a global batch that is a multiple of 12"):
        step(state, make_batch(batch=GLOBAL_BATCH))


def test_strategy_and_model_config_errors():
    from jaxpar.models import GPTConfig
    with pytest.raises(ValueError, match=r"Strategy.zero=4: choose one of \(0, 1, 2, 3\)"):
        jaxpar.Strategy(zero=4)
    with pytest.raises(ValueError, match="Strategy.compute_dtype='fp8'"):
        jaxpar.Strategy(compute_dtype="fp8")
    with pytest.raises(ValueError, match="embed=30 is not divisible by heads=4"):
        GPTConfig(embed=30, heads=4)
    with pytest.raises(ValueError, match="remat='some'"):
        GPTConfig(remat="some")


def test_errors_are_not_deep_jax_tracebacks(mesh):
    """The error is raised by jaxpar, before anything reaches JAX."""
    with pytest.raises(RulesError) as info:
        logical_to_spec(("nope",), RULES, mesh)
    tb = info.value.__traceback__
    assert tb.tb_frame.f_code.co_filename.endswith("test_mesh_rules.py")
    while tb.tb_next:
        tb = tb.tb_next
    assert "jaxpar/rules.py" in tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_filename
