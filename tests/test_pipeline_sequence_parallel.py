"""Sequence parallelism inside pipelines: the flush schedules run as lockstep programs (every stage
the tick's action, masked where it has none: jaxpar.parallel.pipeline.lockstep), so SP's all-gathers and
reduce-scatters over ``tensor`` inside the stages' actions are reached by every device. Each schedule
on tensor2 x pipe2 x data2 equals one device; the lockstep executor equals the per-stage program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.models import GPTConfig
from jaxpar.parallel.pipeline import PipelineParts, get_schedule, lower, to_stages
from jaxpar.parallel.pipeline import pipeline_value_and_grad
from jaxpar.parallel.pipeline import is_lockstep, lockstep
from jaxpar.parallel.pipeline import from_stages
from jaxpar.parallel.pipeline import peak_in_flight
from jaxpar.parallel.pipeline._schedules import num_ticks, stage_actions

from conftest import need_devices
from helpers import run
from test_equivalence import assert_same

CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=4)
MESH = {"pipe": 2, "data": 2, "tensor": 2}
SCHEDULES = {"1f1b": {"microbatches": 4}, "zb-h1": {"microbatches": 4, "schedule": "zb-h1"},
             "gpipe": {"microbatches": 4, "schedule": "gpipe"},
             "interleaved": {"microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}}


@pytest.fixture(scope="module")
def reference():
    return run({}, jaxpar.Strategy(), cfg=CFG)


@need_devices(8)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if n != "1f1b" else [])
                                  for n in SCHEDULES])
def test_sequence_parallelism_in_a_pipeline_equals_one_device(name, reference):
    """3 AdamW steps: losses within 1e-5, the first gradients and the parameters within the usual bounds."""
    result = run(MESH, jaxpar.Strategy(sequence_parallel=True, **SCHEDULES[name]), cfg=CFG)
    assert_same(result, reference)


@pytest.mark.parametrize("kind, p, m, v", [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("zb-h1", 4, 8, 1),
                                           ("interleaved", 4, 8, 2), ("1f1b", 2, 3, 1)])
def test_lockstep_keeps_every_action_and_each_stages_order_of_backwards(kind, p, m, v):
    """One kind per tick; the same actions on the same stages (validated); each stage's backwards
    (and W) in their original order, its forwards too; at most ``peak + p - 1 - s`` in flight."""
    s = get_schedule(kind, p, m, v)
    out = lockstep(s)
    assert is_lockstep(out) and not is_lockstep(s) or kind == "gpipe"
    for st in range(p):
        before, after = stage_actions(s, st), stage_actions(out, st)
        assert sorted(map(str, before)) == sorted(map(str, after))
        for k in "FBW":
            assert [a for a in before if a.kind == k] == [a for a in after if a.kind == k]
        assert peak_in_flight(out)[st] <= peak_in_flight(s)[st] + p - 1 - st
    assert num_ticks(out) >= num_ticks(s)


@need_devices(2)
@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "interleaved"])
def test_the_lockstep_executor_equals_the_per_stage_program_with_uneven_stages(kind):
    """Stages of 3 and 2 layers (padding masked, not branched over): loss and gradients equal."""
    parts = PipelineParts(pre=lambda o, mb: mb["x"] * o["scale"], layer=lambda w, x: jnp.tanh(x @ w),
                          post=lambda o, y, mb: jnp.mean((y - mb["y"]) ** 2) * o["scale"])
    mesh = jaxpar.make_mesh({"pipe": 2}, devices=jax.devices()[:2])
    v = 2 if kind == "interleaved" else 1
    layers = (2, 1, 1, 1) if v == 2 else (3, 2)
    outer = {"scale": 1.3 * jnp.ones(())}
    blocks = 0.5 * jax.random.normal(jax.random.key(0), (5, 3, 3))
    mbs = {"x": jax.random.normal(jax.random.key(1), (4, 2, 3)), "y": jnp.zeros((4, 2, 3))}
    runs = []
    for in_lockstep in (False, True):
        sched = get_schedule(kind, 2, 4, v)
        program = lower(lockstep(sched) if in_lockstep else sched)
        fn = pipeline_value_and_grad(parts, mesh, (), program, stage_layers=layers, lockstep=in_lockstep)
        loss, (g_outer, g_blocks) = jax.jit(fn)(outer, to_stages(blocks, layers, p=2, v=v), mbs)
        runs.append((float(loss), float(g_outer["scale"]), np.asarray(from_stages(g_blocks, layers, 5))))
    (l0, o0, b0), (l1, o1, b1) = runs
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(o1, o0, rtol=1e-5)
    np.testing.assert_allclose(b1, b0, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1)])
def test_the_cost_models_lockstep_closed_forms_are_the_tables(kind, v):
    """jaxpar.cost reads lockstep tables up to p*m*v = 256 and closed forms above: they agree wherever both
    are computed. Each stage runs vm + p - 1 F ticks and as many B ticks (what the cost model's traffic
    counts), and 1F1B / interleaved keep the bubble of their usual table."""
    from collections import Counter

    from jaxpar.cost._schedule import lockstep_closed_form, schedule_stats

    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p, 4 * p):
            if (kind == "interleaved" and m % p) or p * m * v > 256:
                continue
            assert schedule_stats(kind, p, m, v, True) == pytest.approx(lockstep_closed_form(kind, p, m, v))
            ticks = Counter(next(a.kind for a in row if a) for row in lockstep(get_schedule(kind, p, m, v)).table)
            assert ticks["F"] == ticks["B"] == m * v + p - 1, (p, m, ticks)
            if kind in ("1f1b", "interleaved"):
                assert schedule_stats(kind, p, m, v, True)[0] == pytest.approx(schedule_stats(kind, p, m, v)[0])
