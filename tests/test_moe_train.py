"""Expert parallelism in the train step: the GPT with MoE layers (GPTConfig.moe) trained over an
``expert`` axis matches one device (losses and the first step's gradients, router and aux loss
included, fp32 1e-5), alone and with data, ZeRO-3 / fsdp and tensor; the compiled step's
collectives over ``expert`` are the dispatch's all-to-alls; the experts' state is 1/E per device;
and what cannot run is refused by name."""

import dataclasses
import math
from collections import Counter

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import Strategy
from jaxpar.analysis import collectives
from jaxpar.options import ContextParallel
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.models import MoESettings
from jaxpar.parallel.moe import DROPLESS_SEND_FACTOR, MoEError
from jaxpar.parallel.sync import synchronous

from conftest import need_devices

LR, STEPS, ROWS = 0.1, 3, 8
MOE = MoESettings(experts=8, top_k=2, capacity_factor=None, aux_weight=0.01, z_weight=1e-3)
CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2, mlp=32, moe=MOE)


def _batch(i, rows=ROWS):
    t = np.random.default_rng(i).integers(0, 64, (rows, CFG.seq_len + 1)).astype(np.int32)
    return {"tokens": t[:, :-1], "targets": t[:, 1:]}


def _setup(axes, strategy, cfg=CFG):
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    return mesh, state, jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)


def _train(axes, strategy, cfg=CFG):
    mesh, state, step = _setup(axes, strategy, cfg)
    losses = []
    for i in range(STEPS):
        state, m = step(state, jaxpar.shard_batch(_batch(i), mesh))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    """One device's run of each test GPT, computed when a case first asks for it."""
    runs = {}

    def get(case):
        if case not in runs:
            runs[case] = _train({"data": 1}, Strategy(), _config(case))
        return runs[case]
    return get


def _config(case):
    """The test GPT: MoE every layer (``plain``; ``deep``: 4 layers; ``drops``: capacity 1.0, C = 4;
    ``pad``: capacity 1.25, C = 5, padded to 6 over a context axis of 2), with shared experts of hidden
    16, or every 2nd layer."""
    every, shared = (2, 0) if case == "every2" else (1, 16 if case == "shared" else 0)
    layers = 4 if case == "deep" else 2 * every
    cf = {"drops": 1.0, "pad": 1.25}.get(case, MOE.capacity_factor)
    return dataclasses.replace(CFG, layers=layers, moe=dataclasses.replace(MOE, every=every, shared_mlp=shared,
                                                                           capacity_factor=cf))


CASES = {
    "ep2": ({"expert": 2}, Strategy(), "plain"),
    "ep4-dp2-shared": ({"data": 2, "expert": 4}, Strategy(), "shared"),
    "ep8": ({"expert": 8}, Strategy(), "plain"),
    "ep2-fsdp2-tp2-zero3-shared": ({"fsdp": 2, "expert": 2, "tensor": 2}, Strategy(zero=3), "shared"),
    "ep4-tp2-every2": ({"expert": 4, "tensor": 2}, Strategy(), "every2"),
    # pipelines: each micro-batch's aux loss uses the step's loads (a forward sweep through the stages first)
    "ep2-pipe2-dp2-1f1b": ({"pipe": 2, "expert": 2, "data": 2}, Strategy(microbatches=2, schedule="1f1b"), "plain"),
    "ep2-pipe2-dp2-interleaved": ({"pipe": 2, "expert": 2, "data": 2},
                                  Strategy(microbatches=2, schedule="interleaved", virtual_stages=2), "deep"),
    "ep4-pipe2-zb-shared": ({"pipe": 2, "expert": 4}, Strategy(microbatches=2, schedule="zb-h1"), "shared"),
    "ep2-pipe2-tp2-gpipe-every2": ({"pipe": 2, "expert": 2, "tensor": 2}, Strategy(microbatches=4, schedule="gpipe"),
                                   "every2"),
    # sequence parallelism: the schedule and the loads' sweep run in lockstep (jaxpar.parallel.pipeline._lockstep)
    "ep2-pipe2-tp2-sp-1f1b": ({"pipe": 2, "expert": 2, "tensor": 2},
                              Strategy(microbatches=2, schedule="1f1b", sequence_parallel=True), "plain"),
    # context: the sequence split over it; slots (and drops) follow the true positions in the balanced layout
    "ep2-cx2-dp2-ring-balanced-drops": ({"context": 2, "expert": 2, "data": 2},
                                        Strategy(context=ContextParallel("ring", balance=True)), "drops"),
    "ep2-cx2-tp2-allgather-pad": ({"context": 2, "expert": 2, "tensor": 2},
                                  Strategy(context=ContextParallel("all_gather")), "pad"),
    "ep2-cx2-pipe2-ulysses": ({"pipe": 2, "context": 2, "expert": 2},
                              Strategy(microbatches=2, context=ContextParallel("ulysses")), "plain"),
}


