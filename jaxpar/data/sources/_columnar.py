"""Parquet, ArrayRecord and Hugging Face ``save_to_disk`` sources: the formats read through the
optional packages pyarrow and grain (``pip install 'jaxpar[data]'``).

* Parquet: the index is the row groups' row counts from the footer; a read decodes only the text
  column of the row groups it needs (the last :data:`ROW_GROUP_CACHE` stay decoded).
* ArrayRecord: random access by record number through ``grain.sources.ArrayRecordDataSource``; a
  record that is a JSON object gives ``text_field``, any other record is the text itself.
* ``save_to_disk`` directories: each Arrow IPC stream file listed in ``state.json`` is opened over
  a memory map (zero-copy: nothing is loaded whole), and its ``text_field`` column is read from it.
"""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jaxpar.errors import SourceError
from jaxpar.data.sources._base import Source, field_text

#: Decoded row groups a Parquet source keeps.
ROW_GROUP_CACHE = 2


def require(module: str, fmt: str) -> Any:
    """``module`` imported, or a :class:`SourceError` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SourceError(f"the {fmt} format needs {module.split('.')[0]} ({e}): pip install 'jaxpar[data]'") from e


def check_arrow_field(schema: Any, text_field: str, path: Path) -> None:
    """Raises :class:`SourceError` unless ``text_field`` (dotted: a field of a struct column) is a string column."""
    pa = require("pyarrow", "arrow")
    parts, node = text_field.split("."), schema
    for depth, part in enumerate(parts):
        names = [field.name for field in node]
        if part not in names:
            where = f"the fields of {'.'.join(parts[:depth])!r}" if depth else "the columns"
            raise SourceError(f"{path}: no column {text_field!r} ({where}: {names}); "
                              "pass text_field= naming the column that holds the text")
        node = node.field(part).type
        if depth < len(parts) - 1 and not pa.types.is_struct(node):
            raise SourceError(f"{path}: {'.'.join(parts[:depth + 1])!r} is {node}, not a struct; "
                              f"no column {text_field!r}")
    if not (pa.types.is_string(node) or pa.types.is_large_string(node) or pa.types.is_string_view(node)):
        raise SourceError(f"{path}: column {text_field!r} holds {node}, not strings; "
                          "pass text_field= naming the column that holds the text")


def arrow_column(table: Any, text_field: str) -> Any:
    """The column ``text_field`` (dotted: a field of a struct column) of an Arrow table."""
    pc = require("pyarrow.compute", "arrow")
    parts = text_field.split(".")
    column = table.column(parts[0])
    for part in parts[1:]:
        column = pc.struct_field(column, part)
    return column


def arrow_texts(values: Any, path: Path, rows: np.ndarray, text_field: str) -> list[str]:
    """The strings of an Arrow array; a null is an error naming its row."""
    texts = values.to_pylist()
    if values.null_count:
        raise SourceError(f"{path}, row {rows[texts.index(None)]}: {text_field!r} is null, not a string")
    return texts


class RowGroups(NamedTuple):
    """A Parquet file's index: the first row of each row group (then the row count), and the
    compressed bytes of the text column's chunks in each."""
    starts: np.ndarray
    text_bytes: np.ndarray


class ParquetSource(Source):
    """Parquet files (``.parquet``); ``bytes_read`` counts the compressed bytes of the text
    column chunks decoded (from the row groups' metadata)."""

    format = "parquet"

    def __init__(self, *args: Any, **kwargs: Any):
        self._parquet = require("pyarrow.parquet", self.format)
        self._decoded: OrderedDict[tuple[int, int], Any] = OrderedDict()
        super().__init__(*args, **kwargs)

    def _open_file(self, path: Path) -> tuple[int, RowGroups]:
        pa = require("pyarrow", self.format)
        try:
            with self._parquet.ParquetFile(path) as reader:
                schema, meta = reader.schema_arrow, reader.metadata
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: not a readable Parquet file ({e})") from e
        check_arrow_field(schema, self.text_field, path)
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        text_bytes = [sum(group.column(c).total_compressed_size for c in range(group.num_columns)
                          if f"{group.column(c).path_in_schema}.".startswith(f"{self.text_field}."))
                      for group in groups]
        starts = np.concatenate(([0], np.cumsum([group.num_rows for group in groups], dtype=np.int64)))
        return int(starts[-1]), RowGroups(starts, np.asarray(text_bytes, np.int64))

    def _read(self, file: int, local: np.ndarray) -> list[str | None]:
        starts = self._handles[file].starts
        group_of = np.searchsorted(starts, local, side="right") - 1
        texts: list[str | None] = []
        for group in np.unique(group_of):
            rows = local[group_of == group]
            column = self._row_group(file, int(group))
            texts += arrow_texts(column.take(rows - starts[group]), self.files[file], rows, self.text_field)
        return texts

    def _row_group(self, file: int, group: int) -> Any:
        """The text column of a row group, decoded (or from the cache)."""
        key = (file, group)
        if key not in self._decoded:
            with self._parquet.ParquetFile(self.files[file]) as reader:
                table = reader.read_row_group(group, columns=[self.text_field])
            self.bytes_read += int(self._handles[file].text_bytes[group])
            self._decoded[key] = arrow_column(table, self.text_field)
            while len(self._decoded) > ROW_GROUP_CACHE:
                self._decoded.popitem(last=False)
        self._decoded.move_to_end(key)
        return self._decoded[key]


