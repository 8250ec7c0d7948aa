"""``metrics["grad_norm"]`` means one thing in every program (jaxpar.step._update): the global norm
of the gradient an optimizer update receives, before clipping; the root mean square of those norms
where a step applies several updates (replicas that update on their own, the asynchronous
parameter server). Checked on the first step against one-device gradients.

Meshes: replica=4 x data=2 and pipe=2 x data=4 (8 simulated devices), test GPT, batch 16.
"""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import GPT, lm_loss
from jaxpar.parallel.sync import local_sgd, stale, synchronous

from helpers import CFG, make_batch

K = 4
BATCH = make_batch()


def _model():
    return GPT(CFG, rngs=nnx.Rngs(0))


def _one_device_norm(rows) -> float:
    graphdef = nnx.graphdef(_model())
    params = nnx.to_pure_dict(nnx.state(_model(), nnx.Param))
    g = jax.jit(jax.grad(lambda p, b: lm_loss(nnx.merge(graphdef, p), b)))(params, rows)
    return float(optax.tree.norm(g))


def _first_grad_norm(sizes, strategy) -> float:
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(_model, tx, jaxpar.make_mesh(sizes), strategy)
    _, m = jaxpar.make_train_step(lm_loss, tx, layout, strategy)(state, BATCH)
    return float(m["grad_norm"])


@pytest.fixture(scope="module")
def replica_norms():
    """Each replica's gradient norm at the initial parameters, on its own rows."""
    return [_one_device_norm(jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:])[r], BATCH)) for r in range(K)]


@pytest.mark.parametrize("sync", [local_sgd(2), stale(0, mode="async")], ids=["local_sgd", "async"])
def test_replicas_that_update_on_their_own_report_the_rms_of_their_norms(replica_norms, sync):
    got = _first_grad_norm({"replica": K, "data": 2}, jaxpar.Strategy(sync=sync))
    rms = float(np.sqrt(np.mean(np.square(replica_norms))))
    np.testing.assert_allclose(got, rms, rtol=1e-5)
    assert abs(got - max(replica_norms)) > 1e-4 * rms and abs(got - np.mean(replica_norms)) > 1e-4 * rms


@pytest.mark.parametrize("sizes,strategy", [
    ({"replica": K, "data": 2}, jaxpar.Strategy(sync=synchronous())),
    ({"pipe": 2, "data": 4}, jaxpar.Strategy(schedule="pipedream", microbatches=2, update_every=2)),
], ids=["sync-replicas", "stashing"])
def test_one_update_per_step_reports_the_norm_of_the_averaged_gradient(sizes, strategy):
    """One update per step on the whole batch's gradient: its norm, as one device computes it
    (weight stashing: every stage's first update is on the initial weights)."""
    np.testing.assert_allclose(_first_grad_norm(sizes, strategy), _one_device_norm(BATCH), rtol=1e-5)


def _steps_with_and_without_norm(sizes, strategy, **kw):
    tx = optax.adamw(1e-3)
    state, layout = jaxpar.init_train_state(_model, tx, jaxpar.make_mesh(sizes), strategy)
    steps = [jaxpar.make_train_step(lm_loss, tx, layout, strategy, grad_norm=g, donate=False, **kw) for g in (True, False)]
    return steps, state, [step(state, BATCH)[1] for step in steps]


@pytest.mark.parametrize("sizes,strategy", [
    ({"data": 8}, jaxpar.Strategy()),
    pytest.param({"replica": K, "data": 2}, jaxpar.Strategy(sync=local_sgd(2)), marks=pytest.mark.exhaustive),
    pytest.param({"replica": K, "data": 2}, jaxpar.Strategy(sync=stale(0, mode="async")), marks=pytest.mark.exhaustive),
    pytest.param({"pipe": 2, "data": 4}, jaxpar.Strategy(schedule="pipedream", microbatches=2, update_every=2),
                 marks=pytest.mark.exhaustive),
], ids=["dp8", "local_sgd", "async", "stashing"])
def test_grad_norm_false_leaves_the_norm_out_and_trains_as_before(sizes, strategy):
    """No ``grad_norm`` metric and no pass over the gradients for it; the same training: the second step's
    loss to 1e-5 (XLA fuses the program without the pass differently, so the round-off may differ)."""
    steps, state, (m1, m2) = _steps_with_and_without_norm(sizes, strategy)
    assert "grad_norm" in m1 and "grad_norm" not in m2
    if strategy.sync is None and strategy.schedule != "pipedream":   # one program: its pass over the gradients is gone
        cost = [s.lower(state, BATCH).compile().cost_analysis() for s in steps]
        cost = [c[0] if isinstance(c, list) else c for c in cost]
        assert cost[1]["bytes accessed"] < cost[0]["bytes accessed"]
    losses = [float(step(step(state, BATCH)[0], BATCH)[1]["loss"]) for step in steps]     # the second step's
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_clipping_still_measures_the_norm_it_needs_without_reporting_it():
    steps, state, (m1, m2) = _steps_with_and_without_norm({"data": 8}, jaxpar.Strategy(), clip_norm=0.01)
    assert "grad_norm" in m1 and "grad_norm" not in m2
    new = [step(state, BATCH)[0] for step in steps]           # clipped to 0.01: the same parameters, bit for bit
    for a, b in zip(jax.tree.leaves(new[0].params), jax.tree.leaves(new[1].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