#: In the default pass (the rest in the exhaustive tier).
FAST = {"ep2-fsdp2-tp2-zero3-shared", "ep2-cx2-dp2-ring-balanced-drops"}


@need_devices(8)
@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.exhaustive) for c in CASES])
def test_expert_parallel_training_matches_one_device(case, reference):
    axes, strategy, model = CASES[case]
    ref_losses, ref_params = reference(model)
    losses, params = _train(axes, strategy, _config(model))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # SGD, 3 steps of lr 0.1: parameters within 1e-5 relative of one device's (gradients alike)
    for (path, p), r in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@need_devices(8)
def test_the_compiled_step_dispatches_with_all_to_alls_and_keeps_the_experts_sharded():
    """Per MoE layer (the scan's body): the per-expert counts (E int32) and the routed rows out and back
    over expert, each rows all-to-all one device's [E_p, S, D], and backward the cotangents' rows and the
    weights out, the gradients back (tests/test_moe.py::exchange_sizes); no all-gather over expert; each
    device holds 1/E of the experts."""
    mesh, state, step = _setup({"data": 2, "expert": 4}, Strategy())
    compiled = step.lower(state, jaxpar.shard_batch(_batch(0), mesh)).compile()
    rows = [r for r in collectives(compiled.as_text(), mesh) if r.axes and "expert" in r.axes]
    a2a = [r for r in rows if r.kind == "all-to-all"]
    assert all(r.in_loop and tuple(r.axes) == ("expert",) for r in a2a), a2a
    # dropless: S = 1.25 x a device's N k choices over E_p; the rounds past the first run in loops of their own
    send = math.ceil(DROPLESS_SEND_FACTOR * (ROWS // 8) * CFG.seq_len * MOE.top_k / 4)
    assert Counter(r.bytes for r in a2a) == {MOE.experts * 4: 1, 4 * send * CFG.embed * 4: 4 + 5, 4 * send * 4: 4}, a2a
    assert not [r for r in rows if r.kind == "all-gather"], rows
    for name in ("experts_w1", "experts_w2"):
        leaf = state.params["blocks"][name]
        assert {s.data.nbytes for s in leaf.addressable_shards} == {leaf.nbytes // 4}


@need_devices(8)
def test_under_context_parallelism_each_device_dispatches_its_own_part_of_the_sequence():
    """EP x CX: each device sends its own T/2 tokens' choices, [E_p, S, D] with S = G/n * (E/E_p) * min(C, T/2)
    (C = 4 at capacity 1.0; n = data x expert); no rows buffer is reduce-scattered, gathered or summed
    over context."""
    mesh, state, step = _setup({"context": 2, "expert": 2, "data": 2},
                               Strategy(context=ContextParallel("ring", balance=True)), _config("drops"))
    rows = collectives(step.lower(state, jaxpar.shard_batch(_batch(0), mesh)).compile().as_text(), mesh)
    buffer = 2 * (ROWS // 4 * MOE.experts // 2 * 4) * CFG.embed * 4
    a2a = [r for r in rows if r.kind == "all-to-all"]
    assert Counter(r.bytes for r in a2a) == {MOE.experts * 4: 1, buffer: 4 + 5, buffer // CFG.embed: 4}, a2a
    assert {tuple(r.axes) for r in a2a} == {("expert",)}
    on_context = [(r.kind, r.bytes) for r in rows if r.axes and tuple(r.axes) == ("context",)]
    assert not [c for c in on_context if c[0] in ("reduce-scatter", "all-gather") and c[1] >= buffer], on_context


@need_devices(8)
def test_expert_state_per_device_is_one_over_e_as_the_memory_report_says():
    """Adam on data 2 x expert 4: each device holds exactly 1/4 of the experts' parameters and of each
    moment, and the layout's analytic bytes (jaxpar.parallel._zero's formulas, the memory report's) equal the
    bytes the devices hold, leaf by leaf summed."""
    mesh = jaxpar.make_mesh({"data": 2, "expert": 4}, devices=jax.devices()[:8])
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh, Strategy())
    adam = state.opt_state[0]
    for tree in (state.params, adam.mu, adam.nu):
        for name in ("experts_w1", "experts_w2"):
            leaf = tree["blocks"][name]
            assert {s.data.nbytes for s in leaf.addressable_shards} == {leaf.nbytes // 4}, name
    held = {}
    for leaf in jax.tree.leaves((state.params, adam.mu, adam.nu)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert set(held.values()) == {layout.analytic_bytes()["total"]}, (held, layout.analytic_bytes())


@need_devices(8)
@pytest.mark.parametrize("axes, strategy", [
    ({"data": 2, "expert": 4}, Strategy()),
    pytest.param({"pipe": 2, "expert": 2, "data": 2}, Strategy(microbatches=2), marks=pytest.mark.exhaustive)])
def test_step_metrics_with_drops_match_one_device(axes, strategy):
    """Capacity 1.0 drops assignments: the step's MoE metrics (drop rate, load min / max / CV, router
    entropy, the losses) on data 2 x expert 4, and from a pipeline's last stage, equal one device's, so
    the same assignments dropped."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1.0))
    out = []
    for ax, st in (({"data": 1}, Strategy()), (axes, strategy)):
        mesh, state, step = _setup(ax, st, cfg)
        out.append(jax.device_get(step(state, jaxpar.shard_batch(_batch(0), mesh))[1]))
    names = {"moe/drop_rate", "moe/load_min", "moe/load_max", "moe/load_cv", "moe/entropy", "moe/aux_loss",
             "moe/z_loss"}
    assert names <= set(out[0]) and out[0]["moe/drop_rate"] > 0.05, out[0]
    for name in names:
        np.testing.assert_allclose(out[1][name], out[0][name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(out[1]["loss"], out[0]["loss"], rtol=1e-5)


@need_devices(4)
def test_an_expert_axis_without_moe_layers_is_refused():
    mesh, state, step = _setup({"expert": 4}, Strategy(), dataclasses.replace(CFG, moe=None))
    with pytest.raises(MoEError, match="never ran an MoE layer"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))


@need_devices(8)
@pytest.mark.parametrize("axes, k", [pytest.param({"data": 1}, 4, marks=pytest.mark.exhaustive), ({"data": 2, "expert": 2}, 2)])
def test_the_aux_loss_with_accumulation_is_the_whole_batchs(axes, k):
    """Accumulation with the load-balancing loss: the step's forward pre-pass sums the micro-batches'
    loads per layer, each micro-batch's aux loss uses them, and losses, the aux loss, the load CV and
    the parameters after 3 steps equal one step on the whole batch on one device."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, aux_weight=0.1))
    ref_losses, ref_params = _train({"data": 1}, Strategy(), cfg)
    losses, params = _train(axes, Strategy(microbatches=k), cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, p), r in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@need_devices(2)
def test_the_aux_loss_with_accumulation_and_a_codec_is_refused():
    """A codec's per-replica gradient runs no load pre-pass: the aux loss with accumulation is refused."""
    from jaxpar.parallel.compression import topk

    mesh, state, step = _setup({"data": 2}, Strategy(microbatches=2, compression=topk(1.0)))
    with pytest.raises(MoEError, match="microbatches=2 with a loss that adds the MoE load-balancing loss"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))


def test_moe_layers_with_an_asynchronous_pipeline_are_refused_by_name():
    from jaxpar.compat import LIBRARY_NAMES, Setting, problems

    for schedule, code in (("pipedream-2bw", "2B"), ("pipedream", "ST")):
        found = problems(Setting(Strategy(microbatches=2, schedule=schedule), {"pipe": 2, "expert": 2}))
        assert [p.features for p in found] == [(code, "EP")]
        assert f"schedule={schedule!r} with expert=2" in found[0].render(LIBRARY_NAMES)
    assert not problems(Setting(Strategy(microbatches=2, schedule="1f1b"), {"pipe": 2, "expert": 2}))


@pytest.mark.parametrize("moe, match", [
    (dict(experts=8, top_k=9), "top_k=9"),
    (dict(experts=8, capacity_factor=0.0), "capacity_factor"),
    (dict(experts=8, every=3), "every=3 must divide"),
])
def test_bad_moe_settings_are_named(moe, match):
    with pytest.raises(MoEError, match=match):
        dataclasses.replace(CFG, moe=MoESettings(**moe))


@need_devices(4)
def test_experts_not_divisible_by_the_expert_axis_are_named():
    from jaxpar.rules import RulesError

    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, experts=6))
    with pytest.raises(RulesError, match=r"'blocks/experts_w1' of shape \(2, 6, 32, 32\).*'experts'.*size 6 is not "
                                         r"divisible by the mesh axes' total size 4 \(expert=4\)"):
        _setup({"expert": 4}, Strategy(), cfg)


def _quickstart(overrides, steps):
    """``jaxpar train configs/quickstart.yaml`` with ``overrides`` on data 2: its train records (one per
    step) and the final eval loss."""
    import json
    import tempfile
    from pathlib import Path

    from jaxpar.cli import main

    with tempfile.TemporaryDirectory() as out:
        config = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
        assert main(["train", config, f"train.steps={steps}", "mesh.data=2",
                     "mesh.fsdp=1", "mesh.tensor=1", "train.log_every=1", "train.eval_every=0", "train.eval_batches=4",
                     "checkpoint.enabled=false", "logging.tensorboard=false", "logging.samples=0",
                     "train.progress=none", f"train.out_dir={out}", *overrides]) == 0
        records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], next(r["eval_loss"] for r in records if r["kind"] == "eval")


@pytest.mark.exhaustive
@need_devices(8)
def test_moe_converges_below_dense_and_the_balancing_loss_evens_the_load():
    """The quickstart at equal tokens (400 steps): the dropless 8-expert top-2 MoE GPT (experts of hidden
    256: 512 active, the dense MLP's) reaches a lower eval loss than the dense GPT; with the
    load-balancing loss the load CV falls; at capacity 1.25 it drops fewer assignments than without."""
    moe = ["mesh.expert=4", "model.mlp=256", "model.moe.experts=8", "model.moe.top_k=2"]
    dense_train, dense_eval = _quickstart(["mesh.data=8"], 400)
    moe_train, moe_eval = _quickstart(moe + ["model.moe.capacity_factor=null"], 400)
    assert moe_eval < dense_eval, (moe_eval, dense_eval)
    cv = lambda recs: float(np.mean([r["moe/load_cv"] for r in recs]))       # noqa: E731
    assert cv(moe_train[-25:]) < 0.5 * cv(moe_train[:25]), (cv(moe_train[:25]), cv(moe_train[-25:]))
    on, _ = _quickstart(moe + ["model.moe.capacity_factor=1.25"], 100)
    off, _ = _quickstart(moe + ["model.moe.capacity_factor=1.25", "model.moe.aux_weight=0"], 100)
    drops = lambda recs: float(np.mean([r["moe/drop_rate"] for r in recs[-50:]]))   # noqa: E731
    assert drops(off) > drops(on), (drops(off), drops(on))


def _biased_run(axes, strategy, cfg, steps=STEPS):
    """``(losses, the router bias, parameters)`` after ``steps`` SGD steps with an aux-loss-free bias of rate 0.05."""
    from jaxpar.step import with_router_bias

    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    state, layout = with_router_bias(state, layout, (cfg.layers, cfg.moe.experts), rate=cfg.moe.bias_rate)
    step = jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)
    losses = []
    for i in range(steps):
        state, m = step(state, jaxpar.shard_batch(_batch(i), mesh))
        losses.append(float(m["loss"]))
    return np.array(losses), np.asarray(jax.device_get(state.stats["router_bias"])), jax.device_get(state.params)


#: Capacity 1.0 (assignments dropped, so the bias changes what is computed), balanced by the bias alone.
BIASED = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1.0, aux_weight=0.0, bias_rate=0.05))


