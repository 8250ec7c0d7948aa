"""A pipeline stage that holds collective-permutes runs as a lockstep program (docs/pipeline.md, "Lockstep programs").

The user's model: examples/patch_attention.py's blocks with a fused ``qkv`` projection (one nnx.Linear to
3 x embed, sharded over ``tensor``) cut into q, k, v by ``jnp.split``. XLA reshards the three parts with
collective-permutes, whose rendezvous takes every device; in the per-stage program they sat in one stage's
branch and XLA:CPU aborted the step after 40 s. The rule (:func:`stage_reshards`) is checked on a tiny
model; the user's model on pipe2 x data2 x tensor2, 1F1B, 4 micro-batches runs in lockstep and equals one
device (slow; its compiled program is checked for device-dependent collectives before it runs, so a
regression fails instead of hanging); PipeDream-2BW, which has no lockstep program, is refused by name.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis import device_dependent_collectives
from jaxpar.parallel.pipeline import PipelineParts
from jaxpar.parallel.pipeline._reshards import stage_reshards

from conftest import need_devices
from test_byo_model import BATCH, LR, STEPS, assert_same_updates, pa, train

MESH = {"pipe": 2, "data": 2, "tensor": 2}


class FusedBlock(nnx.Module):
    """patch_attention's block with one ``qkv`` projection, split into q, k, v."""

    def __init__(self, embed: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1, self.ln2 = pa._norm(embed, rngs), pa._norm(embed, rngs)
        self.qkv = pa._linear(embed, 3 * embed, ("embed", "mlp"), rngs)
        self.out = pa._linear(embed, embed, ("mlp", "embed"), rngs)
        self.up = pa._linear(embed, mlp, ("embed", "mlp"), rngs)
        self.down = pa._linear(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, e = x.shape
        q, k, v = (a.reshape(b, t, self.heads, e // self.heads) for a in jnp.split(self.qkv(self.ln1(x)), 3, -1))
        x = x + self.out(nnx.dot_product_attention(q, k, v).reshape(b, t, e))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class FusedNet(pa.PatchAttentionNet):
    """PatchAttentionNet with :class:`FusedBlock` s."""

    def __init__(self, *, layers: int = 4, embed: int = 24, heads: int = 4, mlp: int = 40, rngs: nnx.Rngs):
        super().__init__(layers=layers, embed=embed, heads=heads, mlp=mlp, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r: nnx.Rngs) -> FusedBlock:
            return FusedBlock(embed, heads, mlp, rngs=r)

        self.blocks = stack(rngs)


def fused() -> FusedNet:
    return FusedNet(rngs=nnx.Rngs(0))


def _tiny_reshards(sizes: dict, fused_split: bool) -> tuple:
    """:func:`stage_reshards` of a layer ``h + q * k + v``: q, k, v split from one matmul's output
    (``fused_split``, its columns sharded over ``tensor``), or three matmuls of the same weights; the
    micro-batch's rows over ``data``."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    e, tensor, data = 12, "tensor" if "tensor" in sizes else None, "data" if "data" in sizes else None

    def layer(w, h):
        q, k, v = jnp.split(h @ w, 3, -1) if fused_split else (h @ w[i] for i in range(3))
        return h + q * k + v

    shaped = lambda shape, *spec: jax.ShapeDtypeStruct(    # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh, P(*spec)))
    w = shaped((e, 3 * e), None, tensor) if fused_split else shaped((3, e, e), None, None, tensor)
    parts = PipelineParts(pre=lambda o, mb: mb["x"] * o[0], layer=layer, post=lambda o, y, mb: jnp.mean(y ** 2))
    return stage_reshards(parts, mesh, [shaped(())], w, {"x": shaped((4, e), data)})


@need_devices(8)
def test_a_split_of_a_tensor_sharded_value_is_a_reshard_and_a_plain_layer_has_none():
    assert any(op.endswith("split") for op in _tiny_reshards(MESH, fused_split=True))
    assert _tiny_reshards(MESH, fused_split=False) == ()
    assert _tiny_reshards({"pipe": 2}, fused_split=True) == ()       # nothing sharded in a stage: not compiled


@need_devices(8)
def test_two_bw_with_a_stage_that_reshards_is_refused_by_name():
    """PipeDream-2BW runs a different action per stage: refused while its step traces, before it compiles."""
    start, tx = time.monotonic(), optax.sgd(LR)
    strategy = jaxpar.Strategy(microbatches=4, schedule="pipedream-2bw")
    layout = jaxpar.state_layout(fused, tx, jaxpar.make_mesh(MESH), strategy)
    step = jaxpar.make_train_step(pa.loss, tx, layout, strategy)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pa.batches(0, batch_size=BATCH))
    with pytest.raises(jaxpar.AsyncPipelineError, match=r"schedule='pipedream-2bw' with a model whose pipeline "
                                                        r"stage holds collective-permutes \(.*split\).*flush schedule"):
        step.lower(layout.abstract_state(), batch)
    assert time.monotonic() - start < 10


@need_devices(8)
@pytest.mark.slow
def test_fused_qkv_on_pipe_data_tensor_runs_in_lockstep_and_equals_one_device():
    """1F1B, 4 micro-batches, no sequence parallelism: the compiled step has no device-dependent collective
    (checked before it runs), and its updates equal one device's."""
    mesh = jaxpar.make_mesh(MESH)
    strategy, tx = jaxpar.Strategy(microbatches=4), optax.sgd(LR)
    state, layout = jaxpar.init_train_state(fused, tx, mesh, strategy)
    batch = jaxpar.shard_batch(pa.batches(0, batch_size=BATCH), mesh)
    step = jaxpar.make_train_step(pa.loss, tx, layout, strategy).lower(state, batch).compile()
    assert device_dependent_collectives(step) == []
    start, losses = jax.device_get(state.params), []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert_same_updates((np.array(losses), start, jax.device_get(state.params)), train({}, make=fused))
