"""Context parallelism in the train step: the GPT (jaxpar.attention.attention) and a small model of a
user's own (GQA, packed sequences, a full mask) trained over a ``context`` axis match one device
(losses and the first step's gradients, fp32 1e-5), alone and with data, ZeRO-3 / fsdp and tensor;
the compiled step's collectives are the method's; its temporaries fall with C; and what cannot run
is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import Strategy
from jaxpar.analysis import collectives
from jaxpar.attention import attention
from jaxpar.options import ContextParallel
from jaxpar.parallel.context import ContextParallelError, in_sequence_order, sequence_order
from jaxpar.models import GPT, GPTConfig, lm_loss

from conftest import need_devices

LR, STEPS = 0.1, 3
CFG = GPTConfig(vocab=64, seq_len=32, embed=32, heads=4, layers=2)


def _gpt():
    return GPT(CFG, rngs=nnx.Rngs(0))


def _gpt_batch(i, rows=8, length=32):
    t = np.random.default_rng(i).integers(0, 64, (rows, length + 1)).astype(np.int32)
    return {"tokens": t[:, :-1], "targets": t[:, 1:]}


class Packed(nnx.Module):
    """A user's own model: token embedding, one GQA attention layer over packed sequences (``segment_ids``,
    no causal mask), learned positions, a head. It lays its sequence out by jaxpar.parallel.context's order."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Param(init(rngs.params(), (32, 16)))
        self.pos = nnx.Param(init(rngs.params(), (16, 16)))
        self.q = nnx.Param(nnx.with_partitioning(init, ("embed", "heads", None))(rngs.params(), (16, 4, 4)))
        self.kv = nnx.Param(nnx.with_partitioning(init, (None, "embed", "heads", None))(rngs.params(), (2, 16, 2, 4)))
        self.out = nnx.Param(init(rngs.params(), (4, 4, 32)))

    def __call__(self, tokens, segments):
        x = self.embed[...][tokens] + in_sequence_order(self.pos[...][: tokens.shape[1]], 0)
        q = jnp.einsum("btd,dhk->bthk", x, self.q[...])
        k, v = (jnp.einsum("btd,dhk->bthk", x, self.kv[...][i]) for i in range(2))
        y = attention(q, k, v, causal=False, segment_ids=segments)
        return jnp.einsum("bthk,hkv->btv", y, self.out[...])


def packed_loss(model, batch):
    sequence_order(batch["tokens"].shape[1])          # the loss lays the sequence out in the step's order
    tokens, targets, segments = (in_sequence_order(batch[k]) for k in ("tokens", "targets", "segments"))
    logp = jax.nn.log_softmax(model(tokens, segments), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, 32), axis=-1))


def _packed_batch(i):
    rng = np.random.default_rng(100 + i)
    tokens = rng.integers(0, 32, (4, 17)).astype(np.int32)
    cuts = np.sort(rng.integers(1, 16, (4, 2)), axis=1)          # three packed documents per row
    segments = (np.arange(16)[None] >= cuts[:, :1]).astype(np.int32) + (np.arange(16)[None] >= cuts[:, 1:])
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segments": segments.astype(np.int32)}


MODELS = {"gpt": (_gpt, lm_loss, _gpt_batch), "packed": (lambda: Packed(nnx.Rngs(1)), packed_loss, _packed_batch)}


def _train(model, axes, strategy):
    """Three SGD steps' losses, and the first batch's gradient at the initial parameters (computed by
    the step's own gradient function, traced as the step traces it)."""
    from jaxpar.step._grads import global_grads
    from jaxpar.step._program import strategy_context

    model_fn, loss_fn, batch_fn = MODELS[model]
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    tx = optax.sgd(LR)
    state, layout = jaxpar.init_train_state(model_fn, tx, mesh, strategy)
    grad_fn = global_grads(loss_fn, layout)

    def first_grads(params, batch):
        with strategy_context(layout):
            return grad_fn(params, batch)[1]

    grads = jax.device_get(jax.jit(first_grads)(state.params, jaxpar.shard_batch(batch_fn(0), mesh)))
    step = jaxpar.make_train_step(loss_fn, tx, layout)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, jaxpar.shard_batch(batch_fn(i), mesh))
        losses.append(float(metrics["loss"]))
    return losses, grads, step, state, mesh


