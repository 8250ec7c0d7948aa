"""How each optional part of a :class:`~jaxpar.step.TrainState` restores from a checkpoint: its restore policy as
data (:class:`RestorePolicy`; :data:`RESTORE_POLICIES`, one per optional ``TrainState`` field), read by one
:meth:`RestorePolicy.plan` (restore, drop, or start afresh with a warning). The checkpoint
(:mod:`jaxpar.run._state_parts`) reads these policies; it keeps none of its own. The policy: docs/training.md.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from jaxpar.step._state import TrainState
    >>> abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, ())
    >>> [policy.name for policy in RESTORE_POLICIES]
    ['codec', 'sync', 'stats', 'versions']
    >>> codec = RESTORE_POLICIES[0]
    >>> plan = codec.plan({"codec_shapes": {"residual": [4, 2]}}, abstract.codec, abstract, "checkpoint 7")
    >>> plan.action, plan.message[:80]
    ('drop', "checkpoint 7: the gradient codec's state saved with it is dropped (shapes {'resi")
    >>> RESTORE_POLICIES[3].describe({"schedule": "pipedream", "pipe": 2, "update_every": 1, "stage_layers": None})
    "schedule='pipedream', pipe=2, update_every=1, stage_layers=None"
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxpar.errors import CheckpointMismatchError
from jaxpar.step._exchange import compression_plan

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
      part: the :class:`RestorePolicy`.
      action: ``"restore"`` (read from the checkpoint), ``"empty"`` (neither side has one),
        ``"drop"`` (the checkpoint has one, the target none) or ``"fresh"`` (the target's is
        started afresh: :meth:`RestorePolicy.fresh`).
      message: the warning to give, or ``None``.
    """

    part: RestorePolicy
    action: str
    message: str | None = None


@dataclass(frozen=True)
class RestorePolicy:
    """One optional part of a :class:`~jaxpar.step.TrainState` as a checkpoint sees it: its restore
    policy as data. The four are :data:`RESTORE_POLICIES`; :meth:`plan` reads them.

    The messages are ``str.format`` templates of ``where``, ``what``, ``saved`` / ``shapes`` (the
    checkpoint's and the target's shapes), ``saved_names`` / ``names`` (their entries),
    ``old`` / ``new`` (the checkpoint's and the target's layout record in words), ``was`` (``old`` in
    parentheses, or nothing when unrecorded), ``about`` (``old``, or the saved shapes) and ``schedule``
    (the target's pipeline schedule in parentheses).

    Attributes:
      name: the ``TrainState`` field; the record's keys are ``<name>_shapes`` and ``<name>_layout``.
      what: the part in words, for the messages.
      missing: the warning when the checkpoint has none and the target keeps one.
      reshaped: the warning when the saved shapes are not the target's.
      relaid: the warning when the same shapes were saved for another layout (``None``: never).
      dropped: the warning when the target keeps none.
      shapes_always: a save records the part's shapes even when it keeps none (``[]``).
      records: ``records(layout)`` -> the ``<name>_layout`` record (``None``: none is kept).
      words: ``words(record)`` -> the record in words (default: its ``key=value`` entries).
      layout_keys: the record's entries that place the values (``None``: all of them).
      start: ``start(abstract, params)`` -> the part afresh (``None``: the layout part's ``init``).
    """

    name: str
    what: str
    missing: str
    reshaped: str
    relaid: str | None
    dropped: str
    shapes_always: bool = False
    records: Callable[[Any], dict] | None = None
    words: Callable[[dict], str] = lambda record: ", ".join(f"{k}={v}" for k, v in record.items())
    layout_keys: tuple[str, ...] | None = None
    start: Callable[[Any, Any], Any] | None = None

    def record(self, layout: Any) -> dict | None:
        """The part's layout record.

        Args:
          layout: the state's :class:`~jaxpar.step.StateLayout`.

        Returns:
          The ``<name>_layout`` record, or ``None`` (none kept, or the layout has no such part).
        """
        if self.records is None or not jax.tree.leaves(layout.part(self.name).shapes):
            return None
        return self.records(layout)

    def describe(self, record: dict | None) -> str:
        """A layout record in words.

        Args:
          record: a ``<name>_layout`` record, or ``None``.

        Returns:
          The words, or ``"an unrecorded layout"``.
        """
        return self.words(record) if record else "an unrecorded layout"

    def same_layout(self, old: dict, new: dict) -> bool:
        """Whether the values saved for one layout belong where another reads them.

        Args:
          old: the checkpoint's ``<name>_layout`` record.
          new: the target's.

        Returns:
          True when the entries that place the values (``layout_keys``) agree.
        """
        return old == new if self.layout_keys is None else all(old.get(k) == new.get(k) for k in self.layout_keys)

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
        saved, old = meta.get(f"{self.name}_shapes"), meta.get(f"{self.name}_layout")
        new = self.record(target) if _is_layout(target) else None
        words = self._words(saved, old, new, abstract_part, target, where)
        if not jax.tree.leaves(abstract_part):
            return PartPlan(self, "drop", f"{self.dropped.format(**words)}. {_RESTORED}") if saved else \
                PartPlan(self, "empty")
        if not saved:
            why = self.missing
        elif saved != words["shapes"]:
            why = self.reshaped
        elif old and new and not self.same_layout(old, new):
            why = self.relaid
        else:
            return PartPlan(self, "restore")
        return PartPlan(self, "fresh", why.format(**words))

    def _words(self, saved, old, new, abstract_part, target, where) -> dict:
        """The fields of the messages' templates."""
        shapes = shapes_of(abstract_part)
        return dict(where=where, what=self.what, saved=saved, shapes=shapes, saved_names=_names(saved),
                    names=_names(shapes), old=self.describe(old), new=self.describe(new),
                    was=f" ({self.describe(old)})" if old else "",
                    about=self.describe(old) if old else f"shapes {saved}",
                    schedule=f" ({target.strategy.schedule!r})" if _is_layout(target) else "")

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
        if self.start is not None:
            return self.start(abstract, params)
        if not _is_layout(target) or target.part(self.name).init is None:
            raise CheckpointMismatchError(f"{where}: {self.what} cannot be restored into this target and has to start "
                                          "afresh, which needs the StateLayout: call restore(layout).")
        return target.part(self.name).init(params)


