"""The data section -> ``(batch_fn(step) -> host batch, fixed eval batches)``: token windows of text
(its bytes, or its tokens with ``data.tokenizer``), a token file or synthetic sequences for the
built-in GPT and ``model.hf``, or a user's batch function by import path (called once for step 0 and
checked before the run starts).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxpar.config._documents import build_documents
from jaxpar.config._imports import resolve_import, takes
from jaxpar.config._schema import DATA_KINDS, ConfigError, DataConfig
from jaxpar.data import _windows as data_lib
from jaxpar.data._tokens import map_tokens
from jaxpar.run._ramp import AdaptiveRamp, BatchRamp, RampError, ramp_batch_fn


def describe_batch(batch: Any) -> str:
    """``"['x']: float32[32, 16], ['y']: int32[32]"``: the leaves of a host batch.

    Args:
      batch: a host batch (a pytree of arrays).

    Returns:
      One ``path: dtype[shape]`` entry per leaf, comma-separated.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    return ", ".join(f"{jax.tree_util.keystr(k)}: {np.asarray(x).dtype}{list(np.shape(x))}" for k, x in leaves)


def _check_import_batch(batch: Any, cfg: DataConfig, what: str) -> None:
    """A batch of ``data.target``: a mapping of numeric arrays with leading dimension ``data.batch_size``."""
    where = f"data.target={cfg.target!r} ({what})"
    if not isinstance(batch, Mapping) or not batch:
        got = "an empty dict" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        raise ConfigError(f"{where} returned {got}; it must return a non-empty dict of arrays whose leading "
                          "dimension is the global batch (data.batch_size), e.g. {'x': ..., 'y': ...}.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        name, a = jax.tree_util.keystr(path), np.asarray(leaf)
        if a.dtype.kind not in "biuf":
            raise ConfigError(f"{where}: batch{name} has dtype {a.dtype}; batch leaves must be numeric arrays.")
        if a.ndim == 0 or a.shape[0] != cfg.batch_size:
            raise ConfigError(f"{where}: batch{name} has shape {a.shape}; every leaf needs the leading dimension "
                              f"data.batch_size={cfg.batch_size} (the global batch). Batch: {describe_batch(batch)}.")


def _import_data(cfg: DataConfig, eval_batches: int) -> tuple[Callable[[int], dict], list[dict]]:
    """``batch_fn = partial(target, batch_size=, seed=, **kwargs)``, called once now for step 0; eval batch
    ``i`` is ``target(i, ..., eval=True)`` when ``target`` takes an ``eval`` keyword, else no eval."""
    fn = resolve_import(cfg.target, "data.target")
    kw = dict(batch_size=cfg.batch_size, seed=cfg.seed, **cfg.kwargs)
    batch_fn = partial(fn, **kw)    # a `rows` parameter stays visible to make_global_batch

    def call(step: int, what: str, **extra: Any) -> dict:
        try:
            batch = fn(step, **kw, **extra)
        except Exception as e:
            e.add_note(f"jaxpar: while calling data.target={cfg.target!r} for {what} with data.kwargs={cfg.kwargs}")
            raise
        _check_import_batch(batch, cfg, what)
        return batch

    call(0, "step 0")   # fail now, not mid-run
    evals = [call(i, f"eval batch {i}", eval=True) for i in range(eval_batches)] if takes(fn, "eval") else []
    return batch_fn, evals


_FIXED_KEYS, _ADAPTIVE_KEYS = {"sizes", "steps"}, {"sizes", "adaptive", "every", "factor", "start"}


def build_ramp(cfg: DataConfig):
    """The ramp of ``data.batch_ramp``: a :class:`~jaxpar.run.BatchRamp` (``{sizes, steps}``), an
    :class:`~jaxpar.run.AdaptiveRamp` (``{sizes, adaptive: true, every, factor, start}``), or
    ``None`` when empty.

    Args:
      cfg: the data section; its ``batch_ramp``'s first size must equal ``batch_size``.

    Returns:
      The ramp, or None.
    """
    if not cfg.batch_ramp:
        return None
    r = cfg.batch_ramp
    adaptive = r.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"data.batch_ramp.adaptive={adaptive!r}: must be true or false.")
    keys = _ADAPTIVE_KEYS if adaptive else _FIXED_KEYS
    unknown = sorted(set(r) - keys - {"adaptive"})
    if unknown:
        other = sorted(set(unknown) & (_ADAPTIVE_KEYS | _FIXED_KEYS))
        hint = (f" ({', '.join(other)} belong to {'a fixed ramp' if adaptive else 'adaptive: true'})"
                if other else "")
        raise ConfigError(f"data.batch_ramp: unknown key(s) {unknown}{hint}; a fixed ramp takes sizes and steps, e.g. "
                          "{sizes: [32, 64, 128], steps: [0, 100, 200]}; an adaptive one sizes, adaptive: true, every, "
                          "factor, start, e.g. {sizes: [32, 64, 128], adaptive: true, every: 50}.")
    try:
        if adaptive:
            if "every" not in r:
                raise RampError("batch ramp: adaptive: true needs every (decide every that many steps), e.g. every: 50.")
            ramp = AdaptiveRamp(tuple(r.get("sizes", ())), r["every"], factor=r.get("factor", 1.0),
                                start=r.get("start", 0))
        else:
            ramp = BatchRamp(tuple(r.get("sizes", ())), tuple(r.get("steps", ())))
    except RampError as e:
        raise ConfigError(f"data.batch_ramp: {str(e).removeprefix('batch ramp: ')}") from None
    if ramp.sizes[0] != cfg.batch_size:
        raise ConfigError(f"data.batch_ramp: the first size {ramp.sizes[0]} must equal data.batch_size="
                          f"{cfg.batch_size} (the batch the run starts with).")
    return ramp


