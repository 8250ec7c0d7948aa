"""Collective inventory and memory reports of compiled programs on 8 CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis import Collective, collectives, collectives_table, count, summarize
from jaxpar.analysis._hlo import iota_replica_groups, parse_replica_groups, shape_bytes
from jaxpar.analysis import MemoryReport, format_bytes, memory_report, memory_table

from conftest import need_devices

pytestmark = need_devices(8)

F32 = jnp.float32


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def explicit_mesh():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def permuted_mesh():
    devices = np.array(jax.devices())[[3, 1, 7, 0, 5, 2, 6, 4]].reshape(2, 4)
    return jax.sharding.Mesh(devices, ("data", "tensor"))


def arg(mesh, shape, spec, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def compile_shard_map(mesh, fn, in_spec, out_spec, shape=(8, 128)):
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    return jax.jit(mapped).lower(arg(mesh, shape, in_spec)).compile()


def only(colls):
    assert len(colls) == 1, colls
    return colls[0]


# --------------------------------------------------------------------------- shard_map collectives


def test_psum_over_tensor(mesh):
    compiled = compile_shard_map(mesh, lambda x: jax.lax.psum(x, "tensor"), P("data", "tensor"), P("data"))
    c = only(collectives(compiled, mesh))
    assert (c.kind, c.axes, c.bytes, c.in_loop) == ("all-reduce", ("tensor",), 4 * 32 * 4, False)
    assert c.computation and c.name


def test_psum_over_both_axes(mesh):
    compiled = compile_shard_map(mesh, lambda x: jax.lax.psum(x, ("data", "tensor")), P("data", "tensor"), P())
    assert only(collectives(compiled, mesh)).axes == ("data", "tensor")


def test_all_gather_over_data(mesh):
    fn = lambda x: jax.lax.all_gather(x, "data", tiled=True)  # noqa: E731
    c = only(collectives(compile_shard_map(mesh, fn, P("data", "tensor"), P("data", "tensor")), mesh))
    assert (c.kind, c.axes, c.bytes) == ("all-gather", ("data",), 8 * 32 * 4)


def test_psum_scatter_is_reduce_scatter(mesh):
    fn = lambda x: jax.lax.psum_scatter(x, "tensor", scatter_dimension=0, tiled=True)  # noqa: E731
    c = only(collectives(compile_shard_map(mesh, fn, P("data"), P(("data", "tensor"))), mesh))
    assert (c.kind, c.axes, c.bytes) == ("reduce-scatter", ("tensor",), 1 * 128 * 4)


@pytest.mark.parametrize("axis,perm", [("tensor", [(i, (i + 1) % 4) for i in range(4)]), ("data", [(0, 1), (1, 0)])])
def test_ppermute(mesh, axis, perm):
    fn = lambda x: jax.lax.ppermute(x, axis, perm)  # noqa: E731
    c = only(collectives(compile_shard_map(mesh, fn, P("data", "tensor"), P("data", "tensor")), mesh))
    assert (c.kind, c.axes, c.bytes) == ("collective-permute", (axis,), 4 * 32 * 4)


def test_all_to_all(mesh):
    fn = lambda x: jax.lax.all_to_all(x, "tensor", 0, 1, tiled=True)  # noqa: E731
    c = only(collectives(compile_shard_map(mesh, fn, P("data"), P("data", "tensor")), mesh))
    assert (c.kind, c.axes) == ("all-to-all", ("tensor",))
    assert c.bytes == 4 * 128 * 4  # CPU emits a tuple of 4 f32[1,128] pieces; their sum


def test_psum_inside_loops(mesh):
    def body(x):
        x = jax.lax.psum(x, "data")  # outside any loop
        x = jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(jnp.sin(c), "tensor"), x)
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "data"), None), x, None, length=2)[0]

    colls = collectives(compile_shard_map(mesh, body, P("data", "tensor"), P("data", "tensor")), mesh)
    assert sorted((c.axes, c.in_loop) for c in colls) == [(("data",), False), (("data",), True), (("tensor",), True)]
    assert count(colls, "all-reduce", in_loop=True) == 2
    assert {c.computation for c in colls if c.in_loop}.isdisjoint({c.computation for c in colls if not c.in_loop})


# --------------------------------------------------------------------------- SPMD partitioner collectives


def test_matmul_sharded_contraction_auto(mesh):
    f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("data")))
    compiled = f.lower(arg(mesh, (16, 64), P("data", "tensor")), arg(mesh, (64, 32), P("tensor"))).compile()
    c = only(collectives(compiled, mesh))
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("tensor",), 8 * 32 * 4)


def test_matmul_sharded_contraction_explicit(explicit_mesh):
    m = explicit_mesh
    f = jax.jit(lambda a, b: jnp.matmul(a, b, out_sharding=NamedSharding(m, P("data"))))
    compiled = f.lower(arg(m, (16, 64), P("data", "tensor")), arg(m, (64, 32), P("tensor"))).compile()
    assert count(collectives(compiled, m), "all-reduce", axes="tensor") == 1


def test_partitioner_mesh_axes_groups_on_3d_mesh():
    m = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    f = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(m, P()))
    colls = collectives(f.lower(arg(m, (16, 16), P(("a", "c"), "b"))).compile(), m)
    assert sorted((c.kind, c.axes) for c in colls) == [("all-gather", ("a", "c")), ("all-gather", ("b",))]


def test_shard_map_on_explicit_mesh(explicit_mesh):
    compiled = compile_shard_map(explicit_mesh, lambda x: jax.lax.psum(x, "tensor"), P("data", "tensor"), P("data"))
    assert only(collectives(compiled, explicit_mesh)).axes == ("tensor",)


# --------------------------------------------------------------------------- device-id mapping


def test_partition_i_runs_on_mesh_devices_flat_i(permuted_mesh):
    m = permuted_mesh
    shift = [(i, (i + 1) % 4) for i in range(4)]
    compiled = compile_shard_map(m, lambda x: jax.lax.ppermute(x, "tensor", shift), P("data", "tensor"),
                                 P("data", "tensor"), shape=(2, 4))
    assert [d.id for d in compiled.runtime_executable().local_devices()] == [d.id for d in m.devices.flat]
    assert "source_target_pairs={{0,1},{1,2},{2,3},{3,0}" in compiled.as_text()  # ids are mesh positions
    x = jax.device_put(np.arange(8, dtype=np.float32).reshape(2, 4), NamedSharding(m, P("data", "tensor")))
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.roll(np.arange(8).reshape(2, 4), 1, axis=1))
    assert only(collectives(compiled, m)).axes == ("tensor",)


def test_permuted_mesh_partitioner(permuted_mesh):
    m = permuted_mesh
    f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(m, P("data")))
    compiled = f.lower(arg(m, (16, 64), P("data", "tensor")), arg(m, (64, 32), P("tensor"))).compile()
    assert only(collectives(compiled, m)).axes == ("tensor",)
    # The same devices seen through a transposed mesh: the groups are its 'tensor' columns.
    transposed = jax.sharding.Mesh(m.devices.T, ("tensor", "data"))
    assert only(collectives(compiled, transposed)).axes == ("tensor",)


def test_mesh_size_mismatch_is_rejected(mesh):
    compiled = compile_shard_map(mesh, lambda x: jax.lax.psum(x, "tensor"), P("data", "tensor"), P("data"))
    small = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    with pytest.raises(ValueError, match="mesh"):
        collectives(compiled, small)


# --------------------------------------------------------------------------- HLO text parsing

ASYNC_HLO = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%inner (p: f32[64]) -> f32[64] {
  %ars = f32[64]{0} all-reduce-start(f32[64]{0} %p), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  ROOT %ard = f32[64]{0} all-reduce-done(f32[64]{0} %ars)
}

%body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %v = f32[64]{0} get-tuple-element(%t), index=1
  %c = f32[64]{0} call(%v), to_apply=%inner
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[64]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[64])) -> pred[] {
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[4,32], b: f32[64]) -> (bf16[16,32], f32[64]) {
  %a = bf16[4,32]{1,0} parameter(0)
  %ags = (bf16[4,32]{1,0}, bf16[16,32]{1,0}) all-gather-start(%a), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="body=%fake"}
  %agd = bf16[16,32]{1,0} all-gather-done(%ags)
  %b = f32[64]{0} parameter(1)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%b), channel_id=2, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  %z = s32[] constant(0)
  %t = (s32[], f32[64]{0}) tuple(%z, %cpd)
  %w = (s32[], f32[64]{0}) while(%t), condition=%cond, body=%body
  %res = f32[64]{0} get-tuple-element(%w), index=1
  ROOT %out = (bf16[16,32]{1,0}, f32[64]{0}) tuple(%agd, %res)
}
"""


