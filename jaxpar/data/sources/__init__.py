"""Random-access document sources: a dataset file, or several, as a numbered list of texts.

:func:`open_source` opens JSON lines (plain or gzip), Parquet, ArrayRecord or a Hugging Face
``save_to_disk`` directory as a :class:`Source`. Nothing is loaded whole: a source holds an index
(line offsets, row group sizes, memory-mapped Arrow files) and reads the texts asked for, by
number (:meth:`Source.texts`) or in order (:meth:`Source.iter_texts`). Several files of one
format are one source, their documents numbered file after file. The formats live in
:mod:`~jaxpar.data.sources._jsonl` and :mod:`~jaxpar.data.sources._columnar` (Parquet, ArrayRecord, Arrow), the shared base in
:mod:`~jaxpar.data.sources._base`.

>>> import pathlib, tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> path = pathlib.Path(tmp.name) / "docs.jsonl"
>>> _ = path.write_text('{"text": "hello"}\\n\\n{"text": "wörld", "id": 2}\\n', encoding="utf-8")
>>> source = open_source(path)
>>> len(source), source.format
(2, 'jsonl')
>>> source.texts([1, 0, 1])
['wörld', 'hello', 'wörld']
>>> list(source.iter_texts(chunk=1))
[['hello'], ['wörld']]
>>> tmp.cleanup()
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from jaxpar.errors import SourceError
from jaxpar.data.sources._base import Source
from jaxpar.data.sources._columnar import ArrayRecordSource, HfDiskSource, ParquetSource, save_to_disk_files
from jaxpar.data.sources._jsonl import JsonlSource

__all__ = ["FORMATS", "Source", "open_source"]

#: The formats :func:`open_source` reads.
FORMATS = ("jsonl", "parquet", "arrayrecord", "hf_disk")
#: File name endings and the format each one means (``hf_disk`` is a directory).
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl",
            ".parquet": "parquet", ".array_record": "arrayrecord", ".arrayrecord": "arrayrecord"}
SOURCE_CLASSES: dict[str, type[Source]] = {"jsonl": JsonlSource, "parquet": ParquetSource,
                                           "arrayrecord": ArrayRecordSource, "hf_disk": HfDiskSource}

PathLike = str | os.PathLike


def open_source(path: PathLike | Sequence[PathLike], *, format: str | None = None, text_field: str = "text",
                on_malformed: str = "error") -> Source:
    """Opens a dataset file, a glob of files or a list of them as one :class:`Source`.

    Args:
        path: a file, a ``save_to_disk`` directory, a glob (matches sorted; ``**`` recurses) or a
            list of these; the documents are numbered file after file, in that order.
        format: one of :data:`FORMATS`; ``None`` infers it from the names (see :func:`infer_format`).
        text_field: the field (JSON key or column) holding the text; a dotted path such as
            ``"meta.body"`` reaches into a nested object or struct column.
        on_malformed: ``"error"`` raises on a record that cannot be parsed (naming the file and
            line); ``"skip"`` reads it as ``None``, so document numbers never shift, and counts
            it in the source's ``skipped`` count.

    Returns:
        The source (indexed; no text read yet).
    """
    files = resolve_paths(path)
    format = infer_format(files) if format is None else format
    if format not in FORMATS:
        raise SourceError(f"format={format!r}: unknown; the formats are {FORMATS}")
    more = len(files) - 1
    name = str(files[0]) + (f" (+{more} file{'s' if more > 1 else ''})" if more else "")
    if format == "hf_disk":
        files = [file for directory in files for file in save_to_disk_files(directory)]
    elif directories := [p for p in files if p.is_dir()]:
        raise SourceError(f"{directories[0]}: a directory; the {format} format reads files, e.g. "
                          f"{os.path.join(directories[0], '*')} (only save_to_disk directories are read whole)")
    return SOURCE_CLASSES[format](files, text_field=text_field, on_malformed=on_malformed, name=name)


def resolve_paths(path: PathLike | Sequence[PathLike]) -> list[Path]:
    """The files (or directories) that a path, a glob or a list of them names.

    Args:
        path: as for :func:`open_source`; ``~`` is expanded.

    Returns:
        The paths, each glob's matches sorted, in the order of the patterns.
    """
    patterns = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not patterns:
        raise SourceError("no path given (an empty list); pass a file, a glob such as 'data/*.jsonl', or a list")
    found = []
    for pattern in (os.path.expanduser(os.fspath(p)) for p in patterns):
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise SourceError(f"{pattern}: the pattern matches no file")
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise SourceError(f"{pattern}: no such file or directory")
        found += [Path(m) for m in matches]
    return found


def infer_format(files: Sequence[Path]) -> str:
    """The format of some files, from their names.

    ``.jsonl``, ``.json`` and their ``.gz`` are ``jsonl``; ``.parquet`` is ``parquet``;
    ``.array_record`` and ``.arrayrecord`` are ``arrayrecord``; a directory is ``hf_disk``.

    Args:
        files: the paths, all of one format.

    Returns:
        One of :data:`FORMATS`.
    """
    formats = {}
    for path in files:
        formats.setdefault(format_of(path), path)
    if len(formats) > 1:
        found = ", ".join(f"{fmt} ({path})" for fmt, path in formats.items())
        raise SourceError(f"files of several formats: {found}; a source reads one format: open one source per format")
    return next(iter(formats))


def format_of(path: Path) -> str:
    """The format of one file or directory, from its name."""
    if path.is_dir():
        return "hf_disk"
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIXES[suffix]
    raise SourceError(f"{path}: cannot tell the format from the name (known endings: {', '.join(SUFFIXES)}); "
                      f"pass format= one of {FORMATS}")

