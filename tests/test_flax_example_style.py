"""A model written as Flax's NNX Gemma example writes one (examples/gemma_style.py: a ``ShardingConfig``
of mesh-axis specs, ``kernel_metadata={"out_sharding": ...}``, activations pinned with ``out_sharding=``,
their batch on ``fsdp`` alone; GQA, sliding-window and global layers, ``nnx.List`` blocks) trains under
every strategy exactly as on one device: jaxpar splits the batch over the data axes the model names and
leaves the others automatic around it. Where its annotations cannot work, the error is jaxpar's."""

import collections
import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import Strategy
from jaxpar.adapters import ModelMeshError
from jaxpar.parallel.pipeline._cut import PipelineCutError

from conftest import need_devices
from helpers import explicit_one_device, train_steps

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gemma_style import AttentionType, GemmaStyle, ShardingConfig, TransformerConfig, batches, loss  # noqa: E402

LR, STEPS = 1e-3, 3
SHARDING = ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")
# the same weights annotated with jaxpar's logical names, and no activation pinned
LOGICAL = ShardingConfig(emb_vd=("vocab", "embed"), q_weight_ndh=("heads", "embed", "kv"),
                         kv_weight_cndh=(None, "heads", "embed", "kv"), o_weight_nhd=("heads", "kv", "embed"),
                         ffw_weight_df=("embed", "mlp"), ffw_weight_fd=("mlp", "embed"), rms_norm_weight=("embed",))


def _model(sharding=SHARDING, **kw):
    return lambda: GemmaStyle(TransformerConfig(shd_config=sharding, **kw), rngs=nnx.Rngs(0))


def _batch(step):
    return batches(step, batch_size=8, seed=0, seq_len=16, vocab=64)


@pytest.fixture(scope="module")
def reference():
    """One device, as the example's own trainer runs it: an Explicit mesh, the batch on ``fsdp``."""
    return explicit_one_device(_model(), loss, _batch, LR, STEPS, batch_axes="fsdp")


CASES = {"one-device": ({"data": 1}, Strategy()),
         "dp8": ({"data": 8}, Strategy()),
         "fsdp8-zero3": ({"fsdp": 8}, Strategy(zero=3)),
         "fsdp4-tp2": ({"fsdp": 4, "tensor": 2}, Strategy()),
         "dp4-tp2": ({"data": 4, "tensor": 2}, Strategy()),
         "dp2-fsdp2-tp2-zero1-accum2": ({"data": 2, "fsdp": 2, "tensor": 2}, Strategy(zero=1, microbatches=2))}


SLOW = {"dp8", "fsdp8-zero3", "fsdp4-tp2", "dp4-tp2"}   # their axes run in the other cases; the exhaustive tier runs them


@need_devices(8)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.exhaustive) if c in SLOW else c for c in CASES])
def test_the_example_style_model_is_exact_against_one_device(case, reference):
    ref_losses, ref_params, _ = reference
    axes, strategy = CASES[case]
    state, layout, losses, _, _ = train_steps(_model(), loss, _batch, axes, strategy, LR, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam moves a parameter by at most lr per step, so two runs whose gradients agree to float error
    # end within a small fraction of STEPS * lr of each other
    bound = 0.01 * STEPS * LR
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0],
                            jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=bound, rtol=0, err_msg=jax.tree_util.keystr(path))


def _collectives(sharding, axes, strategy):
    from jaxpar.analysis import collectives

    mesh = jaxpar.make_mesh(axes)
    state, layout = jaxpar.init_train_state(_model(sharding), optax.adam(LR), mesh, strategy)
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    compiled = step.lower(state, jaxpar.shard_batch(_batch(0), mesh)).compile()
    total = collections.Counter()
    for row in collectives(compiled.as_text(), mesh):
        total[row.kind, tuple(row.axes)] += row.bytes
    return dict(total)


@need_devices(8)
@pytest.mark.exhaustive
@pytest.mark.parametrize("axes, strategy", [({"data": 8}, Strategy()),
                                            pytest.param({"data": 8}, Strategy(zero=3), marks=pytest.mark.exhaustive)],
                         ids=["dp8", "dp8-zero3"])
def test_data_parallel_collectives_are_a_logical_names_models(axes, strategy):
    """The data axis the model does not name stays automatic around it: the same collectives, per axis
    and bytes, as the same weights annotated with logical names (the gradients' all-reduce; ZeRO-3's
    all-gather of the parameters)."""
    ours = _collectives(SHARDING, axes, strategy)
    assert ours == _collectives(LOGICAL, axes, strategy)
    assert {axes for _, axes in ours} == {("data",)}


