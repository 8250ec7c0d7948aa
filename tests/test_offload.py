"""Memory offloading (``Strategy.offload``, :mod:`jaxpar.parallel._offload`): the optimizer state, the
fp32 master weights and named activations in host memory.

An offloaded run is the run without offload bit for bit (the step's arithmetic is the same: only where
the state lives between steps changes), under DP and FSDP; the state lives in ``pinned_host`` before and
after each step; checkpoints restore bit-exact into a run without offload, onto another mesh, and the
other way round. The pair harness (tests/test_pairs.py, feature ``OF``) runs offload with every other
feature against the one-device reference. On the CPU mesh a ``device_put`` between memory kinds inside a
program lowers to nothing (XLA:CPU has one physical memory), so the transfers themselves are checked in the
program JAX traces (``device_put`` to the host memory space); the GPU compiler's program is docs/strategies.md's.
"""
from __future__ import annotations

import dataclasses
import tempfile

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import make_batch
from jaxpar.options import LAYER_INPUT
from jaxpar.models import GPT, GPTConfig, lm_loss
from jaxpar.options import Offload

CFG = GPTConfig(vocab=32, seq_len=8, embed=16, heads=2, layers=2)
ROWS = 16
OPT_MASTER = Offload(optimizer=True, master=True)
HOST_UPDATE = Offload(optimizer=True, master=True, update="host")


def _setup(sizes, strategy, remat="none"):
    n = int(np.prod(list(sizes.values())))
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:n])
    cfg = dataclasses.replace(CFG, remat=remat)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    return state, layout, jaxpar.make_train_step(lm_loss, tx, layout)


def _kinds(state, field):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(getattr(state, field))}


def _run(sizes, strategy, remat="none", steps=2):
    state, layout, step = _setup(sizes, strategy, remat)
    kinds = [{f: _kinds(state, f) for f in ("params", "opt_state")}]
    losses = []
    for i in range(steps):
        state, metrics = step(state, make_batch(ROWS, CFG, seed=i))
        losses.append(float(metrics["loss"]))
        kinds.append({f: _kinds(state, f) for f in ("params", "opt_state")})
    return losses, jax.device_get((state.params, state.opt_state)), kinds


def _assert_same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_offload_options_are_checked():
    with pytest.raises(jaxpar.JaxparError, match="offloads nothing"):
        Offload()
    with pytest.raises(jaxpar.JaxparError, match=r"Offload.master=1"):
        Offload(master=1)
    with pytest.raises(jaxpar.JaxparError, match="tuple of checkpoint_name names"):
        Offload(activations="mlp")
    with pytest.raises(jaxpar.StrategyError, match="Strategy.offload=True"):
        jaxpar.Strategy(offload=True)
    with pytest.raises(jaxpar.OffloadError, match=r"Offload.update='gpu': must be 'device'"):
        Offload(optimizer=True, update="gpu")
    with pytest.raises(jaxpar.OffloadError, match=r"update='host' with optimizer=False.*Set optimizer=True"):
        Offload(master=True, update="host")
    assert Offload(optimizer=True, master=True, update="host").streamed == ("params",)
    assert Offload(optimizer=True, master=True).streamed == ("opt_state", "params")
    assert Offload(optimizer=True, update="host").label == "offload-opt-host"
    s = jaxpar.Strategy(zero=1, offload=Offload(optimizer=True, activations=[LAYER_INPUT]))
    assert s.offload.activations == (LAYER_INPUT,)
    assert s.name({"data": 2}) == "dp2-zero1-offload-opt-act"


@pytest.mark.parametrize("sizes,zero,offload", [
    pytest.param({"data": 8}, 0, OPT_MASTER, id="dp8-opt-master"),
    pytest.param({"data": 8}, 0, HOST_UPDATE, id="dp8-opt-master-host-update"),
    pytest.param({"fsdp": 8}, 0, Offload(optimizer=True, update="host"), id="fsdp8-opt-host-update"),
    pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, 1, OPT_MASTER, id="dp2-zero1-fsdp2-tp2-opt-master",
                 marks=pytest.mark.exhaustive),
])
def test_offloaded_state_lives_on_the_host_and_trains_bit_exact(sizes, zero, offload):
    plain = _run(sizes, jaxpar.Strategy(zero=zero))
    off = _run(sizes, jaxpar.Strategy(zero=zero, offload=offload))
    assert off[0] == plain[0]
    _assert_same(off[1], plain[1])
    want = {f: {"pinned_host" if f in offload.fields else "device"} for f in ("params", "opt_state")}
    assert all(k == want for k in off[2]), off[2]        # at init and after every step
    assert all(k == {"params": {"device"}, "opt_state": {"device"}} for k in plain[2])


