"""Compressed gradient exchange inside the train step: bytes on the wire read from the compiled
HLO, exact cases against the uncompressed step, composition with the strategies, checkpoints."""
import math
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import collectives
from jaxpar.parallel.compression import (CompressionError, cast, onebit, powersgd, qsgd, randomk, sign, terngrad, topk)
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.run import Checkpointer, CheckpointWarning
from jaxpar.step import compression_plan

from helpers import flat, grad_atol, make_batch, mesh_for, run, setup

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Big enough that padding rows to whole buckets costs < 2%: the ratios are the codecs' own.
WIRE_CFG = GPTConfig(vocab=128, seq_len=16, embed=96, heads=4, layers=2)

CODECS = {"qsgd": qsgd(), "terngrad": terngrad(), "sign": sign(), "onebit": onebit(), "cast-bf16": cast("bfloat16"),
          "cast-fp8": cast("float8_e4m3fn"), "topk": topk(0.01), "randomk": randomk(0.01),
          "powersgd": powersgd(rank=4), "topk-partitioned": topk(0.01, partitioned=True)}

# Bytes one device sends per collective, ring algorithms (``Collective.bytes`` is the result on one device).
_SENT = {"all-reduce": lambda b, n: 2 * (n - 1) / n * b, "all-gather": lambda b, n: (n - 1) / n * b,
         "all-to-all": lambda b, n: (n - 1) / n * b, "reduce-scatter": lambda b, n: (n - 1) * b}


def _compiled(sizes, strategy, cfg=WIRE_CFG, batch=16):
    mesh = mesh_for(sizes)
    tx = optax.sgd(0.1)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy, clip_norm=None)
    b = jaxpar.shard_batch(make_batch(batch, cfg), mesh)
    return step.lower(state, b).compile(), mesh, layout


def _data_collectives(compiled, mesh):
    text = compiled.as_text()
    out = []
    for c in collectives(compiled, mesh):
        if c.axes and set(c.axes) & {"data", "fsdp"}:
            shape = re.search(rf"%?{re.escape(c.name)} = (\(?[a-z0-9]+)\[", text).group(1).lstrip("(")
            out.append((c, shape))
    return out


# one codec per payload kind in the default pass (quantised, sparse, low rank); every codec in the exhaustive tier
WIRE_DEFAULT = {"qsgd", "topk", "powersgd"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in WIRE_DEFAULT else [pytest.mark.exhaustive])
                                  for n in CODECS])
def test_wire_bytes_in_the_compiled_step(name):
    """The data-axis collectives carry the codec's payload (bytes: u8) and the sizes its plan
    predicts (+-1%); against the fp32 exchange the ratio is the codec's."""
    codec = CODECS[name]
    strategy = jaxpar.Strategy(compression=codec)
    compiled, mesh, layout = _compiled({"data": 8}, strategy)
    plan = compression_plan(codec, layout, 0)
    found = _data_collectives(compiled, mesh)
    sent = sum(_SENT[c.kind](c.bytes, 8) for c, _ in found)
    assert sent == pytest.approx(plan.wire_bytes(), rel=0.01), [(c.kind, c.bytes, d) for c, d in found]
    big = [(c, d) for c, d in found if c.bytes > 64]          # not the loss / residual-norm scalars
    wire = {"randomk": {"f32"}, "powersgd": {"f32"}, "topk-partitioned": {"s32", "f32"}}.get(name, {"u8"})
    assert big and {d for _, d in big} == wire, [(c.kind, c.bytes, d) for c, d in found]
    ratio = plan.wire_bytes() / plan.uncompressed_bytes()
    limit = {"qsgd": 0.27, "terngrad": 0.07, "sign": 0.04, "onebit": 0.045, "cast-bf16": 0.51, "cast-fp8": 0.27,
             "topk": 0.08 * 1.01, "randomk": 0.0101,
             "topk-partitioned": 0.12 * 1.01}[name] if name != "powersgd" else 1.0
    assert ratio <= limit
    if name == "powersgd":
        for shape, st in zip(plan.shapes, plan.stacked):
            mat = codec.matrix(shape, st)
            if mat is not None:
                b, n, m, r = mat
                assert (b * (n + m) * r) / math.prod(shape) == pytest.approx((n + m) * r / (n * m))
        assert ratio < 0.5


