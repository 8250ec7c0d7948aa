"""Stage partitioning (exact DP against brute force), stacked-layer layouts, lowered programs."""
import doctest
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.parallel.pipeline import _partition as P
from jaxpar.parallel.pipeline import _instructions as G
from jaxpar.parallel.pipeline import get_schedule, peak_in_flight
from jaxpar.parallel.pipeline._schedules import num_ticks


def _stage_cost(costs, stage_layers, first_extra=0.0, last_extra=0.0):
    """Cost of each stage under a partition: its layers', plus the embedding on the first and the head on the last."""
    out, start = [], 0
    for k, n in enumerate(stage_layers):
        c = float(sum(costs[start:start + n]))
        c += first_extra if k == 0 else 0.0
        c += last_extra if k == len(stage_layers) - 1 else 0.0
        out.append(c)
        start += n
    return tuple(out)


def _brute(costs, k, first, last):
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), k - 1):
        sizes = np.diff((0, *cuts, L))
        worst = max(_stage_cost(costs, sizes, first, last))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_optimal(seed):
    rng = np.random.default_rng(seed)
    L, k = int(rng.integers(4, 11)), int(rng.integers(2, 5))
    costs = rng.uniform(0.5, 3.0, L).tolist()
    first, last = float(rng.uniform(0, 3)), float(rng.uniform(0, 3))
    sizes = P.partition_layers(costs, k, first_extra=first, last_extra=last)
    assert len(sizes) == k and sum(sizes) == L and min(sizes) >= 1
    assert max(_stage_cost(costs, sizes, first, last)) == pytest.approx(_brute(costs, k, first, last))


def test_partition_moves_layers_off_the_ends():
    assert P.partition_layers([1.0] * 8, 4) == (2, 2, 2, 2)
    assert P.partition_layers([1.0] * 8, 4, first_extra=1.0, last_extra=2.0) == (1, 3, 3, 1)


def test_partition_errors():
    with pytest.raises(P.PartitionError, match="every stage needs at least one layer"):
        P.partition_layers([1.0] * 3, 4)
    with pytest.raises(P.PartitionError, match="cannot be split evenly"):
        P.uniform_layers(6, 4)
    with pytest.raises(P.PartitionError, match="pipe=2 x virtual_stages=2 = 4"):
        P.check_stage_layers((2, 2), 4, 2, 2)


@pytest.mark.parametrize("stage_layers,v", [((2, 2, 2, 2), 1), ((1, 3, 3, 1), 1), ((1, 1, 1, 1, 1, 1, 1, 1), 2),
                                             ((2, 1, 1, 2), 2)])
def test_stage_layout_round_trips(stage_layers, v):
    p = len(stage_layers) // v
    L = sum(stage_layers)
    blocks = {"w": jnp.arange(L * 3.0).reshape(L, 3)}
    staged = P.to_stages(blocks, stage_layers, p, v)["w"]
    assert staged.shape[:2] == (v, p)
    start = 0
    for k, n in enumerate(stage_layers):          # virtual stage k = chunk * p + stage
        c, s = divmod(k, p)
        np.testing.assert_array_equal(staged[c, s, :n], blocks["w"][start:start + n])
        start += n
    np.testing.assert_array_equal(P.from_stages({"w": staged}, stage_layers, L)["w"], blocks["w"])


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 16, 1), ("interleaved", 4, 8, 2),
                                         ("zb-h1", 4, 8, 1), ("1f1b", 2, 2, 1)])
def test_lowered_program_buffers(kind, p, m, v):
    s = get_schedule(kind, p, m, v)
    prog = G.lower(s)
    assert len(prog.ticks) == num_ticks(s)
    assert prog.n_res == max(peak_in_flight(s, until="W"))     # residuals live until B (or W)
    if kind == "1f1b":
        assert prog.n_res <= p and prog.n_fwd == 1 and prog.n_bwd == 1
    assert G.sends(prog) == {"forward": m * (p * v - 1), "backward": m * (p * v - 1)}
    for t in prog.ticks:                       # every receive lands in a real slot, others in the discard slot
        assert sorted(d for _, d in t.fwd_pairs) == [s_ for s_, r in enumerate(t.fwd_recv) if r < prog.n_fwd]
        assert sorted(d for _, d in t.bwd_pairs) == [s_ for s_, r in enumerate(t.bwd_recv) if r < prog.n_bwd]


@pytest.mark.parametrize("mod", [P, G], ids=lambda m: m.__name__)
def test_module_doctests(mod):
    """The examples in the docstrings run and hold (3 in _partition.py, 4 in _program.py today)."""
    result = doctest.testmod(mod)
    assert result.attempted > 0, f"no doctest examples found in {mod.__name__}"
    assert result.failed == 0, result