def test_host_update_runs_on_the_host_and_equals_the_device_update_with_clip_and_skip():
    """The host update (ZeRO-Offload's) against the device update of the same offloaded state, clipping
    and the skip rule on: bit for bit on XLA:CPU (the same arithmetic), and the host's program is a
    computation XLA places on the host (``_xla_compute_type = "host"``); the device update has none."""
    runs, texts = {}, {}
    for update in ("host", "device"):
        strategy = jaxpar.Strategy(zero=1, offload=Offload(optimizer=True, update=update))
        mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
        tx = optax.adamw(1e-3, weight_decay=0.1)
        state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
        step = jaxpar.make_train_step(lm_loss, tx, layout, clip_norm=0.05, skip_nonfinite=True)
        texts[update] = step.lower(state, make_batch(ROWS, CFG)).as_text()
        norms = []
        for i in range(2):
            state, metrics = step(state, make_batch(ROWS, CFG, seed=i))
            norms.append(float(metrics["grad_norm"]))
        assert norms[0] > 0.05 and not bool(metrics["skipped"])        # the clip scaled the gradient
        runs[update] = norms, jax.device_get((state.params, state.opt_state))
        assert _kinds(state, "opt_state") == {"pinned_host"} and _kinds(state, "params") == {"device"}
    assert runs["host"][0] == runs["device"][0]
    _assert_same(runs["host"][1], runs["device"][1])
    assert '_xla_compute_type = "host"' in texts["host"] and "_xla_compute_type" not in texts["device"]


def test_host_update_refuses_an_optimizer_that_creates_device_arrays():
    def creating():           # an update that builds an array of its own beside its host-resident inputs
        return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (
            jax.tree.map(lambda x: jax.numpy.where(x > 0, x, jax.numpy.zeros_like(x)), u), s))

    tx = optax.chain(optax.adam(1e-3), creating())
    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh,
                                            jaxpar.Strategy(offload=Offload(optimizer=True, update="host")))
    with pytest.raises(jaxpar.OffloadError, match=r"update='host': the optimizer's update does not run in host.*"
                                                  r"Use Offload\(update='device'\)"):
        jaxpar.make_train_step(lm_loss, tx, layout).lower(state, make_batch(ROWS, CFG))


def test_activation_offload_equals_full_remat_and_moves_the_layer_inputs():
    strategy = jaxpar.Strategy(offload=Offload(activations=(LAYER_INPUT,)))
    full = _run({"data": 8}, jaxpar.Strategy(), remat="full")
    off = _run({"data": 8}, strategy, remat="offload")
    assert off[0] == full[0]
    _assert_same(off[1], full[1])
    state, _, step = _setup({"data": 8}, strategy, remat="offload")
    jaxpr = str(step.programs["step"].trace(state, make_batch(ROWS, CFG)).jaxpr)
    assert "devices=(MemorySpace.Host,)" in jaxpr and "devices=(MemorySpace.Device,)" in jaxpr


def test_activation_offload_needs_the_policy_and_named_residuals():
    batch = make_batch(ROWS, CFG)
    state, _, step = _setup({"data": 8}, jaxpar.Strategy(offload=Offload(activations=(LAYER_INPUT,))), "full")
    with pytest.raises(jaxpar.OffloadError, match=r"remat policy 'offload'.*model.remat: offload.*a model of your "
                       r"own, call jaxpar\.scan_blocks\(blocks, x, remat=jaxpar\.adapters\.remat_policy\('offload'\)\)"):
        step(state, batch)
    state, _, step = _setup({"data": 8}, jaxpar.Strategy(offload=Offload(activations=("mlp_out",))), "offload")
    with pytest.raises(jaxpar.OffloadError, match=r"\['mlp_out'\].*jaxpar_layer_input"):
        step(state, batch)


