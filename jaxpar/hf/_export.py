"""Writing a :class:`~jaxpar.models.Decoder`'s parameters as a Hugging Face checkpoint.

:func:`export` streams one file tensor at a time: each is assembled on the host from its
parameter's shards (cast to the checkpoint's dtype as each shard is copied in; with several
processes, gathered), rearranged back to the checkpoint's layout
(:func:`jaxpar.hf._boxes.file_tensor`) and written, so the host holds about one tensor at a time.
Files are cut at ``max_shard_bytes`` with ``model.safetensors.index.json`` beside them, as
``transformers`` writes them. From an imported checkpoint it keeps what the source had: its
``config.json``, its tokenizer and generation files, its expert layout, and ``lm_head.weight`` exactly
when the source stored it; an import followed by an export is byte-identical tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.devices._distributed import sync_processes
from jaxpar.models._decoder import DecoderConfig
from jaxpar.hf._boxes import file_tensor
from jaxpar.hf._reader import Checkpoint
from jaxpar.hf._config import decoder_config, hf_config_dict
from jaxpar.hf._files import DTYPES, INDEX, SAFETENSORS_DTYPE, write_safetensors
from jaxpar.hf._keys import stack_counts, tensor_maps
from jaxpar.errors import HFExportError

_OWN = ("config.json", INDEX)


@functools.lru_cache(maxsize=None)
def _take(n: int, mesh: Any, dtype: Any):
    """``a[i]`` cast to ``dtype``, replicated: every process gathers it."""
    return jax.jit(lambda a, *i: (a[i] if i else a).astype(dtype), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _element(array: Any, combo: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``array[combo]`` in ``dtype`` on the host. One process: assembled from the devices' shards one at
    a time, each cast as it is copied in (the host holds the result and one shard). Several processes:
    gathered (cast first) by every process."""
    mesh = getattr(getattr(array, "sharding", None), "mesh", None)
    if mesh is None or not isinstance(array, jax.Array):
        return np.asarray(array)[combo].astype(dtype)
    if not array.is_fully_addressable:
        out = _take(len(combo), mesh, np.dtype(dtype))(array, *(np.int32(c) for c in combo))
        return np.asarray(out.addressable_data(0))
    n, shape = len(combo), array.shape[len(combo):]
    out, done = np.empty(shape, dtype), set()
    for shard in array.addressable_shards:
        bounds = [s.indices(d)[:2] for s, d in zip(shard.index, array.shape)]
        if not all(a <= c < b for c, (a, b) in zip(combo, bounds)) or tuple(bounds[n:]) in done:
            continue
        done.add(tuple(bounds[n:]))
        local = np.asarray(shard.data[tuple(c - a for c, (a, _) in zip(combo, bounds))])
        out[tuple(slice(a, b) for a, b in bounds[n:])] = local
    return out


def _sources(params: Any, cfg: DecoderConfig, maps: dict) -> dict[str, list]:
    """``{file key: [(TensorMap, parameter, stacked index), ...]}`` in the maps' order."""
    flat, counts, out = traverse_util.flatten_dict(params), stack_counts(cfg), {}
    for path, m in maps.items():
        for key, combo in zip(m.keys(counts), itertools.product(*(range(counts[f]) for f in m.stack))):
            out.setdefault(key, []).append((m, flat[path], combo))
    return out


def _shards(entries: dict[str, tuple], max_bytes: int) -> list[dict[str, tuple]]:
    files, current, size = [], {}, 0
    for key, (shape, dtype) in entries.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if current and size + nbytes > max_bytes:
            files, current, size = files + [current], {}, 0
        current[key], size = (shape, dtype), size + nbytes
    return files + [current]


def _prepare(out: Path, overwrite: bool) -> None:
    """Refuse a file or a non-empty ``out`` (every process looks before any writes), then clear it (process 0)."""
    if out.exists() and not out.is_dir():
        raise HFExportError(f"export: {out} is a file, not a directory; name a new or empty directory (the "
                            "checkpoint is config.json and *.safetensors files written into it).")
    full = out.exists() and any(out.iterdir())
    if full and not overwrite:
        raise HFExportError(f"export: {out} is not empty; choose an empty or new directory, or pass "
                            "overwrite=True (jaxpar export --overwrite) to replace its checkpoint files.")
    sync_processes("jaxpar.hf.export")
    if jax.process_index() == 0:
        for f in list(out.glob("*.safetensors")) + [out / INDEX] if full else []:
            f.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)


