"""Builders: config sections -> the library's own objects (``GPTConfig``, ``Strategy``, a ``Mesh``,
an optax optimizer and learning-rate schedule, a model factory and its loss), and the registries
of built-in models and optimizers.

The library checks its own objects; their errors are relabelled here with the YAML keys
(``GPTConfig.heads`` -> ``model.heads``, ``Strategy.virtual_stages`` -> ``parallel.virtual_stages``).
The data section is built by :mod:`jaxpar.config.data_section`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import optax
from flax import nnx

from jaxpar import optimizers as opt_lib
from jaxpar.mesh import MeshError, MeshSpec, make_mesh
from jaxpar.strategy import Strategy
from jaxpar.config.imports import resolve_import
from jaxpar.config.schema import GPT_KEYS, ConfigError, LRScalingConfig, MeshConfig, ModelConfig, OptimizerConfig, ParallelConfig

__all__ = [
    "ModelEntry", "MODELS", "OPTIMIZERS", "build_gpt_config", "build_mesh", "build_strategy", "build_lr_schedule",
    "peak_lr", "lr_scaling_problems", "build_trust_mask", "build_optimizer", "build_model_fn", "build_loss_fn",
    "relabel", "mesh_spec", "mesh_error",
]


@dataclass(frozen=True)
class ModelEntry:
    """``build(model_cfg, seed) -> model_fn`` and ``loss() -> loss(model, batch)`` (imported lazily)."""

    build: Callable[[ModelConfig, int], Callable[[], nnx.Module]]
    loss: Callable[[], Callable]


def build_gpt_config(cfg: ModelConfig):
    """The :class:`jaxpar.models.gpt.GPTConfig` of the model section; its errors name ``model.*`` keys."""
    from jaxpar.models.gpt import GPTConfig   # the GPT is one example model: imported only when used
    from jaxpar.parallel.moe import MoEError

    moe = build_moe(cfg.moe)
    try:
        return GPTConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, embed=cfg.embed, heads=cfg.heads, layers=cfg.layers,
                         mlp=cfg.mlp, remat=cfg.remat, scan_layers=cfg.scan_layers, init_std=cfg.init_std, moe=moe)
    except MoEError as e:
        raise ConfigError(str(e) if str(e).startswith("model.moe") else f"model.moe: {e}") from None
    except ValueError as e:
        raise ConfigError(relabel(e, "GPTConfig", "model", GPT_KEYS)) from None


def build_moe(options: Mapping[str, Any]):
    """The :class:`jaxpar.models.gpt_moe.MoESettings` of ``model.moe`` (empty: ``None``, dense MLPs)."""
    if not options:
        return None
    from jaxpar.models.gpt_moe import MoESettings

    known = tuple(f.name for f in dataclasses.fields(MoESettings))
    unknown = sorted(set(options) - set(known))
    if unknown or "experts" not in options:
        raise ConfigError(f"model.moe={dict(options)!r}: " + (f"unknown keys {unknown}; " if unknown else "no 'experts'; ")
                          + f"it takes {', '.join(known)} (e.g. moe: {{experts: 8, top_k: 2}}).")
    return MoESettings(**options)


def _build_gpt(cfg: ModelConfig, seed: int) -> Callable[[], nnx.Module]:
    from jaxpar.models.gpt import GPT

    gpt_cfg = build_gpt_config(cfg)
    return lambda: GPT(gpt_cfg, rngs=nnx.Rngs(seed))


def _gpt_loss() -> Callable:
    from jaxpar.models.gpt import lm_loss

    return lm_loss


def _adamw(c: OptimizerConfig, lr, **_):
    return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _adam(c: OptimizerConfig, lr, **_):
    return optax.adam(lr, b1=c.b1, b2=c.b2, eps=c.eps)


def _sgd(c: OptimizerConfig, lr, **_):
    return optax.sgd(lr, momentum=c.momentum or None)


def _lars(c: OptimizerConfig, lr, *, logical=None, mask=None):
    return opt_lib.lars(lr, weight_decay=c.weight_decay, momentum=c.momentum, trust_coefficient=c.trust_coefficient,
                        eps=c.eps, logical=logical, mask=mask)


def _lamb(c: OptimizerConfig, lr, *, logical=None, mask=None):
    return opt_lib.lamb(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, logical=logical, mask=mask)


MODELS: dict[str, ModelEntry] = {"gpt": ModelEntry(_build_gpt, _gpt_loss)}
#: ``name -> fn(cfg, lr, *, logical=None, mask=None) -> optax.GradientTransformation`` (``logical``:
#: the params' logical names; ``mask``: :func:`jaxpar.optimizers.trust_mask`'s tree; both for lars / lamb).
OPTIMIZERS: dict[str, Callable] = {"adamw": _adamw, "adam": _adam, "sgd": _sgd, "lars": _lars, "lamb": _lamb}
#: Optimizers that apply ``weight_decay`` themselves (the others get ``add_decayed_weights`` in front).
_OWN_DECAY = ("adamw", "lars", "lamb")


def relabel(err: Exception, owner: str, section: str, fields: Sequence[str], fallback: str | None = None) -> str:
    """The library's message with ``Owner.field`` and bare ``field=`` turned into ``section.field``;
    prefixed with ``fallback`` (default ``section``) when it names no key of the section."""
    msg = re.sub(rf"^{re.escape(owner)}:\s*", "", str(err))
    for f in sorted(fields, key=len, reverse=True):
        msg = re.sub(rf"(?<![\w.]){re.escape(owner)}\.{f}\b", f"{section}.{f}", msg)
        msg = re.sub(rf"(?<![\w.]){f}(?==)", f"{section}.{f}", msg)
    return msg if f"{section}." in msg else f"{fallback or section}: {msg}"


_MESH_AXES = ("data", "fsdp", "tensor", "pipe", "replica", "context", "expert")
_PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ParallelConfig))


def mesh_spec(cfg: MeshConfig) -> MeshSpec:
    return MeshSpec(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor, pipe=cfg.pipe, replica=cfg.replica,
                    context=cfg.context, expert=cfg.expert)


def mesh_error(e: MeshError, cfg: MeshConfig) -> str:
    given = ", ".join(f"mesh.{a}={getattr(cfg, a)}" for a in _MESH_AXES)
    return relabel(e, "MeshSpec", "mesh", _MESH_AXES, f"mesh ({given})")


def build_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None):
    """``jax.sharding.Mesh`` from the mesh section (``devices``: default all)."""
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
    from jaxpar.parallel.sync import SYNC_KINDS, SyncError, make_sync

    opts = {k: tuple(map(tuple, v)) if k == "pattern" and v is not None else v for k, v in options.items()}
    if "kind" not in opts:
        raise ConfigError(f"parallel.sync={dict(options)!r} has no 'kind'; write e.g. sync: {{kind: diloco, every: "
                          f"50}} (kinds: {', '.join(SYNC_KINDS)}).")
    try:
        return make_sync(opts)
    except (SyncError, TypeError) as e:
        raise ConfigError(f"parallel.sync: {e}") from None


def build_context(options: Mapping[str, Any]):
    """The :class:`jaxpar.parallel.context.ContextParallel` of ``parallel.context`` (empty: ``None``)."""
    if not options:
        return None
    from jaxpar.parallel.context import ContextParallel, ContextParallelError

    unknown = sorted(set(options) - {"method", "balance"})
    if unknown:
        raise ConfigError(f"parallel.context has unknown keys {unknown}; it takes method (ring | all_gather | "
                          "ulysses) and balance (true | false).")
    try:
        return ContextParallel(**options)
    except ContextParallelError as e:
        raise ConfigError(f"parallel.context: {e}".replace("ContextParallel.", "")) from None


def build_strategy(cfg: ParallelConfig) -> Strategy:
    """The :class:`jaxpar.Strategy` of the parallel section; its errors name ``parallel.*`` keys.
    ``parallel.compression.local_clip`` is the strategy's ``local_clip``, not a codec option."""
    options = dict(cfg.compression or {})
    local_clip = options.pop("local_clip", None)
    if local_clip is not None and not options:
        raise ConfigError(f"parallel.compression.local_clip={local_clip!r} clips each replica's gradient before a "
                          "codec, but parallel.compression names none; add one, e.g. compression: {kind: topk, "
                          "ratio: 0.01, local_clip: 1.0}, or use optimizer.clip_norm.")
    codec = build_codec(options)
    sync = build_sync(cfg.sync)
    try:
        return Strategy(zero=cfg.zero, sequence_parallel=cfg.sequence_parallel, microbatches=cfg.microbatches,
                        compute_dtype=cfg.compute_dtype, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages,
                        stage_layers=cfg.stage_layers, compression=codec, sync=sync,
                        update_every=cfg.update_every, vertical_sync=cfg.vertical_sync, local_clip=local_clip,
                        context=build_context(cfg.context))
    except ValueError as e:
        if str(e).startswith("Strategy.local_clip="):
            raise ConfigError(str(e).replace("Strategy.local_clip=", "parallel.compression.local_clip=", 1)) from None
        fallback = f"parallel.schedule={cfg.schedule!r}" if "schedule" in str(e) else "parallel"
        raise ConfigError(relabel(e, "Strategy", "parallel", _PARALLEL_KEYS, fallback)) from None


