"""A user's own model with jaxpar.parallel.moe layers and a plain loss (cross-entropy + w * the layers'
aux loss, no protocol): under 4 micro-batches and under a 1F1B pipeline (pipe=2) its losses,
gradients and parameters equal one device's on the whole batch (the layers report their loads and
balance with the step's: jaxpar.parallel.moe._balance); a loss the step cannot make exact is refused
by name (MoEError)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import Strategy
from jaxpar.parallel.moe import MoE, MoEError

from conftest import need_devices

V, D, M, E, T, ROWS, LR, STEPS, AUX = 32, 16, 16, 4, 8, 16, 0.1, 3, 0.1


class Block(nnx.Module):
    def __init__(self, rngs):
        self.moe = MoE(D, M, E, top_k=2, capacity_factor=None, rngs=rngs)

    def __call__(self, carry):
        x, aux = carry
        y, stats = self.moe(x)
        return x + y, aux + stats.aux_loss


class Stacked(nnx.Module):
    """An embedding, 2 MoE blocks stacked with nnx.vmap and run by jaxpar.scan_blocks, a head."""

    def __init__(self, rngs):
        self.embed = nnx.Param(0.5 * jax.random.normal(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r):
            return Block(r)

        self.blocks = stack(rngs)
        self.head = nnx.Param(0.5 * jax.random.normal(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0)
        x, aux = jaxpar.scan_blocks(self.blocks, (x, jnp.zeros((), jnp.float32)))
        return x @ self.head[...], aux


class Direct(nnx.Module):
    """An embedding, 2 MoE layers called one after the other, a head."""

    def __init__(self, rngs):
        self.embed = nnx.Param(0.5 * jax.random.normal(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))
        self.moe1 = MoE(D, M, E, top_k=2, capacity_factor=None, rngs=rngs)
        self.moe2 = MoE(D, M, E, top_k=2, capacity_factor=None, rngs=rngs)
        self.head = nnx.Param(0.5 * jax.random.normal(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x, aux = jnp.take(self.embed[...], tokens, axis=0), 0.0
        for layer in (self.moe1, self.moe2):
            y, stats = layer(x)
            x, aux = x + y, aux + stats.aux_loss
        return x @ self.head[...], aux


def cross_entropy(logits, targets):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits, -1) * jax.nn.one_hot(targets, V), -1))


def loss(model, batch):
    """The plain loss: nothing of MoE in it but the aux loss the layers return."""
    logits, aux = model(batch["tokens"])
    return cross_entropy(logits, batch["targets"]) + AUX * aux


def squared_aux_loss(model, batch):
    logits, aux = model(batch["tokens"])
    return cross_entropy(logits, batch["targets"]) + AUX * aux ** 2


def _batch(i):
    t = np.random.default_rng(i).integers(0, V, (ROWS, T + 1)).astype(np.int32)
    return {"tokens": t[:, :-1], "targets": t[:, 1:]}


def _train(cls, axes, strategy, tx, loss_fn=loss):
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: cls(nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(loss_fn, tx, layout)
    start, losses = jax.device_get(state.params), []
    for i in range(STEPS):
        state, metrics = step(state, jaxpar.shard_batch(_batch(i), mesh))
        losses.append(float(metrics["loss"]))
    return np.array(losses), start, jax.device_get(state.params), metrics


CASES = {"direct-accumulate4": (Direct, {"data": 1}, Strategy(microbatches=4)),
         "stacked-accumulate4-dp2": (Stacked, {"data": 2}, Strategy(microbatches=4)),
         "stacked-1f1b-pipe2": (Stacked, {"pipe": 2}, Strategy(microbatches=4, schedule="1f1b"))}


@need_devices(2)
@pytest.mark.parametrize("case", list(CASES))
def test_a_plain_loss_equals_one_device(case):
    """SGD, 3 steps: losses at rtol 1e-5; the updates p_n - p0 (lr x the summed gradients) at rtol 1e-5 of
    their size; the load metrics of the last step are the whole batch's."""
    cls, axes, strategy = CASES[case]
    ref_losses, start, ref, ref_metrics = _train(cls, {"data": 1}, Strategy(), optax.sgd(LR))
    losses, _, got, metrics = _train(cls, axes, strategy, optax.sgd(LR))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, p), r, s in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref),
                               jax.tree.leaves(start)):
        scale = float(np.abs(r - s).max())
        np.testing.assert_allclose(p - s, r - s, rtol=1e-5, atol=1e-5 * scale + 2e-7 * float(np.abs(s).max()),
                                   err_msg=jax.tree_util.keystr(path))
    for name in ("moe/load_min", "moe/load_max", "moe/load_cv"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, err_msg=name)


