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
import jaxpar.step
from jaxpar.parallel.moe import MoE, MoEError, moe_apply, update_router_bias

from conftest import need_devices

V, D, M, E, T, ROWS, LR, STEPS, AUX = 32, 16, 16, 4, 8, 16, 0.1, 3, 0.1


#: The MoE layers' options (the biased models below change them).
MOE_KW = dict(top_k=2, capacity_factor=None)


class Block(nnx.Module):
    MOE_KW = MOE_KW

    def __init__(self, rngs):
        self.moe = MoE(D, M, E, **self.MOE_KW, rngs=rngs)

    def __call__(self, carry):
        x, aux = carry
        y, stats = self.moe(x)
        return x + y, aux + stats.aux_loss


class Stacked(nnx.Module):
    """An embedding, 2 MoE blocks stacked with nnx.vmap and run by jaxpar.scan_blocks, a head."""
    BLOCK = Block

    def __init__(self, rngs):
        self.embed = nnx.Param(0.5 * jax.random.normal(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))
        block = self.BLOCK

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r):
            return block(r)

        self.blocks = stack(rngs)
        self.head = nnx.Param(0.5 * jax.random.normal(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0)
        x, aux = jaxpar.scan_blocks(self.blocks, (x, jnp.zeros((), jnp.float32)))
        return x @ self.head[...], aux


class Direct(nnx.Module):
    """An embedding, 2 MoE layers called one after the other, a head."""
    MOE_KW = MOE_KW

    def __init__(self, rngs):
        self.embed = nnx.Param(0.5 * jax.random.normal(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))
        self.moe1 = MoE(D, M, E, **self.MOE_KW, rngs=rngs)
        self.moe2 = MoE(D, M, E, **self.MOE_KW, rngs=rngs)
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



# ---------------------------------------------------------------- aux-loss-free balancing in the user's layers
RATE, BIASED_MOE = 0.05, dict(top_k=2, capacity_factor=1.0)    # capacity 1.0 drops: the bias changes the outputs


class BiasedBlock(Block):
    MOE_KW = {**BIASED_MOE, "router_bias": True}


class BiasedStacked(Stacked):
    """:class:`Stacked` of blocks whose layers balance with the router bias."""
    BLOCK = BiasedBlock


class BiasedDirect(Direct):
    """:class:`Direct` with layers that balance with the router bias."""
    MOE_KW = {**BIASED_MOE, "router_bias": True}


def _layer_params(params):
    """Each MoE layer's parameters, in the order the forward runs them."""
    if "blocks" in params:
        return [jax.tree.map(lambda a: a[i], params["blocks"]["moe"]) for i in range(2)]
    return [params["moe1"], params["moe2"]]


def _by_hand(params, rate):
    """One device, written out: each layer routes with its row of the bias (moe_apply's params), SGD on
    the plain loss, then each row moves by the sign rule on that layer's load of the whole batch."""
    def loss_of(p, bias, batch):
        x, aux, loads = jnp.take(p["embed"], batch["tokens"], axis=0), 0.0, []
        for lp, row in zip(_layer_params(p), bias):
            y, stats = moe_apply({**lp, "router_bias": row}, x, **BIASED_MOE)
            x, aux = x + y, aux + stats.aux_loss
            loads.append(stats.load)
        return cross_entropy(x @ p["head"], batch["targets"]) + AUX * aux, jnp.stack(loads)

    grad = jax.jit(jax.value_and_grad(loss_of, has_aux=True))
    bias, losses = jnp.zeros((2, E), jnp.float32), []
    for i in range(STEPS):
        (value, loads), g = grad(params, bias, _batch(i))
        params = jax.tree.map(lambda p, d: p - LR * d, params, g)
        bias = jax.vmap(update_router_bias, in_axes=(0, 0, None))(bias, loads, rate)
        losses.append(float(value))
    return np.array(losses), np.asarray(bias), params


def _biased_train(cls, axes, strategy):
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: cls(nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    start = jax.device_get(state.params)
    state, layout = jaxpar.step.with_router_bias(state, layout, (2, E), rate=RATE)
    step, losses = jaxpar.make_train_step(loss, optax.sgd(LR), layout), []
    for i in range(STEPS):
        state, metrics = step(state, jaxpar.shard_batch(_batch(i), mesh))
        losses.append(float(metrics["loss"]))
    return np.array(losses), np.asarray(jax.device_get(state.stats["router_bias"])), start, jax.device_get(state.params)


BIASED_CASES = {"direct-dp2-accumulate2": (BiasedDirect, {"data": 2}, Strategy(microbatches=2)),
                "stacked-dp2-accumulate2": pytest.param(BiasedStacked, {"data": 2}, Strategy(microbatches=2),
                                                        marks=pytest.mark.exhaustive),
                "stacked-1f1b-pipe2": pytest.param(BiasedStacked, {"pipe": 2}, Strategy(microbatches=2, schedule="1f1b"),
                                                   marks=pytest.mark.exhaustive)}


@need_devices(2)
@pytest.mark.parametrize("cls, axes, strategy", [BIASED_CASES[k] for k in BIASED_CASES], ids=list(BIASED_CASES))
def test_layers_with_router_bias_move_it_as_by_hand(cls, axes, strategy):
    """``MoE(router_bias=True)`` layers read their rows of the train state's bias (one per MoE call, in
    the forward's order: called directly, or stacked through scan_blocks and a pipeline's stages), and
    the step moves it by each step's whole-batch loads: losses, the bias (exactly) and the parameters
    after 3 SGD steps equal the one-device computation written out by hand."""
    losses, bias, start, params = _biased_train(cls, axes, strategy)
    ref_losses, ref_bias, ref_params = _by_hand(start, RATE)
    plain_losses, _, _ = _by_hand(start, 0.0)
    assert np.abs(ref_bias).max() > 0 and not np.allclose(ref_losses, plain_losses, rtol=1e-6, atol=0)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_array_equal(bias, ref_bias)
    for (path, p), r, s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params),
                               jax.tree.leaves(start)):
        scale = float(np.abs(r - s).max())
        np.testing.assert_allclose(p - s, r - s, rtol=1e-5, atol=1e-5 * scale + 2e-7 * float(np.abs(s).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_a_bias_the_layers_cannot_read_is_refused_by_name():
    """Fewer rows than MoE calls, no bias for layers built to read one, a bias no layer reads."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    state, layout = jaxpar.init_train_state(lambda: BiasedDirect(nnx.Rngs(0)), optax.sgd(LR), mesh)
    state, layout = jaxpar.step.with_router_bias(state, layout, (1, E), rate=RATE)
    step = jaxpar.make_train_step(loss, optax.sgd(LR), layout)
    with pytest.raises(MoEError, match=r"at least 2 MoE layers .* bias has 1 rows .* shape \(MoE layers, experts\)"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))
    state, layout = jaxpar.init_train_state(lambda: BiasedDirect(nnx.Rngs(0)), optax.sgd(LR), mesh)
    with pytest.raises(MoEError, match=r"MoE\(router_bias=True\) balances .*with_router_bias.* router_bias=False"):
        jaxpar.make_train_step(loss, optax.sgd(LR), layout)(state, jaxpar.shard_batch(_batch(0), mesh))
    state, layout = jaxpar.init_train_state(lambda: Direct(nnx.Rngs(0)), optax.sgd(LR), mesh)   # layers without
    state, layout = jaxpar.step.with_router_bias(state, layout, (2, E), rate=RATE)
    with pytest.raises(MoEError, match=r"never read it, .*moe\.MoE\(\.\.\., router_bias=True\)"):
        jaxpar.make_train_step(loss, optax.sgd(LR), layout)(state, jaxpar.shard_batch(_batch(0), mesh))
