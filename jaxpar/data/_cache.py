"""The token cache: a source tokenized once, memory-mapped by every run that reads it.

One directory per source: ``tokens.bin`` (every document's ids, end to end, ``uint16`` when the
vocabulary allows, else ``uint32``), ``offsets.npy`` (``int64[documents + 1]``: where each document
starts) and ``meta.json``, which records what the cache was built from (the source's files, sizes
and modification times, its text field, the tokenizer's fingerprint, the ids put before / after each
document) and how (the malformed records skipped, ``on_malformed``). A run checks the record against its
own config and names what differs, so a cache is never read under another tokenizer or corpus, nor
with skipped records under ``on_malformed="error"``. A skipped record is no document. The cache is
written beside its final name and renamed when complete.

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
from jaxpar.data._tokens import CachedTokens, document_ids, parsed

CACHE_VERSION = 2


def expected_meta(source: Any, tokenizer: Any, bos: bool | str, eos: bool | str) -> dict:
    """What a cache of ``source`` under ``tokenizer`` must record (``meta.json`` less its counts).

    Args:
      source: the text source (its ``fingerprint()``).
      tokenizer: the tokenizer (its ``fingerprint()`` and :meth:`~jaxpar.data.Tokenizer.special_ids`).
      bos, eos: what goes before / after each document: ``True``, ``False`` or ``"auto"``.

    Returns:
      The dict to compare with ``meta.json``; ``bos`` / ``eos`` are the ids put before / after each document.
    """
    head, tail = tokenizer.special_ids(bos, eos)
    return {"version": CACHE_VERSION, "source": source.fingerprint(), "tokenizer": tokenizer.fingerprint(),
            "bos": head, "eos": tail}


def prepare_cache(source: Any, tokenizer: Any, directory: str | Path, *, bos: bool | str, eos: bool | str,
                  progress: bool = True, chunk: int = 1024) -> dict:
    """Tokenize ``source`` into a cache at ``directory`` (replacing one there); a malformed record the source
    skips (``on_malformed="skip"``) is counted and is no document.

    Args:
      source: a :class:`jaxpar.data.sources.Source`.
      tokenizer: a :class:`jaxpar.data.Tokenizer`.
      directory: the cache's directory.
      bos, eos: what goes before / after each document: ``True`` the tokenizer's BOS / EOS, ``"auto"`` what
        its post-processor adds, ``False`` nothing.
      progress: show a progress bar (documents).
      chunk: documents tokenized per batch.

    Returns:
      ``meta.json``'s content: :func:`expected_meta` plus ``documents``, ``tokens``, ``skipped``,
      ``on_malformed`` (the source's) and ``dtype``.
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _write_tokens(source, tokenizer, tmp, bos=bos, eos=eos, progress=progress, chunk=chunk)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return meta


def _write_tokens(source: Any, tokenizer: Any, tmp: Path, *, bos: bool | str, eos: bool | str, progress: bool,
                  chunk: int) -> dict:
    """``tokens.bin``, ``offsets.npy`` and ``meta.json`` of ``source`` in ``tmp``; returns the meta."""
    from tqdm.auto import tqdm

    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    expected = expected_meta(source, tokenizer, bos, eos)
    ends, total, skipped = [np.zeros(1, np.int64)], 0, 0
    bar = tqdm(total=len(source), desc=f"tokenizing {source.name}", unit="doc", disable=not progress, leave=False)
    try:
        with open(tmp / "tokens.bin", "wb") as out:
            for texts in source.iter_texts(chunk=chunk):
                good = parsed(texts, 0)[1]
                skipped += len(texts) - len(good)
                docs = document_ids(good, tokenizer.encode_batch, head=expected["bos"], tail=expected["eos"])
                lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
                if docs:
                    np.concatenate(docs).astype(dtype).tofile(out)
                ends.append(total + np.cumsum(lengths))
                total += int(lengths.sum())
                bar.update(len(texts))
    finally:
        bar.close()
    offsets = np.concatenate(ends)
    np.save(tmp / "offsets.npy", offsets)
    meta = {**expected, "documents": len(offsets) - 1, "tokens": total, "skipped": skipped,
            "on_malformed": source.on_malformed, "dtype": np.dtype(dtype).name}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def open_cache(directory: str | Path, expected: dict, *, on_malformed: str = "error") -> CachedTokens:
    """The cache at ``directory``, checked against ``expected`` (:func:`expected_meta`) and ``on_malformed``.

    Args:
      directory: the cache's directory (``meta.json`` and the token files).
      expected: what its ``meta.json`` must record.
      on_malformed: the run's setting: ``"error"`` refuses a cache that skipped malformed records.

    Returns:
      The :class:`CachedTokens` store.

    Raises:
      CacheError: no cache there, one built from other sources, tokenizer or BOS / EOS (named), or one that
        skipped malformed records under ``on_malformed="error"``.
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
    skipped = int(meta.get("skipped", 0))
    if skipped and on_malformed == "error":
        raise CacheError(f"token cache {str(directory)!r} was built with on_malformed={meta.get('on_malformed')!r} "
                         f"and left out {skipped} malformed records, which on_malformed='error' (data.on_malformed) "
                         "refuses. Set data.on_malformed: skip to train without them, or fix the records and build "
                         "the cache again with `jaxpar data prepare CONFIG`.")
    return CachedTokens(directory, meta["dtype"], skipped=skipped)


def _difference(key: str, found: Any, want: Any) -> str:
    if key == "tokenizer":
        return "another tokenizer (its fingerprint differs)"
    if key in ("bos", "eos"):
        where = "before" if key == "bos" else "after"
        return f"the ids {where} each document ({key}) are {found!r} in the cache, {want!r} now"
    if key == "source" and isinstance(found, dict) and isinstance(want, dict):
        fields = sorted(k for k in set(found) | set(want) if found.get(k) != want.get(k))
        return f"the source differs in {', '.join(fields)} (cache: {[found.get(k) for k in fields]}, now: " \
               f"{[want.get(k) for k in fields]})"
    return f"{key}={found!r} in the cache, {want!r} now"
