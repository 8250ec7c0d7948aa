"""A run directory holds one run, so that ``checkpoint.keep`` prunes only the run's own checkpoints and
``--resume``, ``jaxpar sample`` and ``jaxpar export`` read the run trained last.

* :func:`earlier_run`: what marks ``train.out_dir`` and ``checkpoint.dir`` as a run's (:data:`RUN_RECORDS`,
  complete checkpoints).
* :func:`claim_run_directory`: a new run there is refused, or with ``overwrite`` (``jaxpar train
  --overwrite``) the earlier run is moved aside to ``<train.out_dir>.old-<n>``; nothing is deleted.
* :func:`refuse_later_steps`: a run that starts at or saves a step beside good checkpoints of later steps
  (:meth:`~jaxpar.run.Checkpointer.steps_after`) is refused before ``keep`` prunes them.

Example::

    >>> import pathlib, tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "run"
    >>> claim_run_directory(out, out / "checkpoints") is None           # nothing there: a new run starts
    True
    >>> (out / "checkpoints").mkdir(parents=True)
    >>> _ = (out / "config.yaml").write_text("model: ...")             # a start that crashed before step 1
    >>> earlier_run(out, out / "checkpoints")
    ''
    >>> (out / "checkpoints" / "100").mkdir()                    # an interrupted save: no checkpoint
    >>> _ = (out / "metrics.jsonl").write_text("{}")
    >>> earlier_run(out, out / "checkpoints")
    ''
    >>> _ = (out / "checkpoints" / "100" / COMPLETE).write_text("{}")  # Orbax's record of a finished save
    >>> earlier_run(out, out / "checkpoints").endswith("/checkpoints; config.yaml, metrics.jsonl")
    True
    >>> moved = claim_run_directory(out, out / "checkpoints", overwrite=True)
    moved    the earlier run in .../run to .../run.old-1 (read it with train.out_dir=... checkpoint.dir=...)
    >>> moved.out_dir.name, sorted(p.name for p in moved.out_dir.iterdir()), earlier_run(out, out / "checkpoints")
    ('run.old-1', ['checkpoints', 'config.yaml', 'metrics.jsonl'], '')
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import jax

from jaxpar.devices._distributed import sync_processes
from jaxpar.errors import RunDirectoryError

#: The file Orbax writes into a step's folder when its save is complete (a folder without it is an interrupted
#: save, or an empty one).
COMPLETE = "_CHECKPOINT_METADATA"
#: What marks ``train.out_dir`` as a run's, beside the checkpoints in ``checkpoint.dir``.
RUN_RECORDS = ("config.yaml", "metrics.jsonl", "summary.json")
#: What a run writes in ``train.out_dir``: moved aside with its checkpoints by :func:`claim_run_directory`.
RUN_FILES = (*RUN_RECORDS, "loss.png", "noise_scale.png", "samples.txt", "tb", "trace")


class Moved(NamedTuple):
    """Where :func:`claim_run_directory` moved an earlier run: its files (``out_dir``) and its checkpoints
    (``checkpoint_dir``; None: it had none)."""

    out_dir: Path
    checkpoint_dir: Path | None


def checkpoint_steps(directory: str | Path | None, *, complete: bool = True) -> list[int]:
    """The steps of the checkpoints in ``directory``: Orbax's ``<step>`` folders, none opened.

    Args:
      directory: a checkpoint directory (None or missing: none).
      complete: only those whose save finished (:data:`COMPLETE`); False: only those whose save did not.

    Returns:
      Their steps, oldest first.
    """
    if directory is None or not Path(directory).is_dir():
        return []
    return sorted(int(p.name) for p in Path(directory).iterdir()
                  if p.name.isdigit() and p.is_dir() and (p / COMPLETE).is_file() == complete)


def earlier_run(out_dir: str | Path, checkpoint_dir: str | Path | None = None) -> str:
    """What an earlier run left in a run's directories.

    Args:
      out_dir: the run's ``train.out_dir``.
      checkpoint_dir: its ``checkpoint.dir`` (None: no checkpoints).

    Returns:
      The complete checkpoints and the :data:`RUN_RECORDS` files found, in words
      (``"checkpoints of steps [100, 200] in DIR; config.yaml, metrics.jsonl"``); empty: the directories hold no
      run. A run is what can be continued or read: a complete checkpoint, a ``summary.json`` (a run that
      finished), or without checkpoints (``checkpoint_dir`` None) a non-empty ``metrics.jsonl``. A start that
      left none of them (it crashed while compiling, or before its first checkpoint: ``--resume`` has nothing
      to continue) is no run: its retry takes the directory.
    """
    out = Path(out_dir)
    steps = checkpoint_steps(checkpoint_dir)
    records = ("summary.json",) if checkpoint_dir is not None else ("metrics.jsonl", "summary.json")
    recorded = [name for name in records if (out / name).is_file() and (out / name).stat().st_size > 0]
    if not steps and not recorded:
        return ""
    found = [", ".join(name for name in RUN_RECORDS if (out / name).exists())]
    if steps:
        found.insert(0, f"checkpoints of steps {steps} in {checkpoint_dir}")
    return "; ".join(words for words in found if words)


def set_aside(directory: str | Path, step: int, why: str) -> Path:
    """Rename the checkpoint folder ``<directory>/<step>`` to ``<step>.<why>`` (``<step>.<why>-2``, ... when
    taken), where Orbax no longer counts it as a step: ``keep`` prunes good checkpoints only, and a new save of
    ``step`` finds the name free. Nothing is deleted.

    Args:
      directory: the checkpoint directory.
      step: the step whose folder goes.
      why: the new name's suffix (``incomplete``, ``unreadable``).

    Returns:
      The new path.
    """
    src, n = Path(directory) / str(step), 1
    dest = src.with_name(f"{step}.{why}")
    while dest.exists():
        n += 1
        dest = src.with_name(f"{step}.{why}-{n}")
    src.rename(dest)
    return dest


def _aside(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.old-{n}")


def claim_run_directory(out_dir: str | Path, checkpoint_dir: str | Path | None = None, *,
                        overwrite: bool = False) -> Moved | None:
    """Make ``out_dir`` (and ``checkpoint_dir``) a new run's: refuse directories that hold an earlier run
    (:func:`earlier_run`), or with ``overwrite`` move that run aside. Nothing is deleted.

    Call it before the run writes anything, and before a :class:`~jaxpar.run.Checkpointer` of
    ``checkpoint_dir`` is made. Every process calls it (only process 0 moves files).

    Args:
      out_dir: the run's ``train.out_dir``.
      checkpoint_dir: its ``checkpoint.dir`` (None: no checkpoints).
      overwrite: move the earlier run's :data:`RUN_FILES` to ``<out_dir>.old-<n>`` (the smallest free ``n``)
        and its checkpoint directory with them (to the same place relative to it; one outside ``out_dir``
        to ``<checkpoint_dir>.old-<n>``).

    Returns:
      Where the earlier run went (:class:`Moved`; a ``moved ...`` line says where and how to read it), or
      None: there was none.

    Raises:
      RunDirectoryError: the directories hold an earlier run and ``overwrite`` is false.
    """
    out = Path(out_dir).resolve()
    ck = None if checkpoint_dir is None else Path(checkpoint_dir).resolve()
    found, moved, n = earlier_run(out, ck), None, 1
    while found and (_aside(out, n).exists() or (ck is not None and _aside(ck, n).exists())):
        n += 1
    if found and not overwrite:
        raise RunDirectoryError(
            f"train.out_dir={str(out_dir)!r} holds an earlier run ({found}). A new run there would mix "
            "with it: its records overwritten, its checkpoints pruned by checkpoint.keep, and --resume, jaxpar "
            "sample and jaxpar export reading either run's. Continue it with --resume (checkpoint.resume=true), "
            "start the new run elsewhere with train.out_dir=NEW_DIR, or pass --overwrite to move the earlier run "
            f"aside to {_aside(out, n)} (nothing is deleted).")
    if found:
        sync_processes("jaxpar.claim_run_directory.looked")     # every process has looked before process 0 moves
        moved = _move_aside(out, ck, n)
        read = f"train.out_dir={moved.out_dir}" + (f" checkpoint.dir={moved.checkpoint_dir}" if moved.checkpoint_dir
                                                   else "")
        print(f"moved    the earlier run in {out_dir} to {moved.out_dir} (read it with {read})")
    sync_processes("jaxpar.claim_run_directory.claimed")        # and before any process writes there
    return moved


def _move_aside(out: Path, ck: Path | None, n: int) -> Moved:
    """Move the run in ``out`` (and ``ck``) to ``<out>.old-<n>`` (process 0 moves, every process returns where)."""
    dest, inside = _aside(out, n), ck.relative_to(out) if ck is not None and ck.is_relative_to(out) else None
    ck_dest = None if ck is None or not ck.is_dir() else dest / inside if inside is not None else _aside(ck, n)
    if jax.process_index() != 0:
        return Moved(dest, ck_dest)
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if (out / name).exists():
            (out / name).rename(dest / name)
    if ck_dest is None:
        return Moved(dest, None)
    if inside == Path("."):                   # checkpoints straight in out_dir: the step folders and partial saves
        for step in ck.iterdir():
            if step.name.split(".")[0].isdigit():      # steps, partial saves, those set aside
                step.rename(dest / step.name)
    else:
        ck_dest.parent.mkdir(parents=True, exist_ok=True)
        ck.rename(ck_dest)
    return Moved(dest, ck_dest)


def refuse_later_steps(who: str, directory: str | Path, later: Sequence[int], keep: int) -> None:
    """Refuse a run that starts at or saves a step in ``directory`` beside good checkpoints of ``later`` steps
    (another run's, or a later point of this one): the two runs would mix, and ``keep`` would prune them.

    Args:
      who: the call the message names (``"train(start_step=0)"``).
      directory: the checkpoint directory.
      later: the steps of its good checkpoints after that step (empty: nothing to refuse).
      keep: how many checkpoints the checkpointer keeps.

    Raises:
      RunDirectoryError: ``later`` is not empty; the message names the directory, the steps and the fixes.
    """
    if later:
        raise RunDirectoryError(
            f"{who}: {directory} holds checkpoints of later steps {list(later)}, another run's (or a later point of "
            f"this one). Saving this run's beside them would mix the two runs, and keep={keep} would prune them. "
            "Save into another directory, continue from the latest (checkpointer.restore(layout), jaxpar train "
            "--resume), or move them aside (jaxpar train --overwrite).")