def lr_scaling_problems(cfg: LRScalingConfig) -> list[str]:
    """What is wrong with ``optimizer.lr_scaling`` (empty: nothing)."""
    p = []
    if cfg.rule not in opt_lib.LR_SCALING_RULES:
        p.append(f"optimizer.lr_scaling.rule={cfg.rule!r}: unknown rule; allowed: "
                 f"{', '.join(opt_lib.LR_SCALING_RULES)} (lr x B/base_batch, lr x sqrt(B/base_batch), lr).")
    if isinstance(cfg.base_batch, bool) or not isinstance(cfg.base_batch, int) or cfg.base_batch <= 0:
        p.append(f"optimizer.lr_scaling.base_batch={cfg.base_batch!r}: must be a positive int, the global batch "
                 "size at which optimizer.lr was tuned (e.g. 256).")
    return p


def peak_lr(cfg: OptimizerConfig, global_batch: int | None = None) -> float:
    """``optimizer.lr`` scaled by ``optimizer.lr_scaling`` to ``global_batch`` (``data.batch_size``)."""
    if problems := lr_scaling_problems(cfg.lr_scaling):
        raise ConfigError(" ".join(problems))
    rule = cfg.lr_scaling.rule
    if rule == "none":
        return cfg.lr
    if global_batch is None:
        raise ConfigError(f"optimizer.lr_scaling.rule={rule!r} scales optimizer.lr by the global batch, which "
                          "was not given: call build_optimizer / build_lr_schedule with global_batch="
                          "data.batch_size, or set optimizer.lr_scaling.rule=none.")
    return opt_lib.scaled_lr(cfg.lr, global_batch, cfg.lr_scaling.base_batch, rule)


