"""Pipeline executor: every schedule equals the single-device run; memory, sends and errors."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.parallel.pipeline import PartitionError
from jaxpar.parallel.pipeline import lower, sends
from jaxpar.parallel.pipeline import get_schedule
from jaxpar.rules import path_str
from jaxpar.parallel.pipeline._piped import auto_stage_layers, make_pipeline_loss_and_grad
from jaxpar.step._grads import global_grads

from helpers import make_batch, run
from test_equivalence import assert_same

PCFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=8)


def _layout(sizes, strategy, cfg=PCFG):
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:1] if not sizes else None)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), mesh, strategy)
    return mesh, state, layout


_REF = {}


def _reference(batch_size):
    if batch_size not in _REF:
        _, state, layout = _layout({}, jaxpar.Strategy())
        fn = jax.jit(global_grads(lm_loss, layout))
        _REF[batch_size] = jax.device_get(fn(state.params, make_batch(batch_size, PCFG)))
    return _REF[batch_size]


def _pipelined(sizes, strategy, batch_size, cfg=PCFG):
    mesh, state, layout = _layout(sizes, strategy, cfg)
    fn = make_pipeline_loss_and_grad(lm_loss, layout.graphdef, mesh, layout.rules, layout.params, layout.grads,
                                     strategy)

    def go(params, batch):
        with jaxpar.use_rules(mesh, layout.rules):
            return fn(params, batch)

    batch = jaxpar.shard_batch(make_batch(batch_size, PCFG), mesh)
    return jax.device_get(jax.jit(go)(state.params, batch))


def assert_grads_equal(got, ref, rtol=1e-4, atol=1e-7):
    np.testing.assert_allclose(got[0], ref[0], rtol=rtol)
    flat = dict((path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(ref[1])[0])
    for p, v in jax.tree_util.tree_flatten_with_path(got[1])[0]:
        np.testing.assert_allclose(v, flat[path_str(p)], rtol=rtol, atol=atol, err_msg=path_str(p))


# To keep the default suite under its time budget, one case per schedule runs by default and the
# rest are marked exhaustive (`make test-all`; CI runs a third of them a run): GPipe at p = 2 (no table of
# p = 4 differs for it but in length), 1F1B at p = 4, m = 8 (warm-up, steady state and cool-down;
# m = p has no steady state), interleaved and ZB-H1 at p = m = 4. The composed tests below run
# p = 2 for 1F1B and interleaved, and p = 4 for ZB-H1 with an uneven partition.
DEFAULT = {("gpipe", 2, 2), ("1f1b", 4, 8), ("interleaved", 4, 4), ("zb-h1", 4, 4)}


def _slow(kind, p, m):
    return (kind, p, m) not in DEFAULT


CASES = [pytest.param(kind, p, m, id=f"{kind}-p{p}-m{m}", marks=[pytest.mark.exhaustive] if _slow(kind, p, m) else [])
         for kind in ("gpipe", "1f1b", "interleaved", "zb-h1") for p in (2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("kind,p,m", CASES)
def test_schedule_matches_single_device(kind, p, m):
    """Loss and every gradient of the pipelined GPT (pipe=p x data=8/p) equal the single-device ones."""
    v = 2 if kind == "interleaved" else 1
    batch_size = m * (8 // p)                      # one row per data shard per micro-batch
    strategy = jaxpar.Strategy(microbatches=m, schedule=kind, virtual_stages=v)
    assert_grads_equal(_pipelined({"pipe": p, "data": 8 // p}, strategy, batch_size), _reference(batch_size))


@pytest.mark.parametrize("remat", ["full", "save-matmuls"])
def test_remat_policies_inside_the_pipeline(remat):
    """The layer's remat policy shapes what the executor stores; the numbers do not change."""
    cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=8, remat=remat)
    got = _pipelined({"pipe": 2, "data": 4}, jaxpar.Strategy(microbatches=4), 16, cfg)
    assert_grads_equal(got, _reference(16))