def _names(shapes: Any) -> str:
    return ", ".join(shapes) if isinstance(shapes, dict) else str(shapes)


# Options left out of a codec's description at these values (the codec factories' defaults).
_DEFAULT_OPTIONS = {"momentum": 0.0, "warmup": [], "warmup_steps": 0, "seed": 0, "error_feedback": True,
                    "optimizer_momentum": 0.0, "start_step": 0, "partitioned": False, "precondition": 0.0,
                    "options": {}, "warm_start": True, "min_compression_rate": 2.0}
_CODEC_FRESH = ("its residuals {} from zero (and 1-bit Adam's exchanged moment, step count and top-k's ranking "
                "second moment). " + _RESTORED)


def _codec_record(layout: Any) -> dict:
    """``TrainState.codec``'s record, ``{"codec", "options", "axes", "packing", "zero"}``: ``axes`` the
    exchange's data axes and sizes in replica order, ``packing`` each gradient leaf's dimension cut into
    the buffer's rows (``None``: flattened into the rest), or ``None`` for PowerSGD, whose state is per
    leaf; ``zero`` is for reading only (ZeRO-0 and ZeRO-1 pack alike).

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.parallel.compression import topk
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> codec = RESTORE_POLICIES[0]
    >>> records = [codec.record(jaxpar.state_layout(model_fn, optax.sgd(0.1), mesh,
    ...                                             jaxpar.Strategy(zero=z, compression=topk(0.1)))) for z in (1, 3)]
    >>> for record in records:
    ...     print(codec.describe(record))
    topk(ratio=0.1) over data=4, zero=1: gradients packed flat
    topk(ratio=0.1) over data=4, zero=3: 7 of 8 gradient leaves packed by their data shard
    >>> codec.same_layout(*records)
    False
    """
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


def _codec_words(record: dict) -> str:
    """A codec record in words: its options off their defaults, its axes and its packing."""
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


def _versions_record(layout: Any) -> dict:
    """``TrainState.versions``' record: ``{"schedule"}`` for PipeDream-2BW (its ``W(t-1)`` is the whole
    model's previous weights); for weight stashing, whose older versions are each stage's own, also
    ``pipe``, ``update_every`` and ``stage_layers``, which must all agree."""
    s = layout.strategy
    out = {"schedule": s.schedule}
    if s.schedule == "pipedream":
        out.update(pipe=int(dict(layout.mesh.shape).get("pipe", 1)), update_every=s.update_every,
                   stage_layers=json.loads(json.dumps(s.stage_layers)))     # tuples as lists
    return out