@need_devices(2)
def test_adam_under_a_pipeline_stays_within_its_step_bound():
    """Adam moves a parameter by at most about lr per step, so two runs whose gradients agree to fp32
    round-off stay within 2 * lr * steps everywhere, and agree far tighter where gradients are not ~0."""
    ref_losses, _, ref, _ = _train(Stacked, {"data": 1}, Strategy(), optax.adam(LR))
    losses, _, got, _ = _train(Stacked, {"pipe": 2}, Strategy(microbatches=4, schedule="1f1b"), optax.adam(LR))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    diff = np.concatenate([np.abs(p - r).ravel() for p, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))])
    assert diff.max() <= 2 * LR * STEPS and np.median(diff) <= 1e-5 * LR * STEPS, (diff.max(), np.median(diff))


def test_without_micro_batches_the_plain_loss_needs_nothing():
    """One device, one batch: the step runs no pre-pass and the loss is what a plain jax.grad gives."""
    with nnx.use_eager_sharding(False):
        model = Direct(nnx.Rngs(0))
    want = loss(model, _batch(0))
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    state, layout = jaxpar.init_train_state(lambda: Direct(nnx.Rngs(0)), optax.sgd(LR), mesh)
    _, metrics = jaxpar.make_train_step(loss, optax.sgd(LR), layout)(state, jaxpar.shard_batch(_batch(0), mesh))
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
    assert metrics["moe/layer_loads"].shape == (2, E)


@need_devices(2)
@pytest.mark.parametrize("cls, axes, strategy", [
    (Direct, {"data": 1}, Strategy(microbatches=4)),
    (Stacked, {"pipe": 2}, Strategy(microbatches=2, schedule="1f1b"))])
def test_a_loss_the_step_cannot_make_exact_is_refused_by_name(cls, axes, strategy):
    """aux ** 2: a mean over micro-batches of each one's square is not the whole batch's square."""
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: cls(nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    step = jaxpar.make_train_step(squared_aux_loss, optax.sgd(LR), layout)
    with pytest.raises(MoEError, match=r"other than as a sum with constant weights .* `loss \+ w \* aux_loss`"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))


@need_devices(2)
def test_the_aux_loss_with_micro_batches_and_a_codec_is_refused_by_name():
    from jaxpar.parallel.compression import topk

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    strategy = Strategy(microbatches=2, compression=topk(1.0))
    state, layout = jaxpar.init_train_state(lambda: Direct(nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    with pytest.raises(MoEError, match="microbatches=2 with a loss that adds the MoE load-balancing loss"):
        jaxpar.make_train_step(loss, optax.sgd(LR), layout)(state, jaxpar.shard_batch(_batch(0), mesh))


def test_a_layer_that_keeps_its_own_router_bias_is_refused_by_name():
    """``MoE(router_bias=True)`` keeps the bias in the layer, which the step would never move: init_train_state
    refuses it with the fix (the aux loss), where a generic non-Param error would not say why."""
    class Biased(nnx.Module):
        def __init__(self, rngs):
            self.moe = MoE(D, M, E, top_k=2, capacity_factor=None, router_bias=True, rngs=rngs)

    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    with pytest.raises(MoEError, match=r"MoE\(router_bias=True\).* build the layers with router_bias=False"):
        jaxpar.init_train_state(lambda: Biased(nnx.Rngs(0)), optax.sgd(LR), mesh)
