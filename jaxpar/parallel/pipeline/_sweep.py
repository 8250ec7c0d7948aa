"""A forward-only pass of a cut model through the pipeline's stages: what the last virtual stage computes
from each micro-batch, summed over the micro-batches.

The train step runs it before the schedule when a loss needs a whole-step quantity that only a
forward gives, such as the MoE layers' load per expert (the load-balancing loss of every
micro-batch uses the step's load; :func:`jaxpar.parallel.moe.use_step_loads`). Each device keeps its
stages' layers, as in the schedule: no weight moves. Items ``(chunk c, micro-batch j)`` flow through
the ``p`` stages as a wave, stage ``s`` running item ``i = c * M + j`` at tick ``i + s`` (``M =
max(m, p)``, so that an item's previous chunk has left the last stage before the first stage
needs it); every tick ends with one ``ppermute`` to the next stage (the last stage's output wraps
to the first, which keeps it for the next chunk). It costs a forward of the model (about a third of
a step) and ``(v - 1) * M + m + p - 1`` ticks.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.parallel.pipeline import PipelineParts, to_stages
    >>> parts = PipelineParts(pre=lambda o, mb: mb["x"] * o, layer=lambda w, x: jnp.tanh(x @ w),
    ...                       post=lambda o, y, mb: jnp.mean(y))
    >>> mesh = jaxpar.make_mesh({"pipe": 2}, devices=jax.devices()[:2])
    >>> fn = pipeline_forward_sum(parts, mesh, (), lambda o, y, mb: jnp.sum(y, axis=0),
    ...                           stage_layers=(1, 1), chunks=1)
    >>> blocks, mbs = 0.5 * jnp.ones((2, 3, 3)), {"x": jnp.ones((4, 2, 3))}   # 2 layers; 4 micro-batches
    >>> total = jax.jit(fn)(jnp.float32(1.0), to_stages(blocks, (1, 1), p=2), mbs)
    >>> y = jnp.tanh(jnp.tanh(jnp.ones((2, 3)) @ blocks[0]) @ blocks[1])   # one micro-batch on one device
    >>> bool(jnp.allclose(total, 4 * jnp.sum(y, axis=0)))
    True
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.adapters._blocks import use_layer_runner
from jaxpar.rules import drop_axes, use_rules
from jaxpar.parallel.pipeline._buffers import put_tree, take, take_tree, zeros_like_tree
from jaxpar.parallel.pipeline._cut import PipelineParts
from jaxpar.parallel.pipeline._partition import check_blocks_layout
from jaxpar.parallel.pipeline._instructions import PIPE


def pipeline_forward_sum(parts: PipelineParts, mesh, rules, value: Callable, *, stage_layers: Sequence[int],
                         chunks: int = 1, lockstep: bool = False) -> Callable:
    """Build ``fn(outer, blocks, microbatches) -> sum over micro-batches of value(outer, y, mb)``.

    Args:
      parts: the cut model (``pre``, ``layer``; ``post`` is not run).
      mesh: the mesh (its ``pipe`` axis has the stages).
      rules: the logical rules (``pipe`` is dropped inside the stages).
      value: ``value(outer, y, mb) -> pytree of arrays`` on the last virtual stage's output ``y``.
      stage_layers: layers of each virtual stage ``k = chunk * p + stage``.
      chunks: virtual stages per device (interleaved schedules).
      lockstep: every stage runs every tick's item, ``pre``, its padding layers and ``value``, with
        their results masked (``jnp.where``) rather than skipped by a conditional whose predicate
        differs between the stages: the layers' collectives (sequence parallelism) are then reached
        by every device (as a lockstep :class:`~._stage.Stage` does for the pipeline's ticks).

    Returns:
      The function, with the arguments of :func:`~._executor.pipeline_value_and_grad`'s; its result is
      replicated over ``pipe``.
    """
    p, v = dict(mesh.shape)[PIPE], chunks
    counts = np.asarray(stage_layers, np.int32).reshape(v, p)

    def body(outer, blocks, mbs):
        sweep = _Sweep(parts, value, counts, outer, jax.tree.map(lambda a: a[:, 0], blocks), mbs, lockstep)
        ticks = (v - 1) * sweep.period + sweep.m + p - 1
        carry = (zeros_like_tree(sweep.x), jax.tree.map(lambda a: jnp.zeros((sweep.m + 1, *a.shape), a.dtype),
                                                        sweep.x), zeros_like_tree(sweep.out))
        (_, _, total), _ = jax.lax.scan(sweep.tick, carry, jnp.arange(ticks))
        return jax.tree.map(lambda a: jax.lax.psum(a, PIPE), total)       # the last stage's sums

    inner_rules = drop_axes(rules, (PIPE,))

    def fn(outer, blocks, mbs):
        check_blocks_layout(blocks, counts, stage_layers)
        specs = (jax.tree.map(lambda _: P(), outer), jax.tree.map(lambda _: P(None, PIPE), blocks),
                 jax.tree.map(lambda _: P(), mbs))
        smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE}, check_vma=False, in_specs=specs, out_specs=P())
        with use_rules(mesh, inner_rules), use_layer_runner(None):
            return smap(outer, blocks, mbs)

    return fn


def _masked(pred, yes: Callable, no: Callable, *args):
    """``lax.cond``'s result computed without a conditional: both branches run, ``jnp.where`` picks."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), yes(*args), no(*args))


class _Sweep:
    """One device's share of the sweep, traced inside the ``shard_map`` (see the module docstring)."""

    def __init__(self, parts: PipelineParts, value: Callable, counts: np.ndarray, outer: Any, blocks: Any, mbs: Any,
                 lockstep: bool = False):
        self.parts, self.value, self.outer, self.blocks, self.mbs = parts, value, outer, blocks, mbs
        self.cond = _masked if lockstep else jax.lax.cond
        self.v, self.p = counts.shape
        self.m = jax.tree.leaves(mbs)[0].shape[0]
        self.period, self.lmax = max(self.m, self.p), int(counts.max())
        self.s = jax.lax.axis_index(PIPE)
        self.n_layers = take(jnp.asarray(counts.T), self.s)      # [v]: real layers per chunk here
        mb0 = take_tree(mbs, 0)
        self.x = jax.eval_shape(parts.pre, outer, mb0)
        self.out = jax.eval_shape(value, outer, self.x, mb0)

    def item(self, i):
        """``(valid, chunk, micro-batch)`` of item ``i`` (a traced int)."""
        c, j = i // self.period, i % self.period
        valid = (i >= 0) & (c < self.v) & (j < self.m)
        return valid, jnp.clip(c, 0, self.v - 1), jnp.clip(j, 0, self.m - 1)

    def chunk(self, c, h):
        """Chunk ``c``'s layers on ``h`` (padding layers skipped)."""
        n, bp = self.n_layers[c], take_tree(self.blocks, c)

        def one(h, item):
            return self.cond(item[1] < n, lambda h: self.parts.layer(item[0], h), lambda h: h, h), None

        return jax.lax.scan(one, h, (bp, jnp.arange(self.lmax)))[0]

    def run(self, c, j, inbox, wrap, total):
        """Item ``(c, j)`` on this stage: its input (``pre``, the wrapped output of the previous chunk, or
        the inbox), the chunk's layers, and on the last virtual stage ``value`` added to ``total``."""
        s, mb = self.s, take_tree(self.mbs, j)
        kept = jax.tree.map(lambda w, x: jnp.where(s == 0, take(w, j), x), wrap, inbox)
        h = self.cond((s == 0) & (c == 0), lambda: self.parts.pre(self.outer, mb), lambda: kept)
        y = self.chunk(c, h)
        last = (s == self.p - 1) & (c == self.v - 1)
        add = lambda t: jax.tree.map(jnp.add, t, self.value(self.outer, y, mb))   # noqa: E731
        return y, self.cond(last, add, lambda t: t, total)

    def tick(self, carry, t):
        """Tick ``t``: this stage's item, then the send to the next stage; the first stage keeps what
        the last one sends for the next chunk (slot ``m``: discarded)."""
        inbox, wrap, total = carry
        valid, c, j = self.item(t - self.s)
        y, total = self.cond(valid, lambda tot: self.run(c, j, inbox, wrap, tot),
                             lambda tot: (zeros_like_tree(self.x), tot), total)
        received = jax.lax.ppermute(y, PIPE, [(k, (k + 1) % self.p) for k in range(self.p)])
        sent, c_sent, j_sent = self.item(t - (self.p - 1))             # what the last stage ran
        keep = (self.s == 0) & sent & (c_sent < self.v - 1)
        wrap = put_tree(wrap, jnp.where(keep, j_sent, self.m), received)
        return (received, wrap, total), None