@need_devices(8)
@pytest.mark.parametrize("axes, k", [({"data": 2, "expert": 2}, 2),
                                     pytest.param({"pipe": 2, "expert": 2, "data": 2}, 2, marks=pytest.mark.exhaustive)])
def test_the_router_bias_moves_as_on_one_device(axes, k):
    """Aux-loss-free balancing: each step moves every MoE layer's bias by the step's loads (summed over
    micro-batches, replicas and pipeline stages), so losses, the bias and the parameters after 3 steps
    equal one device's on the whole batch."""
    ref_losses, ref_bias, ref_params = _biased_run({"data": 1}, Strategy(), BIASED)
    assert np.abs(ref_bias).max() > 0 and set(np.round(np.abs(ref_bias.ravel()) / 0.05, 4)) <= {0.0, 1.0, 2.0, 3.0}
    losses, bias, params = _biased_run(axes, Strategy(microbatches=k), BIASED)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_array_equal(bias, ref_bias)
    for (path, p), r in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@need_devices(2)
def test_router_bias_errors_are_named():
    from jaxpar.step import router_bias, with_router_bias
    from jaxpar.step._router_bias import KEY

    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    state, layout = jaxpar.init_train_state(lambda: GPT(BIASED, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh)
    step = jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)        # bias_rate > 0, no bias in the state
    with pytest.raises(MoEError, match=r"bias_rate=0.05 balances .* this state has none. Add it: .*with_router_bias"):
        step(state, jaxpar.shard_batch(_batch(0), mesh))
    for rate in (0, -0.01, None, True):
        with pytest.raises(MoEError, match=rf"with_router_bias\(rate={rate}\): the bias step must be a number > 0"):
            with_router_bias(state, layout, (2, 8), rate=rate)
        with pytest.raises(MoEError, match=rf"^router_bias\(rate={rate}\): the bias step must be a number > 0"):
            router_bias((2, 8), rate=rate)
    with pytest.raises(TypeError, match="rate"):                # the rate is required: no bias without it
        with_router_bias(state, layout, (2, 8))
    biased, biased_layout = with_router_bias(state, layout, (2, 8), rate=0.01)
    assert biased_layout.parts[KEY].options == 0.01 and KEY not in layout.parts
    traced = jaxpar.state_layout(lambda: GPT(BIASED, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh,
                                 parts=[router_bias((2, 8), rate=0.01)]).parts[KEY]
    assert (traced.options, traced.shapes) == (0.01, biased_layout.parts[KEY].shapes)
    dense = dataclasses.replace(CFG, moe=None)                            # a bias kept, never read
    state, layout = jaxpar.init_train_state(lambda: GPT(dense, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh)
    state, layout = with_router_bias(state, layout, (2, 8), rate=0.01)
    with pytest.raises(MoEError, match=r"keeps a router bias of shape \(2, 8\) .* reported no loads"):
        jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)(state, jaxpar.shard_batch(_batch(0), mesh))


@need_devices(2)
@pytest.mark.parametrize("sizes, strategy, code", [
    ({"pipe": 2}, Strategy(microbatches=2, schedule="pipedream"), "ST"),
    ({"pipe": 2}, Strategy(microbatches=2, schedule="pipedream-2bw"), "2B"),
    ({"replica": 2}, Strategy(sync=synchronous()), "RS"),
], ids=["ST", "2B", "RS"])
def test_a_router_bias_without_one_load_per_step_is_refused_by_the_table(sizes, strategy, code):
    """Weight stashing, PipeDream-2BW and replicas have no one load per step to move the bias by: the
    compatibility table's RB pair (class MoEError, a message naming both options and the fix) is
    raised by ``with_router_bias`` and ``init_train_state`` / ``state_layout(parts=[router_bias(...)])``, and by
    ``make_train_step`` for a layout that got the part some other way."""
    import re

    from jaxpar.compat import LIBRARY_NAMES, Setting, problems
    from jaxpar.step import router_bias, with_router_bias
    from jaxpar.step._state import with_parts

    found = problems(Setting(strategy, sizes, router_bias_rate=0.01))
    assert [set(p.features) for p in found] == [{code, "RB"}] and found[0].error is MoEError
    text = found[0].render(LIBRARY_NAMES)
    assert "with_router_bias(rate)=0.01 with " in text and ("schedule=" in text or "Strategy.sync=" in text)
    assert "synchronous data parallelism" in text and "MoESettings.aux_weight" in text, text
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:2])
    state, layout = jaxpar.init_train_state(lambda: GPT(BIASED, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    model_fn, part = lambda: GPT(BIASED, rngs=nnx.Rngs(0)), router_bias((2, 8), rate=0.01)
    for call in (lambda: with_router_bias(state, layout, (2, 8), rate=0.01),
                 lambda: jaxpar.state_layout(model_fn, optax.sgd(LR), mesh, strategy, parts=[part])):
        with pytest.raises(MoEError, match=re.escape(text)):
            call()
    biased = with_parts(layout, [part])                 # the part, past init_train_state's table
    with pytest.raises(MoEError, match=re.escape(text)):
        jaxpar.make_train_step(lm_loss, optax.sgd(LR), biased)
    assert not problems(Setting(Strategy(microbatches=2, schedule="1f1b"), {"pipe": 2}, router_bias_rate=0.01))


@need_devices(2)
def test_the_router_bias_rate_is_the_parts_only():
    """``make_train_step`` takes no ``router_bias_rate``, with or without a bias in the state: the rate is
    given to ``with_router_bias``."""
    from jaxpar.step import with_router_bias

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    state, layout = jaxpar.init_train_state(lambda: GPT(BIASED, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh)
    _, biased = with_router_bias(state, layout, (2, 8), rate=0.05)
    for on in (layout, biased):
        with pytest.raises(TypeError, match="router_bias_rate"):
            jaxpar.make_train_step(lm_loss, optax.sgd(LR), on, router_bias_rate=0.05)