def test_async_pairs_counted_once_from_text(mesh):
    colls = collectives(ASYNC_HLO, mesh)
    assert [(c.kind, c.axes, c.bytes, c.in_loop, c.computation, c.name) for c in colls] == [
        ("all-reduce", ("data",), 256, True, "inner", "ars"),
        ("all-gather", ("tensor",), 16 * 32 * 2, False, "main", "ags"),
        ("collective-permute", ("data",), 256, False, "main", "cps"),
    ]


# libtpu's async collective fusions: the start (outside the layer loop), a continuation that runs in the loop's
# body while the all-gather moves, and the done all carry the all-gather of channel 6; channel 7 is another one
TPU_CHAIN = """HloModule m, num_partitions=8

%start_comp (s0: bf16[64,256]) -> (bf16[64,256], bf16[512,256], u32[]) {
  %s0 = bf16[64,256]{1,0} parameter(0)
  %ag.1 = bf16[512,256]{1,0} all-gather(%s0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %cc.1 = (bf16[64,256]{1,0}, bf16[512,256]{1,0}, u32[]) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%cont_comp (c0: bf16[64,256], c1: f32[8,32]) -> (f32[8,32], bf16[512,256]) {
  %c0 = bf16[64,256]{1,0} parameter(0)
  %c1 = f32[8,32]{1,0} parameter(1)
  %ag.2 = bf16[512,256]{1,0} all-gather(%c0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %n = f32[8,32]{1,0} negate(%c1)
  ROOT %ct = (f32[8,32]{1,0}, bf16[512,256]{1,0}) tuple(%n, %ag.2)
}

%done_comp (d0: bf16[64,256], d1: bf16[512,256]) -> bf16[512,256] {
  %d0 = bf16[64,256]{1,0} parameter(0)
  %d1 = bf16[512,256]{1,0} parameter(1)
  %ag.3 = bf16[512,256]{1,0} all-gather(%d0), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %cc.2 = bf16[512,256]{1,0} custom-call(%d1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

%body (t: (s32[], f32[8,32], bf16[64,256])) -> (s32[], f32[8,32], bf16[64,256]) {
  %t = (s32[], f32[8,32]{1,0}, bf16[64,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%t), index=1
  %e = bf16[64,256]{1,0} get-tuple-element(%t), index=2
  %f = (f32[8,32]{1,0}, bf16[512,256]{1,0}) fusion(%e, %x), kind=kOutput, calls=%cont_comp
  %y = f32[8,32]{1,0} get-tuple-element(%f), index=0
  %ar = f32[8,32]{1,0} all-reduce(%y), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,32]{1,0}, bf16[64,256]{1,0}) tuple(%next, %ar, %e)
}

%cond (q: (s32[], f32[8,32], bf16[64,256])) -> pred[] {
  %q = (s32[], f32[8,32]{1,0}, bf16[64,256]{1,0}) parameter(0)
  %qi = s32[] get-tuple-element(%q), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%qi, %limit), direction=LT
}

ENTRY %main (e0: bf16[64,256], x: f32[8,32]) -> bf16[512,256] {
  %e0 = bf16[64,256]{1,0} parameter(0)
  %x = f32[8,32]{1,0} parameter(1)
  %async-collective-start = (bf16[64,256]{1,0}, bf16[512,256]{1,0}, u32[]) fusion(%e0), kind=kCustom, calls=%start_comp
  %g0 = bf16[64,256]{1,0} get-tuple-element(%async-collective-start), index=0
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[8,32]{1,0}, bf16[64,256]{1,0}) tuple(%zero, %x, %g0)
  %w = (s32[], f32[8,32]{1,0}, bf16[64,256]{1,0}) while(%t0), condition=%cond, body=%body
  %g1 = bf16[512,256]{1,0} get-tuple-element(%async-collective-start), index=1
  ROOT %async-collective-done = bf16[512,256]{1,0} fusion(%g0, %g1), kind=kCustom, calls=%done_comp
}
"""


