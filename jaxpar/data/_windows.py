"""Host-side batches for language models: deterministic, resumable from the step number alone.

Every source returns numpy ``{"tokens": int32[B, T], "targets": int32[B, T]}`` (``targets`` shifted by
one), built from windows of ``seq_len + 1`` tokens at offsets that depend only on ``(seed, step)``,
the last ``eval_fraction`` held out: byte-level text (by default a capped subset of the Python
standard library's sources), tokenized text (:func:`tokenize_documents`), token files (nanoGPT's
``.bin`` or ``.npy``, :func:`jaxpar.data._tokens.map_tokens`) and synthetic arithmetic progressions.

The batch functions take ``rows=`` (``None``: the whole global batch; global row indices; or the
batch's ``Sharding``, :func:`process_rows`): row ``i`` of step ``s`` is the same however it is asked
for, so processes build only their own rows (:func:`make_global_batch`).

Example::

    >>> corpus = load_bytes()                                  # stdlib sources, <= 4 MB
    >>> train, held_out = split_holdout(corpus, 0.05)
    >>> batch = text_batch(train, step=0, batch_size=8, seq_len=64, seed=0)
    >>> batch["tokens"].shape, batch["tokens"].dtype
    ((8, 64), dtype('int32'))
    >>> bool((batch["tokens"][:, 1:] == batch["targets"][:, :-1]).all())
    True
    >>> part = text_batch(train, step=0, batch_size=8, seq_len=64, seed=0, rows=np.arange(4, 8))
    >>> bool((part["tokens"] == batch["tokens"][4:]).all())
    True
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from jaxpar.errors import DataError, SourceError, check_int
from jaxpar.data._rows import make_global_batch, process_rows, select_rows

#: Default cap on the text corpus size (bytes): a few MB keeps start-up fast.
DEFAULT_MAX_BYTES = 4_000_000

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_TRAIN, _EVAL = 0, 1  # stream ids mixed into the RNG seed


def stdlib_sources(max_bytes: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files (no tests, no site-packages), sorted by relative path.

    With ``max_bytes``, every k-th file of that list (k chosen so the total is
    about ``max_bytes``): a small, deterministic subset drawn from the whole
    library rather than its alphabetical head.

    Args:
      max_bytes: about how many bytes in all, or ``None`` (every file).

    Returns:
      The files' paths.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1])]
    files.sort(key=lambda f: f.relative_to(root).as_posix())
    if max_bytes:
        sizes = [f.stat().st_size for f in files]
        k = max(1, sum(sizes) // max_bytes)
        while k > 1 and sum(sizes[::k]) < max_bytes:
            k -= 1
        files = files[::k]
    return files


def expand_paths(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by ``patterns`` (paths or globs, ``**`` allowed), each pattern sorted, in order.

    A directory stands for every file below it. Raises :class:`~jaxpar.errors.SourceError` naming a
    pattern that matches no file.

    Args:
      patterns: file or directory paths and glob patterns.

    Returns:
      The files, in pattern order (duplicates kept).
    """
    out: list[Path] = []
    for pattern in patterns:
        text = os.fspath(pattern)
        matches = sorted(glob.glob(os.path.expanduser(text), recursive=True))
        files: list[Path] = []
        for m in map(Path, matches):
            if m.is_dir():
                files.extend(sorted(f for f in m.rglob("*") if f.is_file()))
            elif m.is_file():
                files.append(m)
        if not files:
            raise SourceError(f"data path {text!r} matches no file (relative paths are relative to the "
                             f"working directory {os.getcwd()!r}).")
        out.extend(files)
    return out


def read_documents(paths: Sequence[str | os.PathLike] | None = None, *,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes]:
    """The files of :func:`load_bytes`, one ``bytes`` each (a newline appended), ``max_bytes`` in all.

    ``paths=None`` (or empty) reads :func:`stdlib_sources` (``max_bytes``). Files are taken in
    order until the cap; the last one is cut, so the result is deterministic.

    Args:
      paths: files, directories or globs (:func:`expand_paths`), or ``None``.
      max_bytes: the cap on the bytes read.

    Returns:
      One ``bytes`` per file read.
    """
    check_int("read_documents", "max_bytes", max_bytes, 1, DataError)
    files = stdlib_sources(max_bytes) if not paths else expand_paths(paths)
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes() + b"\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return chunks