COMPOSED = {     # pp2-dp2-tp2 in the exhaustive tier: the interleaved case runs the same mesh
    "pp2-dp2-tp2": ({"pipe": 2, "data": 2, "tensor": 2}, {"microbatches": 4}),
    "pp2-zero3fsdp2-tp2": ({"pipe": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 4, "zero": 3}),
    "pp2-interleaved-dp2-tp2": ({"pipe": 2, "data": 2, "tensor": 2},
                                {"microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}),
    "pp4-uneven-zbh1-dp2": ({"pipe": 4, "data": 2}, {"microbatches": 8, "schedule": "zb-h1",
                                                       "stage_layers": (1, 3, 3, 1)}),
}


@pytest.fixture(scope="module")
def reference8():
    return run({}, jaxpar.Strategy(), cfg=PCFG)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if n == "pp2-dp2-tp2" else [])
                                  for n in COMPOSED])
def test_composed_pipeline_trains_like_single_device(name, reference8):
    """3 AdamW steps through make_train_step: pipe x DP x TP, pipe x ZeRO-3 x TP, an uneven partition."""
    sizes, kw = COMPOSED[name]
    result = run(sizes, jaxpar.Strategy(**kw), cfg=PCFG)
    assert result[0][-1] < result[0][0]
    assert_same(result, reference8)


def _temp_bytes(kind, m, rows=2):
    strategy = jaxpar.Strategy(microbatches=m, schedule=kind)
    mesh, state, layout = _layout({"pipe": 4, "data": 2}, strategy, cfg=MEM_CFG)
    step = jaxpar.make_train_step(lm_loss, optax.adamw(1e-3), layout, strategy)
    batch = {k: jax.ShapeDtypeStruct((m * rows, MEM_CFG.seq_len), jnp.int32) for k in ("tokens", "targets")}
    compiled = step.lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled


MEM_CFG = GPTConfig(vocab=64, seq_len=64, embed=32, heads=4, layers=8)


@pytest.mark.parametrize("kind", ["1f1b", pytest.param("gpipe", marks=pytest.mark.exhaustive)])
def test_1f1b_memory_is_bounded_and_gpipe_grows(kind):
    """Same micro-batch size, m = 4 -> 16: 1F1B's temporaries grow <= 1.25x, GPipe's >= 2.5x (the
    measurement sees the stored activations; exhaustive tier)."""
    t4, t16 = _temp_bytes(kind, 4)[0], _temp_bytes(kind, 16)[0]
    growth = f"{kind} temp {t4} -> {t16} ({t16 / t4:.2f}x)"
    if kind == "1f1b":
        assert t16 <= 1.25 * t4, growth
    else:
        assert t16 >= 2.5 * t4, growth


