"""Checkpoints (real Orbax) and the loop's fault handling and metrics, in process on 8 simulated devices.

Resharding restore, keep-K, partial / corrupt checkpoints, non-finite steps (skip / stop),
TensorBoard + MFU records, greedy samples, and bad keys in the new config sections.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.run import Checkpointer, CheckpointWarning
from jaxpar.run._checkpoint import CheckpointError, CheckpointMismatchError
from jaxpar.run._state_parts import FORMAT
from jaxpar.data._windows import synthetic_batch
from jaxpar.run import NonFiniteError, train
from jaxpar.run._metrics import flops_per_token
from jaxpar.run import greedy_generate

from conftest import need_devices

# Orbax may report "Event loop is closed" from a background thread after a failed (corrupt) restore.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2)
B = 8


_BUILT: dict = {}
TX = optax.adamw(1e-2)


def build(spec: dict, zero: int = 0, n: int = 8):
    """``(fresh state, layout, step)``; layout and compiled step are shared between tests (compiles are slow)."""
    key = (tuple(sorted(spec.items())), zero, n)
    if key not in _BUILT:
        mesh = jaxpar.make_mesh(spec, devices=jax.devices()[:n])
        strategy = jaxpar.Strategy(zero=zero)
        state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), TX, mesh, strategy)
        _BUILT[key] = state, layout, jaxpar.make_train_step(lm_loss, TX, layout, strategy, skip_nonfinite=True)
    state, layout, step = _BUILT[key]
    return jax.tree.map(lambda a: a.copy(), state), layout, step


def batch(i: int) -> dict:
    return synthetic_batch(i, batch_size=B, seq_len=CFG.seq_len, vocab=CFG.vocab)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))))


def finite(tree) -> bool:
    return all(np.isfinite(x).all() for x in jax.tree.leaves(host(tree)))


# ----------------------------------------------------------------------------- resharding
@need_devices(8)
@pytest.mark.exhaustive
def test_restore_onto_other_meshes_and_strategies(tmp_path):
    state, layout, step = build({"fsdp": 8}, zero=3)
    for i in range(2):
        state, _ = step(state, jaxpar.shard_batch(batch(i), layout.mesh))
    saved = host(state)
    with Checkpointer(tmp_path, keep=2) as ck:
        ck.save(2, state, {"data": {"next_step": 2}})
    _, ref_metrics = step(state, jaxpar.shard_batch(batch(2), layout.mesh))
    ref_loss = float(ref_metrics["loss"])
    for spec, zero, n in (({"data": 2, "tensor": 4}, 0, 8), ({"fsdp": 4}, 3, 4)):   # other mesh, fewer devices
        _, lay, st = build(spec, zero, n)
        with Checkpointer(tmp_path, keep=2) as ck:
            got = ck.restore(lay)
        assert got.step == 2 and got.meta["data"] == {"next_step": 2} and got.skipped == []
        assert same(got.state, saved), f"values changed restoring onto {spec} zero={zero}"
        for leaf, sh in zip(jax.tree.leaves(got.state), jax.tree.leaves(lay.shardings())):
            assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)        # placed as the new layout wants
        new_state, metrics = st(got.state, jaxpar.shard_batch(batch(2), lay.mesh))   # training continues
        assert int(new_state.step) == 3 and not bool(metrics["skipped"])
        np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)


# ----------------------------------------------------------------------------- keep, partial, corrupt
def _save_steps(directory: Path, steps=(2, 4, 6), keep: int = 3):
    state, layout, step = build({"data": 2, "fsdp": 2, "tensor": 2})
    snaps = {}
    with Checkpointer(directory, every=2, keep=keep) as ck:
        for i in range(1, max(steps) + 1):
            state, _ = step(state, jaxpar.shard_batch(batch(i), layout.mesh))
            if i in steps:
                snaps[i] = host(state)
                assert ck.save(i, state, {"data": {"next_step": i}})
        with pytest.warns(CheckpointWarning, match=rf"checkpoint of step {max(steps)} not saved"):
            assert not ck.save(max(steps), state)          # an existing good step is not rewritten
    return layout, snaps, state


def test_keep_last_k_and_should_save(tmp_path):
    _save_steps(tmp_path, steps=(2, 4, 6, 8), keep=2)
    ck = Checkpointer(tmp_path, every=2, keep=2)
    assert ck.steps() == [6, 8]
    assert [s for s in range(1, 9) if ck.should_save(s)] == [2, 4, 6, 8]
    assert not Checkpointer(tmp_path / "other", every=0).should_save(100)
    with pytest.raises(ValueError, match=r"Checkpointer\(keep=0\): must be an int >= 1"):
        Checkpointer(tmp_path, keep=0)


def test_partial_save_is_ignored(tmp_path):
    layout, snaps, _ = _save_steps(tmp_path)
    shutil.copytree(tmp_path / "6", tmp_path / "8.orbax-checkpoint-tmp-1234")   # a save killed mid-write
    shutil.rmtree(tmp_path / "8.orbax-checkpoint-tmp-1234" / "meta")
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [2, 4, 6]
        assert ck.removed_partial == ["8.orbax-checkpoint-tmp-1234"]
        assert not (tmp_path / "8.orbax-checkpoint-tmp-1234").exists()
        got = ck.restore(layout)
    assert got.step == 6 and same(got.state, snaps[6])


def _state_data_file(step_dir: Path) -> Path:
    return max((step_dir / "state" / "d").iterdir(), key=lambda f: f.stat().st_size)


CORRUPTIONS = {
    "truncate array data": lambda d: _truncate(_state_data_file(d)),
    "delete array data": lambda d: _state_data_file(d).unlink(),
    "truncate tree metadata": lambda d: _truncate(d / "state" / "_METADATA"),
    "delete ocdbt manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "delete JSON record": lambda d: (d / "meta" / "metadata").unlink(),
}


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


def _overwrite(path: Path, nbytes: int = 4096) -> None:
    """``nbytes`` random bytes over the middle of a file, in place (its size unchanged)."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size // 2 - nbytes // 2))
        f.write(np.random.default_rng(0).bytes(min(nbytes, size)))


