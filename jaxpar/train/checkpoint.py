"""Orbax checkpoints of a :class:`TrainState` plus a small JSON record, restorable onto any mesh.

One checkpoint is a directory ``<dir>/<step>/`` with two items: ``state`` (the
train state's arrays, written by every process for its own shards) and ``meta``
(JSON: the step, the data iterator state, seeds, the config name, ...).

* **Async and atomic.** :meth:`Checkpointer.save` copies the arrays to host and
  returns; a background thread writes them into ``<step>.orbax-checkpoint-tmp-*``
  and renames it to ``<step>`` only when complete. A crash mid-save leaves the
  temporary directory (ignored, removed by the next :class:`Checkpointer`), never a
  half-written ``<step>``. The last ``keep`` checkpoints are kept.
* **Resharding restore.** :meth:`Checkpointer.restore` reads into a target of
  ``ShapeDtypeStruct(..., sharding=...)`` (``layout.abstract_state()``): a state
  saved under ``fsdp=8`` restores under ``data=2 x tensor=4`` or on 4 devices.
* **Fallback.** A latest checkpoint that cannot be read (a truncated or deleted
  file, a step that disagrees with its record) is reported with a
  :class:`CheckpointWarning` naming the step and the reason; the previous one is
  used. No readable checkpoint at all raises :class:`CheckpointError` naming the directory.

Example::

    >>> import shutil, tempfile
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
    >>> from jaxpar.train.state import TrainState
    >>> mesh = jaxpar.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    >>> w = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("fsdp")))
    >>> state = TrainState(jnp.int32(100), {"w": w}, ())       # saved split over 2 devices
    >>> d = tempfile.mkdtemp()
    >>> ckpt = Checkpointer(d, every=100, keep=3)
    >>> step = 100
    >>> if ckpt.should_save(step):
    ...     ckpt.save(step, state, {"data": {"next_step": step}})
    True
    >>> ckpt.wait()                                # restore sees finished saves only
    >>> one = SingleDeviceSharding(jax.devices()[0])          # restored onto one device
    >>> target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), state)
    >>> restored = ckpt.restore(target)            # latest good checkpoint (or ckpt.restore(layout))
    >>> restored.step, restored.meta["data"], restored.state.params["w"].sharding == one
    (100, {'next_step': 100}, True)
    >>> restored.state.params["w"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    >>> ckpt.close()                               # waits for pending writes
    >>> shutil.rmtree(d)
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

__all__ = ["CheckpointError", "CheckpointWarning", "Checkpointer", "Restored", "FORMAT"]

#: Written into every checkpoint's JSON record; a restore checks it.
FORMAT = "jaxpar-checkpoint-1"


class CheckpointError(RuntimeError):
    """No usable checkpoint (the message names the directory and what was found there)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was unreadable and an older one is used instead."""


@dataclass
class Restored:
    """What :meth:`Checkpointer.restore` found: the state, its JSON record, and the steps it passed over."""

    step: int
    state: Any
    meta: dict
    path: str
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (step, reason) of unreadable newer ones


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


class Checkpointer:
    """Save / restore train states under ``directory`` with an Orbax ``CheckpointManager``.

    ``every``: :meth:`should_save` is true every ``every`` steps (0: never; the
    caller still saves at the end). ``keep``: how many of the newest checkpoints
    to keep. ``async_save``: write in a background thread (the arrays are copied
    to host before :meth:`save` returns, so the caller may donate them).
    """

    def __init__(self, directory: str | Path, *, every: int = 0, keep: int = 3, async_save: bool = True):
        for name, value, low in (("every", every, 0), ("keep", keep, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Checkpointer({name}={value!r}): must be an int >= {low}.")
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self.every, self.keep, self.async_save = every, keep, async_save
        # Partial saves of a crashed run: removed here, synchronously (Orbax's own cleanup runs in a
        # thread that can outlive a process ending right after, e.g. on a failed resume).
        self.removed_partial: list[str] = []
        if jax.process_index() == 0 and self.directory.is_dir():
            for tmp in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
                shutil.rmtree(tmp, ignore_errors=True)
                self.removed_partial.append(tmp.name)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            create=True,
        )
        # Arrays are written by replica 0 of each shard. Orbax's default on CPU ("replica-parallel")
        # slices replicated shards with small jitted programs: ~80 compilations (seconds) at the first save.
        arrays = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
        tree = ocp.PyTreeCheckpointHandler(type_handler_registry=arrays)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for args, handler in ((ocp.args.PyTreeSave, tree), (ocp.args.PyTreeRestore, tree)):
            registry.add("state", args, handler)
        for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
            registry.add("meta", args, ocp.JsonCheckpointHandler())
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._bad: set[int] = set()         # steps found unreadable by restore(): overwritten on save
        self.save_seconds: list[float] = []  # blocking time of each save() (host copy + dispatch)

    # ------------------------------------------------------------------ queries
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True every ``every`` steps (never for ``every=0``)."""
        return bool(self.every) and step > 0 and step % self.every == 0

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, meta: dict | None = None, *, wait: bool = False) -> bool:
        """Checkpoint ``state`` at ``step`` with the JSON record ``meta`` (plus ``step``, ``format``, ``time``).

        Returns False (and writes nothing) when a good checkpoint of ``step`` already
        exists. ``wait=True`` blocks until it is on disk.
        """
        ocp = self._ocp
        existing = set(self._manager.all_steps())
        if step in existing and step not in self._bad:
            if wait:
                self.wait()
            return False
        if step in existing:                     # an unreadable one passed over by restore(): replace it
            self._manager.delete(step)
            self._bad.discard(step)
        record = {**(meta or {}), "step": int(step), "format": FORMAT, "time": time.time()}
        comm = getattr(state, "comm", ())
        if jax.tree.leaves(comm):      # the codec state's shapes: a restore onto other replicas sees them
            record["comm_shapes"] = _shapes(comm)
        if hasattr(state, "stats"):    # running measurements (TrainState.stats): a restore compares them
            record["stats_shapes"] = _shapes(state.stats)
        if hasattr(state, "versions"):  # older weight versions (PipeDream-2BW's W(t-1)): a restore compares them
            record["versions_shapes"] = _shapes(state.versions)
        t0 = time.perf_counter()
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                         meta=ocp.args.JsonSave(record)), force=True)
        self.save_seconds.append(time.perf_counter() - t0)
        if wait:
            self.wait()
        return True

    def wait(self) -> None:
        """Block until every pending save is on disk (and old ones are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def restore(self, target: Any, step: int | None = None) -> Restored:
        """Restore the newest readable checkpoint (or exactly ``step``) into ``target``'s shardings.

        ``target`` is a :class:`~jaxpar.train.state.StateLayout` (its
        ``abstract_state()`` is used) or a tree of ``jax.ShapeDtypeStruct`` with
        shardings. Unreadable newer checkpoints are reported with a
        :class:`CheckpointWarning` and passed over; with ``step`` given, an
        unreadable one raises. Raises :class:`CheckpointError` when none is readable.
        """
        ocp = self._ocp
        abstract = target.abstract_state() if hasattr(target, "abstract_state") else target
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; "
                                      f"found steps {steps or 'none'}.")
            candidates = [step]
        else:
            candidates = steps[::-1]
        if not candidates:
            partial = self.removed_partial
            extra = f" (only unfinished saves, now removed: {', '.join(partial)})" if partial else ""
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}{extra}: "
                                  "the directory has no complete checkpoint. Train without resuming first, "
                                  "or point the checkpoint directory at an earlier run.")
        skipped: list[tuple[int, str]] = []
        for i, s in enumerate(candidates):
            try:
                state, meta = self._restore_one(s, abstract, target)
                if meta.get("step") != s or int(jax.device_get(state.step)) != s:
                    raise ValueError(f"the record says step {meta.get('step')!r} and the state says step "
                                     f"{int(jax.device_get(state.step))}, the directory says {s}")
            except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
                reason = _reason(e)
                skipped.append((s, reason))
                self._bad.add(s)
                if step is not None:
                    raise CheckpointError(f"checkpoint {self.directory / str(s)} is unreadable: {reason}") from e
                nxt = f"falling back to step {candidates[i + 1]}" if i + 1 < len(candidates) else "no older one left"
                warnings.warn(f"checkpoint {self.directory / str(s)} (step {s}) is unreadable, {nxt}: {reason}",
                              CheckpointWarning, stacklevel=2)
                continue
            return Restored(step=s, state=state, meta=meta, path=str(self.directory / str(s)), skipped=skipped)
        listing = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise CheckpointError(f"no readable checkpoint in {self.directory}: {listing}")

    def _restore_one(self, step: int, abstract: Any, target: Any) -> tuple[Any, dict]:
        """The state and record of ``step``. A gradient codec's state saved for another layout
        (another number of data-parallel replicas) is not restored but started afresh (zero
        residuals), with a :class:`CheckpointWarning`: the documented reshard policy. Running
        measurements (``TrainState.stats``) that the checkpoint lacks (older checkpoints, or
        saved without them) or holds in other shapes start afresh (zeros) too."""
        ocp = self._ocp
        meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        comm = getattr(abstract, "comm", ())
        fresh = bool(jax.tree.leaves(comm)) and meta.get("comm_shapes") != _shapes(comm)
        stats = getattr(abstract, "stats", None)
        fresh_stats = stats is not None and meta.get("stats_shapes") != _shapes(stats)
        versions = getattr(abstract, "versions", None)
        fresh_versions = versions is not None and meta.get("versions_shapes") != _shapes(versions)
        drop = [name for name, yes in (("comm", fresh), ("stats", fresh_stats), ("versions", fresh_versions)) if yes]
        item = abstract._asdict() if drop else abstract
        for name in drop:
            del item[name]
        args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=bool(drop))
        state = self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        if not drop:
            return state, meta
        if fresh_stats:
            state["stats"] = jax.tree.map(lambda a: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), a.sharding),
                                          stats)
            if jax.tree.leaves(stats) and "stats_shapes" in meta:
                warnings.warn(f"checkpoint {self.directory / str(step)}: the running measurements were saved with "
                              f"shapes {meta.get('stats_shapes')} and this layout has {_shapes(stats)}: they restart "
                              "from zero.", CheckpointWarning, stacklevel=3)
        if fresh_versions:    # none saved in this shape (another schedule): W(t-1) := W(t), as at step 0
            state["versions"] = _older_version(versions, state["params"], self.directory / str(step))
        if fresh:
            state["comm"] = (target.comm_init(state["params"]) if getattr(target, "comm_from_params", False)
                             else target.comm_init())
            what = ("the replicas (jaxpar.sync) restart from the restored parameters, with fresh inner optimizer "
                    "states" if getattr(target, "comm_from_params", False) else
                    "its residuals restart from zero (and 1-bit Adam's exchanged moment, step count and top-k's "
                    "ranking second moment)")
            warnings.warn(f"checkpoint {self.directory / str(step)}: the gradient codec's or replicas' state was saved "
                          f"with shapes {meta.get('comm_shapes')} and this layout needs {_shapes(comm)} (another "
                          f"number of replicas, or another codec): {what}. Parameters and optimizer state are "
                          "restored.", CheckpointWarning, stacklevel=3)
        return type(abstract)(**state), meta


def _older_version(versions: Any, params: Any, where: Path) -> Any:
    """Older weight versions for a checkpoint saved without them (another schedule, or weight
    stashing with another ``update_every`` / ``pipe``): copies of ``W(t)``, with a warning.
    ``versions`` is one params-like tree (PipeDream-2BW's ``W(t-1)``) or a tuple of them (weight
    stashing's older versions, newest first)."""
    if not jax.tree.leaves(versions):
        return versions
    warnings.warn(f"checkpoint {where}: no older weight versions of this layout saved (another pipeline schedule); "
                  "they resume equal to the current weights, W(t-1) = W(t), as at step 0.",
                  CheckpointWarning, stacklevel=4)
    copy = lambda v: jax.tree.map(lambda a, p: jax.device_put(jax.numpy.copy(p), a.sharding), v, params)  # noqa: E731
    if jax.tree.structure(versions) == jax.tree.structure(params):
        return copy(versions)
    return tuple(copy(v) for v in versions)


def _shapes(tree: Any) -> Any:
    """JSON-able shapes of a pytree of arrays (lists of ints, in the tree's structure)."""
    return json.loads(json.dumps(jax.tree.map(lambda a: list(a.shape), tree, is_leaf=lambda x: hasattr(x, "shape"))))
