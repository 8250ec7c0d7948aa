"""Builders: config sections -> the library's own objects (``GPTConfig``, ``Strategy``, a ``Mesh``,
a model factory and its loss), and the registry of built-in models.

The library checks its own objects; their errors are relabelled here with the YAML keys
(``GPTConfig.heads`` -> ``model.heads``, ``Strategy.virtual_stages`` -> ``parallel.virtual_stages``).
The optimizer section is built by :mod:`jaxpar.config._optimizer_section`, the data section by
:mod:`jaxpar.config._data_section`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from flax import nnx

from jaxpar.mesh import MeshError, MeshSpec, make_mesh
from jaxpar.strategy import Strategy, option_types
from jaxpar.config._imports import resolve_import
from jaxpar.config._schema import GPT_KEYS, NOT_IN_YAML, ConfigError, MeshConfig, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class ModelEntry:
    """``build(model_cfg, seed) -> model_fn`` and ``loss() -> loss(model, batch)`` (imported lazily)."""

    build: Callable[[ModelConfig, int], Callable[[], nnx.Module]]
    loss: Callable[[], Callable]


def build_gpt_config(cfg: ModelConfig):
    """The GPT's config of the model section; its errors name ``model.*`` keys.

    Args:
      cfg: the ``model`` section.

    Returns:
      A :class:`jaxpar.models.GPTConfig` (with ``model.moe``'s settings, if any).
    """
    from jaxpar.models._gpt import GPTConfig   # the GPT is one example model: imported only when used
    from jaxpar.parallel.moe import MoEError

    plain = {key: getattr(cfg, key) for key in GPT_KEYS if key != "moe"}
    try:
        return GPTConfig(**plain, moe=build_moe(cfg.moe))
    except MoEError as e:
        raise ConfigError(str(e) if str(e).startswith("model.moe") else f"model.moe: {e}") from None
    except ValueError as e:
        raise ConfigError(relabel(e, "GPTConfig", "model", GPT_KEYS)) from None


def build_moe(options: Mapping[str, Any]):
    """The :class:`jaxpar.models.MoESettings` of ``model.moe`` (empty: ``None``, dense MLPs)."""
    if not options:
        return None
    from jaxpar.models._gpt_moe import MoESettings

    known = tuple(f.name for f in dataclasses.fields(MoESettings))
    unknown = sorted(set(options) - set(known))
    if unknown or "experts" not in options:
        raise ConfigError(f"model.moe={dict(options)!r}: " + (f"unknown keys {unknown}; " if unknown else "no 'experts'; ")
                          + f"it takes {', '.join(known)} (e.g. moe: {{experts: 8, top_k: 2}}).")
    return MoESettings(**options)


def gpt_model_fn(gpt: Any, seed: int) -> Callable[[], nnx.Module]:
    """The GPT's factory of a built ``GPTConfig`` (``gpt``), its parameters drawn from ``seed``."""
    from jaxpar.models._gpt import GPT

    return lambda: GPT(gpt, rngs=nnx.Rngs(seed))


def _build_gpt(cfg: ModelConfig, seed: int) -> Callable[[], nnx.Module]:
    return gpt_model_fn(build_gpt_config(cfg), seed)


def _gpt_loss() -> Callable:
    from jaxpar.models._gpt import lm_loss

    return lm_loss


MODELS: dict[str, ModelEntry] = {"gpt": ModelEntry(_build_gpt, _gpt_loss)}


def relabel(err: Exception, owner: str, section: str, fields: Sequence[str], fallback: str | None = None) -> str:
    """A library error's message in YAML keys.

    Args:
      err: the library's error.
      owner: the class its message names (``"GPTConfig"``).
      section: the YAML section (``"model"``).
      fields: the section's keys.
      fallback: the prefix when the message names no key of the section (default ``section``).

    Returns:
      The message with ``Owner.field`` and bare ``field=`` turned into ``section.field``.
    """
    msg = re.sub(rf"^{re.escape(owner)}:\s*", "", str(err))
    for f in sorted(fields, key=len, reverse=True):
        msg = re.sub(rf"(?<![\w.]){re.escape(owner)}\.{f}\b", f"{section}.{f}", msg)
        msg = re.sub(rf"(?<![\w.]){f}(?==)", f"{section}.{f}", msg)
    return msg if f"{section}." in msg else f"{fallback or section}: {msg}"


_MESH_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))
_PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig))