CORRUPTIONS |= {
    "random bytes in array data": lambda d: _overwrite(_state_data_file(d)),
    "random bytes in the JSON record": lambda d: _overwrite(d / "meta" / "metadata", 64),
    "random bytes in tree metadata": lambda d: _overwrite(d / "state" / "_METADATA", 64),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_latest_falls_back_to_previous(tmp_path, how):
    layout, snaps, _ = _save_steps(tmp_path)
    CORRUPTIONS[how](tmp_path / "6")
    with Checkpointer(tmp_path) as ck, pytest.warns(CheckpointWarning) as caught:
        got = ck.restore(layout)
    assert got.step == 4 and same(got.state, snaps[4])
    assert [s for s, _ in got.skipped] == [6]
    message = str(caught[0].message)
    assert f"checkpoint {tmp_path / '6'} (step 6) is unreadable, falling back to step 4" in message
    with Checkpointer(tmp_path) as ck, pytest.raises(CheckpointError, match=r"checkpoint .*6 is unreadable"):
        ck.restore(layout, step=6)


def _ascii_in(path: Path) -> None:
    """Eight ASCII letters over the middle of a file: still UTF-8, no longer JSON."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = b"abcdefgh"
    path.write_bytes(bytes(data))


#: A corrupt metadata file of a step, and the words of the reason its fallback gives.
METADATA_CORRUPTIONS = {
    "meta/metadata": (lambda p: _overwrite(p), "its file meta/metadata is not valid UTF-8 (UnicodeDecodeError: "),
    "state/_METADATA": (lambda p: _overwrite(p), "its file state/_METADATA is not valid UTF-8 (UnicodeDecodeError: "),
    "state/_sharding": (_ascii_in, "its file state/_sharding is not valid JSON in its entry of "),
    "state/_METADATA ": (_truncate, "its file state/_METADATA is not valid JSON (JSONDecodeError: "),
}


def test_a_corrupt_metadata_file_is_named_in_the_fallback(tmp_path):
    """Random bytes, ASCII or a cut in a step's JSON files: the fallback's reason names the file, not only the
    decoder's exception."""
    layout, snaps, _ = _save_steps(tmp_path / "saved")
    for i, (name, (corrupt, reason)) in enumerate(METADATA_CORRUPTIONS.items()):
        run = tmp_path / str(i)
        shutil.copytree(tmp_path / "saved", run)
        corrupt(run / "6" / name.strip())
        with Checkpointer(run) as ck, pytest.warns(CheckpointWarning) as caught:
            got = ck.restore(layout)
        assert got.step == 4 and same(got.state, snaps[4]), name
        message = str(caught[0].message)
        assert f"(step 6) is unreadable, falling back to step 4: {reason}" in message, message


def test_data_that_decode_but_changed_after_the_save_fail_their_checksums(tmp_path):
    """Step 6's arrays replaced by another state's of the same step (valid files, so they decode, as data
    changed in place can): its checksums differ from those recorded at save, so the restore falls back to
    step 4 and names the arrays."""
    layout, snaps, state = _save_steps(tmp_path / "run")
    other = state._replace(params=jax.tree.map(lambda a: a + 1, state.params))
    with Checkpointer(tmp_path / "other") as ck:
        assert ck.save(6, other, {"data": {"next_step": 6}}, wait=True)
    shutil.rmtree(tmp_path / "run" / "6" / "state")
    shutil.copytree(tmp_path / "other" / "6" / "state", tmp_path / "run" / "6" / "state")
    with Checkpointer(tmp_path / "run") as ck, pytest.warns(
            CheckpointWarning, match=r"step 6\) is unreadable, falling back to step 4: its data differ from the "
                                     r"checksums recorded at save in \d+ array\(s\) \(params/"):
        got = ck.restore(layout)
    assert got.step == 4 and same(got.state, snaps[4])


def test_a_checkpoint_of_another_format_is_refused_by_name(tmp_path):
    """A record of another format (an earlier jaxpar's, or a caller's ``format``, which save overwrites) is
    refused with its format and the one this jaxpar reads; no older checkpoint is tried."""
    layout, _, state = _save_steps(tmp_path)
    record = tmp_path / "6" / "meta" / "metadata"
    assert FORMAT in record.read_text()
    record.write_text(record.read_text().replace(FORMAT, "jaxpar-checkpoint-2"))
    with Checkpointer(tmp_path) as ck, pytest.raises(
            CheckpointMismatchError, match=rf"6 was written in format 'jaxpar-checkpoint-2'; this jaxpar reads "
                                           rf"'{FORMAT}' only"):
        ck.restore(layout)


def test_a_nonfinite_state_is_neither_saved_nor_restored(tmp_path, monkeypatch):
    """A state with a NaN parameter is not saved (a warning; the good checkpoints stay); one that reached the
    disk anyway (the save's check bypassed here) is refused at restore as corrupt."""
    layout, snaps, state = _save_steps(tmp_path)
    bad = state._replace(params=jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), state.params))
    with Checkpointer(tmp_path) as ck:
        with pytest.warns(CheckpointWarning, match=r"checkpoint of step 8 not saved: non-finite values in params/"):
            assert not ck.save(8, bad)
        assert ck.steps() == [2, 4, 6]
    from jaxpar.run import _checkpoint
    monkeypatch.setattr(_checkpoint, "inspect_state", lambda state: ({}, []))
    with Checkpointer(tmp_path, keep=4) as ck:
        assert ck.save(8, bad._replace(step=bad.step + 2), wait=True)
    monkeypatch.undo()
    with Checkpointer(tmp_path, keep=4) as ck, pytest.warns(
            CheckpointWarning, match=r"step 8\) is unreadable, falling back to step 6: non-finite values in params/"):
        got = ck.restore(layout)
    assert got.step == 6 and same(got.state, snaps[6])


