"""A pipeline stage whose loss gathers along the tensor-split vocabulary (issue 87, "No abort from a loss").

The user's model: a character LM (nnx.Embed, stacked blocks with a fused ``qkv`` split by ``jnp.split``, a
head annotated ``("embed", "vocab")``) with the usual integer-label cross-entropy,
``jnp.take_along_axis(logp, targets[..., None], -1)``. On pipe2 x data2 x tensor2, 1F1B, 4 micro-batches,
XLA's SPMD partitioner aborted the process on that batched gather inside the stage's ``shard_map``
(``spmd_partitioner_util.cc`` ``Check failed``). The stage now reads the gathered dimension whole
(:mod:`jaxpar.parallel.pipeline._gathers`): the user's case trains and equals one device; the rewrite is
checked on its jaxpr (no compile), and a batched gather it cannot reach (inside a ``lax.scan``) is refused by
name while the step traces.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters._loss_metrics import collect_metrics
from jaxpar.parallel.pipeline._gathers import whole_indexed_dims

from conftest import need_devices
from helpers import RunResult, assert_runs_match, keep_grads

MESH = {"pipe": 2, "data": 2, "tensor": 2}
VOCAB, SEQ, BATCH, LR, STEPS = 32, 8, 16, 1e-3, 2
_init = nnx.initializers


def _named(init, *names):
    return nnx.with_partitioning(init, names)


def _norm(embed: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(embed, scale_init=_named(_init.ones_init(), "embed"),
                         bias_init=_named(_init.zeros_init(), "embed"), rngs=rngs)


def _linear(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, kernel_init=_named(_init.lecun_normal(), *names),
                      bias_init=_named(_init.zeros_init(), names[-1]), rngs=rngs)


class Block(nnx.Module):
    """Pre-norm attention with one ``qkv`` projection cut by ``jnp.split``, and an MLP."""

    def __init__(self, embed: int, heads: int, mlp: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1, self.ln2 = _norm(embed, rngs), _norm(embed, rngs)
        self.qkv = _linear(embed, 3 * embed, ("embed", "mlp"), rngs)
        self.out = _linear(embed, embed, ("mlp", "embed"), rngs)
        self.up = _linear(embed, mlp, ("embed", "mlp"), rngs)
        self.down = _linear(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, e = x.shape
        q, k, v = (a.reshape(b, t, self.heads, e // self.heads) for a in jnp.split(self.qkv(self.ln1(x)), 3, -1))
        x = x + self.out(nnx.dot_product_attention(q, k, v).reshape(b, t, e))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
    """Tokens ``[B, T]`` -> logits ``[B, T, vocab]``; the head's vocabulary split over ``tensor``."""

    def __init__(self, *, vocab: int = VOCAB, embed: int = 16, heads: int = 4, mlp: int = 32, layers: int = 2,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, embed, embedding_init=_named(_init.normal(0.02), "vocab", "embed"), rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r: nnx.Rngs) -> Block:
            return Block(embed, heads, mlp, r)

        self.blocks = stack(rngs)
        self.norm = _norm(embed, rngs)
        self.head = _linear(embed, vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.norm(jaxpar.scan_blocks(self.blocks, self.embed(tokens))))


def loss(model: CharLM, batch: dict) -> jax.Array:
    """The usual integer-label cross-entropy: a batched gather of the targets' log-probabilities."""
    logp = jax.nn.log_softmax(model(batch["tokens"]), -1)
    return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()