@pytest.mark.slow
def test_activation_offload_in_a_users_model_is_the_policy_made_in_its_call():
    """docs/strategies.md: a model of one's own offloads its layer inputs with
    ``scan_blocks(..., remat=remat_policy("offload"))`` in its ``__call__``; a policy made in ``__init__``
    (outside the step's trace) offloads nothing, and the step says so."""
    import importlib.util
    from pathlib import Path

    from jaxpar.adapters import remat_policy

    spec = importlib.util.spec_from_file_location(
        "patch_attention", Path(__file__).resolve().parents[1] / "examples" / "patch_attention.py")
    pa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pa)

    class Net(pa.PatchAttentionNet):
        def __init__(self, made_in):
            super().__init__(layers=2, rngs=nnx.Rngs(0))
            self.made_in = made_in
            self.policy = remat_policy("offload")     # outside a step: full remat (nothing saved)

        def __call__(self, images):
            x = self.stem(images)
            x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos[...]
            policy = remat_policy("offload") if self.made_in == "call" else self.policy
            x = jaxpar.scan_blocks(self.blocks, x, remat=policy)
            return self.head(self.norm(x).mean(axis=1)).astype(np.float32)

    def run(made_in, strategy):
        mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
        tx = optax.adam(1e-3)
        state, layout = jaxpar.init_train_state(lambda: Net(made_in), tx, mesh, strategy)
        step = jaxpar.make_train_step(pa.loss, tx, layout)
        batch = jaxpar.shard_batch(pa.batches(0, batch_size=8, seed=0), mesh)
        state, metrics = step(state, batch)
        return float(metrics["loss"]), jax.device_get(state.params), step, state, batch

    offload = jaxpar.Strategy(offload=Offload(activations=(LAYER_INPUT,)))
    full = run("init", jaxpar.Strategy())
    off = run("call", offload)
    assert off[0] == full[0]
    _assert_same(off[1], full[1])
    jaxpr = str(off[2].programs["step"].trace(off[3], off[4]).jaxpr)
    assert "devices=(MemorySpace.Host,)" in jaxpr
    with pytest.raises(jaxpar.OffloadError, match=r"a model of your own.*made once in __init__, it saves nothing"):
        run("init", offload)


def test_relaxed_synchronisation_and_the_host_update_under_weight_stashing_are_refused():
    from jaxpar.parallel.sync import synchronous

    with pytest.raises(jaxpar.OffloadError, match="Strategy.offload='offload-opt' with Strategy.sync"):
        _setup({"replica": 2, "data": 4}, jaxpar.Strategy(sync=synchronous(), offload=Offload(optimizer=True)))
    with pytest.raises(jaxpar.OffloadError, match=r"offload.update='host' with schedule='pipedream' on pipe=2.*update='device'"):
        _setup({"pipe": 2, "data": 2}, jaxpar.Strategy(schedule="pipedream", microbatches=2, offload=HOST_UPDATE))


def test_checkpoints_restore_bit_exact_across_offload_and_meshes():
    """Saved with the optimizer state and the master weights on the host (DP8), restored without offload
    onto FSDP4, with offload onto DP8, and with the optimizer state alone offloaded onto DP2 x FSDP2."""
    from jaxpar.run import Checkpointer

    off = jaxpar.Strategy(offload=OPT_MASTER)
    state, _, step = _setup({"data": 8}, off)
    state, _ = step(state, make_batch(ROWS, CFG, seed=0))
    saved = jax.device_get(state)
    _, _, again = _setup({"data": 8}, off)
    want_loss = float(again(state, make_batch(ROWS, CFG, seed=1))[1]["loss"])     # the run, uninterrupted
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(d, async_save=False) as ck:
            ck.save(1, state, {}, wait=True)
        for sizes, strategy in (({"fsdp": 4}, jaxpar.Strategy()), ({"data": 8}, off),
                                ({"data": 2, "fsdp": 2}, jaxpar.Strategy(offload=Offload(optimizer=True)))):
            _, layout, step2 = _setup(sizes, strategy)
            with Checkpointer(d, async_save=False) as ck:
                restored = ck.restore(layout).state
            _assert_same(jax.device_get(restored), saved)
            fields = strategy.offload.fields if strategy.offload else ()
            for f in ("params", "opt_state"):
                assert _kinds(restored, f) == {"pinned_host" if f in fields else "device"}, (sizes, f)
            _, metrics = step2(restored, make_batch(ROWS, CFG, seed=1))
            np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)


def test_yaml_parallel_offload_builds_the_strategy_and_names_its_keys():
    from jaxpar.config._build import build_strategy
    from jaxpar.config._schema import ParallelConfig

    built = build_strategy(ParallelConfig(offload={"optimizer": True, "activations": [LAYER_INPUT]}))
    assert built.offload == Offload(optimizer=True, activations=(LAYER_INPUT,))
    assert build_strategy(ParallelConfig()).offload is None
    assert build_strategy(ParallelConfig(offload={"optimizer": True, "update": "host"})).offload.update == "host"
    with pytest.raises(jaxpar.ConfigError, match=r"parallel.offload has unknown keys \['optimiser'\]"):
        build_strategy(ParallelConfig(offload={"optimiser": True}))
    with pytest.raises(jaxpar.ConfigError, match=r"parallel.offload.master='yes': must be True or False"):
        build_strategy(ParallelConfig(offload={"master": "yes"}))