def test_an_update_that_makes_a_parameter_nonfinite_is_skipped(tmp_path):
    """Finite loss and gradients, but the optimizer's update at step 3 is infinite: with on_nonfinite='skip'
    the step keeps the parameters and the optimizer state, and is reported as a non-finite update."""
    state, layout, _ = build({"data": 2, "fsdp": 2, "tensor": 2})
    tx = optax.chain(optax.sgd(1e-2), optax.scale_by_schedule(lambda count: jnp.where(count == 2, jnp.inf, 1.0)))
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, layout.mesh)
    step, snaps = _recording(jaxpar.make_train_step(lm_loss, tx, layout, skip_nonfinite=True))
    lines = []
    state, summary = train(step, state, batch, mesh=layout.mesh, steps=4, log_every=1, out_dir=tmp_path,
                           on_nonfinite="skip", progress="lines", print_fn=lines.append)
    # skipped, the optimizer's count stays at 2, so step 4's update is infinite too
    assert summary.skipped_steps == [3, 4] and same(snaps[3][0], snaps[1][0]) and finite(state.params)
    assert not same(snaps[1][0], snaps[0][0])
    assert any("step      3/4  WARNING non-finite update: update skipped" in x for x in lines), lines
    assert math.isfinite(summary.last_loss)


def test_corrupt_step_is_replaced_on_save(tmp_path):
    layout, snaps, state = _save_steps(tmp_path)
    _truncate(_state_data_file(tmp_path / "6"))
    with Checkpointer(tmp_path) as ck:
        with pytest.warns(CheckpointWarning):
            ck.restore(layout)
        assert ck.save(6, state, {"data": {"next_step": 6}})   # the unreadable step 6 is rewritten
    with Checkpointer(tmp_path) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ck.restore(layout)
    assert got.step == 6 and same(got.state, snaps[6])


