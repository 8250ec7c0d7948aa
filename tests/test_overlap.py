"""Compute scheduled under asynchronous collectives (jaxpar.analysis._overlap): hand-written HLO with
exact counts (GPU start / done pairs, async wrappers, libtpu's async collective fusions, while loops,
FLOPs of dots, convolutions and cuBLAS gemms), then real programs compiled for CPU and an H100."""
from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxpar.analysis import format_bytes
from jaxpar._text import render_table
from jaxpar.analysis._overlap import OverlapReport, dims, overlap

ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""

# ------------------------------------------------------------------------------ GPU start / done pairs
GPU = ADD + """
%mm (p0: f32[8,32], p1: f32[32,16]) -> f32[8,16] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[1,32], x: f32[8,32], w: f32[32,16], g: f32[64]) -> f32[8,16] {
  %a = f32[1,32]{1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %g = f32[64]{0} parameter(3)
  %ars = f32[64]{0} all-reduce-start(%g), replica_groups={{0,1}}, to_apply=%add
  %ags = (f32[1,32]{1,0}, f32[2,32]{1,0}) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
  %f = f32[8,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%mm
  %b = f32[16,8]{0,1} bitcast(%f)
  %n = f32[8,16]{1,0} negate(%b)
  %agd = f32[2,32]{1,0} all-gather-done(%ags)
  %ard = f32[64]{0} all-reduce-done(%ars)
  %cps = (f32[64]{0}, f32[64]{0}) collective-permute-start(%ard), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  ROOT %ar = f32[8,16]{1,0} all-reduce(%n), replica_groups={{0,1}}, to_apply=%add
}
"""


def test_gpu_pairs_count_what_lies_between():
    r = overlap(GPU)
    got = [(a.kind, a.collective, a.start, a.done, a.instructions, a.flops, a.bytes) for a in r.asynchronous]
    assert got == [
        ("all-reduce", "ars", "ars", "ard", 4, 8192.0, 256),      # ags, f, n, agd (the bitcast is bookkeeping)
        ("all-gather", "ags", "ags", "agd", 2, 8192.0, 256),      # f (its dot: 2 x 8 x 16 x 32), n
        ("collective-permute", "cps", "cps", "cpd", 0, 0.0, 256),
    ]
    assert [(s.kind, s.name, s.bytes, s.runs) for s in r.synchronous] == [("all-reduce", "ar", 512, 1)]
    assert [a.start for a in r.exposed] == ["cps"]
    # the fusion's dot runs under two collectives at once: counted once
    assert (r.step_flops, r.overlapped_flops, r.overlapped_fraction) == (8192.0, 8192.0, 1.0)
    assert (r.hidden_bytes, r.exposed_bytes) == (512, 256 + 512)


def overlap_table(report: OverlapReport) -> str:
    """One row per collective (synchronous ones: ``sync``), then the totals."""
    rows = [[a.kind, "async", a.computation, f"{a.runs:g}", format_bytes(a.bytes), str(a.instructions),
             f"{a.flops / 1e9:.3g}"] for a in report.asynchronous]
    rows += [[s.kind, "sync", s.computation, f"{s.runs:g}", format_bytes(s.bytes), "-", "-"]
             for s in report.synchronous]
    table = render_table(["kind", "mode", "computation", "runs", "bytes", "instrs under", "GFLOPs under"], rows,
                         right=[False, False, False, True, True, True, True])
    return (f"{table}\noverlapped: {report.overlapped_flops / 1e9:.3g} of {report.step_flops / 1e9:.3g} GFLOPs "
            f"({report.overlapped_fraction:.0%}); {len(report.exposed)} of {len(report.asynchronous)} async "
            f"collectives have no FLOPs under them")


def test_the_table_lists_every_collective_and_the_totals():
    text = overlap_table(overlap(GPU))
    lines = text.splitlines()
    assert lines[0].split() == ["kind", "|", "mode", "|", "computation", "|", "runs", "|", "bytes", "|", "instrs",
                                "under", "|", "GFLOPs", "under"]
    assert [ln.split("|")[1].strip() for ln in lines[2:6]] == ["async", "async", "async", "sync"]
    assert lines[-1] == ("overlapped: 8.19e-06 of 8.19e-06 GFLOPs (100%); 1 of 3 async collectives have no FLOPs "
                         "under them")


