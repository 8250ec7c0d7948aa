"""What a checkpoint's JSON record holds, the formats a restore reads, and how an older record maps
onto today's parts.

For each optional part of the train state (:data:`jaxpar.run._state_parts.STATE_PARTS`) a record
holds its shapes (:func:`record_shapes`: ``codec_shapes``, ``sync_shapes``, ``stats_shapes``,
``versions_shapes``) and, when the saver passed the layout, the layout its values are laid out for
(:func:`record_layouts`: ``codec_layout``, ``sync_layout``, ``versions_layout``).

Format 2 (written now) records each optional part of the train state under its own name:
``codec`` (a gradient codec's state) and ``sync`` (relaxed synchronisation's replicas or
history), beside ``stats`` and ``versions``. Format 1 kept the first two in one ``comm`` part,
told apart by its record: :func:`upgrade_record` says which part a format-1 ``comm`` is, so
that :class:`~jaxpar.run.Checkpointer` restores it there. A record of ``jaxpar train`` also
holds ``schedule``: the run's ``train.steps`` (``steps``) and the learning rate of the step it resumes
at (``lr``), which :func:`jaxpar.run._resume.resume` compares; records written before it have none and
restore alike. Beside the parts' own entries (:mod:`jaxpar.run._state_parts`), a record says which
``nnx.List`` s of layers the parameters were saved stacked (``layer_lists``: :func:`lists_record`,
:func:`saved_lists`).

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.step._state import TrainState
    >>> state = TrainState(jnp.int32(4), {"w": jnp.zeros(2)}, (), codec={"residual": jnp.zeros((4, 2))})
    >>> record_shapes(state)            # sync only when kept, stats and versions always
    {'codec_shapes': {'residual': [4, 2]}, 'stats_shapes': [], 'versions_shapes': []}
    >>> record_layouts(None, state)     # no layout given: shapes only
    {}
    >>> old = {"format": "jaxpar-checkpoint-1", "step": 4, "comm_shapes": {"params": {"w": [2, 3]}},
    ...        "comm_layout": {"kind": "replicas", "sync": "diloco"}}
    >>> meta, renames = upgrade_record(old)
    >>> meta["sync_shapes"], meta["sync_layout"], renames
    ({'params': {'w': [2, 3]}}, {'sync': 'diloco'}, {'sync': 'comm'})
    >>> upgrade_record({"format": FORMAT, "step": 4})[1]
    {}
    >>> saved_lists({"layer_lists": [[["blocks"], 2]]})
    {('blocks',): 2}
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpar.run._state_parts import STATE_PARTS, shapes_of

#: Written into every checkpoint's JSON record.
FORMAT = "jaxpar-checkpoint-2"
#: The formats a restore reads.
READABLE = ("jaxpar-checkpoint-1", FORMAT)

_SYNC_KEYS = {"params", "opt", "history"}     # relaxed synchronisation's state (jaxpar.step._relaxed)


def upgrade_record(meta: dict) -> tuple[dict, dict[str, str]]:
    """A checkpoint's record in today's part names.

    Args:
      meta: the checkpoint's JSON record.

    Returns:
      ``(record, renames)``: ``renames`` maps a part of today's train state to the name it
      was saved under (``{"codec": "comm"}`` or ``{"sync": "comm"}`` for a format-1
      checkpoint with such a part; empty otherwise).
    """
    if "comm_shapes" not in meta and "comm_layout" not in meta:
        return meta, {}
    meta = dict(meta)
    shapes, sig = meta.pop("comm_shapes", None), meta.pop("comm_layout", None)
    is_sync = (sig or {}).get("kind") == "replicas" or (isinstance(shapes, dict) and bool(_SYNC_KEYS & set(shapes)))
    name = "sync" if is_sync else "codec"
    if shapes is not None:
        meta[f"{name}_shapes"] = shapes
    if sig:
        meta[f"{name}_layout"] = {k: v for k, v in sig.items() if k != "kind"}
    return meta, {name: "comm"}


def lists_record(layout: Any) -> dict:
    """The ``layer_lists`` record of a checkpoint saved with ``layout``.

    Args:
      layout: the state's :class:`~jaxpar.step.StateLayout`, or ``None``.

    Returns:
      ``{"layer_lists": [[path, count], ...]}`` for the ``nnx.List`` s run stacked, or ``{}``
      (none, or no layout).
    """
    if layout is None or not hasattr(layout, "strategy"):
        return {}
    lists = getattr(layout, "layer_lists", None) or {}
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
    for part in STATE_PARTS:
        value = getattr(state, part.name, ())
        if jax.tree.leaves(value) or (part.shapes_always and hasattr(state, part.name)):
            out[f"{part.name}_shapes"] = shapes_of(value)
    return out


def record_layouts(layout: Any, state: Any) -> dict:
    """The layout records of a checkpoint of ``state`` (:meth:`~jaxpar.run._state_parts.StatePart.record`).

    Args:
      layout: the state's :class:`~jaxpar.step.StateLayout`, or ``None``.
      state: the train state being saved.

    Returns:
      ``{"codec_layout": ..., "sync_layout": ..., "versions_layout": ...}`` for the parts
      ``state`` has; empty without a layout. A part whose shapes are not the layout's is left
      out (the layout describes another state).
    """
    if layout is None or not hasattr(layout, "strategy"):
        return {}
    out, abstract = {}, layout.abstract_state()
    for part in STATE_PARTS:
        value = getattr(state, part.name, ())
        if jax.tree.leaves(value) and shapes_of(value) == shapes_of(getattr(abstract, part.name)):
            record = part.record(layout)
            if record is not None:
                out[f"{part.name}_layout"] = record
    return out