def test_a_tpu_async_collective_chain_counts_once_at_its_start():
    from jaxpar.analysis import trip_counts

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    colls = collectives(TPU_CHAIN, mesh)
    assert [(c.name, c.kind, c.bytes, c.in_loop, c.asynchronous) for c in colls] == [
        ("ag.1", "all-gather", 512 * 256 * 2, False, True),      # not again in the loop, nor at the done
        ("ar", "all-reduce", 8 * 32 * 4, True, False),
    ]
    runs = trip_counts(TPU_CHAIN)
    assert sum(c.bytes * runs[c.computation] for c in colls) == 512 * 256 * 2 + 3 * 8 * 32 * 4


ALL_REDUCE_SCATTER = """HloModule m, num_partitions=8

%all-reduce-scatter.3 (input_0: f32[128,512]) -> f32[128,64] {
  %input_0 = f32[128,512]{0,1:T(8,128)S(1)} parameter(0)
  %all-reduce.48 = f32[128,512]{0,1:T(8,128)} all-reduce(%input_0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %constant.902 = u32[] constant(0)
  %partition-id.15 = u32[] partition-id()
  %constant.903 = u32[] constant(64)
  %multiply.149 = u32[]{:T(128)} multiply(%partition-id.15, %constant.903)
  ROOT %dynamic-slice.182 = f32[128,64]{0,1:T(8,128)S(1)} dynamic-slice(%all-reduce.48, %constant.902, %multiply.149), dynamic_slice_sizes={128,64}
}

ENTRY %main (g: f32[128,512]) -> f32[128,64] {
  %g = f32[128,512]{0,1:T(8,128)} parameter(0)
  ROOT %fusion.218 = f32[128,64]{0,1:T(8,128)S(1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.3
}
"""


