"""A Hugging Face checkpoint opened for import: its config, its tensors checked, its weights read
straight into any layout, and the train state that starts from them (:func:`train_state`).

:func:`open_checkpoint` reads ``config.json`` and the safetensors headers only, and checks every key
and shape against the model before anything is compiled. :meth:`Checkpoint.load` then builds each
parameter as a global ``jax.Array`` in the given shardings: every distinct box of it that this
process's devices hold is read from the files once (only those bytes: a process never reads
another's shards, and no host holds the whole model), cast to the parameter dtype on the host and
placed on its devices.

Example (a checkpoint written by :func:`jaxpar.hf.export` from random weights)::

    >>> import jax, optax, tempfile
    >>> from flax import nnx
    >>> import jaxpar
    >>> from jaxpar.hf import export, open_checkpoint
    >>> from jaxpar.models import Decoder, DecoderConfig
    >>> cfg = DecoderConfig(vocab=11, embed=8, layers=2, heads=2, kv_heads=1, head_dim=4, mlp=12)
    >>> with nnx.use_eager_sharding(False):
    ...     params = nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    >>> out = tempfile.mkdtemp() + "/ckpt"
    >>> export(params, out, config=cfg, family="llama")
    >>> ckpt = open_checkpoint(out)
    >>> mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
    >>> layout = jaxpar.state_layout(ckpt.model_fn(), optax.adamw(1e-3), mesh, jaxpar.Strategy(zero=3))
    >>> loaded = ckpt.load(mesh, layout.params)
    >>> loaded["layers"]["wq"].sharding.spec, bool((loaded["layers"]["wq"] == params["layers"]["wq"]).all())
    (P(None, 'tensor', None, ('fsdp', 'data')), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import NamedSharding

from jaxpar.models._decoder import Decoder, DecoderConfig
from jaxpar.step._init import init_train_state, state_layout
from jaxpar.strategy import Strategy
from jaxpar.hf._boxes import read_box
from jaxpar.hf._config import decoder_config, read_config
from jaxpar.hf._files import INDEX, CheckpointFiles
from jaxpar.hf._keys import TensorMap, stack_counts, tensor_maps
from jaxpar.errors import HFCheckpointError


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: ``path``, the raw ``hf_config`` dict, the model's ``config``, its
    ``family`` (``model_type``), ``dtype`` (its tensors' dtype name), ``experts_layout``,
    ``has_lm_head`` (``lm_head.weight`` is stored, also when tied), the parameter ``maps`` and ``files``
    (None: a directory with ``config.json`` only, opened with ``require_weights=False``: the model's
    shape, no weights)."""

    path: Path
    hf_config: dict
    config: DecoderConfig
    family: str
    dtype: str
    experts_layout: str
    has_lm_head: bool
    maps: dict
    files: CheckpointFiles | None

    @property
    def has_weights(self) -> bool:
        """Whether the directory has the safetensors files (:meth:`load` reads them)."""
        return self.files is not None

    def model_fn(self, seed: int = 0) -> Callable[[], Decoder]:
        """``() -> Decoder`` of this config (random weights), for :func:`jaxpar.state_layout` /
        :func:`jaxpar.init_train_state`; :meth:`load` supplies the checkpoint's weights.

        Args:
          seed: the seed of the random weights.

        Returns:
          The model factory.
        """
        cfg = self.config
        return lambda: Decoder(cfg, rngs=nnx.Rngs(seed))

    def load(self, mesh, specs: Any, dtype: Any = np.float32) -> Any:
        """The parameters as global arrays, each in ``NamedSharding(mesh, spec)``.

        Args:
          mesh: the device mesh.
          specs: a ``PartitionSpec`` tree mirroring the parameters (``layout.params``).
          dtype: the parameters' dtype (the master weights: fp32).

        Returns:
          The parameter dict, as ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` has it.

        Raises:
          HFCheckpointError: the directory has no weights (``config.json`` only).
        """
        if self.files is None:
            raise HFCheckpointError(f"{self.path}: config.json only, no *.safetensors file: there are no weights to "
                                    "read. Download the checkpoint's safetensors files into it, or start from random "
                                    "weights (jaxpar train does, for a directory with config.json only).")
        flat = {}
        for path, spec in traverse_util.flatten_dict(specs).items():
            m = self.maps[path]
            shape = tuple(stack_counts(self.config)[f] for f in m.stack) + _element_shape(m)
            flat[path] = _global_array(self.files, m, shape, NamedSharding(mesh, spec), dtype)
        return traverse_util.unflatten_dict(flat)


