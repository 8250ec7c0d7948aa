"""Muon (jaxpar.optimizers.muon): routed by logical names, exact under every layout, built from YAML.

Layouts: 3 steps of Muon (matrices) + AdamW (the rest) under each layout against one device, fp32.
The Muon-routed parameters compare at the fp32 parameter standard (rtol 1e-4, atol 1e-6): their update
``-lr (NS(momentum) scale + wd w)`` is a smooth function of the gradients (a Frobenius normalisation and
a fixed polynomial), so gradient round-off moves it by round-off, not by a normalised step as in Adam.
The AdamW-routed ones compare as tests/helpers.py's AdamW runs do (``adam_atol``). A wrong routing
(a stack orthogonalised as one matrix, a shard orthogonalised alone) moves a matrix by O(lr).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import abstract_model, stack_layers
from jaxpar.errors import OptimizerError
from jaxpar.models import GPT, GPTConfig, MoESettings, lm_loss
from jaxpar.optimizers import muon, muon_routes, muon_routing, muon_routing_table

from conftest import need_devices
from helpers import (CFG, PARAM_ATOL, PARAM_RTOL, adam_atol, assert_grads_close, flat, keep_grads, make_batch,
                     mesh_for)

MUON_LR, ADAM_LR, STEPS = 0.02, 1e-3, 3


def _model():
    return GPT(CFG, rngs=nnx.Rngs(0))


def _tx(logical, **place):
    return muon(MUON_LR, logical=logical, weight_decay=0.1, adam=dict(lr=ADAM_LR, b2=0.999, weight_decay=0.1),
                **place)


def _setup(sizes, strategy, model_fn=_model, record=True, placement=None):
    """``placement``: Newton-Schulz placed on the mesh (tests/test_muon_placement.py); None: XLA's."""
    mesh = mesh_for(sizes)
    place = {}
    if placement is not None:
        specs = jaxpar.state_layout(model_fn, optax.identity(), mesh, strategy).opt_param_specs
        place = dict(placement=placement, mesh=mesh, specs=specs)
    tx = _tx(abstract_model(model_fn)[2], **place)
    tx = optax.chain(keep_grads(), tx) if record else tx
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    return mesh, state, layout, jaxpar.make_train_step(lm_loss, tx, layout, strategy)


def train_muon(sizes, strategy=jaxpar.Strategy(), model_fn=_model, placement=None):
    """Params after 3 steps of Muon on ``sizes`` and the first gradients."""
    mesh, state, layout, step = _setup(sizes, strategy, model_fn, placement=placement)
    batch = jaxpar.shard_batch(make_batch(), mesh)
    grads = None
    for _ in range(STEPS):
        state, _ = step(state, batch)
        grads = jax.device_get(state.opt_state[0].grads) if grads is None else grads
    return jax.device_get(state.params), grads


#: The MoE GPT of EP4: 4 experts, top-2, dropless (so expert parallelism is exact), every layer MoE.
MOE_CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=2, mlp=32,
                    moe=MoESettings(experts=4, top_k=2, capacity_factor=None))


def _moe_model():
    return GPT(MOE_CFG, rngs=nnx.Rngs(0))


_REFERENCES: dict = {}


def one_device_reference(model_fn=_model):
    """One device's run of ``model_fn`` (computed once per session)."""
    if model_fn not in _REFERENCES:
        _REFERENCES[model_fn] = train_muon({}, model_fn=model_fn)
    return _REFERENCES[model_fn]


def assert_like_one_device(name, params, grads, model_fn=_model):
    """The first gradients as tests/helpers.py compares them; the Muon-routed parameters at the fp32 parameter
    standard, the AdamW-routed ones with ``adam_atol`` (the module docstring)."""
    ref_params, ref_grads = one_device_reference(model_fn)
    assert_grads_close(grads, ref_grads)
    rules = muon_routing(*abstract_model(model_fn)[1:])
    got, ref, g1 = flat(params), flat(ref_params), flat(ref_grads)
    assert {r for r in rules.values()} == {"muon", "adam"}
    for k, rule in rules.items():
        r = ref[k].astype(np.float64)
        extra = 0.0 if rule == "muon" else adam_atol(g1[k], ADAM_LR, STEPS)
        diff = np.abs(got[k] - r)
        assert (diff <= PARAM_RTOL * np.abs(r) + PARAM_ATOL + extra).all(), \
            f"{name}: {rule} parameter {k}: max |diff| {diff.max():.3g}"


