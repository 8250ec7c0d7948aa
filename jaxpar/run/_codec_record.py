"""What a checkpoint records of the layout a gradient codec's state is laid out for (the
``codec_layout`` entry of its JSON record, :class:`jaxpar.run._state_parts.CodecPart`'s record), so
that a restore can tell whether the saved residuals still belong to the same replicas and gradient
coordinates.

Example::

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.parallel.compression import topk
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> layouts = [jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh, jaxpar.Strategy(zero=z, compression=topk(0.1)))
    ...            for z in (1, 3)]
    >>> for lay in layouts:
    ...     print(describe_codec(codec_layout(lay)))
    topk(ratio=0.1) over data=4, zero=1: gradients packed flat
    topk(ratio=0.1) over data=4, zero=3: 7 of 8 gradient leaves packed by their data shard
    >>> same_codec_layout(codec_layout(layouts[0]), codec_layout(layouts[1]))
    False
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

_CODEC_KEYS = ("codec", "options", "axes", "packing")   # what decides where each residual entry belongs
# Options left out of describe_codec at these values (the codec factories' defaults).
_DEFAULT_OPTIONS = {"momentum": 0.0, "warmup": [], "warmup_steps": 0, "seed": 0, "error_feedback": True,
                    "optimizer_momentum": 0.0, "start_step": 0, "partitioned": False, "precondition": 0.0,
                    "options": {}, "warm_start": True, "min_compression_rate": 2.0}


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
      layout: a :class:`~jaxpar.step.StateLayout`.

    Returns:
      ``None`` when it keeps no codec state, else ``{"codec", "options", "axes", "packing",
      "zero"}``: ``axes`` the exchange's data axes and sizes in replica order, ``packing`` each
      gradient leaf's dimension cut into the buffer's rows (``None``: flattened into the rest),
      or ``None`` for PowerSGD, whose state is per leaf. ``zero`` is for reading only.
    """
    if not jax.tree.leaves(layout.codec_shapes):
        return None
    from jaxpar.parallel.compression import PowerSGD
    from jaxpar.step._compressed import compression_plan     # compression loads only when used

    strategy = layout.strategy
    codec = strategy.compression
    plan = compression_plan(codec, layout, strategy.zero)
    sizes = dict(layout.mesh.shape)
    rows = None if isinstance(codec, PowerSGD) else [d if sc else None for d, sc in zip(plan.dims, plan.scattered)]
    return {"codec": codec.name, "options": _options(codec),
            "axes": [[a, int(sizes[a])] for a in plan.axes], "packing": rows, "zero": strategy.zero}


def same_codec_layout(a: dict, b: dict) -> bool:
    """Whether two ``codec_layout`` records place the codec's state alike.

    Args:
      a: a ``codec_layout`` record.
      b: another.

    Returns:
      Whether codec, options, exchange axes and packing agree (``zero`` is for reading only:
      ZeRO-0 and ZeRO-1 pack alike).
    """
    return all(a.get(k) == b.get(k) for k in _CODEC_KEYS)


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