def load_bytes(paths: Sequence[str | os.PathLike] | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Concatenate files as a ``uint8`` array (files joined by a newline), capped at ``max_bytes``
    (:func:`read_documents`, joined).

    Args:
      paths: files, directories or globs (:func:`expand_paths`), or ``None``: the standard library's sources.
      max_bytes: the cap on the bytes read.

    Returns:
      ``uint8[n]``, ``n <= max_bytes``.
    """
    return np.frombuffer(b"".join(read_documents(paths, max_bytes=max_bytes)), dtype=np.uint8)


def tokenize_documents(documents: Sequence[bytes | str], encode: Callable[[str], Sequence[int]], *,
                       bos_id: int | None = None, eos_id: int | None = None) -> np.ndarray:
    """One ``int32`` token stream of ``documents``: each encoded (bytes decoded as UTF-8, invalid bytes
    replaced), with ``bos_id`` before it and ``eos_id`` after it when given. Batches then take windows
    of it as of :func:`~jaxpar.data._tokens.map_tokens`'s.

    Args:
      documents: the documents' text (``bytes`` or ``str``).
      encode: text -> token ids.
      bos_id, eos_id: the ids added before / after each document, or ``None`` (none).

    Returns:
      ``int32[n]``.

    >>> tokenize_documents([b"ab", "c"], lambda text: [ord(ch) for ch in text], bos_id=1, eos_id=2).tolist()
    [1, 97, 98, 2, 1, 99, 2]
    """
    ids: list[int] = []
    for doc in documents:
        text = doc.decode("utf-8", "replace") if isinstance(doc, (bytes, bytearray)) else doc
        ids += ([bos_id] if bos_id is not None else []) + list(encode(text)) + ([eos_id] if eos_id is not None else [])
    return np.asarray(ids, dtype=np.int32)


def check_token_ids(batch: dict[str, np.ndarray], vocab: int, where: str) -> dict[str, np.ndarray]:
    """``batch`` unchanged, or a clear error if a token id is outside ``[0, vocab)``.

    Args:
      batch: a batch with ``tokens`` and ``targets``.
      vocab: the model's vocabulary size.
      where: what the batch is, for the error message (e.g. ``"data.train, batch 3,"``).

    Returns:
      ``batch``.
    """
    lo = min(int(batch[k].min(initial=0)) for k in ("tokens", "targets"))
    hi = max(int(batch[k].max(initial=0)) for k in ("tokens", "targets"))
    if lo < 0 or hi >= vocab:
        raise DataError(f"{where} holds token id {hi if hi >= vocab else lo}, outside the model's vocabulary "
                         f"[0, {vocab}); set model.vocab above the tokenizer's largest id.")
    return batch


def token_batch_fn(data: np.ndarray, vocab: int, where: str, **kw: Any) -> Callable:
    """``text_batch`` over token ids with :func:`check_token_ids` on every batch.

    Args:
      data: the token stream.
      vocab: the model's vocabulary size.
      where: the data's name in the error message.
      **kw: :func:`text_batch`'s keywords (``batch_size``, ``seq_len``, ``seed``).

    Returns:
      ``batch(step, rows=None, **override)``: ``kw`` updated by ``override``.
    """
    def batch(step: int, rows: Any = None, **override: Any) -> dict[str, np.ndarray]:
        return check_token_ids(text_batch(data, step, rows=rows, **{**kw, **override}), vocab, f"{where}, batch {step},")
    return batch


def split_holdout(data: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)``: the last ``eval_fraction`` of ``data`` is held out (no overlap).

    Args:
      data: a byte or token stream.
      eval_fraction: the share held out, in ``[0, 1)``.

    Returns:
      The two views of ``data``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"split_holdout(eval_fraction={eval_fraction!r}): must be in [0, 1).")
    cut = len(data) - int(round(len(data) * eval_fraction))
    return data[:cut], data[cut:]


def _windows(data: np.ndarray, offsets: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    rows = data[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:]}


def _check_len(data: np.ndarray, seq_len: int, what: str) -> None:
    if len(data) < seq_len + 1:
        raise DataError(f"{what}: {len(data)} tokens cannot hold one window of seq_len + 1 = {seq_len + 1}; "
                         "use more data, a shorter seq_len or (for eval) a larger eval fraction.")


def text_batch(data: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int = 0,
               rows: Any = None) -> dict[str, np.ndarray]:
    """Training batch ``step``: ``batch_size`` windows at offsets drawn from ``(seed, step)`` only.

    ``rows`` selects global rows (see the module docstring); only those windows are read.

    Args:
      data: a byte or token stream of at least ``seq_len + 1`` items.
      step: the step.
      batch_size: the global batch's rows.
      seq_len: tokens per row.
      seed: the offsets' seed.
      rows: ``None``, row indices, or the batch's sharding.

    Returns:
      ``{"tokens", "targets"}``: ``int32[rows, seq_len]`` each.
    """
    _check_len(data, seq_len, "text_batch")
    rng = np.random.default_rng((seed, _TRAIN, step))
    offsets = rng.integers(0, len(data) - seq_len, size=batch_size)   # all rows: cheap, fixes the order
    return _windows(data, offsets[select_rows(rows, batch_size)], seq_len)


def eval_windows(data: np.ndarray, *, num_batches: int, batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
    """``num_batches`` fixed batches of windows spread evenly over ``data`` (the held-out split).

    Args:
      data: the held-out byte or token stream.
      num_batches: how many batches.
      batch_size: rows per batch.
      seq_len: tokens per row.

    Returns:
      The batches, ``{"tokens", "targets"}`` of ``int32[batch_size, seq_len]`` each.
    """
    _check_len(data, seq_len, "eval_windows")
    n = num_batches * batch_size
    offsets = np.linspace(0, len(data) - seq_len - 1, n).astype(np.int64)
    return [_windows(data, offsets[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(num_batches)]


def synthetic_batch(step: int, *, batch_size: int, seq_len: int, vocab: int, seed: int = 0,
                    eval: bool = False, rows: Any = None) -> dict[str, np.ndarray]:
    """Rows ``start + stride * t (mod vocab)``, ``stride`` in ``1..8``; drawn from ``(seed, step)``.

    ``eval=True`` draws from a separate stream (same distribution, other rows).
    ``rows`` selects global rows (see the module docstring).

    Args:
      step: the step.
      batch_size: the global batch's rows.
      seq_len: tokens per row.
      vocab: the vocabulary size.
      seed: the draw's seed.
      eval: draw from the evaluation stream.
      rows: ``None``, row indices, or the batch's sharding.

    Returns:
      ``{"tokens", "targets"}``: ``int32[rows, seq_len]`` each.
    """
    rng = np.random.default_rng((seed, _EVAL if eval else _TRAIN, step))
    start = rng.integers(0, vocab, size=(batch_size, 1))
    stride = rng.integers(1, 9, size=(batch_size, 1))
    pick = select_rows(rows, batch_size)
    out = ((start[pick] + stride[pick] * np.arange(seq_len + 1)) % vocab).astype(np.int32)
    return {"tokens": out[:, :-1], "targets": out[:, 1:]}