# ------------------------------------------------------------------------------ while loops
def _loop(trip_config: str, window_around_loop: bool, condition: str = "compare(%qi, %limit), direction=LT") -> str:
    before, after = ("  %ags = (f32[1,32]{1,0}, f32[2,32]{1,0}) all-gather-start(%a), replica_groups={{0,1}}, "
                     "dimensions={0}\n", "  %agd = f32[2,32]{1,0} all-gather-done(%ags)\n")
    loop = f"  %loop = (s32[], f32[8,32]{{1,0}}, f32[32,16]{{1,0}}) while(%t), condition=%cond, body=%body{trip_config}\n"
    middle = before + loop + after if window_around_loop else loop + before + after
    return ADD + """
%body (p: (s32[], f32[8,32], f32[32,16])) -> (s32[], f32[8,32], f32[32,16]) {
  %p = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %bx = f32[8,32]{1,0} get-tuple-element(%p), index=1
  %bw = f32[32,16]{1,0} get-tuple-element(%p), index=2
  %ars = f32[32,16]{1,0} all-reduce-start(%bw), replica_groups={{0,1}}, to_apply=%add
  %d1 = f32[8,16]{1,0} dot(%bx, %bw), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ard = f32[32,16]{1,0} all-reduce-done(%ars)
  %d2 = f32[8,16]{1,0} dot(%bx, %ard), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%next, %bx, %ard)
}

%cond (q: (s32[], f32[8,32], f32[32,16])) -> pred[] {
  %q = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %qi = s32[] get-tuple-element(%q), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] """ + condition + """
}

ENTRY %main (a: f32[1,32], x: f32[8,32], w: f32[32,16]) -> f32[2,32] {
  %a = f32[1,32]{1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %t = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%start, %x, %w)
""" + middle + "  ROOT %res = f32[2,32]{1,0} negate(%agd)\n}\n"


@pytest.mark.parametrize("trip_config, trips", [
    ("", 3),                                                         # read from the condition (libtpu's form)
    (', backend_config={"known_trip_count":{"n":"5"}}', 5),          # XLA's own count wins
])
def test_loops_count_their_trips(trip_config, trips):
    r = overlap(_loop(trip_config, window_around_loop=True))
    body, entry = r.asynchronous
    assert (body.kind, body.computation, body.runs, body.instructions, body.flops) == ("all-reduce", "body", trips, 1,
                                                                                       8192.0)
    # the whole loop runs under the entry's all-gather: both dots, every trip
    assert (entry.computation, entry.runs, entry.instructions, entry.flops) == ("main", 1, 1, trips * 2 * 8192.0)
    assert r.step_flops == r.overlapped_flops == trips * 2 * 8192.0


@pytest.mark.parametrize("condition, trips", [
    ("compare(%limit, %qi), direction=GT", 3), ("compare(%qi, %limit), direction=LE", 4),
    ("compare(%limit, %qi), direction=GE", 4), ("compare(%qi, %limit), direction=NE", 1),     # NE: not read
])
def test_the_condition_may_be_written_either_way(condition, trips):
    assert overlap(_loop("", True, condition)).step_flops == trips * 2 * 8192.0


def test_a_loop_outside_a_window_counts_only_what_its_own_windows_cover():
    r = overlap(_loop("", window_around_loop=False))
    assert [a.flops for a in r.asynchronous] == [8192.0, 0.0]
    assert (r.step_flops, r.overlapped_flops, r.overlapped_fraction) == (6 * 8192.0, 3 * 8192.0, 0.5)


def test_a_loop_whose_trips_cannot_be_read_runs_once():
    text = _loop("", window_around_loop=False).replace("%start = s32[] copy(%zero)", "%start = s32[] add(%zero, %zero)")
    assert overlap(text).step_flops == 2 * 8192.0