def test_no_compression_compiles_to_the_same_program():
    cfg = GPTConfig(vocab=64, seq_len=8, embed=32, heads=4, layers=2)
    texts = []
    for strategy in (jaxpar.Strategy(), jaxpar.Strategy(compression=None)):
        mesh = mesh_for({"data": 8})
        state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)
        step = jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout, strategy, clip_norm=None)
        texts.append(step.lower(state, jaxpar.shard_batch(make_batch(16, cfg), mesh)).as_text())
    assert texts[0] == texts[1]          # the same program, before XLA (whose cache could mask a difference)
    assert "all_to_all" not in texts[0]


# ----------------------------------------------------------------------------- exact cases

@pytest.fixture(scope="module")
def reference():
    return {zero: run({"data": 8}, jaxpar.Strategy(zero=zero), steps=2) for zero in (0, 2)}


# the default pass: PowerSGD at full rank on DP8, top-k 100 % under ZeRO-2; the rest (sign's exact
# steps too: tests/test_onebit_adam.py checks them on DP8 against AdamW) in the exhaustive tier
LOSSLESS_DEFAULT = {("powersgd-full", 0), ("topk-1", 2)}


@pytest.mark.parametrize("codec, zero", [
    pytest.param(codec, zero, id=f"{name}-{zero}", marks=[] if (name, zero) in LOSSLESS_DEFAULT else [pytest.mark.exhaustive])
    for name, codec in [("powersgd-full", powersgd(rank=64, min_compression_rate=0)), ("topk-1", topk(1.0)),
                        ("sign-before-start", sign(start_step=100))] for zero in (0, 2)])
def test_lossless_settings_match_the_uncompressed_step(reference, zero, codec):
    got = run({"data": 8}, jaxpar.Strategy(zero=zero, compression=codec), steps=2)
    ref = reference[zero]
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got.grads), jax.tree.leaves(ref.grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * np.abs(r).max(), err_msg=str(path))


def test_local_clip_clips_each_replica_before_the_codec():
    """``Strategy(local_clip=c)``: each replica's gradient is scaled to norm <= c before the (here
    lossless) codec, then averaged: against each replica's gradient on one device, clipped by hand."""
    from jaxpar.step._grads import global_grads

    batch = make_batch()
    mesh1, state1, layout1, _ = setup({}, jaxpar.Strategy())
    with jaxpar.use_rules(mesh1, layout1.rules):
        grad_fn = jax.jit(global_grads(lm_loss, layout1))
        per = [flat(jax.device_get(grad_fn(state1.params, {k: v[2 * r:2 * r + 2] for k, v in batch.items()})[1]))
               for r in range(8)]
    norms = [math.sqrt(sum(float(np.sum(np.square(g))) for g in p.values())) for p in per]
    clip = 0.5 * min(norms)                                 # every replica is clipped, each by its own factor
    ref = {k: sum(p[k] * clip / n for p, n in zip(per, norms)) / 8 for k in per[0]}
    plain = {k: sum(p[k] for p in per) / 8 for k in per[0]}
    mesh, state, layout, step = setup({"data": 8}, jaxpar.Strategy(compression=topk(1.0), local_clip=clip),
                                      record_grads=True)
    state, metrics = step(state, jaxpar.shard_batch(batch, mesh))
    got = flat(jax.device_get(state.opt_state[0].grads))
    assert float(metrics["replica_grad_norm"]) == pytest.approx(sum(norms) / 8, rel=1e-5)
    for k, r in ref.items():
        np.testing.assert_allclose(got[k], r, rtol=1e-4, atol=grad_atol(r), err_msg=k)
    assert max(np.abs(plain[k] - ref[k]).max() / np.abs(plain[k]).max() for k in ref) > 0.3   # the clip mattered


