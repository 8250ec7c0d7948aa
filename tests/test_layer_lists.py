"""Layers kept in an ``nnx.List`` (examples/explicit_transformer.py, its identical-layer variant):
stacked by jaxpar.stack_layers or by a pipeline, they scan and pipeline (1F1B, interleaved) exactly as
the list runs on one device; lists that differ, and loops that are not a chain, get named errors."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import Strategy
from jaxpar.adapters import LayerListError, stack_layers
from jaxpar.adapters import list_form, stacked_form
from jaxpar.adapters._layer_lists import stacked_lists
from jaxpar.parallel.pipeline._cut import PipelineCutError

from conftest import need_devices
from helpers import explicit_one_device, train_steps

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from explicit_transformer import ExplicitTransformer, batches, loss  # noqa: E402

LR, STEPS = 1e-3, 3
KW = dict(vocab=64, embed=32, heads=4, kv_heads=2, mlp=64, layers=4)


def _model(windows=None):
    return ExplicitTransformer(**KW, windows=windows, rngs=nnx.Rngs(0))


def _batch(step):
    return batches(step, batch_size=8, seed=0, seq_len=16, vocab=64)


@pytest.fixture(scope="module")
def reference():
    """The list model on one device, in the style's own terms (helpers.explicit_one_device)."""
    return explicit_one_device(_model, loss, _batch, LR, STEPS)[:2]


def _train(axes, strategy, model_fn=_model):
    return train_steps(model_fn, loss, _batch, axes, strategy, LR, STEPS)[:3]


CASES = {"scan-fsdp4-tp2-zero3": ({"fsdp": 4, "tensor": 2}, Strategy(zero=3), True),
         "1f1b-pipe2-dp2-tp2": ({"pipe": 2, "data": 2, "tensor": 2}, Strategy(microbatches=2, schedule="1f1b"), False),
         "interleaved-pipe2-dp2-tp2": ({"pipe": 2, "data": 2, "tensor": 2},
                                       Strategy(microbatches=4, schedule="interleaved", virtual_stages=2), False)}


@need_devices(8)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.exhaustive) if c.startswith("interleaved") else c
                                  for c in CASES])
def test_stacked_list_is_exact_against_the_list_on_one_device(case, reference):
    ref_losses, ref_params = reference
    axes, strategy, by_hand = CASES[case]
    state, layout, losses = _train(axes, strategy, (lambda: stack_layers(_model())) if by_hand else _model)
    assert layout.layer_lists == {("blocks",): 4}
    assert layout.shapes["blocks"]["layer"]["attn"]["q"].shape[0] == 4          # stacked: one scanned layer
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # exported in the list's own paths, the parameters match the list trained on one device: Adam moves
    # a parameter by at most lr per step, so runs whose gradients agree end within a small fraction of that
    exported = list_form(jax.device_get(state.params), layout.layer_lists)
    assert jax.tree.structure(exported) == jax.tree.structure(ref_params)
    bound = 0.01 * STEPS * LR
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(exported)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=bound, rtol=0, err_msg=jax.tree_util.keystr(path))


@need_devices(8)
def test_pipeline_stages_hold_their_layers_only():
    """Stacked for the pipeline, the layers axis is split over ``pipe``: each stage holds 2 of 4 layers."""
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 2, "tensor": 2})
    layout = jaxpar.state_layout(_model, optax.adam(LR), mesh, Strategy(microbatches=2))
    assert layout.params["blocks"]["layer"]["mlp"]["gate"] == P("pipe", "fsdp", "tensor")
    state, layout = jaxpar.init_train_state(_model, optax.adam(LR), mesh, Strategy(microbatches=2))
    gate = state.params["blocks"]["layer"]["mlp"]["gate"]
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 32, 32)}


@need_devices(4)
def test_a_list_whose_layers_differ_stays_a_list_and_a_pipeline_names_the_difference():
    windows = [4, None, 4, None]
    with nnx.use_eager_sharding(False):
        assert stacked_lists(_model(windows)) == {}
        assert stacked_lists(_model([4] * 4)) == {("blocks",): 4}
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 2}, devices=jax.devices()[:4])
    state, layout = jaxpar.init_train_state(lambda: _model(windows), optax.adam(LR), mesh, Strategy(microbatches=2))
    assert layout.layer_lists == {} and 0 in layout.shapes["blocks"]
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    with pytest.raises(PipelineCutError, match=r"4 blocks in an nnx.List at 'blocks': they differ from layer 0 "
                                               r"\(layer 1: attn/window: None vs 4"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))


class _Net(nnx.Module):
    def __init__(self, call):
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)])
        self.call = call

    def __call__(self, x):
        return self.call(self, x)


def _chain(m, x):
    for block in m.blocks:
        x = block(x)
    return x


def _skips(m, x):
    outs = []
    for block in m.blocks:
        x = block(x)
        outs.append(x)
    return sum(outs)


