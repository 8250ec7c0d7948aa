"""``jaxpar export`` and ``jaxpar sample``: the commands that read a run's weights (:func:`run_weights`): the latest
good jaxpar checkpoint in ``checkpoint.dir`` (``--step N``: that one), restored onto the config's own mesh and
layout as ``jaxpar train --resume`` restores it; before the run has one, ``model.hf``'s imported weights.
``export`` writes them as a Hugging Face checkpoint (:func:`jaxpar.hf.export`; it needs ``model.hf``);
``sample`` continues a prompt greedily (:func:`jaxpar.run.greedy_generate`), decoded by ``data.tokenizer``, else
``model.hf``'s tokenizer, else as bytes. Both say on stderr which weights they read.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from jaxpar.commands._common import config_job
from jaxpar.config._schema import ConfigError
from jaxpar.data import check_tokenizer
from jaxpar.data._tokenizers import decode_ids
from jaxpar.run._checkpoint import CheckpointError
from jaxpar.run._sample import greedy_generate, host_params, length_fixes
from jaxpar.step._state import use_parts


class RunWeights(NamedTuple):
    """A run's weights (:func:`run_weights`): ``params`` in ``layout``, ``where`` they came from (in
    words), and the ``stats`` parts its state keeps (on the host; None: none), which the model runs under
    (:func:`jaxpar.step._state.use_parts`: the MoE router bias)."""

    params: Any
    layout: Any
    where: str
    stats: Any = None
    record: dict | None = None       # the checkpoint's JSON record (None: the imported weights)


def run_weights(job: Any, step: int | None = None) -> RunWeights:
    """The run's weights: its jaxpar checkpoint of ``step`` (None: the latest good one) restored onto
    the job's layout (the whole train state is read), or before it has one, ``model.hf``'s imported
    weights (only they are read).

    Args:
      job: the run's :class:`~jaxpar.config.Job` (built with a mesh).
      step: the checkpoint's step (None: the latest).

    Returns:
      The :class:`RunWeights`.

    Raises:
      CheckpointError: ``step`` has no (readable) checkpoint, or the run has none and no ``model.hf``.
    """
    layout = job.state_layout()
    directory = Path(job.checkpoint["directory"]) if job.checkpoint is not None else None
    if directory is not None and directory.is_dir():
        ckpt = job.checkpointer(layout)
        try:
            if step is not None or ckpt.latest_step() is not None:
                state = (restored := ckpt.restore(layout, step)).state
                saved = restored.meta.get("time")       # which run's checkpoint was read, and when it was saved
                when = f" (saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved))})" if saved else ""
                return RunWeights(state.params, layout, f"step {restored.step} of {ckpt.directory}{when}",
                                  host_params(state.stats), restored.meta)
        finally:
            ckpt.close()
    if job.hf is None or step is not None:
        which = f" of step {step}" if step is not None else ""
        where = f"in {directory}" if directory is not None else "(checkpoint.enabled=false)"
        raise CheckpointError(f"no jaxpar checkpoint{which} {where}; train first (jaxpar train), or point "
                              "checkpoint.dir at the run's checkpoints.")
    where = f"the imported weights of model.hf={str(job.hf.path)!r} (no jaxpar checkpoint yet)"
    return RunWeights(job.hf.load(job.mesh, layout.params), layout, where)


def run_export(config: str, overrides: Sequence[str], out: str, *, step: int | None = None, overwrite: bool = False,
               dtype: str | None = None) -> int:
    """``jaxpar export``: the run's weights (:func:`run_weights`) -> a Hugging Face checkpoint in ``out``.

    Args:
      config: the run's YAML config (or ``<train.out_dir>/config.yaml``).
      overrides: dotted ``key=value`` overrides.
      out: the directory to write (new or empty).
      step: the jaxpar checkpoint of that step (None: the latest good one).
      overwrite: replace the checkpoint files of a non-empty ``out``.
      dtype: the tensors' dtype, ``"bfloat16"`` or ``"float32"`` (None: the source's).

    Returns:
      The exit status (0).

    Raises:
      ConfigError: the config is invalid, or has no ``model.hf``.
      HFExportError: ``out`` is a file, or is not empty (and not ``overwrite``).
    """
    from jaxpar.hf import HFExportError, export

    target = Path(out)
    if target.exists() and not target.is_dir():                          # before a restore that may take long
        raise HFExportError(f"export: --hf {target} is a file, not a directory; name a new or empty directory "
                            "(the checkpoint is config.json and *.safetensors files written into it).")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise HFExportError(f"export: {target} is not empty; choose an empty or new directory, or pass --overwrite "
                            "to replace its checkpoint files.")
    _, job = config_job(config, overrides, "export")
    weights = run_weights(job, step)
    print(f"export   {weights.where} -> {target} ({dtype or job.hf.dtype})", file=sys.stderr)
    export(weights.params, target, source=job.hf, dtype=dtype, overwrite=overwrite)
    return 0


def _sample_codec(cfg: Any, job: Any):
    """``(encode, tokenizer)`` of the run's text: ``data.tokenizer``'s, ``model.hf``'s tokenizer, or bytes
    (tokenizer None); ``data.bos: auto`` encodes a prompt as transformers' ``tokenizer(prompt)`` does."""
    tok = job.tokenizer
    if tok is None and job.hf is not None:
        from dataclasses import replace

        from jaxpar.config._hf_model import build_tokenizer

        try:
            tok = build_tokenizer(replace(cfg.data, tokenizer="hf"), cfg.model.hf, job.hf.config.vocab,
                                  "model.hf's vocab_size")
        except ConfigError as e:
            raise ConfigError(f"jaxpar sample: data.tokenizer is not set, and model.hf's own does not serve: {e}"
                              ) from None
    if tok is not None:
        encode = tok.encode_prompt if cfg.data.bos == "auto" else (lambda text: tok.encode(text, bos=cfg.data.bos))
        return encode, tok
    if cfg.data.kind != "text":
        raise ConfigError(f"jaxpar sample: data.kind={cfg.data.kind!r} with no tokenizer: the run's tokens have no "
                          "text; set data.tokenizer (a tokenizer's directory) to decode them.")
    return (lambda text: list(text.encode())), None


