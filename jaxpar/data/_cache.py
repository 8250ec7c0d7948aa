"""The token cache: a source tokenized once, memory-mapped by every run that reads it.

One directory per source: ``tokens.bin`` (every document's ids, end to end, ``uint16`` when the
vocabulary allows, else ``uint32``), ``offsets.npy`` (``int64[documents + 1]``: where each document
starts) and ``meta.json``, which records what the cache was built from (the source's files, sizes
and modification times, its text field, the tokenizer's fingerprint, BOS / EOS). A run checks the
record against its own config and names what differs, so a cache is never read under another
tokenizer or corpus. The cache is written beside its final name and renamed when complete.

>>> import json, os, tempfile, tokenizers
>>> from jaxpar.data.sources import open_source
>>> from jaxpar.data._tokenizers import load_tokenizer
>>> d = tempfile.mkdtemp(); path = os.path.join(d, "docs.jsonl")
>>> with open(path, "w") as f:
...     _ = f.write("\\n".join(json.dumps({"text": t}) for t in ["hello", "big world"]) + "\\n")
>>> words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "big": 1, "world": 2, "</s>": 3},
...                                                           unk_token="</s>"))
>>> words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
>>> words.save(os.path.join(d, "tokenizer.json"))
>>> tok = load_tokenizer(d, eos_token="</s>")
>>> meta = prepare_cache(open_source(path), tok, os.path.join(d, "cache"), bos=False, eos=True, progress=False)
>>> store = open_cache(os.path.join(d, "cache"), expected_meta(open_source(path), tok, bos=False, eos=True))
>>> meta["documents"], store.lengths.tolist(), store.read(1, 0, 3).tolist()
(2, [2, 3], [1, 2, 3])
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import CacheError
from jaxpar.data._tokens import CachedTokens, document_ids

__all__ = ["prepare_cache", "open_cache", "expected_meta", "CACHE_VERSION"]

CACHE_VERSION = 1


def expected_meta(source: Any, tokenizer: Any, bos: bool, eos: bool) -> dict:
    """What a cache of ``source`` under ``tokenizer`` must record (``meta.json`` less its counts).

    Args:
      source: the text source (its ``fingerprint()``).
      tokenizer: the tokenizer (its ``fingerprint()``).
      bos, eos: whether BOS / EOS are added to each document.

    Returns:
      The dict to compare with ``meta.json``.
    """
    return {"version": CACHE_VERSION, "source": source.fingerprint(), "tokenizer": tokenizer.fingerprint(),
            "bos": bool(bos), "eos": bool(eos)}


def prepare_cache(source: Any, tokenizer: Any, directory: str | Path, *, bos: bool, eos: bool,
                  progress: bool = True, chunk: int = 1024) -> dict:
    """Tokenize ``source`` into a cache at ``directory`` (replacing one there).

    Args:
      source: a :class:`jaxpar.data.sources.Source`.
      tokenizer: a :class:`jaxpar.data.Tokenizer`.
      directory: the cache's directory.
      bos, eos: insert the tokenizer's BOS before / EOS after each document.
      progress: show a progress bar (documents).
      chunk: documents tokenized per batch.

    Returns:
      ``meta.json``'s content: :func:`expected_meta` plus ``documents``, ``tokens``, ``skipped``, ``dtype``.
    """
    directory = Path(directory)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ends, total = [np.zeros(1, np.int64)], 0
    bar = _bar(len(source), f"tokenizing {source.name}", progress)
    bos_id, eos_id = (tokenizer.bos_id if bos else None), (tokenizer.eos_id if eos else None)
    with open(tmp / "tokens.bin", "wb") as out:
        for texts in source.iter_texts(chunk=chunk):
            docs = document_ids(texts, tokenizer.encode_batch, bos_id=bos_id, eos_id=eos_id)
            lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
            if docs:
                np.concatenate(docs).astype(dtype).tofile(out)
            ends.append(total + np.cumsum(lengths))
            total += int(lengths.sum())
            bar.update(len(texts))
    bar.close()
    offsets = np.concatenate(ends)
    np.save(tmp / "offsets.npy", offsets)
    meta = {**expected_meta(source, tokenizer, bos, eos), "documents": len(offsets) - 1, "tokens": total,
            "skipped": int(getattr(source, "skipped", 0)), "dtype": np.dtype(dtype).name}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return meta


def open_cache(directory: str | Path, expected: dict) -> CachedTokens:
    """The cache at ``directory``, checked against ``expected`` (:func:`expected_meta`).

    Args:
      directory: the cache's directory (``meta.json`` and the token files).
      expected: what its ``meta.json`` must record.

    Returns:
      The :class:`CachedTokens` store.

    Raises:
      CacheError: no cache there, or one built from other sources, tokenizer or BOS / EOS (named).
    """
    directory = Path(directory)
    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        raise CacheError(f"token cache {str(directory)!r} does not exist; build it with `jaxpar data prepare CONFIG` "
                         "(or set data.cache: null to tokenize on the fly).")
    meta = json.loads(meta_file.read_text())
    differ = [key for key in expected if meta.get(key) != expected[key]]
    if differ:
        detail = "; ".join(_difference(key, meta.get(key), expected[key]) for key in differ)
        raise CacheError(f"token cache {str(directory)!r} was built from other data: {detail}. Build it again with "
                         "`jaxpar data prepare CONFIG`.")
    return CachedTokens(directory, meta["dtype"], skipped=int(meta.get("skipped", 0)))


def _difference(key: str, found: Any, want: Any) -> str:
    if key == "tokenizer":
        return "another tokenizer (its fingerprint differs)"
    if key == "source" and isinstance(found, dict) and isinstance(want, dict):
        fields = sorted(k for k in set(found) | set(want) if found.get(k) != want.get(k))
        return f"the source differs in {', '.join(fields)} (cache: {[found.get(k) for k in fields]}, now: " \
               f"{[want.get(k) for k in fields]})"
    return f"{key}={found!r} in the cache, {want!r} now"


def _bar(total: int, desc: str, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="doc", disable=not show, leave=False)
