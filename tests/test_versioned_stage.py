"""The no-flush program's parts on their own: the version tables 2BW and weight stashing give the
versioned stage, where its updates run, and the metrics of a step of several updates."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.parallel.pipeline import lower
from jaxpar.parallel.pipeline import pipedream, pipedream_2bw
from jaxpar.parallel.pipeline._pipedream import lower_stashed, step_windows, version_rows
from jaxpar.parallel.pipeline._stage import tick_table
from jaxpar.step._update import updates_metrics


@pytest.mark.parametrize("p,m,steps", [(2, 2, 3), (4, 4, 2), (4, 8, 3)])
def test_2bw_version_table_reads_the_previous_steps_weights(p, m, steps):
    """In window ``t`` slot 0 is ``W(t-1)`` and slot 1 ``W(t)``: every action of a micro-batch of step
    ``i // m`` reads ``W(i // m - 1)``, and no action updates."""
    program = lower(pipedream_2bw(p, m, steps))
    ver, cur, new = version_rows(program, m, steps)
    windows = step_windows(p, m, steps)
    assert ver.shape == (len(program.ticks), p) and not cur.any() and not new.any()
    seen = set()
    for t, tick in enumerate(program.ticks):
        window = next(w for w, (lo, hi) in enumerate(windows) if lo <= t < hi)
        for s, ins in enumerate(tick.instrs):
            if ins.op != "idle":
                assert window - 1 + ver[t, s] == ins.microbatch // m - 1, (t, s, ins)
                seen.add(int(ver[t, s]))
    assert seen == {0, 1}
    assert not any(k.updates for k in tick_table(program).kinds)


@pytest.mark.parametrize("k", [1, 2])
def test_stashing_updates_run_after_the_backward_that_ends_a_group(k):
    """The branch kinds update exactly at the backwards that end an ``update_every`` group, on
    every stage, ``m / k`` times per step."""
    p, m, steps = 4, 4, 2
    sp = lower_stashed(pipedream(p, m, steps), m=m, update_every=k)
    table = tick_table(sp.program, updates=sp.update)
    kinds, rows = table.kinds, table.rows
    for t, tick in enumerate(sp.program.ticks):
        for s, ins in enumerate(tick.instrs):
            updates = kinds[rows.kind[t, s]].updates
            assert updates == (ins.op == "B" and (ins.microbatch + 1) % k == 0), (t, s, ins)
    assert sum(k_.updates for row in rows.kind for k_ in (kinds[i] for i in row)) == p * m * steps // k


def test_a_step_of_several_updates_reports_their_rms_and_what_was_skipped():
    """``grad_norm`` is the root mean square of the updates' norms; ``skipped`` only when every
    update was (no weight changed), ``skipped_updates`` how many."""
    norms = jnp.array([3.0, 4.0, 12.0])
    m = updates_metrics(jnp.float32(1.5), jnp.sum(norms ** 2), 3, jnp.int32(2), lr=0.2)
    np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt((9 + 16 + 144) / 3), rtol=1e-6)
    assert not bool(m["skipped"]) and int(m["skipped_updates"]) == 2
    np.testing.assert_allclose(float(m["lr"]), 0.2, rtol=1e-6)
    assert bool(updates_metrics(jnp.float32(jnp.nan), jnp.float32(0.0), 3, jnp.int32(3))["skipped"])
    per_stage = updates_metrics(jnp.float32(1.0), jnp.float32(4.0), 1, jnp.int32(3), of=4)
    assert not bool(per_stage["skipped"]) and int(per_stage["skipped_updates"]) == 3   # 3 of 4 stages' parts
    plain = updates_metrics(jnp.float32(1.0), jnp.float32(4.0), 1)
    assert sorted(plain) == ["grad_norm", "loss"] and float(plain["grad_norm"]) == 2.0