CALLS = """HloModule m
%mm (p0: f32[8,32], p1: f32[32,16]) -> f32[8,16] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%mm2 (p2: f32[8,32], p3: f32[32,16]) -> f32[8,16] {
  %p2 = f32[8,32]{1,0} parameter(0)
  %p3 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.2 = f32[8,16]{1,0} dot(%p2, %p3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,32], w: f32[32,16]) -> f32[8,16] {
  %x = f32[8,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %c = f32[8,16]{1,0} call(%x, %w), to_apply=%mm
  %st = ((f32[8,32]{1,0}, f32[32,16]{1,0}), f32[8,16]{1,0}, s32[]) async-start(%x, %w), calls=%mm2
  ROOT %dn = f32[8,16]{1,0} async-done(%st), calls=%mm2
}
"""


def test_a_call_and_async_compute_count_their_computation_once():
    r = overlap(CALLS)
    assert (r.step_flops, r.asynchronous, r.synchronous) == (2 * 8192.0, (), ())    # async compute is no collective


# ------------------------------------------------------------------------------ async wrappers
WRAPPED = ADD + """
%wrapped_rs (q: f32[8,4]) -> f32[1,4] {
  %q = f32[8,4]{1,0} parameter(0)
  ROOT %rs = f32[1,4]{1,0} reduce-scatter(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (g: f32[8,4], x: f32[8,32], w: f32[32,16]) -> f32[1,4] {
  %g = f32[8,4]{1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %st = ((f32[8,4]{1,0}), f32[1,4]{1,0}) async-start(%g), calls=%wrapped_rs
  %up = ((f32[8,4]{1,0}), f32[1,4]{1,0}) async-update(((f32[8,4]{1,0}), f32[1,4]{1,0}) %st), calls=%wrapped_rs
  %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %dn = f32[1,4]{1,0} async-done(((f32[8,4]{1,0}), f32[1,4]{1,0}) %up), calls=%wrapped_rs
}
"""


def test_async_wrappers_pair_through_their_updates():
    r = overlap(WRAPPED)
    assert [(a.kind, a.collective, a.start, a.done, a.instructions, a.flops, a.bytes) for a in r.asynchronous] == [
        ("reduce-scatter", "rs", "st", "dn", 2, 8192.0, 16)]
    assert r.synchronous == ()                      # the wrapped reduce-scatter is the async one


# ------------------------------------------------------------------------------ libtpu's async collective fusions
TPU = ADD + """
%start_comp (s0: bf16[64,256]) -> (bf16[64,256], bf16[512,256], u32[]) {
  %s0 = bf16[64,256]{1,0} parameter(0)
  %ag.1 = bf16[512,256]{1,0} all-gather(%s0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %cc.1 = (bf16[64,256]{1,0}, bf16[512,256]{1,0}, u32[]) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%cont_comp (c0: bf16[64,256], c1: f32[8,32], c2: f32[32,16]) -> (f32[8,16], bf16[512,256]) {
  %c0 = bf16[64,256]{1,0} parameter(0)
  %c1 = f32[8,32]{1,0} parameter(1)
  %c2 = f32[32,16]{1,0} parameter(2)
  %ag.2 = bf16[512,256]{1,0} all-gather(%c0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %conv = f32[8,16]{1,0} convolution(%c1, %c2), dim_labels=bf_io->bf
  ROOT %ct = (f32[8,16]{1,0}, bf16[512,256]{1,0}) tuple(%conv, %ag.2)
}

%done_comp (d0: bf16[64,256], d1: bf16[512,256]) -> bf16[512,256] {
  %d0 = bf16[64,256]{1,0} parameter(0)
  %d1 = bf16[512,256]{1,0} parameter(1)
  %ag.3 = bf16[512,256]{1,0} all-gather(%d0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %cc.2 = bf16[512,256]{1,0} custom-call(%d1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

%ars_comp (o0: f32[512,256]) -> f32[64,256] {
  %o0 = f32[512,256]{1,0} parameter(0)
  %ar.9 = f32[512,256]{1,0} all-reduce(%o0), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %off = s32[] constant(0)
  ROOT %ds = f32[64,256]{1,0} dynamic-slice(%ar.9, %off, %off), dynamic_slice_sizes={64,256}
}

ENTRY %main (e0: bf16[64,256], x: f32[8,32], w: f32[32,16], g: f32[512,256]) -> bf16[512,256] {
  %e0 = bf16[64,256]{1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %g = f32[512,256]{1,0} parameter(3)
  %async-collective-start = (bf16[64,256]{1,0}, bf16[512,256]{1,0}, u32[]) fusion(%e0), kind=kCustom, calls=%start_comp
  %g0 = bf16[64,256]{1,0} get-tuple-element(%async-collective-start), index=0
  %fusion.404 = (f32[8,16]{1,0}, bf16[512,256]{1,0}) fusion(%g0, %x, %w), kind=kOutput, calls=%cont_comp
  %g1 = bf16[512,256]{1,0} get-tuple-element(%fusion.404), index=1
  %fusion.8 = f32[64,256]{1,0} fusion(%g), kind=kLoop, calls=%ars_comp
  ROOT %async-collective-done = bf16[512,256]{1,0} fusion(%g0, %g1), kind=kCustom, calls=%done_comp
}
"""