def test_no_checkpoint_errors_name_the_directory(tmp_path):
    layout, _, _ = _save_steps(tmp_path / "a", steps=(2,))
    with Checkpointer(tmp_path / "empty") as ck, pytest.raises(CheckpointError) as err:
        ck.restore(layout)
    assert f"no checkpoint to resume from in {tmp_path / 'empty'}" in str(err.value)
    _truncate(_state_data_file(tmp_path / "a" / "2"))
    with Checkpointer(tmp_path / "a") as ck, pytest.warns(CheckpointWarning), \
            pytest.raises(CheckpointError, match=r"no readable checkpoint in .*step 2: "):
        ck.restore(layout)


# ----------------------------------------------------------------------------- a feature switched off or on at resume
def _mlp(sizes: dict, tx=TX, **strategy):
    """``(state, layout)`` of a tiny MLP (only the initialisation compiles)."""
    from jaxpar.models import MLPClassifier

    model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))  # noqa: E731
    return jaxpar.init_train_state(model_fn, tx, jaxpar.make_mesh(sizes), jaxpar.Strategy(**strategy))


def _bumped(state):
    """``state`` one step on, every array moved off its initial value (so a restore is told from a fresh init)."""
    return jax.tree.map(lambda a: a + 1, state)


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


@need_devices(8)
def test_resume_with_noise_scale_switched_off_or_on(tmp_path):
    """The model and optimizer state restore; the measurements are dropped (or start at zero), with a warning."""
    from jaxpar.step import with_noise_scale

    on, on_layout = with_noise_scale(*_mlp({"data": 8}), every=1)
    off, off_layout = _mlp({"data": 8})
    on, off = _bumped(on), _bumped(off)
    with Checkpointer(tmp_path / "on", async_save=False) as ck:
        ck.save(1, on)
        with pytest.warns(CheckpointWarning) as caught:
            got = ck.restore(off_layout)
    assert any("running measurements" in m and "dropped" in m for m in _messages(caught)), _messages(caught)
    assert not any("unreadable" in m for m in _messages(caught))
    assert got.step == 1 and got.state.stats == () and same((got.state.params, got.state.opt_state),
                                                             (on.params, on.opt_state))
    with Checkpointer(tmp_path / "off", async_save=False) as ck:
        ck.save(1, off)
        with pytest.warns(CheckpointWarning, match="running measurements.*restart from zero"):
            got = ck.restore(on_layout)
    assert same((got.state.params, got.state.opt_state), (off.params, off.opt_state))
    assert all(float(x) == 0 for x in jax.tree.leaves(host(got.state.stats)))


