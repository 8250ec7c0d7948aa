"""Documents as tokens: each store knows every document's token length and reads a document's tokens.

Three stores, one interface (``name``, ``lengths``, ``read(doc, start, stop)``, ``bytes_read``):

* :class:`CachedTokens`: a token cache written by :func:`jaxpar.data._cache.prepare_cache`
  (``tokens.bin`` memory-mapped, ``offsets.npy``); a read touches only the tokens asked for.
* :class:`LiveTokens`: a text source tokenized on the fly. The lengths come from one pass over the
  source when the store opens; a read tokenizes only the documents asked for (the last few are kept).
* :class:`TokenFile`: a pre-tokenized ``.bin`` / ``.npy`` file (nanoGPT style), cut into documents
  after each ``separator`` id (none: the whole file is one document, cut into rows by the plan).

``bytes_read`` counts the payload bytes a store has read for its documents' tokens (for a live
store, the source's text bytes), so a test can check that a process reads only its own rows.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "t.bin")
>>> np.array([5, 6, 0, 7, 8, 9, 0], np.uint16).tofile(path)
>>> store = TokenFile(path, separator=0)
>>> store.lengths.tolist(), store.read(1, 0, 4).tolist()
([3, 4], [7, 8, 9, 0])
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxpar.errors import CacheError, SourceError

TOKEN_DTYPES = ("uint16", "uint32", "int32")


def document_ids(texts: Sequence[str], encode_batch: Callable[[list[str]], list[list[int]]], *,
                 head: Sequence[int] = (), tail: Sequence[int] = ()) -> list[np.ndarray]:
    """Each text's ids between ``head`` and ``tail``.

    Args:
      texts: the texts.
      encode_batch: the tokenizer's batch encoder.
      head, tail: the ids put before / after each text (:meth:`jaxpar.data.Tokenizer.special_ids`).

    Returns:
      One ``int32`` array per text.
    """
    texts = list(texts)
    return [np.asarray([*head, *ids, *tail], np.int32) for ids in (encode_batch(texts) if texts else [])]


def parsed(texts: Sequence[str | None], first: int) -> tuple[list[int], list[str]]:
    """The numbers and texts of the records of a chunk that parsed (a skipped record is ``None``).

    Args:
      texts: a chunk of a source's texts.
      first: the number of its first record.

    Returns:
      ``(record numbers, texts)`` without the skipped records.
    """
    kept = [(first + k, t) for k, t in enumerate(texts) if t is not None]
    return [k for k, _ in kept], [t for _, t in kept]


class _Mapped:
    """Documents end to end in a memory-mapped ``tokens`` array, document ``i`` at ``offsets[i]``."""

    tokens: np.ndarray
    offsets: np.ndarray
    bytes_read: int = 0

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop - 1`` of document ``doc``."""
        base = int(self.offsets[doc])
        out = np.asarray(self.tokens[base + start:base + stop], np.int32)
        self.bytes_read += out.size * self.tokens.dtype.itemsize
        return out


class CachedTokens(_Mapped):
    """A token cache's documents (see :mod:`jaxpar.data._cache`).

    Args:
      directory: the cache of one source (``tokens.bin``, ``offsets.npy``, ``meta.json``).
      dtype: the tokens' dtype (from ``meta.json``).
      skipped: the malformed records the cache left out (from ``meta.json``); they are no documents.
    """

    def __init__(self, directory: str | Path, dtype: str, skipped: int = 0):
        directory = Path(directory)
        self.name, self.skipped = str(directory), skipped
        try:
            self.offsets = np.load(directory / "offsets.npy")
            self.tokens = (np.memmap(directory / "tokens.bin", dtype=dtype, mode="r")
                           if (directory / "tokens.bin").stat().st_size else np.zeros(0, dtype))
        except (OSError, ValueError) as e:
            raise CacheError(f"token cache {str(directory)!r} cannot be read ({e}); build it again with "
                             "`jaxpar data prepare CONFIG`.") from None
        if self.offsets.ndim != 1 or self.offsets[-1] != len(self.tokens):
            raise CacheError(f"token cache {str(directory)!r}: offsets.npy ends at {int(self.offsets[-1])} but "
                             f"tokens.bin holds {len(self.tokens)} tokens; build it again with `jaxpar data prepare`.")
        self.lengths = np.diff(self.offsets)


