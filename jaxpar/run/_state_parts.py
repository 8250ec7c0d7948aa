"""A checkpoint's JSON record of the train state's optional parts, and what a restore does with each.

A save records each part's shapes (:func:`record_shapes`: ``<name>_shapes``), the layout its values
are laid out for when the saver passed one (:func:`record_layouts`: ``<name>_layout``) and which ``nnx.List`` s
of layers were saved stacked (:func:`lists_record`); a restore does with each part what the step's restore
policy of that part says (:data:`jaxpar.step.RESTORE_POLICIES`, :func:`plan_parts`: restore, drop, or start
afresh with a warning), for :mod:`jaxpar.run._checkpoint`. The policy: docs/training.md.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.step._state import TrainState
    >>> abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, ())
    >>> plans = plan_parts({"codec_shapes": {"residual": [4, 2]}}, abstract, abstract, "checkpoint 7")
    >>> [(p.part.name, p.action) for p in plans]
    [('codec', 'drop'), ('sync', 'empty'), ('stats', 'empty'), ('versions', 'empty')]
    >>> state = TrainState(jnp.int32(4), {"w": jnp.zeros(2)}, (), codec={"residual": jnp.zeros((4, 2))})
    >>> record_shapes(state)            # sync only when kept, stats and versions always
    {'codec_shapes': {'residual': [4, 2]}, 'stats_shapes': [], 'versions_shapes': []}
    >>> record_layouts(None, state)     # no layout given: shapes only
    {}
    >>> saved_lists({"layer_lists": [[["blocks"], 2]]})
    {('blocks',): 2}
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpar.step import RESTORE_POLICIES, PartPlan, shapes_of


def plan_parts(meta: dict, abstract: Any, target: Any, where: str) -> list[PartPlan]:
    """What a restore does with each optional part of ``abstract`` (:meth:`jaxpar.step.RestorePolicy.plan`).

    Args:
      meta: the checkpoint's record (``codec_shapes``, ``codec_layout``, ...).
      abstract: the restore target's abstract state (a ``TrainState`` of ``ShapeDtypeStruct``).
      target: what ``restore`` was given: a ``StateLayout`` (its layout records are compared)
        or the abstract state itself (shapes compared only).
      where: the checkpoint, for the messages.

    Returns:
      One :class:`PartPlan` per part that ``abstract`` has.
    """
    fields = getattr(abstract, "_fields", ())
    return [part.plan(meta, getattr(abstract, part.name), target, where) for part in RESTORE_POLICIES
            if part.name in fields]


#: Written into every checkpoint's JSON record; a restore reads this format only (there are no upgraders:
#: jaxpar has not been released).
FORMAT = "jaxpar-checkpoint-3"


def lists_record(layout: Any) -> dict:
    """The ``layer_lists`` record of a checkpoint saved with ``layout``.

    Args:
      layout: the state's :class:`~jaxpar.step.StateLayout`, or ``None``.

    Returns:
      ``{"layer_lists": [[path, count], ...]}`` for the ``nnx.List`` s run stacked, or ``{}``
      (none, or no layout).
    """
    lists = getattr(layout, "layer_lists", None) if hasattr(layout, "strategy") else None
    return {"layer_lists": [[list(path), int(n)] for path, n in lists.items()]} if lists else {}


def saved_lists(meta: dict) -> dict[tuple, int]:
    """The ``nnx.List`` s a checkpoint keeps stacked.

    Args:
      meta: the checkpoint's JSON record.

    Returns:
      ``{path: count}`` from its ``layer_lists`` record (empty without one).
    """
    return {tuple(path): int(n) for path, n in meta.get("layer_lists") or []}


def record_shapes(state: Any) -> dict:
    """The part shapes a checkpoint of ``state`` records, so that a restore onto other replicas
    or another layout sees them.

    Args:
      state: the train state being saved (another tree: nothing).

    Returns:
      ``{"<name>_shapes": ...}`` for each part ``state`` keeps, and for ``stats`` and
      ``versions`` also when it keeps none (``[]``).
    """
    out = {}
    for part in RESTORE_POLICIES:
        value = getattr(state, part.name, ())
        if jax.tree.leaves(value) or (part.shapes_always and hasattr(state, part.name)):
            out[f"{part.name}_shapes"] = shapes_of(value)
    return out


def record_layouts(layout: Any, state: Any) -> dict:
    """The layout records of a checkpoint of ``state`` (:meth:`jaxpar.step.RestorePolicy.record`).

    Args:
      layout: the state's :class:`~jaxpar.step.StateLayout`, or ``None``.
      state: the train state being saved.

    Returns:
      ``{"codec_layout": ..., "sync_layout": ..., "versions_layout": ...}`` for the parts
      ``state`` has; empty without a layout. A part whose shapes are not the layout's is left
      out (the layout describes another state).
    """
    if not hasattr(layout, "strategy"):       # None, or no layout
        return {}
    out, abstract = {}, layout.abstract_state()
    for part in RESTORE_POLICIES:
        value = getattr(state, part.name, ())
        if jax.tree.leaves(value) and shapes_of(value) == shapes_of(getattr(abstract, part.name)):
            record = part.record(layout)
            if record is not None:
                out[f"{part.name}_layout"] = record
    return out