@need_devices(8)
def test_resume_with_relaxed_sync_switched_off_or_on(tmp_path):
    """stale(2) keeps the optimizer's layout: its replicas' history is dropped (or starts from the restored
    parameters). DiLoCo's outer optimizer is another optimizer state: a named error, not a fallback."""
    from jaxpar.parallel.sync import diloco, stale

    on, on_layout = _mlp({"replica": 4, "data": 2}, sync=stale(2))
    off, off_layout = _mlp({"data": 8})
    on, off = _bumped(on), _bumped(off)
    assert jax.tree.leaves(on.sync)
    with Checkpointer(tmp_path / "on", async_save=False) as ck:
        ck.save(1, on)
        with pytest.warns(CheckpointWarning) as caught:
            got = ck.restore(off_layout)
    assert any("replicas" in m and "dropped" in m for m in _messages(caught)), _messages(caught)
    assert not any("unreadable" in m for m in _messages(caught))
    assert got.state.sync == () and same((got.state.params, got.state.opt_state), (on.params, on.opt_state))
    with Checkpointer(tmp_path / "off", async_save=False) as ck:
        ck.save(1, off)
        with pytest.warns(CheckpointWarning, match="replicas.*restart from the restored parameters"):
            got = ck.restore(on_layout)
    assert same((got.state.params, got.state.opt_state), (off.params, off.opt_state))
    for h in range(2):
        assert same(jax.tree.map(lambda a: a[h], got.state.sync["history"]), off.params)
    outer, diloco_layout = _mlp({"replica": 4, "data": 2}, sync=diloco(2))
    with Checkpointer(tmp_path / "diloco", async_save=False) as ck:
        ck.save(1, _bumped(outer))
    for directory, layout in ((tmp_path / "diloco", off_layout), (tmp_path / "off", diloco_layout)):
        with Checkpointer(directory) as ck, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointError, match=r"optimizer state \(opt_state\)") as err:
                ck.restore(layout)
        assert "unreadable" not in str(err.value) and not _messages(caught), (str(err.value), _messages(caught))


@need_devices(8)
def test_resume_with_older_weight_versions_switched_off(tmp_path):
    """Weight stashing's older versions saved, 1F1B resumed: dropped with a warning, the rest restored."""
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    model_fn = lambda: GPT(CFG, rngs=nnx.Rngs(0))                               # noqa: E731
    stash, _ = jaxpar.init_train_state(model_fn, TX, mesh, jaxpar.Strategy(microbatches=2, schedule="pipedream"))
    _, flushed = jaxpar.init_train_state(model_fn, TX, mesh, jaxpar.Strategy(microbatches=2))
    stash = _bumped(stash)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, stash)
        with pytest.warns(CheckpointWarning) as caught:
            got = ck.restore(flushed)
    assert any("older weight versions" in m and "dropped" in m for m in _messages(caught)), _messages(caught)
    assert got.state.versions == () and same((got.state.params, got.state.opt_state), (stash.params, stash.opt_state))


