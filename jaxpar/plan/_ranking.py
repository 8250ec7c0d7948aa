"""The planner's one call for ``jaxpar plan`` and ``jaxpar inspect`` (:func:`rank_plans`, with
:class:`PlanOptions`), which plans are the same program (:func:`same_plan`, by their fields, not their labels),
and the MFU against the peak of the dtype each GEMM runs in (:func:`gemm_peak_mfu`).

Example::

    >>> from jaxpar import cost
    >>> from jaxpar.strategy import Strategy
    >>> same_plan(cost.Plan(fsdp=8, strategy=Strategy(compute_dtype="bfloat16")), cost.Plan(fsdp=8))
    True
    >>> same_plan(cost.Plan(fsdp=8), cost.Plan(fsdp=8, remat="full"))
    False
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    ``jaxpar plan`` and of ``jaxpar inspect``'s suggestion. Each ranked plan's MFU is against the peaks its GEMMs
    run at (:func:`gemm_peak_mfu`).

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
    result = cost.plan(model, cluster, top=top, dtype=o.dtype, precision=o.precision, lowering=o.lowering,
                       fp8_options=o.fp8, muon=o.muon, offload=o.offload, contexts=o.contexts,
                       context_methods=o.context_methods)
    ranked = [replace(e, time=replace(e.time, mfu=gemm_peak_mfu(model, e.plan, cluster, o.dtype, e.time.mfu)))
              for e in result.ranked]
    return replace(result, ranked=ranked)


def fp8_flops_share(model: Any, plan: Any) -> float:
    """The share of a step's model FLOPs (:func:`jaxpar.cost.step_flops`, no recomputation) that the plan's FP8
    GEMMs compute (:func:`jaxpar.cost._roofline.fp8_kernels`: the attention projections, the MLP and the
    shared experts where ``min_dim`` covers them).

    Args:
      model: the cost model's model.
      plan: the plan (its ``strategy.fp8``).

    Returns:
      The share, in [0, 1]; 0 without FP8.

    >>> from jaxpar import cost
    >>> from jaxpar.strategy import Strategy
    >>> m = cost.gpt(2, 1024, 8, 64, 256, 8)
    >>> fp8_flops_share(m, cost.Plan()), round(fp8_flops_share(m, cost.Plan(strategy=Strategy(fp8=Fp8()))), 3)
    (0.0, 0.98)
    """
    from jaxpar.cost import Plan, step_flops
    from jaxpar.cost._roofline import fp8_kernels, layer_kernels

    covered = fp8_kernels(model, plan)
    if not covered:
        return 0.0

    def per_layer(moe: bool) -> float:        # forward FLOPs of one sequence's covered GEMMs in one layer
        return sum(k.flops * k.count for k in layer_kernels(model, Plan(), 1, 2, moe) if k.name in covered)
    n_moe = model.moe_layers
    forward = (model.layers - n_moe) * per_layer(False) + (n_moe * per_layer(True) if n_moe else 0.0)
    return min(1.0, 3 * model.batch * forward / step_flops(model))


def gemm_peak_mfu(model: Any, plan: Any, cluster: Any, dtype: str, mfu: float) -> float:
    """An MFU against ``dtype``'s peak made against the peak of the dtype each GEMM runs in: the plan's FP8
    GEMMs' FLOPs (:func:`fp8_flops_share`) against the cluster's FP8 peak, the others against ``dtype``'s. So an
    FP8 plan computing in float32 is not set against the float32 peak alone, and the MFU stays at most 1.

    Args:
      model: the cost model's model.
      plan: the plan.
      cluster: the cluster (its peaks).
      dtype: the compute dtype ``mfu`` is against.
      mfu: the MFU against ``dtype``'s peak (:attr:`jaxpar.cost._time.StepTime.mfu`).

    Returns:
      The MFU.
    """
    share = fp8_flops_share(model, plan)
    if not share:
        return mfu
    from jaxpar.cost._cluster import FP8

    return mfu * (1 - share + share * cluster.peak(dtype) / cluster.peak(FP8))


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
