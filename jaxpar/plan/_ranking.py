"""The planner's one call for ``jaxpar plan`` and ``jaxpar inspect`` (:func:`rank_plans`, with
:class:`PlanOptions`), and which plans are the same program (:func:`same_plan`, by their fields, not their labels).

Example::

    >>> from jaxpar import cost
    >>> from jaxpar.strategy import Strategy
    >>> same_plan(cost.Plan(fsdp=8, strategy=Strategy(compute_dtype="bfloat16")), cost.Plan(fsdp=8))
    True
    >>> same_plan(cost.Plan(fsdp=8), cost.Plan(fsdp=8, remat="full"))
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxpar.options import CONTEXT_METHODS, Fp8


@dataclass(frozen=True)
class PlanOptions:
    """What the planner ranks a model's plans with, beside the model and the cluster
    (:func:`jaxpar.cost.plan`'s keywords of the same meaning).

    Attributes:
      dtype: the compute dtype (the peak FLOP/s of the GEMMs not in FP8).
      precision: the bytes per parameter, gradient and optimizer state (a key of :data:`jaxpar.cost.PRECISIONS`).
      lowering: the program the traffic is counted for (:func:`jaxpar.cost.lowering_for_platform`).
      fp8: the FP8 plans' options.
      muon: Muon's ``ns_steps`` and ``placement`` (None: another optimizer).
      offload: propose host offload where nothing fits (None: where it can run; False: never).
      contexts: the CP degrees to search (None: the planner's default).
      context_methods: the CP methods to search.
    """

    dtype: str = "bfloat16"
    precision: str = "mixed"
    lowering: str = "ideal"
    fp8: Fp8 = Fp8()
    muon: dict | None = None
    offload: bool | None = None
    contexts: tuple[int, ...] | None = None
    context_methods: tuple[str, ...] = CONTEXT_METHODS


def rank_plans(model: Any, cluster: Any, options: PlanOptions, *, top: int = 10) -> Any:
    """Rank every plan of ``model`` on ``cluster`` (:func:`jaxpar.cost.plan`) with ``options``: the one call of
    ``jaxpar plan`` and of ``jaxpar inspect``'s suggestion.

    Args:
      model: the cost model's model (:class:`jaxpar.cost.ModelSpec`).
      cluster: the :class:`jaxpar.cost.Cluster`.
      options: the planner's options.
      top: how many plans the result's tables print.

    Returns:
      The :class:`jaxpar.cost.PlanResult`.

    Raises:
      PlanError: no plan is possible or none fits.
    """
    from jaxpar import cost

    o = options
    return cost.plan(model, cluster, top=top, dtype=o.dtype, precision=o.precision, lowering=o.lowering,
                     fp8_options=o.fp8, muon=o.muon, offload=o.offload, contexts=o.contexts,
                     context_methods=o.context_methods)


def plan_fields(plan: Any) -> tuple:
    """What a plan runs, by its fields: the mesh sizes, the remat policy and the strategy's fields the cost model
    reads (:data:`jaxpar.cost._parallel.MODELLED`), each where it does something on these sizes (the ZeRO stage
    with a ``data`` axis, SP with ``tensor``, the schedule, virtual stages and stage layers with a pipeline, the
    CP method with ``context``). Not the label: the compute dtype and the unmodelled fields are not in it.

    Args:
      plan: a :class:`jaxpar.cost.Plan`.

    Returns:
      A tuple, equal for two plans exactly when they run the same program.
    """
    from jaxpar.cost._parallel import MODELLED

    s, sizes = plan.strategy, plan.sizes
    live = {"zero": sizes["data"] > 1, "sequence_parallel": sizes["tensor"] > 1, "schedule": sizes["pipe"] > 1,
            "virtual_stages": sizes["pipe"] > 1, "stage_layers": sizes["pipe"] > 1, "context": sizes["context"] > 1}

    def value(k: str) -> Any:
        if not live.get(k, True):
            return None
        return s.context_setting if k == "context" else getattr(s, k)
    return tuple(sorted(sizes.items())), plan.remat, tuple((k, value(k)) for k in MODELLED)


def same_plan(a: Any, b: Any) -> bool:
    """Whether two plans run the same program (:func:`plan_fields`), whatever their labels say.

    Args:
      a, b: :class:`jaxpar.cost.Plan` s (None: no plan, the same as none).

    Returns:
      The answer.
    """
    if a is None or b is None:
        return a is b
    return plan_fields(a) == plan_fields(b)
