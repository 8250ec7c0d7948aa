"""Every strategy matches the single-device run: same init, same global batch, 3 AdamW steps."""
import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.rules import path_str

from helpers import run

STRATEGIES = {
    "dp8": ({"data": 8}, {}),
    "zero1": ({"data": 8}, {"zero": 1}),
    "zero2": ({"data": 8}, {"zero": 2}),
    "zero3": ({"data": 8}, {"zero": 3}),
    "fsdp8": ({"fsdp": 8}, {}),
    "tp8": ({"tensor": 8}, {}),
    "tp8-sp": ({"tensor": 8}, {"sequence_parallel": True}),
    "dp2-tp4": ({"data": 2, "tensor": 4}, {}),
    "fsdp4-tp2": ({"fsdp": 4, "tensor": 2}, {}),
    "dp2-fsdp2-tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    "dp2-zero2-fsdp2-tp2-sp": ({"data": 2, "fsdp": 2, "tensor": 2}, {"zero": 2, "sequence_parallel": True}),
}


@pytest.fixture(scope="module")
def reference():
    return run({}, jaxpar.Strategy())


def assert_same(result, reference, rtol=1e-4, atol=1e-6):
    losses, params = result
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=atol)
    flat_ref = dict((path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(ref_params)[0])
    for p, v in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_allclose(v, flat_ref[path_str(p)], rtol=rtol, atol=atol, err_msg=path_str(p))


@pytest.mark.parametrize("accum", [1, 2], ids=["noaccum", "accum2"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(name, accum, reference):
    sizes, kw = STRATEGIES[name]
    result = run(sizes, jaxpar.Strategy(microbatches=accum, **kw))
    assert result[0][-1] < result[0][0], "loss must go down over 3 steps"
    assert_same(result, reference)


def test_accumulation_matches_on_single_device(reference):
    assert_same(run({}, jaxpar.Strategy(microbatches=4)), reference)


def test_xla_managed_data_parallel_matches(reference):
    """explicit_dp=False (XLA chooses the data-axis collectives) gives the same numbers."""
    from helpers import make_batch, setup
    import optax
    from jaxpar.models import lm_loss
    mesh, state, layout, _ = setup({"data": 2, "fsdp": 2, "tensor": 2}, jaxpar.Strategy(zero=2))
    step = jaxpar.make_train_step(lm_loss, optax.adamw(1e-3, weight_decay=0.1), layout,
                                  jaxpar.Strategy(zero=2), explicit_dp=False)
    losses = []
    for _ in range(3):
        state, m = step(state, jaxpar.shard_batch(make_batch(), mesh))
        losses.append(float(m["loss"]))
    assert_same((np.array(losses), jax.device_get(state.params)), reference)


@pytest.mark.parametrize("sizes,zero", [({"data": 2, "fsdp": 4}, 2), ({"data": 4, "fsdp": 2}, 1),
                                        ({"data": 2, "fsdp": 2, "tensor": 2}, 3)],
                         ids=["data2-fsdp4-zero2", "data4-fsdp2-zero1", "dp2-fsdp2-tp2-zero3"])
def test_explicit_data_parallel_matches(sizes, zero, reference):
    """explicit_dp=True (per-layer flat-buffer all-gather / reduce-scatter / psum over two data
    axes at once, also next to a tensor axis) gives the single-device numbers."""
    from helpers import make_batch, setup
    import optax
    from jaxpar.models import lm_loss
    mesh, state, layout, _ = setup(sizes, jaxpar.Strategy(zero=zero))
    step = jaxpar.make_train_step(lm_loss, optax.adamw(1e-3, weight_decay=0.1), layout,
                                  jaxpar.Strategy(zero=zero), explicit_dp=True)
    losses = []
    for _ in range(3):
        state, m = step(state, jaxpar.shard_batch(make_batch(), mesh))
        losses.append(float(m["loss"]))
    assert_same((np.array(losses), jax.device_get(state.params)), reference)