@pytest.fixture(scope="module")
def references():
    return {m: _train(m, {"data": 1}, Strategy())[:2] for m in MODELS}


def _ring(**kw):
    return ContextParallel("ring", **kw)


CASES = {
    "gpt-cp2-ring": ("gpt", {"context": 2}, Strategy(context=_ring())),
    "gpt-cp8-ring-balanced": ("gpt", {"context": 8}, Strategy(context=_ring(balance=True))),
    "gpt-cp4-allgather-balanced-dp2": ("gpt", {"data": 2, "context": 4},
                                       Strategy(context=ContextParallel("all_gather", balance=True))),
    "gpt-cp2-ulysses-tp2-dp2": ("gpt", {"data": 2, "context": 2, "tensor": 2},
                                Strategy(context=ContextParallel("ulysses"))),
    "gpt-cp4-ring-balanced-fsdp2-zero3": ("gpt", {"fsdp": 2, "context": 4}, Strategy(zero=3, context=_ring(balance=True))),
    "gpt-cp4-allgather-balanced-pipe2-1f1b": ("gpt", {"pipe": 2, "context": 4},
                                              Strategy(microbatches=2, context=ContextParallel("all_gather", True))),
    "gpt-cp2-ulysses-dp2-pipe2-1f1b": ("gpt", {"pipe": 2, "data": 2, "context": 2},
                                       Strategy(microbatches=2, context=ContextParallel("ulysses"))),
    "gpt-cp4-ring-balanced-pipe2-1f1b": ("gpt", {"pipe": 2, "context": 4},
                                         Strategy(microbatches=2, context=_ring(balance=True))),
    "gpt-cp2-ring-dp2-pipe2-gpipe": ("gpt", {"pipe": 2, "data": 2, "context": 2},
                                     Strategy(microbatches=4, schedule="gpipe", context=_ring())),
    "packed-cp4-ring-balanced": ("packed", {"context": 4}, Strategy(context=_ring(balance=True))),
    "packed-cp2-ulysses-dp2": ("packed", {"data": 2, "context": 2}, Strategy(context=ContextParallel("ulysses"))),
    "packed-cp4-allgather-dp2": ("packed", {"data": 2, "context": 4}, Strategy(context=ContextParallel("all_gather"))),
}


#: In the exhaustive tier: a second case of what the default pass already runs.
SLOW = {"gpt-cp2-ring-dp2-pipe2-gpipe", "gpt-cp2-ulysses-dp2-pipe2-1f1b", "gpt-cp2-ring",
        "gpt-cp4-allgather-balanced-pipe2-1f1b", "gpt-cp8-ring-balanced",
        "gpt-cp4-ring-balanced-pipe2-1f1b", "packed-cp4-allgather-dp2", "packed-cp4-ring-balanced",
        "gpt-cp2-ulysses-tp2-dp2"}


@need_devices(8)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.exhaustive) if c in SLOW else c for c in CASES])
def test_context_parallel_training_matches_one_device(case, references):
    model, axes, strategy = CASES[case]
    ref_losses, ref_grads = references[model]
    losses, grads, *_ = _train(model, axes, strategy)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))),
                                   err_msg=jax.tree_util.keystr(path))


def _compiled(axes, strategy, length=32):
    cfg = GPTConfig(vocab=64, seq_len=length, embed=32, heads=4, layers=2)
    n = int(np.prod(list(axes.values())))
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n])
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)
    return step.lower(state, jaxpar.shard_batch(_gpt_batch(0, length=length), mesh)).compile(), mesh