def test_local_clip_errors_name_the_fix():
    with pytest.raises(ValueError, match="local_clip=0.0.*positive number"):
        jaxpar.Strategy(compression=topk(0.01), local_clip=0.0)
    with pytest.raises(ValueError, match="compression is None.*clip_norm"):
        jaxpar.Strategy(local_clip=1.0)
    from jaxpar.config import ConfigError, load_config
    from jaxpar.config import build_strategy
    with pytest.raises(ConfigError, match="parallel.compression.local_clip=-1.*positive"):
        build_strategy(load_config(CONFIGS / "topk.yaml", ["parallel.compression.local_clip=-1"]).parallel)
    with pytest.raises(ConfigError, match="names none.*kind: topk"):
        build_strategy(load_config(CONFIGS / "dp.yaml", ["parallel.compression={local_clip: 1.0}"]).parallel)
    strategy = build_strategy(load_config(CONFIGS / "topk.yaml", ["parallel.compression.local_clip=2"]).parallel)
    assert strategy.local_clip == 2 and strategy.compression.name.startswith("topk")


# ----------------------------------------------------------------------------- composition

COMPOSE = [({"data": 8}, 0), ({"data": 8}, 2), ({"fsdp": 4, "tensor": 2}, 0), ({"pipe": 2, "data": 4}, 0)]


#: The cases of test_codecs_train_under_the_strategies; the matrix runs the others (each program once per
#: session: XLA:CPU's executable of powersgd on pipe 2 x data 4 with 4 micro-batches, loaded from the
#: persistent compilation cache, deadlocks in its first collectives; docs/testing.md, section 3).
TRAINS = [("qsgd", 0, 1), ("sign", 1, 2), ("topk", 2, 1), ("powersgd", 3, 2)]


@pytest.mark.parametrize("name, mesh_i, accum", [pytest.param(*c, marks=[pytest.mark.exhaustive] * (c[0] in ("qsgd", "powersgd")))
                                                  for c in TRAINS])
def test_codecs_train_under_the_strategies(name, mesh_i, accum):
    """Loss falls and stays finite: DP8, ZeRO-2, ZeRO-3 fsdp4 x tensor2, pipe2 x data4 (1F1B),
    with and without accumulation (the rest of the codec x mesh x accumulation matrix is in the exhaustive tier)."""
    _trains(name, *COMPOSE[mesh_i], accum)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name, mesh_i, accum", [pytest.param(n, m, a, id=f"{n}-{m}-{a}") for n in CODECS
                                                  for m in range(len(COMPOSE)) for a in (1, 2) if (n, m, a) not in TRAINS])
def test_codec_strategy_matrix(name, mesh_i, accum):
    _trains(name, *COMPOSE[mesh_i], accum)


@pytest.mark.exhaustive      # local clipping itself runs in the default pass (test_local_clip_clips_each_replica_...)
@pytest.mark.parametrize("mesh_i", [2, 3], ids=["zero3-fsdp4-tp2", "pipe2-data4"])
def test_local_clip_trains_under_zero3_and_pipelines(mesh_i):
    """Each replica's norm is taken over its whole gradient (sharded over ``tensor`` / ``pipe``)."""
    m = _trains("topk", *COMPOSE[mesh_i], 1, local_clip=0.5)
    assert float(m["replica_grad_norm"]) > 0.5        # so the clip was active


def _trains(name, sizes, zero, accum, steps=8, local_clip=None):
    codec = CODECS[name] if name not in ("topk", "randomk") else type(CODECS[name])(CODECS[name].name, 0.1)
    piped = sizes.get("pipe", 1) > 1     # pipelines: accumulation is the micro-batches of the schedule
    strategy = jaxpar.Strategy(zero=zero, microbatches=2 * accum if piped else accum, compression=codec,
                               local_clip=local_clip)
    mesh = mesh_for(sizes)
    tx = optax.adam(3e-3)
    cfg = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
    batch = jaxpar.shard_batch(make_batch(16, cfg), mesh)
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
    assert 0 < float(m["comm_ratio"]) and np.isfinite(float(m["residual_norm"]))
    return m


