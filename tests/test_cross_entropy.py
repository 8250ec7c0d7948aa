"""The cross-entropy's target logit (jaxpar.parallel.cross_entropy): gathered where the vocabulary is
whole on each device, picked by a one-hot product where the rules split it over ``tensor``; the loss and
its gradient equal one device's either way, and the gradient scatters nothing. 8 simulated CPU devices."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.parallel import cross_entropy
from jaxpar.rules import constrain, logical_to_spec, use_rules

from conftest import need_devices
from helpers import abstract_batch, setup

pytestmark = need_devices(8)

LOGITS = ("batch", "length", "vocab")
B, T, V = 16, 8, 64


def _reference(x: np.ndarray, t: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and its gradient, in float64 on the host."""
    x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    one_hot = np.eye(x.shape[-1])[t]
    loss = float(np.mean(-np.log((p * one_hot).sum(-1))))
    return loss, (p - one_hot) / t.size


def _ops(text: str, op: str) -> int:
    return len(re.findall(rf"\b{op}\(", text))


@pytest.mark.parametrize("sizes,gathered", [({"data": 8}, True), ({"data": 4, "tensor": 2}, False)],
                         ids=["dp8", "dp4-tp2"])
def test_target_logit_is_gathered_where_the_vocabulary_is_whole(sizes, gathered):
    mesh = jaxpar.make_mesh(sizes)
    rules = jaxpar.Strategy().rules(mesh)
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((B, T, V))).astype(np.float32)
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    spec = logical_to_spec(LOGITS, rules, mesh)
    args = (jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(t, NamedSharding(mesh, P(spec[0]))))
    with use_rules(mesh, rules):
        fn = jax.jit(jax.value_and_grad(lambda x, t: cross_entropy(constrain(x, LOGITS), t)))
        compiled = fn.lower(*args).compile()
    text = compiled.as_text()
    assert _ops(text, "gather") == int(gathered)
    assert _ops(text, "scatter") == 0                   # the gradient is softmax - one_hot, elementwise
    loss, grad = compiled(*args)
    want_loss, want_grad = _reference(x, t)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("sizes,gathers", [({"data": 8}, 1), ({"data": 2, "fsdp": 2, "tensor": 2}, 0)],
                         ids=["dp8", "dp2-fsdp2-tp2"])
def test_the_train_step_gathers_the_target_logit_where_the_vocabulary_is_whole(sizes, gathers):
    """The GPT's own train step: one gather of a ``[batch, length, vocab]`` operand (the embedding
    lookup gathers from ``[vocab, embed]``), none where ``tensor`` splits the vocabulary."""
    _, state, layout, step = setup(sizes)
    text = step.lower(state, abstract_batch()).as_text()
    vocab = layout.shapes["head"].shape[-1]
    logit_gathers = re.findall(rf"stablehlo\.gather.*\(tensor<\d+x\d+x{vocab}xf32>", text)
    assert len(logit_gathers) == gathers
