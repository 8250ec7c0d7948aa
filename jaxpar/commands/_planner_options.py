"""What a config asks of the planner, read in one place for ``jaxpar plan`` and ``jaxpar inspect``'s suggestion:
the planner's options (:func:`plan_options`: the compute dtype of :func:`plan_dtype`, the FP8 options, Muon,
offload, the lowering and the precision), and the overrides of a plan that the config lacks, as ``jaxpar plan``
prints them (:func:`changed_overrides`).

Example::

    >>> from jaxpar import cost
    >>> plan_options(None, cost.load_cluster("h100")).precision        # jaxpar's GPT of given sizes
    'mixed'
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from omegaconf import OmegaConf

from jaxpar import cost
from jaxpar.compat._offload_rules import HOST_UPDATE_REFUSED
from jaxpar.config._build import build_option
from jaxpar.config._cost_model import muon_settings
from jaxpar.config._load import parse_overrides
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.errors import Fp8Error
from jaxpar.options import CONTEXT_METHODS, Fp8
from jaxpar.plan import PlanOptions, fp8_cluster_problem, plan_overrides


def plan_dtype(cfg: JobConfig | None, dtype: str | None, cluster: Any) -> str:
    """The planner's compute dtype (the cluster's peak FLOP/s of that dtype): ``--dtype`` when given, else the
    config's ``parallel.compute_dtype``, else ``bfloat16``.

    Args:
      cfg: the loaded config (None: none).
      dtype: ``--dtype`` (None: not given).
      cluster: the :class:`jaxpar.cost.Cluster` planned on.

    Returns:
      The dtype.

    Raises:
      ConfigError: the config's dtype is one the cluster has no peak FLOP/s for (an explicit ``--dtype``
        is left to the planner, which names the cluster's dtypes).
      Fp8Error: the config has ``parallel.fp8`` on and the cluster no FP8 GEMMs (:func:`fp8_cluster_problem`).
    """
    if cfg is not None and cfg.parallel.fp8 and not cluster.has_fp8 and (why := fp8_cluster_problem(cluster.name)):
        raise Fp8Error(why)
    if dtype or cfg is None:
        return dtype or "bfloat16"
    dtype = cfg.parallel.compute_dtype
    if dtype not in cluster.compute_dtypes:
        raise ConfigError(f"{cfg.name}: parallel.compute_dtype is {dtype}, and cluster {cluster.name!r} has peak "
                          f"FLOP/s for {', '.join(cluster.compute_dtypes)} only; pass --dtype "
                          f"{cluster.compute_dtypes[0]} to plan in that dtype, or choose another --cluster.")
    return dtype


def plan_options(cfg: JobConfig | None, cluster: Any, *, dtype: str | None = None, precision: str | None = None,
                 contexts: tuple[int, ...] | None = None,
                 context_methods: Sequence[str] = CONTEXT_METHODS) -> PlanOptions:
    """The planner's options for a config on a cluster: those of ``jaxpar plan`` and of ``jaxpar inspect``'s
    suggestion alike (:func:`jaxpar.plan.rank_plans`).

    With a config, its plans are jaxpar's step: fp32 parameters and moments (``precision`` ``fp32``), compiled by
    the cluster's platform's XLA (its lowering), in the config's compute dtype, with its FP8 options (the defaults
    where it has none: the planner considers FP8 where the cluster has FP8 GEMMs), Muon's settings, and never host
    offload where the optimizer cannot update in host memory. Without one (jaxpar's GPT of given sizes): mixed
    precision and the ideal lowering.

    Args:
      cfg: the loaded config (None: none).
      cluster: the :class:`jaxpar.cost.Cluster` planned on.
      dtype: ``--dtype`` (None: :func:`plan_dtype`'s default).
      precision: ``--precision`` (None: as above).
      contexts: the CP degrees to search (None: the planner's default).
      context_methods: the CP methods to search.

    Returns:
      The :class:`jaxpar.plan.PlanOptions`.

    Raises:
      ConfigError, Fp8Error: as :func:`plan_dtype`.
    """
    search = dict(dtype=plan_dtype(cfg, dtype, cluster), contexts=contexts, context_methods=tuple(context_methods))
    if cfg is None:
        return PlanOptions(precision=precision or "mixed", **search)
    return PlanOptions(precision=precision or "fp32", lowering=cost.lowering_for_platform(cluster.platform),
                       fp8=build_option("fp8", cfg.parallel.fp8) or Fp8(), muon=muon_settings(cfg),
                       offload=False if cfg.optimizer.name in HOST_UPDATE_REFUSED else None, **search)


def changed_overrides(cfg: JobConfig | None = None) -> Callable[[Any], list[str]]:
    """``changed(plan)``: the overrides of :func:`jaxpar.plan.plan_overrides` whose value ``cfg`` (default: the
    schema's defaults) lacks; each override is compared once.

    Args:
      cfg: the config the overrides apply to.

    Returns:
      The function, ``plan -> key=value strings``.

    >>> from jaxpar.cost import Plan
    >>> from jaxpar.strategy import Strategy
    >>> changed_overrides()(Plan(pipe=2, data=4, strategy=Strategy(microbatches=8)))
    ['mesh.pipe=2', 'mesh.data=4', 'parallel.microbatches=8']
    """
    base = OmegaConf.structured(cfg if cfg is not None else JobConfig())

    @functools.lru_cache(maxsize=None)
    def differs(item: str) -> bool:
        key = item.split("=", 1)[0]
        want = OmegaConf.select(OmegaConf.create(parse_overrides([item])), key)
        have = OmegaConf.select(base, key)
        plain = lambda v: (OmegaConf.to_container(v) or None) if OmegaConf.is_config(v) else v   # noqa: E731 - {}: none
        return plain(want) != plain(have)
    return lambda plan: [item for item in plan_overrides(plan) if differs(item)]
