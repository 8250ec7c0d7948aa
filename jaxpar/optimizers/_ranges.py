"""The range of each optimizer option (:data:`HYPERPARAMETERS`) and the learning rate scaled to a global batch
(:func:`scaled_lr`)."""
from __future__ import annotations

import math
import numbers
from typing import Any

import jax

from jaxpar.errors import OptimizerError, int_problem

#: ``linear``: lr x B / B0 (Goyal et al.); ``sqrt``: lr x sqrt(B / B0); ``none``: lr.
LR_SCALING_RULES = ("linear", "sqrt", "none")

#: ``name -> (holds, what it must be)``: the range of each optimizer option, checked on finite real numbers
#: (a ``learning_rate`` or ``weight_decay`` that is an optax schedule is not checked).
HYPERPARAMETERS = {
    "learning_rate": (lambda v: v > 0, "a finite number > 0"),
    "b1": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "momentum": (lambda v: 0 <= v < 1, "a decay in [0, 1)"),
    "eps": (lambda v: v >= 0, "a finite number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a finite number >= 0 (0: no decay)"),
    "trust_coefficient": (lambda v: v > 0, "a finite number > 0 (LARS: e.g. 0.001)"),
    "clip_norm": (lambda v: v > 0, "a finite number > 0 (the global gradient norm to clip to, e.g. 1.0), or None "
                                   "for no clipping"),
}


def hyperparameter_problem(name: str, value: Any) -> str | None:
    """What is wrong with an optimizer option's value.

    Args:
      name: a key of :data:`HYPERPARAMETERS` (``"learning_rate"``, ``"b1"``, ``"eps"``, ...).
      value: its value: a real number (a 0-d array counts); ``learning_rate`` and ``weight_decay`` may
        also be optax schedules, or a schedule's value that ``optax.inject_hyperparams`` passes (a JAX array:
        a warm-up starts at 0).

    Returns:
      ``"must be ..."`` naming the range (a bool, NaN and inf are out of every range), or None.

    >>> hyperparameter_problem("b2", 1.0), hyperparameter_problem("eps", 1e-8)
    ('must be a decay in [0, 1)', None)
    """
    holds, what = HYPERPARAMETERS[name]
    if ((callable(value) or isinstance(value, jax.Array)) and name in ("learning_rate", "weight_decay")) \
            or isinstance(value, jax.core.Tracer):
        return None          # an optax schedule or its value; a traced value is checked where it is concrete
    if not isinstance(value, bool) and getattr(value, "shape", None) == ():
        value = value.item()               # a 0-d numpy / jax array
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not holds(value):
        return f"must be {what}"
    return None


def check_hyperparameters(owner: str, **values: Any) -> None:
    """Raise :class:`OptimizerError` naming ``owner(name=value)`` for the first option out of its range.

    Args:
      owner: the function named in the message (``"lamb"``).
      **values: options by their :data:`HYPERPARAMETERS` names.

    >>> check_hyperparameters("lamb", learning_rate=-0.1)
    Traceback (most recent call last):
    ...
    jaxpar.errors.OptimizerError: lamb(learning_rate=-0.1): must be a finite number > 0.
    """
    for name, value in values.items():
        why = hyperparameter_problem(name, value)
        if why is not None:
            raise OptimizerError(f"{owner}({name}={value!r}): {why}.")


def scaled_lr(lr: float, batch: int, base_batch: int, rule: str = "linear") -> float:
    """The peak learning rate for global batch ``batch``, given ``lr`` tuned at ``base_batch``.

    Args:
      lr: the peak learning rate tuned at ``base_batch``.
      batch: the global batch size (sequences).
      base_batch: the global batch ``lr`` was tuned at.
      rule: ``"linear"`` (``lr x batch / base_batch``), ``"sqrt"`` or ``"none"``.

    Returns:
      The peak learning rate.

    Raises:
      OptimizerError: an unknown ``rule``, a batch that is not a positive int, or an ``lr`` out of
        :data:`HYPERPARAMETERS`' range.

    >>> scaled_lr(3e-4, batch=64, base_batch=256, rule="linear")
    7.5e-05
    >>> scaled_lr(3e-4, 64, 256, rule="none")
    0.0003
    """
    if rule not in LR_SCALING_RULES:
        raise OptimizerError(f"scaled_lr(rule={rule!r}): unknown rule; choose one of {', '.join(LR_SCALING_RULES)}.")
    for name, value in (("batch", batch), ("base_batch", base_batch)):
        if int_problem(value, 1) is not None:
            raise OptimizerError(f"scaled_lr({name}={value!r}): must be a positive int (a number of examples).")
    if (why := hyperparameter_problem("learning_rate", lr)) is not None or callable(lr):
        raise OptimizerError(f"scaled_lr(lr={lr!r}): {why or 'must be a finite number > 0'}; scale the peak, then "
                             "build the schedule from it.")
    ratio = batch / base_batch
    return lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]
