"""Collectives inside device-dependent branches (jaxpar.analysis._device_branches).

Hand-written HLO pins each rule of the taint analysis (tuples, loops, both conditional forms, calls,
async pairs, uniform collectives); jitted ``shard_map`` programs check it on XLA:CPU's HLO; the GPT's
train step checks the pipeline programs: the lockstep program of sequence parallelism (pipe2 x data2
x tensor2, 1F1B) has none, the per-stage program has some, all over axes inside one stage. The slow
tests compile the bf16 sequence-parallel step for an H100 and a TPU v5e target (deviceless) and check
the same there, printing each program's peak memory (``pytest -m exhaustive -s``).
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis import BranchCollective, device_dependent_collectives
from jaxpar.analysis._device_branches import _analyse, _any, _dependent
from jaxpar.analysis._hlo_text import module_text
from jaxpar.analysis import collectives
from jaxpar.batch import batch_sharding
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.devices import parse_target, target_devices

from conftest import need_devices
from helpers import compile_step

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%reduce (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
}
%skip (q: f32[4]) -> f32[4] {
  ROOT %q = f32[4]{0} parameter(0)
}
"""


def taints(compiled_or_text) -> dict:
    """``{instruction name: taint}`` of every value derived (in part) from ``partition-id`` / ``replica-id``."""
    return {k: v for k, v in _analyse(module_text(compiled_or_text)).taint.items() if _any(v)}


def device_dependent_conditionals(compiled_or_text) -> list[str]:
    """The ``conditional`` (and ``while``) instructions whose branch index (condition) depends on the device."""
    return [i.name for i, _ in _dependent(_analyse(module_text(compiled_or_text)))]


def _module(*computations: str) -> str:
    return "HloModule m, num_partitions=4\n" + ADD + "\n".join(computations)


def _names(found):
    return sorted(f.name for f in found)


# ----------------------------------------------------------------------------- rules, on hand-written HLO
def test_a_branch_index_from_the_partition_id_makes_its_branches_collectives_device_dependent():
    hlo = _module("""ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %id = u32[] partition-id()
  %idx = s32[] convert(%id)
  ROOT %c = f32[4]{0} conditional(%idx, %x, %x), branch_computations={%skip, %reduce}
}""")
    assert device_dependent_collectives(hlo) == [BranchCollective("ar", "all-reduce", "c", "reduce", "reduce")]
    assert device_dependent_conditionals(hlo) == ["c"]


def test_a_hoisted_stage_index_taints_only_its_element_of_the_loop_tuple():
    """partition-id is loop-invariant, hoisted into element 1 of the while tuple; the conditional on
    the counter (element 0) is the same everywhere, the one on element 1 is not."""
    hlo = _module("""%body (t: (s32[], s32[], f32[4])) -> (s32[], s32[], f32[4]) {
  %t = (s32[], s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %stage = s32[] get-tuple-element(%t), index=1
  %x = f32[4]{0} get-tuple-element(%t), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %by_tick = f32[4]{0} conditional(%i, %x, %x), branch_computations={%skip, %reduce}
  %by_stage = f32[4]{0} conditional(%stage, %by_tick, %by_tick), branch_computations={%skip, %reduce.2}
  ROOT %out = (s32[], s32[], f32[4]{0}) tuple(%next, %stage, %by_stage)
}
%reduce.2 (p2: f32[4]) -> f32[4] {
  %p2 = f32[4]{0} parameter(0)
  ROOT %ar2 = f32[4]{0} all-reduce(%p2), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
}
%cond (c: (s32[], s32[], f32[4])) -> pred[] {
  %c = (s32[], s32[], f32[4]{0}) parameter(0)
  %n = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%n, %three), direction=LT
}
ENTRY %main (x0: f32[4]) -> f32[4] {
  %x0 = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %id = u32[] partition-id()
  %stage0 = s32[] convert(%id)
  %init = (s32[], s32[], f32[4]{0}) tuple(%zero, %stage0, %x0)
  %w = (s32[], s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=2
}""")
    assert _names(device_dependent_collectives(hlo)) == ["ar2"]
    t = taints(hlo)
    assert t["init"] == (False, True, False) and t["w"] == (False, True, True) and "i" not in t