def test_libtpus_all_reduce_scatter_fusion_is_a_reduce_scatter():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    assert [(c.kind, c.bytes, c.axes) for c in collectives(ALL_REDUCE_SCATTER, mesh)] == [
        ("reduce-scatter", 128 * 64 * 4, ("data",))]


def test_a_tpu_program_counts_each_channel_once():
    """A compiled TPU FSDP step: libtpu gathers weights through chains of async collective fusions (a start,
    continuations that run compute while the gather moves, a done; all carry the gather): each chain is
    counted once, at its start."""
    from flax import nnx

    from jaxpar.analysis._hlo_text import channel, parse_instructions, tpu_async_roles
    from jaxpar.cost import Plan
    from jaxpar.models import GPT, GPTConfig
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.analysis import compile_plan

    cfg = GPTConfig(vocab=512, seq_len=64, embed=128, heads=4, layers=2)
    mesh, compiled = compile_plan(lambda: GPT(cfg, rngs=nnx.Rngs(0)), Plan(fsdp=8), 16, 64,
                                  devices=target_devices(parse_target("tpu-v5e:2x4")))
    text = compiled.as_text()
    roles = tpu_async_roles(text)
    assert {"start", "continuation", "done"} <= set(roles.values()), roles
    colls = collectives(compiled, mesh)
    starts = {n for n, r in roles.items() if r == "start"}
    assert {c.name for c in colls if c.asynchronous} == starts
    assert not {c.name for c in colls} & (set(roles) - starts)          # no continuation or done counted
    by_name = {i.name: i for i in parse_instructions(text)}
    chains = [channel(by_name[n]) for n in starts]
    assert len(chains) == len(set(chains)) == sum(channel(by_name[c.name]) in chains for c in colls)
    # the gradients are reduce-scattered over fsdp (libtpu's all-reduce-scatter fusions), to 1/8 shards
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert scatters and not [c for c in colls if c.kind == "all-reduce" and c.bytes > 64 * 1024]
    assert sum(c.bytes for c in scatters) < sum(c.bytes for c in colls if c.kind == "all-gather")