@need_devices(8)
def test_weight_stashing_versions_reset_when_the_stages_change(tmp_path):
    """pipe=2 with update_every 1 -> 2 keeps one older version (same shapes), but it is another stage's
    version: W(t-1) = W(t) with a warning naming both layouts. The same layout restores it bit-exactly,
    and a checkpoint without the layout record restores as before (shapes compared only)."""
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    model_fn = lambda: GPT(CFG, rngs=nnx.Rngs(0))                               # noqa: E731
    k1 = jaxpar.Strategy(microbatches=2, schedule="pipedream")
    k2 = jaxpar.Strategy(microbatches=2, schedule="pipedream", update_every=2)
    state, layout1 = jaxpar.init_train_state(model_fn, TX, mesh, k1)
    _, layout2 = jaxpar.init_train_state(model_fn, TX, mesh, k2)
    assert len(state.versions) == 1 and jax.tree.structure(layout1.part("versions").shapes) == jax.tree.structure(
        layout2.part("versions").shapes)
    state = _bumped(state)._replace(versions=jax.tree.map(lambda a: a + 7, state.versions))
    with Checkpointer(tmp_path / "new", async_save=False) as ck:
        ck.save(1, state, layout=layout1)
        with pytest.warns(CheckpointWarning, match=r"(?s)update_every.*W\(t-1\) = W\(t\)") as caught:
            got = ck.restore(layout2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            same_layout = ck.restore(layout1)
    message = next(m for m in _messages(caught) if "W(t-1)" in m)
    assert "update_every=1" in message and "update_every=2" in message, message
    assert same(got.state.versions[0], state.params) and same(got.state.params, state.params)
    assert same(same_layout.state.versions, state.versions)
    with Checkpointer(tmp_path / "old", async_save=False) as ck:
        ck.save(1, state)                                    # no layout given: no record, as before
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            old = ck.restore(layout2)
    assert same(old.state.versions, state.versions)


# ----------------------------------------------------------------------------- non-finite steps
def _nan_at(step_no: int):
    """A loss that is NaN for global step ``step_no`` (1-based): the batch carries a per-row scale."""
    def loss(model, b):
        return lm_loss(model, b) * jnp.mean(b["scale"])

    def batch_fn(i):
        b = batch(i)
        b["scale"] = np.full((B,), np.nan if i + 1 == step_no else 1.0, np.float32)
        return b

    return loss, batch_fn


def _recording(step):
    snaps = []

    def run(state, b):
        state, metrics = step(state, b)
        snaps.append(host((state.params, state.opt_state)))
        return state, metrics

    return run, snaps


def test_nonfinite_step_is_skipped_and_reported(tmp_path):
    state, layout, _ = build({"data": 2, "fsdp": 2, "tensor": 2})
    loss, batch_fn = _nan_at(3)
    step, snaps = _recording(jaxpar.make_train_step(loss, TX, layout, skip_nonfinite=True))
    lines = []
    with Checkpointer(tmp_path / "ck", every=3) as ck:
        state, summary = train(step, state, batch_fn, mesh=layout.mesh, steps=5, log_every=1, out_dir=tmp_path,
                               checkpointer=ck, on_nonfinite="skip", progress="lines", print_fn=lines.append)
        restored = ck.restore(layout, step=3)
    assert summary.skipped_steps == [3] and int(state.step) == 5
    assert same(snaps[2], snaps[1]), "the skipped step changed params or optimizer state"
    assert not same(snaps[3], snaps[2]) and finite(snaps[-1])
    assert same(restored.state.params, snaps[2][0]) and finite(restored.state)    # saved at the skipped step
    assert any("step      3/5  WARNING non-finite loss nan" in x and "update skipped" in x for x in lines)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in recs if r["kind"] == "nonfinite"] == [
        {"kind": "nonfinite", "step": 3, "loss": "nan", "grad_norm": "nan", "action": "skipped"}]
    train_recs = {r["step"]: r for r in recs if r["kind"] == "train"}
    assert train_recs[3]["skipped"] == 1 and train_recs[3]["loss"] == "nan" and train_recs[4]["skipped"] == 0
    assert math.isfinite(summary.last_loss)


def test_nonfinite_step_with_compression_prints_its_nan_residual(tmp_path):
    """A skipped step of a compressed exchange: its residual norm is NaN, and the progress line
    says so instead of failing to format it (it raised ValueError once)."""
    from jaxpar.parallel.compression import sign

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    strategy = jaxpar.Strategy(compression=sign())
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), TX, mesh, strategy)
    loss, batch_fn = _nan_at(2)
    step = jaxpar.make_train_step(loss, TX, layout, strategy, skip_nonfinite=True)
    lines = []
    state, summary = train(step, state, batch_fn, mesh=mesh, steps=3, log_every=1, out_dir=tmp_path,
                           on_nonfinite="skip", progress="lines", print_fn=lines.append)
    assert summary.skipped_steps == [2] and finite(state)
    assert any(x.startswith("step      2/3") and "residual nan" in x for x in lines), lines
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_recs = {r["step"]: r for r in recs if r["kind"] == "train"}
    assert train_recs[2]["residual_norm"] == "nan" and math.isfinite(train_recs[3]["residual_norm"])


