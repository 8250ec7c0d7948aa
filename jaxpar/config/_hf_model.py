"""The config side of Hugging Face checkpoints: ``model.hf`` (the checkpoint's
:class:`jaxpar.models.Decoder`, started from its weights) and ``data.tokenizer`` (the text data
tokenized by a checkpoint's tokenizer).

Two kinds of checks, as for the rest of the config. :func:`hf_problems` and :func:`tokenizer_problems`
are :func:`jaxpar.config.check`'s: they read no file. The files are read when the job is built
(:func:`jaxpar.config.build_job`, like the data files): :func:`open_hf` opens the checkpoint
(``config.json`` and the safetensors headers), :func:`hf_mesh_problems` checks its sizes against
``mesh.tensor``, and :func:`build_tokenizer` loads the tokenizer and checks it against the model's
vocabulary. Every error of :mod:`jaxpar.hf` comes back as a :class:`ConfigError` naming the YAML key
(``model.hf``, ``data.tokenizer``) and keeping the library's message.

Example::

    >>> from jaxpar.config._schema import DataConfig, JobConfig, ModelConfig
    >>> cfg = JobConfig(model=ModelConfig(hf="ckpt"), data=DataConfig(kind="text"))
    >>> for line in hf_problems(cfg): print(line)
    data.kind='text' with model.hf='ckpt' and no data.tokenizer would feed bytes ...
    >>> tokenizer_problems(JobConfig(data=DataConfig(tokenizer="hf")))
    ["data.tokenizer='hf' names model.hf's tokenizer, but model.hf is not set; ..."]
    >>> open_hf(ModelConfig(hf="/nonexistent"))
    Traceback (most recent call last):
    ...
    jaxpar.errors.ConfigError: model.hf='/nonexistent': /nonexistent: no config.json; ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxpar.adapters._blocks import REMAT_POLICIES
from jaxpar.config._schema import ConfigError, DataConfig, JobConfig, ModelConfig
from jaxpar.errors import int_problem


def hf_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with a ``model.hf`` config, without reading the checkpoint.

    Args:
      cfg: the config (``model.hf`` set).

    Returns:
      The problems: ``model.hf``, ``model.remat`` and ``model.loss_chunks``, and text data without a tokenizer
      (the model keys set beside ``model.hf`` are :func:`jaxpar.config.load_config`'s: it knows which were given).
    """
    m, d, p = cfg.model, cfg.data, []      # the keys beside model.hf: jaxpar.config.load_config's
    if not m.hf:
        p.append("model.hf='': give the directory of a Hugging Face checkpoint (config.json, *.safetensors).")
    if m.remat not in REMAT_POLICIES:
        p.append(f"model.remat={m.remat!r}: unknown value; allowed: {', '.join(REMAT_POLICIES)}.")
    if why := int_problem(m.loss_chunks, 1):
        p.append(f"model.loss_chunks={m.loss_chunks!r}: {why}; 1 computes the loss whole.")
    if d.kind == "text" and d.tokenizer is None:
        p.append(f"data.kind='text' with model.hf={m.hf!r} and no data.tokenizer would feed bytes to the "
                 "checkpoint's model as token ids; set data.tokenizer: hf (the checkpoint's tokenizer).")
    return p


