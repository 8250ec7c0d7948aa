"""``jaxpar data prepare`` tokenizes each text source of ``data.sources`` into ``data.cache``
(:func:`jaxpar.data._cache.prepare_cache`) and prints a summary and a length histogram;
``jaxpar data show`` builds the global batches ``A .. B-1`` exactly as ``jaxpar train`` would under
the config's mesh and prints each one's sha256 (:func:`jaxpar.data.batch_digest`), packing
efficiency and first row decoded: two meshes that print the same digests see the same data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from jaxpar._text import agg_axes
from jaxpar.commands._common import config_job, parse_steps
from jaxpar.config._documents import open_source_of, source_cache_dir, source_error
from jaxpar.config._job import build_job
from jaxpar.config._load import load_config
from jaxpar.config._schema import ConfigError, DataConfig
from jaxpar.data import DataError, batch_digest, make_global_batch
from jaxpar.data._cache import expected_meta, open_cache, prepare_cache
from jaxpar.data._tokenizers import decode_ids
from jaxpar.run._sample import host_params


def run_prepare(config: str, overrides: Sequence[str], *, force: bool = False) -> int:
    """``jaxpar data prepare``: each text source's token cache, then the summary and the histogram.

    Args:
      config: the YAML config file.
      overrides: dotted ``key=value`` overrides.
      force: tokenize again even where a cache is up to date.

    Returns:
      The exit status (0).
    """
    cfg = load_config(config, list(overrides))
    d = cfg.data
    if d.kind != "documents" or d.cache is None:
        raise ConfigError(f"jaxpar data prepare: needs data.kind=documents and data.cache (the directory to write); "
                          f"here data.kind={d.kind!r}, data.cache={d.cache!r}.")
    tokenizer = build_job(cfg, mesh=False, data=False).tokenizer
    lengths = []
    for i, entry in enumerate(d.sources):
        if dict(entry).get("format") == "tokens":
            print(f"source {i}  {dict(entry)['path']}: a token file, read as it is")
            continue
        store, line = _prepare_source(d, i, tokenizer, force)
        lengths.append(store.lengths)
        print(line)
    if lengths:
        png = length_histogram(np.concatenate(lengths), Path(d.cache) / "lengths.png", cfg.model.seq_len)
        print(f"lengths  {_percentiles(np.concatenate(lengths))}; histogram -> {png}")
    return 0


def _prepare_source(d: DataConfig, index: int, tokenizer: Any, force: bool) -> tuple[Any, str]:
    """``data.sources[index]``'s cache, built unless up to date (or ``force``), and its summary line; an error
    of the data layer is a :class:`ConfigError` naming the source."""
    directory = source_cache_dir(d, index)
    try:
        source = open_source_of(d, index)
        expected = expected_meta(source, tokenizer, d.bos, d.eos)
        store, state = None, "up to date"
        if not force:
            try:
                store = open_cache(directory, expected, on_malformed=d.on_malformed)
            except DataError:    # none there, or out of date: built below
                pass
        if store is None:
            meta = prepare_cache(source, tokenizer, directory, bos=d.bos, eos=d.eos)
            store, state = open_cache(directory, meta, on_malformed=d.on_malformed), "built"
    except DataError as e:
        raise source_error(d, index, e) from None
    skipped = f", {store.skipped} malformed records skipped" if store.skipped else ""
    return store, (f"source {index}  {source.name} -> {directory}: {len(store.lengths):,} documents, "
                   f"{int(store.lengths.sum()):,} tokens ({state}{skipped})")


def _percentiles(lengths: np.ndarray) -> str:
    q = np.percentile(lengths, [10, 50, 90, 99]).astype(int)
    return f"documents' tokens: p10 {q[0]}, median {q[1]}, p90 {q[2]}, p99 {q[3]}, max {int(lengths.max())}"


def length_histogram(lengths: np.ndarray, path: str | Path, seq_len: int | None = None) -> Path:
    """A PNG histogram of documents' token lengths (log-spaced bins), with ``seq_len`` marked when given.

    Args:
      lengths: each document's token count.
      path: the PNG file to write.
      seq_len: the model's sequence length, drawn as a line (None: none).

    Returns:
      ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = agg_axes((7, 4), dpi=100)
    bins = np.geomspace(1, max(2, int(lengths.max())) + 1, 50)
    ax.hist(np.maximum(lengths, 1), bins=bins)
    ax.set(xscale="log", xlabel="tokens per document", ylabel="documents",
           title=f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens")
    if seq_len:
        ax.axvline(seq_len, color="k", linestyle="--", label=f"seq_len {seq_len}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def run_show(config: str, overrides: Sequence[str], *, steps: str = "0:4", chars: int = 160,
             dist: dict | None = None) -> int:
    """``jaxpar data show``: the global batches of ``steps`` under the config's mesh: digest, packing, a row.

    With several processes (``dist``: ``--coordinator`` and the rest, or a launcher), each builds its own
    rows, the batch is gathered, and process 0 prints.

    Args:
      config: the YAML config file.
      overrides: dotted ``key=value`` overrides.
      steps: ``A:B``, the global steps A .. B-1 whose batches are shown (``--steps``).
      chars: characters of each decoded row.
      dist: the process options (None: one process, or a launcher's environment).

    Returns:
      The exit status (0).
    """
    span = range(*parse_steps(steps))
    cfg, job = config_job(config, overrides, "data show", dist, data=True)
    say = print if jax.process_index() == 0 else (lambda *_: None)
    say(f"mesh     {dict(job.mesh.shape)}, {jax.process_count()} process(es); data.kind={cfg.data.kind}, "
        f"seed {cfg.data.seed}")
    for step in span:
        batch = host_params(make_global_batch(job.batch_fn, step, job.mesh))    # every process gathers it
        used = float((batch["segment_ids"] > 0).mean()) if "segment_ids" in batch else 1.0
        row = batch["tokens"][0][batch["segment_ids"][0] > 0] if "segment_ids" in batch else batch["tokens"][0]
        say(f"step {step:>6}  sha256 {batch_digest(batch)}  rows {len(batch['tokens'])}  packing {used:.2%}")
        say(f"             row 0: {decode_ids(job.tokenizer, row)[:chars]!r}")
    if hasattr(job.batch_fn, "close"):
        job.batch_fn.close()
    return 0