class LiveTokens:
    """A text source tokenized as it is read; a malformed record it skips is no document.

    Args:
      source: a :class:`jaxpar.data.sources.Source`.
      tokenizer: a :class:`jaxpar.data.Tokenizer`.
      bos, eos: what goes before / after each document: ``True`` the tokenizer's BOS / EOS, ``"auto"``
        what its post-processor adds, ``False`` nothing (:meth:`~jaxpar.data.Tokenizer.special_ids`).
      progress: a callable wrapping the length pass's chunks (e.g. ``tqdm``), or ``None``.
      keep: how many tokenized documents are kept for the next reads.

    ``records[i]`` is the source's record number of document ``i``.
    """

    def __init__(self, source: Any, tokenizer: Any, *, bos: bool | str, eos: bool | str,
                 progress: Callable | None = None, keep: int = 4096):
        self.source, self.tokenizer, self.name = source, tokenizer, source.name
        self.head, self.tail = tokenizer.special_ids(bos, eos)
        chunks, records, lengths, first = source.iter_texts(chunk=1024), [], [], 0
        for texts in (progress(chunks) if progress else chunks):
            numbers, good = parsed(texts, first)
            records += numbers
            lengths += [len(ids) for ids in self._encode(good)]
            first += len(texts)
        self.records = np.asarray(records, np.int64)
        self.lengths = np.asarray(lengths, np.int64)
        self._kept: OrderedDict[int, np.ndarray] = OrderedDict()
        self.keep = keep

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        return document_ids(texts, self.tokenizer.encode_batch, head=self.head, tail=self.tail)

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    @property
    def skipped(self) -> int:
        """Malformed records skipped (``on_malformed="skip"``)."""
        return self.source.skipped

    def prefetch(self, docs: Iterable[int]) -> None:
        """Tokenize ``docs`` not yet kept, in one batch (the reads of a batch's rows call this first).

        Args:
          docs: document ids.
        """
        todo = sorted({int(d) for d in docs} - set(self._kept))
        for doc, ids in zip(todo, self._encode(self.source.texts(self.records[todo])) if todo else []):
            self._kept[doc] = ids
        while len(self._kept) > max(self.keep, len(todo)):
            self._kept.popitem(last=False)

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop - 1`` of document ``doc``.

        Args:
          doc: the document id.
          start, stop: the token range.

        Returns:
          ``int32`` tokens (BOS / EOS included as configured).
        """
        if doc not in self._kept:
            self.prefetch([doc])
        self._kept.move_to_end(doc)
        return self._kept[doc][start:stop]


class TokenFile(_Mapped):
    """A pre-tokenized file's documents.

    Args:
      path: a raw ``.bin`` of ``dtype`` tokens, or a ``.npy`` (its own dtype); memory-mapped.
      dtype: the ``.bin``'s token dtype (:data:`TOKEN_DTYPES`).
      separator: a token id that ends each document (kept as its last token); ``None``: one document.

    ``max_id`` is the file's largest token id (checked against the model's vocabulary).
    """

    def __init__(self, path: str | Path, *, dtype: str = "uint16", separator: int | None = None):
        path = Path(path)
        self.name = str(path)
        self.tokens = map_tokens(path, dtype)
        n = len(self.tokens)
        if n == 0:
            raise SourceError(f"token file {str(path)!r} is empty.")
        ends, self.max_id = _scan(self.tokens, separator)
        if not len(ends) or ends[-1] != n:
            ends = np.append(ends, n)
        self.offsets = np.concatenate([[0], ends]).astype(np.int64)
        self.lengths = np.diff(self.offsets)


def map_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """A pre-tokenized file as a read-only memory map: ``.npy`` (its own dtype) or a raw ``.bin`` of
    ``dtype`` tokens (nanoGPT's ``train.bin`` is ``uint16``). Nothing is read until it is indexed.

    Args:
      path: a ``.npy`` or ``.bin`` file.
      dtype: the token type of a ``.bin`` file, one of :data:`TOKEN_DTYPES`.

    Returns:
      The 1-D tokens (a ``np.memmap``).

    Raises:
      SourceError: no such file, another suffix, a size that is not whole tokens, not 1-D integers.
    """
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"token file {str(path)!r} not found.")
    if path.suffix == ".npy":
        data = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        if dtype not in TOKEN_DTYPES:
            raise SourceError(f"token file {str(path)!r}: token_dtype {dtype!r}; choose one of {TOKEN_DTYPES}.")
        if path.stat().st_size % np.dtype(dtype).itemsize:
            raise SourceError(f"token file {str(path)!r}: {path.stat().st_size} bytes is not a whole number of "
                              f"{dtype} tokens; check token_dtype.")
        data = np.memmap(path, dtype=dtype, mode="r")
    else:
        raise SourceError(f"token file {str(path)!r}: expected a .bin (raw tokens) or .npy file.")
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise SourceError(f"token file {str(path)!r}: expected a 1-D integer array, got {data.dtype}{list(data.shape)}.")
    return data


def _scan(tokens: np.ndarray, separator: int | None, block: int = 1 << 24) -> tuple[np.ndarray, int]:
    """``(offsets just after each separator, the largest id)``, reading ``block`` tokens at a time."""
    ends, top = [np.zeros(0, np.int64)], 0
    for i in range(0, len(tokens), block):
        part = np.asarray(tokens[i:i + block])
        top = max(top, int(part.max()))
        if separator is not None:
            ends.append(np.flatnonzero(part == separator).astype(np.int64) + i + 1)
    return np.concatenate(ends), top
