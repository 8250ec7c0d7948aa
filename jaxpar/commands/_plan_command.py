"""``jaxpar plan``: rank the plans of a config's model (``--config``) or of jaxpar's GPT of given sizes on a cluster
(:func:`jaxpar.cost.plan`), print them with the overrides that run each (:func:`jaxpar.plan.plan_report`), write the
chosen one as a config (``--write``), and compile the top ones (``--verify``).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Mapping, Sequence

from jaxpar import cost
from jaxpar.compat._offload_rules import HOST_UPDATE_REFUSED
from jaxpar.config._cost_model import cost_model, muon_settings
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.errors import Fp8Error
from jaxpar.plan import chosen_plan, fp8_cluster_problem, on_target, plan_overrides, plan_report, verify_plans


def plan_model(cfg: JobConfig | None, sizes: Mapping[str, int | None]):
    """``jaxpar plan``'s model: that of ``--config`` (its global batch unless ``sizes['batch']``), else
    jaxpar's GPT of the sizes given.

    Args:
      cfg: ``--config``'s loaded config (None: none).
      sizes: ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab``, ``batch`` (None where not given).

    Returns:
      The :class:`jaxpar.cost.ModelSpec`.

    Raises:
      ConfigError: no config and a size missing.
    """
    from jaxpar.config._job import build_job

    if cfg is not None:
        return cost_model(cfg, build_job(cfg, mesh=False, data=False).model_fn, **sizes)
    missing = [k for k, v in sizes.items() if not v]
    if missing:
        raise ConfigError(f"jaxpar plan needs --config CONFIG or the model's sizes; missing "
                          f"{', '.join('--' + k for k in missing)}.")
    return cost.gpt(sizes["layers"], sizes["hidden"], sizes["heads"], sizes["seq"], sizes["vocab"], sizes["batch"])


def plan_dtype(cfg: JobConfig | None, dtype: str | None, cluster: Any) -> str:
    """``jaxpar plan``'s compute dtype (the cluster's peak FLOP/s of that dtype): ``--dtype`` when given,
    else the config's ``parallel.compute_dtype``, else ``bfloat16``.

    Args:
      cfg: ``--config``'s loaded config (None: none).
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


def changed_overrides(cfg: JobConfig | None = None) -> Callable[[Any], list[str]]:
    """``changed(plan)``: the overrides of :func:`plan_overrides` whose value ``cfg`` (default: the schema's
    defaults) lacks; each override is compared once.

    Args:
      cfg: the config the overrides apply to.

    Returns:
      The function, ``plan -> key=value strings``.

    >>> from jaxpar.cost import Plan
    >>> from jaxpar.strategy import Strategy
    >>> changed_overrides()(Plan(pipe=2, data=4, strategy=Strategy(microbatches=8)))
    ['mesh.pipe=2', 'mesh.data=4', 'parallel.microbatches=8']
    """
    from omegaconf import OmegaConf

    from jaxpar.config._load import parse_overrides

    base = OmegaConf.structured(cfg if cfg is not None else JobConfig())

    @functools.lru_cache(maxsize=None)
    def differs(item: str) -> bool:
        key = item.split("=", 1)[0]
        want = OmegaConf.select(OmegaConf.create(parse_overrides([item])), key)
        have = OmegaConf.select(base, key)
        plain = lambda v: (OmegaConf.to_container(v) or None) if OmegaConf.is_config(v) else v   # noqa: E731 - {}: none
        return plain(want) != plain(have)
    return lambda plan: [item for item in plan_overrides(plan) if differs(item)]


def write_plan_config(path: str, config: str, overrides: Sequence[str], plan: Any) -> str:
    """``jaxpar plan --write``: ``config`` with its ``overrides`` and the plan's, resolved, as a new YAML file.

    Args:
      path: the file to write (it must not exist).
      config: the ``--config`` file.
      overrides: its overrides.
      plan: the chosen plan.

    Returns:
      The ``wrote`` line.

    Raises:
      ConfigError: ``path`` exists.
    """
    from pathlib import Path

    from jaxpar._text import shown_path
    from jaxpar.config._load import load_config, to_yaml

    out = Path(path)
    if out.exists():
        raise ConfigError(f"--write {path}: the file exists; jaxpar never overwrites a file. Choose another path.")
    cfg = load_config(config, [*overrides, *plan_overrides(plan)])
    out.write_text(f"# jaxpar plan's {plan.name()}: {config} {' '.join(overrides)}\n{to_yaml(cfg)}")
    return f"wrote    {shown_path(out)}: {plan.name()} (jaxpar check {shown_path(out)})"


def run_plan(args: argparse.Namespace) -> int:
    """``jaxpar plan``: rank every plan of the model on the cluster (:func:`jaxpar.cost.plan`);
    ``--verify`` compiles the top plans (on simulated CPU devices, or with ``--target``'s real
    compiler) and compares memory and bytes.

    Args:
      args: the parsed ``jaxpar plan`` arguments (:func:`jaxpar.cli.build_parser`).

    Returns:
      The exit status (0).
    """
    from jaxpar.config._build import build_option
    from jaxpar.config._load import load_config
    from jaxpar.options import Fp8

    target = None
    if args.target:
        from jaxpar.devices import parse_target

        target = parse_target(args.target)
        args.cluster = args.cluster or target.spec.cluster
        args.devices = args.devices or target.num_devices
    try:
        cluster = cost.load_cluster(args.cluster or "h100", num_devices=args.devices)
        if target is not None:
            cluster = on_target(cluster, target)
        if args.overrides and not args.config:
            raise ConfigError(f"the overrides {' '.join(args.overrides)} need --config CONFIG; without "
                              "it, give the model's sizes (--layers, --hidden, --heads, --seq, --vocab, --batch).")
        if args.write and not args.config:
            raise ConfigError(f"--write {args.write} needs --config CONFIG: the file written is that config with the "
                              "chosen plan's overrides.")
        cfg = load_config(args.config, args.overrides) if args.config else None
        model = plan_model(cfg, {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab",
                                                                        "batch")})
        dtype = plan_dtype(cfg, args.dtype, cluster)
        cp = dict(contexts=args.contexts, context_methods=args.context_methods) if args.contexts else {}
        fp8 = (build_option("fp8", cfg.parallel.fp8) if cfg else None) or Fp8()
        # offload: never where the optimizer cannot update in host memory; else (None) where nothing fits
        # a config's plans are jaxpar's step: fp32 parameters and moments, compiled by the cluster's XLA
        own = dict(precision=args.precision or "fp32", lowering=cost.lowering_for_platform(cluster.platform)) if cfg \
            else dict(precision=args.precision or "mixed")
        result = cost.plan(model, cluster, top=args.top, dtype=dtype, **own, fp8_options=fp8,
                           muon=muon_settings(cfg) if cfg else None, offload=False if cfg is not None and
                           cfg.optimizer.name in HOST_UPDATE_REFUSED else None, **cp)
    except (cost.ClusterError, cost.PlanError) as e:
        raise ConfigError(str(e)) from None
    print(plan_report(model, cluster, result, args.top, changed_overrides(cfg), as_json=args.json,
                      config=cfg is not None))
    if args.write:
        print(write_plan_config(args.write, args.config, args.overrides, chosen_plan(result, args.choose)))
    if args.verify:
        verify_plans(model, cluster, result.ranked[: args.top], target)
    return 0

