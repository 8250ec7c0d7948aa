"""What a loss reports (jaxpar.report_metric) comes back from every pipelined step: the flush
schedules, PipeDream-2BW's no-flush program and weight stashing. The last stage sums it over the
micro-batches like the loss: a reported copy of the loss equals the step's loss, step by step. A
flush schedule's metrics equal one device's on the whole batch, and so do 2BW's first step's (every
micro-batch on W(0)); weight stashing updates a stage after each micro-batch, so only the loss
copy is checked there."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import GPT, GPTConfig
from jaxpar.parallel import cross_entropy

from conftest import need_devices
from helpers import make_batch

CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=4)
STEPS = 2


def reporting_loss(model, batch):
    """The GPT's loss, reporting the mean logit and the mean squared logit (means over equal
    micro-batches, so their mean is the whole batch's)."""
    logits = model(batch["tokens"])
    jaxpar.report_metric("fit/logit_mean", jnp.mean(logits))
    jaxpar.report_metric("fit/logit_sq", jnp.mean(logits ** 2))
    loss = cross_entropy(logits, batch["targets"])
    jaxpar.report_metric("fit/loss_copy", loss)
    return loss


def _run(sizes, strategy, steps_per_call=1):
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(reporting_loss, tx, layout, steps_per_call=steps_per_call)
    batches = [make_batch(8, CFG, seed=t) for t in range(STEPS)]
    if steps_per_call > 1:
        stacked = jax.tree.map(lambda *b: np.stack(b), *batches)
        return jax.device_get(step(state, stacked)[1])
    out = []
    for b in batches:
        state, metrics = step(state, jaxpar.shard_batch(b, mesh))
        out.append(jax.device_get(metrics))
    return jax.tree.map(lambda *a: np.stack(a), *out)


@need_devices(8)
@pytest.mark.parametrize("strategy, steps_per_call", [
    (jaxpar.Strategy(microbatches=2, schedule="1f1b"), 1),
    pytest.param(jaxpar.Strategy(microbatches=2, schedule="pipedream-2bw"), STEPS, marks=pytest.mark.exhaustive),
    pytest.param(jaxpar.Strategy(microbatches=2, schedule="pipedream"), 1, marks=pytest.mark.exhaustive),
])
def test_pipelined_steps_return_what_the_loss_reports(strategy, steps_per_call):
    ref = _run({"data": 1}, jaxpar.Strategy())
    got = _run({"pipe": 2, "data": 4}, strategy, steps_per_call)
    for name in ("fit/logit_mean", "fit/logit_sq"):
        assert got[name].shape == (STEPS,) and np.isfinite(got[name]).all(), (name, got[name])
    np.testing.assert_allclose(got["fit/loss_copy"], got["loss"], rtol=1e-6)
    if strategy.schedule == "pipedream-2bw":      # the first step on W(0) only
        for name in ("fit/logit_mean", "fit/logit_sq"):
            np.testing.assert_allclose(got[name][0], ref[name][0], rtol=1e-5, err_msg=name)
    if strategy.schedule == "1f1b":       # a flush schedule: every step is one device's
        for name in ("fit/logit_mean", "fit/logit_sq", "loss"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=name)