LAYOUTS = {
    "fsdp8": ({"fsdp": 8}, {}, _model),
    "dp8": ({"data": 8}, {}, _model),
    "zero1": ({"data": 8}, {"zero": 1}, _model),
    "zero2": ({"data": 8}, {"zero": 2}, _model),
    "zero3": ({"data": 8}, {"zero": 3}, _model),
    "fsdp4-tp2-sp": ({"fsdp": 4, "tensor": 2}, {"sequence_parallel": True}, _model),
    "1f1b-pipe2-dp4": ({"pipe": 2, "data": 4}, {"microbatches": 2, "schedule": "1f1b"}, _model),
    "ep4-dp2": ({"data": 2, "expert": 4}, {}, _moe_model),
}


@need_devices(8)
@pytest.mark.parametrize("name", [n if n == "fsdp8" else pytest.param(n, marks=pytest.mark.exhaustive)
                                  for n in LAYOUTS])
def test_muon_under_a_layout_equals_one_device(name):
    sizes, kw, model_fn = LAYOUTS[name]
    if model_fn is _moe_model:           # the experts' matrices are Muon's, per layer and expert
        rules = muon_routing(*abstract_model(model_fn)[1:])
        assert rules["blocks/experts_w1"] == rules["blocks/experts_w2"] == "muon"
    assert_like_one_device(name, *train_muon(sizes, jaxpar.Strategy(**kw), model_fn), model_fn)


def test_the_update_is_one_newton_schulz_per_stacked_matrix():
    """A stacked ``[layers, embed, heads, kv]`` leaf is updated as each layer's ``embed x heads*kv`` matrix,
    alone: equal to optax's 2-D Muon on that matrix."""
    w = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    g = jax.random.normal(jax.random.key(1), w.shape)
    tx = muon(0.1, logical={"w": ("layers", "embed", "heads", "kv")})
    ours = tx.update({"w": g}, tx.init({"w": w}), {"w": w})[0]["w"]
    ref = optax.contrib.muon(0.1)
    for i in range(2):
        m, gm = w[i].reshape(8, 8), g[i].reshape(8, 8)
        want = ref.update(gm, ref.init(m), m)[0]
        np.testing.assert_allclose(ours[i].reshape(8, 8), want, rtol=1e-5, atol=1e-6)


def _rules(model_fn):
    _, shapes, logical = abstract_model(model_fn)
    return muon_routes(shapes, logical)


def test_routing_of_the_scanned_gpt():
    routes = _rules(_model)
    for k in ("wq", "wk", "wv", "wo", "w1", "w2"):
        r = routes[f"blocks/{k}"]
        assert r.rule == "muon" and r.batch == (0,), (k, r)          # per layer
    assert routes["blocks/wq"].reduction == (1,) and routes["blocks/wq"].output == (2, 3)   # embed x heads*kv
    assert routes["blocks/wo"].reduction == (1, 2) and routes["blocks/wo"].output == (3,)
    for k in ("wte", "head", "wpe", "lnf_scale", "blocks/ln1_scale", "blocks/b1"):
        assert routes[k].rule == "adam", k
    table = muon_routing_table(*abstract_model(_model)[1:])
    assert re.search(r"blocks/wq\s+muon\s+embed\(32\) x heads\*kv\(32\)\s+batch layers\(2\)", table), table


