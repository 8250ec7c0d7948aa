"""``data.kind: documents``: the YAML of real corpora -> :class:`jaxpar.data.PackedBatches`.

::

    data:
      kind: documents
      sources:                        # one or more, mixed by weight (share of the tokens)
        - {path: data/web/*.jsonl.gz, text_field: text, weight: 0.7}
        - {path: data/code.parquet, weight: 0.3}
        - {path: data/extra.bin, format: tokens, separator: 0}      # pre-tokenized, cut after each 0
      tokenizer: hf                   # or a tokenizer.json / .model / .tiktoken (or its directory)
      bos: auto                       # BOS before each document: auto (what the tokenizer's post-processor
      eos: true                       # adds, as transformers' tokenizer(text)) | true | false; EOS after it
      cache: runs/cache               # jaxpar data prepare CONFIG writes it; null: tokenize on the fly
      pack: best_fit                  # first_fit | none
      pack_window: 64                 # rows packed together
      pack_fill: 0.99                 # the share of a window the documents fill
      on_malformed: error             # skip: a malformed record is skipped, counted, and no document

:func:`documents_problems` checks the section without reading a file; :func:`open_stores` opens each
source as a token store (its cache, or the text tokenized on the fly, or a token file);
:func:`build_documents` makes the batch function and the held-out batches.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from jaxpar.data import DataError, PackedBatches
from jaxpar.data._cache import expected_meta, open_cache
from jaxpar.data._packing import PACK_METHODS
from jaxpar.data._tokens import TOKEN_DTYPES, LiveTokens, TokenFile
from jaxpar.config._schema import ConfigError, DataConfig, JobConfig

#: The keys of one entry of ``data.sources``.
SOURCE_KEYS = ("path", "format", "text_field", "weight", "token_dtype", "separator")
MALFORMED_MODES = ("error", "skip")
_TEXT_FORMATS = ("jsonl", "parquet", "arrayrecord", "hf_disk")


def documents_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with a ``data.kind: documents`` section (and its model), without reading a file.

    Args:
      cfg: the whole config.

    Returns:
      One line per problem, naming its YAML key; empty when there is none (or another ``data.kind``).
    """
    d, m = cfg.data, cfg.model
    if d.kind != "documents":
        return [f"data.sources: only read by data.kind=documents (here data.kind={d.kind!r}); remove it or set "
                "data.kind: documents."] if d.sources else []
    p: list[str] = []
    if m.hf is None and m.target is None:
        p.append(f"data.kind=documents makes packed rows (segment_ids, positions, loss_weights), which the built-in "
                 f"model.name={m.name!r} does not read; use model.hf (a Hugging Face checkpoint), or data.kind=text "
                 "with data.tokenizer (windows of the token stream). A model of your own reads them through "
                 "jaxpar.data.PackedBatches as its data.target.")
    if not d.sources:
        p.append("data.sources: empty; data.kind=documents needs at least one source, e.g. "
                 "sources: [{path: data/train.jsonl}].")
    if d.paths:
        p.append(f"data.paths={list(d.paths)}: read by data.kind=text and tokens; data.kind=documents reads "
                 "data.sources (e.g. sources: [{path: corpus.jsonl}]). Remove data.paths.")
    for i, s in enumerate(d.sources):
        p += _source_problems(i, dict(s))
    if d.pack not in PACK_METHODS:
        p.append(f"data.pack={d.pack!r}: choose one of {', '.join(PACK_METHODS)}.")
    if d.pack_window < 1:
        p.append(f"data.pack_window={d.pack_window!r}: must be >= 1 (rows packed together).")
    if not 0 < d.pack_fill <= 1:
        p.append(f"data.pack_fill={d.pack_fill!r}: must be in (0, 1] (the share of a pack window the documents fill).")
    if d.on_malformed not in MALFORMED_MODES:
        p.append(f"data.on_malformed={d.on_malformed!r}: choose one of {', '.join(MALFORMED_MODES)}.")
    if d.prefetch < 0:
        p.append(f"data.prefetch={d.prefetch!r}: must be >= 0 (steps built ahead in the background).")
    if d.tokenizer is None and any(dict(s).get("format") != "tokens" for s in d.sources):   # text sources
        p.append("data.tokenizer: missing; text sources need a tokenizer (hf: model.hf's, or a tokenizer.json / "
                 ".model / .tiktoken file or its directory).")
    return p