def test_tpu_async_collective_fusions_pair_by_channel():
    r = overlap(TPU)
    assert [(a.kind, a.collective, a.start, a.done, a.instructions, a.flops, a.bytes) for a in r.asynchronous] == [
        ("all-gather", "ag.1", "async-collective-start", "async-collective-done", 2, 8192.0, 512 * 256 * 2)]
    # the continuation and the done carry the same all-gather: only the other channel's all-reduce is synchronous
    assert [(s.kind, s.name, s.computation) for s in r.synchronous] == [("all-reduce", "ar.9", "ars_comp")]


# ------------------------------------------------------------------------------ FLOPs
def _flops(shapes: dict[str, str], out: str, op: str) -> float:
    params = "\n".join(f"  %{n} = {s} parameter({i})" for i, (n, s) in enumerate(shapes.items()))
    sig = ", ".join(f"{n}: {s.split('{')[0]}" for n, s in shapes.items())
    return overlap(f"HloModule m\nENTRY %main ({sig}) -> {out} {{\n{params}\n  ROOT %res = {out} {op}\n}}\n").step_flops


@pytest.mark.parametrize("shapes, out, op, flops", [
    ({"l": "f32[4,8,32]{2,1,0}", "r": "f32[4,32,16]{2,1,0}"}, "f32[4,8,16]{2,1,0}",
     "dot(%l, %r), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}",
     2 * 4 * 8 * 16 * 32),
    ({"l": "f32[8,32]{1,0}", "r": "f32[16,32]{1,0}"}, "f32[8,16]{1,0}",
     "dot(%l, %r), lhs_contracting_dims={1}, rhs_contracting_dims={1}", 2 * 8 * 16 * 32),
    # a padded 1-D convolution: 4 outputs x 3 taps, 2 of them on padding -> 10 (position, tap) pairs
    ({"l": "f32[2,4,3]{2,1,0}", "r": "f32[3,3,5]{2,1,0}"}, "f32[2,4,5]{2,1,0}",
     "convolution(%l, %r), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f", 2 * (2 * 5) * 3 * 10),
    # input dilated by 2 ([x0, 0, x1, 0, x2]): each of the 4 windows of 2 holds one input
    ({"l": "f32[1,3,1]{2,1,0}", "r": "f32[2,1,1]{2,1,0}"}, "f32[1,4,1]{2,1,0}",
     "convolution(%l, %r), window={size=2 lhs_dilate=2}, dim_labels=b0f_0io->b0f", 2 * 4),
    # stride 2 over 5 inputs: 2 outputs x 2 taps
    ({"l": "f32[1,5,1]{2,1,0}", "r": "f32[2,1,1]{2,1,0}"}, "f32[1,2,1]{2,1,0}",
     "convolution(%l, %r), window={size=2 stride=2}, dim_labels=b0f_0io->b0f", 2 * 4),
    # libtpu's matmul as a convolution with a spatial dimension of size 2 and a window of 1
    ({"l": "f32[2,256,512]{2,1,0}", "r": "f32[2048,512,1]{2,1,0}"}, "f32[2,256,2048]{2,1,0}",
     "convolution(%l, %r), window={size=1}, dim_labels=0bf_oi0->0bf", 2 * 2 * 256 * 2048 * 512),
    ({"l": "f32[8,32]{1,0}", "r": "f32[32,16]{1,0}"}, "(f32[8,16]{1,0}, s8[1024]{0})",
     'custom-call(%l, %r), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{'
     '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
     '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}', 2 * 8 * 16 * 32),
    ({"l": "f32[8,32]{1,0}", "r": "f32[32,16]{1,0}"}, "f32[8,32]{1,0}",
     'custom-call(%l, %r), custom_call_target="Sharding"', 0),
    ({"l": "f32[8,32]{1,0}", "r": "f32[8,32]{1,0}"}, "f32[8,32]{1,0}", "multiply(%l, %r)", 0),
])
def test_flops(shapes, out, op, flops):
    assert _flops(shapes, out, op) == flops


