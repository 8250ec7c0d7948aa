"""What a restore does with the parts of a train state that depend on the run's settings
(used by :mod:`jaxpar.run.checkpoint`).

``TrainState.codec`` (a gradient codec's per-replica state), ``sync`` (relaxed
synchronisation's replicas or stale history), ``stats`` (running measurements) and ``versions``
(a pipeline schedule's older weight versions) exist only with the feature that keeps them. A
restore compares what the checkpoint recorded of each (:mod:`jaxpar.run.checkpoint_records`)
with the target's (:func:`plan_parts`): each part is restored, dropped (the run keeps none), or
started afresh (the run keeps one the checkpoint has not, or one of other shapes or layout),
with a message for the warning.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.step.state import TrainState
    >>> abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, ())
    >>> plans = plan_parts({"codec_shapes": {"residual": [4, 2]}}, abstract, abstract, "checkpoint 7")
    >>> [(p.name, p.action) for p in plans]
    [('codec', 'drop'), ('sync', 'empty'), ('stats', 'empty'), ('versions', 'empty')]
    >>> print(plans[0].message[:80])
    checkpoint 7: the gradient codec's state saved with it is dropped (shapes {'resi
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxpar.run.checkpoint_records import codec_layout, describe_codec, describe_versions, same_layout, shapes_of, versions_layout

__all__ = ["PARTS", "PartPlan", "plan_parts", "fresh_stats", "versions_from_params"]

#: The optional parts of a :class:`~jaxpar.step.state.TrainState`.
PARTS = ("codec", "sync", "stats", "versions")


@dataclass(frozen=True)
class PartPlan:
    """What a restore does with one optional part.

    Attributes:
      name: ``"codec"``, ``"sync"``, ``"stats"`` or ``"versions"``.
      action: ``"restore"`` (read from the checkpoint), ``"empty"`` (neither side has one),
        ``"drop"`` (the checkpoint has one, the target none) or ``"fresh"`` (the target's is
        started afresh).
      message: the warning to give, or ``None``.
    """

    name: str
    action: str
    message: str | None = None


def _is_layout(target: Any) -> bool:
    return hasattr(target, "abstract_state") and hasattr(target, "strategy")


_CODEC_FRESH = ("its residuals {} from zero (and 1-bit Adam's exchanged moment, step count and top-k's ranking "
                "second moment)")
_SYNC_FRESH = ("the replicas (jaxpar.parallel.sync) restart from the restored parameters, with fresh inner optimizer "
               "states")
_RESTORED = "Parameters and optimizer state are restored."


def _codec_plan(meta: dict, part: Any, target: Any, where: str) -> PartPlan:
    """What a restore does with ``codec`` (see :func:`plan_parts`)."""
    saved, old = meta.get("codec_shapes"), meta.get("codec_layout")
    if not jax.tree.leaves(part):
        if not saved:
            return PartPlan("codec", "empty")
        about = describe_codec(old) if old else f"shapes {saved}"
        return PartPlan("codec", "drop", f"{where}: the gradient codec's state saved with it is dropped ({about}): "
                                         f"this run keeps none (no compression, or a codec that keeps none). "
                                         f"{_RESTORED}")
    new = codec_layout(target) if _is_layout(target) else None
    fresh = _CODEC_FRESH.format("restart")
    if not saved:
        return PartPlan("codec", "fresh", (
            f"{where}: the checkpoint has no gradient codec state (saved without compression, or with a codec that "
            f"keeps none); this run has {describe_codec(new)}: {_CODEC_FRESH.format('start')}. {_RESTORED}"))
    if saved != shapes_of(part):
        return PartPlan("codec", "fresh", (
            f"{where}: the gradient codec's state was saved with shapes {saved} and this layout needs "
            f"{shapes_of(part)} (another number of replicas, or another codec): {fresh}. {_RESTORED}"))
    if old and new and not same_layout(old, new):
        return PartPlan("codec", "fresh", (
            f"{where}: the gradient codec's state was saved for {describe_codec(old)} and this run has "
            f"{describe_codec(new)}: the same shapes, but its entries belong to other replicas or gradient coordinates "
            f"(another exchange, packing or codec): {fresh}. {_RESTORED}"))
    return PartPlan("codec", "restore")


def _sync_plan(meta: dict, part: Any, where: str) -> PartPlan:
    """What a restore does with ``sync``, relaxed synchronisation's state (see :func:`plan_parts`)."""
    saved, old = meta.get("sync_shapes"), meta.get("sync_layout")
    if not jax.tree.leaves(part):
        if not saved:
            return PartPlan("sync", "empty")
        about = f" (Strategy.sync={old.get('sync')})" if old else ""
        return PartPlan("sync", "drop", f"{where}: relaxed synchronisation's replicas saved with it are dropped"
                                        f"{about}: this run keeps none (no Strategy.sync and no replica axis). "
                                        f"{_RESTORED}")
    if not saved:
        return PartPlan("sync", "fresh", f"{where}: the checkpoint has no replica state (saved without relaxed "
                                         f"synchronisation): {_SYNC_FRESH}. {_RESTORED}")
    if saved != shapes_of(part):
        return PartPlan("sync", "fresh", (
            f"{where}: relaxed synchronisation's state was saved with shapes {saved} and this layout needs "
            f"{shapes_of(part)} (another number of replicas, or another sync kind): {_SYNC_FRESH}. {_RESTORED}"))
    return PartPlan("sync", "restore")


