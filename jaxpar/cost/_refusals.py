"""The compatibility table's verdict on a plan: the planner's candidates checked by the rules that
``init_train_state``, ``make_train_step`` and the config layer raise from (:mod:`jaxpar.compat._table`).

A :class:`~jaxpar.cost.Plan` carries the mesh sizes and the strategy fields the planner
searches (ZeRO stage, sequence parallelism, schedule, micro-batches); :func:`plan_setting` turns it,
with the run's settings that the search keeps fixed (the compute dtype, a codec, a sync kind, local
clipping, and :class:`~jaxpar.compat.Setting`'s step options such as ``clip_norm``), into the table's
:class:`~jaxpar.compat.Setting`. :class:`PlanStrategy` stands in for :class:`jaxpar.Strategy`: it holds
the fields the rules read and imports no JAX. :func:`plan_refusal` is the reason the planner files a
refused candidate under :attr:`jaxpar.cost._planner.PlanResult.rejected`.

Example:
    >>> from jaxpar.cost._parallel import Plan
    >>> plan_refusal(Plan(pipe=2, data=2, tensor=2, sequence_parallel=True, microbatches=4)) is None
    True
    >>> print(plan_refusal(Plan(data=4, context=2), fixed={"compression": "topk"}))   # doctest: +ELLIPSIS
    the compatibility table refuses it: Strategy.compression with context=2: a codec's exchange runs...
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from jaxpar.compat._table import LIBRARY_NAMES, Problem, Setting, problems
from jaxpar.errors import PlanError

#: The strategy fields that no plan chooses: the search keeps them fixed (``fixed=`` of :func:`plan_setting`).
STRATEGY_FIELDS = ("compute_dtype", "compression", "sync", "local_clip")
#: The step's and the loop's options of :class:`~jaxpar.compat.Setting` that ``fixed=`` may also set.
SETTING_FIELDS = tuple(f for f in Setting._fields if f not in ("strategy", "sizes"))
#: How a reason of the table starts in the planner's rejected list.
REFUSED_PREFIX = "the compatibility table refuses it: "


class PlanStrategy(NamedTuple):
    """The fields of :class:`jaxpar.Strategy` that the compatibility table reads, for a plan.

    Attributes:
      zero: the ZeRO stage.
      sequence_parallel: sequence parallelism on the tensor axis.
      schedule: the pipeline schedule (read with ``pipe`` > 1).
      microbatches: accumulation steps, or the pipeline's micro-batches.
      compute_dtype: ``"float32"`` or ``"bfloat16"``.
      compression: a codec (anything with a ``name``; 1-bit Adam's has ``optimizer_momentum``), or None.
      sync: a relaxed-synchronisation kind, or None.
      local_clip: the per-replica clip before the codec, or None.
    """

    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    compute_dtype: str = "bfloat16"
    compression: Any = None
    sync: Any = None
    local_clip: float | None = None


def plan_setting(plan: Any, *, dtype: str = "bfloat16", fixed: Mapping[str, Any] | None = None) -> Setting:
    """The compatibility table's :class:`~jaxpar.compat.Setting` of a plan.

    Args:
      plan: a :class:`~jaxpar.cost.Plan` (or any record with its ``zero``, ``sequence_parallel``,
        ``schedule``, ``microbatches`` and ``sizes``).
      dtype: the compute dtype the plan is ranked for (the strategy's ``compute_dtype``).
      fixed: the run's settings that no plan chooses: :data:`STRATEGY_FIELDS` (``compute_dtype`` here
        wins over ``dtype``) and :data:`SETTING_FIELDS` (``clip_norm``, ``steps_per_call``, ...).

    Returns:
      The setting: a :class:`PlanStrategy` and the plan's mesh sizes.

    Raises:
      ValueError: a key of ``fixed`` that is neither.
    """
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(STRATEGY_FIELDS) - set(SETTING_FIELDS))
    if unknown:
        raise PlanError(f"fixed={fixed!r}: unknown key(s) {', '.join(unknown)}; the table reads the strategy's "
                        f"{', '.join(STRATEGY_FIELDS)} and the options {', '.join(SETTING_FIELDS)}.")
    strategy = PlanStrategy(zero=plan.zero, sequence_parallel=plan.sequence_parallel, schedule=plan.schedule,
                            microbatches=plan.microbatches, compute_dtype=fixed.pop("compute_dtype", dtype),
                            **{k: fixed.pop(k) for k in STRATEGY_FIELDS[1:] if k in fixed})
    return Setting(strategy, dict(plan.sizes), **fixed)


def plan_problems(plan: Any, *, dtype: str = "bfloat16", fixed: Mapping[str, Any] | None = None) -> list[Problem]:
    """The table's :class:`~jaxpar.compat.Problem`\\ s of a plan (empty: it composes).

    Args:
      plan: as :func:`plan_setting`'s.
      dtype: as :func:`plan_setting`'s.
      fixed: as :func:`plan_setting`'s.

    Returns:
      :func:`jaxpar.compat.problems` of :func:`plan_setting`.
    """
    return problems(plan_setting(plan, dtype=dtype, fixed=fixed))


def plan_refusal(plan: Any, *, dtype: str = "bfloat16", fixed: Mapping[str, Any] | None = None) -> str | None:
    """Why the compatibility table refuses a plan, with the library's names (None: it composes).

    Args:
      plan: as :func:`plan_setting`'s.
      dtype: as :func:`plan_setting`'s.
      fixed: as :func:`plan_setting`'s.

    Returns:
      :data:`REFUSED_PREFIX` and every problem's message (:data:`jaxpar.compat.LIBRARY_NAMES`), or None.
    """
    found = plan_problems(plan, dtype=dtype, fixed=fixed)
    return REFUSED_PREFIX + " ".join(p.render(LIBRARY_NAMES) for p in found) if found else None