def test_taint_that_reaches_the_loop_counter_only_through_the_body_is_found_at_the_fixed_point():
    """Iteration 1 adds the stage index into element 1, iteration 2 passes it to element 0."""
    hlo = _module("""%body (t: (s32[], s32[])) -> (s32[], s32[]) {
  %t = (s32[], s32[]) parameter(0)
  %a = s32[] get-tuple-element(%t), index=0
  %b = s32[] get-tuple-element(%t), index=1
  %id = u32[] partition-id()
  %s = s32[] convert(%id)
  %b2 = s32[] add(%a, %s)
  ROOT %out = (s32[], s32[]) tuple(%b, %b2)
}
%cond (c: (s32[], s32[])) -> pred[] {
  %c = (s32[], s32[]) parameter(0)
  ROOT %k = pred[] constant(true)
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], s32[]) tuple(%zero, %zero)
  %w = (s32[], s32[]) while(%init), condition=%cond, body=%body
  %first = s32[] get-tuple-element(%w), index=0
  ROOT %r = f32[4]{0} conditional(%first, %x, %x), branch_computations={%skip, %reduce}
}""")
    assert _names(device_dependent_collectives(hlo)) == ["ar"]


def test_the_gpu_predicate_form_passes_operand_1_to_the_true_branch():
    """``conditional(p, a, b), true_computation=T, false_computation=F``: T gets a, F gets b. Only the
    branch given the stage index holds a device-dependent inner conditional."""
    hlo = _module("""%inner (s: s32[]) -> f32[4] {
  %s = s32[] parameter(0)
  %z = f32[4]{0} constant({0,0,0,0})
  ROOT %ic = f32[4]{0} conditional(%s, %z, %z), branch_computations={%skip, %reduce}
}
%inner.2 (s2: s32[]) -> f32[4] {
  %s2 = s32[] parameter(0)
  %z2 = f32[4]{0} constant({0,0,0,0})
  ROOT %ic2 = f32[4]{0} conditional(%s2, %z2, %z2), branch_computations={%skip, %reduce.2}
}
%reduce.2 (p2: f32[4]) -> f32[4] {
  %p2 = f32[4]{0} parameter(0)
  ROOT %ar2 = f32[4]{0} all-reduce(%p2), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
}
ENTRY %main (k: pred[]) -> f32[4] {
  %k = pred[] parameter(0)
  %id = u32[] partition-id()
  %stage = s32[] convert(%id)
  %tick = s32[] constant(1)
  ROOT %c = f32[4]{0} conditional(%k, %tick, %stage), true_computation=%inner, false_computation=%inner.2
}""")
    assert device_dependent_collectives(hlo) == [BranchCollective("ar2", "all-reduce", "ic2", "reduce.2", "reduce.2")]


def test_fusions_and_async_pairs_in_a_branch_count_once_each():
    hlo = _module("""%fused (f: f32[4]) -> f32[4] {
  %f = f32[4]{0} parameter(0)
  ROOT %ag = f32[4]{0} all-gather(%f), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
}
%act (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %start = f32[4]{0} all-reduce-start(%x), channel_id=4, replica_groups={{0,2},{1,3}}, to_apply=%add
  %done = f32[4]{0} all-reduce-done(%start)
  ROOT %fu = f32[4]{0} fusion(%done), kind=kCustom, calls=%fused
}
ENTRY %main (y: f32[4]) -> f32[4] {
  %y = f32[4]{0} parameter(0)
  %id = u32[] partition-id()
  %two = u32[] constant(2)
  %half = pred[] compare(%id, %two), direction=LT
  ROOT %c = f32[4]{0} conditional(%half, %y, %y), true_computation=%act, false_computation=%skip
}""")
    found = device_dependent_collectives(hlo)
    assert [(f.name, f.kind, f.computation, f.branch) for f in found] == [
        ("ag", "all-gather", "fused", "act"), ("start", "all-reduce", "act", "act")]


@pytest.mark.parametrize("groups, dependent", [("{}", False), ("{{0,1,2,3}}", False), ("[1,4]<=[4]", False),
                                               ("{{0,1},{2,3}}", True)])
def test_an_all_reduce_over_every_device_gives_every_device_the_same_value(groups, dependent):
    hlo = _module(f"""ENTRY %main (x: f32[4]) -> f32[4] {{
  %x = f32[4]{{0}} parameter(0)
  %id = u32[] partition-id()
  %f = f32[] convert(%id)
  %sum = f32[] all-reduce(%f), channel_id=5, replica_groups={groups}, to_apply=%add
  %one = f32[] constant(1)
  %p = pred[] compare(%sum, %one), direction=GT
  ROOT %c = f32[4]{{0}} conditional(%p, %x, %x), true_computation=%reduce, false_computation=%skip
}}""")
    assert bool(device_dependent_collectives(hlo)) == dependent


