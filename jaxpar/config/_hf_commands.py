"""``jaxpar export`` and ``jaxpar sample``: a run's weights written as a Hugging Face checkpoint, or
continuing a prompt.

Both take the run's config (the same file and overrides as ``jaxpar train``, or the run's own
``<train.out_dir>/config.yaml``) and its weights: the latest good jaxpar checkpoint in
``checkpoint.dir`` (``--step N``: that one), restored onto the config's own mesh and layout as
``jaxpar train --resume`` restores it (a run checkpointed under any strategy); before the run has
a checkpoint, ``model.hf``'s imported weights themselves.

Usage::

    jaxpar export CONFIG [key=value ...] --hf OUT [--step N] [--overwrite] [--dtype bfloat16|float32]
    jaxpar sample CONFIG [key=value ...] --prompt TEXT [--tokens N] [--step N]

``export`` writes ``OUT`` with :func:`jaxpar.hf.export` from the imported checkpoint (its config,
tokenizer and generation files kept; ``--dtype``: the tensors' dtype, default the source's); it
needs ``model.hf``. ``sample`` continues the prompt greedily (:func:`jaxpar.run.greedy_generate`,
a window of ``model.seq_len`` tokens) and prints the text, decoded by ``data.tokenizer`` or else
``model.hf``'s tokenizer (a byte-level GPT: bytes). Both say on stderr which weights they read: the
checkpoint's step, directory and save time, or the imported checkpoint's directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from jaxpar.config._schema import ConfigError


def add_parsers(sub: Any) -> None:
    """Add the ``export`` and ``sample`` subcommands to the ``jaxpar`` parser's subparsers ``sub``.

    Args:
      sub: the subparsers of the ``jaxpar`` parser.
    """
    p = sub.add_parser("export", help="write a run's weights as a Hugging Face checkpoint (model.hf)",
                       description="Restore CONFIG's run (its latest jaxpar checkpoint, or --step N; before any, "
                                   "model.hf's imported weights) and write them as a Hugging Face checkpoint.")
    p.add_argument("config", help="the run's YAML config (or <train.out_dir>/config.yaml)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, as for train")
    p.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    p.add_argument("--step", type=int, metavar="N", help="the jaxpar checkpoint of step N (default: the latest)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files of a non-empty OUT")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="the tensors' dtype (default: the source's)")
    p = sub.add_parser("sample", help="continue a prompt greedily with a run's weights",
                       description="Greedy continuation of --prompt by CONFIG's run (its latest checkpoint, or "
                                   "--step N; before any, model.hf's imported weights), decoded and printed.")
    p.add_argument("config", help="the run's YAML config (or <train.out_dir>/config.yaml)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, as for train")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, metavar="N", help="new tokens (default: logging.sample_tokens)")
    p.add_argument("--step", type=int, metavar="N", help="the jaxpar checkpoint of step N (default: the latest)")


def run_command(args: argparse.Namespace) -> int:
    """``jaxpar export`` / ``jaxpar sample`` from their parsed arguments; returns the exit status.

    Args:
      args: the parsed arguments (``command``: ``export`` or ``sample``).

    Returns:
      The exit status.
    """
    if args.command == "export":
        return run_export(args.config, args.overrides, args.hf, step=args.step, overwrite=args.overwrite,
                          dtype=args.dtype)
    return run_sample(args.config, args.overrides, args.prompt, tokens=args.tokens, step=args.step)


def _job(config: str, overrides: Sequence[str], command: str):
    """``(cfg, job)`` of the run's config, on its devices (the data is not read)."""
    from jaxpar.devices._distributed import start_processes
    from jaxpar.config._job import build_job
    from jaxpar.config._load import load_config

    cfg = load_config(config, list(overrides))
    if command == "export" and cfg.model.hf is None:
        raise ConfigError("jaxpar export: model.hf is not set; export writes a Hugging Face checkpoint of a model "
                          "imported from one (model.hf: its directory). jaxpar's GPT and models of your own "
                          "(model.target) have no Hugging Face layout to write.")
    if command == "sample" and cfg.model.target is not None:
        raise ConfigError(f"jaxpar sample: model.target={cfg.model.target!r} is a model of your own, whose inputs "
                          "and outputs jaxpar does not know; sample continues text with jaxpar's GPT or model.hf.")
    start_processes(devices=cfg.train.devices)
    return cfg, build_job(cfg, data=False)