def test_compression_errors_name_the_fix():
    cfg = GPTConfig(vocab=64, seq_len=8, embed=32, heads=4, layers=2)
    with pytest.raises(CompressionError, match="no data axis.*Remove Strategy.compression"):
        jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                jaxpar.make_mesh({"tensor": 2}, devices=jax.devices()[:2]),
                                jaxpar.Strategy(compression=qsgd()))
    with pytest.raises(jaxpar.ExplicitDPError, match="explicit_dp=None with compression"):
        strategy = jaxpar.Strategy(compression=sign())
        _, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                            mesh_for({"data": 8}), strategy)
        jaxpar.make_train_step(lm_loss, optax.sgd(0.1), layout, strategy, explicit_dp=True)
    _, plain = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh_for({"data": 8}))
    with pytest.raises(jaxpar.StrategyMismatchError, match="init_train_state.*fields that differ: compression"):
        jaxpar.make_train_step(lm_loss, optax.sgd(0.1), plain, jaxpar.Strategy(compression=sign()))
    from jaxpar.step._grads import global_grads
    with pytest.raises(CompressionError, match="silently ignored.*make_train_step"):
        global_grads(lm_loss, layout)


# ----------------------------------------------------------------------------- checkpoints

STATEFUL = {"sign": sign(), "onebit": onebit(), "topk-momentum": topk(0.05, momentum=0.9),
            "randomk": randomk(0.05), "powersgd": powersgd(rank=2),
            "sign-1bit-adam": sign(optimizer_momentum=0.9, start_step=2),    # compressed from step 2 on
            "topk-1bit-adam": topk(0.05, optimizer_momentum=0.9, start_step=2, partitioned=True, precondition=0.999)}


def _setup(sizes, codec):
    cfg = GPTConfig(vocab=64, seq_len=8, embed=32, heads=4, layers=2)
    strategy = jaxpar.Strategy(compression=codec)
    mesh = mesh_for(sizes)
    tx = optax.adam(1e-2)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
    batches = [jaxpar.shard_batch(make_batch(16, cfg, seed=s), mesh) for s in range(6)]
    return state, layout, step, batches


# the default pass: an error-feedback residual (sign), a low-rank warm start (powersgd), a compressed
# optimizer moment (topk-1bit-adam); the others keep the same kinds of state: in the exhaustive tier
STATEFUL_DEFAULT = {"sign", "powersgd", "topk-1bit-adam"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in STATEFUL_DEFAULT else [pytest.mark.exhaustive])
                                  for n in STATEFUL])
def test_codec_state_is_checkpointed_bit_exactly(name, tmp_path):
    """3 steps, save, 3 more = restore the save into a fresh process state, 3 more: identical."""
    state, layout, step, batches = _setup({"data": 8}, STATEFUL[name])
    assert jax.tree.leaves(state.codec), "a stateful codec keeps state"
    for b in batches[:3]:
        state, _ = step(state, b)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(3, state)
        restored = ck.restore(layout).state
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    a, b_ = state, restored
    for b in batches[3:]:
        a, ma = step(a, b)
        b_, mb = step(b_, b)
        assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b_)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_onto_other_replicas_resets_the_codec_state_with_a_warning(tmp_path):
    """The reshard policy: parameters and optimizer state restored exactly, residuals restart at zero."""
    state, layout, step, batches = _setup({"data": 8}, sign())
    for b in batches[:2]:
        state, _ = step(state, b)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(2, state)
    _, layout4, step4, batches4 = _setup({"data": 4, "tensor": 2}, sign())
    with Checkpointer(tmp_path) as ck, pytest.warns(CheckpointWarning, match="residuals restart from zero"):
        got = ck.restore(layout4).state
    for x, y in zip(jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(float(np.abs(np.asarray(r)).max()) == 0 for r in jax.tree.leaves(got.codec))
    assert jax.tree.leaves(got.codec)[0].shape[0] == 4
    after, m = step4(got, batches4[2])
    assert np.isfinite(float(m["loss"]))


def _init(sizes, codec=None, zero=0):
    """``(state one step on, layout)``: every array moved off its initial value (only the init compiles)."""
    cfg = GPTConfig(vocab=64, seq_len=8, embed=32, heads=4, layers=2)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.adam(1e-2), mesh_for(sizes),
                                            jaxpar.Strategy(zero=zero, compression=codec))
    return jax.tree.map(lambda a: a + 1, state), layout


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True))