def test_an_operand_without_a_shape_is_named():
    with pytest.raises(ValueError, match=r"convolution 'res': operand 1 has no known shape in the HLO text"):
        overlap("HloModule m\nENTRY %main (l: f32[2,8]) -> f32[2,8] {\n  %l = f32[2,8]{1,0} parameter(0)\n"
                "  ROOT %res = f32[2,8]{1,0} convolution(%l, %nowhere), dim_labels=bf_io->bf\n}\n")


def test_dims():
    assert dims("bf16[4,1,2,256]{3,2,1,0:T(8,128)(2,1)S(1)}") == [4, 1, 2, 256]
    assert dims("(f32[<=8,3]{1,0}, s32[])") == [8, 3]
    with pytest.raises(ValueError, match="has no array"):
        dims("token")


# ------------------------------------------------------------------------------ compiled programs
ROOT = Path(__file__).resolve().parents[1]


def _compiled(devices, *overrides):
    """The quickstart GPT (2 layers) train step on 8 devices of data parallelism, compiled for ``devices``."""
    from jaxpar.config import load_config
    from jaxpar.config import build_job

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["train.devices=0", "model.layers=2", "mesh.data=8",
                                                            "mesh.fsdp=1", "mesh.tensor=1", *overrides])
    job = build_job(cfg, devices, data=False)
    layout = job.state_layout()
    per_device = job.log_options(layout, None).flops_per_token * job.global_batch * job.seq_len / 8
    return job.compile(layout)["step"], per_device


def test_xla_cpu_makes_every_collective_synchronous():
    compiled, gpt_flops = _compiled(jax.devices()[:8])
    r = overlap(compiled)
    assert r.asynchronous == () and r.overlapped_flops == 0
    assert [(s.kind, s.runs) for s in r.synchronous if s.runs > 1] == [("all-reduce", 2)]    # the layers' gradients
    assert r.step_flops == pytest.approx(gpt_flops, rel=0.01)        # the GPT's 6N + attention, per device


def _target(name):
    from jaxpar.devices import parse_target, target_devices

    return target_devices(parse_target(name))


@pytest.mark.exhaustive
def test_an_h100_step_overlaps_the_layers_gradient_all_reduce_with_their_backward():
    compiled, gpt_flops = _compiled(_target("h100:1x8"))
    r = overlap(compiled)
    assert r.synchronous == ()                                        # the GPU compiler makes every one async
    in_loop = [a for a in r.asynchronous if a.runs == 2]
    assert [a.kind for a in in_loop] == ["all-reduce"] and in_loop[0].instructions > 0
    assert 0 < in_loop[0].flops < r.step_flops / 2                     # a part of one layer's backward
    assert r.overlapped_flops == pytest.approx(sum(a.flops * a.runs for a in r.asynchronous))
    assert 0 < r.overlapped_fraction < 0.5
    assert r.step_flops == pytest.approx(gpt_flops, rel=0.01)


def test_a_tpu_step_counts_its_layer_loop_from_the_condition():
    """libtpu writes no known_trip_count: the layer loops' 2 trips are read from the loops themselves
    (jaxpar.analysis._loops.while_trip_counts, which overlap uses)."""
    from jaxpar.analysis import while_trip_counts

    compiled, gpt_flops = _compiled(_target("tpu-v5e:2x4"))
    text = compiled.as_text()
    assert "known_trip_count" not in text
    assert sorted(while_trip_counts(text).values()) == [2, 2]          # the forward and the backward scan
    r = overlap(compiled)
    assert sorted(s.runs for s in r.synchronous if s.kind == "all-reduce")[-1] == 2
    assert r.step_flops == pytest.approx(gpt_flops, rel=0.01)        # libtpu's convolutions count as the dots
