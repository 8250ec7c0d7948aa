"""How often each computation runs (jaxpar.analysis._loops) and the pipelined step's bytes per axis
(jaxpar.analysis._axis_bytes): while loops' trip counts read from the loop when the compiler writes none
(libtpu), the GPU compiler's predicate conditionals in the branch order of ``lax.cond``, then real
programs compiled for TPU and GPU targets (deviceless, seconds each)."""
from __future__ import annotations

import re

import jax
import pytest

from jaxpar.analysis import trip_counts, while_trip_counts
from jaxpar.strategy import Strategy

ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def _loop(init: int, limit: int, update: str, compare: str, config: str = "") -> str:
    """A counter loop ``i = init; while i <compare> limit: i = <update>``, with an all-reduce in its body."""
    return "HloModule m\n" + ADD + f"""
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p = (s32[], f32[4]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[4]{{0}} get-tuple-element(%p), index=1
  %ar = f32[4]{{0}} all-reduce(%v), replica_groups={{{{0,1}}}}, to_apply=%add
  %c = s32[] constant(3)
  %next = s32[] {update}
  ROOT %out = (s32[], f32[4]{{0}}) tuple(%next, %ar)
}}

%cond (q: (s32[], f32[4])) -> pred[] {{
  %q = (s32[], f32[4]{{0}}) parameter(0)
  %qi = s32[] get-tuple-element(%q), index=0
  %limit = s32[] constant({limit})
  ROOT %lt = pred[] {compare}
}}

ENTRY %main (a: f32[4]) -> f32[4] {{
  %a = f32[4]{{0}} parameter(0)
  %zero = s32[] constant({init})
  %start = s32[] copy(%zero)
  %t = (s32[], f32[4]{{0}}) tuple(%start, %a)
  %w = (s32[], f32[4]{{0}}) while(%t), condition=%cond, body=%body{config}
  ROOT %res = f32[4]{{0}} get-tuple-element(%w), index=1
}}
"""


@pytest.mark.parametrize("init, limit, update, compare, trips", [
    (0, 12, "add(%i, %c)", "compare(%qi, %limit), direction=LT", 4),         # 0, 3, 6, 9
    (0, 13, "add(%c, %i)", "compare(%qi, %limit), direction=LT", 5),         # 0, 3, 6, 9, 12
    (0, 12, "add(%i, %c)", "compare(%qi, %limit), direction=LE", 5),         # ... 12
    (0, 12, "add(%i, %c)", "compare(%limit, %qi), direction=GT", 4),         # 12 > i
    (12, 0, "subtract(%i, %c)", "compare(%qi, %limit), direction=GT", 4),    # 12, 9, 6, 3
    (12, 0, "subtract(%i, %c)", "compare(%qi, %limit), direction=GE", 5),    # ... 0
    (5, 2, "add(%i, %c)", "compare(%qi, %limit), direction=LT", 0),          # never entered
])
def test_trip_counts_are_read_from_the_loop(init, limit, update, compare, trips):
    text = _loop(init, limit, update, compare)
    assert while_trip_counts(text) == {"w": trips}
    assert trip_counts(text)["body"] == trips


@pytest.mark.parametrize("update, compare", [
    ("copy(%i)", "compare(%qi, %limit), direction=LT"),                 # the counter does not move
    ("subtract(%i, %c)", "compare(%qi, %limit), direction=LT"),         # it moves away from the limit
    ("add(%i, %c)", "compare(%qi, %limit), direction=NE"),
    ("add(%i, %i)", "compare(%qi, %limit), direction=LT"),              # no constant step
])
def test_a_loop_whose_count_cannot_be_read_is_left_out(update, compare):
    text = _loop(0, 12, update, compare)
    assert while_trip_counts(text) == {}
    assert trip_counts(text)["body"] == 1


def test_the_compilers_known_trip_count_wins():
    text = _loop(0, 12, "add(%i, %c)", "compare(%qi, %limit), direction=LT",
                 ', backend_config={"known_trip_count":{"n":"7"}}')
    assert while_trip_counts(text) == {"w": 7}


