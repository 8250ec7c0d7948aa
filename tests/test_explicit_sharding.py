"""A model in JAX's explicit-sharding style (examples/explicit_transformer.py: mesh-axis parameter
specs, ``out_sharding=`` on every einsum, ``jax.reshard`` in its loss, ``nnx.List`` layers that differ,
GQA, RMSNorm, RoPE) trains under jaxpar's GSPMD strategies exactly as on one device, with the
strategy's collectives; where it cannot run, the error is jaxpar's and names the model's line."""

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import Strategy
from jaxpar.adapters import ModelMeshError

from conftest import need_devices
from helpers import explicit_one_device, train_steps

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from explicit_transformer import ExplicitTransformer, batches, loss  # noqa: E402

LR, STEPS = 1e-3, 3
KW = dict(vocab=64, embed=32, heads=4, kv_heads=2, mlp=64, layers=2, windows=[4, None])


def _model():
    return ExplicitTransformer(**KW, rngs=nnx.Rngs(0))


def _batch(step):
    return batches(step, batch_size=8, seed=0, seq_len=16, vocab=64)


@pytest.fixture(scope="module")
def reference():
    """One device, written by hand in the style's own terms (helpers.explicit_one_device)."""
    return explicit_one_device(_model, loss, _batch, LR, STEPS)


def _train(axes, strategy):
    return train_steps(_model, loss, _batch, axes, strategy, LR, STEPS)


CASES = {"dp8": ({"data": 8}, Strategy()),
         "zero1": ({"data": 8}, Strategy(zero=1)),
         "zero2": ({"data": 8}, Strategy(zero=2)),
         "zero3": ({"data": 8}, Strategy(zero=3)),
         "fsdp8": ({"fsdp": 8}, Strategy()),
         "fsdp4-tp2": ({"fsdp": 4, "tensor": 2}, Strategy()),
         "dp2-fsdp2-tp2-zero3-accum2": ({"data": 2, "fsdp": 2, "tensor": 2}, Strategy(zero=3, microbatches=2))}


#: In the exhaustive tier: ZeRO-1/2 and FSDP alone (DP, ZeRO-3 and all axes with accumulation run in the default
#: pass; tests/test_flax_example_style.py runs FSDP x TP there with Flax's example style).
SLOW = {"zero1", "zero2", "fsdp8", "fsdp4-tp2"}


@need_devices(8)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.exhaustive) if c in SLOW else c for c in CASES])
def test_explicit_style_model_is_exact_against_one_device(case, reference):
    ref_losses, ref_params, _ = reference
    axes, strategy = CASES[case]
    state, layout, losses, _, _ = _train(axes, strategy)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Adam moves a parameter by at most lr per step, so two runs whose gradients agree to float error
    # end within a small fraction of STEPS * lr of each other
    bound = 0.01 * STEPS * LR
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0],
                            jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=bound, rtol=0, err_msg=jax.tree_util.keystr(path))
    for spec in jax.tree.leaves(layout.params, is_leaf=lambda x: isinstance(x, P)):
        used = [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]
        assert len(used) == len(set(used)), spec


def _collectives(axes, strategy):
    from jaxpar.analysis import collectives

    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(_model, optax.adam(LR), mesh, strategy)
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    compiled = step.lower(state, jaxpar.shard_batch(_batch(0), mesh)).compile()
    param_bytes = sum(4 * a.size for a in jax.tree.leaves(layout.shapes))
    return collectives(compiled.as_text(), mesh), param_bytes


def _bytes(rows, kind, axes):
    return sum(r.bytes for r in rows if r.kind == kind and tuple(r.axes) == axes)