def mesh_spec(cfg: MeshConfig) -> MeshSpec:
    """The mesh section as a :class:`jaxpar.mesh.MeshSpec`.

    Args:
      cfg: the ``mesh`` section.

    Returns:
      The spec, unchecked.
    """
    return MeshSpec(**dataclasses.asdict(cfg))        # the same axes


def mesh_error(e: MeshError, cfg: MeshConfig) -> str:
    """A mesh error's message in ``mesh.*`` keys.

    Args:
      e: the error of :func:`jaxpar.mesh.make_mesh`.
      cfg: the ``mesh`` section (its sizes are named when the message names no key).

    Returns:
      The message.
    """
    given = ", ".join(f"mesh.{a}={getattr(cfg, a)}" for a in _MESH_AXES)
    return relabel(e, "MeshSpec", "mesh", _MESH_AXES, f"mesh ({given})")


def build_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None):
    """The device mesh of the mesh section.

    Args:
      cfg: the ``mesh`` section.
      devices: the devices to lay out (default: all of JAX's).

    Returns:
      A ``jax.sharding.Mesh``; its errors name ``mesh.*`` keys.
    """
    try:
        return make_mesh(mesh_spec(cfg), devices)
    except MeshError as e:
        raise ConfigError(mesh_error(e, cfg)) from None


def build_codec(options: Mapping[str, Any]):
    """The codec of ``parallel.compression`` (``{kind: ..., **options}``; empty: ``None``)."""
    if not options:
        return None
    from jaxpar.parallel.compression import CODECS, CompressionError, make_codec

    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    if "kind" not in opts:
        raise ConfigError(f"parallel.compression={dict(options)!r} has no 'kind'; write e.g. "
                          f"compression: {{kind: powersgd, rank: 4}} (kinds: {', '.join(CODECS)}).")
    try:
        return make_codec(opts.pop("kind"), **opts)
    except CompressionError as e:
        raise ConfigError(f"parallel.compression: {e}") from None


def build_sync(options: Mapping[str, Any]):
    """The kind of ``parallel.sync`` (``{kind: ..., **options}``; empty: ``None``)."""
    if not options:
        return None
    from jaxpar.parallel.sync import SyncError, make_sync

    opts = {k: tuple(map(tuple, v)) if k == "pattern" and v is not None else v for k, v in options.items()}
    try:      # make_sync names a missing or unknown kind
        return make_sync(opts)
    except (SyncError, TypeError) as e:
        raise ConfigError(f"parallel.sync: {e}") from None


def build_option(key: str, options: Mapping[str, Any]):
    """The option object of ``parallel.<key>`` (its class: :func:`jaxpar.strategy.option_types`), e.g.
    ``build_option("fp8", {"recipe": "rowwise"})``.

    Args:
      key: the strategy's field (``context``, ``fp8``, ``offload``).
      options: the YAML mapping (empty: ``None``).

    Returns:
      The object; an unknown key or the class's error is a :class:`ConfigError` naming ``parallel.<key>``
      (``Fp8.min_dim`` -> ``parallel.fp8.min_dim``).
    """
    if not options:
        return None
    cls = option_types()[key]
    allowed = [f.name for f in dataclasses.fields(cls)]
    if unknown := sorted(set(options) - set(allowed)):
        raise ConfigError(f"parallel.{key} has unknown keys {unknown}; it takes {cls.TAKES}.")
    try:
        return cls(**options)
    except ValueError as e:
        raise ConfigError(relabel(e, cls.__name__, f"parallel.{key}", allowed)) from None


