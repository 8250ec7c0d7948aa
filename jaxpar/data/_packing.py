"""Packing document pieces into rows of ``seq_len`` tokens, and the rows' arrays.

A *piece* is a run of one document's tokens: ``(source, doc, start, length, doc_length)``. A *pack
window* is a list of pieces whose lengths sum to at most ``rows * seq_len``; :func:`pack_window`
places them into exactly ``rows`` rows and never drops a token:

* ``"best_fit"``: longest piece first, into the row whose free space fits it most tightly;
* ``"first_fit"``: pieces in stream order, into the first row with room;
* ``"none"``: one piece per row (the window then holds ``rows`` pieces, each at most ``seq_len``).

A piece that no row can take whole (the packing methods only) is split over the rows with the most
room, so every token of the window is placed: the window's fill is fixed by how many tokens it was
given, and the packer's quality shows in how few pieces it must split (:class:`PackStats`).

:func:`row_arrays` turns a row's segments into ``tokens``, ``targets``, ``segment_ids`` (1…n, 0 =
padding), ``positions`` (restarting per segment) and ``loss_mask`` (0 where the target would cross a
document's end, and on padding).

>>> import numpy as np
>>> pieces = np.array([[0, 0, 0, 5, 5], [0, 1, 0, 3, 3], [0, 2, 0, 4, 4]])   # three documents
>>> rows, stats = pack_window(pieces, rows=2, seq_len=8, method="best_fit")
>>> rows
[[(0, 0, 5), (1, 0, 3)], [(2, 0, 4)]]
>>> stats.split_pieces, stats.tokens
(0, 12)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from jaxpar.errors import DataError

PACK_METHODS = ("best_fit", "first_fit", "none")

#: The arrays of a packed batch, in the order its sha256 reads them.
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")

#: ``(piece index, offset in the piece, length)``: part of a piece placed in a row.
Segment = tuple[int, int, int]


@dataclass
class PackStats:
    """What packing a window did: ``tokens`` placed, ``capacity`` (rows × seq_len), ``split_pieces``
    (pieces cut because no row could take them whole)."""

    tokens: int = 0
    capacity: int = 0
    split_pieces: int = 0

    @property
    def efficiency(self) -> float:
        """Non-padding tokens over all tokens."""
        return self.tokens / self.capacity if self.capacity else 0.0


def pack_window(pieces: np.ndarray, *, rows: int, seq_len: int, method: str) -> tuple[list[list[Segment]], PackStats]:
    """Place a window's pieces into ``rows`` rows of ``seq_len`` tokens.

    Args:
      pieces: ``int64[n, 5]`` rows ``(source, doc, start, length, doc_length)``, each ``length <= seq_len``.
      rows: how many rows the window fills.
      seq_len: tokens per row.
      method: one of :data:`PACK_METHODS`.

    Returns:
      ``(segments per row, stats)``: each row's ``(piece, offset, length)`` in placement order.

    Raises:
      DataError: the pieces hold more tokens than the rows (or, for ``"none"``, more pieces than rows).
    """
    lengths = pieces[:, 3].astype(np.int64) if len(pieces) else np.zeros(0, np.int64)
    total = int(lengths.sum())
    if method not in PACK_METHODS:
        raise DataError(f"pack method {method!r}: choose one of {', '.join(PACK_METHODS)}.")
    if total > rows * seq_len or (method == "none" and len(pieces) > rows) or (lengths > seq_len).any():
        raise DataError(f"pack_window: {len(pieces)} pieces of {total} tokens do not fit {rows} rows of {seq_len} "
                        f"(method {method!r}).")
    stats = PackStats(tokens=total, capacity=rows * seq_len)
    if method == "none":
        out = [[(i, 0, int(n))] for i, n in enumerate(lengths)]
        return out + [[] for _ in range(rows - len(out))], stats
    order = np.argsort(-lengths, kind="stable") if method == "best_fit" else np.arange(len(pieces))
    choose = _tightest_row if method == "best_fit" else _first_row
    segments: list[list[Segment]] = [[] for _ in range(rows)]
    free = _FreeSpace(rows, seq_len)
    for i in order:
        i, need, offset = int(i), int(lengths[i]), 0
        row = choose(free, need)
        if row is None:
            stats.split_pieces += 1
        while row is None:                   # no row takes it whole: fill the roomiest, go on with the rest
            row, room = free.roomiest()
            segments[row].append((i, offset, room))
            free.take(row, room)
            offset, need = offset + room, need - room
            row = choose(free, need)
        segments[row].append((i, offset, need))
        free.take(row, need)
    return segments, stats


class _FreeSpace:
    """Each row's free tokens, kept sorted as ``(free, row)`` for best-fit lookups."""

    def __init__(self, rows: int, seq_len: int):
        self.free = [seq_len] * rows
        self.sorted = [(seq_len, r) for r in range(rows)]

    def take(self, row: int, n: int) -> None:
        self.sorted.remove((self.free[row], row))
        self.free[row] -= n
        bisect.insort(self.sorted, (self.free[row], row))

    def roomiest(self) -> tuple[int, int]:
        room = self.sorted[-1][0]
        return self.sorted[bisect.bisect_left(self.sorted, (room, -1))][1], room   # the lowest such row


def _tightest_row(free: _FreeSpace, need: int) -> int | None:
    k = bisect.bisect_left(free.sorted, (need, -1))
    return free.sorted[k][1] if k < len(free.sorted) else None


def _first_row(free: _FreeSpace, need: int) -> int | None:
    return next((r for r, f in enumerate(free.free) if f >= need), None)


def row_arrays(segments: Sequence[Segment], pieces: np.ndarray, seq_len: int,
               read: Callable[[int, int, int, int], np.ndarray]) -> dict[str, np.ndarray]:
    """The five arrays of one packed row.

    Args:
      segments: the row's ``(piece, offset, length)``.
      pieces: the window's pieces (see :func:`pack_window`).
      seq_len: the row's length.
      read: ``read(source, doc, start, stop) -> int32 tokens`` of one document.

    Returns:
      ``{"tokens", "targets", "segment_ids", "positions", "loss_mask"}``, each ``int32[seq_len]``.
      A segment's last target is its document's next token, or masked where the document ends.
    """
    out = {k: np.zeros(seq_len, np.int32) for k in BATCH_KEYS}
    at = 0
    for seg_id, (p, offset, n) in enumerate(segments, start=1):
        source, doc, start, _, doc_len = (int(v) for v in pieces[p])
        begin = start + offset
        stop = min(begin + n + 1, doc_len)              # one more token for the last target, if the document has it
        ids = read(source, doc, begin, stop)
        out["tokens"][at:at + n] = ids[:n]
        out["targets"][at:at + len(ids) - 1] = ids[1:]
        out["segment_ids"][at:at + n] = seg_id
        out["positions"][at:at + n] = np.arange(n)
        out["loss_mask"][at:at + len(ids) - 1] = 1
        at += n
    return out
