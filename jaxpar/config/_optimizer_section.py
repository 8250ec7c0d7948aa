"""The optimizer section -> an optax optimizer and its learning-rate schedule, and the registry of
built-in optimizers (``optimizer.name``).

The learning rate is ``optimizer.lr`` scaled to the global batch by ``optimizer.lr_scaling``
(:func:`peak_lr`), warmed up and decayed (:func:`build_lr_schedule`); lars / lamb take a trust-ratio
mask checked against the model's parameters (:func:`build_trust_mask`). Errors name the YAML keys.
"""

from __future__ import annotations

import re
import warnings
from typing import Callable

import optax

from jaxpar import optimizers as opt_lib
from jaxpar.errors import ScheduleWarning, int_problem
from jaxpar.strategy import Strategy
from jaxpar.config._schema import ConfigError, LRScalingConfig, OptimizerConfig


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


def _muon(c: OptimizerConfig, lr, *, logical=None, mask=None, place=None, kernel_layout="in_out"):
    m = c.muon
    adam = {"b1": c.b1, "b2": c.b2, "eps": c.eps, "weight_decay": m.adam_weight_decay}
    if m.adam_lr is not None:             # the same schedule, scaled to the AdamW half's peak
        adam["lr"] = lr * (m.adam_lr / c.lr)
    try:
        return opt_lib.muon(lr, logical=logical, routing=dict(m.routing), momentum=m.momentum, nesterov=m.nesterov,
                            ns_steps=m.ns_steps, weight_decay=c.weight_decay, consistent_rms=m.consistent_rms,
                            adam=adam, kernel_layout=kernel_layout, **(place or {}))
    except opt_lib.OptimizerError as e:
        raise ConfigError(f"optimizer.name=muon: {e} (YAML: optimizer.muon.routing, optimizer.muon.*).") from None


#: ``name -> fn(cfg, lr, *, logical=None, mask=None) -> optax.GradientTransformation`` (``lr``: the update's
#: learning rate, a number; ``logical``: the params' logical names; ``mask``: :func:`jaxpar.optimizers.trust_mask`'s
#: tree; both for lars / lamb).
OPTIMIZERS: dict[str, Callable] = {"adamw": _adamw, "adam": _adam, "sgd": _sgd, "lars": _lars, "lamb": _lamb,
                                 "muon": _muon}
#: Optimizers that apply ``weight_decay`` themselves (the others get ``add_decayed_weights`` in front).
_OWN_DECAY = ("adamw", "lars", "lamb", "muon")


def lr_scaling_problems(cfg: LRScalingConfig) -> list[str]:
    """What is wrong with ``optimizer.lr_scaling``.

    Args:
      cfg: the ``optimizer.lr_scaling`` section.

    Returns:
      One line per problem, naming its key (empty: nothing).
    """
    p = []
    if cfg.rule not in opt_lib.LR_SCALING_RULES:
        p.append(f"optimizer.lr_scaling.rule={cfg.rule!r}: unknown rule; allowed: "
                 f"{', '.join(opt_lib.LR_SCALING_RULES)} (lr x B/base_batch, lr x sqrt(B/base_batch), lr).")
    if int_problem(cfg.base_batch, 1):
        p.append(f"optimizer.lr_scaling.base_batch={cfg.base_batch!r}: must be a positive int, the global batch "
                 "size at which optimizer.lr was tuned (e.g. 256).")
    return p