def tokenizer_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with ``data.tokenizer``, ``data.bos`` and ``data.eos``, without reading a file.

    Args:
      cfg: the config.

    Returns:
      The problems.
    """
    d, p = cfg.data, []
    if d.tokenizer is None:
        p += [f"data.{key}=true: BOS / EOS tokens are inserted by a tokenizer, and data.tokenizer is not set; "
              f"set data.tokenizer (hf, or a tokenizer's directory) or remove data.{key}."
              for key in ("bos", "eos") if getattr(d, key) is True]
        return p
    if d.kind not in ("text", "documents"):
        p.append(f"data.tokenizer={d.tokenizer!r}: tokenizes data.kind=text or documents only (here data.kind="
                 f"{d.kind!r}); remove it, or set data.kind: text.")
    if not d.tokenizer:
        p.append("data.tokenizer='': give hf (model.hf's tokenizer) or a directory holding tokenizer.json.")
    elif d.tokenizer == "hf" and cfg.model.hf is None:
        p.append("data.tokenizer='hf' names model.hf's tokenizer, but model.hf is not set; give the path of a "
                 "directory holding tokenizer.json (or the tokenizer.json file), or set model.hf.")
    return p


def open_hf(m: ModelConfig):
    """The :class:`jaxpar.hf.Checkpoint` of ``model.hf`` (config and tensor headers read and checked). A
    directory with ``config.json`` only opens without weights (``Checkpoint.files`` None): ``check``,
    ``inspect`` and ``plan`` need the model's shape only, and ``train`` starts it from random weights.

    Args:
      m: the model section (``hf`` set; its ``remat``, ``scan_layers`` and ``loss_chunks`` go to the decoder's
        config).

    Returns:
      The opened checkpoint.

    Raises:
      ConfigError: the checkpoint cannot be imported; the message names ``model.hf`` and keeps jaxpar.hf's.
    """
    from jaxpar.hf import HFCheckpointError, HFConfigError, HFFilesError, open_checkpoint

    try:
        return open_checkpoint(m.hf, require_weights=False, remat=m.remat, scan_layers=m.scan_layers,
                               loss_chunks=m.loss_chunks)
    except (HFConfigError, HFCheckpointError, HFFilesError) as e:
        raise ConfigError(f"model.hf={m.hf!r}: {e}") from None


def hf_mesh_problems(hf: Any, path: str, tensor: int) -> list[str]:
    """The checkpoint's sizes that ``mesh.tensor`` splits and does not divide (K/V heads fewer than it are
    replicated over it: :func:`jaxpar.parallel.tensor_rules`).

    Args:
      hf: the opened checkpoint.
      path: ``model.hf`` (for the message).
      tensor: the ``tensor`` axis's size.

    Returns:
      The problems (none when ``tensor`` is 1).
    """
    c = hf.config
    dims = [("vocab_size", c.vocab), ("num_attention_heads", c.heads), ("intermediate_size", c.mlp)] + ([("moe_intermediate_size", c.moe.mlp)] if c.moe else [])
    return [f"model.hf={path!r}: its {name}={size} is not divisible by mesh.tensor={tensor}, which splits it; "
            f"choose a mesh.tensor that divides it (e.g. mesh.tensor=1 and the devices on mesh.data)."
            for name, size in dims if size % tensor]


def hf_length_problems(hf: Any, path: str, seq_len: int) -> list[str]:
    """A ``model.seq_len`` beyond the checkpoint's ``max_position_embeddings`` (the longest sequence its
    positions were trained for); none when the config does not say.

    Args:
      hf: the opened checkpoint.
      path: ``model.hf`` (for the message).
      seq_len: ``model.seq_len``.

    Returns:
      The problems (at most one).
    """
    most = hf.hf_config.get("max_position_embeddings")
    if isinstance(most, int) and seq_len > most:
        return [f"model.seq_len={seq_len}: longer than model.hf={path!r}'s max_position_embeddings={most}, the "
                f"longest sequence its positions were trained for; use model.seq_len <= {most}."]
    return []


def build_tokenizer(d: DataConfig, hf: str | None, vocab: int, vocab_key: str):
    """The tokenizer of ``data.tokenizer``, checked against the model's vocabulary and ``data.bos`` / ``eos``.

    Args:
      d: the data section (``tokenizer`` set).
      hf: ``model.hf`` (for ``data.tokenizer: hf``).
      vocab: the model's vocabulary size.
      vocab_key: where that size comes from, for the message (``model.vocab``, ``model.hf's vocab_size``).

    Returns:
      The :class:`jaxpar.hf.Tokenizer`.

    Raises:
      ConfigError: no tokenizer there, more tokens than the model's vocabulary, or a BOS / EOS asked for
        that the tokenizer lacks; the message names ``data.tokenizer`` (or ``data.bos`` / ``data.eos``).
    """
    from jaxpar.data import load_tokenizer
    from jaxpar.errors import TokenizerError

    where = f"data.tokenizer={d.tokenizer!r}" + (f" (model.hf={hf!r})" if d.tokenizer == "hf" else "")
    try:
        tok = load_tokenizer(Path(hf if d.tokenizer == "hf" else d.tokenizer).expanduser())
    except TokenizerError as e:
        raise ConfigError(f"{where}: {e} Give a tokenizer.json, a SentencePiece .model or a tiktoken .tiktoken "
                          "file, or a directory holding one.") from None
    if tok.vocab_size > vocab:
        raise ConfigError(f"{where}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocabulary "
                          f"({vocab_key}={vocab}); its ids would be out of range. Use the model's own tokenizer"
                          + (" (data.tokenizer: hf)." if hf is not None else ", or a model.vocab that holds them."))
    for key, tid in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        if getattr(d, key) is True and tid is None:
            raise ConfigError(f"data.{key}=true: {where} has no {key.upper()} token (its tokenizer_config.json "
                              f"names no {key}_token); set data.{key}: false.")
    return tok