def _source_problems(i: int, s: dict) -> list[str]:
    where = f"data.sources[{i}]"
    p = [f"{where}.{key}: unknown key; a source takes {', '.join(SOURCE_KEYS)}." for key in sorted(set(s) - set(SOURCE_KEYS))]
    if not s.get("path"):
        p.append(f"{where}.path: missing; give a file, a glob or a list of them.")
    fmt = s.get("format")
    if fmt is not None and fmt not in (*_TEXT_FORMATS, "tokens"):
        p.append(f"{where}.format={fmt!r}: choose one of {', '.join((*_TEXT_FORMATS, 'tokens'))} (or leave it out: "
                 "inferred from the file's suffix).")
    weight = s.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        p.append(f"{where}.weight={weight!r}: must be a number > 0 (the source's share of the tokens).")
    if fmt == "tokens":
        if s.get("token_dtype", "uint16") not in TOKEN_DTYPES:
            p.append(f"{where}.token_dtype={s.get('token_dtype')!r}: choose one of {', '.join(TOKEN_DTYPES)}.")
    else:
        for key in ("token_dtype", "separator"):
            if key in s:
                p.append(f"{where}.{key}: only for format: tokens (a pre-tokenized file); remove it.")
    return p


def source_cache_dir(d: DataConfig, index: int) -> Path:
    """The cache directory of ``data.sources[index]``: ``<data.cache>/<index>-<name of its path>``.

    Args:
      d: the data section.
      index: the source's index in ``data.sources``.

    Returns:
      The directory (it may not exist yet).
    """
    path = dict(d.sources[index])["path"]
    first = path[0] if isinstance(path, (list, tuple)) else path
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(first)).name.split("*")[0]).strip("._") or "source"
    return Path(d.cache).expanduser() / f"{index}-{stem}"


def open_source_of(d: DataConfig, index: int) -> Any:
    """``data.sources[index]`` opened as a :class:`jaxpar.data.sources.Source` (a text source).

    Args:
      d: the data section.
      index: the source's index in ``data.sources``.

    Returns:
      The opened source.
    """
    from jaxpar.data.sources import open_source

    s = dict(d.sources[index])
    return open_source(s["path"], format=s.get("format"), text_field=s.get("text_field", "text"),
                       on_malformed=d.on_malformed)


def open_stores(d: DataConfig, tokenizer: Any, *, progress: Callable | None = None) -> list[Any]:
    """One token store per source: its cache (``data.cache``), its text tokenized on the fly, or its token file.

    Args:
      d: the data section.
      tokenizer: ``data.tokenizer``'s, for the text sources.
      progress: wraps the chunks of a text source's length pass (e.g. ``tqdm``); None: a bar on a terminal.

    Returns:
      The stores, in the order of ``data.sources``.

    Raises:
      ConfigError: a source, cache or token file that cannot be used; the message names ``data.sources[i]``.
    """
    stores = []
    for i, entry in enumerate(d.sources):
        s = dict(entry)
        try:
            if s.get("format") == "tokens":
                stores.append(TokenFile(s["path"], dtype=s.get("token_dtype", "uint16"), separator=s.get("separator")))
                continue
            source = open_source_of(d, i)
            if d.cache is not None:
                meta = expected_meta(source, tokenizer, d.bos, d.eos)
                stores.append(open_cache(source_cache_dir(d, i), meta, on_malformed=d.on_malformed))
            else:
                stores.append(LiveTokens(source, tokenizer, bos=d.bos, eos=d.eos,
                                         progress=progress or _length_bar(source)))
        except DataError as e:
            raise source_error(d, i, e) from None
        if not len(stores[-1].lengths) or not int(stores[-1].lengths.sum()):
            raise source_error(d, i, "no tokens (an empty source).")
    return stores