def export(params: Any, out: str | Path, *, source: Checkpoint | None = None, config: DecoderConfig | None = None,
           family: str | None = None, dtype: str | None = None, max_shard_bytes: int = 5 * 2 ** 30,
           overwrite: bool = False) -> None:
    """Write ``params`` (a :class:`~jaxpar.models.Decoder`'s parameter dict, any layout) as a checkpoint.

    Args:
      params: the parameters (global ``jax.Array``s in any sharding, or host arrays).
      out: the directory to write.
      source: the imported checkpoint: its config, dtype, expert layout, head and files are kept.
      config, family: without ``source``, the model's config and ``model_type`` (``config.json`` is
        written from them).
      dtype: the tensors' dtype name (``"bfloat16"``, ``"float32"``); default: the source's, else fp32.
      max_shard_bytes: the largest safetensors file.
      overwrite: replace the checkpoint files of a non-empty ``out``.

    Raises:
      HFExportError: ``out`` is a file or is not empty (and not ``overwrite``), or neither ``source`` nor
        ``config`` and ``family`` are given.
    """
    if source is None and (config is None or family is None):
        raise HFExportError("export: give source= (the imported Checkpoint) or both config= and family=.")
    cfg = source.config if source is not None else config
    family = source.family if source is not None else family
    dtype = dtype or (source.dtype if source is not None else "float32")
    if dtype not in SAFETENSORS_DTYPE:
        raise HFExportError(f"export: dtype={dtype!r}; choose one of {sorted(SAFETENSORS_DTYPE)}.")
    if source is None:
        _check_family(cfg, family)
    out = Path(out)
    _prepare(out, overwrite)
    maps = source.maps if source is not None else tensor_maps(cfg, family)
    sources = _sources(params, cfg, maps)
    if source is not None and source.has_lm_head and cfg.tie_embeddings:
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
    order = [k for k in source.files.order if k in sources] if source is not None and source.has_weights else \
        sorted(sources)
    st = SAFETENSORS_DTYPE[dtype]
    entries = {k: (sources[k][0][0].file, st) for k in order}
    _write_files(out, entries, sources, max_shard_bytes, DTYPES[st])
    if jax.process_index() == 0:
        _write_config(out, source, cfg, family, dtype)


def _write_files(out: Path, entries: dict, sources: dict, max_bytes: int, np_dtype) -> None:
    shards, weight_map = _shards(entries, max_bytes), {}
    writer = jax.process_index() == 0
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = (file_tensor([(m, _element(a, c, np_dtype)) for m, a, c in sources[k]]) for k in shard)
        if writer:
            write_safetensors(out / name, shard, tensors)
        else:
            for _ in tensors:       # every process takes part in each gather
                pass
        weight_map.update({k: name for k in shard})
    if len(shards) > 1 and writer:
        total = sum(int(np.prod(s, dtype=np.int64)) * DTYPES[d].itemsize for s, d in entries.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _check_family(cfg: DecoderConfig, family: str) -> None:
    """The ``config.json`` written for ``family`` must read back as ``cfg``; else name what differs."""
    keep = {f: getattr(cfg, f) for f in ("remat", "scan_layers", "loss_chunks", "init_std")}
    back = decoder_config(hf_config_dict(cfg, family), **keep)
    differ = {f.name: (getattr(cfg, f.name), getattr(back, f.name)) for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != getattr(back, f.name)}
    if differ:
        raise HFExportError(f"export: model_type {family!r} cannot hold this config: {family!r} has "
                            + ", ".join(f"{k}={b!r} (the config has {a!r})" for k, (a, b) in differ.items())
                            + ". Export under the family the model was built for.")


def _write_config(out: Path, source: Checkpoint | None, cfg: DecoderConfig, family: str, dtype: str) -> None:
    if source is None:
        (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, family, dtype), indent=2, sort_keys=True))
        return
    for f in source.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _OWN:
            shutil.copy2(f, out / f.name)
    hf = dict(source.hf_config)
    if dtype != source.dtype:
        for name in ("dtype", "torch_dtype"):
            if name in hf or (name == "dtype" and "torch_dtype" not in hf):
                hf[name] = dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
