"""Pipeline schedule tables: legality, exact bubble formulas, memory, rendering, errors."""
import dataclasses
import doctest
from fractions import Fraction

import pytest

from jaxpar.parallel.pipeline import _schedules as S
from jaxpar.parallel.pipeline import Action, Schedule, ScheduleError, bubble_fraction, get_schedule, peak_in_flight, to_text, validate
from jaxpar.parallel.pipeline._schedules import gpipe, interleaved_1f1b, num_ticks, one_f_one_b, stage_actions, timeline, zero_bubble_h1

PM = [(p, k * p) for p in (2, 4) for k in (1, 2, 4)]


def _edit(s: Schedule, **cells) -> Schedule:
    """Copy of ``s`` with ``table[t][st] = action`` for keys ``t{t}_{st}``."""
    table = [list(row) for row in s.table]
    for key, a in cells.items():
        t, st = map(int, key[1:].split("_"))
        table[t][st] = a
    return dataclasses.replace(s, table=table)


def _tick(s: Schedule, stage: int, a: Action) -> int:
    return next(t for t, row in enumerate(s.table) if row[stage] == a)


def makespan(s: Schedule) -> int:
    """Total time of one step under the cost model: the latest end of any stage's timeline."""
    return max(end for stage in timeline(s) for _, end, _ in stage)


def tick_bubble_fraction(s: Schedule) -> Fraction:
    """Idle cells / all cells of the unit-tick table (every action one tick)."""
    idle = sum(a is None for row in s.table for a in row)
    return Fraction(idle, max(1, len(s.table) * s.num_stages))


# ----------------------------------------------------------------------------- legality + formulas
@pytest.mark.parametrize("p,m", PM)
def test_gpipe(p, m):
    s = gpipe(p, m)
    validate(s)
    assert num_ticks(s) == 2 * (m + p - 1)
    assert bubble_fraction(s, exact=True) == Fraction(p - 1, m + p - 1)
    assert peak_in_flight(s) == (m,) * p


@pytest.mark.parametrize("p,m", PM)
def test_one_f_one_b(p, m):
    s = one_f_one_b(p, m)
    validate(s)
    assert num_ticks(s) == 2 * (m + p - 1)
    assert bubble_fraction(s, exact=True) == Fraction(p - 1, m + p - 1)
    peaks = peak_in_flight(s)
    assert max(peaks) <= p and peaks[0] == p
    assert peaks == tuple(p - st for st in range(p))
    for st in range(p):  # p-st-1 warm-up forwards, then a B right after the next F
        acts = stage_actions(s, st)
        assert [a.kind for a in acts[: p - st]] == ["F"] * (p - st)
        assert acts[p - st] == Action("B", 0)


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved(p, m, v):
    s = interleaved_1f1b(p, m, v)
    validate(s)
    assert (s.num_chunks, s.split_backward) == (v, False)
    assert bubble_fraction(s, exact=True) == Fraction(p - 1, v * m + p - 1)
    assert tick_bubble_fraction(s) == Fraction(p - 1, v * m + p - 1)
    assert num_ticks(s) == 2 * (v * m + p - 1)
    # every device holds chunks 0..v-1 and runs F and B of each for each micro-batch once
    for st in range(p):
        assert {(a.microbatch, a.chunk) for a in stage_actions(s, st)} == {
            (mb, c) for mb in range(m) for c in range(v)}


@pytest.mark.parametrize("p,m", PM)
def test_zero_bubble_h1(p, m):
    s = zero_bubble_h1(p, m)
    validate(s)
    assert s.split_backward
    assert bubble_fraction(s, exact=True) == Fraction(p - 1, 3 * m + p - 1)
    assert bubble_fraction(s) < bubble_fraction(one_f_one_b(p, m))
    assert num_ticks(s) == makespan(s) == 3 * m + p - 1
    # activation memory (until B) equals 1F1B's; awaiting-W never exceeds 1F1B's peak p
    assert peak_in_flight(s) == peak_in_flight(one_f_one_b(p, m))
    assert max(peak_in_flight(s, until="W")) <= p


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zb_h1_beats_1f1b_for_every_m(p):
    for m in range(p, 4 * p + 1):
        zb, ofob = zero_bubble_h1(p, m), one_f_one_b(p, m)
        if p == 1:
            assert bubble_fraction(zb) == bubble_fraction(ofob) == 0
        else:
            assert bubble_fraction(zb) < bubble_fraction(ofob), (p, m)


