"""The optional parts of a train state as the checkpoint sees them, and what a checkpoint's JSON record holds.

A save records each part's shapes (:func:`record_shapes`: ``<name>_shapes``), the layout its values
are laid out for when the saver passed one (:func:`record_layouts`, :meth:`StatePart.record`:
``<name>_layout``) and which ``nnx.List`` s of layers were saved stacked (:func:`lists_record`); a restore
does with each part what :meth:`StatePart.plan` says (restore, drop, or start afresh with a warning), for
:mod:`jaxpar.run._checkpoint`. The policy: docs/training.md.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.step._state import TrainState
    >>> abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, ())
    >>> [part.name for part in STATE_PARTS]
    ['codec', 'sync', 'stats', 'versions']
    >>> plans = plan_parts({"codec_shapes": {"residual": [4, 2]}}, abstract, abstract, "checkpoint 7")
    >>> [(p.part.name, p.action) for p in plans]
    [('codec', 'drop'), ('sync', 'empty'), ('stats', 'empty'), ('versions', 'empty')]
    >>> print(plans[0].message[:80])
    checkpoint 7: the gradient codec's state saved with it is dropped (shapes {'resi
    >>> STATE_PARTS[3].describe({"schedule": "pipedream", "pipe": 2, "update_every": 1, "stage_layers": None})
    "schedule='pipedream', pipe=2, update_every=1, stage_layers=None"
    >>> state = TrainState(jnp.int32(4), {"w": jnp.zeros(2)}, (), codec={"residual": jnp.zeros((4, 2))})
    >>> record_shapes(state)            # sync only when kept, stats and versions always
    {'codec_shapes': {'residual': [4, 2]}, 'stats_shapes': [], 'versions_shapes': []}
    >>> record_layouts(None, state)     # no layout given: shapes only
    {}
    >>> saved_lists({"layer_lists": [[["blocks"], 2]]})
    {('blocks',): 2}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import jax

from jaxpar.errors import CheckpointMismatchError
from jaxpar.step import compression_plan

_RESTORED = "Parameters and optimizer state are restored."


def shapes_of(tree: Any) -> Any:
    """JSON-able shapes of a pytree of arrays.

    Args:
      tree: a pytree whose leaves have a ``shape``.

    Returns:
      The tree with every leaf's shape as a list of ints (tuples as lists), as JSON reads it back.
    """
    return json.loads(json.dumps(jax.tree.map(lambda a: list(a.shape), tree, is_leaf=lambda x: hasattr(x, "shape"))))


def _is_layout(target: Any) -> bool:
    return hasattr(target, "abstract_state") and hasattr(target, "strategy")


@dataclass(frozen=True)
class PartPlan:
    """What a restore does with one optional part.

    Attributes:
      part: the :class:`StatePart`.
      action: ``"restore"`` (read from the checkpoint), ``"empty"`` (neither side has one),
        ``"drop"`` (the checkpoint has one, the target none) or ``"fresh"`` (the target's is
        started afresh: :meth:`StatePart.fresh`).
      message: the warning to give, or ``None``.
    """

    part: StatePart
    action: str
    message: str | None = None


@dataclass(frozen=True)
class StatePart:
    """One optional part of a :class:`~jaxpar.step.TrainState`: what a checkpoint records of
    it and what a restore does with it. The four are :data:`STATE_PARTS`.

    Attributes:
      name: the ``TrainState`` field (``"codec"``, ``"sync"``, ``"stats"``, ``"versions"``);
        the record's keys are ``<name>_shapes`` and ``<name>_layout``.
      what: the part in words, for the messages.
      shapes_always: a save records the part's shapes even when it keeps none (``[]``).
    """

    name: str
    what: str
    shapes_always: bool = False

    def record(self, layout: Any) -> dict | None:
        """What a checkpoint records of the layout the part's values are laid out for.

        Args:
          layout: a :class:`~jaxpar.step.StateLayout`.

        Returns:
          The ``<name>_layout`` record, or ``None`` where there is nothing to record.
        """
        return None

    def describe(self, record: dict | None) -> str:
        """A ``<name>_layout`` record in words, for the messages.

        Args:
          record: the record, or ``None``.

        Returns:
          Its entries as ``key=value``, or ``"an unrecorded layout"``.
        """
        return ", ".join(f"{k}={v}" for k, v in record.items()) if record else "an unrecorded layout"

    def same_layout(self, old: dict, new: dict) -> bool:
        """Whether two ``<name>_layout`` records place the part's values alike.

        Args:
          old: the checkpoint's record.
          new: the target's.

        Returns:
          Whether the values saved for ``old`` belong where ``new`` reads them (here: equal records).
        """
        return old == new

    def plan(self, meta: dict, abstract_part: Any, target: Any, where: str) -> PartPlan:
        """What a restore does with the part.

        Args:
          meta: the checkpoint's JSON record (``<name>_shapes``, ``<name>_layout``, ...).
          abstract_part: the target's part (``ShapeDtypeStruct`` s; no leaves: the run keeps none).
          target: what ``restore`` was given: a ``StateLayout`` (its layout records are compared)
            or the abstract state itself (shapes compared only).
          where: the checkpoint, for the messages.

        Returns:
          A :class:`PartPlan`: ``empty`` or ``drop`` when the target keeps none, else
          ``restore`` or ``fresh``; the ones that change something carry a message.
        """
        if jax.tree.leaves(abstract_part):
            return self._kept(meta, abstract_part, target, where)
        if not meta.get(f"{self.name}_shapes"):
            return PartPlan(self, "empty")
        return PartPlan(self, "drop", f"{where}: {self._dropped(meta, target)}. {_RESTORED}")

    def fresh(self, abstract: Any, params: Any, target: Any, where: str) -> Any:
        """The part started afresh (a plan's ``fresh``), in the target's shapes and shardings.

        Args:
          abstract: the target's abstract ``TrainState``.
          params: the restored parameters.
          target: what ``restore`` was given (a ``StateLayout``, or ``abstract``).
          where: the checkpoint, for the messages.

        Returns:
          The part's arrays.

        Raises:
          CheckpointMismatchError: the part starts from the layout part's init, and ``target`` is
            no layout.
        """
        init = target.part(self.name).init if _is_layout(target) else None
        if init is None:
            raise CheckpointMismatchError(f"{where}: {self.what} cannot be restored into this target and has to start "
                                          "afresh, which needs the StateLayout: call restore(layout).")
        return init(params)

    def _kept(self, meta: dict, part: Any, target: Any, where: str) -> PartPlan:
        """The plan when the target keeps the part (``restore`` or ``fresh``)."""
        raise NotImplementedError

    def _dropped(self, meta: dict, target: Any) -> str:
        """Why the part saved is dropped (the target keeps none), without the checkpoint's name."""
        raise NotImplementedError


_CODEC_KEYS = ("codec", "options", "axes", "packing")   # what decides where each residual entry belongs
# Options left out of a codec's description at these values (the codec factories' defaults).
_DEFAULT_OPTIONS = {"momentum": 0.0, "warmup": [], "warmup_steps": 0, "seed": 0, "error_feedback": True,
                    "optimizer_momentum": 0.0, "start_step": 0, "partitioned": False, "precondition": 0.0,
                    "options": {}, "warm_start": True, "min_compression_rate": 2.0}
_CODEC_FRESH = ("its residuals {} from zero (and 1-bit Adam's exchanged moment, step count and top-k's ranking "
                "second moment)")


@dataclass(frozen=True)
class CodecPart(StatePart):
    """``TrainState.codec``: a gradient codec's per-replica state; afresh: the layout part's init.

    The record, ``{"codec", "options", "axes", "packing", "zero"}``: ``axes`` the exchange's data
    axes and sizes in replica order, ``packing`` each gradient leaf's dimension cut into the
    buffer's rows (``None``: flattened into the rest), or ``None`` for PowerSGD, whose state is
    per leaf; ``zero`` is for reading only (ZeRO-0 and ZeRO-1 pack alike).

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.parallel.compression import topk
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> records = [CodecPart().record(jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh,
    ...                                                   jaxpar.Strategy(zero=z, compression=topk(0.1)))) for z in (1, 3)]
    >>> for record in records:
    ...     print(CodecPart().describe(record))
    topk(ratio=0.1) over data=4, zero=1: gradients packed flat
    topk(ratio=0.1) over data=4, zero=3: 7 of 8 gradient leaves packed by their data shard
    >>> CodecPart().same_layout(*records)
    False
    """

    name: str = "codec"
    what: str = "the gradient codec's state"

    def record(self, layout: Any) -> dict | None:
        if not jax.tree.leaves(layout.part("codec").shapes):
            return None
        from jaxpar.parallel.compression import PowerSGD

        strategy = layout.strategy
        codec = strategy.compression
        plan = compression_plan(codec, layout, strategy.zero)
        sizes = dict(layout.mesh.shape)
        rows = None if isinstance(codec, PowerSGD) else [d if sc else None for d, sc in zip(plan.dims, plan.scattered)]
        options = {f.name: json.loads(json.dumps(getattr(codec, f.name), default=str))
                   for f in dataclasses.fields(codec) if f.name not in ("name", "kind")
                   and not callable(getattr(codec, f.name))}
        return {"codec": codec.name, "options": options,
                "axes": [[a, int(sizes[a])] for a in plan.axes], "packing": rows, "zero": strategy.zero}

    def describe(self, record: dict | None) -> str:
        if not record:
            return "an unrecorded layout"
        opts = ", ".join(f"{k}={v}" for k, v in record["options"].items()
                         if k not in _DEFAULT_OPTIONS or _DEFAULT_OPTIONS[k] != v)
        axes = ", ".join(f"{a}={n}" for a, n in record["axes"])
        rows = [d for d in record["packing"] or () if d is not None]
        if record["packing"] is None:
            packing = "state kept per gradient leaf"
        elif not rows:
            packing = "gradients packed flat"
        else:
            packing = (f"{len(rows)} of {len(record['packing'])} gradient leaves packed by their "
                       f"{'/'.join(a for a, _ in record['axes'])} shard")
        return f"{record['codec']}({opts}) over {axes}, zero={record.get('zero')}: {packing}"

    def same_layout(self, old: dict, new: dict) -> bool:
        return all(old.get(k) == new.get(k) for k in _CODEC_KEYS)

    def _dropped(self, meta: dict, target: Any) -> str:
        old = meta.get("codec_layout")
        about = self.describe(old) if old else f"shapes {meta.get('codec_shapes')}"
        return f"{self.what} saved with it is dropped ({about}): this run keeps none (no compression, or a codec " \
               "that keeps none)"

    def _kept(self, meta: dict, part: Any, target: Any, where: str) -> PartPlan:
        saved, old = meta.get("codec_shapes"), meta.get("codec_layout")
        new = self.record(target) if _is_layout(target) else None
        fresh = _CODEC_FRESH.format("restart")
        if not saved:
            return PartPlan(self, "fresh", (
                f"{where}: the checkpoint has no gradient codec state (saved without compression, or with a codec that "
                f"keeps none); this run has {self.describe(new)}: {_CODEC_FRESH.format('start')}. {_RESTORED}"))
        if saved != shapes_of(part):
            return PartPlan(self, "fresh", (
                f"{where}: {self.what} was saved with shapes {saved} and this layout needs {shapes_of(part)} "
                f"(another number of replicas, or another codec): {fresh}. {_RESTORED}"))
        if old and new and not self.same_layout(old, new):
            return PartPlan(self, "fresh", (
                f"{where}: {self.what} was saved for {self.describe(old)} and this run has {self.describe(new)}: the "
                f"same shapes, but its entries belong to other replicas or gradient coordinates (another exchange, "
                f"packing or codec): {fresh}. {_RESTORED}"))
        return PartPlan(self, "restore")


_SYNC_FRESH = ("the replicas (jaxpar.parallel.sync) restart from the restored parameters, with fresh inner optimizer "
               "states")


@dataclass(frozen=True)
class SyncPart(StatePart):
    """``TrainState.sync``: relaxed synchronisation's replicas or stale history; afresh: the layout
    part's init. Replicas of any relaxed synchronisation are laid out alike."""

    name: str = "sync"
    what: str = "relaxed synchronisation's replicas"

    def record(self, layout: Any) -> dict | None:
        if not jax.tree.leaves(layout.part("sync").shapes):
            return None
        return {"sync": getattr(layout.strategy.sync, "name", None) or "synchronous"}

    def describe(self, record: dict | None) -> str:
        return f"Strategy.sync={record.get('sync')}" if record else "an unrecorded layout"

    def same_layout(self, old: dict, new: dict) -> bool:
        return True

    def _dropped(self, meta: dict, target: Any) -> str:
        old = meta.get("sync_layout")
        about = f" ({self.describe(old)})" if old else ""
        return f"{self.what} saved with it are dropped{about}: this run keeps none (no Strategy.sync and no replica " \
               "axis)"

    def _kept(self, meta: dict, part: Any, target: Any, where: str) -> PartPlan:
        saved = meta.get("sync_shapes")
        if not saved:
            return PartPlan(self, "fresh", f"{where}: the checkpoint has no replica state (saved without relaxed "
                                           f"synchronisation): {_SYNC_FRESH}. {_RESTORED}")
        if saved != shapes_of(part):
            return PartPlan(self, "fresh", (
                f"{where}: relaxed synchronisation's state was saved with shapes {saved} and this layout needs "
                f"{shapes_of(part)} (another number of replicas, or another sync kind): {_SYNC_FRESH}. {_RESTORED}"))
        return PartPlan(self, "restore")


def _names(shapes: Any) -> str:
    return ", ".join(shapes) if isinstance(shapes, dict) else str(shapes)


@dataclass(frozen=True)
class StatsPart(StatePart):
    """``TrainState.stats``: running measurements; afresh: zeros."""

    name: str = "stats"
    what: str = "the running measurements"
    shapes_always: bool = True

    def fresh(self, abstract: Any, params: Any, target: Any, where: str) -> Any:
        return jax.tree.map(lambda a: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), a.sharding), abstract.stats)

    def _dropped(self, meta: dict, target: Any) -> str:
        return f"{self.what} saved with it ({_names(meta.get('stats_shapes'))}) are dropped: this run measures none"

    def _kept(self, meta: dict, part: Any, target: Any, where: str) -> PartPlan:
        saved, shapes = meta.get("stats_shapes"), shapes_of(part)
        if saved == shapes:
            return PartPlan(self, "restore")
        if not saved:
            return PartPlan(self, "fresh", f"{where}: the checkpoint has no running measurements (saved without "
                                           f"them): the measurements ({_names(shapes)}) restart from zero.")
        return PartPlan(self, "fresh", f"{where}: {self.what} were saved with shapes {saved} and this layout has "
                                       f"{shapes}: they restart from zero.")