def _windowed_loop(kind: str, shard: str, pairs: str) -> str:
    """A windowed einsum loop's body and condition (the SPMD partitioner's names): each step permutes ``shard``."""
    return f"""
%windowed_dot_general_body_{kind} (p: ({shard}, s32[])) -> ({shard}, s32[]) {{
  %p = ({shard}, s32[]) parameter(0)
  %buf = {shard} get-tuple-element(%p), index=0
  %cp_{kind} = {shard} collective-permute(%buf), channel_id=1, source_target_pairs={pairs}
  %i = s32[] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = ({shard}, s32[]) tuple(%cp_{kind}, %next)
}}

%windowed_dot_general_cond_{kind} (q: ({shard}, s32[])) -> pred[] {{
  %q = ({shard}, s32[]) parameter(0)
  %qi = s32[] get-tuple-element(%q), index=1
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%qi, %n), direction=LT
}}
"""


RING = "{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}"
WINDOWED = ("HloModule m, num_partitions=8\n" + _windowed_loop("ag", "bf16[16,32]", RING)
            + _windowed_loop("rs", "f32[8,32]", RING) + f"""
ENTRY %main (w: bf16[16,32], g: f32[8,32]) -> (f32[8,32], f32[8,32]) {{
  %w = bf16[16,32]{{1,0}} parameter(0)
  %first = bf16[16,32]{{1,0}} collective-permute(%w), channel_id=2, source_target_pairs={RING}
  %zero = s32[] constant(0)
  %t0 = (bf16[16,32]{{1,0}}, s32[]) tuple(%first, %zero)
  %ag = (bf16[16,32]{{1,0}}, s32[]) while(%t0), condition=%windowed_dot_general_cond_ag, body=%windowed_dot_general_body_ag
  %g = f32[8,32]{{1,0}} parameter(1)
  %t1 = (f32[8,32]{{1,0}}, s32[]) tuple(%g, %zero)
  %rs = (f32[8,32]{{1,0}}, s32[]) while(%t1), condition=%windowed_dot_general_cond_rs, body=%windowed_dot_general_body_rs
  %acc = f32[8,32]{{1,0}} get-tuple-element(%rs), index=0
  %last = f32[8,32]{{1,0}} collective-permute(%acc), channel_id=3, source_target_pairs={RING}
  %other = f32[8,32]{{1,0}} collective-permute(%g), channel_id=4, source_target_pairs={{{{0,4}},{{4,0}}}}
  ROOT %out = (f32[8,32]{{1,0}}, f32[8,32]{{1,0}}) tuple(%last, %other)
}}
""")