def test_a_while_whose_condition_depends_on_the_device_is_device_dependent():
    hlo = _module("""%body (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %ar3 = f32[4]{0} all-reduce(%b), channel_id=6, replica_groups={{0,1,2,3}}, to_apply=%add
}
%cond (c: f32[4]) -> pred[] {
  %c = f32[4]{0} parameter(0)
  %id = u32[] partition-id()
  %one = u32[] constant(1)
  ROOT %lt = pred[] compare(%id, %one), direction=LT
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%x), condition=%cond, body=%body
}""")
    assert device_dependent_collectives(hlo) == [BranchCollective("ar3", "all-reduce", "w", "body", "body")]


def test_anything_but_a_compiled_program_or_text_is_named():
    with pytest.raises(jaxpar.AnalysisError, match="or its HLO text .*, got int"):
        device_dependent_collectives(3)


# ----------------------------------------------------------------------------- jitted programs on XLA:CPU
def _compiled_shard_map(body):
    mesh = jax.make_mesh((2, 4), ("pipe", "data"), devices=jax.devices()[:8])
    f = jax.shard_map(lambda x: lax.scan(body, x, jnp.arange(4))[0], mesh=mesh, in_specs=P("pipe", "data"),
                      out_specs=P("pipe", "data"), check_vma=False)
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("pipe", "data")))
    return mesh, jax.jit(f).lower(x).compile()


@need_devices(8)
def test_a_cond_on_the_stage_index_is_found_and_a_cond_on_the_tick_is_not():
    """``lax.cond(axis_index('pipe') == 0, psum over data)`` in a scan: its all-reduce is found; the
    same cond on the scanned tick (the same on every device) is not."""
    def body(x, tick):
        x = lax.cond(lax.axis_index("pipe") == 0, lambda v: lax.psum(v, "data"), lambda v: v * 2, x)
        x = lax.cond(tick % 2 == 0, lambda v: lax.psum(v, "data") + 1, lambda v: v + 1, x)
        return x, None

    mesh, compiled = _compiled_shard_map(body)
    found = device_dependent_collectives(compiled)
    assert [f.kind for f in found] == ["all-reduce"], found
    axes = {c.name: c.axes for c in collectives(compiled, mesh)}
    assert axes[found[0].name] == ("data",) and len(axes) == 2      # the tick's psum: not in the list


@need_devices(8)
def test_a_stage_index_summed_over_every_device_is_the_same_everywhere():
    """psum over both axes makes a device's index uniform; over ``data`` alone it stays per stage."""
    def body(x, tick):
        everywhere = lax.psum(lax.axis_index("pipe"), ("pipe", "data"))
        per_stage = lax.psum(lax.axis_index("pipe"), "data")
        x = lax.cond(everywhere + tick > 2, lambda v: lax.psum(v, "data"), lambda v: v * 2, x)
        x = lax.cond(per_stage + tick > 2, lambda v: lax.psum(v, "data") * 3, lambda v: v * 4, x)
        return x, None

    _, compiled = _compiled_shard_map(body)
    assert len(device_dependent_conditionals(compiled)) == 1
    assert len(device_dependent_collectives(compiled)) == 1


# ----------------------------------------------------------------------------- the GPT's pipelines on the CPU mesh
MESH = {"pipe": 2, "data": 2, "tensor": 2}


def _report(label, compiled, mesh):
    """Print and return the device-dependent collectives by (kind, axes)."""
    axes = {c.name: c.axes for c in collectives(compiled, mesh)}
    found = device_dependent_collectives(compiled)
    by = Counter((f.kind, axes.get(f.name)) for f in found)
    print(f"{label}: {len(found)} collectives in device-dependent branches "
          f"({len(device_dependent_conditionals(compiled))} conditionals): {dict(by)}")
    return found, axes


@need_devices(8)
def test_the_lockstep_program_of_sequence_parallelism_has_no_device_dependent_collective():
    """pipe2 x data2 x tensor2, SP, 1F1B on 4 micro-batches: every conditional branches on the tick's
    kind, so no conditional is device-dependent at all."""
    mesh, _, compiled = compile_step(MESH, jaxpar.Strategy(sequence_parallel=True, microbatches=4))
    found, axes = _report("cpu lockstep (SP)", compiled, mesh)
    assert found == [] and device_dependent_conditionals(compiled) == []
    assert any(a == ("pipe",) for a in axes.values())               # it is a pipeline


