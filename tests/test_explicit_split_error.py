"""A model in JAX's explicit-sharding style whose batch is on ``fsdp`` alone and whose vocabulary is split
over ``tensor`` (Flax's Gemma example with ``fsdp_tp_sharding``), scored with ``take_along_axis``: no
split of the batch traces, and the error quotes the split that got furthest (the model's own, failing at
the loss's gather) with the fix for a gather, not the first split's failure inside the model. With the
vocabulary resharded whole before the gather, the model trains as on one device."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import Strategy
from jaxpar.adapters import ModelMeshError

from conftest import need_devices
from helpers import explicit_one_device, train_steps

VOCAB, EMBED, LR, STEPS = 16, 8, 1e-2, 2
AXES = {"fsdp": 2, "tensor": 2}


class VocabOnTensor(nnx.Module):
    """An embedding and a head, the vocabulary over ``tensor``, the activations' batch on ``fsdp``."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.5)
        self.embedding = nnx.Param(nnx.with_partitioning(init, P("tensor", "fsdp"))(rngs.params(), (VOCAB, EMBED)))
        self.head = nnx.Param(nnx.with_partitioning(init, P("fsdp", "tensor"))(rngs.params(), (EMBED, VOCAB)))

    def __call__(self, tokens):
        x = self.embedding[...].at[tokens].get(out_sharding=P("fsdp", None, None))
        x = x * (tokens != 0)[..., None]          # padding: batch ("data", "fsdp") meets the pinned "fsdp" here
        return jnp.einsum("btd,dv->btv", x, self.head[...], out_sharding=P("fsdp", None, "tensor"))


def _loss(model, batch):
    tokens = batch["tokens"]
    logp = jax.nn.log_softmax(model(tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _resharded_loss(model, batch):
    tokens = batch["tokens"]
    logits = jax.sharding.reshard(model(tokens[:, :-1]), P("fsdp", None, None))    # the whole vocabulary per row
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _model():
    return VocabOnTensor(nnx.Rngs(0))


def _batch(step):
    rng = np.random.default_rng(step)
    return {"tokens": rng.integers(0, VOCAB, (4, 9)).astype(np.int32)}


def _gather_line():
    lines, first = inspect.getsourcelines(_loss)
    return first + next(i for i, line in enumerate(lines) if "take_along_axis" in line)


@need_devices(4)
def test_the_error_quotes_the_split_that_got_furthest_and_the_gathers_fix():
    with pytest.raises(ModelMeshError) as caught:
        train_steps(_model, _loss, _batch, AXES, Strategy(), LR, 1)
    message = str(caught.value)
    assert f"test_explicit_split_error.py:{_gather_line()} (_loss)" in message
    assert "the failure under P('fsdp'), the split that got furthest" in message
    assert "jax.sharding.reshard(logits, P('fsdp', None, None)) before take_along_axis" in message
    assert "mul got incompatible shardings" not in message           # the first split's failure, in the model
    assert "(__call__)" not in message


@need_devices(4)
def test_with_the_vocabulary_resharded_whole_it_trains_as_on_one_device():
    ref_losses, ref_params, _ = explicit_one_device(_model, _resharded_loss, _batch, LR, STEPS, batch_axes="fsdp")
    state, _, losses, _, _ = train_steps(_model, _resharded_loss, _batch, AXES, Strategy(), LR, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam moves a parameter by at most lr per step, so two runs whose gradients agree to float error
    # end within a small fraction of STEPS * lr of each other
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=0.01 * STEPS * LR, rtol=0)
