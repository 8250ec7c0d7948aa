"""The cross-entropy's target logit (jaxpar.parallel.cross_entropy): gathered where the vocabulary is
whole on each device, picked by a one-hot product where the rules split it over ``tensor``; the loss and
its gradient equal one device's either way, and the gradient scatters nothing. The loss in pieces of the
vocabulary (jaxpar.parallel.linear_cross_entropy, DecoderConfig.loss_chunks) equals the whole loss and holds one
piece's logits. 8 simulated CPU devices."""
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


# ----------------------------------------------------------------------------- the loss in vocabulary pieces
E, CHUNKS = 24, 4


def _pieces_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, E)).astype(np.float32)
    head = (0.5 * rng.standard_normal((V, E))).astype(np.float32)
    t = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = rng.random((B, T)) < 0.7
    return x, head, t, mask


@pytest.mark.parametrize("sizes", [{"data": 8}, {"data": 4, "tensor": 2}, {"data": 2, "context": 4}],
                         ids=["dp8", "dp4-tp2", "dp2-cp4"])
def test_the_loss_in_vocabulary_pieces_equals_the_whole_and_holds_one_piece(sizes):
    """``linear_cross_entropy`` over 4 pieces of the vocabulary, soft-capped and masked, sharded as the
    rules lay out a decoder's head: the loss and the gradients of ``x`` and of the head equal the whole
    logits' :func:`cross_entropy` (1e-6 / 1e-5); the compiled program makes no fp32 array of the whole
    vocabulary (its largest logits are one piece's) and gathers nothing (a split vocabulary stays split)."""
    from jaxpar.parallel import linear_cross_entropy

    mesh = jaxpar.make_mesh(sizes)
    rules = jaxpar.Strategy(context=jaxpar.options.ContextParallel("ring")
                            if "context" in sizes else None).rules(mesh)
    x, head, t, mask = _pieces_case()

    def whole(x, head):
        z = jnp.einsum("bte,ve->btv", x, constrain(head, ("vocab", "embed")))
        return cross_entropy(constrain(jnp.tanh(z / 3.0) * 3.0, LOGITS), t, mask)

    def pieces(x, head):
        return linear_cross_entropy(constrain(x, ("batch", "length", "embed")), constrain(head, ("vocab", "embed")),
                                    t, mask, chunks=CHUNKS, softcap=3.0)

    with use_rules(mesh, rules):
        args = (jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch", "length", "embed"), rules, mesh))),
                jax.device_put(head, NamedSharding(mesh, logical_to_spec(("vocab", "embed"), rules, mesh))))
        compiled = jax.jit(jax.value_and_grad(pieces, (0, 1))).lower(*args).compile()
        want_loss, want_grads = jax.jit(jax.value_and_grad(whole, (0, 1)))(x, head)
    loss, grads = compiled(*args)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    text = compiled.as_text()
    widths = {int(w) for w in re.findall(r"f32\[\d+,\d+,(\d+)\]", text)}
    local = V // CHUNKS // sizes.get("tensor", 1)
    assert local in widths and not {w for w in widths if w > local} - {E}
    assert _ops(text, "all-gather") == _ops(text, "all-to-all") == 0


def test_the_loss_in_pieces_runs_under_explicit_sharding():
    """JAX's explicit-sharding style (a user model's): ``x`` split over ``data``, the head's vocabulary over
    ``tensor``; the gradients keep those types and equal the whole loss's."""
    from jax.sharding import AxisType

    from jaxpar.parallel import linear_cross_entropy

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
    x, head, t, _ = _pieces_case()
    want_loss, want_grads = jax.value_and_grad(
        lambda x, head: cross_entropy(jnp.einsum("bte,ve->btv", x, head), t), (0, 1))(x, head)
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, P("data")), jax.device_put(head, P("tensor")), jax.device_put(t, P("data")))
        loss, grads = jax.jit(jax.value_and_grad(
            lambda x, head, t: linear_cross_entropy(x, head, t, chunks=CHUNKS), (0, 1)))(*args)
    assert [jax.typeof(g).sharding.spec for g in grads] == [P("data", None, None), P("tensor", None)]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_the_loss_in_pieces_needs_a_number_that_divides_the_vocabulary():
    from jaxpar.errors import BatchError, ModelConfigError
    from jaxpar.models import DecoderConfig
    from jaxpar.parallel import linear_cross_entropy

    x, head, t, _ = _pieces_case()
    with pytest.raises(BatchError, match=r"chunks=5\).*vocabulary of 64 entries.*model.loss_chunks"):
        linear_cross_entropy(x, head, t, chunks=5)
    with pytest.raises(BatchError, match=r"chunks=0\): must be an int >= 1"):
        linear_cross_entropy(x, head, t, chunks=0)
    with pytest.raises(ModelConfigError, match="loss_chunks=3 must divide vocab=64"):
        DecoderConfig(vocab=64, embed=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp=32, loss_chunks=3)


PIECES_LAYOUTS = {
    "dp2-cp2-ring-balanced": ({"data": 2, "context": 2},
                              jaxpar.Strategy(context=jaxpar.options.ContextParallel("ring", balance=True))),
    "pipe2-dp2-1f1b": ({"pipe": 2, "data": 2}, jaxpar.Strategy(microbatches=2, schedule="1f1b")),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if "pipe" in n else [])
                                  for n in PIECES_LAYOUTS])      # the pipeline's last stage runs the same loss
def test_a_decoder_with_its_loss_in_pieces_trains_like_one_device(name):
    """A tied, soft-capped Decoder with ``loss_chunks=4`` under context parallelism (balanced ring) and in a
    pipeline (its last stage's loss), three AdamW steps on packed rows with a loss mask: losses, first
    gradients and parameters equal the whole loss's on one device (the helpers' fp32 bounds)."""
    import optax
    from flax import nnx

    from helpers import RunResult, assert_runs_match, keep_grads
    from jaxpar.models import Decoder, DecoderConfig, decoder_loss

    def run(axes, strategy, chunks):
        cfg = DecoderConfig(vocab=V, embed=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64,
                            tie_embeddings=True, final_softcap=5.0, loss_chunks=chunks)
        mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
        tx = optax.chain(keep_grads(), optax.adamw(1e-3, weight_decay=0.1))
        state, layout = jaxpar.init_train_state(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
        step, batch = jaxpar.make_train_step(decoder_loss, tx, layout, strategy), jaxpar.shard_batch(rows, mesh)
        losses, grads = [], None
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            grads = jax.device_get(state.opt_state[0].grads) if grads is None else grads
        return RunResult(np.array(losses), jax.device_get(state.params), grads, 1e-3, 3)

    rng = np.random.default_rng(1)
    toks = rng.integers(0, V, (4, 17)).astype(np.int32)
    segments = np.tile(np.repeat([1, 2], [9, 7]), (4, 1)).astype(np.int32)
    rows = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": segments,
            "positions": np.tile(np.r_[np.arange(9), np.arange(7)], (4, 1)).astype(np.int32),
            "loss_mask": (segments == np.roll(segments, -1, 1)).astype(np.float32)}
    assert_runs_match(run(*PIECES_LAYOUTS[name], CHUNKS), run({"data": 1}, jaxpar.Strategy(), 1))