def test_get_schedule_kinds_and_aliases():
    assert get_schedule("gpipe", 2, 4) == gpipe(2, 4)
    assert get_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert get_schedule("interleaved", 2, 4, v=2) == interleaved_1f1b(2, 4, 2)
    assert get_schedule("interleaved_1f1b", 2, 4, 3) == interleaved_1f1b(2, 4, 3)
    for alias in ("zb-h1", "zbh1", "zero_bubble", "ZB-H1"):
        assert get_schedule(alias, 2, 4) == zero_bubble_h1(2, 4)


def test_timeline_durations():
    s = gpipe(2, 2)
    for stage in timeline(s):
        for start, end, a in stage:
            assert end - start == (2 if a.kind == "B" else 1)
    assert makespan(s) == 3 * (2 + 2 - 1)
    assert all(end - start == 1 for stage in timeline(zero_bubble_h1(2, 2)) for start, end, _ in stage)


def test_module_doctests():
    result = doctest.testmod(S)
    assert result.failed == 0 and result.attempted >= 8


# ----------------------------------------------------------------------------- validator rejects broken tables
def test_rejects_missing_action():
    s = one_f_one_b(2, 2)
    bad = _edit(s, **{f"t{_tick(s, 0, Action('B', 1))}_0": None})
    with pytest.raises(ScheduleError, match=r"missing action: B\(mb=1, chunk=0\).*stage 0"):
        validate(bad)


def test_rejects_duplicate_action():
    s = gpipe(2, 2)
    idle = next(t for t, row in enumerate(s.table) if row[0] is None and t > 1)
    with pytest.raises(ScheduleError, match=r"duplicate F\(mb=0, chunk=0\)"):
        validate(_edit(s, **{f"t{idle}_0": Action("F", 0)}))


def test_rejects_forward_before_previous_stage():
    s = gpipe(2, 2)  # stage 1 runs F0 at tick 1; tick 0 is idle there
    bad = _edit(s, t0_1=Action("F", 0), t1_1=None)
    with pytest.raises(ScheduleError, match=r"tick 0, stage 1: F\(mb=0.*dependency F\(mb=0.*activation"):
        validate(bad)


def test_rejects_backward_before_its_forward():
    s = Schedule("hand", 1, 1, 1, [[Action("B", 0)], [Action("F", 0)]])
    with pytest.raises(ScheduleError, match=r"tick 0, stage 0: B\(mb=0.*its own F"):
        validate(s)


def test_rejects_backward_before_next_stage_backward():
    s = gpipe(2, 1)  # s0 F0@0, s1 F0@1, s1 B0@2, s0 B0@3
    assert _tick(s, 1, Action("B", 0)) == 2 and _tick(s, 0, Action("B", 0)) == 3
    bad = _edit(s, t2_0=Action("B", 0), t3_0=None)  # same tick as stage 1's B: not strictly earlier
    msg = r"tick 2, stage 0: B\(mb=0.*B\(mb=0, chunk=0\) on stage 1.*output gradient"
    with pytest.raises(ScheduleError, match=msg):
        validate(bad)


def test_rejects_weight_before_backward():
    s = zero_bubble_h1(2, 2)
    tb, tw = _tick(s, 1, Action("B", 0)), _tick(s, 1, Action("W", 0))
    bad = _edit(s, **{f"t{tb}_1": Action("W", 0), f"t{tw}_1": Action("B", 0)})
    with pytest.raises(ScheduleError, match=r"W\(mb=0, chunk=0\) runs before its dependency B\(mb=0"):
        validate(bad)