def _stats_plan(meta: dict, part: Any, where: str) -> PartPlan:
    """What a restore does with ``stats``: checkpoints from before ``TrainState.stats`` existed
    (no ``stats_shapes`` in the record) start the measurements afresh without a warning."""
    saved, shapes = meta.get("stats_shapes"), shapes_of(part)
    names = lambda s: ", ".join(s) if isinstance(s, dict) else str(s)   # noqa: E731
    if not jax.tree.leaves(part):
        if not saved:
            return PartPlan("stats", "empty")
        return PartPlan("stats", "drop", f"{where}: the running measurements saved with it ({names(saved)}) are "
                                         f"dropped: this run measures none. {_RESTORED}")
    if saved == shapes:
        return PartPlan("stats", "restore")
    if "stats_shapes" not in meta:
        return PartPlan("stats", "fresh")
    if not saved:
        return PartPlan("stats", "fresh", f"{where}: the checkpoint has no running measurements (saved without "
                                          f"them): the measurements ({names(shapes)}) restart from zero.")
    return PartPlan("stats", "fresh", f"{where}: the running measurements were saved with shapes {saved} and this "
                                      f"layout has {shapes}: they restart from zero.")


def _versions_plan(meta: dict, part: Any, target: Any, where: str) -> PartPlan:
    """What a restore does with ``versions`` (older weight versions of a pipeline schedule)."""
    saved, old = meta.get("versions_shapes"), meta.get("versions_layout")
    equal = "they resume equal to the current weights, W(t-1) = W(t), as at step 0."
    if not jax.tree.leaves(part):
        if not saved:
            return PartPlan("versions", "empty")
        schedule = f" ({target.strategy.schedule!r})" if _is_layout(target) else ""
        about = f" ({describe_versions(old)})" if old else ""
        return PartPlan("versions", "drop", f"{where}: the older weight versions saved with it{about} are dropped: "
                                            f"this run's pipeline schedule{schedule} keeps none. {_RESTORED}")
    if not saved or saved != shapes_of(part):
        return PartPlan("versions", "fresh", f"{where}: no older weight versions of this layout saved (another "
                                             f"pipeline schedule); {equal}")
    new = versions_layout(target) if _is_layout(target) else None
    if old and new and not same_layout(old, new):
        return PartPlan("versions", "fresh", (
            f"{where}: the older weight versions were saved for {describe_versions(old)} and this run has "
            f"{describe_versions(new)}: the same shapes, but each stage's older versions are its own stage's and "
            f"update interval's, so {equal}"))
    return PartPlan("versions", "restore")


def plan_parts(meta: dict, abstract: Any, target: Any, where: str) -> list[PartPlan]:
    """What a restore does with each optional part of ``abstract`` (a ``TrainState`` of
    ``ShapeDtypeStruct``), from the checkpoint's JSON record ``meta``.

    Args:
      meta: the checkpoint's record (``codec_shapes``, ``codec_layout``, ...).
      abstract: the restore target's abstract state.
      target: what ``restore`` was given: a ``StateLayout`` (its layout records are compared)
        or the abstract state itself (shapes compared only).
      where: the checkpoint, for the messages.

    Returns:
      One :class:`PartPlan` per part that ``abstract`` has.
    """
    fields = getattr(abstract, "_fields", ())
    plans = []
    for name in PARTS:
        if name not in fields:
            continue
        part = getattr(abstract, name)
        if name == "codec":
            plans.append(_codec_plan(meta, part, target, where))
        elif name == "sync":
            plans.append(_sync_plan(meta, part, where))
        elif name == "stats":
            plans.append(_stats_plan(meta, part, where))
        else:
            plans.append(_versions_plan(meta, part, target, where))
    return plans


def fresh_stats(stats: Any) -> Any:
    """Running measurements started afresh.

    Args:
      stats: the abstract ``TrainState.stats`` (``ShapeDtypeStruct`` with shardings).

    Returns:
      Zeros in its shapes, dtypes and shardings.
    """
    return jax.tree.map(lambda a: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), a.sharding), stats)


def versions_from_params(versions: Any, params: Any) -> Any:
    """Older weight versions started afresh: ``W(t-1) = W(t)``, as at step 0.

    Args:
      versions: the abstract ``TrainState.versions``: one params-like tree (PipeDream-2BW's
        ``W(t-1)``) or a tuple of them (weight stashing's older versions, newest first).
      params: the restored parameters.

    Returns:
      Copies of ``params`` in ``versions``' structure and shardings.
    """
    if not jax.tree.leaves(versions):
        return versions
    copy = lambda v: jax.tree.map(lambda a, p: jax.device_put(jax.numpy.copy(p), a.sharding), v, params)  # noqa: E731
    if jax.tree.structure(versions) == jax.tree.structure(params):
        return copy(versions)
    return tuple(copy(v) for v in versions)

