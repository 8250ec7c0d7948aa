"""The parts of a train state that depend on the run's settings, as a checkpoint records them
and as a restore treats them (used by :mod:`jaxpar.train.checkpoint`).

``TrainState.comm`` (a gradient codec's per-replica state, or relaxed synchronisation's
replicas), ``stats`` (running measurements) and ``versions`` (a pipeline schedule's older weight
versions) exist only with the feature that keeps them. A checkpoint's JSON record holds their
shapes (``comm_shapes``, ``stats_shapes``, ``versions_shapes``) and, when the saver passed the
layout, the layout their values are laid out for (``comm_layout``: codec, options, exchange
axes and the gradient packing; ``versions_layout``: the schedule and its stages). A restore
compares both with the target's (:func:`plan_parts`): each part is restored, dropped (the run
keeps none), or started afresh (the run keeps one the checkpoint has not, or one of other shapes
or layout), with a message for the warning.

Example::

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.compression import topk
    >>> from jaxpar.models.mlp import MLPClassifier
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> layouts = [jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(zero=z, compression=topk(0.1)))
    ...            for z in (1, 3)]
    >>> for lay in layouts:
    ...     print(describe_comm(comm_layout(lay)))
    topk(ratio=0.1) over data=4, zero=1: gradients packed flat
    topk(ratio=0.1) over data=4, zero=3: 7 of 8 gradient leaves packed by their data shard
    >>> same_layout(comm_layout(layouts[0]), comm_layout(layouts[1]))
    False
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["PARTS", "PartPlan", "comm_layout", "versions_layout", "record_layouts", "describe_comm",
           "describe_versions", "same_layout", "plan_parts", "fresh_stats", "versions_from_params", "shapes_of"]

#: The optional parts of a :class:`~jaxpar.train.state.TrainState`.
PARTS = ("comm", "stats", "versions")

_COMM_KEYS = ("kind", "codec", "options", "axes", "packing")   # what decides where each residual entry belongs
_REPLICA_KEYS = {"params", "opt", "history"}                   # relaxed synchronisation's comm (jaxpar.train.relaxed)
# Options left out of describe_comm at these values (the codec factories' defaults).
_DEFAULT_OPTIONS = {"momentum": 0.0, "warmup": [], "warmup_steps": 0, "seed": 0, "error_feedback": True,
                    "optimizer_momentum": 0.0, "start_step": 0, "partitioned": False, "precondition": 0.0,
                    "options": {}, "warm_start": True, "min_compression_rate": 2.0}


@dataclass(frozen=True)
class PartPlan:
    """What a restore does with one optional part.

    Attributes:
      name: ``"comm"``, ``"stats"`` or ``"versions"``.
      action: ``"restore"`` (read from the checkpoint), ``"empty"`` (neither side has one),
        ``"drop"`` (the checkpoint has one, the target none) or ``"fresh"`` (the target's is
        started afresh).
      message: the warning to give, or ``None``.
    """

    name: str
    action: str
    message: str | None = None


def shapes_of(tree: Any) -> Any:
    """JSON-able shapes of a pytree of arrays.

    Args:
      tree: a pytree whose leaves have a ``shape``.

    Returns:
      The tree with every leaf's shape as a list of ints (tuples as lists), as JSON reads it back.
    """
    return json.loads(json.dumps(jax.tree.map(lambda a: list(a.shape), tree, is_leaf=lambda x: hasattr(x, "shape"))))


def _options(codec: Any) -> dict:
    """A codec's JSON-able dataclass fields (functions left out)."""
    out = {}
    for f in dataclasses.fields(codec):
        value = getattr(codec, f.name)
        if f.name not in ("name", "kind") and not callable(value):
            out[f.name] = json.loads(json.dumps(value, default=str))
    return out