def source_error(d: DataConfig, index: int, error: Exception | str) -> ConfigError:
    """``error`` of ``data.sources[index]`` as a :class:`ConfigError` that names the source and its path.

    Args:
      d: the data section.
      index: the source's index.
      error: what the data layer raised, or the problem in words.

    Returns:
      The error to raise.
    """
    return ConfigError(f"data.sources[{index}] (path {dict(d.sources[index]).get('path')!r}): {error}")


def _length_bar(source: Any) -> Callable:
    """A progress bar (on a terminal) over the chunks of the pass that learns a source's lengths."""
    from tqdm.auto import tqdm

    return lambda chunks: tqdm(chunks, total=-(-len(source) // 1024), desc=f"lengths of {source.name}",
                               unit="1k docs", leave=False, disable=None)


def build_documents(d: DataConfig, *, seq_len: int, vocab: int, tokenizer: Any, eval_batches: int,
                    ramp: Any = None, steps: int | None = None,
                    progress: Callable | None = None) -> tuple[PackedBatches, list[dict]]:
    """The packed batches of ``data.sources`` and ``eval_batches`` held-out batches.

    Args:
      d: the data section (``kind: documents``).
      seq_len: the model's sequence length (the rows' length).
      vocab: the model's vocabulary size (token ids must be below it).
      tokenizer: ``data.tokenizer``'s, for the text sources.
      eval_batches: how many held-out batches.
      ramp: a batch ramp whose sizes the batches follow (None: ``data.batch_size``).
      steps: the run's steps (None: not checked against the sources' epochs).
      progress: as for :func:`open_stores`.

    Returns:
      ``(batches, eval batches)``: the :class:`jaxpar.data.PackedBatches` and the held-out host batches.

    Raises:
      ConfigError: a source that cannot be read, token ids outside the model's vocabulary (named with the
        source), no held-out documents while evaluation is asked for, a run of ``steps`` steps that would
        draw a source for a second epoch without ``data.repeat``.
    """
    stores = open_stores(d, tokenizer, progress=progress)
    for i, store in enumerate(stores):
        top = int(store.max_id) if hasattr(store, "max_id") else None
        if top is not None and top >= vocab:
            raise ConfigError(f"data.sources[{i}] ({store.name}): holds token id {top}, outside the model's vocabulary "
                              f"[0, {vocab}); the file was tokenized for another model.")
    weights = [float(dict(s).get("weight", 1.0)) for s in d.sources]
    try:
        data = PackedBatches(stores, weights, seq_len=seq_len, batch_size=d.batch_size, seed=d.seed, method=d.pack,
                             rows_per_window=d.pack_window, fill=d.pack_fill, eval_fraction=d.eval_fraction,
                             ramp=ramp, prefetch=d.prefetch)
        evals = data.eval_batches(eval_batches) if eval_batches else []
        data(0)    # fail now, not mid-run
    except DataError as e:
        raise ConfigError(f"data (data.kind=documents): {e}") from None
    if steps and not d.repeat:
        _check_one_epoch(stores, data.epochs(steps), steps)
    return data, evals


def _check_one_epoch(stores: list, epochs: Any, steps: int) -> None:
    over = [(i, e) for i, e in enumerate(epochs) if e > 1.0]
    if over:
        what = "; ".join(f"data.sources[{i}] ({stores[i].name}): {e:.2f} epochs of its "
                         f"{int(stores[i].lengths.sum()):,} tokens" for i, e in over)
        raise ConfigError(f"the run's {steps} steps would draw documents more than once: {what}. Set data.repeat: "
                          "true to repeat them (each epoch in a new order), or train fewer steps, or give the "
                          "source a smaller weight.")