PREDICATE = "HloModule m\n" + ADD + """
%skip (s: f32[4]) -> f32[4] {
  ROOT %s = f32[4]{0} parameter(0)
}

%act (r: f32[4]) -> f32[4] {
  %r = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%r), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (p: pred[], a: f32[4]) -> f32[4] {
  %p = pred[] parameter(0)
  %a = f32[4]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(%p, %a, %a), true_computation=%act, false_computation=%skip
}
"""


def test_a_predicate_conditional_has_lax_conds_branch_order():
    """The GPU compiler rewrites ``lax.cond``'s index conditional {skip, act} as true=act, false=skip:
    branch weights are given in the index order, so [0.75, 0.25] runs ``act`` a quarter of the time."""
    runs = trip_counts(PREDICATE, {"c": [0.75, 0.25]})
    assert (runs["skip"], runs["act"]) == (0.75, 0.25)
    assert trip_counts(PREDICATE)["act"] == 1                          # no weights: every branch, every time


# ------------------------------------------------------------------------------ compiled programs
def _compile(target: str, strategy=None, **sizes):
    """A 2-layer GPT (width 128, vocab 512, 64 tokens, batch 16) train step compiled for ``target``."""
    from flax import nnx

    from jaxpar.cost import Plan
    from jaxpar.models import GPT, GPTConfig
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.analysis import compile_plan

    cfg = GPTConfig(vocab=512, seq_len=64, embed=128, heads=4, layers=2)
    plan = Plan(**sizes, strategy=strategy or Strategy())
    mesh, compiled = compile_plan(lambda: GPT(cfg, rngs=nnx.Rngs(0)), plan, 16, 64,
                                  devices=target_devices(parse_target(target)))
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    n_params = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return mesh, compiled, plan, n_params


def test_a_tpu_data_parallel_step_reduces_every_gradient_once():
    """libtpu writes no trip count: the layer loop's all-reduce of one layer's gradients counts once per
    layer, so the data axis carries every fp32 gradient once (and the loss)."""
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
    from jaxpar.analysis import collectives

    mesh, compiled, plan, n_params = _compile("tpu-v5e:2x4", data=8)
    assert "known_trip_count" not in compiled.as_text()
    in_loop = [c for c in collectives(compiled, mesh) if c.in_loop]
    assert [(c.kind, c.axes) for c in in_loop] == [("all-reduce", ("data",))]
    assert compiled_bytes_per_axis(compiled, mesh) == {"data": 4 * n_params + 4}


@pytest.mark.exhaustive
@pytest.mark.parametrize("target", ["h100:1x8", "tpu-v5p:2x2x2"])
def test_a_pipelined_step_is_counted_on_gpu_and_tpu(target):
    """1F1B, 2 stages x 4 micro-batches, 10 ticks. The GPU compiler rewrites the tick loop's action
    conditionals as predicate conditionals; libtpu keeps them but writes no trip count. Either way each
    stage runs its forward and its backward on 4 of the 10 ticks, and receives 4 activations of one
    sequence over ``pipe`` (stage 1 forward, stage 0 backward) besides the all-reduce of the outer
    gradients."""
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis, stage_branch_weights
    from jaxpar.analysis import collectives

    mesh, compiled, plan, _ = _compile(target, Strategy(microbatches=4, schedule="1f1b"), pipe=2, data=4)
    if target.startswith("h100"):
        assert re.search(r"conditional\(.*true_computation=", compiled.as_text())
    weights = stage_branch_weights(compiled, mesh, plan)
    assert len(weights) == 2 and all(len(w) == 6 for w in weights), weights    # 2 send switches, 4 action kinds
    for w in weights:   # what this stage receives, its F and B: 4 ticks of 10; its sends, the other stage's kinds: 0
        assert sorted(branches[1] for branches in w.values()) == pytest.approx([0, 0, 0, 0.4, 0.4, 0.4]), w
    outer = sum(c.bytes for c in collectives(compiled, mesh) if c.axes == ("pipe",) and not c.in_loop)
    got = compiled_bytes_per_axis(compiled, mesh, plan)
    assert got["pipe"] == 4 * (64 * 128 * 4) + outer
    assert got["data"] > 0