def _permute_pairs(hlo: str):
    out = []
    for line in hlo.splitlines():
        if "collective-permute" in line and "source_target_pairs" in line and "=" in line.split("collective-permute")[0]:
            pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", line).group(1)
            out.append([tuple(map(int, q)) for q in re.findall(r"\{(\d+),(\d+)\}", "{" + pairs + "}")])
    return out


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2)])
def test_sends_are_neighbour_permutes_matching_the_table(kind, v):
    """Collective-permutes run over ``pipe`` only, between neighbours (plus the interleaved
    wrap-around); per step there is one send each way per micro-batch per virtual-stage boundary."""
    p, m = 4, 8
    strategy = jaxpar.Strategy(microbatches=m, schedule=kind, virtual_stages=v)
    mesh, state, layout = _layout({"pipe": p, "data": 2}, strategy)
    step = jaxpar.make_train_step(lm_loss, optax.adamw(1e-3), layout, strategy)
    batch = {k: jax.ShapeDtypeStruct((2 * m, PCFG.seq_len), jnp.int32) for k in ("tokens", "targets")}
    hlo = step.lower(state, batch).compile().as_text()
    coords = {int(d.id): idx for idx, d in np.ndenumerate(mesh.devices)}
    pipe_dim = mesh.axis_names.index("pipe")
    patterns = set()
    for pairs in _permute_pairs(hlo):
        stage_pairs = set()
        for a, b in pairs:
            ca, cb = coords[a], coords[b]
            assert all(x == y for i, (x, y) in enumerate(zip(ca, cb)) if i != pipe_dim), (a, b)
            sa, sb = ca[pipe_dim], cb[pipe_dim]
            assert abs(sa - sb) == 1 or (v > 1 and {sa, sb} == {0, p - 1}), (sa, sb)
            stage_pairs.add((sa, sb))
        patterns.add(tuple(sorted(stage_pairs)))
    program = lower(get_schedule(kind, p, m, v))
    expected = {tuple(sorted(t.fwd_pairs)) for t in program.ticks if t.fwd_pairs} | \
               {tuple(sorted(t.bwd_pairs)) for t in program.ticks if t.bwd_pairs}
    assert patterns == expected
    assert sends(program) == {"forward": m * (p * v - 1), "backward": m * (p * v - 1)}
    # Nothing else moves over pipe inside the schedule. After it: one all-reduce of the
    # embedding / head gradients (replicated over pipe) and scalars (loss, norms).
    # Interleaved chunks also re-lay the block parameters (stored in model layer order)
    # once per step: an all-to-all of the parameters and one of the gradients.
    from jaxpar.analysis import collectives
    colls = collectives(hlo, mesh)
    assert all(c.axes is not None for c in colls), [c for c in colls if c.axes is None]
    over_pipe = [c for c in colls if "pipe" in c.axes and c.kind != "collective-permute"]
    assert not any(c.in_loop for c in over_pipe), over_pipe
    ends = sum(a.size * 4 for k, a in layout.shapes.items() if k != "blocks" for a in jax.tree.leaves(a))
    reduced = sum(c.bytes for c in over_pipe if c.kind == "all-reduce")
    assert ends <= reduced <= ends + 64, (ends, reduced)
    block_bytes = sum(a.size * 4 for a in jax.tree.leaves(layout.shapes["blocks"])) / p
    moved = sum(c.bytes for c in over_pipe if c.kind == "all-to-all")
    assert {c.kind for c in over_pipe} <= {"all-reduce", "all-to-all"}
    assert moved == 0 if v == 1 else 0 < moved <= 2 * block_bytes * 1.01


@pytest.mark.parametrize("strategy_kw,sizes,match", [
    ({"microbatches": 2}, {"pipe": 4, "data": 2}, r"m >= p"),
    ({"microbatches": 6, "schedule": "interleaved", "virtual_stages": 2}, {"pipe": 4, "data": 2},
     r"m divisible by p"),
    ({"microbatches": 4, "stage_layers": (4, 4)}, {"pipe": 4, "data": 2}, r"pipe=4 x virtual_stages=1 = 4"),
    ({"microbatches": 4, "stage_layers": (1, 2, 2, 1)}, {"pipe": 4, "data": 2}, r"sum to the model's 8"),
])
def test_bad_pipeline_configs(strategy_kw, sizes, match):
    with pytest.raises(ValueError, match=match):
        _pipelined(sizes, jaxpar.Strategy(**strategy_kw), 8)


def test_layers_not_divisible_by_stages():
    cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=8, layers=6)
    strategy = jaxpar.Strategy(microbatches=4)
    mesh, state, layout = _layout({"pipe": 4, "data": 2}, strategy, cfg=cfg)
    with pytest.raises(PartitionError, match=r"6 layers cannot be split evenly over 4 pipeline stages"):
        jaxpar.make_train_step(lm_loss, optax.adamw(1e-3), layout, strategy)


def test_batch_not_divisible_by_microbatches():
    strategy = jaxpar.Strategy(microbatches=4)
    mesh, state, layout = _layout({"pipe": 2, "data": 4}, strategy)
    step = jaxpar.make_train_step(lm_loss, optax.adamw(1e-3), layout, strategy)
    with pytest.raises(ValueError, match=r"microbatches \(4\)"):
        step(state, make_batch(8, PCFG))