def build_data(cfg: DataConfig, *, seq_len: int | None = None, vocab: int | None = None, eval_batches: int,
               ramp: Any = None, tokenizer: Any = None, steps: int | None = None
               ) -> tuple[Callable[[int], dict], list[dict]]:
    """The batch function and eval batches of the data section.

    Args:
      cfg: the data section.
      seq_len: the model's sequence length; needed by the token kinds (text, tokens, synthetic,
        documents), not by ``import``.
      vocab: the model's vocabulary size; likewise.
      eval_batches: how many fixed eval batches.
      ramp: the ramp of :func:`build_ramp` to read the sizes from (an adaptive ramp changes as it
        decides); default: a new one.
      tokenizer: ``data.tokenizer``'s (:func:`jaxpar.config._hf_model.build_tokenizer`): the text is its
        tokens, not bytes.
      steps: the run's steps (``data.kind=documents`` refuses a run that would repeat documents
        without ``data.repeat``).

    Returns:
      ``(batch_fn(step) -> host batch, eval batches)``; with ``data.batch_ramp``, the batch of step
      ``t`` has the ramp's size at ``t``.
    """
    ramp = build_ramp(cfg) if ramp is None else ramp
    if cfg.kind == "documents":   # the packed batches follow the ramp's rows themselves
        return build_documents(cfg, seq_len=seq_len, vocab=vocab, tokenizer=tokenizer, eval_batches=eval_batches,
                               ramp=ramp, steps=steps)
    batch_fn, evals = _build_data(cfg, seq_len=seq_len, vocab=vocab, eval_batches=eval_batches, tokenizer=tokenizer)
    if ramp is None:
        return batch_fn, evals
    return ramp_batch_fn(batch_fn, ramp), evals


def _corpus(cfg: DataConfig, tokenizer: Any) -> np.ndarray:
    """The data as one array: a token file's, the text's bytes, or the text's tokens (each file a document)."""
    if cfg.kind == "tokens":
        return map_tokens(cfg.paths[0], cfg.token_dtype)
    if tokenizer is None:
        return data_lib.load_bytes(list(cfg.paths) or None, max_bytes=cfg.max_bytes)
    docs = data_lib.read_documents(list(cfg.paths) or None, max_bytes=cfg.max_bytes)
    return data_lib.tokenize_documents(docs, lambda text: tokenizer.encode(text, bos=cfg.bos, eos=cfg.eos))


def _build_data(cfg: DataConfig, *, seq_len: int | None, vocab: int | None, eval_batches: int, tokenizer: Any = None
                ) -> tuple[Callable[[int], dict], list[dict]]:
    if cfg.kind == "import":
        return _import_data(cfg, eval_batches)
    if cfg.kind not in DATA_KINDS:
        raise ConfigError(f"data.kind={cfg.kind!r}: unknown; allowed: {', '.join(DATA_KINDS)}.")
    if seq_len is None or vocab is None:
        raise ConfigError(f"data.kind={cfg.kind!r} makes token windows and needs the model's seq_len and vocab "
                          "(model.seq_len, model.vocab of the built-in GPT); use data.kind=import for other models.")
    kw = dict(batch_size=cfg.batch_size, seq_len=seq_len)
    if cfg.kind == "synthetic":
        evals = [data_lib.synthetic_batch(i, vocab=vocab, seed=cfg.seed, eval=True, **kw)
                 for i in range(eval_batches)]
        return partial(data_lib.synthetic_batch, vocab=vocab, seed=cfg.seed, **kw), evals
    if cfg.kind == "tokens" and len(cfg.paths) != 1:
        raise ConfigError(f"data.kind=tokens needs exactly one token file in data.paths (a .bin or .npy), "
                          f"got data.paths={list(cfg.paths)}.")
    try:
        train, held = data_lib.split_holdout(_corpus(cfg, tokenizer), cfg.eval_fraction)
        evals = (data_lib.eval_windows(held, num_batches=eval_batches, **kw) if eval_batches else [])
        data_lib.text_batch(train, 0, seed=cfg.seed, **kw)  # fail now, not mid-run
    except (ValueError, OSError) as e:
        tok = f", data.tokenizer={cfg.tokenizer!r}" if tokenizer is not None else ""
        raise ConfigError(f"data (data.kind={cfg.kind}, data.paths={list(cfg.paths)}, data.max_bytes="
                          f"{cfg.max_bytes}, data.eval_fraction={cfg.eval_fraction}{tok}): {e}") from None
    if cfg.kind == "text" and tokenizer is None:
        return partial(data_lib.text_batch, train, seed=cfg.seed, **kw), evals
    key, where = (("data.paths", f"token file {cfg.paths[0]!r}") if cfg.kind == "tokens" else
                  ("data.tokenizer", f"the text tokenized by data.tokenizer={cfg.tokenizer!r}"))
    batch_fn = data_lib.token_batch_fn(train, vocab, where, seed=cfg.seed, **kw)
    try:   # fail now, not mid-run
        batch_fn(0)
        for i, b in enumerate(evals):
            data_lib.check_token_ids(b, vocab, f"{where}, eval batch {i},")
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    return batch_fn, evals