@need_devices(8)
@pytest.mark.exhaustive
def test_fsdp_collectives_differ_from_a_logical_names_model_only_in_the_embedding_lookup():
    """FSDP8: every weight is all-gathered and every gradient all-reduced over ``fsdp`` as for the
    logical-names model, but for two things the model's own specs decide. The embedding: the model
    splits its table on the model dimension (``emb_vd = P(tp, fsdp)``) and pins the lookup's output to
    the batch, so each device looks up its slice of every token's row (the token ids all-gathered:
    B*T*4 bytes) and an all-to-all moves the rows to the batch split (forward and backward:
    2 * B*T*D*4 / 8 bytes), where the logical model all-gathers the table and all-reduces its gradient
    (V*D*4 bytes each). The 9 norm scales: they enter the model replicated (``P(tp)``), gathered once
    (9*D*4 bytes); the logical model's program gathers them again for the backward pass."""
    ours, theirs = _collectives(SHARDING, {"fsdp": 8}, Strategy()), _collectives(LOGICAL, {"fsdp": 8}, Strategy())
    b, t, d, v, norms = 8, 16, 32, 64, 9
    assert set(ours) == {("all-gather", ("fsdp",)), ("all-reduce", ("fsdp",)), ("all-to-all", ("fsdp",))}
    assert ours["all-gather", ("fsdp",)] == theirs["all-gather", ("fsdp",)] - v * d * 4 + b * t * 4 - norms * d * 4
    assert ours["all-reduce", ("fsdp",)] == theirs["all-reduce", ("fsdp",)] - v * d * 4
    assert ours["all-to-all", ("fsdp",)] == 2 * b * t * d * 4 // 8


@need_devices(8)
def test_a_pipeline_names_what_the_models_layers_need():
    """Sliding-window and global layers differ, so they are not stacked; alike layers are, but each
    takes the positions and the mask besides x, which a pipeline stage does not receive."""
    mesh = jaxpar.make_mesh({"pipe": 2, "fsdp": 2, "tensor": 2})
    strategy = Strategy(microbatches=2, schedule="1f1b")
    for model_fn, message in [
            (_model(), r"they differ from layer 0 \(layer 1: attn/attn_type: <AttentionType.GLOBAL"),
            (_model(attention_pattern=(AttentionType.GLOBAL,)), r"passes arrays of shapes \[\(4, 16\), \(4, 16, 16\)\] "
                                                                 "to every layer besides x")]:
        state, layout = jaxpar.init_train_state(model_fn, optax.adam(LR), mesh, strategy)
        step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
        with pytest.raises(PipelineCutError, match=message):
            step(state, jaxpar.shard_batch(_batch(0), mesh))


def test_a_model_that_names_an_axis_the_mesh_lacks_is_refused_at_init():
    """The example's default tensor-parallel name is ``tp``; jaxpar's mesh calls it ``tensor``."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    with pytest.raises(ModelMeshError, match=r"parameter 'embedder/embedding': the model's spec P\('tp', 'fsdp'\) "
                                             r"names 'tp', which is not an axis of jaxpar's mesh \('pipe', 'data', "
                                             r"'fsdp', 'tensor'\).*tensor_parallel_axis_name='tensor'"):
        jaxpar.init_train_state(_model(ShardingConfig.fsdp_tp_sharding()), optax.adam(LR), mesh)


@need_devices(8)
def test_a_model_that_splits_the_sequence_over_the_batch_axis_gets_both_specs():
    """Activations split over ``fsdp`` on the sequence (the model's own sequence sharding): the strategy
    splits the batch over ``fsdp``, and no split of the batch traces with the model's annotations."""
    seq = dataclasses.replace(SHARDING, act_btd=P(None, "fsdp", "tensor"), act_btf=P(None, "fsdp", "tensor"),
                              act_btnh=P(None, "fsdp", "tensor", None), act_cbtkh=P(None, None, "fsdp", "tensor", None))
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    state, layout = jaxpar.init_train_state(_model(seq), optax.adam(LR), mesh)
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    with pytest.raises(ModelMeshError, match=r"conflict with jaxpar's at .*gemma_style.py:\d+ \(apply_rope\): "
                                             r"JAX said: .*16@fsdp.*8@\(data,fsdp\).*jaxpar splits the batch over "
                                             r"the data axes \('data', 'fsdp'\).*failure under P\(\('data', 'fsdp'\)\), "
                                             r"the split that got furthest.*pin every activation's batch dimension"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))
