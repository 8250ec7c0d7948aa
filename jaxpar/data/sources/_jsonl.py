"""JSON-lines sources, plain or gzip: one JSON object per non-blank line, read by byte offset.

Indexing scans a file once in blocks (never whole) and keeps one int64 array: the start offset of
each non-blank line, then the end of the data. A gzip file is indexed in the same sequential pass
through ``zlib.decompressobj(wbits=31)``; every :data:`SNAPSHOT_INTERVAL` bytes of output a
``.copy()`` of the decompressor is kept with its compressed and decompressed offsets, so reading
a line restarts from the nearest snapshot before it instead of from the start of the file (a
sequential read continues where the last one stopped). Files of several gzip members (``cat
a.gz b.gz``) are read member after member.
"""

from __future__ import annotations

import bisect
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxpar.errors import SourceError
from jaxpar.data.sources._base import Source, field_text

#: Decompressed bytes between two snapshots of a gzip decompressor.
SNAPSHOT_INTERVAL = 4 << 20
#: Bytes read at a time: plain files while indexing, compressed bytes of gzip files.
BLOCK = 1 << 20
GZIP_READ = 1 << 14
#: The bytes JSON reads as white space: a line of only these is blank.
SPACE = np.zeros(256, dtype=bool)
SPACE[[9, 10, 13, 32]] = True


def line_starts(blocks: Iterable[bytes]) -> np.ndarray:
    """The start offsets of the non-blank lines of the data cut into ``blocks``, then its length.

    Args:
        blocks: the data, in consecutive pieces of any size.

    Returns:
        An int64 array of ``number of non-blank lines + 1`` offsets.
    """
    starts, marks = [np.zeros(1, np.int64)], []     # marks: non-space bytes up to each line's end
    offset = seen = 0
    for chunk in blocks:
        for first in range(0, len(chunk), BLOCK):   # bounded temporaries, whatever the size of a chunk
            block = np.frombuffer(chunk, np.uint8, count=min(BLOCK, len(chunk) - first), offset=first)
            nonspace = np.cumsum(~SPACE[block], dtype=np.int32)
            newlines = np.flatnonzero(block == 10)
            starts.append(newlines + (offset + 1))
            marks.append(nonspace[newlines] + np.int64(seen))
            offset, seen = offset + len(block), seen + int(nonspace[-1])
    marks.append(np.array([seen], np.int64))        # the last line ends at the end of the data
    has_text = np.diff(np.concatenate(marks), prepend=0) > 0
    return np.append(np.concatenate(starts)[has_text], offset).astype(np.int64)


def inflate(fh: BinaryIO, pos: int, decompressor: Any, path: Path) -> Iterator[tuple[int, Any, bytes]]:
    """Decompresses gzip data from compressed offset ``pos`` with ``decompressor`` (used up).

    Yields:
        ``(compressed offset reached, decompressor there, output)`` per block read; a new
        decompressor starts at each further gzip member.
    """
    fh.seek(pos)
    while block := fh.read(GZIP_READ):
        pos += len(block)
        pieces = []
        try:
            while block:
                if decompressor.eof:
                    decompressor = zlib.decompressobj(wbits=31)
                pieces.append(decompressor.decompress(block))
                block = decompressor.unused_data
        except zlib.error as e:
            raise SourceError(f"{path}: damaged gzip data before compressed byte {pos} ({e}); "
                              "check the file with `gzip -t`") from e
        yield pos, decompressor, b"".join(pieces)


