"""The checkpoint formats a restore reads, and how an older record maps onto today's parts.

Format 2 (written now) records each optional part of the train state under its own name:
``codec`` (a gradient codec's state) and ``sync`` (relaxed synchronisation's replicas or
history), beside ``stats`` and ``versions``. Format 1 kept the first two in one ``comm`` part,
told apart by its record: :func:`upgrade_record` says which part a format-1 ``comm`` is, so
that :class:`~jaxpar.run.checkpoint.Checkpointer` restores it there. A record of ``jaxpar train`` also
holds ``schedule``: the run's ``train.steps`` (``steps``) and the learning rate of the step it resumes
at (``lr``), which :func:`jaxpar.run.resume.resume` compares; records written before it have none and
restore alike.

Example::

    >>> old = {"format": "jaxpar-checkpoint-1", "step": 4, "comm_shapes": {"params": {"w": [2, 3]}},
    ...        "comm_layout": {"kind": "replicas", "sync": "diloco"}}
    >>> meta, renames = upgrade_record(old)
    >>> meta["sync_shapes"], meta["sync_layout"], renames
    ({'params': {'w': [2, 3]}}, {'sync': 'diloco'}, {'sync': 'comm'})
    >>> upgrade_record({"format": FORMAT, "step": 4})[1]
    {}
"""

from __future__ import annotations

__all__ = ["FORMAT", "READABLE", "upgrade_record"]

#: Written into every checkpoint's JSON record.
FORMAT = "jaxpar-checkpoint-2"
#: The formats a restore reads.
READABLE = ("jaxpar-checkpoint-1", FORMAT)

_SYNC_KEYS = {"params", "opt", "history"}     # relaxed synchronisation's state (jaxpar.step.relaxed)


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