def test_a_windowed_einsum_loop_counts_as_the_collective_it_runs(mesh):
    """A windowed all-gather round a ring of 4 (tensor) counts as one all-gather of 4 shards, a windowed
    reduce-scatter as one reduce-scatter of its partial sum; their permutes (body, prologue, epilogue) do not
    count again, and an unrelated permute (over data) still counts."""
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
    from jaxpar.analysis._hlo_text import parse_instructions
    from jaxpar.analysis._windowed import windowed_einsums

    loops = windowed_einsums(parse_instructions(WINDOWED))
    assert {n: (w.kind, w.permutes) for n, w in loops.items()} == {
        "ag": ("all-gather", ("cp_ag", "first")), "rs": ("reduce-scatter", ("cp_rs", "last"))}
    colls = collectives(WINDOWED, mesh)
    assert [(c.kind, c.bytes, c.axes, c.name, c.asynchronous) for c in colls] == [
        ("all-gather", 4 * 16 * 32 * 2, ("tensor",), "ag", True),
        ("reduce-scatter", 8 * 32 * 4, ("tensor",), "rs", True),
        ("collective-permute", 8 * 32 * 4, ("data",), "other", False)]
    assert compiled_bytes_per_axis(WINDOWED, mesh) == {"tensor": 4 * 16 * 32 * 2 + 8 * 32 * 4, "data": 8 * 32 * 4}


ONE_ALL_REDUCE = """\
HloModule m

ENTRY %e (p: f32[2]) -> f32[2] {{
  ROOT %x = f32[2]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add
}}
"""


def test_groups_within_part_of_an_axis_name_that_axis(mesh):
    # halves of the 'tensor' axis (XLA splits some reshardings into pairwise exchanges)
    text = ONE_ALL_REDUCE.format(groups="{{0,1},{2,3},{4,5},{6,7}}")
    assert only(collectives(text, mesh)).axes == ("tensor",)


def test_groups_spanning_axes_name_every_axis_they_span(mesh):
    text = ONE_ALL_REDUCE.format(groups="{{0,5},{1,4},{2,7},{3,6}}")
    c = only(collectives(text, mesh))
    assert c.axes == ("data", "tensor")   # each group spans both axes: the smallest axes containing it


def test_absent_replica_groups_mean_all_devices(mesh):
    text = ONE_ALL_REDUCE.format(groups="{}")
    assert only(collectives(text, mesh)).axes == ("data", "tensor")