@need_devices(8)
@pytest.mark.exhaustive
def test_the_per_stage_program_has_collectives_inside_its_stage_branches():
    """Without SP the pipeline runs the per-stage program (one cond per action on the stage index):
    measured 17, the tensor all-reduces of the blocks and the data-axis reduction / gathers of a stage's
    own weights. None spans ``pipe``: each group lies within one stage, whose devices all take the
    same branch (the predicate depends on the stage only), which is why this program runs."""
    mesh, _, compiled = compile_step(MESH, jaxpar.Strategy(microbatches=4))
    found, axes = _report("cpu per-stage (no SP)", compiled, mesh)
    assert found and device_dependent_conditionals(compiled)
    assert all(axes[f.name] is not None and "pipe" not in axes[f.name] for f in found), found
    assert {axes[f.name] for f in found} >= {("tensor",), ("data",)}


# ----------------------------------------------------------------------------- deviceless targets (exhaustive)
TARGET_CFG = GPTConfig(vocab=256, seq_len=64, embed=128, heads=8, layers=4)
TARGET_BATCH = 32
LAYOUTS = {"pipe2xdata2xtensor4": {"pipe": 2, "data": 2, "tensor": 4}, "data4xtensor4": {"data": 4, "tensor": 4}}


def _target_step(target: str, sizes: dict, sequence_parallel: bool = True):
    """Mesh and compiled bf16 train step of TARGET_CFG on ``target`` (1F1B, 4 micro-batches with a pipe)."""
    mesh = jaxpar.make_mesh(sizes, devices=target_devices(parse_target(target)))
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", sequence_parallel=sequence_parallel, schedule="1f1b",
                               microbatches=4 if sizes.get("pipe", 1) > 1 else 1)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    layout = jaxpar.state_layout(lambda: GPT(TARGET_CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
    spec = jax.ShapeDtypeStruct((TARGET_BATCH, TARGET_CFG.seq_len), jnp.int32, sharding=batch_sharding(mesh))
    return mesh, step.lower(layout.abstract_state(), {"tokens": spec, "targets": spec}).compile()


def _over(colls, kind, axis):
    return [c for c in colls if c.kind == kind and c.axes == (axis,)]


@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("target", ["h100:2x8", "tpu-v5e:4x4"])
def test_bf16_sequence_parallelism_on_targets_has_no_device_dependent_collective(target, layout):
    """SP's gathers and scatters over ``tensor``, the pipeline's permutes over ``pipe``, and no collective
    inside a device-dependent branch; prints the peak memory per device."""
    sizes = LAYOUTS[layout]
    mesh, compiled = _target_step(target, sizes)
    colls = collectives(compiled, mesh)
    found, _ = _report(f"{target} {layout} bf16 SP", compiled, mesh)
    print(f"{target} {layout} bf16 SP: peak {compiled.memory_analysis().peak_memory_in_bytes} bytes per device; "
          f"collectives {dict(Counter((c.kind, c.axes) for c in colls))}")
    assert found == [], found
    assert _over(colls, "all-gather", "tensor"), colls
    assert _over(colls, "reduce-scatter", "tensor") or _over(colls, "all-reduce", "tensor"), colls
    if "pipe" in sizes:
        assert _over(colls, "collective-permute", "pipe"), colls


@pytest.mark.exhaustive
@pytest.mark.parametrize("target", ["h100:2x8", "tpu-v5e:4x4"])
def test_the_per_stage_program_is_found_in_the_gpu_and_tpu_compilers_hlo(target):
    """The analysis reads the GPU compiler's predicate conditionals and async pairs and libtpu's HLO:
    the bf16 per-stage program (no SP) has collectives in its stage branches, none over ``pipe``."""
    mesh, compiled = _target_step(target, LAYOUTS["pipe2xdata2xtensor4"], sequence_parallel=False)
    found, axes = _report(f"{target} pipe2xdata2xtensor4 bf16 per-stage", compiled, mesh)
    print(f"{target} per-stage: peak {compiled.memory_analysis().peak_memory_in_bytes} bytes per device")
    assert found and all(axes.get(f.name) is not None and "pipe" not in axes[f.name] for f in found), found