def peak_lr(cfg: OptimizerConfig, global_batch: int | None = None) -> float:
    """The peak learning rate.

    Args:
      cfg: the ``optimizer`` section.
      global_batch: ``data.batch_size``; needed unless ``optimizer.lr_scaling.rule`` is ``none``.

    Returns:
      ``optimizer.lr`` scaled by ``optimizer.lr_scaling`` to ``global_batch``.
    """
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
    """The learning-rate schedule of the optimizer section.

    Args:
      cfg: the ``optimizer`` section.
      total_steps: ``train.steps``.
      global_batch: ``data.batch_size`` (for ``optimizer.lr_scaling``).

    Returns:
      ``step -> lr``: a linear warm-up from 0 over ``warmup_steps`` to the peak :func:`peak_lr`,
      then constant / cosine / linear decay to ``min_lr_ratio`` times the peak.
    """
    peak = peak_lr(cfg, global_batch)
    if 0 < total_steps <= cfg.warmup_steps:
        end = (total_steps - 1) / total_steps
        warnings.warn(f"optimizer.warmup_steps={cfg.warmup_steps} is not below train.steps={total_steps}: the whole "
                      f"run warms up, to {end:.2f} of the peak learning rate {peak:g} at its last step, and "
                      f"optimizer.lr_schedule={cfg.lr_schedule!r} never starts. Lower optimizer.warmup_steps below "
                      "train.steps.", ScheduleWarning, stacklevel=2)
    warm = min(cfg.warmup_steps, total_steps)
    rest = max(1, total_steps - warm)
    after = {"constant": lambda: optax.constant_schedule(peak),
             "cosine": lambda: optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio),
             "linear": lambda: optax.linear_schedule(peak, peak * cfg.min_lr_ratio, rest)}[cfg.lr_schedule]()
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def build_trust_mask(cfg: OptimizerConfig, params=None):
    """The trust-ratio mask of lars / lamb.

    Args:
      cfg: the ``optimizer`` section (its ``trust_mask``).
      params: the parameters' layout (:func:`jaxpar.param_layout`; None: the mask is checked when the
        optimizer is initialised).

    Returns:
      ``(logical, mask)``: the model's logical names and :func:`jaxpar.optimizers.trust_mask` with
      ``optimizer.trust_mask``, checked against the model's parameters; without ``params``
      ``(None, mask function)``.
    """
    tm = cfg.trust_mask
    if params is None:
        return None, lambda p: opt_lib.trust_mask(p, exclude=tm.exclude, include=tm.include)
    try:
        return params.logical, opt_lib.trust_mask(params.shapes, params.logical, exclude=tm.exclude,
                                                  include=tm.include)
    except opt_lib.MaskError as e:
        key = "exclude" if str(e).startswith("trust_mask exclude") else "include"
        msg = re.sub(r"^trust_mask \w+: ", "", str(e))
        raise ConfigError(f"optimizer.trust_mask.{key}={list(getattr(tm, key))!r}: {msg}") from None