def build_lr_schedule(cfg: OptimizerConfig, total_steps: int, global_batch: int | None = None) -> Callable:
    """Linear warm-up from 0 over ``warmup_steps`` to the peak :func:`peak_lr` (``optimizer.lr`` scaled to
    ``global_batch`` by ``optimizer.lr_scaling``), then constant / cosine / linear decay to ``min_lr_ratio``
    times the peak."""
    peak = peak_lr(cfg, global_batch)
    warm = min(cfg.warmup_steps, total_steps)
    rest = max(1, total_steps - warm)
    end = peak * cfg.min_lr_ratio
    after = {"constant": lambda: optax.constant_schedule(peak),
             "cosine": lambda: optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio),
             "linear": lambda: optax.linear_schedule(peak, end, rest)}[cfg.lr_schedule]()
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def build_trust_mask(cfg: OptimizerConfig, model_fn: Callable[[], nnx.Module] | None = None):
    """``(logical, mask)`` for lars / lamb: the model's logical names and :func:`jaxpar.optimizers.trust_mask`
    with ``optimizer.trust_mask`` (checked against the model's parameters, not built); without ``model_fn``
    ``(None, mask function)``, checked when the optimizer is initialised."""
    tm = cfg.trust_mask
    if model_fn is None:
        return None, lambda params: opt_lib.trust_mask(params, exclude=tm.exclude, include=tm.include)
    from jaxpar.adapters.shapes import abstract_model

    _, shapes, logical = abstract_model(model_fn)
    try:
        return logical, opt_lib.trust_mask(shapes, logical, exclude=tm.exclude, include=tm.include)
    except opt_lib.MaskError as e:
        key = "exclude" if str(e).startswith("trust_mask exclude") else "include"
        msg = re.sub(r"^trust_mask \w+: ", "", str(e))
        raise ConfigError(f"optimizer.trust_mask.{key}={list(getattr(tm, key))!r}: {msg}") from None