def test_restore_with_compression_switched_off_or_on(tmp_path):
    """Turning compression off drops the codec state, turning it on starts it at zero: parameters and
    optimizer state are restored, with a warning saying so (not an 'unreadable checkpoint')."""
    on, on_layout = _init({"data": 8}, topk(0.05))
    off, off_layout = _init({"data": 8})
    with Checkpointer(tmp_path / "on", async_save=False) as ck:
        ck.save(1, on)
        with pytest.warns(CheckpointWarning) as caught:
            got = ck.restore(off_layout)
    messages = [str(w.message) for w in caught]
    assert any("gradient codec" in m and "dropped" in m for m in messages), messages
    assert not any("unreadable" in m for m in messages) and got.skipped == []
    assert got.step == 1 and got.state.codec == ()
    assert _equal((got.state.params, got.state.opt_state), (on.params, on.opt_state))
    with Checkpointer(tmp_path / "off", async_save=False) as ck:
        ck.save(1, off)
        with pytest.warns(CheckpointWarning, match="no gradient codec state.*residuals start from zero"):
            got = ck.restore(on_layout)
    assert _equal((got.state.params, got.state.opt_state), (off.params, off.opt_state))
    assert jax.tree.structure(got.state.codec) == jax.tree.structure(on.codec)
    assert all(float(np.abs(np.asarray(r)).max()) == 0 for r in jax.tree.leaves(got.state.codec))


def test_restore_resets_residuals_when_the_gradient_packing_changes(tmp_path):
    """ZeRO-1 -> ZeRO-3, or data=8 -> fsdp=8, at 8 replicas: the codec's buffer has the same shape
    but the gradient is packed into it in another order, so the residuals restart from zero (a warning
    names both layouts). ZeRO-0 packs as ZeRO-1 does: restored as saved. A checkpoint without the layout
    record (saved without a layout) compares shapes only, as before."""
    import warnings

    codec = topk(0.05)
    state, z1 = _init({"data": 8}, codec, zero=1)
    _, z3 = _init({"data": 8}, codec, zero=3)
    _, z0 = _init({"data": 8}, codec, zero=0)
    _, fsdp = _init({"fsdp": 8}, codec, zero=1)
    for other in (z3, fsdp):
        assert jax.tree.map(lambda a: a.shape, other.part("codec").shapes) == jax.tree.map(lambda a: a.shape, z1.part("codec").shapes)
        assert compression_plan(codec, other, other.strategy.zero).scattered != \
            compression_plan(codec, z1, 1).scattered
    with Checkpointer(tmp_path / "new", async_save=False) as ck:
        ck.save(1, state, layout=z1)
        for other, now in ((z3, "over data=8, zero=3"), (fsdp, "over fsdp=8, zero=1")):
            with pytest.warns(CheckpointWarning, match="residuals restart from zero") as caught:
                got = ck.restore(other)
            message = next(str(w.message) for w in caught if "residuals" in str(w.message))
            assert "over data=8, zero=1: gradients packed flat" in message and now in message, message
            assert all(float(np.abs(np.asarray(r)).max()) == 0 for r in jax.tree.leaves(got.state.codec))
            assert _equal((got.state.params, got.state.opt_state), (state.params, state.opt_state))
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            got = ck.restore(z0)
        assert _equal(got.state.codec, state.codec)
    with Checkpointer(tmp_path / "old", async_save=False) as ck:
        ck.save(1, state)                                  # no layout: no record, shapes compared only
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            got = ck.restore(z3)
        assert _equal(got.state.codec, state.codec)
