"""Orbax checkpoints of a :class:`~jaxpar.step.TrainState` plus a small JSON record, restorable onto any mesh.

One checkpoint is a directory ``<dir>/<step>/`` with two items: ``state`` (the
train state's arrays, written by every process for its own shards) and ``meta``
(JSON: the step, the data iterator state, seeds, the config name, ...).

* **Async and atomic.** :meth:`Checkpointer.save` copies the arrays to host and returns; a
  background thread writes them into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
  only when complete. A crash mid-save leaves the temporary directory (ignored, removed by the next
  :class:`Checkpointer`), never a half-written ``<step>``. The last ``keep`` of the run are kept.
* **Resharding restore.** :meth:`Checkpointer.restore` reads into a target of
  ``ShapeDtypeStruct(..., sharding=...)`` (``layout.abstract_state()``): a state saved under
  ``fsdp=8`` restores under ``data=2 x tensor=4`` or on 4 devices.
* **Integrity.** The record holds a checksum of every parameter and optimizer array
  (:mod:`jaxpar.run._integrity`), compared at restore; a state with a non-finite parameter or moment is
  neither saved (a :class:`CheckpointWarning`, the good checkpoints kept) nor restored.
* **Fallback.** A latest checkpoint that cannot be read (a truncated or deleted
  file, a metadata file that is not UTF-8 JSON, named by its path in the step, a step that disagrees
  with its record, data that differ from the recorded checksums, a non-finite parameter or moment)
  is reported with a
  :class:`CheckpointWarning` naming the step and the reason; the previous one is
  used; the next save renames it to ``<step>.unreadable``, as a new :class:`Checkpointer` does to a step folder
  whose save never finished (``<step>.incomplete``), so that ``keep`` prunes good checkpoints only and nothing
  is deleted. No readable checkpoint at all raises :class:`CheckpointError` naming the directory;
  parameters or an optimizer state of another tree than the target's raise
  :class:`CheckpointMismatchError` (every checkpoint of the run would fail alike).
* **Features switched on or off.** A feature's state part (``codec``, ``sync``, ``stats``,
  ``versions``) is dropped when the target keeps none, and started afresh when the checkpoint has
  none or has it in other shapes or for another layout, each with a :class:`CheckpointWarning`
  (each part's restore policy is the step's, :data:`jaxpar.step.RESTORE_POLICIES`; :mod:`jaxpar.run._state_parts`).

Example::

    >>> import shutil, tempfile
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
    >>> from jaxpar.step._state import TrainState
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

import base64
import json
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxpar.adapters._layer_lists import change_form
from jaxpar.run._state_parts import (FORMAT, lists_record, plan_parts, record_layouts, record_shapes,
                                     saved_lists)
from jaxpar.run._integrity import inspect_state, verify_state
from jaxpar.devices._distributed import sync_processes
from jaxpar.run._run_directory import checkpoint_steps, refuse_later_steps, set_aside
from jaxpar.errors import CheckpointError, CheckpointMismatchError, CheckpointWarning, check_int
from jaxpar.rules import path_str


@dataclass
class Restored:
    """What :meth:`Checkpointer.restore` found: the state, its JSON record, and the steps it passed over."""

    step: int
    state: Any
    meta: dict
    path: str
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (step, reason) of unreadable newer ones


def no_checkpoint_error(directory: str | Path, unfinished: list[str] = ()) -> CheckpointError:
    """The error of a resume that finds no complete checkpoint in ``directory`` (``unfinished``: the names of
    the partial saves removed or set aside)."""
    extra = f" (only unfinished saves: {', '.join(unfinished)})" if unfinished else ""
    return CheckpointError(f"no checkpoint to resume from in {directory}{extra}: the directory has no complete "
                           "checkpoint. Train without resuming first (without --resume), or point checkpoint.dir at "
                           "an earlier run's checkpoints.")


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    kind = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "     # jaxpar's own say what they are
    return f"{kind}{text[:300]}{'...' if len(text) > 300 else ''}"


class Checkpointer:
    """Save / restore train states under ``directory`` with an Orbax ``CheckpointManager``.

    ``every``: :meth:`should_save` is true every ``every`` steps (0: never; the caller still saves
    at the end). ``keep``: how many of the newest checkpoints to keep. ``async_save``: write in a
    background thread (the arrays are copied to host before :meth:`save` returns, so the caller may
    donate them). ``layout``: the :class:`~jaxpar.step.StateLayout` of the states :meth:`save`
    is given when it is not told one (:meth:`restore` of a layout sets it too); with it, a record
    says which layout the codec state and older weight versions were saved for.
    """

    def __init__(self, directory: str | Path, *, every: int = 0, keep: int = 3, async_save: bool = True,
                 layout: Any = None):
        check_int("Checkpointer", "every", every, 0, CheckpointError)
        check_int("Checkpointer", "keep", keep, 1, CheckpointError)
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self.every, self.keep, self.async_save = every, keep, async_save
        self.layout = layout
        # Partial saves of a crashed run: removed here, synchronously (Orbax's own cleanup runs in a
        # thread that can outlive a process ending right after, e.g. on a failed resume).
        # A step folder without Orbax's completion record (an interrupted or empty save) is set aside, so that
        # keep prunes good checkpoints only.
        self.removed_partial: list[str] = []
        self.set_aside: list[str] = []
        if jax.process_index() == 0 and self.directory.is_dir():
            for tmp in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
                shutil.rmtree(tmp, ignore_errors=True)
                self.removed_partial.append(tmp.name)
            for s in checkpoint_steps(self.directory, complete=False):
                self.set_aside.append(set_aside(self.directory, s, "incomplete").name)
        options = ocp.CheckpointManagerOptions(preservation_policy=ocp.checkpoint_managers.LatestN(keep),
                                               enable_async_checkpointing=async_save, create=True)
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

    def steps_after(self, step: int, steps: Any = None) -> list[int]:
        """The good checkpoints after ``step`` (those :meth:`restore` found unreadable left out).

        Args:
          step: a step.
          steps: the steps on disk (None: :meth:`steps`).

        Returns:
          Their steps, oldest first.
        """
        return sorted(s for s in (self.steps() if steps is None else steps) if s > step and s not in self._bad)

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint at a step.

        Args:
          step: the step just trained.

        Returns:
          True every ``every`` steps (never for ``every=0`` or step 0).
        """
        return bool(self.every) and step > 0 and step % self.every == 0

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, meta: dict | None = None, *, wait: bool = False,
             layout: Any = None) -> bool:
        """Checkpoint a state with its JSON record.

        Args:
          step: the step; the checkpoint is ``<directory>/<step>``.
          state: the train state (its arrays are on the host before this returns).
          meta: the JSON record (``step``, ``format`` and ``time`` are added).
          wait: block until it is on disk.
          layout: the state's :class:`~jaxpar.step.StateLayout` (default: the checkpointer's
            ``layout``); the record then says which layout the codec state and older weight versions
            are laid out for (``codec_layout``, ``sync_layout``, ``versions_layout``), so that a
            restore under another one starts them afresh. Without one the record has shapes only.

        Returns:
          True, or False (nothing written, a :class:`CheckpointWarning` naming the step and the directory)
          when a good checkpoint of ``step`` exists. Those :meth:`restore` found unreadable are first renamed
          to ``<step>.unreadable``.

        Raises:
          RunDirectoryError: good checkpoints of later steps exist (another run's, which ``keep`` would prune).
        """
        ocp = self._ocp
        existing = set(self._manager.all_steps())
        if step in existing and step not in self._bad:
            why = (f"{self.directory / str(step)} already holds a checkpoint of step {step}, which is kept. To keep "
                   "both, save into another directory.")
        else:
            refuse_later_steps(f"Checkpointer.save(step={step})", self.directory, self.steps_after(step, existing),
                               self.keep)
            checksums, bad = inspect_state(state)
            why = (f"non-finite values in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}. The good checkpoints "
                   f"in {self.directory} are kept; on_nonfinite: skip (or stop) keeps such an update out of the "
                   "state.") if bad else None
        if why is not None:
            warnings.warn(f"checkpoint of step {step} not saved: {why}", CheckpointWarning, stacklevel=2)
        else:
            if self._bad:                  # those restore() found unreadable: set aside before keep prunes
                self._set_aside_unreadable()
            layout = layout if layout is not None else self.layout
            record = {**(meta or {}), "step": int(step), "format": FORMAT, "time": time.time(), "checksums": checksums,
                      **record_shapes(state), **lists_record(layout), **record_layouts(layout, state)}
            t0 = time.perf_counter()
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                             meta=ocp.args.JsonSave(record)), force=True)
            self.save_seconds.append(time.perf_counter() - t0)
        if wait:
            self.wait()
        return why is None

    def _set_aside_unreadable(self) -> None:
        """Rename the checkpoints :meth:`restore` found unreadable to ``<step>.unreadable`` (process 0; every
        process then reads the directory again): ``keep`` counts good checkpoints only, and a save of that
        step writes a new one."""
        if jax.process_index() == 0:
            for s in sorted(self._bad):
                if (self.directory / str(s)).is_dir():
                    self.set_aside.append(set_aside(self.directory, s, "unreadable").name)
        sync_processes("jaxpar.Checkpointer.set_aside")
        self._bad.clear()
        self._manager.reload()

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

        Unreadable newer checkpoints are reported with a :class:`CheckpointWarning` and passed
        over. A layout given becomes the checkpointer's ``layout``.

        Args:
          target: a :class:`~jaxpar.step.StateLayout` (its ``abstract_state()`` is used) or
            a tree of ``jax.ShapeDtypeStruct`` with shardings.
          step: restore exactly this step (an unreadable one raises); None: the newest readable.

        Returns:
          A :class:`Restored`: the state, its JSON record, and the newer steps passed over.

        Raises:
          CheckpointError: no checkpoint is readable, or ``step`` is missing or unreadable.
          CheckpointMismatchError: the parameters or optimizer state are another tree than the target's.
        """
        abstract = target.abstract_state() if hasattr(target, "abstract_state") else target
        steps = self.steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; found steps {steps or 'none'}.")
        candidates = steps[::-1] if step is None else [step]
        if not candidates:
            raise no_checkpoint_error(self.directory, [*self.removed_partial, *self.set_aside])
        skipped: list[tuple[int, str]] = []
        for i, s in enumerate(candidates):
            try:
                state, meta = self._restore_one(s, abstract, target)
                if meta.get("step") != s or int(jax.device_get(state.step)) != s:
                    raise CheckpointError(f"the record says step {meta.get('step')!r} and the state says step "
                                          f"{int(jax.device_get(state.step))}, the directory says {s}")
            except CheckpointMismatchError:
                raise
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
            if hasattr(target, "abstract_state"):
                self.layout = target
            return Restored(step=s, state=state, meta=meta, path=str(self.directory / str(s)), skipped=skipped)
        listing = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise CheckpointError(f"no readable checkpoint in {self.directory}: {listing}")

    def _restore_one(self, step: int, abstract: Any, target: Any) -> tuple[Any, dict]:
        """The state and record of ``step``. The optional parts (``codec``, ``sync``, ``stats``, ``versions``)
        are restored, dropped or started afresh as :func:`~jaxpar.run._state_parts.plan_parts`
        decides, each change with a :class:`CheckpointWarning`; a gradient codec's state saved for
        another layout starts afresh (zero residuals): the documented reshard policy."""
        ocp = self._ocp
        if (bad := _bad_json_file(self.directory / str(step))) is not None:
            raise CheckpointError(bad)
        meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        if meta.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} was written in format {meta.get('format')!r}; this jaxpar "
                f"reads {FORMAT!r} only. Resume it with the jaxpar that wrote it, or start a new run.")
        have, want = saved_lists(meta), dict(getattr(target, "layer_lists", None) or {})
        as_saved = not hasattr(target, "strategy") or have == want
        if as_saved:
            state = self._restore_as_saved(step, abstract, target, meta)
        else:   # nnx.List layers saved stacked and restored as a list (or the other way): read them as saved
            state = self._restore_as_saved(step, change_form(abstract, want, have), target, meta)
            shardings = jax.tree.map(lambda a: a.sharding, abstract)
            state = jax.jit(lambda st: change_form(st, have, want), out_shardings=shardings)(state)
        if (corrupt := verify_state(state, meta.get("checksums") if as_saved else None)) is not None:
            raise CheckpointError(corrupt)
        return state, meta

    def _restore_as_saved(self, step: int, abstract: Any, target: Any, meta: dict) -> Any:
        """The state of ``step`` into ``abstract``, the tree as it was saved."""
        ocp = self._ocp
        where = f"checkpoint {self.directory / str(step)}"
        plans = plan_parts(meta, abstract, target, where)
        self._check_tree(step, abstract)
        skip = [p.part.name for p in plans if p.action != "restore"]
        if not skip:
            args = ocp.args.PyTreeRestore(item=abstract,
                                          restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
            return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        item = abstract._asdict()
        for name in skip:
            del item[name]
        args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=True)
        saved = self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        state = {name: saved[name] for name in abstract._fields if name not in skip}
        for p in plans:
            if p.action in ("empty", "drop"):
                state[p.part.name] = getattr(abstract, p.part.name)      # no leaves: the target's own empty part
            elif p.action == "fresh":
                state[p.part.name] = p.part.fresh(abstract, state["params"], target, where)
            if p.message:
                warnings.warn(p.message, CheckpointWarning, stacklevel=4)
        return type(abstract)(**state)

    def _check_tree(self, step: int, abstract: Any) -> None:
        """Raises :class:`CheckpointMismatchError` when the saved ``params`` or ``opt_state`` are
        another tree than ``abstract``'s (Orbax's restore would fail, or fill what it lacks
        silently); other trees (no such fields) are left to Orbax."""
        fields = getattr(abstract, "_fields", ())
        saved = self._manager.item_metadata(step)["state"]
        saved = getattr(saved, "tree", saved)
        for name, what in (("params", "the parameters (params) were"),
                           ("opt_state", "the optimizer state (opt_state) was")):
            if name not in fields or not isinstance(saved, dict) or name not in saved:
                continue
            diff = _tree_mismatch(saved[name], getattr(abstract, name))
            if diff is None:
                continue
            why = ("another model or model configuration" if name == "params" else
                   "another optimizer, or relaxed synchronisation switched on or off (DiLoCo and EASGD keep an outer "
                   "optimizer's state instead of the optimizer's)")
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)}: {what} saved as another tree than this run's ({diff}): "
                f"{why}. It cannot be restored, and no older checkpoint is tried (they share it). Resume with the "
                "settings the checkpoint was saved with, or start a new run.")


#: The JSON files of a checkpoint step that a restore reads (the record, Orbax's tree metadata and shardings).
JSON_FILES = ("meta/metadata", "state/_METADATA", "state/_sharding")


def _bad_json_file(step_dir: Path) -> str | None:
    """The first of a step's :data:`JSON_FILES` that is not UTF-8 JSON, named with what is wrong (None: all
    parse; a missing one is left to Orbax, which names it)."""
    for name in JSON_FILES:
        entry = ""
        try:
            tree = json.loads((step_dir / name).read_bytes().decode("utf-8"))
            if name == "state/_sharding" and isinstance(tree, dict):    # each array's sharding: JSON in a string
                for key, value in tree.items():
                    entry = f" in its entry of {_array_key(key)}"
                    if isinstance(value, str):
                        json.loads(value)
        except FileNotFoundError:
            continue
        except (UnicodeDecodeError, ValueError) as e:
            what = "UTF-8" if isinstance(e, UnicodeDecodeError) else "JSON"
            return (f"its file {name} is not valid {what}{entry} "
                    f"({type(e).__name__}: {' '.join(str(e).split())[:200]})")
    return None


def _array_key(key: str) -> str:
    """An array's name in Orbax's ``_sharding`` (its path, base64-encoded), decoded where it decodes."""
    try:
        return base64.b64decode(key, validate=True).decode("utf-8")
    except ValueError:
        return key


def _flat_shapes(tree: Any) -> dict:
    return {path_str(p): tuple(getattr(leaf, "shape", ())) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _tree_mismatch(saved: Any, target: Any) -> str | None:
    """How a saved tree (Orbax's metadata of it) differs from a target tree, by leaf path and shape.

    Orbax saves a named tuple as a dict of its fields and a tuple as a list, which is how
    ``jax.tree_util`` names their paths too, so the paths of both sides compare as strings.

    Args:
      saved: the checkpoint's tree metadata (leaves with a ``shape``).
      target: the target's tree (``ShapeDtypeStruct`` leaves).

    Returns:
      ``None`` when the paths and shapes agree, else the first differences in words.
    """
    a, b = _flat_shapes(saved), _flat_shapes(target)
    if a == b:
        return None
    parts = []
    for label, keys in (("only in the checkpoint", sorted(set(a) - set(b))),
                        ("only in this run", sorted(set(b) - set(a)))):
        if keys:
            parts.append(f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} ({len(keys)} entries)")
    other = [f"{k} {list(a[k])} saved, {list(b[k])} here" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    if other:
        parts.append(f"other shapes: {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}")
    return "; ".join(parts)
