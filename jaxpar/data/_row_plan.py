"""Which document pieces fill global row ``i``: a pure function of the documents' lengths, the seed and ``i``.

The plan never reads a token. Each source's training documents are shuffled anew each epoch
(``seed``, source, epoch), and laid end to end as one endless stream; every document appears once
per epoch of its source. Global rows are cut into *pack windows* of ``rows_per_window`` rows; window
``g`` takes a fixed budget of the streams: ``fill × rows_per_window × seq_len`` tokens (``"none"``:
``rows_per_window`` pieces), shared among the sources by their weights (cumulatively rounded, so each
source's share over any run of windows is exact to one token per window). A document that crosses
a window's budget continues in the next window; one longer than ``seq_len`` is cut at multiples of
``seq_len`` from its start. The window's pieces are then packed (:func:`jaxpar.data._packing.pack_window`).

So row ``i`` lies in window ``i // rows_per_window``, found in O(1) from the step alone, whatever the
mesh, the number of processes or the batch size of each step: every host plans the same rows and reads
only its own, and a resume at any step starts at once.

>>> import numpy as np
>>> plan = StreamPlan([np.array([5, 3, 4, 9, 2])], [1.0], seq_len=8, rows_per_window=2, fill=1.0,
...                   method="best_fit", seed=0)
>>> rows = plan.rows(0, 2)                       # window 0: 16 tokens of the shuffled documents
>>> sum(n for row in rows for _, _, n in row[1])
16
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxpar.errors import DataError
from jaxpar.data._packing import PackStats, Segment, pack_window

#: ``(pieces of the row's window, the row's segments)``: see :mod:`jaxpar.data._packing`.
PlannedRow = tuple[np.ndarray, list[Segment]]


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train ids, held-out ids)`` of ``n_docs`` documents: ``round(eval_fraction × n_docs)`` of them,
    drawn with ``seed``, are held out (the same for every mesh and process count), both sorted.

    Args:
      n_docs: the number of documents.
      eval_fraction: the share held out, in ``[0, 1)``.
      seed: the draw's seed.

    Returns:
      The two sorted ``int64`` id arrays.

    >>> [a.tolist() for a in split_documents(10, 0.2, seed=0)]
    [[1, 2, 3, 4, 5, 6, 7, 8], [0, 9]]
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction!r}: must be in [0, 1).")
    held = np.random.default_rng((seed, 0x5E1)).permutation(n_docs)[:int(round(eval_fraction * n_docs))]
    mask = np.zeros(n_docs, bool)
    mask[held] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


@dataclass
class _Epoch:
    order: np.ndarray      # positions into the source's documents, in this epoch's order
    cum: np.ndarray        # int64[n + 1]: cost before each document of `order`


class StreamPlan:
    """The rows of an endless, shuffled, packed stream of documents from weighted sources.

    Args:
      lengths: per source, the token length of each document the stream draws from (``int[n]``).
      weights: per source, its share of the tokens (``"none"``: of the pieces); positive.
      seq_len: tokens per row.
      rows_per_window: rows packed together (the best-fit window).
      fill: the share of a window's tokens the stream fills (``≤ 1``); the rest is room that lets
        whole documents fit. Ignored by ``"none"``.
      method: one of :data:`jaxpar.data.PACK_METHODS`.
      seed: the shuffle's seed.
      shuffle: shuffle each epoch (``False``: the documents' own order, every epoch; held-out data).
    """

    def __init__(self, lengths: Sequence[np.ndarray], weights: Sequence[float], *, seq_len: int, rows_per_window: int,
                 fill: float, method: str, seed: int, shuffle: bool = True):
        if not 0.0 < fill <= 1.0:
            raise DataError(f"pack fill {fill!r}: must be in (0, 1].")
        self.lengths = [np.asarray(x, np.int64) for x in lengths]
        self.seq_len, self.rows_per_window, self.method, self.seed, self.shuffle = (
            seq_len, rows_per_window, method, seed, shuffle)
        self.costs = [-(-x // seq_len) if method == "none" else x for x in self.lengths]   # pieces, or tokens
        self.budget = rows_per_window if method == "none" else int(math.floor(fill * rows_per_window * seq_len))
        if self.budget < 1:
            raise DataError(f"pack fill {fill} × {rows_per_window} rows × seq_len {seq_len} leaves no token per window.")
        for i, (c, w) in enumerate(zip(self.costs, weights)):
            if int(c.sum()) == 0:
                raise DataError(f"source {i}: no tokens to draw from (every document is empty).")
            if not w > 0:
                raise DataError(f"source {i}: weight {w!r} must be positive.")
        total = float(sum(weights))
        self.cum_weights = np.cumsum([w / total for w in weights])
        self.cum_weights[-1] = 1.0
        self._epochs: OrderedDict = OrderedDict()
        self._windows: OrderedDict = OrderedDict()

    def source_budget(self, window: int) -> np.ndarray:
        """``int64[sources]``: how much of each source's stream precedes ``window`` (tokens, or pieces).

        Args:
          window: a window index.

        Returns:
          The budget per source.
        """
        upto = np.floor(window * self.budget * self.cum_weights).astype(np.int64)
        upto[-1] = window * self.budget
        return np.diff(upto, prepend=0)

    def epochs(self, windows: int) -> np.ndarray:
        """``float[sources]``: how many epochs of each source the first ``windows`` windows draw.

        Args:
          windows: the number of windows from window 0.

        Returns:
          The epochs, one per source.
        """
        return self.source_budget(windows) / np.array([int(c.sum()) for c in self.costs], np.float64)

    def _epoch(self, source: int, epoch: int) -> _Epoch:
        key = (source, epoch)
        if key not in self._epochs:
            n = len(self.costs[source])
            order = (np.random.default_rng((self.seed, source, epoch)).permutation(n) if self.shuffle
                     else np.arange(n))
            self._epochs[key] = _Epoch(order, np.concatenate([[0], np.cumsum(self.costs[source][order])]))
            while len(self._epochs) > 2 * len(self.costs):
                self._epochs.popitem(last=False)
        return self._epochs[key]

    def window_pieces(self, window: int) -> np.ndarray:
        """``int64[n, 5]`` pieces ``(source, doc, start, length, doc_length)`` of ``window``, in stream order.

        Args:
          window: a window index.

        Returns:
          The pieces.
        """
        lo, hi = self.source_budget(window), self.source_budget(window + 1)
        parts = [self._pieces(s, int(a), int(b)) for s, (a, b) in enumerate(zip(lo, hi)) if b > a]
        return np.concatenate(parts) if parts else np.zeros((0, 5), np.int64)

    def _pieces(self, source: int, start: int, stop: int) -> np.ndarray:
        """The pieces of ``source``'s stream between cost positions ``start`` and ``stop``."""
        per_epoch = int(self.costs[source].sum())
        out = []
        while start < stop:
            epoch, at = divmod(start, per_epoch)
            end = min(stop - start, per_epoch - at) + at
            out.append(self._epoch_pieces(source, self._epoch(source, epoch), at, end))
            start += end - at
        return np.concatenate(out)

    def _epoch_pieces(self, source: int, ep: _Epoch, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(ep.cum, start, side="right")) - 1
        last = int(np.searchsorted(ep.cum, stop, side="left"))
        out = []
        t = self.seq_len
        for k in range(first, last):
            doc = int(ep.order[k])
            n = int(self.lengths[source][doc])
            lo, hi = max(start, ep.cum[k]) - ep.cum[k], min(stop, ep.cum[k + 1]) - ep.cum[k]
            if self.method == "none":                   # cost in pieces of seq_len
                lo, hi = lo * t, min(hi * t, n)
            a = int(lo)
            while a < hi:                               # cut at multiples of seq_len from the document's start
                b = min(int(hi), (a // t + 1) * t)
                out.append((source, doc, a, b - a, n))
                a = b
        return np.asarray(out, np.int64).reshape(-1, 5)

    def window(self, window: int) -> tuple[np.ndarray, list[list[Segment]], PackStats]:
        """``(pieces, segments per row, stats)`` of a pack window (the last few are kept).

        Args:
          window: a window index.

        Returns:
          The pieces (:meth:`window_pieces`), each row's segments, and the packing's :class:`PackStats`.
        """
        if window not in self._windows:
            pieces = self.window_pieces(window)
            rows, stats = pack_window(pieces, rows=self.rows_per_window, seq_len=self.seq_len, method=self.method)
            self._windows[window] = (pieces, rows, stats)
            while len(self._windows) > 64:
                self._windows.popitem(last=False)
        return self._windows[window]

    def rows(self, start: int, stop: int) -> list[PlannedRow]:
        """The global rows ``start .. stop - 1``: each ``(its window's pieces, its segments)``.

        Args:
          start, stop: the global row range.

        Returns:
          One :data:`PlannedRow` per row.
        """
        out = []
        for i in range(start, stop):
            g, r = divmod(i, self.rows_per_window)
            pieces, rows, _ = self.window(g)
            out.append((pieces, rows[r]))
        return out
