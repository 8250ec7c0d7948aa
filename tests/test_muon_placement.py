"""Muon's Newton-Schulz placed on sharded matrices (jaxpar.optimizers.muon(placement=...), docs/muon.md).

``gather`` and ``owner`` are exact: 3 steps under FSDP8 (and FSDP4 x TP2 + SP, DP2 x FSDP2 x TP2) equal one
device at the fp32 parameter standard, as tests/test_muon.py compares XLA's placement. ``local``
orthogonalises each shard alone: it differs from one device by O(lr) and equals Newton-Schulz applied to
each shard by hand. The cost model (:mod:`jaxpar.cost._muon`) counts the FLOPs and chooses.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from jaxpar import cost
from jaxpar.adapters import abstract_model
from jaxpar.errors import OptimizerError
from jaxpar.optimizers import muon, muon_placements

from conftest import need_devices
from helpers import mesh_for
from test_muon import _model, assert_like_one_device, train_muon

LAYOUTS = {
    "fsdp8": ({"fsdp": 8}, {}),
    "fsdp4-tp2-sp": ({"fsdp": 4, "tensor": 2}, {"sequence_parallel": True}),
    "dp2-fsdp2-tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    "zero1-dp8": ({"data": 8}, {"zero": 1}),
    "zero3-dp8": ({"data": 8}, {"zero": 3}),
    "1f1b-pipe2-dp4": ({"pipe": 2, "data": 4}, {"microbatches": 2, "schedule": "1f1b"}),
}


@need_devices(8)
@pytest.mark.parametrize("name,placement", [
    (n, p) if (n, p) == ("fsdp8", "owner") else pytest.param(n, p, marks=pytest.mark.exhaustive)
    for n in LAYOUTS for p in ("owner", "gather")])       # gather's fast case: test_local_orthogonalises_...
def test_an_exact_placement_equals_one_device(name, placement):
    sizes, kw = LAYOUTS[name]
    assert_like_one_device(f"{name} {placement}", *train_muon(sizes, jaxpar.Strategy(**kw), placement=placement))


def _one_update(on, spec, names, shape, **place):
    """One Muon update of a leaf ``w`` (momentum 0: the direction is Newton-Schulz of the gradient's
    Nesterov mix), jitted with the leaf sharded by ``spec``; and the gradient."""
    w = jax.random.normal(jax.random.key(0), shape)
    g = jax.random.normal(jax.random.key(1), shape)
    tx = muon(0.1, logical={"w": names}, nesterov=False, **place)
    sh = {"w": NamedSharding(on, spec)}
    update = jax.jit(lambda g, s, p: tx.update(g, s, p)[0], in_shardings=(sh, None, sh))
    return np.asarray(update({"w": g}, tx.init({"w": w}), {"w": w})["w"]), g


@need_devices(8)
def test_local_orthogonalises_each_shard_alone():
    """FSDP8 over ``embed`` of ``[layers, embed, mlp]``: ``local`` is Newton-Schulz of each device's
    ``[4, 64]`` row block (times the whole matrix's shape scale), not of the matrix: O(lr) away from it."""
    mesh, shape, names = mesh_for({"fsdp": 8}), (2, 32, 64), ("layers", "embed", "mlp")
    spec = P(None, "fsdp", None)
    local, g = _one_update(mesh, spec, names, shape, placement="local", mesh=mesh, specs={"w": spec})
    exact, _ = _one_update(mesh_for({}), P(), names, shape)
    ns = lambda x: optax.contrib._muon.orthogonalize_via_newton_schulz(   # noqa: E731
        x, jnp.asarray(optax.contrib._muon._DEFAULT_NS_COEFFS), 5, "frobenius", 1e-8)
    scale = np.sqrt(max(1, 64 / 32))
    by_hand = np.stack([np.concatenate([np.asarray(ns(g[i, 4 * s:4 * s + 4])) for s in range(8)]) for i in range(2)])
    np.testing.assert_allclose(local, -0.1 * scale * by_hand, rtol=1e-5, atol=1e-6)
    assert np.abs(local - exact).max() > 0.1 * 0.1, "local equals the exact update: nothing was blockwise"
    gather, _ = _one_update(mesh, spec, names, shape, placement="gather", mesh=mesh, specs={"w": spec})
    np.testing.assert_allclose(gather, exact, rtol=1e-5, atol=1e-6)


def test_the_cost_model_counts_newton_schulz_and_chooses_per_group():
    wq = cost.MatrixGroup("blocks/wq", (8, 4096, 32, 128), (1,), (2, 3), ((), ("fsdp",), (), ()))
    assert cost.ns_flops(4096, 4096, 5) == 5 * 6 * 4096 ** 3
    sizes = {"fsdp": 8}
    owner, gather = (cost.placement_cost(wq, sizes, p, 5) for p in ("owner", "gather"))
    assert owner.flops * 8 == gather.flops == 8 * cost.ns_flops(4096, 4096, 5)     # once per matrix vs on every device
    assert [(c.kind, c.count) for c in owner.comms] == [("all-to-all", 2)]
    assert owner.comms[0].bytes == 4096 * 4096 * 4 and gather.comms[0].bytes == 8 * 4096 * 4096 * 4
    assert cost.choose_placement(wq, sizes, 5, "h100") == "owner"
    assert cost.choose_placement(wq, {"data": 8}, 5, "h100") == "local"           # no axis cuts the matrix
    one = cost.MatrixGroup("w", (64, 64), (0,), (1,), (("fsdp",), ()))            # one tiny matrix: latency
    assert cost.choose_placement(one, sizes, 5, "h100") == "gather"
    u = cost.muon_update(cost.gpt(2, 128, 4, 64, 256, 32), sizes, "cpu_sim", placement="gather")
    assert len(u.groups) == 6 and u.flops == sum(c.flops for _, c in u.groups) and "blocks/w1" in u.table()


def test_the_planner_counts_newton_schulz_in_the_update():
    model, h100 = cost.gpt(4, 1024, 16, 1024, 32000, 64), cost.load_cluster("h100", num_devices=8)
    settings = dict(ns_steps=5, placement="auto")
    adamw = cost.evaluate(model, cost.Plan(fsdp=8), h100)
    muon_ = cost.evaluate(model, cost.Plan(fsdp=8), h100, muon=settings)
    update = cost.muon_update(model, {"fsdp": 8}, h100)
    assert muon_.time.optimizer == pytest.approx(adamw.time.optimizer + update.seconds)
    assert muon_.time.bytes_per_axis["fsdp"] == pytest.approx(adamw.time.bytes_per_axis["fsdp"] + update.bytes)
    matrices = sum(math.prod(g.shape) for g in cost.matrix_groups(model, {"fsdp": 8}))
    assert muon_.memory.opt == pytest.approx(adamw.memory.opt - 4 * matrices / 8)      # one moment, not two
    ranked = cost.plan(model, h100, top=3, muon=settings, fp8=False).ranked
    assert all(e.time.optimizer > cost.evaluate(model, e.plan, h100).time.optimizer for e in ranked[:3])


def test_placement_options_are_checked_by_name():
    with pytest.raises(OptimizerError, match=r"placement='nearest'.*auto, gather, owner, local"):
        muon(0.02, placement="nearest")
    with pytest.raises(OptimizerError, match=r"give both"):
        muon(0.02, mesh=mesh_for({}))
    with pytest.raises(OptimizerError, match=r"placement='owner'.*mesh= and specs="):
        muon(0.02, placement="owner")
    _, shapes, logical = abstract_model(_model)
    mesh = mesh_for({})
    with pytest.raises(OptimizerError, match=r"no PartitionSpec for the Muon-routed parameter 'blocks/w1'"):
        muon_placements(shapes, logical, mesh=mesh, specs={"wte": P()})
    from jaxpar.config import build_optimizer
    from jaxpar.config._schema import ConfigError, MuonConfig, OptimizerConfig

    with pytest.raises(ConfigError, match=r"optimizer.muon.placement='ring'"):
        build_optimizer(OptimizerConfig(name="muon", muon=MuonConfig(placement="ring")), 10)


@need_devices(8)
def test_yaml_placement_reaches_the_optimizer():
    from jaxpar.config import build_optimizer
    from jaxpar.config._schema import MuonConfig, OptimizerConfig

    mesh, strategy = mesh_for({"fsdp": 8}), jaxpar.Strategy()
    cfg = OptimizerConfig(name="muon", lr=0.02, muon=MuonConfig(placement="owner"))
    params = jaxpar.param_layout(_model, mesh, strategy)
    tx, _ = build_optimizer(cfg, 10, params=params)
    layout = jaxpar.state_layout(_model, tx, mesh, strategy, param_layout=params)
    places = muon_placements(layout.shapes, layout.logical, mesh=mesh, specs=layout.opt_param_specs,
                             placement="owner")
    assert {p.kind for p in places.values()} == {"owner"} and places["blocks/w1"].axes == ("fsdp",)