def _per_layer(m, x):
    for i, block in enumerate(m.blocks):
        x = block(x * 1.0) if i else block(x)
    return x


def _indexed(m, x):
    return m.blocks[0](x)


def _twice(m, x):
    blocks = list(m.blocks)
    return blocks[1](blocks[0](blocks[0](x)))


@pytest.mark.parametrize("call, message", [
    (_skips, "the output of layer 0 is used outside the chain"),
    (_per_layer, "the output of layer 0 is used outside the chain"),
    (_indexed, r"the model indexes the list \(\[0\]\)"),
    (_twice, "layer 0 is called after layer 0"),
])
def test_a_loop_that_is_not_a_chain_is_named(call, message):
    x = jnp.ones((2, 4))
    with pytest.raises(LayerListError, match=message):
        stack_layers(_Net(call))(x)


def test_a_chain_with_shared_arguments_scans_and_other_arguments_are_named():
    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))

        def __call__(self, x, scale, *, shift=0.0):
            return jnp.tanh(x @ self.w[...] * scale + shift)

    class Net(nnx.Module):
        def __init__(self, scales):
            self.blocks = nnx.List([Scaled(nnx.Rngs(i)) for i in range(3)])
            self.scales = scales

        def __call__(self, x):
            for block, scale in zip(self.blocks, self.scales):
                x = block(x, scale, shift=0.5)
            return x

    x = jnp.arange(8.0).reshape(2, 4) / 8
    want = Net((2.0, 2.0, 2.0))(x)
    np.testing.assert_allclose(stack_layers(Net((2.0, 2.0, 2.0)))(x), want, rtol=1e-6)
    with pytest.raises(LayerListError, match="layer 1 gets other arguments besides x than layer 0"):
        stack_layers(Net((2.0, 3.0, 2.0)))(x)


def test_list_and_stacked_forms_convert_back_and_forth_inside_optimizer_states():
    model = stack_layers(_Net(_chain))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    opt = optax.adam(0.1).init(params)
    lists = {("blocks",): 3}
    as_list = list_form(opt, lists)
    assert sorted(as_list[0].mu["blocks"]) == [0, 1, 2]
    back = stacked_form(as_list, lists)
    assert jax.tree.structure(back) == jax.tree.structure(opt)
    original = nnx.to_pure_dict(nnx.state(_Net(_chain), nnx.Param))
    np.testing.assert_array_equal(list_form(params, lists)["blocks"][2]["kernel"], original["blocks"][2]["kernel"])


@need_devices(8)
def test_a_checkpoint_of_stacked_layers_restores_as_stacked_or_as_the_list_and_back(tmp_path):
    """Saved by a pipeline (stacked), restored onto another pipeline mesh, onto DP8 (the list), and saved
    from DP8 back onto the pipeline: the same values each time, and training goes on from the list."""
    from jaxpar.run import Checkpointer

    state, layout, _ = _train({"pipe": 2, "data": 2, "tensor": 2}, Strategy(microbatches=2))
    saved = jax.device_get(state)
    with Checkpointer(tmp_path / "a", async_save=False) as ck:
        ck.save(STEPS, state, layout=layout, wait=True)
    other = jaxpar.state_layout(_model, optax.adam(LR), jaxpar.make_mesh({"pipe": 2, "data": 4}),
                                Strategy(microbatches=4))
    with Checkpointer(tmp_path / "a", async_save=False) as ck:
        restored = ck.restore(other).state
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    dp = jaxpar.make_mesh({"data": 8})
    as_list = jaxpar.state_layout(_model, optax.adam(LR), dp, Strategy())
    with Checkpointer(tmp_path / "a", async_save=False) as ck:
        listed = ck.restore(as_list).state
    assert sorted(listed.params["blocks"]) == [0, 1, 2, 3]
    assert listed.params["blocks"][1]["mlp"]["gate"].sharding.spec == as_list.params["blocks"][1]["mlp"]["gate"]
    want = list_form(saved, layout.layer_lists)
    for a, b in zip(jax.tree.leaves(jax.device_get(listed)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    step = jaxpar.make_train_step(loss, optax.adam(LR), as_list)
    listed, metrics = step(listed, jaxpar.shard_batch(_batch(STEPS), dp))
    assert np.isfinite(float(metrics["loss"]))
    with Checkpointer(tmp_path / "b", async_save=False) as ck:
        ck.save(STEPS + 1, listed, layout=as_list, wait=True)
    with Checkpointer(tmp_path / "b", async_save=False) as ck:
        back = ck.restore(layout).state
    again = stacked_form(jax.device_get(listed), layout.layer_lists)
    for a, b in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    assert back.params["blocks"]["layer"]["mlp"]["gate"].sharding.spec == layout.params["blocks"]["layer"]["mlp"]["gate"]
