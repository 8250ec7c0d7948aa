"""1-bit Adam (``sign(optimizer_momentum=b1, start_step=T)`` with ``adamw_frozen_variance``): exact
AdamW before ``T``; after it Adam's first moment is the exchanged (compressed) one on every replica."""
import functools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.parallel.compression import CompressionError, onebit, sign, topk
from jaxpar.config import ConfigError, check, load_config
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.optimizers import adamw_frozen_variance
from jaxpar.step import compression_plan

from helpers import assert_params_close, flat, keep_grads, make_batch, mesh_for

ROOT = Path(__file__).resolve().parents[1]

CFG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, layers=2)
LR = 3e-3


def _run(sizes, codec, steps, freeze, zero=0, tx=None, seeds=None, **strategy_kw):
    """``(state, layout, metrics per step)``; batch ``t`` is ``make_batch`` of ``seeds[t]`` (default ``t``)."""
    strategy = jaxpar.Strategy(zero=zero, compression=codec, **strategy_kw)
    tx = tx or optax.chain(keep_grads(), adamw_frozen_variance(LR, freeze, weight_decay=0.1))
    mesh = mesh_for(sizes)
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, tx, layout, strategy)
    batches = [jaxpar.shard_batch(make_batch(16, CFG, seed=s), mesh) for s in (seeds or range(steps))]
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    return state, layout, metrics


def test_before_start_step_it_is_adamw_with_the_exact_exchange():
    """3 steps before ``start_step``: the same losses, gradients and parameters as uncompressed AdamW."""
    ref, _, ref_m = _run({"data": 8}, None, 3, freeze=10,
                         tx=optax.chain(keep_grads(), optax.adamw(LR, weight_decay=0.1)))
    got, _, got_m = _run({"data": 8}, sign(optimizer_momentum=0.9, start_step=10), 3, freeze=10)
    np.testing.assert_allclose([m["loss"] for m in got_m], [m["loss"] for m in ref_m], rtol=1e-5)
    ref_g = flat(jax.device_get(ref.opt_state[0].grads))
    for k, g in flat(jax.device_get(got.opt_state[0].grads)).items():   # the third step's gradient
        np.testing.assert_allclose(g, ref_g[k], rtol=1e-4, atol=1e-4 * np.abs(ref_g[k]).max(), err_msg=k)
    assert_params_close(jax.device_get(got.params), jax.device_get(ref.params), ref_g, LR, 3)
    assert all(m["comm_ratio"] == 1.0 for m in got_m)      # the exact exchange's bytes


@pytest.mark.parametrize("codec, ratio", [
    (sign, 0.033), pytest.param(onebit, 0.035, marks=pytest.mark.exhaustive), (functools.partial(topk, 0.01), 0.08),
    pytest.param(functools.partial(topk, 0.01, partitioned=True, precondition=0.999), 0.12, marks=pytest.mark.exhaustive)],
    ids=["sign", "onebit", "topk", "topk-partitioned-preconditioned"])
def test_adam_first_moment_is_the_exchanged_compressed_moment(codec, ratio):
    """From ``start_step`` on, every replica holds the same exchanged moment, Adam's first moment equals
    it, and the bytes are the codec's. With ``precondition``, the codec's ranking second moment is
    Adam's frozen one."""
    codec = codec(optimizer_momentum=0.9, start_step=2)
    state, layout, metrics = _run({"data": 8}, codec, 5, freeze=2)
    plan = compression_plan(codec, layout, 0)
    velocity = np.asarray(jax.device_get(state.codec["velocity"]))          # [replicas, flat]
    np.testing.assert_array_equal(velocity, np.broadcast_to(velocity[0], velocity.shape))
    adam = state.opt_state[1][0]                                           # ScaleByAdamState
    mu = np.concatenate([np.asarray(m).reshape(-1) for m in jax.tree.leaves(jax.device_get(adam.mu))])
    lr_ = plan.widths[2]
    np.testing.assert_allclose(mu, velocity[0][:lr_], rtol=1e-5, atol=1e-6 * np.abs(mu).max())
    assert [round(float(m["comm_ratio"]), 3) for m in metrics][:2] == [1.0, 1.0]
    assert all(float(m["comm_ratio"]) == pytest.approx(ratio, abs=0.005) for m in metrics[2:])   # the codec's
    assert float(metrics[-1]["residual_norm"]) > 0
    assert int(adam.count) == 5 and np.all(np.asarray(state.codec["count"]) == 5)   # the start counts updates
    if getattr(codec, "precondition", 0.0):          # optax's default b2 = 0.999, the codec's precondition
        nu = np.concatenate([np.asarray(v).reshape(-1) for v in jax.tree.leaves(jax.device_get(adam.nu))])
        second = np.asarray(jax.device_get(state.codec["second_moment"]))
        np.testing.assert_array_equal(second, np.broadcast_to(second[0], second.shape))
        np.testing.assert_allclose(second[0][:lr_], nu, rtol=1e-5, atol=1e-7 * nu.max())
    assert np.all(np.isfinite([m["loss"] for m in metrics]))


