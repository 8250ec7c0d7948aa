"""Every strategy matches the single-device run: same init, same global batch, 3 AdamW steps.

Compared (tests/helpers.py, ``assert_runs_match``): the loss of every step (rtol 1e-5), the
first step's gradients as the optimizer receives them (rtol 1e-4, atol 1e-5 x the leaf's
largest gradient) and the parameters after the 3 steps (rtol 1e-4, atol 1e-6 plus Adam's
per-element allowance ``c * lr * steps``, ``c <= 2``, derived in ``helpers.adam_atol``: Adam
normalises each element's step to ~lr, so where a gradient is within round-off of zero the
round-off decides a step of size lr; elsewhere ``c`` is ~0).
"""
import pytest

import jaxpar

from helpers import assert_runs_match, run

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


def assert_same(result, reference):
    """Loss per step, first-step gradients and parameters after Adam (see the module docstring)."""
    assert_runs_match(result, reference)


# Accumulation with every strategy runs in the exhaustive tier; the default run keeps it
# for SP with ZeRO-2 on all axes (tests/test_byo_model.py keeps ZeRO-3 with accumulation). Without
# accumulation the default run keeps DP, ZeRO-3, TP with SP and the product of all axes (whose parts
# the exhaustive tier runs one by one).
ACCUM_DEFAULT = {"dp2-zero2-fsdp2-tp2-sp"}
NOACCUM_DEFAULT = {"dp8", "zero3", "tp8-sp", "dp2-zero2-fsdp2-tp2-sp"}
CASES = [pytest.param(name, accum, id=f"{name}-{'accum2' if accum == 2 else 'noaccum'}",
                      marks=[] if name in (ACCUM_DEFAULT if accum == 2 else NOACCUM_DEFAULT) else [pytest.mark.exhaustive])
         for name in STRATEGIES for accum in (1, 2)]


@pytest.mark.parametrize("name,accum", CASES)
def test_strategy_matches_single_device(name, accum, reference):
    sizes, kw = STRATEGIES[name]
    result = run(sizes, jaxpar.Strategy(microbatches=accum, **kw))
    assert result.losses[-1] < result.losses[0], "loss must go down over 3 steps"
    assert_same(result, reference)


def test_accumulation_matches_on_single_device(reference):
    assert_same(run({}, jaxpar.Strategy(microbatches=4)), reference)


def test_xla_managed_data_parallel_matches(reference):
    """explicit_dp=False (XLA chooses the data-axis collectives) gives the same numbers."""
    assert_same(run({"data": 2, "fsdp": 2, "tensor": 2}, jaxpar.Strategy(zero=2), explicit_dp=False), reference)


@pytest.mark.parametrize("sizes,zero", [({"data": 2, "fsdp": 4}, 2), ({"data": 4, "fsdp": 2}, 1),
                                        ({"data": 2, "fsdp": 2, "tensor": 2}, 3)],
                         ids=["data2-fsdp4-zero2", "data4-fsdp2-zero1", "dp2-fsdp2-tp2-zero3"])
def test_explicit_data_parallel_matches(sizes, zero, reference):
    """explicit_dp=True (per-layer flat-buffer all-gather / reduce-scatter / psum over two data
    axes at once, also next to a tensor axis) gives the single-device numbers."""
    assert_same(run(sizes, jaxpar.Strategy(zero=zero), explicit_dp=True), reference)