def test_rejects_weight_in_fused_schedule():
    s = one_f_one_b(2, 2)
    idle = next(t for t, row in enumerate(s.table) if row[1] is None and t > 3)
    with pytest.raises(ScheduleError, match="split_backward=False"):
        validate(_edit(s, **{f"t{idle}_1": Action("W", 0)}))


def test_rejects_action_on_wrong_device_interleaved():
    s = interleaved_1f1b(2, 2, 2)
    t = _tick(s, 0, Action("F", 0, 1))  # chunk 1 of stage 0 = virtual stage 2
    assert s.table[0][1] is None
    bad = _edit(s, **{f"t{t}_0": None}, t0_1=Action("F", 0, 1))
    with pytest.raises(ScheduleError, match=r"duplicate F\(mb=0, chunk=1\).*stage 0 never does.*wrong device"):
        validate(bad)


def test_rejects_malformed_tables():
    s = gpipe(2, 1)
    with pytest.raises(ScheduleError, match="row has 1 cells"):
        validate(dataclasses.replace(s, table=[[Action("F", 0)]]))
    with pytest.raises(ScheduleError, match="out of range"):
        validate(_edit(s, t0_1=Action("F", 5)))
    with pytest.raises(ScheduleError, match="not an Action"):
        validate(_edit(s, t0_1="F0"))
    assert issubclass(ScheduleError, ValueError)


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("fn", [one_f_one_b, zero_bubble_h1])
def test_m_less_than_p(fn):
    with pytest.raises(ValueError, match=r"m >= p.*m=2.*p=4"):
        fn(4, 2)


def test_interleaved_input_errors():
    with pytest.raises(ValueError, match=r"divisible by p.*m=6, p=4.*m=8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"interleaved_1f1b\(v=1\): must be an int >= 2"):
        interleaved_1f1b(4, 8, 1)
    with pytest.raises(ValueError, match=r"interleaved_1f1b\(v=1\): must be an int >= 2"):
        get_schedule("interleaved", 4, 8)


@pytest.mark.parametrize("p,m,match", [(0, 4, r"gpipe\(p=0\): must be an int >= 1"),
                                       (2, 0, r"gpipe\(m=0\): must be an int >= 1"),
                                       (2.0, 4, r"gpipe\(p=2.0\): must be an int"),
                                       (2, True, r"gpipe\(m=True\): must be an int")])
def test_bad_sizes(p, m, match):
    with pytest.raises(ValueError, match=match):
        gpipe(p, m)


def test_get_schedule_errors():
    with pytest.raises(ValueError, match=r"unknown schedule kind 'pipedream-x'.*gpipe, 1f1b, interleaved, zb-h1"):
        get_schedule("pipedream-x", 2, 4)
    with pytest.raises(ValueError, match="only applies to kind 'interleaved'"):
        get_schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="Action kind"):
        Action("X", 0)
    with pytest.raises(ValueError, match=r"Action\(microbatch=-1\): must be an int >= 0"):
        Action("F", -1)


# ----------------------------------------------------------------------------- text + png
def test_to_text():
    text = to_text(one_f_one_b(4, 8))
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[0] == "1f1b p=4 m=8 v=1 ticks=22 bubble=0.2727 peak_in_flight=(4, 3, 2, 1)"
    assert lines[1].split()[:6] == ["s0", "|", "F0", "F1", "F2", "F3"]
    assert lines[4].split()[:7] == ["s3", "|", ".", ".", ".", "F0", "B0"]
    inter = to_text(interleaved_1f1b(2, 4, 2))
    assert "F0.1" in inter and "B3.0" in inter and "v=2" in inter
    zb = to_text(zero_bubble_h1(2, 2))
    assert "W1" in zb and "zb-h1" in zb


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_render_png(tmp_path, kind, v, timed):
    matplotlib = pytest.importorskip("matplotlib")
    from jaxpar.parallel.pipeline._render import render_png

    backend = matplotlib.get_backend()
    out = render_png(get_schedule(kind, 4, 8, v), tmp_path / f"{kind}.png", timed=timed)
    data = (tmp_path / f"{kind}.png").read_bytes()
    assert out == str(tmp_path / f"{kind}.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024
    assert matplotlib.get_backend() == backend