@need_devices(8)
@pytest.mark.parametrize("method", ["ring", "all_gather", "ulysses"])
def test_the_compiled_step_runs_the_methods_collectives_over_context(method):
    compiled, mesh = _compiled({"context": 4}, Strategy(context=ContextParallel(method, balance=method != "ulysses")))
    rows = [r for r in collectives(compiled.as_text(), mesh) if r.axes and "context" in r.axes]
    kinds = {}
    for r in rows:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
        assert tuple(r.axes) == ("context",), r
    if method == "ring":      # per layer (the scan's body): C-1 hops forward, C backward; no gathered K/V
        assert kinds.get("collective-permute") == 2 * 4 - 1, kinds
        assert all(r.in_loop for r in rows if r.kind == "collective-permute"), rows
        assert not [r for r in rows if r.kind == "all-gather" and r.in_loop], rows   # no K/V gathered
        # besides: the layers' weight gradients summed over context, wpe's gathered once
        assert set(kinds) <= {"collective-permute", "all-reduce", "all-gather"}, kinds
    elif method == "all_gather":
        assert kinds.get("all-gather", 0) >= 2 and kinds.get("reduce-scatter", 0) >= 2, kinds
    else:
        assert kinds.get("all-to-all", 0) >= 8, kinds


@pytest.mark.exhaustive
@need_devices(8)
def test_temporaries_fall_with_the_context_axis():
    """At a fixed sequence (1024 tokens), the compiled step's temporaries on one device of CP 8 (ring,
    balanced) are at most 1/6 of one device's."""
    one, _ = _compiled({"data": 1}, Strategy(), length=1024)
    cp8, _ = _compiled({"context": 8}, Strategy(context=_ring(balance=True)), length=1024)
    t1, t8 = one.memory_analysis().temp_size_in_bytes, cp8.memory_analysis().temp_size_in_bytes
    assert t8 <= t1 / 6, (t1, t8)


def _plain_loss(model, batch):        # a loss that never calls jaxpar.attention.attention
    return jnp.mean(model.embed(batch["tokens"]) ** 2)


@need_devices(4)
@pytest.mark.parametrize("loss_fn, strategy, match", [
    (_plain_loss, Strategy(), "never called jaxpar.attention.attention"),
    (lambda m, b: jnp.mean(attention(*(m.embed(b["tokens"])[:, :, None],) * 3)), Strategy(context=_ring(balance=True)),
     "never asked for that order"),
])
def test_a_loss_that_ignores_the_context_axis_is_refused(loss_fn, strategy, match):
    mesh = jaxpar.make_mesh({"context": 4}, devices=jax.devices()[:4])
    state, layout = jaxpar.init_train_state(_gpt, optax.sgd(LR), mesh, strategy)
    step = jaxpar.make_train_step(loss_fn, optax.sgd(LR), layout)
    with pytest.raises(ContextParallelError, match=match):
        step(state, jaxpar.shard_batch(_gpt_batch(0), mesh))


@need_devices(8)
@pytest.mark.parametrize("axes, strategy, match", [
    ({"context": 8}, Strategy(context=_ring(balance=True)), r"not divisible by 16"),
    ({"context": 8}, Strategy(context=ContextParallel("ulysses")), "heads"),
])
def test_shapes_the_context_axis_cannot_split_are_named(axes, strategy, match):
    cfg = GPTConfig(vocab=64, seq_len=24, embed=32, heads=4, layers=2)
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:8])
    state, layout = jaxpar.init_train_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(LR), mesh, strategy)
    step = jaxpar.make_train_step(lm_loss, optax.sgd(LR), layout)
    with pytest.raises(ContextParallelError, match=match):
        step(state, jaxpar.shard_batch(_gpt_batch(0, length=24), mesh))


@need_devices(8)
def test_the_ring_in_a_pipeline_stage_hops_by_all_gather_on_cpu():
    """XLA:CPU runs every collective-permute as one rendezvous over all devices, so inside a stage's
    conditional the ring's hops would meet the other stage's activation transfer: there each hop is
    an all-gather over context (jaxpar.parallel.context._ring, ``hop``); the only permutes left are over pipe."""
    compiled, mesh = _compiled({"pipe": 2, "context": 4}, Strategy(microbatches=2, context=_ring(balance=True)))
    rows = collectives(compiled.as_text(), mesh)
    permutes = {tuple(r.axes) for r in rows if r.kind == "collective-permute"}
    assert permutes == {("pipe",)}, permutes
    assert [r for r in rows if r.kind == "all-gather" and tuple(r.axes or ()) == ("context",)], rows