@pytest.mark.parametrize("sizes, zero", [({"data": 8}, 1),
                                         pytest.param({"pipe": 2, "data": 4}, 0, marks=pytest.mark.exhaustive)],
                         ids=["zero1", "pipe2-data4"])
def test_onebit_adam_trains_under_zero1_and_pipelines(sizes, zero):
    kw = dict(microbatches=2) if "pipe" in sizes else {}
    _, _, metrics = _run(sizes, sign(optimizer_momentum=0.9, start_step=2), 8, freeze=2, zero=zero, seeds=[0] * 8,
                         local_clip=1.0, **kw)              # one batch, repeated
    losses = [float(m["loss"]) for m in metrics]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def test_onebit_adam_errors_name_the_fix():
    with pytest.raises(CompressionError, match="start_step=0.*warm-up"):
        sign(optimizer_momentum=0.9)
    with pytest.raises(CompressionError, match="choose one"):
        onebit(momentum=0.9, optimizer_momentum=0.9, start_step=5)
    with pytest.raises(CompressionError, match=r"optimizer_momentum=1.5.*\(0, 1\)"):
        sign(optimizer_momentum=1.5, start_step=5)
    with pytest.raises(CompressionError, match="start_step=-1"):
        sign(start_step=-1)
    with pytest.raises(CompressionError, match="choose one way to start"):
        topk(0.01, warmup=(0.25,), warmup_steps=5, start_step=5)
    with pytest.raises(CompressionError, match="momentum correction is not applied during exact steps"):
        topk(0.01, momentum=0.9, start_step=5)
    codec = sign(optimizer_momentum=0.9, start_step=5)
    tx = adamw_frozen_variance(LR, 5)
    with pytest.raises(CompressionError, match="ZeRO-2/3 or fsdp.*zero <= 1"):
        jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh_for({"data": 8}),
                                jaxpar.Strategy(zero=2, compression=codec))
    strategy = jaxpar.Strategy(compression=codec)
    _, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh_for({"data": 8}), strategy)
    with pytest.raises(CompressionError, match=r"clip_norm=1.0.*Strategy.local_clip=1.0 and clip_norm=None"):
        jaxpar.make_train_step(lm_loss, tx, layout, strategy, clip_norm=1.0)
    with pytest.raises(ValueError, match="freeze_step=0"):
        adamw_frozen_variance(LR, 0)


def test_onebit_adam_config_errors_name_the_keys():
    path = ROOT / "configs" / "onebit_adam.yaml"
    check(load_config(path), num_devices=8)                 # the shipped config is valid
    with pytest.raises(ConfigError) as e:
        check(load_config(path, ["optimizer.name=sgd", "optimizer.clip_norm=1.0"]), num_devices=8)
    assert "optimizer.name='sgd'" in str(e.value) and "parallel.compression.local_clip=1.0 and optimizer.clip_norm=None" in str(e.value)
    with pytest.raises(ConfigError, match="optimizer.b1=0.8.*same value"):
        check(load_config(path, ["optimizer.b1=0.8"]), num_devices=8)
    topk_path = ROOT / "configs" / "topk_adam.yaml"
    check(load_config(topk_path), num_devices=8)
    with pytest.raises(ConfigError, match=r"precondition=0.95 but optimizer.b2=0.99.*same value"):
        check(load_config(topk_path, ["optimizer.b2=0.99"]), num_devices=8)