def test_sequence_parallel_with_a_no_flush_schedule_is_refused():
    """The no-flush programs run a different action per stage, so SP's collectives inside them would
    hang; the flush schedules run in lockstep (tests/test_pipeline_sequence_parallel.py)."""
    strategy = jaxpar.Strategy(microbatches=4, sequence_parallel=True, schedule="pipedream-2bw")
    with pytest.raises(ValueError, match=r"Strategy.sequence_parallel=True with schedule='pipedream-2bw' on "
                                         r"pipe=2 is not supported"):
        _layout({"pipe": 2, "data": 2, "tensor": 2}, strategy)


def test_strategy_rejects_bad_pipeline_fields():
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        jaxpar.Strategy(virtual_stages=2)
    with pytest.raises(ValueError, match="unknown schedule kind 'pipedream-x'"):
        jaxpar.Strategy(schedule="pipedream-x")


def test_auto_stage_layers_balance_compiled_flops():
    """'auto' moves layers off the stage that also runs an expensive head (large vocabulary)."""
    from jaxpar.parallel.pipeline._cut import cut_model

    def stages(cfg):
        _, state, layout = _layout({"pipe": 4, "data": 2}, jaxpar.Strategy(microbatches=4, stage_layers="auto"), cfg)
        mb = {k: jax.ShapeDtypeStruct((4, cfg.seq_len), jnp.int32) for k in ("tokens", "targets")}
        cut = cut_model(lm_loss, layout.graphdef, layout.shapes, mb)
        return auto_stage_layers(cut, *cut.split(layout.shapes), mb, 4)

    assert stages(GPTConfig(vocab=256, seq_len=64, embed=64, heads=4, layers=8)) == (2, 2, 2, 2)
    assert stages(GPTConfig(vocab=2048, seq_len=64, embed=64, heads=4, layers=8)) == (2, 2, 3, 1)


def test_schedule_stages_must_match_the_pipe_axis():
    from jaxpar.models import _gpt as gpt
    from jaxpar.parallel import cross_entropy
    from jaxpar.parallel.pipeline import PipelineParts, pipeline_value_and_grad
    parts = PipelineParts(pre=lambda outer, mb: gpt.embed_apply(outer, mb["tokens"]), layer=gpt.block_apply,
                          post=lambda outer, y, mb: cross_entropy(gpt.head_apply(outer, y), mb["targets"]))
    mesh = jaxpar.make_mesh({"pipe": 2, "data": 4})
    with pytest.raises(ValueError, match=r"has 4 stages but the mesh's 'pipe' axis has size 2"):
        pipeline_value_and_grad(parts, mesh, jaxpar.Strategy().rules(mesh),
                                lower(get_schedule("1f1b", 4, 4)), stage_layers=(2, 2, 2, 2))


def test_pipelined_checkpoint_restores_onto_other_meshes(tmp_path):
    """A state saved under pipe=4 x data=2 (layers split over pipe) restores under
    data=4 x tensor=2 and under pipe=2 x fsdp=4 with identical values."""
    from jaxpar.run import Checkpointer
    _, state, layout = _layout({"pipe": 4, "data": 2}, jaxpar.Strategy(microbatches=4))
    state = state._replace(step=jnp.full_like(state.step, 7))
    with Checkpointer(tmp_path / "ck", keep=1, async_save=False) as ck:
        ck.save(7, state, {"note": "pipelined"}, wait=True)
    host = jax.device_get(state)
    for sizes, kw in (({"data": 4, "tensor": 2}, {}), ({"pipe": 2, "fsdp": 4}, {"microbatches": 2})):
        _, _, other = _layout(sizes, jaxpar.Strategy(**kw))
        with Checkpointer(tmp_path / "ck") as ck:
            restored = ck.restore(other)
        assert restored.step == 7
        for a, b in zip(jax.tree.leaves(jax.device_get(restored.state)), jax.tree.leaves(host)):
            np.testing.assert_array_equal(a, b)
        leaf = restored.state.params["blocks"]["w1"]
        assert leaf.sharding.spec == other.params["blocks"]["w1"]