def _batch() -> dict:
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _train(sizes: dict, strategy: jaxpar.Strategy) -> RunResult:
    """``STEPS`` AdamW steps on one batch, the first step's gradients kept (tests/helpers.py's standards)."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:1] if not sizes else None)
    tx = optax.chain(keep_grads(), optax.adamw(LR, weight_decay=0.1))
    state, layout = jaxpar.init_train_state(lambda: CharLM(rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(loss, tx, layout, strategy)
    batch, losses, grads = jaxpar.shard_batch(_batch(), mesh), [], None
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads = jax.device_get(state.opt_state[0].grads) if grads is None else grads
    return RunResult(np.array(losses), jax.device_get(state.params), grads, LR, STEPS)


@need_devices(8)
@pytest.mark.slow
def test_integer_label_loss_on_a_vocab_split_head_in_a_pipeline_equals_one_device():
    """pipe2 x data2 x tensor2, 1F1B, 4 micro-batches: trains (no abort) and equals one device."""
    assert_runs_match(_train(MESH, jaxpar.Strategy(microbatches=4)), _train({}, jaxpar.Strategy()))


def _logp_and_targets():
    return jnp.zeros((4, SEQ, VOCAB)), jnp.zeros((4, SEQ), jnp.int32)


@need_devices(8)
def test_a_batched_gather_reads_its_indexed_dimension_whole_in_a_stage():
    """Under the rules of a split mesh, take_along_axis's and optax's gathers get their operand constrained
    whole along the vocabulary (the rest left to XLA), and the loss's metrics still reach the step; without
    rules nothing changes. Nothing compiles."""
    mesh = jaxpar.make_mesh(MESH)
    post = lambda logp, t: -jnp.take_along_axis(logp, t[..., None], -1).mean()   # noqa: E731
    labels = lambda logp, t: optax.softmax_cross_entropy_with_integer_labels(logp, t).mean()   # noqa: E731

    def constraints(fn):
        text = str(jax.make_jaxpr(whole_indexed_dims(fn, "post"))(*_logp_and_targets()))
        return text.count("spec=P(UNCONSTRAINED, UNCONSTRAINED, None)")

    def reporting(logp, t):
        jaxpar.report_metric("fit/logp_mean", logp.mean())
        return post(logp, t)

    with jaxpar.use_rules(mesh, (("batch", "data"), ("vocab", "tensor"))):
        assert constraints(post) == 1 and constraints(labels) == 1
        with collect_metrics() as found:       # what the loss reports comes out of the rewrite
            assert constraints(reporting) == 1
    whole = (("batch", "data"), ("length", None), ("vocab", None))
    with jaxpar.use_rules(mesh, whole):      # a whole vocabulary: jaxpar's loss picks the targets by a gather,
        own = lambda logits, t: jaxpar.parallel.cross_entropy(logits, t)   # noqa: E731
        assert "gather" in str(jax.make_jaxpr(own)(*_logp_and_targets()))
        assert constraints(own) == 0     # inside its custom derivative: left as it is, neither pinned nor refused
    assert list(found) == ["fit/logp_mean"]
    assert constraints(post) == 0        # no rules: one device


@need_devices(8)
def test_a_batched_gather_inside_a_scan_is_refused_by_name_before_compiling():
    """A gather the rewrite cannot reach: a PipelineCutError naming it and the fixes, while the step traces."""
    def scanned(model: CharLM, batch: dict) -> jax.Array:
        logp = jax.nn.log_softmax(model(batch["tokens"]), -1)
        pick = lambda c, x: (c - jnp.take_along_axis(x[0], x[1][..., None], -1).mean(), None)   # noqa: E731
        return jax.lax.scan(pick, 0.0, (logp[None], batch["targets"][None]))[0]

    start, tx, strategy = time.monotonic(), optax.sgd(LR), jaxpar.Strategy(microbatches=4)
    layout = jaxpar.state_layout(lambda: CharLM(rngs=nnx.Rngs(0)), tx, jaxpar.make_mesh(MESH), strategy)
    step = jaxpar.make_train_step(scanned, tx, layout, strategy)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _batch())
    with pytest.raises(jaxpar.PipelineCutError, match=r"post part .* gathers along dimension\(s\) \(2,\) of a "
                                                      r"float32\[4,8,32\] value .* inside a scan.*one-hot.*"
                                                      r"linear_cross_entropy.*\('embed', None\)"):
        step.lower(layout.abstract_state(), batch)
    assert time.monotonic() - start < 10
