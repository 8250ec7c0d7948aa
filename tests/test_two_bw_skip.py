"""PipeDream-2BW's rule for a skipped (non-finite) step is one rule: the one-step program
(``steps_per_call=1``) and the no-flush program of ``K`` steps give the same states over a run
whose middle step has a NaN loss (jaxpar.step._update.delayed).

Mesh: pipe=2 x data=4 (8 simulated devices), test GPT (2 layers), 2 micro-batches, Adam.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import GPT, lm_loss

from helpers import CFG, make_batch

STEPS, NAN_STEP, ROWS = 3, 1, 8
TX = optax.adam(1e-2)


def scaled_loss(model, batch):
    """The LM loss times the batch's ``scale`` (NaN on the step that must be skipped)."""
    return lm_loss(model, batch) * jnp.mean(batch["scale"])


def _batches():
    out = []
    for t in range(STEPS):
        b = {k: np.asarray(v) for k, v in make_batch(ROWS, CFG, seed=t).items()}
        b["scale"] = np.full(ROWS, np.nan if t == NAN_STEP else 1.0, np.float32)
        out.append(b)
    return out


def _setup(k):
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    strategy = jaxpar.Strategy(microbatches=2, schedule="pipedream-2bw")
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), TX, mesh, strategy)
    step = jaxpar.make_train_step(scaled_loss, TX, layout, strategy, skip_nonfinite=True, steps_per_call=k)
    return state, step


def _host(state):
    return jax.device_get({"step": state.step, "params": state.params, "opt_state": state.opt_state,
                           "versions": state.versions})


@pytest.fixture(scope="module")
def one_step_run():
    """``steps_per_call=1``: the states after every step, and the metrics."""
    state, step = _setup(1)
    states, metrics = [], []
    for b in _batches():
        state, m = step(state, b)
        states.append(_host(state))
        metrics.append(jax.device_get(m))
    return states, metrics


def test_one_step_program_skips_and_makes_the_newest_version_the_older_one(one_step_run):
    states, metrics = one_step_run
    assert [bool(m["skipped"]) for m in metrics] == [t == NAN_STEP for t in range(STEPS)]
    before, skipped, after = states[NAN_STEP - 1], states[NAN_STEP], states[NAN_STEP + 1]
    assert int(skipped["step"]) == NAN_STEP + 1
    for x, y in zip(jax.tree.leaves(skipped["params"]), jax.tree.leaves(before["params"]), strict=True):
        np.testing.assert_array_equal(x, y)                       # W(t+1) = W(t)
    for x, y in zip(jax.tree.leaves(skipped["opt_state"]), jax.tree.leaves(before["opt_state"]), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(skipped["versions"]), jax.tree.leaves(before["params"]), strict=True):
        np.testing.assert_array_equal(x, y)                       # and W(t) is the older version
    assert np.isfinite(float(metrics[NAN_STEP + 1]["loss"]))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(after["params"]),
                                                         jax.tree.leaves(skipped["params"])))


@pytest.mark.fusion_emitters
@pytest.mark.parametrize("k", [STEPS])
def test_no_flush_program_gives_the_one_step_programs_states(one_step_run, k):
    """The skipped step is the middle one of a no-flush call: the next step's first micro-batches
    ran on ``W(t)`` before the skip was known, in the one-step program's state."""
    states, metrics = one_step_run
    state, step = _setup(k)
    state, m = step(state, jax.tree.map(lambda *b: np.stack(b), *_batches()))
    m = jax.device_get(m)
    assert [bool(s) for s in m["skipped"]] == [bool(x["skipped"]) for x in metrics]
    np.testing.assert_array_equal(m["loss"], [x["loss"] for x in metrics])
    np.testing.assert_array_equal(m["grad_norm"], [x["grad_norm"] for x in metrics])
    got, want = _host(state), states[-1]
    assert int(got["step"]) == int(want["step"]) == STEPS
    for part in ("params", "opt_state", "versions"):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got[part])[0], jax.tree.leaves(want[part]),
                                strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"{part}{jax.tree_util.keystr(path)}")