def _element_shape(m: TensorMap) -> tuple[int, ...]:
    view = m.view or m.taken
    return tuple(view[a] for a in m.perm) if m.perm else tuple(view)


def _global_array(files: CheckpointFiles, m: TensorMap, shape, sharding, dtype) -> jax.Array:
    """Read each distinct box once, cast it, put it on the devices that hold it, and let it go."""
    boxes: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        boxes.setdefault(tuple((s.start, s.stop) for s in box), []).append(device)
    arrays = {}
    for bounds, devices in boxes.items():
        host = read_box(files, m, tuple(slice(a, b) for a, b in bounds), dtype)
        for device in devices:
            arrays[device] = jax.device_put(host, device)
        del host
    ordered = [arrays[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def _check_tensors(files: CheckpointFiles, cfg: DecoderConfig, maps: dict, path: Path) -> None:
    """Every expected key present with its shape, no unexpected one; raises naming them."""
    counts, expected = stack_counts(cfg), {}
    for m in maps.values():
        for key in m.keys(counts):
            expected[key] = m.file
    missing = sorted(set(expected) - set(files.where))
    unexpected = sorted(set(files.where) - set(expected) - {"lm_head.weight"})
    if missing or unexpected:
        raise HFCheckpointError(
            f"{path}: the tensors do not match config.json: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)}).")
    for key, shape in expected.items():
        if files.shape(key) != tuple(shape):
            raise HFCheckpointError(f"{path}: tensor {key!r} has shape {list(files.shape(key))}; config.json implies "
                                    f"{list(shape)}.")


def _check_head(files: CheckpointFiles, cfg: DecoderConfig, path: Path) -> None:
    """``tie_word_embeddings`` against ``lm_head.weight``: a tied model may store the head only as a
    copy of the embedding (its first row is compared); an untied one must store it."""
    has = "lm_head.weight" in files.where
    if not cfg.tie_embeddings and not has:
        raise HFCheckpointError(f"{path}: tie_word_embeddings is false (or absent: the architecture's default) but the "
                                "checkpoint has no lm_head.weight. Set tie_word_embeddings: true in config.json if "
                                "the head is the embedding.")
    if cfg.tie_embeddings and has:
        if files.shape("lm_head.weight") != files.shape("model.embed_tokens.weight") or not np.array_equal(
                files.read("lm_head.weight", (slice(0, 1),)), files.read("model.embed_tokens.weight", (slice(0, 1),))):
            raise HFCheckpointError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                                    "model.embed_tokens.weight. Set tie_word_embeddings: false to use the stored head.")


def open_checkpoint(path: str | Path, *, require_weights: bool = True, **overrides: Any) -> Checkpoint:
    """Open a Hugging Face checkpoint directory for import, checking it against its config.

    Args:
      path: the directory (``config.json``, ``*.safetensors``, optionally the index).
      require_weights: False accepts a directory with ``config.json`` only (no safetensors file nor index):
        the model's shape without weights (``Checkpoint.files`` None), for planning and compiling.
      **overrides: :class:`~jaxpar.models.DecoderConfig` fields to set (``remat``, ``scan_layers``).

    Returns:
      The :class:`Checkpoint`; no tensor is read yet beyond the headers.

    Raises:
      HFConfigError: ``config.json`` is missing, unsupported or incomplete.
      HFFilesError: the safetensors files are missing (with ``require_weights``) or inconsistent.
      HFCheckpointError: missing / unexpected keys or shapes (named), or a head that disagrees with
        ``tie_word_embeddings``.
    """
    path = Path(path)
    hf = read_config(path)
    cfg = decoder_config(hf, **overrides)
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")     # the Hub's name, or transformers 5's
    if not require_weights and not has_weight_files(path):
        return Checkpoint(path, hf, cfg, hf["model_type"], dtype, "per_expert", False,
                          tensor_maps(cfg, hf["model_type"], "per_expert"), None)
    files = CheckpointFiles(path)
    layout = "fused" if any(k.endswith("mlp.experts.gate_up_proj") for k in files.where) else "per_expert"
    maps = tensor_maps(cfg, hf["model_type"], layout)
    _check_head(files, cfg, path)
    _check_tensors(files, cfg, maps, path)
    return Checkpoint(path, hf, cfg, hf["model_type"], dtype, layout,
                      "lm_head.weight" in files.where, maps, files)


def has_weight_files(path: str | Path) -> bool:
    """Whether a checkpoint directory has weights: a safetensors file or index (their contents unchecked).

    Args:
      path: the directory.

    Returns:
      True when it holds ``*.safetensors`` or ``model.safetensors.index.json``.
    """
    path = Path(path)
    return (path / INDEX).is_file() or any(path.glob("*.safetensors"))


def load(checkpoint: str | Path | Checkpoint, layout: Any) -> Any:
    """The checkpoint's parameters in ``layout``'s shardings (a :class:`~jaxpar.StateLayout`).

    Args:
      checkpoint: a checkpoint directory, or an opened :class:`Checkpoint`.
      layout: the state's layout (:func:`jaxpar.state_layout`).

    Returns:
      The parameter dict, each array in ``NamedSharding(layout.mesh, spec)``.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    return ckpt.load(layout.mesh, layout.params)


def train_state(path: str | Path, tx: Any, mesh: Any, strategy: Strategy = Strategy(), *, seed: int = 0,
                **overrides: Any) -> tuple[Any, Any, Checkpoint]:
    """The train state of the checkpoint's model under ``strategy`` on ``mesh``, starting from its weights.

    Args:
      path: the checkpoint directory.
      tx: the optax optimizer (its state starts fresh).
      mesh: the device mesh.
      strategy: what to do with the mesh axes.
      seed: the seed of the model's random initialisation (only traced: every weight comes from the files).
      **overrides: :class:`~jaxpar.models.DecoderConfig` fields (``remat``, ``scan_layers``).

    Returns:
      ``(state, layout, checkpoint)``: as :func:`jaxpar.init_train_state`, and the opened checkpoint
      (for :func:`jaxpar.hf.export` and the tokenizer).

    Example:
      >>> import jax, optax, tempfile
      >>> from flax import nnx
      >>> import jaxpar
      >>> from jaxpar.hf import export, train_state
      >>> from jaxpar.models import Decoder, DecoderConfig, decoder_loss
      >>> cfg = DecoderConfig(vocab=16, embed=8, layers=2, heads=2, kv_heads=1, head_dim=4, mlp=12, qk_norm=True)
      >>> with nnx.use_eager_sharding(False):
      ...     params = nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param))
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> export(params, path, config=cfg, family="qwen3")
      >>> mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
      >>> tx = optax.adamw(1e-3)
      >>> state, layout, ckpt = train_state(path, tx, mesh, jaxpar.Strategy(zero=3))
      >>> step = jaxpar.make_train_step(decoder_loss, tx, layout)
      >>> batch = {"tokens": jax.numpy.zeros((4, 8), "int32"), "targets": jax.numpy.ones((4, 8), "int32")}
      >>> state, metrics = step(state, jaxpar.shard_batch(batch, mesh))
      >>> int(state.step), ckpt.family
      (1, 'qwen3')
    """
    ckpt = open_checkpoint(path, **overrides)
    layout = state_layout(ckpt.model_fn(seed), tx, mesh, strategy)
    state, layout = init_train_state(ckpt.model_fn(seed), tx, mesh, strategy, params=load(ckpt, layout))
    return state, layout, ckpt