_EQUAL = "they resume equal to the current weights, W(t-1) = W(t), as at step 0."


@dataclass(frozen=True)
class VersionsPart(StatePart):
    """``TrainState.versions``: a pipeline schedule's older weight versions; afresh: copies of the
    restored parameters, ``W(t-1) = W(t)``, as at step 0.

    The record: ``{"schedule"}`` for PipeDream-2BW (its ``W(t-1)`` is the whole model's previous
    weights); for weight stashing, whose older versions are each stage's own, also ``pipe``,
    ``update_every`` and ``stage_layers``, which must all agree."""

    name: str = "versions"
    what: str = "the older weight versions"
    shapes_always: bool = True

    def record(self, layout: Any) -> dict | None:
        if not jax.tree.leaves(layout.part("versions").shapes):
            return None
        s = layout.strategy
        out = {"schedule": s.schedule}
        if s.schedule == "pipedream":
            out.update(pipe=int(dict(layout.mesh.shape).get("pipe", 1)), update_every=s.update_every,
                       stage_layers=json.loads(json.dumps(s.stage_layers)))     # tuples as lists
        return out

    def describe(self, record: dict | None) -> str:
        if not record:
            return "an unrecorded layout"
        return ", ".join([f"schedule={record['schedule']!r}"] + [f"{k}={v}" for k, v in record.items()
                                                                  if k != "schedule"])

    def fresh(self, abstract: Any, params: Any, target: Any, where: str) -> Any:
        versions = abstract.versions
        if not jax.tree.leaves(versions):
            return versions
        def copy(v):
            return jax.tree.map(lambda a, p: jax.device_put(jax.numpy.copy(p), a.sharding), v, params)

        if jax.tree.structure(versions) == jax.tree.structure(params):     # PipeDream-2BW's W(t-1)
            return copy(versions)
        return tuple(copy(v) for v in versions)                           # weight stashing's, newest first

    def _dropped(self, meta: dict, target: Any) -> str:
        old = meta.get("versions_layout")
        schedule = f" ({target.strategy.schedule!r})" if _is_layout(target) else ""
        about = f" ({self.describe(old)})" if old else ""
        return f"{self.what} saved with it{about} are dropped: this run's pipeline schedule{schedule} keeps none"

    def _kept(self, meta: dict, part: Any, target: Any, where: str) -> PartPlan:
        saved, old = meta.get("versions_shapes"), meta.get("versions_layout")
        if not saved or saved != shapes_of(part):
            return PartPlan(self, "fresh", f"{where}: no older weight versions of this layout saved (another "
                                           f"pipeline schedule); {_EQUAL}")
        new = self.record(target) if _is_layout(target) else None
        if old and new and not self.same_layout(old, new):
            return PartPlan(self, "fresh", (
                f"{where}: {self.what} were saved for {self.describe(old)} and this run has {self.describe(new)}: the "
                f"same shapes, but each stage's older versions are its own stage's and update interval's, so {_EQUAL}"))
        return PartPlan(self, "restore")


#: The optional parts of a :class:`~jaxpar.step.TrainState`, in its field order.
STATE_PARTS: tuple[StatePart, ...] = (CodecPart(), SyncPart(), StatsPart(), VersionsPart())


def plan_parts(meta: dict, abstract: Any, target: Any, where: str) -> list[PartPlan]:
    """What a restore does with each optional part of ``abstract`` (:meth:`StatePart.plan`).

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
    return [part.plan(meta, getattr(abstract, part.name), target, where) for part in STATE_PARTS
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
