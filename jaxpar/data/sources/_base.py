"""The base of the document sources of :mod:`jaxpar.data.sources`: numbering documents across
files, random and sequential reads, the fingerprint, and the checks shared by the formats.

A format subclasses :class:`Source` with two methods: ``_open_file(path)`` indexes one file and
returns ``(number of documents, per-file handle)``, and ``_read(file, local)`` returns the texts
of the sorted, distinct document numbers ``local`` of that file. Everything else is here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import SourceError

#: What a source does with a record it cannot parse: raise, or read it as ``None`` (and count it).
ON_MALFORMED = ("error", "skip")


class Source:
    """A dataset file, or several of one format, as a list of text documents read on demand.

    Documents are numbered file after file, from 0. Only a per-file index (line offsets, row
    group sizes) is held in memory; texts are read from the files when asked for.

    Attributes:
        name: the source in messages, e.g. ``"data/train.jsonl (+3 files)"``.
        format: one of :data:`jaxpar.data.sources.FORMATS`.
        files: the resolved paths of the files, in document order.
        text_field: the field holding the text (a dotted path such as ``"meta.body"`` reaches
            into nested objects or struct columns).
        on_malformed: ``"error"`` raises :class:`SourceError` on a record that cannot be parsed;
            ``"skip"`` returns ``None`` for it (document numbers never shift) and counts it in
            ``skipped``. A record that parses but lacks ``text_field`` is always an error.
        skipped: malformed records returned as ``None`` so far (each time one is read).
        bytes_read: payload bytes read from the files by :meth:`texts` and :meth:`iter_texts`.
    """

    format = ""

    def __init__(self, files: Sequence[str | os.PathLike], *, text_field: str = "text",
                 on_malformed: str = "error", name: str | None = None):
        if on_malformed not in ON_MALFORMED:
            raise SourceError(f"on_malformed={on_malformed!r}: must be one of {ON_MALFORMED}")
        if not isinstance(text_field, str) or not text_field:
            raise SourceError(f"text_field={text_field!r}: must name a field, e.g. 'text' or 'meta.body'")
        self.files = [Path(f).resolve() for f in files]
        self.name = name or str(files[0])
        self.text_field = text_field
        self.on_malformed = on_malformed
        self.skipped = 0
        self.bytes_read = 0
        self._handles: list[Any] = []
        counts = []
        for path in self.files:
            count, handle = self._open_file(path)
            counts.append(count)
            self._handles.append(handle)
        self._starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        if self._starts[-1] == 0:
            raise SourceError(f"{self.name}: no documents in {len(self.files)} file(s) ({self.files[0]}...); "
                              "point at files that hold records")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {len(self)} documents>"

    def texts(self, indices: Iterable[int]) -> list[str | None]:
        """The texts of some documents, in the order asked (random access).

        Args:
            indices: document numbers in ``[0, len(self))``, in any order, repeats allowed.

        Returns:
            One text per index; ``None`` for a malformed record when ``on_malformed="skip"``.
        """
        wanted = self._checked_indices(indices)
        unique, inverse = np.unique(wanted, return_inverse=True)
        file_of = np.searchsorted(self._starts, unique, side="right") - 1
        found: list[str | None] = []
        for f in np.unique(file_of):       # ascending, as ``unique`` is sorted
            found += self._read(int(f), unique[file_of == f] - self._starts[f])
        return [found[k] for k in inverse.reshape(-1)]

    def iter_texts(self, start: int = 0, stop: int | None = None, chunk: int = 1024) -> Iterator[list[str | None]]:
        """The documents ``start..stop-1`` in order, as lists of ``chunk`` texts (the last one shorter).

        Args:
            start: the first document.
            stop: one past the last document; ``None`` for the end of the source.
            chunk: the documents per list.

        Returns:
            An iterator of lists of texts (``None`` for a skipped malformed record).
        """
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"{self.name}: start={start}, stop={stop} outside 0..{len(self)}")
        if chunk < 1:
            raise SourceError(f"chunk={chunk}: must be at least 1")
        return (self.texts(range(first, min(first + chunk, stop))) for first in range(start, stop, chunk))

    def fingerprint(self) -> dict:
        """The identity of the source, to tell whether a cache built from it is still valid.

        Returns:
            A JSON-able dict: the format, ``text_field`` and each file's resolved path, size and
            modification time in nanoseconds.
        """
        files = []
        for path in self.files:
            stat = os.stat(path)
            files.append({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return {"format": self.format, "text_field": self.text_field, "files": files}

    def _checked_indices(self, indices: Iterable[int]) -> np.ndarray:
        wanted = np.asarray(indices if isinstance(indices, (Sequence, np.ndarray)) else list(indices))
        if wanted.size == 0:
            return np.zeros(0, np.int64)
        if wanted.ndim != 1 or wanted.dtype.kind not in "iu":
            raise SourceError(f"{self.name}: indices must be a 1-D sequence of ints, got {wanted.dtype} "
                            f"of shape {wanted.shape}")
        outside = wanted[(wanted < 0) | (wanted >= len(self))]
        if outside.size:
            raise IndexError(f"{self.name}: document {outside[0]} out of range (the source has "
                             f"{len(self)} documents)")
        return wanted.astype(np.int64)

    def _malformed(self, where: Callable[[], str], problem: str) -> None:
        """Raises :class:`SourceError`, or with ``on_malformed="skip"`` counts the record and returns ``None``."""
        if self.on_malformed == "skip":
            self.skipped += 1
            return None
        raise SourceError(f"{where()}: {problem} (on_malformed='skip', in a config data.on_malformed: skip, "
                          "skips such records and counts them)")

    def _open_file(self, path: Path) -> tuple[int, Any]:
        raise NotImplementedError

    def _read(self, file: int, local: np.ndarray) -> list[str | None]:
        raise NotImplementedError


def field_text(record: dict, text_field: str, where: Callable[[], str]) -> str:
    """The string at ``text_field`` (a dotted path) of a parsed record.

    Args:
        record: a JSON object.
        text_field: e.g. ``"text"`` or ``"meta.body"``.
        where: builds the record's place for a message, e.g. ``"data.jsonl, line 7"``.

    Returns:
        The text.
    """
    value: Any = record
    parts = text_field.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            inside = f" of {'.'.join(parts[:depth])!r}" if depth else ""
            keys = sorted(value) if isinstance(value, dict) else f"none, it is a {type(value).__name__}"
            raise SourceError(f"{where()}: no field {text_field!r} (the keys{inside}: {keys}); "
                              "pass text_field= naming the field that holds the text")
        value = value[part]
    if not isinstance(value, str):
        raise SourceError(f"{where()}: field {text_field!r} is a {type(value).__name__}, not a string; "
                          "pass text_field= naming a field that holds the text")
    return value