def comm_layout(layout: Any) -> dict | None:
    """The layout ``layout``'s ``comm`` values are laid out for.

    Args:
      layout: a :class:`~jaxpar.train.state.StateLayout`.

    Returns:
      ``None`` when it keeps no ``comm``; ``{"kind": "replicas"}`` for relaxed synchronisation's
      replicas; for a gradient codec ``{"kind": "codec", "codec", "options", "axes", "packing",
      "zero"}``: ``axes`` the exchange's data axes and sizes in replica order, ``packing`` each
      gradient leaf's dimension cut into the buffer's rows (``None``: flattened into the rest),
      or ``None`` for PowerSGD, whose state is per leaf. ``zero`` is for reading only.
    """
    if not jax.tree.leaves(layout.comm_shapes):
        return None
    strategy = layout.strategy
    if layout.comm_from_params:
        return {"kind": "replicas", "sync": getattr(strategy.sync, "name", None) or "synchronous"}
    from ..compression import PowerSGD
    from .compressed import compression_plan     # compression loads only when used

    codec = strategy.compression
    plan = compression_plan(codec, layout, strategy.zero)
    sizes = dict(layout.mesh.shape)
    rows = None if isinstance(codec, PowerSGD) else [d if sc else None for d, sc in zip(plan.dims, plan.scattered)]
    return {"kind": "codec", "codec": codec.name, "options": _options(codec),
            "axes": [[a, int(sizes[a])] for a in plan.axes], "packing": rows, "zero": strategy.zero}


def versions_layout(layout: Any) -> dict | None:
    """The schedule ``layout``'s older weight versions belong to.

    Args:
      layout: a :class:`~jaxpar.train.state.StateLayout`.

    Returns:
      ``None`` when it keeps none; ``{"schedule"}`` for PipeDream-2BW (its ``W(t-1)`` is the
      whole model's previous weights); for weight stashing, whose older versions are each
      stage's own, also ``pipe``, ``update_every`` and ``stage_layers``.
    """
    if not jax.tree.leaves(layout.versions_shapes):
        return None
    s = layout.strategy
    out = {"schedule": s.schedule}
    if s.schedule == "pipedream":
        stages = s.stage_layers if s.stage_layers is None or isinstance(s.stage_layers, str) else list(s.stage_layers)
        out.update(pipe=int(dict(layout.mesh.shape).get("pipe", 1)), update_every=s.update_every,
                   stage_layers=json.loads(json.dumps(stages)))
    return out


def record_layouts(layout: Any, state: Any) -> dict:
    """The layout records of a checkpoint of ``state``.

    Args:
      layout: the state's :class:`~jaxpar.train.state.StateLayout`, or ``None``.
      state: the train state being saved.

    Returns:
      ``{"comm_layout": ..., "versions_layout": ...}`` for the parts ``state`` has; empty
      without a layout. A part whose shapes are not the layout's is left out (the layout
      describes another state).
    """
    if layout is None or not hasattr(layout, "strategy"):
        return {}
    out = {}
    for key, part, shapes, fn in (("comm_layout", "comm", "comm_shapes", comm_layout),
                                  ("versions_layout", "versions", "versions_shapes", versions_layout)):
        value = getattr(state, part, ())
        if jax.tree.leaves(value) and shapes_of(value) == shapes_of(getattr(layout, shapes)):
            sig = fn(layout)
            if sig is not None:
                out[key] = sig
    return out


def same_layout(a: dict, b: dict) -> bool:
    """Whether two layout records place the values alike.

    Args:
      a: a ``comm_layout`` or ``versions_layout`` record.
      b: another of the same kind.

    Returns:
      For codecs, whether codec, options, exchange axes and packing agree (``zero`` is for
      reading only: ZeRO-0 and ZeRO-1 pack alike); replicas are alike; older weight versions
      must agree in every field.
    """
    if "schedule" in a or "schedule" in b:
        return a == b
    if a.get("kind") != b.get("kind"):
        return False
    keys = _COMM_KEYS if a.get("kind") == "codec" else ("kind",)
    return all(a.get(k) == b.get(k) for k in keys)