@need_devices(8)
def test_collectives_are_the_strategys():
    """DP8: the gradient's all-reduce over data and nothing else. ZeRO-3: the parameters all-gathered
    over data (one model's worth) and the gradient reduced over data; no other axis communicates."""
    rows, psi = _collectives({"data": 8}, Strategy())
    assert {(r.kind, tuple(r.axes)) for r in rows} == {("all-reduce", ("data",))}
    assert _bytes(rows, "all-reduce", ("data",)) == pytest.approx(psi, rel=0.01)
    rows, psi = _collectives({"data": 8}, Strategy(zero=3))
    assert {tuple(r.axes) for r in rows} == {("data",)}
    assert _bytes(rows, "all-gather", ("data",)) == pytest.approx(psi, rel=0.01)
    reduced = _bytes(rows, "all-reduce", ("data",)) + _bytes(rows, "reduce-scatter", ("data",))
    assert reduced == pytest.approx(psi, rel=0.01)


@need_devices(8)
def test_where_the_model_cannot_run_the_error_is_jaxpars_and_names_its_line():
    from jaxpar.parallel.compression import qsgd
    from jaxpar.step._grads import ExplicitDPError

    mesh = jaxpar.make_mesh({"data": 8}, devices=jax.devices()[:8])
    batch = jaxpar.shard_batch(_batch(0), mesh)
    state, layout = jaxpar.init_train_state(_model, optax.adam(LR), mesh, Strategy(compression=qsgd()))
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    with pytest.raises(ModelMeshError, match=r"pins shardings by mesh axes \(at .*explicit_transformer.py:\d+"):
        step(state, batch)
    state, layout = jaxpar.init_train_state(_model, optax.adam(LR), mesh, Strategy(zero=3))
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout, explicit_dp=True)
    with pytest.raises(ExplicitDPError, match="pins shardings by mesh axes"):
        step(state, batch)


@need_devices(8)
def test_checkpoint_restores_onto_another_mesh_and_training_goes_on(tmp_path):
    """Saved under DP2 x FSDP2 x TP2 (ZeRO-3), restored under FSDP4 x TP2: the same values, and the
    next step's loss is the one the first mesh computes."""
    from jaxpar.run import Checkpointer

    state, layout, _, step, mesh = _train({"data": 2, "fsdp": 2, "tensor": 2}, Strategy(zero=3))
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(STEPS, state, layout=layout)
    saved = jax.device_get(state)
    _, next_metrics = step(state, jaxpar.shard_batch(_batch(STEPS), mesh))      # donates state
    other = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, devices=jax.devices()[:8])
    _, other_layout = jaxpar.init_train_state(_model, optax.adam(LR), other, Strategy())
    with Checkpointer(tmp_path, async_save=False) as ck:
        restored = ck.restore(other_layout).state
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    assert restored.params["head"].sharding.spec == other_layout.params["head"]
    other_step = jaxpar.make_train_step(loss, optax.adam(LR), other_layout)
    _, metrics = other_step(restored, jaxpar.shard_batch(_batch(STEPS), other))
    np.testing.assert_allclose(float(metrics["loss"]), float(next_metrics["loss"]), rtol=1e-5)


@need_devices(8)
def test_sequence_parallelism_is_the_models_own_pins():
    """jaxpar's sequence parallelism is a rule on its logical names; a model that pins its activations by
    mesh axes decides that itself, so the option is refused by name rather than ignored."""
    mesh = jaxpar.make_mesh({"data": 2, "tensor": 4}, devices=jax.devices()[:8])
    state, layout = jaxpar.init_train_state(lambda: ExplicitTransformer(**{**KW, "kv_heads": 4}, rngs=nnx.Rngs(0)),
                                            optax.adam(LR), mesh, Strategy(sequence_parallel=True))
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout)
    with pytest.raises(ModelMeshError, match="sequence_parallel=True.*pins its activations"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))


@need_devices(8)
def test_several_steps_per_call_scan_the_explicit_models_step(reference):
    """steps_per_call=3 scans the explicit model's step: the same three losses as one device."""
    ref_losses, ref_params, _ = reference
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=jax.devices()[:8])
    state, layout = jaxpar.init_train_state(_model, optax.adam(LR), mesh, Strategy(zero=3))
    step = jaxpar.make_train_step(loss, optax.adam(LR), layout, steps_per_call=STEPS)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[_batch(i) for i in range(STEPS)])
    state, metrics = step(state, stacked)
    np.testing.assert_allclose(np.asarray(metrics["loss"]), ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=0.01 * STEPS * LR, rtol=0)