def build_optimizer(cfg: OptimizerConfig, total_steps: int, *, global_batch: int | None = None,
                    model_fn: Callable[[], nnx.Module] | None = None,
                    updates_per_step: int = 1,
                    freeze_variance_step: int | None = None) -> tuple[optax.GradientTransformation, Callable]:
    """``(tx, lr_schedule)``. Clipping is done by the train step (``clip_norm``), not by ``tx``.

    ``global_batch`` (``data.batch_size``): needed by ``optimizer.lr_scaling``; the schedule (logged as
    ``lr``) is the scaled one. ``model_fn``: lets lars / lamb read the parameters' logical names (stacked
    layers, :func:`build_trust_mask`) and check ``optimizer.trust_mask`` now; without it the mask is
    taken from the arrays' ranks. ``updates_per_step``: how often ``tx`` is applied per train step
    (PipeDream weight stashing: ``microbatches / update_every`` per stage); its schedule then reads
    the step, ``count // updates_per_step``, so every update of step ``t`` uses the logged ``lr(t)``.
    ``freeze_variance_step`` (1-bit Adam, :func:`frozen_variance_step`): adam / adamw whose second moment
    stops changing after that many updates (:func:`jaxpar.optimizers.adamw_frozen_variance`)."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={cfg.name!r}: unknown optimizer; allowed: {', '.join(OPTIMIZERS)}.")
    schedule = build_lr_schedule(cfg, total_steps, global_batch)
    logical, mask = build_trust_mask(cfg, model_fn) if cfg.name in ("lars", "lamb") else (None, None)
    inner = schedule if updates_per_step == 1 else (lambda count: schedule(count // updates_per_step))
    if freeze_variance_step is not None:
        if cfg.name not in ("adam", "adamw"):
            raise ConfigError(f"optimizer.name={cfg.name!r}: 1-bit Adam (parallel.compression.optimizer_momentum) "
                              "compresses Adam's first moment; use optimizer.name: adamw or adam.")
        tx = opt_lib.adamw_frozen_variance(inner, freeze_variance_step, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay if cfg.name == "adamw" else 0.0)
    else:
        tx = OPTIMIZERS[cfg.name](cfg, inner, logical=logical, mask=mask)
    if cfg.name not in _OWN_DECAY and cfg.weight_decay:
        tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay), tx)
    return tx, schedule


def frozen_variance_step(strategy: Strategy) -> int | None:
    """The step at which Adam's second moment freezes: the codec's ``start_step`` when it compresses
    Adam's first moment (``optimizer_momentum``, 1-bit Adam), else ``None``."""
    codec = strategy.compression
    return codec.start_step if getattr(codec, "optimizer_momentum", 0.0) else None


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
    """A zero-argument model factory for :func:`jaxpar.init_train_state`: the GPT, ``model.target``
    called as ``target(**model.kwargs, rngs=nnx.Rngs(seed))``, or ``model.hf``'s decoder (random
    weights: the job loads the checkpoint's, :meth:`jaxpar.config.Job.init_state`)."""
    if cfg.hf is not None:
        from jaxpar.config.hf_model import open_hf

        return open_hf(cfg).model_fn(seed)
    if cfg.target is not None:
        return _build_user_model(cfg, seed)
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r}: unknown model; allowed: {', '.join(MODELS)}.")
    return MODELS[cfg.name].build(cfg, seed)


def build_loss_fn(cfg: ModelConfig) -> Callable:
    """``loss(model, batch) -> scalar``: ``model.loss`` for a user model, :func:`jaxpar.models.decoder_loss`
    for ``model.hf``, else the registry's."""
    if cfg.hf is not None:
        from jaxpar.models.decoder import decoder_loss

        return decoder_loss
    if cfg.target is not None:
        if cfg.loss is None:
            raise ConfigError(f"model.loss: missing; with model.target={cfg.target!r} name the loss function.")
        return resolve_import(cfg.loss, "model.loss")
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r}: unknown model; allowed: {', '.join(MODELS)}.")
    return MODELS[cfg.name].loss()