class ArrayRecordSource(Source):
    """ArrayRecord files (``.array_record``): a record is UTF-8; a JSON object gives
    ``text_field``, any other record is the text. ``bytes_read`` counts the records' bytes."""

    format = "arrayrecord"

    def _open_file(self, path: Path) -> tuple[int, Any]:
        sources = require("grain.sources", self.format)
        try:
            reader = sources.ArrayRecordDataSource([str(path)])
            return len(reader), reader
        except Exception as e:         # array_record raises bare RuntimeErrors / ValueErrors
            raise SourceError(f"{path}: not a readable ArrayRecord file ({e})") from e

    def _read(self, file: int, local: np.ndarray) -> list[str | None]:
        reader = self._handles[file]
        texts = []
        for index in local.tolist():
            record = reader[index]
            self.bytes_read += len(record)
            texts.append(self._text(record, file, index))
        return texts

    def _text(self, record: bytes, file: int, index: int) -> str | None:
        def where() -> str:
            return f"{self.files[file]}, record {index}"

        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as e:
            return self._malformed(where, f"not UTF-8 text ({e})")
        if text.lstrip().startswith("{"):
            try:
                parsed = json.loads(text)
            except ValueError:
                return text
            if isinstance(parsed, dict):
                return field_text(parsed, self.text_field, where)
        return text


class HfDiskSource(Source):
    """The Arrow files of a ``Dataset.save_to_disk`` directory (see :func:`save_to_disk_files`);
    ``bytes_read`` counts the UTF-8 bytes of the texts read."""

    format = "hf_disk"

    def _open_file(self, path: Path) -> tuple[int, Any]:
        pa, ipc = require("pyarrow", self.format), require("pyarrow.ipc", self.format)
        try:
            table = ipc.open_stream(pa.memory_map(str(path))).read_all()
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: not a readable Arrow stream file ({e}); write the directory "
                              "again with Dataset.save_to_disk") from e
        check_arrow_field(table.schema, self.text_field, path)
        return table.num_rows, arrow_column(table, self.text_field)

    def _read(self, file: int, local: np.ndarray) -> list[str | None]:
        pc = require("pyarrow.compute", self.format)
        values = self._handles[file].take(local)
        self.bytes_read += pc.sum(pc.binary_length(values)).as_py() or 0
        return arrow_texts(values, self.files[file], local, self.text_field)


def save_to_disk_files(directory: Path) -> list[Path]:
    """The Arrow files of a directory written by ``datasets.Dataset.save_to_disk``.

    Args:
        directory: holds ``state.json`` (whose ``_data_files`` lists the files) and ``dataset_info.json``.

    Returns:
        The files' paths, in the dataset's order.
    """
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        example = directory / (splits[0] if splits else "train")
        raise SourceError(f"{directory}: a DatasetDict with splits {splits}; point at one split's "
                          f"directory, DIR/<split>, e.g. {example}")
    state = directory / "state.json"
    if not directory.is_dir() or not state.is_file() or not (directory / "dataset_info.json").is_file():
        raise SourceError(f"{directory}: not a directory written by Dataset.save_to_disk (no state.json and "
                          "dataset_info.json in it); the hf_disk format reads such directories")
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{state}: no list of data files (_data_files) in it ({e!r}); write the "
                          "directory again with Dataset.save_to_disk") from e
    return [directory / name for name in names]