@pytest.mark.parametrize(
    "text,groups",
    [
        ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("replica_groups={}", []),
        ("channel_id=1, dimensions={0}", []),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=[2,4]<=[2,2,2]T(2,1,0)", [[0, 4, 2, 6], [1, 5, 3, 7]]),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("replica_groups=mesh[x=2,y=4] {y}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['x'=8] {'x':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y','x'}", [[0, 1, 2, 3]]),
        ("replica_groups=maximal_mesh[device_id=0] {}", None),
    ],
)
def test_parse_replica_groups(text, groups):
    assert parse_replica_groups(text) == groups


def test_iota_replica_groups_validates():
    assert iota_replica_groups([1, 8], [8]) == [list(range(8))]
    with pytest.raises(ValueError, match="group_shape"):
        iota_replica_groups([2, 2], [8])
    with pytest.raises(ValueError, match="perm"):
        iota_replica_groups([4, 2], [2, 4], [0, 0])


@pytest.mark.parametrize(
    "shape,nbytes",
    [
        ("f32[8,128]{1,0}", 4096),
        ("bf16[3,5]{1,0}", 30),
        ("f32[]", 4),
        ("pred[7]", 7),
        ("(f32[2], f32[4,4])", 72),
        ("(f32[1,128]{1,0}, (bf16[2]{0}, s8[3]))", 512 + 4 + 3),
        ("f32[8,128]{1,0:T(8,128)}", 4096),
        ("f32[<=8]{0}", 32),
        ("s16[2] u16[2] f16[2]", 12),
        ("s64[2]", 16),
        ("u64[1]", 8),
        ("f64[2]", 16),
        ("u32[3]", 12),
        ("u8[5]", 5),
        ("f8e4m3fn[16]", 16),
        ("f8e5m2[4]", 4),
        ("s4[3]", 2),
        ("(f32[4], u32[], u32[])", 24),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_shape_bytes_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="element type"):
        shape_bytes("q7[4]")


# --------------------------------------------------------------------------- summaries and tables


def _colls():
    return [
        Collective("all-reduce", 512, ("tensor",), "main", False, "a"),
        Collective("all-reduce", 512, ("tensor",), "main", False, "b"),
        Collective("all-reduce", 1024, ("tensor",), "body", True, "c"),
        Collective("all-gather", 3 * 1024 * 1024, ("data", "tensor"), "main", False, "d"),
    ]


def test_summarize_and_count():
    rows = summarize(_colls())
    assert rows[0] == dict(kind="all-reduce", axes=("tensor",), in_loop=False, count=2, bytes=1024, asynchronous=0)
    assert [(r["kind"], r["in_loop"], r["count"]) for r in rows] == [
        ("all-reduce", False, 2),
        ("all-reduce", True, 1),
        ("all-gather", False, 1),
    ]
    assert count(_colls(), "all-reduce") == 3
    assert count(_colls(), "all-reduce", axes="tensor", in_loop=False) == 2
    assert count(_colls(), "all-gather", axes=("tensor", "data")) == 1
    assert count(_colls(), "all-to-all") == 0
    with pytest.raises(ValueError, match="kind"):
        count(_colls(), "allreduce")


def test_collectives_table_renders():
    table = collectives_table(_colls())
    header, rule, *lines = table.splitlines()
    assert [h.strip() for h in header.split("|")] == ["kind", "axes", "in loop", "async", "count", "bytes"]
    assert set(rule) <= {"-", "+"}
    assert len(lines) == 3 and "3.0 MiB" in table and "data,tensor" in table and "yes" in table


# --------------------------------------------------------------------------- memory


def test_memory_report_of_sharded_argument():
    m = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    s = NamedSharding(m, P("d"))
    x = jax.ShapeDtypeStruct((8, 1024), F32)
    r = memory_report(jax.jit(lambda x: x * 2 + 1, in_shardings=s, out_shardings=s).lower(x).compile())
    assert (r.argument_bytes, r.output_bytes, r.alias_bytes) == (4096, 4096, 0)  # f32[1,1024] per device
    assert r.temp_bytes >= 0 and r.generated_code_bytes >= 0  # CPU reports 0 generated code
    assert r.peak_bytes == r.argument_bytes + r.output_bytes + r.temp_bytes - r.alias_bytes

    donated = jax.jit(lambda x: x * 2, in_shardings=s, out_shardings=s, donate_argnums=0)
    d = memory_report(donated.lower(x).compile())
    assert d.alias_bytes == 4096 and d.peak_bytes == 4096 + d.temp_bytes


def test_memory_table_and_format_bytes():
    r = MemoryReport(argument_bytes=4096, output_bytes=2048, temp_bytes=1 << 20, alias_bytes=0, generated_code_bytes=0)
    plain = memory_table({"step": r})
    assert [h.strip() for h in plain.splitlines()[0].split("|")] == ["name", "arguments", "outputs", "temps", "peak"]
    table = memory_table({"step": r, "other": r}, analytic={"step": 2048})
    assert "analytic args" in table and "measured/analytic" in table
    assert "2.00" in table.splitlines()[2] and table.splitlines()[3].rstrip().endswith("-")
    with pytest.raises(ValueError, match="analytic"):
        memory_table({"step": r}, analytic={"step": -1})
    sizes = (0, 512, 4096, 1536 * 1024, 3 << 30)
    assert [format_bytes(n) for n in sizes] == ["0 B", "512 B", "4.0 KiB", "1.5 MiB", "3.0 GiB"]
    with pytest.raises(ValueError, match="n must"):
        format_bytes("12")
