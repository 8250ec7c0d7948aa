"""Checkpoints written in format 1 (the codec's state and relaxed synchronisation's state in one
``comm`` part) restore into today's named parts, bit-exact, and the run goes on from them.

The fixtures in ``tests/data/checkpoint_format1`` were written by jaxpar at commit 1bb9889: a
tiny MLP, Adam, three steps of top-k with error feedback (data=4), DiLoCo and stale(1)
(replica=2 x data=2); each ``<case>.npz`` holds that state's arrays as it was saved."""

import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.parallel.compression import topk
from jaxpar.models import MLPClassifier, classifier_loss
from jaxpar.parallel.sync import diloco, stale
from jaxpar.run import Checkpointer, CheckpointWarning
from jaxpar.run._checkpoint import CheckpointError
from jaxpar.run._state_parts import FORMAT

from conftest import need_devices

DATA = Path(__file__).parent / "data" / "checkpoint_format1"
CASES = {"codec": ({"data": 4}, jaxpar.Strategy(compression=topk(0.25)), "codec"),
         "diloco": ({"replica": 2, "data": 2}, jaxpar.Strategy(sync=diloco(2)), "sync"),
         "stale": ({"replica": 2, "data": 2}, jaxpar.Strategy(sync=stale(1)), "sync")}


def _model():
    return MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))


def _layout(case):
    axes, strategy, _ = CASES[case]
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:4])
    return jaxpar.init_train_state(_model, optax.adam(1e-2), mesh, strategy)


def _saved(case):
    """The saved arrays by today's key path (``.comm`` is today's ``.codec`` or ``.sync``)."""
    part = CASES[case][2]
    with np.load(DATA / f"{case}.npz") as f:
        return {k.replace(".comm", f".{part}", 1): f[k] for k in f.files}


@need_devices(4)
@pytest.mark.parametrize("case", sorted(CASES))
def test_format1_checkpoint_restores_into_its_named_part(case, tmp_path):
    shutil.copytree(DATA / case, tmp_path / case)
    state, layout = _layout(case)
    with Checkpointer(tmp_path / case, async_save=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)        # nothing dropped or started afresh
        got = ck.restore(layout)
    assert got.step == 3
    restored = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(got.state))[0]}
    saved = _saved(case)
    assert set(restored) == set(saved)
    assert any(k.startswith(f".{CASES[case][2]}") for k in saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    step = jaxpar.make_train_step(classifier_loss, optax.adam(1e-2), layout)
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8,), jnp.int32)}
    new, metrics = step(got.state, jaxpar.shard_batch(batch, layout.mesh))
    assert int(new.step) == 4 and np.isfinite(float(metrics["loss"]))


@need_devices(4)
def test_format1_part_dropped_when_the_run_keeps_none(tmp_path):
    """A format-1 codec state restored by a run without compression: dropped with the codec's name."""
    shutil.copytree(DATA / "codec", tmp_path / "codec")
    mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    _, layout = jaxpar.init_train_state(_model, optax.adam(1e-2), mesh, jaxpar.Strategy())
    with Checkpointer(tmp_path / "codec", async_save=False) as ck:
        with pytest.warns(CheckpointWarning, match=r"gradient codec's state saved with it is dropped \(topk"):
            got = ck.restore(layout)
    assert got.state.codec == () and got.state.sync == ()
    np.testing.assert_array_equal(np.asarray(got.state.params["inp"]["kernel"]),
                                  _saved("codec")[".params['inp']['kernel']"])


@need_devices(4)
def test_checkpoint_of_an_unknown_format_is_named(tmp_path):
    state, layout = _layout("codec")
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, state, {"format": "jaxpar-checkpoint-99"}, layout=layout)
    record = next((tmp_path / "1" / "meta").glob("metadata")).read_text()
    assert FORMAT in record                      # save writes today's format over the caller's
    with Checkpointer(tmp_path, async_save=False) as ck:
        (tmp_path / "1" / "meta" / "metadata").write_text(record.replace(FORMAT, "jaxpar-checkpoint-99"))
        with pytest.raises(CheckpointError, match="format 'jaxpar-checkpoint-99' and this jaxpar reads"):
            ck.restore(layout, step=1)


@need_devices(2)
def test_optimizer_state_saved_without_its_schedule_restores_inside_it(tmp_path):
    """A ``jaxpar train`` checkpoint from before its optimizer held the schedule (``optax.inject_hyperparams``)
    restores into today's state: the optimizer's own state as saved, the update count its own, the learning
    rate the record's until the next update; the steps after it equal the uninterrupted run's."""
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    batch = jaxpar.shard_batch({"x": jnp.ones((8, 4)), "y": jnp.zeros((8,), jnp.int32)}, mesh)
    old_tx = optax.adamw(schedule, weight_decay=0.1)
    new_tx = optax.inject_hyperparams(lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.1))(
        learning_rate=schedule)                # as jaxpar.config.build_optimizer builds it
    old, old_layout = jaxpar.init_train_state(_model, old_tx, mesh)
    old_step = jaxpar.make_train_step(classifier_loss, old_tx, old_layout, donate=False)
    for _ in range(3):
        old, _ = old_step(old, batch)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(3, old, {"schedule": {"steps": 10, "lr": float(schedule(3))}})
    _, layout = jaxpar.init_train_state(_model, new_tx, mesh)
    with Checkpointer(tmp_path, async_save=False) as ck:
        new = ck.restore(layout).state
    assert int(new.opt_state.count) == 3 and int(new.opt_state.hyperparams_states["learning_rate"].count) == 3
    assert float(new.opt_state.hyperparams["learning_rate"]) == pytest.approx(float(schedule(3)))
    new_step = jaxpar.make_train_step(classifier_loss, new_tx, layout, donate=False)
    for k in (3, 4):
        (old, _), (new, metrics) = old_step(old, batch), new_step(new, batch)
        assert float(metrics["lr"]) == pytest.approx(float(schedule(k)), rel=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(old.params)), jax.tree.leaves(jax.device_get(new.params))):
        np.testing.assert_array_equal(a, b)
