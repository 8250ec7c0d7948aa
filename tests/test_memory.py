"""Per-device memory from the compiled step against the ZeRO formulas (fp32 Adam)."""
import dataclasses
import math

import jax
import pytest

import jaxpar
from jaxpar.analysis import memory_report
from jaxpar.parallel import zero_dim

from helpers import CFG, GLOBAL_BATCH, compile_step

CFG_MEM = dataclasses.replace(CFG, embed=64, layers=8)
N = 8


def psi_split(layout):
    """(Ψ, Ψ of leaves ZeRO cannot split over N devices)."""
    psi = unsplit = 0
    for shape, logical in zip(jax.tree.leaves(layout.shapes),
                              jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        size = math.prod(shape.shape)
        psi += size
        if zero_dim(shape.shape, tuple(logical), jax.sharding.PartitionSpec(), {"data": N}) is None:
            unsplit += size
    return psi, unsplit


def closed_form(kind, psi, unsplit):
    split = psi - unsplit
    return {
        "dp": 12 * psi,
        "zero1": 4 * psi + 8 * split / N + 8 * unsplit,
        "zero2": 4 * psi + 8 * split / N + 8 * unsplit,
        "zero3": 12 * split / N + 12 * unsplit,
    }[kind]


CASES = {"dp": ({"data": N}, 0), "zero1": ({"data": N}, 1), "zero2": ({"data": N}, 2),
         "zero3": ({"data": N}, 3), "fsdp": ({"fsdp": N}, 0)}


class _Compiled(dict):
    """Each case's layout and compiled memory report, compiled when a test first asks for it (``make test``
    runs three of the five cases)."""

    def __missing__(self, name):
        sizes, zero = CASES[name]
        _, layout, c = compile_step(sizes, jaxpar.Strategy(zero=zero), cfg=CFG_MEM)
        self[name] = (layout, memory_report(c))
        return self[name]


@pytest.fixture(scope="module")
def compiled():
    return _Compiled()


@pytest.mark.parametrize("name", list(CASES))
def test_argument_bytes_match_zero_formula(name, compiled):
    layout, report = compiled[name]
    psi, unsplit = psi_split(layout)
    assert unsplit < 0.02 * psi
    batch_bytes = 2 * GLOBAL_BATCH * CFG_MEM.seq_len * 4 / N
    state_bytes = report.argument_bytes - batch_bytes
    formula = closed_form("zero3" if name == "fsdp" else name, psi, unsplit)
    assert state_bytes == pytest.approx(formula, rel=0.05)
    assert layout.analytic_bytes()["total"] == pytest.approx(formula, rel=1e-3)


def test_zero_saves_what_it_promises(compiled):
    args = {k: compiled[k][1].argument_bytes for k in CASES}
    psi, _ = psi_split(compiled["dp"][0])
    assert args["dp"] - args["zero1"] == pytest.approx(8 * psi * (1 - 1 / N), rel=0.05)
    assert args["zero1"] == args["zero2"]
    assert args["zero1"] - args["zero3"] == pytest.approx(4 * psi * (1 - 1 / N), rel=0.05)


def test_zero2_reduces_gradients_per_layer(compiled):
    """ZeRO-2 never holds the full gradient: its temporaries are below ZeRO-1's by >= half of 4Ψ."""
    psi, _ = psi_split(compiled["dp"][0])
    z1, z2 = compiled["zero1"][1].temp_bytes, compiled["zero2"][1].temp_bytes
    assert z1 - z2 >= 0.5 * 4 * psi, f"temp bytes: zero1={z1} zero2={z2} full gradient={4 * psi}"