def describe_comm(sig: dict | None) -> str:
    """A ``comm_layout`` record in words.

    Args:
      sig: the record, or ``None``.

    Returns:
      E.g. ``"topk(ratio=0.1) over data=4, zero=1: gradients packed flat"`` (options at the
      factories' defaults left out).
    """
    if not sig:
        return "an unrecorded layout"
    if sig.get("kind") == "replicas":
        return f"relaxed synchronisation's replicas ({sig.get('sync')})"
    opts = ", ".join(f"{k}={v}" for k, v in sig["options"].items() if k not in _DEFAULT_OPTIONS
                     or _DEFAULT_OPTIONS[k] != v)
    axes = ", ".join(f"{a}={n}" for a, n in sig["axes"])
    rows = [d for d in sig["packing"] or () if d is not None]
    if sig["packing"] is None:
        packing = "state kept per gradient leaf"
    elif not rows:
        packing = "gradients packed flat"
    else:
        packing = (f"{len(rows)} of {len(sig['packing'])} gradient leaves packed by their "
                   f"{'/'.join(a for a, _ in sig['axes'])} shard")
    return f"{sig['codec']}({opts}) over {axes}, zero={sig.get('zero')}: {packing}"



def describe_versions(sig: dict | None) -> str:
    """A ``versions_layout`` record in words.

    Args:
      sig: the record, or ``None``.

    Returns:
      E.g. ``"schedule='pipedream', pipe=2, update_every=1, stage_layers=None"``.
    """
    if not sig:
        return "an unrecorded layout"
    return ", ".join([f"schedule={sig['schedule']!r}"] + [f"{k}={v}" for k, v in sig.items() if k != "schedule"])


def _is_layout(target: Any) -> bool:
    return hasattr(target, "abstract_state") and hasattr(target, "strategy")


_CODEC_FRESH = ("its residuals {} from zero (and 1-bit Adam's exchanged moment, step count and top-k's ranking "
                "second moment)")
_REPLICAS_FRESH = ("the replicas (jaxpar.sync) restart from the restored parameters, with fresh inner optimizer "
                   "states")
_RESTORED = "Parameters and optimizer state are restored."


def _comm_plan(meta: dict, part: Any, target: Any, where: str) -> PartPlan:
    """What a restore does with ``comm`` (see :func:`plan_parts`)."""
    saved, old = meta.get("comm_shapes"), meta.get("comm_layout")
    if not jax.tree.leaves(part):
        if not saved:
            return PartPlan("comm", "empty")
        replicas = ((old or {}).get("kind") == "replicas"
                    or (isinstance(saved, dict) and bool(_REPLICA_KEYS & set(saved))))
        what = ("relaxed synchronisation's replicas saved with it are" if replicas else
                "the gradient codec's state saved with it is")
        if replicas:
            about = f" (Strategy.sync={old.get('sync')})" if old else ""
        else:
            about = f" ({describe_comm(old) if old else f'shapes {saved}'})"
        off = "no Strategy.sync and no replica axis" if replicas else "no compression, or a codec that keeps none"
        return PartPlan("comm", "drop", f"{where}: {what} dropped{about}: this run keeps none ({off}). {_RESTORED}")
    replicas = getattr(target, "comm_from_params", False)
    fresh = _REPLICAS_FRESH if replicas else _CODEC_FRESH.format("restart")
    new = comm_layout(target) if _is_layout(target) else None
    if not saved:
        if replicas:
            text = f"the checkpoint has no replica state (saved without relaxed synchronisation): {fresh}"
        else:
            text = (f"the checkpoint has no gradient codec state (saved without compression, or with a codec that "
                    f"keeps none); this run has {describe_comm(new)}: {_CODEC_FRESH.format('start')}")
        return PartPlan("comm", "fresh", f"{where}: {text}. {_RESTORED}")
    if saved != shapes_of(part):
        return PartPlan("comm", "fresh", (
            f"{where}: the gradient codec's or replicas' state was saved with shapes {saved} and this layout needs "
            f"{shapes_of(part)} (another number of replicas, or another codec): {fresh}. {_RESTORED}"))
    if old and new and not same_layout(old, new):
        return PartPlan("comm", "fresh", (
            f"{where}: the gradient codec's state was saved for {describe_comm(old)} and this run has "
            f"{describe_comm(new)}: the same shapes, but its entries belong to other replicas or gradient coordinates "
            f"(another exchange, packing or codec): {fresh}. {_RESTORED}"))
    return PartPlan("comm", "restore")


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
      meta: the checkpoint's record (``comm_shapes``, ``comm_layout``, ...).
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
        if name == "comm":
            plans.append(_comm_plan(meta, part, target, where))
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