def build_optimizer(cfg: OptimizerConfig, total_steps: int, *, global_batch: int | None = None, params=None,
                    updates_per_step: int = 1,
                    freeze_variance_step: int | None = None) -> tuple[optax.GradientTransformation, Callable]:
    """The optimizer, its learning-rate schedule injected (``optax.inject_hyperparams``): its state holds the
    learning rate of each update (:func:`jaxpar.optimizers.learning_rate`, logged as ``lr``). Clipping is done by
    the train step (``clip_norm``), not by ``tx``.

    Args:
      cfg: the ``optimizer`` section.
      total_steps: ``train.steps`` (the schedule's length).
      global_batch: ``data.batch_size``: needed by ``optimizer.lr_scaling``.
      params: the parameters' layout (:func:`jaxpar.param_layout` of the model on the mesh and strategy):
        lars / lamb read the parameters' logical names (stacked layers, :func:`build_trust_mask`) and check
        ``optimizer.trust_mask`` now (without it the mask is taken from the arrays' ranks); Muon routes by
        them and places Newton-Schulz on the moments' specs (``optimizer.muon.placement``).
      updates_per_step: how often ``tx`` is applied per train step (PipeDream weight stashing:
        ``microbatches / update_every`` per stage); its schedule then reads the step,
        ``count // updates_per_step``, so every update of step ``t`` uses ``lr(t)``.
      freeze_variance_step: 1-bit Adam (:func:`frozen_variance_step`): adam / adamw whose second moment
        stops changing after that many updates (:func:`jaxpar.optimizers.adamw_frozen_variance`).

    Returns:
      ``(tx, lr_schedule)``; the schedule (``step -> lr``) is the scaled one.
    """
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={cfg.name!r}: unknown optimizer; allowed: {', '.join(OPTIMIZERS)}.")
    schedule = build_lr_schedule(cfg, total_steps, global_batch)
    logical, mask = build_trust_mask(cfg, params) if cfg.name in ("lars", "lamb") else (None, None)
    extra = {}
    if cfg.name == "muon":
        logical = _muon_logical(cfg, params)
        extra = {"place": _muon_place(cfg, params), "kernel_layout": params.kernel_layout}
    if freeze_variance_step is not None and cfg.name not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.name={cfg.name!r}: 1-bit Adam (parallel.compression.optimizer_momentum) "
                          "compresses Adam's first moment; use optimizer.name: adamw or adam.")

    def optimizer(learning_rate):
        if freeze_variance_step is not None:
            decay = cfg.weight_decay if cfg.name == "adamw" else 0.0
            return opt_lib.adamw_frozen_variance(learning_rate, freeze_variance_step, b1=cfg.b1, b2=cfg.b2,
                                                 eps=cfg.eps, weight_decay=decay)
        tx = OPTIMIZERS[cfg.name](cfg, learning_rate, logical=logical, mask=mask, **extra)
        if cfg.name not in _OWN_DECAY and cfg.weight_decay:
            tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay), tx)
        return tx

    optimizer(cfg.lr)                   # its options' errors now (inject_hyperparams builds it at init and update)
    inner = schedule if updates_per_step == 1 else (lambda count: schedule(count // updates_per_step))
    return optax.inject_hyperparams(optimizer)(learning_rate=inner), schedule


def muon_problems(cfg: OptimizerConfig) -> list[str]:
    """What is wrong with ``optimizer.muon`` (its options' ranges, as :func:`jaxpar.optimizers.muon` checks them).

    Args:
      cfg: the ``optimizer`` section.

    Returns:
      One line per problem, naming its key (empty: nothing).
    """
    m, p = cfg.muon, []
    for key, name in (("momentum", "momentum"), ("adam_weight_decay", "weight_decay")):
        if (why := opt_lib.hyperparameter_problem(name, getattr(m, key))) is not None:
            p.append(f"optimizer.muon.{key}={getattr(m, key)!r}: {why}.")
    for key in ("adam_lr", "consistent_rms"):
        if getattr(m, key) is not None and (why := opt_lib.hyperparameter_problem("learning_rate", getattr(m, key))):
            p.append(f"optimizer.muon.{key}={getattr(m, key)!r}: {why}, or null.")
    if int_problem(m.ns_steps, 1):
        p.append(f"optimizer.muon.ns_steps={m.ns_steps!r}: must be a positive int (Newton-Schulz iterations, e.g. 5).")
    for pattern, rule in dict(m.routing).items():
        if rule not in ("muon", "adam"):
            p.append(f"optimizer.muon.routing[{pattern!r}]={rule!r}: a rule is muon or adam.")
    if m.placement not in opt_lib.MUON_PLACEMENTS:
        p.append(f"optimizer.muon.placement={m.placement!r}: choose one of {', '.join(opt_lib.MUON_PLACEMENTS)} "
                 "(auto: the cost model's exact choice per matrix group; local approximates).")
    return p


def _muon_place(cfg: OptimizerConfig, params) -> dict:
    """``muon``'s ``placement``, ``mesh``, ``specs`` (the moments', from the parameters' layout) and ``auto``'s
    chooser (the cost model's, on the mesh's platform)."""
    strategy, mesh = params.strategy, params.mesh
    if strategy.schedule == "pipedream" and dict(mesh.shape).get("pipe", 1) > 1:
        if cfg.muon.placement != "auto":       # each stage updates its own weights inside the pipeline
            raise ConfigError(f"optimizer.muon.placement={cfg.muon.placement!r} with parallel.schedule='pipedream': "
                              "each stage updates its own weights inside the pipeline, where XLA places Newton-Schulz; "
                              "use optimizer.muon.placement: auto, or schedule '1f1b' / 'pipedream-2bw'.")
        return {}
    from jaxpar.cost import placement_chooser

    return {"placement": cfg.muon.placement, "mesh": mesh, "specs": params.opt_param_specs,
            "chooser": placement_chooser(platform=mesh.devices.flat[0].platform)}


def _muon_logical(cfg: OptimizerConfig, params):
    """The model's logical names for Muon's routing, after ``optimizer.muon``'s checks and the routing of its
    parameters (``optimizer.muon.routing``'s patterns each match one; an unnamed matrix is routed)."""
    if problems := muon_problems(cfg):
        raise ConfigError(" ".join(problems))
    if params is None:
        raise ConfigError("optimizer.name=muon routes parameters by the model's logical names: call build_optimizer "
                          "with params=jaxpar.param_layout(model_fn, mesh, strategy).")
    try:
        opt_lib.muon_routes(params.shapes, params.logical, routing=dict(cfg.muon.routing))
    except opt_lib.OptimizerError as e:
        raise ConfigError(f"optimizer.name=muon: {e} (YAML: optimizer.muon.routing).") from None
    return params.logical


def frozen_variance_step(strategy: Strategy) -> int | None:
    """The step at which Adam's second moment freezes (1-bit Adam).

    Args:
      strategy: the strategy (its ``compression`` codec).

    Returns:
      The codec's ``start_step`` when it compresses Adam's first moment (``optimizer_momentum``),
      else None.
    """
    return strategy.compression.start_step if getattr(strategy.compression, "optimizer_momentum", 0.0) else None
