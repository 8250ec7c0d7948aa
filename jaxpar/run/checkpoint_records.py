"""What a checkpoint records about the parts of a train state that depend on the run's
settings, so that a restore can tell whether their values still fit (used by
:mod:`jaxpar.run.checkpoint_parts`).

A checkpoint's JSON record holds each optional part's shapes (``codec_shapes``,
``sync_shapes``, ``stats_shapes``, ``versions_shapes``) and, when the saver passed the layout,
the layout its values are laid out for: ``codec_layout`` (codec, options, exchange axes and the
gradient packing), ``sync_layout`` (the sync kind) and ``versions_layout`` (the schedule and its
stages).

Example::

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.parallel.compression import topk
    >>> from jaxpar.models.mlp import MLPClassifier
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> layouts = [jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(zero=z, compression=topk(0.1)))
    ...            for z in (1, 3)]
    >>> for lay in layouts:
    ...     print(describe_codec(codec_layout(lay)))
    topk(ratio=0.1) over data=4, zero=1: gradients packed flat
    topk(ratio=0.1) over data=4, zero=3: 7 of 8 gradient leaves packed by their data shard
    >>> same_layout(codec_layout(layouts[0]), codec_layout(layouts[1]))
    False
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

__all__ = ["shapes_of", "codec_layout", "sync_layout", "versions_layout", "record_layouts", "same_layout",
           "describe_codec", "describe_versions"]

_CODEC_KEYS = ("codec", "options", "axes", "packing")   # what decides where each residual entry belongs
# Options left out of describe_codec at these values (the codec factories' defaults).
_DEFAULT_OPTIONS = {"momentum": 0.0, "warmup": [], "warmup_steps": 0, "seed": 0, "error_feedback": True,
                    "optimizer_momentum": 0.0, "start_step": 0, "partitioned": False, "precondition": 0.0,
                    "options": {}, "warm_start": True, "min_compression_rate": 2.0}


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


def codec_layout(layout: Any) -> dict | None:
    """The layout ``layout``'s gradient codec state (``TrainState.codec``) is laid out for.

    Args:
      layout: a :class:`~jaxpar.step.state.StateLayout`.

    Returns:
      ``None`` when it keeps no codec state, else ``{"codec", "options", "axes", "packing",
      "zero"}``: ``axes`` the exchange's data axes and sizes in replica order, ``packing`` each
      gradient leaf's dimension cut into the buffer's rows (``None``: flattened into the rest),
      or ``None`` for PowerSGD, whose state is per leaf. ``zero`` is for reading only.
    """
    if not jax.tree.leaves(layout.codec_shapes):
        return None
    from jaxpar.parallel.compression import PowerSGD
    from jaxpar.step.compressed import compression_plan     # compression loads only when used

    strategy = layout.strategy
    codec = strategy.compression
    plan = compression_plan(codec, layout, strategy.zero)
    sizes = dict(layout.mesh.shape)
    rows = None if isinstance(codec, PowerSGD) else [d if sc else None for d, sc in zip(plan.dims, plan.scattered)]
    return {"codec": codec.name, "options": _options(codec),
            "axes": [[a, int(sizes[a])] for a in plan.axes], "packing": rows, "zero": strategy.zero}


def sync_layout(layout: Any) -> dict | None:
    """The relaxed synchronisation ``layout``'s ``TrainState.sync`` belongs to.

    Args:
      layout: a :class:`~jaxpar.step.state.StateLayout`.

    Returns:
      ``None`` when it keeps no such state, else ``{"sync": name}``.
    """
    if not jax.tree.leaves(layout.sync_shapes):
        return None
    return {"sync": getattr(layout.strategy.sync, "name", None) or "synchronous"}


def versions_layout(layout: Any) -> dict | None:
    """The schedule ``layout``'s older weight versions belong to.

    Args:
      layout: a :class:`~jaxpar.step.state.StateLayout`.

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
      layout: the state's :class:`~jaxpar.step.state.StateLayout`, or ``None``.
      state: the train state being saved.

    Returns:
      ``{"codec_layout": ..., "sync_layout": ..., "versions_layout": ...}`` for the parts
      ``state`` has, and ``layer_lists`` (the ``nnx.List`` s run stacked) where there are any; empty
      without a layout. A part whose shapes are not the layout's is left
      out (the layout describes another state).
    """
    if layout is None or not hasattr(layout, "strategy"):
        return {}
    lists = getattr(layout, "layer_lists", None) or {}
    out = {"layer_lists": [[list(path), int(n)] for path, n in lists.items()]} if lists else {}
    for part, fn in (("codec", codec_layout), ("sync", sync_layout), ("versions", versions_layout)):
        value = getattr(state, part, ())
        if jax.tree.leaves(value) and shapes_of(value) == shapes_of(getattr(layout, part + "_shapes")):
            sig = fn(layout)
            if sig is not None:
                out[part + "_layout"] = sig
    return out


def saved_lists(meta: dict) -> dict[tuple, int]:
    """``{path: count}`` of the ``nnx.List`` s a checkpoint keeps stacked (its ``layer_lists`` record)."""
    return {tuple(path): int(n) for path, n in meta.get("layer_lists") or []}


def same_layout(a: dict, b: dict) -> bool:
    """Whether two layout records of one part place the values alike.

    Args:
      a: a ``codec_layout``, ``sync_layout`` or ``versions_layout`` record.
      b: another of the same part.

    Returns:
      For codecs, whether codec, options, exchange axes and packing agree (``zero`` is for
      reading only: ZeRO-0 and ZeRO-1 pack alike); replicas of any relaxed synchronisation
      are alike; older weight versions must agree in every field.
    """
    if "codec" in a or "codec" in b:
        return all(a.get(k) == b.get(k) for k in _CODEC_KEYS)
    if "sync" in a or "sync" in b:
        return True
    return a == b


def describe_codec(sig: dict | None) -> str:
    """A ``codec_layout`` record in words.

    Args:
      sig: the record, or ``None``.

    Returns:
      E.g. ``"topk(ratio=0.1) over data=4, zero=1: gradients packed flat"`` (options at the
      factories' defaults left out).
    """
    if not sig:
        return "an unrecorded layout"
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