def build_strategy(cfg: ParallelConfig) -> Strategy:
    """The strategy of the parallel section; its errors name ``parallel.*`` keys.

    Args:
      cfg: the ``parallel`` section (``compression.local_clip`` is the strategy's ``local_clip``,
        not a codec option).

    Returns:
      A :class:`jaxpar.Strategy` with its codec, sync kind and context parallelism.
    """
    options = dict(cfg.compression or {})
    local_clip = options.pop("local_clip", None)
    if local_clip is not None and not options:
        raise ConfigError(f"parallel.compression.local_clip={local_clip!r} clips each replica's gradient before a "
                          "codec, but parallel.compression names none; add one, e.g. compression: {kind: topk, "
                          "ratio: 0.01, local_clip: 1.0}, or use optimizer.clip_norm.")
    built = {"compression": build_codec(options), "sync": build_sync(cfg.sync),
             **{key: build_option(key, getattr(cfg, key)) for key in option_types()}}
    plain = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Strategy)
             if f.name not in NOT_IN_YAML and f.name not in built}
    try:
        return Strategy(**plain, **built, local_clip=local_clip)
    except ValueError as e:
        if str(e).startswith("Strategy.local_clip="):
            raise ConfigError(str(e).replace("Strategy.local_clip=", "parallel.compression.local_clip=", 1)) from None
        fallback = f"parallel.schedule={cfg.schedule!r}" if "schedule" in str(e) else "parallel"
        raise ConfigError(strategy_message(e, fallback)) from None


def strategy_message(err: Exception, fallback: str | None = None) -> str:
    """A library error that names :class:`~jaxpar.Strategy` fields, in ``parallel.*`` keys
    (``Strategy.fp8.min_dim=768`` -> ``parallel.fp8.min_dim=768``; :func:`relabel`).

    Args:
      err: the library's error (``StrategyError``, ``Fp8Error`` of :func:`jaxpar.make_train_step`, ...).
      fallback: the prefix when the message names no ``parallel`` key (default ``parallel``).

    Returns:
      The message.
    """
    return relabel(err, "Strategy", "parallel", _PARALLEL_KEYS, fallback)


def _build_user_model(cfg: ModelConfig, seed: int) -> Callable[[], nnx.Module]:
    target, kwargs = resolve_import(cfg.target, "model.target"), dict(cfg.kwargs)

    def model_fn() -> nnx.Module:
        try:
            model = target(**kwargs, rngs=nnx.Rngs(seed))
        except Exception as e:
            e.add_note(f"jaxpar: while building model.target={cfg.target!r} with model.kwargs={kwargs}")
            raise
        if not isinstance(model, nnx.Module):
            raise ConfigError(f"model.target={cfg.target!r} returned a {type(model).__name__}, not an nnx.Module; "
                              "name a flax.nnx.Module class or a function that returns one.")
        return model

    return model_fn


def build_model_fn(cfg: ModelConfig, seed: int = 0) -> Callable[[], nnx.Module]:
    """The model factory of the model section.

    Args:
      cfg: the ``model`` section.
      seed: the parameters' random seed (``train.seed``).

    Returns:
      A zero-argument factory for :func:`jaxpar.init_train_state`: the GPT, ``model.target`` called
      as ``target(**model.kwargs, rngs=nnx.Rngs(seed))``, or ``model.hf``'s decoder (random
      weights: the job loads the checkpoint's, :meth:`jaxpar.config.Job.init_state`).
    """
    if cfg.hf is not None:
        from jaxpar.config._hf_model import open_hf

        return open_hf(cfg).model_fn(seed)
    if cfg.target is not None:
        return _build_user_model(cfg, seed)
    return _registered(cfg).build(cfg, seed)


def build_loss_fn(cfg: ModelConfig) -> Callable:
    """The loss of the model section.

    Args:
      cfg: the ``model`` section.

    Returns:
      ``loss(model, batch) -> scalar``: ``model.loss`` for a user model,
      :func:`jaxpar.models.decoder_loss` for ``model.hf``, else the registry's.
    """
    if cfg.hf is not None:
        from jaxpar.models._decoder import decoder_loss

        return decoder_loss
    if cfg.target is not None:
        if cfg.loss is None:
            raise ConfigError(f"model.loss: missing; with model.target={cfg.target!r} name the loss function.")
        return resolve_import(cfg.loss, "model.loss")
    return _registered(cfg).loss()


def _registered(cfg: ModelConfig) -> ModelEntry:
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r}: unknown model; allowed: {', '.join(MODELS)}.")
    return MODELS[cfg.name]