def _check_sample_length(prompt: int, new: int, most: int | None, *, asked: bool) -> None:
    """A :class:`ConfigError` naming ``--tokens`` when it is negative, or when the ``prompt``'s tokens plus ``new``
    exceed model.hf's ``max_position_embeddings`` (``most``; None: no limit) before any weight is read.
    ``asked``: ``--tokens`` was given (else ``new`` is ``logging.sample_tokens``)."""
    given = f"--tokens {new}" if asked else f"logging.sample_tokens={new} (no --tokens given)"
    if new < 0:
        raise ConfigError(f"{given} is negative; ask for 0 or more new tokens.")
    if most is not None and prompt + new > most:
        raise ConfigError(
            f"the prompt's {prompt} tokens plus {given} are {prompt + new} tokens, more than model.hf's "
            f"max_position_embeddings={most} (the longest sequence its positions were trained for); "
            f"{length_fixes(prompt, new, most, '--tokens')}.")


def run_sample(config: str, overrides: Sequence[str], prompt: str, *, tokens: int | None = None,
               step: int | None = None) -> int:
    """``jaxpar sample``: ``prompt`` continued greedily by the run's weights (:func:`run_weights`), printed.

    Args:
      config: the run's YAML config (or ``<train.out_dir>/config.yaml``).
      overrides: dotted ``key=value`` overrides.
      prompt: the text to continue.
      tokens: new tokens (None: ``logging.sample_tokens``).
      step: the jaxpar checkpoint of that step (None: the latest good one).

    Returns:
      The exit status (0).

    Raises:
      ConfigError: the config is invalid, the prompt encodes to no token, the run's tokens have no text, or the
        prompt plus the new tokens is longer than model.hf's ``max_position_embeddings``.
    """
    cfg, job = config_job(config, overrides, "sample")
    encode, tok = _sample_codec(cfg, job)
    ids = encode(prompt)
    if not ids:
        raise ConfigError(f"jaxpar sample: --prompt {prompt!r} encodes to no token (the tokenizer knows none of its "
                          "characters); give text in the tokenizer's alphabet.")
    new = cfg.logging.sample_tokens if tokens is None else tokens
    most = job.hf.hf_config.get("max_position_embeddings") if job.hf is not None else None
    _check_sample_length(len(ids), new, most, asked=tokens is not None)
    w = run_weights(job, step)
    saved = (w.record or {}).get("tokenizer")
    if tok is not None and saved is not None:         # the ids the run trained with, or a named error
        check_tokenizer(saved["fingerprint"], tok, saved["vocab_size"])
    with use_parts(w.layout, w.stats):
        out = greedy_generate(w.layout.graphdef, w.params, [ids], new_tokens=new, context=cfg.model.seq_len,
                              max_positions=most)[0]
    print(f"sample   {len(ids)} prompt tokens + {new} greedy tokens from {w.where}", file=sys.stderr)
    print(decode_ids(tok, out))
    return 0