class RunWeights(NamedTuple):
    """A run's weights (:func:`run_weights`): ``params`` in ``layout``, ``where`` they came from (in
    words), and the MoE ``router_bias`` its state keeps (on the host; None: none)."""

    params: Any
    layout: Any
    where: str
    router_bias: Any = None
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
    from jaxpar.run._checkpoint import CheckpointError
    from jaxpar.step._router_bias import bias_of
    from jaxpar.run._sample import host_params

    layout = job.state_layout()
    directory = Path(job.checkpoint["directory"]) if job.checkpoint is not None else None
    if directory is not None and directory.is_dir():
        ckpt = job.checkpointer(layout)
        try:
            if step is not None or ckpt.latest_step() is not None:
                state = (restored := ckpt.restore(layout, step)).state
                bias = None if (b := bias_of(state, layout)) is None else host_params(b)
                return RunWeights(state.params, layout, _checkpoint_words(restored, ckpt.directory), bias,
                                  restored.meta)
        finally:
            ckpt.close()
    if job.hf is None or step is not None:
        which = f" of step {step}" if step is not None else ""
        where = f"in {directory}" if directory is not None else "(checkpoint.enabled=false)"
        raise CheckpointError(f"no jaxpar checkpoint{which} {where}; train first (jaxpar train), or point "
                              "checkpoint.dir at the run's checkpoints.")
    where = f"the imported weights of model.hf={str(job.hf.path)!r} (no jaxpar checkpoint yet)"
    return RunWeights(job.imported_params(layout), layout, where)


def _checkpoint_words(restored: Any, directory: Path) -> str:
    """``step N of DIR (saved YYYY-MM-DD HH:MM:SS)``: which run's checkpoint was read."""
    import time

    saved = restored.meta.get("time")
    when = f" (saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved))})" if saved else ""
    return f"step {restored.step} of {directory}{when}"


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
    _, job = _job(config, overrides, "export")
    weights = run_weights(job, step)
    print(f"export   {weights.where} -> {target} ({dtype or job.hf.dtype})", file=sys.stderr)
    export(weights.params, target, source=job.hf, dtype=dtype, overwrite=overwrite)
    return 0


def _sample_codec(cfg: Any, job: Any):
    """``(encode, decode, tokenizer)`` of the run's text: ``data.tokenizer``'s, ``model.hf``'s tokenizer, or bytes
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
        return encode, tok.decode, tok
    if cfg.data.kind != "text":
        raise ConfigError(f"jaxpar sample: data.kind={cfg.data.kind!r} with no tokenizer: the run's tokens have no "
                          "text; set data.tokenizer (a tokenizer's directory) to decode them.")
    return (lambda text: list(text.encode())), (lambda ids: bytes(v & 0xFF for v in ids).decode("utf-8", "replace")), None


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
      ConfigError: the config is invalid, the prompt encodes to no token, or the run's tokens have no text.
    """
    from jaxpar.data import check_tokenizer
    from jaxpar.parallel.moe import use_router_bias
    from jaxpar.run._sample import greedy_generate

    cfg, job = _job(config, overrides, "sample")
    encode, decode, tok = _sample_codec(cfg, job)
    ids = encode(prompt)
    if not ids:
        raise ConfigError(f"jaxpar sample: --prompt {prompt!r} encodes to no token (the tokenizer knows none of its "
                          "characters); give text in the tokenizer's alphabet.")
    new = cfg.logging.sample_tokens if tokens is None else tokens
    if new < 0:
        raise ConfigError(f"jaxpar sample: --tokens {new}: must be >= 0.")
    w = run_weights(job, step)
    saved = (w.record or {}).get("tokenizer")
    if tok is not None and saved is not None:         # the ids the run trained with, or a named error
        check_tokenizer(saved["fingerprint"], tok, saved["vocab_size"])
    with use_router_bias(w.router_bias):
        most = job.hf.hf_config.get("max_position_embeddings") if job.hf is not None else None
        out = greedy_generate(w.layout.graphdef, w.params, [ids], new_tokens=new, context=cfg.model.seq_len,
                              max_positions=most)[0]
    print(f"sample   {len(ids)} prompt tokens + {new} greedy tokens from {w.where}", file=sys.stderr)
    print(decode(out))
    return 0
