"""Packed global batches: ``batch_fn(step, rows=...)`` over token stores, with a background prefetch.

:class:`PackedBatches` turns token stores (:mod:`jaxpar.data._tokens`) into the batches of a run.
Global batch ``k`` holds the global rows that follow those of the steps before it (``k × batch_size``,
or what a batch ramp's sizes add up to), planned by :class:`jaxpar.data.StreamPlan` from the
documents' lengths alone; a process materialises only its own rows (``rows=``, as
:func:`jaxpar.data.make_global_batch` asks), so only their tokens are read.

A batch holds ``tokens``, ``targets``, ``segment_ids``, ``positions``, ``loss_mask`` (``int32[B, T]``,
:mod:`jaxpar.data._packing`) and ``loss_weights`` (``float32[B, T]``): the mask scaled by
``B × T / (unmasked targets of the global batch)``, so that the plain mean of ``weights × loss`` over
any split of the batch (data replicas, micro-batches, pipeline stages) is the global batch's mean
over its unmasked targets.

>>> import numpy as np, tempfile, os
>>> from jaxpar.data._tokens import TokenFile
>>> path = os.path.join(tempfile.mkdtemp(), "t.bin")
>>> np.tile(np.array([1, 2, 3, 4, 0], np.uint16), 20).tofile(path)
>>> data = PackedBatches([TokenFile(path, separator=0)], seq_len=8, batch_size=4, seed=0)
>>> batch = data(0)
>>> batch["tokens"][0].tolist()           # a whole document, then the first 3 tokens of another
[1, 2, 3, 4, 0, 1, 2, 3]
>>> batch["segment_ids"][0].tolist(), batch["loss_mask"][0].tolist()    # no target across a document's end
([1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 1, 1, 1])
>>> bool((data(0, rows=np.array([2, 3]))["tokens"] == batch["tokens"][2:]).all())
True
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from jaxpar.errors import DataError
from jaxpar.data._packing import BATCH_KEYS, row_arrays
from jaxpar.data._row_plan import StreamPlan, split_documents
from jaxpar.data._rows import select_rows


def batch_digest(batch: dict[str, np.ndarray]) -> str:
    """sha256 over a batch's ``tokens``, ``targets``, ``segment_ids``, ``positions`` and ``loss_mask``
    (those it has; each as ``int32``, C order): equal digests, equal batches.

    Args:
      batch: a batch's arrays.

    Returns:
      The hex digest.
    """
    h = hashlib.sha256()
    for key in (k for k in BATCH_KEYS if k in batch):
        h.update(np.ascontiguousarray(np.asarray(batch[key]), np.int32).tobytes())
    return h.hexdigest()


class PackedBatches:
    """The packed batches of weighted token stores.

    Args:
      stores: token stores (:mod:`jaxpar.data._tokens`), one per source.
      weights: each source's share of the tokens (default: equal).
      seq_len: tokens per row.
      batch_size: the global batch (the first size of ``ramp``, if any).
      seed: the shuffle's and the held-out split's seed.
      method: ``"best_fit"``, ``"first_fit"`` or ``"none"`` (:mod:`jaxpar.data._packing`).
      rows_per_window: rows packed together.
      fill: the share of each window the documents fill (the packing methods).
      eval_fraction: the share of each source's documents held out for evaluation.
      ramp: a batch ramp (:mod:`jaxpar.run._ramp`: ``size_at(step)``, ``tokens_before(step, 1)``), or ``None``.
      prefetch: how many steps ahead a background thread builds.
    """

    def __init__(self, stores: Sequence[Any], weights: Sequence[float] | None = None, *, seq_len: int,
                 batch_size: int, seed: int = 0, method: str = "best_fit", rows_per_window: int = 64,
                 fill: float = 0.99, eval_fraction: float = 0.0, ramp: Any = None, prefetch: int = 0):
        self.stores, self.seq_len, self.batch_size, self.ramp = list(stores), seq_len, batch_size, ramp
        weights = [1.0] * len(self.stores) if weights is None else list(weights)
        if len(weights) != len(self.stores):
            raise DataError(f"{len(weights)} weights for {len(self.stores)} sources.")
        splits = [split_documents(len(s.lengths), eval_fraction, seed) for s in self.stores]
        self.train_ids = [train for train, _ in splits]
        self.eval_ids = [held for _, held in splits]
        options = dict(seq_len=seq_len, rows_per_window=rows_per_window, fill=fill, method=method, seed=seed)
        self.plan = StreamPlan([s.lengths[ids] for s, ids in zip(self.stores, self.train_ids)], weights, **options)
        self.eval_plan = None
        if eval_fraction > 0:
            for i, (store, ids) in enumerate(zip(self.stores, self.eval_ids)):
                if not int(store.lengths[ids].sum()):
                    raise DataError(f"eval_fraction={eval_fraction} holds out no tokens of source {i} ({store.name}: "
                                    f"{len(store.lengths)} documents); raise eval_fraction, or do not evaluate.")
            self.eval_plan = StreamPlan([s.lengths[ids] for s, ids in zip(self.stores, self.eval_ids)], weights,
                                        shuffle=False, **options)
        self._prefetch = prefetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-data") if prefetch else None
        self._ahead: dict[tuple, Future] = {}
        self._lock, self._ahead_lock = threading.RLock(), threading.Lock()

    def size_at(self, step: int) -> int:
        """The global batch size of ``step``.

        Args:
          step: the step.

        Returns:
          Its number of rows.
        """
        return self.ramp.size_at(step) if self.ramp is not None else self.batch_size

    def first_row(self, step: int) -> int:
        """The global row that begins step ``step``'s batch.

        Args:
          step: the step.

        Returns:
          The row's global index.
        """
        return self.ramp.tokens_before(step, 1) if self.ramp is not None else step * self.batch_size

    def __call__(self, step: int, rows: Any = None) -> dict[str, np.ndarray]:
        """Global batch ``step`` (its ``rows``: ``None`` for all, indices, or the batch's sharding)."""
        size = self.size_at(step)
        pick = select_rows(rows, size)
        pick = tuple(range(size)[pick]) if isinstance(pick, slice) else tuple(int(i) for i in pick)
        key = (step, size, pick)
        with self._ahead_lock:
            future = self._ahead.pop(key, None)
            for old in [k for k in self._ahead if k[0] <= step]:
                self._ahead.pop(old)
        batch = future.result() if future is not None else self.rows(self.first_row(step), size, pick)
        if self._pool is not None:
            self._schedule(step, pick)
        return batch

    def _schedule(self, step: int, pick: tuple[int, ...]) -> None:
        """Build the next steps' batches in the background (same rows of this process, if their sizes agree)."""
        for ahead in range(step + 1, step + 1 + self._prefetch):
            size = self.size_at(ahead)
            if size != self.size_at(step):
                break
            key = (ahead, size, pick)
            with self._ahead_lock:
                if key not in self._ahead:
                    self._ahead[key] = self._pool.submit(self.rows, self.first_row(ahead), size, pick)

    def rows(self, start: int, size: int, pick: Sequence[int], plan: StreamPlan | None = None,
             ids: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows ``pick`` of the ``size`` global rows from ``start`` (the mask weights count all of them).

        Args:
          start: the global index of the batch's first row.
          size: the batch's rows.
          pick: the indices (in ``0 .. size - 1``) of the rows wanted.
          plan: the row plan, or ``None``: the training plan.
          ids: each source's document ids the plan indexes, or ``None``: the training documents.

        Returns:
          The batch's arrays, ``[len(pick), seq_len]`` each.
        """
        plan, ids = plan or self.plan, self.train_ids if ids is None else ids

        def read(source: int, doc: int, a: int, b: int) -> np.ndarray:
            return self.stores[source].read(int(ids[source][doc]), a, b)

        with self._lock:        # the prefetch thread and the caller share the plan's caches and the stores
            planned = plan.rows(start, start + size)
            chosen = [planned[i] for i in pick]
            self._warm(chosen, ids)
            arrays = [row_arrays(segs, pieces, self.seq_len, read) for pieces, segs in chosen]
        counted = sum(_unmasked(pieces, segs) for pieces, segs in planned)
        batch = {k: np.stack([a[k] for a in arrays]) if arrays else np.zeros((0, self.seq_len), np.int32)
                 for k in BATCH_KEYS}
        scale = size * self.seq_len / max(counted, 1)
        batch["loss_weights"] = batch["loss_mask"].astype(np.float32) * np.float32(scale)
        return batch

    def _warm(self, chosen: list, ids: Sequence[np.ndarray]) -> None:
        """Let stores that tokenize on the fly encode the rows' documents in one batch each."""
        wanted: dict[int, set] = {}
        for pieces, segs in chosen:
            for p, _, _ in segs:
                wanted.setdefault(int(pieces[p, 0]), set()).add(int(ids[int(pieces[p, 0])][pieces[p, 1]]))
        for source, docs in wanted.items():
            if hasattr(self.stores[source], "prefetch"):
                self.stores[source].prefetch(docs)

    def eval_batches(self, count: int, batch_size: int | None = None) -> list[dict[str, np.ndarray]]:
        """``count`` fixed batches of the held-out documents (their own order, packed alike).

        Args:
          count: how many batches.
          batch_size: rows per batch, or ``None``: the training batch size.

        Returns:
          The batches, the same on every call.
        """
        if self.eval_plan is None:
            raise DataError("no held-out documents: set eval_fraction > 0 to evaluate.")
        size = batch_size or self.batch_size
        every = tuple(range(size))
        return [self.rows(i * size, size, every, self.eval_plan, self.eval_ids) for i in range(count)]

    @property
    def skipped(self) -> int:
        """Malformed records the sources skipped (``on_malformed="skip"``)."""
        return sum(int(getattr(s, "skipped", 0)) for s in self.stores)

    def epochs(self, steps: int) -> np.ndarray:
        """``float[sources]``: the epochs of each source that the first ``steps`` steps draw (the pack
        windows they touch).

        Args:
          steps: the number of steps from step 0.

        Returns:
          The epochs, one per source.
        """
        rows = self.first_row(steps)
        return self.plan.epochs(-(-rows // self.plan.rows_per_window))

    def efficiency(self, start_step: int, steps: int) -> float:
        """Non-padding tokens over all tokens of the batches ``start_step .. start_step + steps - 1``: the
        windows they hold whole from their packing stats, the rows of the windows at either end one by one.

        Args:
          start_step: the first step.
          steps: how many steps.

        Returns:
          The share, in ``[0, 1]``.
        """
        first, stop, per = self.first_row(start_step), self.first_row(start_step + steps), self.plan.rows_per_window
        whole = range(-(-first // per), stop // per)
        if not whole:
            return self._row_tokens(first, stop) / ((stop - first) * self.seq_len)
        used = (self._row_tokens(first, whole.start * per) + self._row_tokens(whole.stop * per, stop)
                + sum(self.plan.window(g)[2].tokens for g in whole))
        return used / ((stop - first) * self.seq_len)

    def _row_tokens(self, start: int, stop: int) -> int:
        return sum(n for _, segments in self.plan.rows(start, stop) for _, _, n in segments)

    def close(self) -> None:
        """Stop the prefetch thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _unmasked(pieces: np.ndarray, segments: list) -> int:
    """How many targets of a planned row count: a segment's tokens, less one where its document ends."""
    total = 0
    for p, offset, n in segments:
        _, _, start, _, doc_len = pieces[p]
        total += n - int(start + offset + n == doc_len)
    return total
