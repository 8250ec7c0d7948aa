"""The commands that read a run's config and then its weights or its data.

``jaxpar export`` and ``jaxpar sample`` take the run's weights: the latest good jaxpar checkpoint in
``checkpoint.dir`` (``--step N``: that one), restored onto the config's own mesh and layout as
``jaxpar train --resume`` restores it; before the run has one, ``model.hf``'s imported weights.
``export`` writes them as a Hugging Face checkpoint (:func:`jaxpar.hf.export`; it needs ``model.hf``);
``sample`` continues a prompt greedily (:func:`jaxpar.run.greedy_generate`), decoded by
``data.tokenizer``, else ``model.hf``'s tokenizer, else as bytes. Both say on stderr which weights they read.

``jaxpar check`` (:func:`run_check`) checks what ``jaxpar train`` would refuse before its first step: the
config on the devices train would find (or a ``--target``'s count), the data files, and the run directory.

``jaxpar data prepare`` tokenizes each text source of ``data.sources`` into ``data.cache``
(:func:`jaxpar.data._cache.prepare_cache`) and prints a summary and a length histogram;
``jaxpar data show`` builds the global batches ``A .. B-1`` exactly as ``jaxpar train`` would under
the config's mesh and prints each one's sha256 (:func:`jaxpar.data.batch_digest`), packing
efficiency and first row decoded: two meshes that print the same digests see the same data.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from jaxpar.config._profile_command import parse_steps
from jaxpar.config._schema import ConfigError, DataConfig


def refuse_cpu_only(devices: int, *, simulated: bool = False) -> None:
    """``train.devices=0`` (the accelerators JAX finds) where JAX found only CPU devices: a config written for
    GPUs, on a machine or a JAX without them. Refused before anything compiles (``simulated``:
    ``--local-devices`` asked for CPU devices).

    Raises:
      ConfigError: the backend is the CPU; the message says what JAX found and the two fixes.
    """
    import jax

    if devices != 0 or simulated or jax.default_backend() != "cpu":
        return
    n = jax.device_count()
    raise ConfigError(
        f"train.devices=0 trains on the GPUs or TPUs JAX finds, and this JAX found none: only {n} CPU "
        f"device{'s' if n > 1 else ''} (jax.default_backend()='cpu'). On a GPU host, install JAX for CUDA "
        "(pip install -U 'jax[cuda12]'; docs/gpu.md) and check with python -c 'import jax; print(jax.devices())'. "
        "To run on simulated CPU devices instead, set train.devices=N (e.g. train.devices=8) and a model that fits "
        "in host memory (jaxpar inspect CONFIG train.devices=8 shows its memory).")


def run_check(config: str, overrides: Sequence[str], *, target: str | None = None, resume: bool = False,
              overwrite: bool = False) -> int:
    """``jaxpar check``: what ``jaxpar train`` (with the same ``--resume`` / ``--overwrite``) would refuse, and then
    every check of :func:`~jaxpar.config._inspection.check_config`, nothing compiled.

    In order: the config; the devices train would find (``train.devices=0``: JAX's own, refused where they are
    CPU devices only: :func:`refuse_cpu_only`; ``target``: its count, simulated, after every refusal of ``jaxpar
    inspect --target`` before it compiles: :func:`~jaxpar.config._inspection.refuse_target`); the mesh on them; the
    data files (``data.paths``, ``data.sources``); the run directory (an earlier run in ``train.out_dir``, or with
    ``resume`` no complete checkpoint); then the train state's layout and step.

    Args:
      config: the YAML file.
      overrides: its ``key=value`` overrides.
      target: a GPU / TPU target (``h100:1x8``) whose device count the mesh is checked on.
      resume: check as ``jaxpar train --resume`` would run.
      overwrite: check as ``jaxpar train --overwrite`` would run (an earlier run would be moved aside).

    Returns:
      The exit status, 0 (a problem raises).

    Raises:
      ConfigError: a setting the config or the library refuses, or the devices; Fp8Error / TargetError: the
        target refuses the config (no FP8 GEMMs, a TPU chip grid of no whole hosts); DataError: a data file that
        is missing; RunDirectoryError / CheckpointError: what train refuses in the run directory.
    """
    import dataclasses

    import jax

    from jaxpar.config._checks import check
    from jaxpar.config._inspection import check_config, refuse_target
    from jaxpar.config._load import load_config

    cfg = load_config(config, [*overrides, *(["checkpoint.resume=true"] if resume else [])])
    if overwrite and cfg.checkpoint.resume:
        raise ConfigError("--overwrite starts a new run (the earlier one moved aside) and --resume "
                          "(checkpoint.resume=true) continues the earlier one; give one of them.")
    if target is not None:
        from jaxpar.devices._targets import parse_target

        tgt = parse_target(target)
        refuse_target(cfg, tgt)            # what jaxpar inspect --target refuses before it compiles
        found = f"{tgt.num_devices} devices of {tgt} (simulated CPU devices: the mesh, layout and step options)"
        devices = tgt.num_devices
    elif cfg.train.devices == 0:
        refuse_cpu_only(0)
        devices = jax.device_count()
        found = f"{devices} x {jax.devices()[0].device_kind} (train.devices=0: the devices JAX finds here)"
    else:
        devices, found = cfg.train.devices, None
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, devices=devices))
    check(cfg, num_devices=devices)
    files = check_inputs(cfg)
    run = _check_run_directory(cfg, overwrite)
    status = check_config(cfg)
    for line in (f"found    {found}" if found else "", files, run):
        if line:
            print(line)
    return status


def check_inputs(cfg: Any) -> str:
    """The files the config reads, checked before the run directory: ``model.hf``'s checkpoint (opened: its
    ``config.json`` and safetensors headers) and the data files (found, not read); a missing one raises.

    Args:
      cfg: the checked config.

    Returns:
      The data files found, in words (empty: the config names none).
    """
    from jaxpar.config._job import hf_checkpoint

    hf_checkpoint(cfg, None)
    return _check_data_files(cfg.data)


def _check_data_files(d: DataConfig) -> str:
    """The files of ``data.paths`` / ``data.sources`` found (none read), in words; a missing one raises."""
    from jaxpar.data._windows import expand_paths
    from jaxpar.data.sources import resolve_paths

    if d.kind in ("text", "tokens") and d.paths:
        return f"data     {len(expand_paths(d.paths))} file(s) of data.paths found (not read: jaxpar data show)"
    if d.kind == "documents" and d.sources:
        found = []
        for i, source in enumerate(d.sources):
            try:
                found += resolve_paths(source.get("path"))
            except Exception as e:      # SourceError: named by its key
                raise ConfigError(f"data.sources[{i}] (path {source.get('path')!r}): {e}") from None
        return f"data     {len(found)} path(s) of data.sources found (not read: jaxpar data show)"
    return ""


def _check_run_directory(cfg: Any, overwrite: bool) -> str:
    """What train would do with the run directory, in words; what it would refuse raises."""
    from jaxpar.errors import RunDirectoryError
    from jaxpar.run._checkpoint import no_checkpoint_error
    from jaxpar.run._run_directory import checkpoint_steps, earlier_run

    ck = cfg.checkpoint.dir if cfg.checkpoint.enabled else None
    if cfg.checkpoint.resume:
        if not (steps := checkpoint_steps(ck)):
            raise no_checkpoint_error(Path(ck).absolute(), [str(s) for s in checkpoint_steps(ck, complete=False)])
        return f"run      --resume continues from the checkpoint of step {steps[-1]} in {ck} (if it reads)"
    found = earlier_run(cfg.train.out_dir, ck)
    if found and not overwrite:
        raise RunDirectoryError(
            f"train.out_dir={cfg.train.out_dir!r} holds an earlier run ({found}): jaxpar train refuses a new run "
            "there. Continue it with --resume, start the new run elsewhere with train.out_dir=NEW_DIR, or pass "
            "--overwrite to move the earlier run aside (nothing is deleted).")
    return (f"run      --overwrite moves the earlier run in {cfg.train.out_dir} aside" if found else
            f"run      a new run in {cfg.train.out_dir}")


def _job(config: str, overrides: Sequence[str], command: str, dist: dict | None = None, *, data: bool = False):
    """``(cfg, job)`` of the run's config, on its devices (``dist``: the process options of ``jaxpar train``;
    ``data``: the data read too)."""
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
    start_processes(**{k: v for k, v in (dist or {}).items() if v is not None}, devices=cfg.train.devices)
    return cfg, build_job(cfg, data=data)


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
    from jaxpar.run._checkpoint import CheckpointError
    from jaxpar.run._sample import host_params

    layout = job.state_layout()
    directory = Path(job.checkpoint["directory"]) if job.checkpoint is not None else None
    if directory is not None and directory.is_dir():
        ckpt = job.checkpointer(layout)
        try:
            if step is not None or ckpt.latest_step() is not None:
                state = (restored := ckpt.restore(layout, step)).state
                return RunWeights(state.params, layout, _checkpoint_words(restored, ckpt.directory),
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
    from jaxpar.run._sample import greedy_generate
    from jaxpar.step._state import use_parts

    cfg, job = _job(config, overrides, "sample")
    encode, decode, tok = _sample_codec(cfg, job)
    ids = encode(prompt)
    if not ids:
        raise ConfigError(f"jaxpar sample: --prompt {prompt!r} encodes to no token (the tokenizer knows none of its "
                          "characters); give text in the tokenizer's alphabet.")
    new = cfg.logging.sample_tokens if tokens is None else tokens      # greedy_generate checks it
    w = run_weights(job, step)
    saved = (w.record or {}).get("tokenizer")
    if tok is not None and saved is not None:         # the ids the run trained with, or a named error
        check_tokenizer(saved["fingerprint"], tok, saved["vocab_size"])
    with use_parts(w.layout, w.stats):
        most = job.hf.hf_config.get("max_position_embeddings") if job.hf is not None else None
        out = greedy_generate(w.layout.graphdef, w.params, [ids], new_tokens=new, context=cfg.model.seq_len,
                              max_positions=most)[0]
    print(f"sample   {len(ids)} prompt tokens + {new} greedy tokens from {w.where}", file=sys.stderr)
    print(decode(out))
    return 0


def run_prepare(config: str, overrides: Sequence[str], *, force: bool = False) -> int:
    """``jaxpar data prepare``: each text source's token cache, then the summary and the histogram.

    Args:
      config: the YAML config file.
      overrides: dotted ``key=value`` overrides.
      force: tokenize again even where a cache is up to date.

    Returns:
      The exit status (0).
    """
    from jaxpar.config._job import build_job
    from jaxpar.config._load import load_config

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
    from jaxpar.data import DataError
    from jaxpar.data._cache import expected_meta, open_cache, prepare_cache
    from jaxpar.config._documents import open_source_of, source_cache_dir, source_error

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.geomspace(1, max(2, int(lengths.max())) + 1, 50)
    ax.hist(np.maximum(lengths, 1), bins=bins)
    ax.set(xscale="log", xlabel="tokens per document", ylabel="documents",
           title=f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens")
    if seq_len:
        ax.axvline(seq_len, color="k", linestyle="--", label=f"seq_len {seq_len}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
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
    import jax

    from jaxpar.data import batch_digest, make_global_batch

    span = range(*parse_steps(steps))
    cfg, job = _job(config, overrides, "data show", dist, data=True)
    say = print if jax.process_index() == 0 else (lambda *_: None)
    say(f"mesh     {dict(job.mesh.shape)}, {jax.process_count()} process(es); data.kind={cfg.data.kind}, "
        f"seed {cfg.data.seed}")
    for step in span:
        batch = {k: _gather(v) for k, v in make_global_batch(job.batch_fn, step, job.mesh).items()}
        used = float((batch["segment_ids"] > 0).mean()) if "segment_ids" in batch else 1.0
        row = _decode(job.tokenizer, batch["tokens"][0], batch["segment_ids"][0] if "segment_ids" in batch else None)
        say(f"step {step:>6}  sha256 {batch_digest(batch)}  rows {len(batch['tokens'])}  packing {used:.2%}")
        say(f"             row 0: {row[:chars]!r}")
    if hasattr(job.batch_fn, "close"):
        job.batch_fn.close()
    return 0


def _gather(value: Any) -> np.ndarray:
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _decode(tokenizer: Any, tokens: np.ndarray, segments: np.ndarray | None) -> str:
    ids = tokens[segments > 0] if segments is not None else tokens
    if tokenizer is None:
        return bytes(int(t) % 256 for t in ids).decode("utf-8", "replace")
    return tokenizer.decode([int(t) for t in ids])
