"""Collective signatures read from the compiled HLO of each strategy."""
import dataclasses
import math

import jax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives, count
from jaxpar.models import lm_loss
from jaxpar.parallel import zero_dim

from helpers import CFG, compile_step, make_batch, setup

CFG8 = dataclasses.replace(CFG, embed=64, layers=4)


def by_loop(colls, kind, axes, in_loop):
    return [c for c in colls if c.kind == kind and c.axes == axes and c.in_loop == in_loop]


def shardable_layer_bytes(layout, n):
    """Bytes of one layer's gradients that ZeRO can split over n devices."""
    total = 0
    for name, shape in layout.shapes["blocks"].items():
        logical = tuple(layout.logical["blocks"][name])
        if zero_dim(shape.shape, logical, jax.sharding.PartitionSpec(), {"data": n}) is not None:
            total += 4 * math.prod(shape.shape[1:])
    return total


def test_dp_all_reduces_gradients_and_gathers_nothing():
    mesh, layout, c = compile_step({"data": 8}, cfg=CFG8)
    colls = collectives(c, mesh)
    assert count(colls, "all-reduce", "data") >= 1
    assert by_loop(colls, "all-reduce", ("data",), True), "gradients are all-reduced per layer inside the backward"
    assert count(colls, "all-gather") == 0
    assert count(colls, "reduce-scatter") == 0


def test_zero1_all_reduces_gradients_then_gathers_updated_params():
    mesh, layout, c = compile_step({"data": 8}, jaxpar.Strategy(zero=1), cfg=CFG8)
    colls = collectives(c, mesh)
    assert by_loop(colls, "all-reduce", ("data",), True)
    assert count(colls, "reduce-scatter") == 0
    assert by_loop(colls, "all-gather", ("data",), False), "updated parameter shards are all-gathered"


@pytest.mark.parametrize("sizes,zero", [({"data": 8}, 2), ({"data": 8}, 3), ({"fsdp": 8}, 0)],
                         ids=["zero2", "zero3", "fsdp8"])
def test_zero2_and_3_reduce_scatter_gradients_per_layer(sizes, zero):
    mesh, layout, c = compile_step(sizes, jaxpar.Strategy(zero=zero), cfg=CFG8)
    axis = next(iter(sizes))
    colls = collectives(c, mesh)
    rs = by_loop(colls, "reduce-scatter", (axis,), True)
    # Each layer's shardable gradient leaves are reduce-scattered inside the backward loop:
    # their per-device output is exactly 1/8 of that layer's shardable gradient bytes.
    assert sum(r.bytes for r in rs) * 8 == shardable_layer_bytes(layout, 8)
    assert len(rs) == 1, "one flat-buffer reduce-scatter per layer, not one per leaf"
    small = sum(a.bytes for a in by_loop(colls, "all-reduce", (axis,), True))
    assert small < shardable_layer_bytes(layout, 8) / 50, "only biases / norms are all-reduced in the loop"
    gathers_in_loop = by_loop(colls, "all-gather", (axis,), True)
    if zero == 3 or "fsdp" in sizes:
        assert gathers_in_loop, "ZeRO-3 gathers parameters per layer"
        # one flat-buffer gather per layer in the forward loop and one in the backward loop
        assert [g.bytes for g in gathers_in_loop] == [shardable_layer_bytes(layout, 8)] * 2
    else:
        assert not gathers_in_loop, "ZeRO-2 keeps parameters whole: no gather in the layer loop"


def _forward_collectives(sp, layers):
    cfg = dataclasses.replace(CFG8, layers=layers, scan_layers=False)
    mesh, state, layout, _ = setup({"tensor": 8}, jaxpar.Strategy(sequence_parallel=sp), cfg)

    def forward(params, batch):
        with jaxpar.use_rules(mesh, layout.rules):
            return lm_loss(nnx.merge(layout.graphdef, params), batch)

    compiled = jax.jit(forward).lower(state.params, make_batch(cfg=cfg)).compile()
    return collectives(compiled, mesh)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_megatron_forward_collectives_per_block(sp):
    """Unrolled forward at 2 and 4 layers: the difference is what 2 blocks cost."""
    small, large = _forward_collectives(sp, 2), _forward_collectives(sp, 4)
    per_block = {k: (count(large, k, "tensor") - count(small, k, "tensor")) / 2
                 for k in ("all-reduce", "all-gather", "reduce-scatter")}
    if sp:
        assert per_block == {"all-reduce": 0, "all-gather": 2, "reduce-scatter": 2}
    else:
        assert per_block == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0}


def test_explicit_zero2_over_two_data_axes_is_one_reduce_scatter_per_layer():
    """data2 x fsdp4, ZeRO-2, bf16 compute: parameters are gathered over fsdp and the gradients
    reduce-scattered once over (data, fsdp) in fp32, per layer. (jaxpar gathers in bf16;
    XLA:CPU itself converts bf16 collectives to fp32, so the bytes are fp32 here.)"""
    mesh, layout, c = compile_step({"data": 2, "fsdp": 4}, jaxpar.Strategy(zero=2, compute_dtype="bfloat16"),
                                   cfg=CFG8, explicit_dp=True)
    colls = [x for x in collectives(c, mesh) if x.in_loop]
    rs = [x for x in colls if x.kind == "reduce-scatter"]
    gathers = [x for x in colls if x.kind == "all-gather"]
    assert [r.axes for r in rs] == [("data", "fsdp")]
    assert rs[0].bytes * 8 == shardable_layer_bytes(layout, 8)                 # fp32, 1/8 per device
    assert [g.axes for g in gathers] == [("fsdp",), ("fsdp",)]                   # forward and backward
    assert all(g.bytes == shardable_layer_bytes(layout, 8) for g in gathers)     # the whole layer