def _zeros(abstract: Any, params: Any) -> Any:
    """Fresh running measurements: zeros."""
    return jax.tree.map(lambda a: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), a.sharding), abstract.stats)


def _copies(abstract: Any, params: Any) -> Any:
    """Fresh older weight versions: copies of the restored parameters, ``W(t-1) = W(t)``, as at step 0."""
    versions = abstract.versions
    if not jax.tree.leaves(versions):
        return versions
    def copy(v):
        return jax.tree.map(lambda a, p: jax.device_put(jax.numpy.copy(p), a.sharding), v, params)

    if jax.tree.structure(versions) == jax.tree.structure(params):     # PipeDream-2BW's W(t-1)
        return copy(versions)
    return tuple(copy(v) for v in versions)                           # weight stashing's, newest first


_SYNC_FRESH = ("the replicas (jaxpar.parallel.sync) restart from the restored parameters, with fresh inner optimizer "
               "states. " + _RESTORED)
_EQUAL = "they resume equal to the current weights, W(t-1) = W(t), as at step 0."
_NO_VERSIONS = "{where}: no older weight versions of this layout saved (another pipeline schedule); " + _EQUAL

#: The optional parts of a :class:`~jaxpar.step.TrainState`, in its field order: a codec's per-replica
#: state and relaxed synchronisation's replicas start afresh from the layout part's init, running
#: measurements from zero, a pipeline schedule's older weight versions as copies of the parameters.
RESTORE_POLICIES: tuple[RestorePolicy, ...] = (
    RestorePolicy(
        "codec", "the gradient codec's state",
        missing="{where}: the checkpoint has no gradient codec state (saved without compression, or with a codec "
                "that keeps none); this run has {new}: " + _CODEC_FRESH.format("start"),
        reshaped="{where}: {what} was saved with shapes {saved} and this layout needs {shapes} (another number of "
                 "replicas, or another codec): " + _CODEC_FRESH.format("restart"),
        relaid="{where}: {what} was saved for {old} and this run has {new}: the same shapes, but its entries belong to "
               "other replicas or gradient coordinates (another exchange, packing or codec): "
               + _CODEC_FRESH.format("restart"),
        dropped="{where}: {what} saved with it is dropped ({about}): this run keeps none (no compression, or a codec "
                "that keeps none)",
        records=_codec_record, words=_codec_words, layout_keys=("codec", "options", "axes", "packing")),
    RestorePolicy(
        "sync", "relaxed synchronisation's replicas",
        missing="{where}: the checkpoint has no replica state (saved without relaxed synchronisation): " + _SYNC_FRESH,
        reshaped="{where}: relaxed synchronisation's state was saved with shapes {saved} and this layout needs "
                 "{shapes} (another number of replicas, or another sync kind): " + _SYNC_FRESH,
        relaid=None, dropped="{where}: {what} saved with it are dropped{was}: this run keeps none (no Strategy.sync "
                             "and no replica axis)",
        records=lambda layout: {"sync": getattr(layout.strategy.sync, "name", None) or "synchronous"},
        words=lambda record: f"Strategy.sync={record.get('sync')}", layout_keys=()),      # any sync, alike
    RestorePolicy(
        "stats", "the running measurements",
        missing="{where}: the checkpoint has no running measurements (saved without them): the measurements ({names}) "
                "restart from zero.",
        reshaped="{where}: {what} were saved with shapes {saved} and this layout has {shapes}: they restart from zero.",
        relaid=None, dropped="{where}: {what} saved with it ({saved_names}) are dropped: this run measures none",
        shapes_always=True, start=_zeros),
    RestorePolicy(
        "versions", "the older weight versions", missing=_NO_VERSIONS, reshaped=_NO_VERSIONS,
        relaid="{where}: {what} were saved for {old} and this run has {new}: the same shapes, but each stage's older "
               "versions are its own stage's and update interval's, so " + _EQUAL,
        dropped="{where}: {what} saved with it{was} are dropped: this run's pipeline schedule{schedule} keeps none",
        shapes_always=True, records=_versions_record, start=_copies,
        words=lambda record: ", ".join([f"schedule={record['schedule']!r}"]
                                       + [f"{k}={v}" for k, v in record.items() if k != "schedule"])),
)