def test_routing_of_the_moe_gpt():
    cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=2, moe=MoESettings(experts=4, every=2))
    routes = _rules(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    for k in ("experts_w1", "experts_w2"):
        r = routes[f"blocks/{k}"]
        assert r.rule == "muon" and len(r.batch) == 2, (k, r)        # per layer and per expert
    assert routes["blocks/w1"].rule == "muon"                         # the dense layer's MLP
    assert routes["blocks/router"].rule == "adam" and routes["wte"].rule == "adam"


class _Block(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(nnx.with_partitioning(init, ("embed", "mlp"))(rngs.params(), (8, 16)))
        self.down = nnx.Param(nnx.with_partitioning(init, ("mlp", "embed"))(rngs.params(), (16, 8)))
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))(rngs.params(), (8,)))

    def __call__(self, x):
        return x + jnp.tanh(x @ self.up[...]) @ self.down[...] * self.scale[...]


class _ListNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(), ("vocab", "embed"))(
            rngs.params(), (32, 8)))
        self.blocks = nnx.List([_Block(rngs) for _ in range(3)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_routing_of_an_nnx_list_model_as_a_list_and_stacked():
    listed = _rules(lambda: _ListNet(nnx.Rngs(0)))
    stacked = _rules(lambda: stack_layers(_ListNet(nnx.Rngs(0))))
    for i in range(3):
        assert listed[f"blocks/{i}/up"].rule == listed[f"blocks/{i}/down"].rule == "muon"
        assert listed[f"blocks/{i}/scale"].rule == "adam"
    up = stacked["blocks/layer/up"]
    assert up.rule == "muon" and up.batch == (0,) and up.reduction == (1,)   # one Newton-Schulz per layer
    assert listed["embed"].rule == stacked["embed"].rule == "adam"


def test_a_model_without_logical_names_is_named_and_routing_routes_it():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    with pytest.raises(OptimizerError, match=r"'w' .*routing=\{'<path regex>'"):
        muon_routing(params)
    mesh_named = {"w": ("fsdp", "tensor"), "b": (None,)}                   # mesh axes, not logical names
    with pytest.raises(OptimizerError, match=r"'w' of shape \(8, 4\) has mesh-axis names \['fsdp', 'tensor'\], not "
                                             "logical names"):
        muon_routing(params, mesh_named)
    assert muon_routing(params, routing={"^w$": "muon"}) == {"b": "adam", "w": "muon"}
    with pytest.raises(OptimizerError, match="matches no parameter"):
        muon_routing(params, routing={"^nope$": "muon"})
    with pytest.raises(OptimizerError, match=r"muon\(adam=\{'beta1'"):
        muon(0.02, adam={"beta1": 0.9})
    with pytest.raises(OptimizerError, match=r"muon\(momentum=1.5\)"):
        muon(0.02, momentum=1.5)


def test_yaml_optimizer_muon_builds_the_routed_optimizer():
    from jaxpar.config import build_optimizer
    from jaxpar.config._schema import ConfigError, MuonConfig, OptimizerConfig

    cfg = OptimizerConfig(name="muon", lr=0.02, muon=MuonConfig(adam_lr=1e-3, routing={"^wpe$": "adam"}))
    tx, _ = build_optimizer(cfg, 10, params=jaxpar.param_layout(_model, mesh_for({})))
    _, shapes, _ = abstract_model(_model)
    state = jaxpar.init_train_state(_model, tx, mesh_for({}))[0].opt_state      # optax.tree_map_params's init too
    halves = state.inner_state.inner_states                # inject_hyperparams' inner state: optax.partition's
    matrices, adam = (halves[k].inner_state[0] for k in ("muon", "adam"))
    assert isinstance(matrices, optax.contrib.MuonState) and matrices.mu["wte"] == optax.MaskedNode()
    assert matrices.mu["blocks"]["wq"].shape == shapes["blocks"]["wq"].shape
    assert matrices.mu["wpe"] == optax.MaskedNode() and adam.mu["wpe"].shape == shapes["wpe"].shape
    with pytest.raises(ConfigError, match=r"optimizer.muon.ns_steps=0"):
        build_optimizer(OptimizerConfig(name="muon", muon=MuonConfig(ns_steps=0)), 10)


@need_devices(8)
def test_a_muon_run_resumes_bit_exact_and_onto_another_mesh(tmp_path):
    """FSDP8: 2 steps, a checkpoint, 1 more step; the checkpoint restored and the same step run again gives
    the same parameters and Muon state bit for bit; restored under DP4 x TP2, the state is the saved one."""
    from jaxpar.run import Checkpointer

    mesh, state, layout, step = _setup({"fsdp": 8}, jaxpar.Strategy(), record=False)
    batch = jaxpar.shard_batch(make_batch(), mesh)
    for _ in range(2):
        state, _ = step(state, batch)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(2, state, wait=True)
        saved = jax.device_get((state.params, state.opt_state))
        once = jax.device_get(step(state, batch)[0])
        again = jax.device_get(step(ck.restore(layout).state, batch)[0])
        for a, b in zip(jax.tree.leaves((once.params, once.opt_state)), jax.tree.leaves((again.params, again.opt_state))):
            np.testing.assert_array_equal(a, b)
        _, _, other, _ = _setup({"data": 4, "tensor": 2}, jaxpar.Strategy(), record=False)
        moved = ck.restore(other).state
        assert jax.tree.structure((moved.params, moved.opt_state)) == jax.tree.structure(saved)
        for a, b in zip(jax.tree.leaves(jax.device_get((moved.params, moved.opt_state))), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(a, b)


def test_kernel_layout_out_in_scales_a_torch_layout_weight_as_its_transpose():
    """``kernel_layout='out_in'`` (Hugging Face's ``[out, in]``, jaxpar's Decoder): the update of ``w [mlp 8, embed
    12]`` is optax's Muon of ``w.T`` (input 12, output 8) transposed; the default reads it as input 8, output 12,
    whose shape scaling differs (sqrt(12 / 8)). The Decoder declares it and the YAML builder reads it."""
    from jaxpar.models import Decoder, DecoderConfig

    w = jax.random.normal(jax.random.key(0), (8, 12))
    g = jax.random.normal(jax.random.key(1), w.shape)
    names = {"w": ("mlp", "embed")}
    ref = optax.contrib.muon(0.1)
    want = ref.update(g.T, ref.init(w.T), w.T)[0].T
    for layout, expect in (("out_in", want), ("in_out", ref.update(g, ref.init(w), w)[0])):
        tx = muon(0.1, logical=names, kernel_layout=layout)
        got = tx.update({"w": g}, tx.init({"w": w}), {"w": w})[0]["w"]
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, ref.update(g, ref.init(w), w)[0], atol=1e-3)      # the layouts differ here
    assert "mlp(8) x embed(12)" in muon_routing_table({"w": w}, names)
    assert "embed(12) x mlp(8)" in muon_routing_table({"w": w}, names, kernel_layout="out_in")
    cfg = DecoderConfig(vocab=32, embed=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp=32)
    assert jaxpar.param_layout(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh_for({})).kernel_layout == "out_in"
    assert jaxpar.param_layout(_model, mesh_for({})).kernel_layout == "in_out"
    with pytest.raises(OptimizerError, match=r"muon\(kernel_layout='io'\)"):
        muon(0.1, kernel_layout="io")


@need_devices(8)
def test_weight_stashing_refuses_muon_matrices_split_inside_a_stage():
    """schedule='pipedream' runs each stage's update alone, between the pipeline's sends: Muon whose matrices
    ``tensor`` splits inside a stage is refused by name (its Newton-Schulz collectives deadlocked XLA:CPU there);
    on pipe x data (the compatibility table's ST x MU case, tests/test_pairs.py) it composes."""
    from jaxpar.errors import StashingError

    strategy = jaxpar.Strategy(schedule="pipedream", microbatches=2)
    with pytest.raises(StashingError, match=r"pipedream.*Muon.*split over 'tensor'"):
        _setup({"pipe": 2, "data": 2, "tensor": 2}, strategy)
