"""``jaxpar plan``: rank the plans of a config's model (``--config``) or of jaxpar's GPT of given sizes on a cluster
(:func:`jaxpar.plan.rank_plans`), print them with the overrides that run each (:func:`jaxpar.plan.plan_report`),
write the chosen one as a config (``--write``), and compile the top ones (``--verify``: a config's own model through
its job builder, as ``jaxpar inspect`` compiles it).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from jaxpar import cost
from jaxpar._text import shown_path
from jaxpar.commands._job_devices import compile_job
from jaxpar.commands._planner_options import changed_overrides, plan_options
from jaxpar.config._cost_model import cost_model, muon_settings
from jaxpar.config._job import build_job
from jaxpar.config._load import load_config, to_yaml
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.devices import parse_target
from jaxpar.plan import (chosen_plan, compiled_check, gpt_check, on_target, plan_overrides, plan_report, planner_view,
                         rank_plans, verify_devices, verify_plans)


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
    if cfg is not None:
        return cost_model(cfg, build_job(cfg, mesh=False, data=False).model_fn, **sizes)
    missing = [k for k, v in sizes.items() if not v]
    if missing:
        raise ConfigError(f"jaxpar plan needs --config CONFIG or the model's sizes; missing "
                          f"{', '.join('--' + k for k in missing)}.")
    return cost.gpt(sizes["layers"], sizes["hidden"], sizes["heads"], sizes["seq"], sizes["vocab"], sizes["batch"])


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
    out = Path(path)
    if out.exists():
        raise ConfigError(f"--write {path}: the file exists; jaxpar never overwrites a file. Choose another path.")
    cfg = _own_run(load_config(config, [*overrides, *plan_overrides(plan)]))
    out.write_text(f"# jaxpar plan's {plan.name()}: {config} {' '.join(overrides)}\n"
                   f"# the keys that differ from jaxpar's defaults\n{to_yaml(cfg, defaults=False)}")
    return f"wrote    {shown_path(out)}: {plan.name()} (jaxpar check {shown_path(out)})"


def _own_run(cfg: JobConfig) -> JobConfig:
    """``cfg`` with its name, run directory and checkpoint directory left to the file it is written to, where they
    are the ones the source's name gave it."""
    train, ckpt = cfg.train, cfg.checkpoint
    out_dir = "" if train.out_dir == f"runs/{cfg.name}" else train.out_dir
    ckpt_dir = "" if ckpt.dir == str(Path(train.out_dir) / "checkpoints") else ckpt.dir
    return dataclasses.replace(cfg, name="", train=dataclasses.replace(train, out_dir=out_dir),
                               checkpoint=dataclasses.replace(ckpt, dir=ckpt_dir))


def config_check(config: str, overrides: Sequence[str], model: Any, devices: Sequence[Any], target: Any,
                 cluster: str) -> Callable[[Any], dict]:
    """``jaxpar plan --config --verify``'s ``check`` (:func:`jaxpar.plan.verify_plans`): the config with a plan's
    overrides built by its own job builder and its train step compiled as ``jaxpar inspect`` compiles it (the
    config's model, in its compute dtype), beside the prediction of ``inspect``'s table.

    Args:
      config: the ``--config`` file.
      overrides: its overrides.
      model: the cost model's model of the config (:func:`plan_model`).
      devices: the devices to compile for (:func:`jaxpar.plan.verify_devices`).
      target: the :class:`jaxpar.devices.Target` (None: simulated CPU devices).
      cluster: the cluster preset (or YAML path) of the prediction.

    Returns:
      The function, ``plan -> figures`` (:func:`jaxpar.plan.compiled_check`).
    """
    platform = target.spec.platform if target is not None else "cpu"

    def check(plan: Any) -> dict:
        cfg = load_config(config, [*overrides, *plan_overrides(plan), f"train.devices={len(devices)}"])
        job = build_job(cfg, devices, data=False)
        layout = job.state_layout()
        step = compile_job(job, layout, target)["step"]
        view = planner_view(model, dict(job.mesh.shape), job.strategy, cluster, remat=cfg.model.remat,
                            muon=muon_settings(cfg), platform=platform)
        return compiled_check(step, job.mesh, view, job.steps_per_call)
    return check


def _verify(args: argparse.Namespace, cfg: JobConfig | None, model: Any, cluster: Any, result: Any,
            target: Any) -> None:
    """``--verify``: compile the top plans, the config's own model through its job builder (else jaxpar's GPT of
    the sizes given, fp32) and print the table."""
    devices, where, lowering = verify_devices(cluster.num_devices, target)
    capacity = target.capacity if target is not None else cluster.capacity
    if cfg is None:
        keeps = "paper" if target is None else target.spec.platform   # the target's compiler's tables
        check = gpt_check(model, devices, lowering, keeps)
        what = "jaxpar's GPT, fp32 parameters and Adam moments; the prediction below uses the same precision"
    else:
        check = config_check(args.config, args.overrides, model, devices, target, args.cluster or "h100")
        what = (f"the config's model, {model.name}, built by its job as jaxpar inspect builds it: "
                f"{cfg.parallel.compute_dtype} compute, fp32 parameters and Adam moments; predicted as inspect does")
    verify_plans(result.ranked[: args.top], check, capacity, f"{where} ({what})", lowering)


def run_plan(args: argparse.Namespace) -> int:
    """``jaxpar plan``: rank every plan of the model on the cluster (:func:`jaxpar.plan.rank_plans`, with the
    options of :func:`plan_options`, as ``jaxpar inspect`` does); ``--verify`` compiles the top plans (on simulated
    CPU devices, or with ``--target``'s real compiler) and compares memory and bytes.

    Args:
      args: the parsed ``jaxpar plan`` arguments (:func:`jaxpar.cli.build_parser`).

    Returns:
      The exit status (0).
    """
    target = None
    if args.target:
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
        options = plan_options(cfg, cluster, dtype=args.dtype, precision=args.precision, contexts=args.contexts,
                               context_methods=args.context_methods)
        result = rank_plans(model, cluster, options, top=args.top)
    except (cost.ClusterError, cost.PlanError) as e:
        raise ConfigError(str(e)) from None
    print(plan_report(model, cluster, result, args.top, changed_overrides(cfg), as_json=args.json,
                      config=cfg is not None))
    if args.write:
        print(write_plan_config(args.write, args.config, args.overrides, chosen_plan(result, args.choose)))
    if args.verify:
        _verify(args, cfg, model, cluster, result, target)
    return 0