def test_nonfinite_stop_mode_raises_and_never_checkpoints_it(tmp_path):
    state, layout, _ = build({"data": 2, "fsdp": 2, "tensor": 2})
    loss, batch_fn = _nan_at(3)
    step = jaxpar.make_train_step(loss, TX, layout, skip_nonfinite=True)
    with Checkpointer(tmp_path / "ck", every=1) as ck:
        with pytest.raises(NonFiniteError, match=r"step 3: the loss is nan .*stopping \(on_nonfinite='stop'\)\. "
                                                 r"The last checkpoint is step 2\."):
            train(step, state, batch_fn, mesh=layout.mesh, steps=6, log_every=4, checkpointer=ck,
                  on_nonfinite="stop", progress="none")
        assert ck.steps() == [1, 2]
    # skip mode with a step that does not skip: the state is poisoned, so it must stop too
    plain = jaxpar.make_train_step(loss, TX, layout)
    state, _, _ = build({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(NonFiniteError, match=r"skip_nonfinite=True"):
        train(plain, state, batch_fn, mesh=layout.mesh, steps=4, log_every=4, on_nonfinite="skip", progress="none")


# ----------------------------------------------------------------------------- metrics
def _tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Read the TFRecord event files with tensorboardX's protos (no TensorFlow needed)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_tensorboard_jsonl_and_mfu(tmp_path):
    state, layout, step = build({"data": 2, "fsdp": 2, "tensor": 2})
    n_matmul = sum(x.size for k, sub in layout.shapes.items() if k not in ("wte", "wpe") for x in jax.tree.leaves(sub))
    fpt = flops_per_token(n_matmul, layers=CFG.layers, seq_len=CFG.seq_len, embed=CFG.embed)
    assert fpt == 6 * n_matmul + 12 * CFG.layers * CFG.seq_len * CFG.embed
    state, summary = train(step, state, batch, mesh=layout.mesh, steps=4, log_every=2, out_dir=tmp_path,
                           tensorboard=True, tokens_per_batch=B * CFG.seq_len, flops_per_token=fpt,
                           peak_flops=1e12, progress="none")
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 4]
    for r in recs:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (8 * 1e12), rel=1e-12)
    tb = _tb_scalars(tmp_path / "tb")
    assert {"train/loss", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s", "perf/mfu"} <= set(tb)
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 4]
    assert [v for _, v in tb["train/loss"]] == pytest.approx([r["loss"] for r in recs], rel=1e-6)
    assert summary.mfu == pytest.approx(summary.tokens_per_s * fpt / 8e12)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_greedy_generate_matches_argmax_of_the_model():
    state, layout, _ = build({"data": 2, "fsdp": 2, "tensor": 2})
    prompts = [[1, 2, 3], [5]]
    out = greedy_generate(layout.graphdef, state.params, prompts, context=CFG.seq_len, new_tokens=12)
    assert [len(o) for o in out] == [15, 13] and out[0][:3] == [1, 2, 3] and out[1][:1] == [5]
    padded = np.zeros((2, CFG.seq_len), np.int32)
    for i, o in enumerate(out):
        padded[i, :len(o)] = o
    forward = jax.jit(lambda p, x: nnx.merge(layout.graphdef, p)(x))     # causal: padding does not matter
    logits = np.asarray(forward(jax.device_get(state.params), padded))
    for i, (o, p) in enumerate(zip(out, prompts)):
        assert o[len(p):] == [int(np.argmax(logits[i, t - 1])) for t in range(len(p), len(o))]
    longer = greedy_generate(layout.graphdef, state.params, [b"\x01\x02"], context=CFG.seq_len, new_tokens=20)
    assert isinstance(longer[0], bytes) and longer[0][:2] == b"\x01\x02" and len(longer[0]) == 22   # past the context


# ----------------------------------------------------------------------------- config
BAD = [  # (override, text the error must contain)
    ("checkpoint.evry=5", "unknown key 'checkpoint.evry'; allowed keys under 'checkpoint': enabled, dir, every"),
    ("checkpoint.every=often", "invalid value for 'checkpoint.every'"),
    ("checkpoint.keep=0", "checkpoint.keep=0: must be >= 1"),
    ("checkpoint.async_save=perhaps", "invalid value for 'checkpoint.async_save'"),
    ("checkpoint=yes", "'checkpoint' must be a mapping"),
    ("logging.tensorbord=true", "unknown key 'logging.tensorbord'; allowed keys under 'logging': tensorboard"),
    ("logging.peak_flops=-1", "logging.peak_flops=-1.0: must be > 0"),
    ("logging.samples=-2", "logging.samples=-2: must be >= 0"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore': unknown value; allowed: skip, stop"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_and_logging_config(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(QUICK, [override])
    assert message in str(err.value)
    assert main(["train", QUICK, override]) == 2
    assert message in capsys.readouterr().err


def test_resume_needs_checkpoints_enabled(capsys):
    assert main(["train", QUICK, "checkpoint.enabled=false", "--resume"]) == 2
    assert "checkpoint.resume=true needs checkpoint.enabled=true" in capsys.readouterr().err
    cfg = load_config(QUICK, ["train.out_dir=/x/run"])
    assert cfg.checkpoint.dir == "/x/run/checkpoints" and not cfg.checkpoint.resume
