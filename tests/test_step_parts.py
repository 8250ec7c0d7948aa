"""The parts make_train_step composes, each on its own: the replicas' exchange over ``replica``
(masked mean, asynchronous pass-through), the update rules around the one ``apply_update``
(PipeDream-2BW's version swap, ``stale``'s history, the parameter server's one-by-one updates),
and the gradient kinds (the data-parallel replicas' own gradients average to the global one).

Meshes: replica=4 and data=4 (simulated CPU devices), the test MLP.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import MLPClassifier, classifier_loss
from jaxpar.parallel.sync import backup, stale
from jaxpar.step._grads import global_grads, replica_grads
from jaxpar.step._replica_mean import replica_exchange, replica_rule
from jaxpar.step import TrainState
from jaxpar.step._update import Update, apply_update, delayed

K = 4
TX = optax.sgd(0.5)


def _model():
    return MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))


def _relaxed(sync):
    mesh = jaxpar.make_mesh({"replica": K}, devices=jax.devices()[:K])
    return jaxpar.init_train_state(_model, TX, mesh, jaxpar.Strategy(sync=sync))


def _per_replica(params, scale):
    """A ``[K, ...]`` gradient whose replica ``r`` is ``scale[r] * ones``."""
    return jax.tree.map(lambda p: jnp.asarray(scale, jnp.float32).reshape(K, *[1] * p.ndim) * jnp.ones_like(p)[None],
                        params)


def test_backup_exchange_averages_the_fastest_replicas_only():
    sync = backup(backups=1)
    state, layout = _relaxed(sync)
    losses, scale = jnp.arange(1.0, K + 1), np.array([1.0, 10.0, 100.0, 1000.0], np.float32)
    with jaxpar.use_rules(layout.mesh, layout.rules):
        loss, grads, parts, m = jax.jit(replica_exchange(sync, layout))(state, losses, _per_replica(state.params, scale))
    used = np.asarray(m["replica_used"])
    times = np.asarray(sync.times(state.step, K))
    assert used.sum() == K - 1 and not used[np.argmax(times)]          # the slowest replica is left out
    want = scale[used].mean()
    for g in jax.tree.leaves(grads):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)
    np.testing.assert_allclose(float(loss), np.asarray(losses)[used].mean(), rtol=1e-6)
    assert parts == {} and float(m["loss_spread"]) == K - 1


def test_asynchronous_exchange_keeps_every_replica_apart():
    sync = stale(0, mode="async")
    state, layout = _relaxed(sync)
    losses, scale = jnp.arange(1.0, K + 1), np.arange(1.0, K + 1, dtype=np.float32)
    with jaxpar.use_rules(layout.mesh, layout.rules):
        loss, grads, _, _ = jax.jit(replica_exchange(sync, layout))(state, losses, _per_replica(state.params, scale))
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(losses))
    leaf = np.asarray(jax.tree.leaves(grads)[0])
    np.testing.assert_array_equal(leaf.reshape(K, -1)[:, 0], scale)


def test_asynchronous_rule_applies_each_replica_in_turn():
    sync = stale(0, mode="async")
    state, layout = _relaxed(sync)
    scale = np.arange(1.0, K + 1, dtype=np.float32)
    with jaxpar.use_rules(layout.mesh, layout.rules):
        new, m = jax.jit(replica_rule(sync, Update(TX), layout))(state, jnp.ones(K), _per_replica(state.params, scale))
    for before, after in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params)):
        np.testing.assert_allclose(np.asarray(after), np.asarray(before) - 0.5 * scale.sum(), rtol=1e-6, atol=1e-6)
    assert int(new.step) == 1
    n = sum(a.size for a in jax.tree.leaves(state.params))
    np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt(np.mean(scale ** 2 * n)), rtol=1e-6)


def test_stale_rule_pushes_the_starting_parameters_onto_the_history():
    sync = stale(2)
    state, layout = _relaxed(sync)
    grads = jax.tree.map(jnp.ones_like, state.params)
    with jaxpar.use_rules(layout.mesh, layout.rules):
        rule = jax.jit(replica_rule(sync, Update(TX), layout))
        one, _ = rule(state, jnp.float32(1.0), grads)
        two, _ = rule(one, jnp.float32(1.0), grads)
    for p0, p1, p2, h in zip(*(jax.tree.leaves(t) for t in (state.params, one.params, two.params, two.sync))):
        np.testing.assert_allclose(np.asarray(p2), np.asarray(p0) - 1.0, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(h[0]), np.asarray(p1))    # newest first
        np.testing.assert_array_equal(np.asarray(h[1]), np.asarray(p0))


def test_delayed_rule_updates_the_newest_version_and_keeps_it_as_the_older():
    w_old, w_new = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    state = TrainState(jnp.int32(3), w_new, TX.init(w_new), versions=w_old)
    apply = lambda *a, **kw: apply_update(Update(TX), *a, **kw)   # noqa: E731
    new, _ = delayed(apply)(state, jnp.float32(0.0), {"w": jnp.array([2.0, 4.0])})
    np.testing.assert_allclose(np.asarray(new.params["w"]), [0.0, -1.0])
    np.testing.assert_array_equal(np.asarray(new.versions["w"]), [1.0, 1.0])


@pytest.mark.parametrize("zero", [0, 3])
def test_the_replicas_own_gradients_average_to_the_global_one(zero):
    mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    state, layout = jaxpar.init_train_state(_model, TX, mesh, jaxpar.Strategy(zero=zero))
    rng = np.random.default_rng(0)
    batch = jaxpar.shard_batch({"x": rng.normal(size=(8, 4)).astype(np.float32),
                                "y": rng.integers(0, 3, 8).astype(np.int32)}, mesh)
    with jaxpar.use_rules(mesh, layout.rules):
        loss, grads = jax.jit(global_grads(classifier_loss, layout))(state.params, batch)
        losses, each = jax.jit(replica_grads(classifier_loss, layout))(state.params, batch)
    np.testing.assert_allclose(float(jnp.mean(losses)), float(loss), rtol=1e-6)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(each)):
        np.testing.assert_allclose(np.asarray(e).mean(0), np.asarray(g), rtol=1e-5, atol=1e-7)
