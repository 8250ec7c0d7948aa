"""Batched gathers in a pipeline stage read the dimensions they index whole.

A loss that picks each position's target from ``[batch, length, vocab]`` log-probabilities
(``jnp.take_along_axis(logp, targets[..., None], -1)``, optax's
``softmax_cross_entropy_with_integer_labels``) lowers to a *batched* gather: its operand's batch
dimensions are the indices' own (``operand_batching_dims``). With the vocabulary split over
``tensor`` (a head annotated ``("embed", "vocab")``) and the rows over the data axes, XLA's SPMD
partitioner splits such a gather by its batch dimensions, then by the split vocabulary (a local
gather and an all-reduce over ``tensor``); inside a pipeline stage, a ``shard_map`` manual over
``pipe``, the device groups of that all-reduce come out wrong and XLA aborts the process
(``spmd_partitioner_util.cc`` ``Check failed: partition_group_list.num_replica_groups() * ...``).

:func:`whole_indexed_dims` runs a stage's ``pre`` or ``post`` with the operand of each batched gather
constrained whole along the dimensions it indexes (its other dimensions left to XLA): the gather is
then split by its batch dimensions only, and the all-gather of the vocabulary before it is what a head
annotated ``("embed", None)`` would hold anyway. The values are the same; only the layout of that
operand changes. A batched gather inside control flow it cannot rewrite (a ``lax.scan``, ``lax.cond``,
``while_loop``) is refused by name, before anything compiles; one inside a function with a custom derivative
(``custom_jvp`` / ``custom_vjp``) is left as its author wrote it (:func:`jaxpar.parallel.cross_entropy` gathers
only where the vocabulary is whole).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend import core
from jax.extend.core import primitives as prims
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.adapters._loss_metrics import report_metric, with_reported_metrics
from jaxpar.errors import PipelineCutError
from jaxpar.rules import current_rules


def whole_indexed_dims(fn: Callable, part: str) -> Callable:
    """``fn`` with each batched gather's operand whole along the dimensions the gather indexes.

    Outside :func:`jaxpar.use_rules`, or where no mesh axis but the manual ones has a size > 1, and
    for a function without a batched gather, ``fn`` runs as it is.

    Args:
      fn: a stage's ``pre(outer, mb)`` or ``post(outer, y, mb)``; it may call
        :func:`jaxpar.report_metric` (the metrics are reported again after the rewrite).
      part: ``'pre'`` or ``'post'``, for the error.

    Returns:
      The function, with the same arguments and result.

    Raises:
      PipelineCutError: a batched gather inside a ``lax.scan`` / ``lax.cond`` / ``while_loop`` /
        or another transformation other than ``jit``, ``checkpoint`` and a custom derivative.
    """
    def run(*args):
        ctx = current_rules()
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        if ctx is None or all(size == 1 for axis, size in ctx[0].shape.items() if axis not in manual):
            return fn(*args)
        traced = with_reported_metrics(fn)
        closed, shape = jax.make_jaxpr(traced, return_shape=True)(*args)
        if not _has_batched_gather(closed.jaxpr):
            return fn(*args)
        out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), ctx[0], part)
        value, metrics = jax.tree.unflatten(jax.tree.structure(shape), out)
        for name, metric in metrics.items():
            report_metric(name, metric)
        return value

    return run


def _batched(eqn) -> bool:
    """Whether ``eqn`` is a gather with batch dimensions shared by operand and indices."""
    return eqn.primitive is prims.gather_p and bool(eqn.params["dimension_numbers"].operand_batching_dims)


def _custom(eqn) -> bool:
    """Whether ``eqn`` calls a function with a custom derivative: its gathers are its author's to lay out
    (:func:`jaxpar.parallel.cross_entropy` gathers only a whole vocabulary)."""
    return eqn.primitive.name.startswith("custom_")


def _has_batched_gather(jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in it, outside a custom derivative, holds a batched gather."""
    return any(_batched(eqn) or not _custom(eqn) and any(_has_batched_gather(getattr(sub, "jaxpr", sub))
                                                          for sub in core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _whole(x: jax.Array, dims: tuple, mesh) -> jax.Array:
    """``x`` constrained whole along ``dims``, its other dimensions left to XLA."""
    inner = jax.sharding.get_abstract_mesh()
    spec = P(*(None if d in dims else P.UNCONSTRAINED for d in range(x.ndim)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(inner if inner.manual_axes else mesh, spec))


def _eval(jaxpr, consts, args, mesh, part: str) -> list:
    """Evaluate ``jaxpr`` with each batched gather's operand whole along its indexed dimensions
    (into nested ``jit`` s and ``checkpoint`` s)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]   # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        nested = [getattr(sub, "jaxpr", sub) for sub in core.jaxprs_in_params(eqn.params)]
        if _batched(eqn):
            ins[0] = _whole(ins[0], tuple(eqn.params["dimension_numbers"].start_index_map), mesh)
            outs = [eqn.primitive.bind(*ins, **eqn.params)]
        elif not any(_has_batched_gather(sub) for sub in nested) or _custom(eqn):
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        elif eqn.primitive in (prims.jit_p, prims.closed_call_p):
            inner = eqn.params["jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"]
            outs = _eval(inner.jaxpr, inner.consts, ins, mesh, part)
        elif eqn.primitive.name == "checkpoint":             # jax.checkpoint / nnx.remat
            p, inner = eqn.params, eqn.params["jaxpr"]
            body = lambda *a, inner=inner: _eval(inner, (), a, mesh, part)   # noqa: E731
            outs = list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*ins))
        else:
            raise PipelineCutError(_refusal(eqn, nested, part))
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _refusal(eqn, nested: list, part: str) -> str:
    """The error for a batched gather that :func:`_eval` cannot reach inside ``eqn``."""
    gather = next(_gathers(nested))
    operand, dims = gather.invars[0].aval, tuple(gather.params["dimension_numbers"].start_index_map)
    return (f"pipeline: the model's {part} part (the loss around the stacked layers) gathers along dimension(s) "
            f"{dims} of a {operand.str_short()} value (a jnp.take_along_axis / integer-label cross-entropy) inside "
            f"a {eqn.primitive.name}, where jaxpar cannot lay the gathered dimension out whole; with that dimension "
            "split over a mesh axis (a head annotated ('embed', 'vocab') on a 'tensor' axis) XLA's partitioner "
            "aborts the process inside a pipeline stage. Take the gather out of the "
            f"{eqn.primitive.name}, or pick the targets with a one-hot product (-jnp.sum(logp * "
            "jax.nn.one_hot(targets, vocab), -1)), or use jaxpar.parallel.linear_cross_entropy(x, head, targets) "
            "(the vocabulary stays split), or annotate the head ('embed', None).")


def _gathers(jaxprs: list):
    """The batched gathers in ``jaxprs`` and the jaxprs nested in them, outermost first."""
    for jaxpr in jaxprs:
        for eqn in jaxpr.eqns:
            if _batched(eqn):
                yield eqn
            yield from _gathers([getattr(sub, "jaxpr", sub) for sub in core.jaxprs_in_params(eqn.params)])