class LineFile:
    """The non-blank lines of one JSON-lines file, plain or gzip (``.gz``), by byte offset.

    Attributes:
        path: the file.
        compressed: whether it is gzip.
        starts: the start offset (in the decompressed data for gzip) of each non-blank line,
            then the end of the data.
        snapshots: gzip only: ``(decompressed offset, compressed offset, decompressor)`` at the
            start and about every :data:`SNAPSHOT_INTERVAL` bytes of output.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.compressed = self.path.name.lower().endswith(".gz")
        self.snapshots: list[tuple[int, int, Any]] = []
        self._cursor: tuple[int, int, Any, bytes] | None = None   # where the last gzip read stopped
        with open(self.path, "rb") as fh:
            self.starts = line_starts(self._indexing_blocks(fh) if self.compressed
                                      else iter(lambda: fh.read(BLOCK), b""))
        self._snapshot_offsets = [snapshot[0] for snapshot in self.snapshots]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def read(self, start: int, stop: int) -> bytes:
        """The bytes ``start..stop-1`` of the (decompressed) data.

        Args:
          start, stop: the byte range.

        Returns:
          The bytes.
        """
        if self.compressed:
            data = self._read_compressed(start, stop)
        else:
            with open(self.path, "rb") as fh:
                fh.seek(start)
                data = fh.read(stop - start)
        if len(data) != stop - start:
            raise SourceError(f"{self.path}: shorter than when it was indexed (changed since); open the source again")
        return data

    def line_number(self, offset: int) -> int:
        """The 1-based line number (blank lines counted) of the line starting at ``offset``.

        Args:
          offset: a line's first byte.

        Returns:
          The line number.
        """
        return 1 + sum(self.read(first, min(first + BLOCK, offset)).count(b"\n") for first in range(0, offset, BLOCK))

    def _indexing_blocks(self, fh: BinaryIO) -> Iterator[bytes]:
        decompressor = zlib.decompressobj(wbits=31)
        self.snapshots = [(0, 0, decompressor.copy())]
        produced = 0
        for pos, decompressor, out in inflate(fh, 0, decompressor, self.path):
            yield out
            produced += len(out)
            if produced - self.snapshots[-1][0] >= SNAPSHOT_INTERVAL:
                self.snapshots.append((produced, pos, decompressor.copy()))
        if not decompressor.eof:
            raise SourceError(f"{self.path}: not a complete gzip file (it ends inside compressed data); "
                              "check it with `gzip -t` or download it again")

    def _read_compressed(self, start: int, stop: int) -> bytes:
        k = bisect.bisect_right(self._snapshot_offsets, start) - 1
        out_pos, pos, decompressor = self.snapshots[k]
        pending = b""
        if self._cursor is not None and out_pos <= self._cursor[0] <= start:
            out_pos, pos, decompressor, pending = self._cursor
        pieces, reached = [pending], out_pos + len(pending)
        with open(self.path, "rb") as fh:
            stream = inflate(fh, pos, decompressor.copy(), self.path)
            while reached < stop and (step := next(stream, None)) is not None:
                pos, decompressor, out = step
                pieces.append(out)
                reached += len(out)
        data = b"".join(pieces)
        self._cursor = (stop, pos, decompressor, data[stop - out_pos:]) if reached >= stop else None
        return data[start - out_pos:stop - out_pos]


class JsonlSource(Source):
    """JSON-lines files (``.jsonl``, ``.json`` with one object per line, and their ``.gz``).

    A record's text is ``record[text_field]``; blank lines are not documents. A line that is not
    a JSON object is malformed (see ``on_malformed``); messages name the file and line number.
    ``bytes_read`` counts the (decompressed) bytes of the lines read.
    """

    format = "jsonl"

    def _open_file(self, path: Path) -> tuple[int, LineFile]:
        lines = LineFile(path)
        return len(lines), lines

    def _read(self, file: int, local: np.ndarray) -> list[str | None]:
        lines: LineFile = self._handles[file]
        texts: list[str | None] = []
        for run in np.split(local, np.flatnonzero(np.diff(local) != 1) + 1):    # consecutive lines: one read
            bounds = lines.starts[run[0]:run[-1] + 2]
            data = lines.read(int(bounds[0]), int(bounds[-1]))
            self.bytes_read += len(data)
            cuts = (bounds - bounds[0]).tolist()
            texts += [self._parse(data[a:b], file, int(i)) for a, b, i in zip(cuts, cuts[1:], run)]
        return texts

    def _parse(self, line: bytes, file: int, index: int) -> str | None:
        def where() -> str:
            lines: LineFile = self._handles[file]
            return f"{self.files[file]}, line {lines.line_number(int(lines.starts[index]))}"

        try:
            record = json.loads(line)
        except ValueError as e:
            return self._malformed(where, f"not valid JSON ({e}); each line must hold one JSON object")
        if not isinstance(record, dict):
            return self._malformed(where, f"a JSON {type(record).__name__}, not an object; each line must "
                                          "hold one JSON object")
        return field_text(record, self.text_field, where)
