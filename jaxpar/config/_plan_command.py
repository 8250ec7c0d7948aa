"""The cost model's view of a config, for ``jaxpar inspect`` and ``jaxpar plan --config``: the
config's model as a :class:`jaxpar.cost.ModelSpec`, its mesh and strategy as a
:class:`jaxpar.cost.Plan` with the cost model's estimate, and the table that sets that prediction
beside a compiled train step.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import build_strategy, load_config
    >>> cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    >>> cost_model(cfg).n_params > 0, cost_model(cfg, batch=8).batch
    (True, 8)
    >>> view = planner_view(cfg, {"data": 2, "fsdp": 2, "tensor": 2}, build_strategy(cfg.parallel), "cpu_sim")
    >>> view.plan.name(), view.estimate.time.total > 0
    ('dp2-fsdp2-tp2', True)
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from jaxpar.compat._settings import FLUSH_SCHEDULES
from jaxpar.strategy import Strategy
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.errors import Fp8Error


class PlannerView(NamedTuple):
    """The cost model's description of a config's job: ``model``, ``plan`` and its ``estimate``."""

    model: Any
    plan: Any
    estimate: Any


def cost_model(cfg: JobConfig, model_fn: Callable | None = None, *, batch: int | None = None,
               layers: int | None = None, hidden: int | None = None, heads: int | None = None,
               seq: int | None = None, vocab: int | None = None):
    """The :class:`jaxpar.cost.ModelSpec` of the config's model and global batch.

    Args:
      cfg: the config.
      model_fn: the model factory of a model of your own (``Job.model_fn``; None: built from the config);
        the GPT and ``model.hf`` need none.
      batch: the global batch (default ``data.batch_size``).
      layers, hidden, heads, seq, vocab: a model of your own: the sizes the cost model cannot read from
        its parameters (default 1); ``seq`` also a decoder's (default ``model.seq_len``).

    Returns:
      The model spec: :func:`jaxpar.cost.gpt` of the GPT's keys; :func:`jaxpar.cost.from_decoder_config` of
      ``model.hf``'s ``config.json`` (no weights read) or of a ``model.target`` that builds a
      :class:`jaxpar.models.Decoder`; else :func:`jaxpar.cost.from_nnx` of the model with the sizes given.
    """
    from jaxpar import cost
    from jaxpar.config._decoder_config import decoder_config_of

    m, batch = cfg.model, batch or cfg.data.batch_size
    if m.target is not None or m.hf is not None:
        if (decoder := decoder_config_of(m, model_fn)) is not None:
            return cost.from_decoder_config(decoder, seq=seq or m.seq_len, batch=batch, name=m.name)
        return cost.from_nnx(model_fn, layers=layers or 1, hidden=hidden or 1, heads=heads or 1, seq=seq or 1,
                             vocab=vocab or 1, batch=batch, name=m.name)
    moe = {}
    if m.moe:             # model.moe (the GPT's MoESettings): its experts, routing and layers
        from jaxpar.config._build import build_moe

        s = build_moe(m.moe)
        moe = dict(experts=s.experts, top_k=s.top_k, capacity_factor=s.capacity_factor, moe_every=s.every,
                   shared_mlp=s.shared_mlp)
    return cost.gpt(m.layers, m.embed, m.heads, m.seq_len, m.vocab, batch, mlp=m.mlp, name=cfg.name, **moe)


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
    from jaxpar import cost
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


def fp8_cluster_problem(cluster: str) -> str | None:
    """Why ``parallel.fp8`` cannot run on the devices of a cluster preset: the first target that uses the
    preset and has no FP8 GEMMs (:func:`jaxpar.devices._targets.fp8_problem`); None for a preset no target
    uses (``cpu_sim``: the simulated mesh emulates FP8) or whose targets have them.

    Args:
      cluster: the cluster preset's name.

    Returns:
      The message, naming the target, the option and the fix, or None.

    >>> print(fp8_cluster_problem("tpu_v5e"))      # doctest: +ELLIPSIS
    target tpu-v5e has no FP8 GEMMs: parallel.fp8 runs the covered matmuls as FP8 GEMMs, ...
    >>> fp8_cluster_problem("cpu_sim"), fp8_cluster_problem("h100")
    (None, None)
    """
    from jaxpar.devices._targets import fp8_problem, load_spec, presets

    return next((why for spec in map(load_spec, presets()) if spec.cluster == cluster and (why := fp8_problem(spec))),
                None)


def yaml_text(value: Any) -> str:
    """``value`` as YAML flow text, for an override: an option object (a dataclass) as the mapping of all its
    fields, None as ``null``.

    Args:
      value: a plain value, tuple, mapping or dataclass.

    Returns:
      The text.

    >>> from jaxpar.options import Offload
    >>> yaml_text(Offload(optimizer=True, update="host")), yaml_text((2, 1)), yaml_text(None)
    ('{optimizer: true, master: false, activations: [], update: host}', '[2, 1]', 'null')
    """
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def plan_overrides(plan: Any) -> list[str]:
    """The dotted overrides that make a config run a :class:`jaxpar.cost.Plan` (``jaxpar train CONFIG
    *overrides``): its mesh, the strategy's fields the cost model reads (:data:`jaxpar.cost._parallel.MODELLED`,
    an option object as a mapping, ``{}`` for none; ``context`` on a ``context`` axis only), even stages, and
    the model's remat policy.

    Args:
      plan: the plan (e.g. ``jaxpar.cost.plan(...).best.plan``).

    Returns:
      ``key=value`` strings.

    >>> from jaxpar.cost import Plan
    >>> interleaved = Strategy(microbatches=8, schedule="interleaved", virtual_stages=2)
    >>> plan_overrides(Plan(pipe=2, data=4, strategy=interleaved))[-6:]
    ['parallel.virtual_stages=2', 'parallel.context={}', 'parallel.fp8={}', 'parallel.offload={}', 'parallel.stage_layers=null', 'model.remat=none']
    >>> from jaxpar.options import Fp8
    >>> plan_overrides(Plan(fsdp=8, strategy=Strategy(fp8=Fp8())))[-4]
    'parallel.fp8={recipe: tensorwise, min_dim: 1024}'
    """
    from jaxpar.cost._parallel import AXES, MODELLED

    s = plan.strategy
    remat = "offload" if s.offload and s.offload.activations else plan.remat
    out = [f"mesh.{a}={getattr(plan, a)}" for a in AXES] + ["mesh.replica=1"]
    value = lambda k: getattr(s, k) if k != "context" or plan.context > 1 else None     # noqa: E731
    out += [f"parallel.{k}={'{}' if value(k) is None else yaml_text(value(k))}" for k in MODELLED]
    return out + ["parallel.stage_layers=null", f"model.remat={remat}"]


def changed_overrides(plan: Any, cfg: JobConfig | None = None) -> list[str]:
    """The overrides of :func:`plan_overrides` whose value ``cfg`` (default: the schema's defaults) lacks.

    Args:
      plan: the plan.
      cfg: the config the overrides apply to.

    Returns:
      ``key=value`` strings.

    >>> from jaxpar.cost import Plan
    >>> changed_overrides(Plan(pipe=2, data=4, strategy=Strategy(microbatches=8)))
    ['mesh.pipe=2', 'mesh.data=4', 'parallel.microbatches=8']
    """
    from omegaconf import OmegaConf

    from jaxpar.config._load import parse_overrides

    base = OmegaConf.structured(cfg if cfg is not None else JobConfig())
    def differs(item: str) -> bool:
        key = item.split("=", 1)[0]
        want = OmegaConf.select(OmegaConf.create(parse_overrides([item])), key)
        have = OmegaConf.select(base, key)
        return OmegaConf.to_container(want) != OmegaConf.to_container(have) if OmegaConf.is_config(want) \
            else want != have
    return [item for item in plan_overrides(plan) if differs(item)]


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


def chosen_plan(result: Any, rank: int) -> Any:
    """The plan of ``rank`` (1: the best) among :func:`jaxpar.cost.plan`'s ranked ones.

    Args:
      result: the planner's result.
      rank: ``--choose``.

    Returns:
      The :class:`jaxpar.cost.Plan`.

    Raises:
      ConfigError: no plan of that rank.
    """
    if not 1 <= rank <= len(result.ranked):
        raise ConfigError(f"--choose {rank}: the planner ranked {len(result.ranked)} plan(s); choose 1.."
                          f"{len(result.ranked)}" if result.ranked else f"--choose {rank}: no plan fits, so none "
                          "is written.")
    return result.ranked[rank - 1].plan


def unpredicted(cfg: JobConfig, strategy: Strategy, mesh_sizes: Mapping[str, int]) -> str | None:
    """Why the cost model predicts nothing for this job (None: it does): a model of your own (``model.target``
    that builds no :class:`jaxpar.models.Decoder`), or a pipeline schedule it does not know.

    Args:
      cfg: the config.
      strategy: its strategy (read for a pipeline of ``mesh_sizes`` only).
      mesh_sizes: the mesh's axis sizes.

    Returns:
      The reason, or None.
    """
    from jaxpar.config._decoder_config import decoder_config_of

    if cfg.model.target is not None and decoder_config_of(cfg.model) is None:
        return (f"the cost model describes jaxpar's GPT and Decoder (model.hf) only; model.target={cfg.model.target!r} "
                "is a model of your own")
    if mesh_sizes.get("pipe", 1) > 1 and strategy.schedule not in FLUSH_SCHEDULES:
        return (f"the cost model knows the pipeline schedules {', '.join(FLUSH_SCHEDULES)}, not "
                f"parallel.schedule={strategy.schedule!r}")
    return None


def planner_view(cfg: JobConfig, mesh_sizes: Mapping[str, int], strategy: Strategy, cluster_name: str, *,
                 lowering: str = "xla-cpu") -> PlannerView:
    """The cost model's plan and estimate for the config's GPT on its mesh (see :func:`unpredicted`
    for the jobs it does not describe).

    Args:
      cfg: the config.
      mesh_sizes: the mesh's axis sizes.
      strategy: the config's strategy.
      cluster_name: a cluster preset or YAML path (its devices are set to the mesh's).
      lowering: the cost model's lowering (:data:`jaxpar.cost._traffic.LOWERINGS`; for a platform,
        :func:`~jaxpar.cost._traffic.lowering_for_platform`): ``xla-cpu`` for the simulated CPU mesh,
        ``xla`` and ``xla-tpu`` for the GPU and TPU compilers.

    Returns:
      The :class:`PlannerView`, estimated for ``lowering`` with fp32 parameters and moments (with the
      strategy's FP8 where the cluster has FP8 GEMMs).
    """
    from jaxpar import cost
    from jaxpar.cost._host_link import plan_offload
    from jaxpar.cost._parallel import AXES
    from jaxpar.cost._planner import evaluate

    model = cost_model(cfg)
    remat = "full" if cfg.model.remat == "offload" else cfg.model.remat
    sizes = {a: mesh_sizes.get(a, 1) for a in AXES}
    plan = cost.Plan(**sizes, remat=remat, strategy=replace(strategy, zero=strategy.zero if sizes["data"] > 1 else 0,
                                                            offload=plan_offload(strategy.offload, cfg.model.remat)))
    n = plan.devices
    cluster = cost.load_cluster(cluster_name)
    cluster = cluster.with_devices(n) if n <= cluster.devices_per_node or n % cluster.devices_per_node == 0 else \
        cost.load_cluster(cluster_name, nodes=1)
    if not cluster.has_fp8:         # FP8 is emulated there: the step's own matmuls
        plan = plan.with_strategy(fp8=None)
    dtype = "float32" if strategy.compute_dtype == "float32" else "bfloat16"
    if dtype not in cluster.compute_dtypes:
        dtype = cluster.compute_dtypes[0]
    return PlannerView(model, plan, evaluate(model, plan, cluster, dtype=dtype, precision="fp32", lowering=lowering,
                                             muon=muon_settings(cfg)))


def muon_settings(cfg: JobConfig) -> dict | None:
    """``optimizer.muon``'s ``ns_steps`` and ``placement`` for the cost model (None: another optimizer)."""
    m = cfg.optimizer.muon
    return dict(ns_steps=m.ns_steps, placement=m.placement) if cfg.optimizer.name == "muon" else None


def _ratio(p: float, g: float) -> str:
    return f"{p / g:.3f}" if g else ("-" if not p else "inf")


def _predicted(view: Any, strategy: Strategy, lowering: str, platform: str, muon: dict | None = None) -> tuple:
    """The cost model's side of :func:`planner_table`: bytes per axis, arguments, temporaries and peak."""
    from jaxpar.cost import PLATFORM_CLUSTERS, device_argument_bytes, muon_comms, muon_update
    from jaxpar.cost._device_bytes import layout_for_platform
    from jaxpar.cost._host_link import host_bytes
    from jaxpar.cost._traffic import bytes_per_axis, comms

    model, plan, est = view
    act = 2 if strategy.compute_dtype == "bfloat16" else 4
    grad = 4 if lowering == "xla-cpu" else act     # GPU / TPU: XLA reduces the compute dtype's gradients
    cs = comms(model, plan, lowering=lowering, compute_bytes=act, grad_bytes=grad)
    if muon is not None:        # Newton-Schulz's placements, chosen on the platform's cluster as the optimizer does
        chooser = PLATFORM_CLUSTERS.get(platform, "h100")
        cs = cs + muon_comms(muon_update(model, plan.sizes, chooser, zero=plan.strategy.zero, **muon))
    pred = bytes_per_axis(cs)
    mem = est.memory
    muon_state = {} if muon is None else {"matrix_moments": 1, "scalars": 3}    # Muon's momentum and its count
    args = device_argument_bytes(model, plan.sizes, plan.strategy.zero, layout=layout_for_platform(platform),
                                 **muon_state)
    args -= host_bytes(model, plan)          # offloaded: host-resident arguments, not the device's
    peak = mem.total if platform == "cpu" else predicted_peak(model, plan, mem.total, strategy.compute_dtype, platform)
    return pred, args, mem.activations + mem.logits, peak


def planner_table(cfg: JobConfig, compiled: Any, mesh: Any, strategy: Strategy, cluster: str,
                  steps_per_call: int = 1, *, lowering: str = "xla-cpu",
                  platform: str = "cpu") -> tuple[str, float | None]:
    """``jaxpar inspect``'s table: the cost model's bytes per axis, arguments, temporaries and peak
    next to the compiled step's, per device (for a pipelined plan, counted on the busiest stage).

    Args:
      cfg: the config.
      compiled: the compiled train step.
      mesh: its mesh.
      strategy: the config's strategy.
      cluster: the cluster preset (or YAML path) of the prediction.
      steps_per_call: optimizer steps per call of ``compiled`` (its bytes per axis are divided by it).
      lowering: the cost model's lowering (see :func:`planner_view`).
      platform: the compiled program's (``"cpu"``, ``"cuda"``, ``"tpu"``): its array layout, and on a
        target the compiled-step model of the peak (:func:`predicted_peak`).

    Returns:
      ``(text, peak)``: the heading, the table and the predicted step time (or why there is none); the
      predicted peak per device (``None``: not predicted).
    """
    from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
    from jaxpar._text import format_bytes, render_table
    from jaxpar.analysis._compiled_memory import memory_report

    sizes = dict(mesh.shape)
    rep = memory_report(compiled)
    why = unpredicted(cfg, strategy, sizes)
    view = planner_view(cfg, sizes, strategy, cluster, lowering=lowering) if why is None else None
    got = compiled_bytes_per_axis(compiled, mesh, view and view.plan) if mesh.size > 1 else {}
    got = {a: g / steps_per_call for a, g in got.items()}
    lines = [f"\nplanner  cost model (jaxpar.cost, lowering {lowering}, cluster {cluster}) vs the compiled step, "
             "per device"]
    pred, args, temps, peak = _predicted(view, strategy, lowering, platform, muon_settings(cfg)) if view else \
        ({}, None, None, None)

    def row(label: str, p: float | None, g: float) -> list[str]:
        return [label, "-" if p is None else format_bytes(p), format_bytes(g), "-" if p is None else _ratio(p, g)]

    rows = [row(f"bytes over {a} per step", pred.get(a, 0.0) if view else None, got.get(a, 0.0))
            for a in sorted(set(pred) | set(got))]
    rows += [row("arguments (state + batch)", args, rep.argument_bytes),
             row("temporaries" + (" (model: activations + logits)" if view else ""), temps, rep.temp_bytes),
             row("peak (the larger of args + outputs + temps - aliased and XLA's)", peak, rep.required_bytes)]
    table = render_table(["", "predicted", "compiled", "predicted / compiled"], rows, right=[False, True, True, True])
    if view is None:
        return "\n".join(lines + [table, f"time     not predicted: {why}"]), None
    t = view.estimate.time
    return "\n".join(lines + [table, (
        f"time     predicted {t.total * 1e3:.1f} ms per step on {cluster} (compute {t.compute * 1e3:.1f}, "
        f"data {t.data * 1e3:.1f}, tensor {t.tensor * 1e3:.1f}, pipeline {t.pipeline * 1e3:.1f}, update "
        f"{t.optimizer * 1e3:.1f}; bubble {t.bubble:.3f}); plan {view.plan.name()}"
        + "".join(f"; {gap}" for gap in t.unmodelled))]), peak


def predicted_peak(model: Any, plan: Any, planned: float, compute_dtype: str, platform: str) -> float:
    """The cost model's peak per device beside a compiled step: the compiled-step model
    (:func:`jaxpar.cost.step_peak_bytes`, measured against the GPU and TPU compilers in
    docs/planning.md §8) for the fp32 step of a dense GPT without context parallelism, else
    ``planned`` (the planner's memory estimate). The planner's is also the one that models offloaded
    layer inputs and the host update on one device (docs/planning.md §12).

    Args:
      model: the cost model's GPT (:class:`jaxpar.cost.ModelSpec`).
      plan: its :class:`jaxpar.cost.Plan`.
      planned: the planner's estimate, in bytes.
      compute_dtype: the strategy's compute dtype.
      platform: the target's platform (``"cuda"`` or ``"tpu"``).

    Returns:
      Bytes per device.

    >>> from jaxpar.cost import Plan, gpt
    >>> m = gpt(2, 64, 4, 32, 128, 8)
    >>> predicted_peak(m, Plan(data=2), 1.0, "float32", "cuda") > 1.0
    True
    >>> predicted_peak(m, Plan(), 1.0, "bfloat16", "cuda")      # not the fp32 step: the planner's
    1.0
    """
    from jaxpar.cost._device_bytes import step_peak_bytes

    o = plan.strategy.offload
    offloaded = o is not None and (o.activations or (o.host_update and plan.unsplit))
    if compute_dtype != "float32" or plan.context > 1 or plan.expert > 1 or model.moe_layers or offloaded:
        return planned
    return step_peak_bytes(model, plan, platform=platform)


def verify_plans(model: Any, cluster: Any, estimates: Sequence[Any], target: Any = None) -> None:
    """``jaxpar plan --verify``: compile each plan's train step ahead of time (jaxpar's GPT, fp32 Adam;
    nothing runs) on simulated CPU devices, or with the real compiler of ``target``, and print
    predicted vs compiled argument bytes, peak memory and bytes per mesh axis.

    Args:
      model: the cost model's GPT.
      cluster: the cluster (its device count is simulated; at most 256).
      estimates: the ranked plans' estimates.
      target: a :class:`jaxpar.devices.Target` with the cluster's device count (None: the CPU).

    Raises:
      ConfigError: more than 256 simulated devices.
    """
    import time

    from jaxpar._text import format_bytes, render_table
    from jaxpar.cost._memory import memory_per_device
    from jaxpar.analysis import compile_and_compare

    devices, where, lowering = _verify_devices(cluster.num_devices, target)
    print(f"\nverify   {len(estimates)} plans compiled ahead of time {where} (jaxpar's GPT, "
          f"fp32 parameters and Adam moments; the prediction below uses the same precision)")
    rows = []
    for e in estimates:
        p = e.plan
        t0 = time.perf_counter()
        r = compile_and_compare(model, p, devices=devices, lowering=lowering)
        mem = memory_per_device(model, p, precision="fp32", activation_bytes=4).total
        if target is not None:          # the compiled-step model, measured against the target's compiler
            mem = predicted_peak(model, p, mem, "float32", target.spec.platform)
        a = r["arguments"]
        peak = r["peak_bytes"]
        worst = max((v["error"] for v in r["axes"].values()), default=0.0)
        rows.append([p.name(), format_bytes(a["predicted"]), format_bytes(a["compiled"]), f"{a['error']:.2%}",
                     format_bytes(mem), format_bytes(peak), f"{mem / peak:.2f}",
                     " ".join(f"{ax}:{v['predicted'] / v['compiled']:.3f}" if v["compiled"] else f"{ax}:-"
                              for ax, v in r["axes"].items()) or "-", f"{worst:.1%}",
                     f"{time.perf_counter() - t0:.0f}"])
    print(render_table(["plan", "args predicted", "args compiled", "args error", "peak predicted", "peak compiled",
                        "peak ratio", f"bytes per axis predicted/compiled ({lowering})", "worst axis error",
                        "compile s"], rows, right=[False] + [True] * 6 + [False, True, True]))


def _verify_devices(n: int, target: Any) -> tuple[list, str, str]:
    """``(devices, where they are, the cost model's lowering)`` for ``verify_plans``."""
    if target is not None:
        from jaxpar.cost._traffic import lowering_for_platform
        from jaxpar.devices._targets import target_devices

        if target.num_devices != n:
            raise ConfigError(f"--target {target} has {target.num_devices} devices, but the plans are for {n}; "
                              f"give --devices {target.num_devices} or a target of {n} devices.")
        return (target_devices(target), f"by the {target.spec.platform} compiler for {target}",
                lowering_for_platform(target.spec.platform))
    if n > 256:
        raise ConfigError(f"--verify simulates the cluster's {n} devices on the CPU; at most 256 (use --devices, "
                          f"or --target to compile for real devices).")
    import jax

    from jaxpar.devices._distributed import setup_devices

    setup_devices(n)
    return jax.devices()[:n], f"on {n} simulated CPU devices", "xla-cpu"


def fp8_line(result: Any, cluster: Any) -> str:
    """``jaxpar plan``'s line on FP8: what the best plan gains with it, or why no plan has it.

    Args:
      result: :func:`jaxpar.cost.plan`'s result.
      cluster: the cluster planned on.

    Returns:
      The line.
    """
    best = result.best
    if best.without_fp8:
        fp8 = best.plan.strategy.fp8
        return (f"fp8      chosen ({fp8.recipe}, min_dim {fp8.min_dim}): predicted "
                f"{best.time.total * 1e3:.1f} ms per step with FP8, {best.without_fp8 * 1e3:.1f} ms without "
                f"({best.without_fp8 / best.time.total:.2f}x)")
    if not cluster.has_fp8:
        return f"fp8      not considered: cluster {cluster.name} has no FP8 GEMMs (no peak_tflops.float8)"
    if result.fp8 is None:
        return "fp8      not considered (fp8=False)"
    if not any(e.without_fp8 for e in result.ranked):
        return (f"fp8      considered, not chosen: no GEMM of the model reaches min_dim {result.fp8.min_dim}, "
                "or FP8 predicts no gain")
    return "fp8      considered: the best plan is faster without it"


def plan_offload(cfg: JobConfig | None) -> bool | None:
    """``jaxpar plan``'s ``offload`` for :func:`jaxpar.cost.plan`: False where the config's optimizer does not
    run in host memory (:data:`jaxpar.compat._offload_rules.HOST_UPDATE_REFUSED`), else None (offload when
    nothing fits, where the cluster has a host link). Without ``--config`` the planner's model is AdamW's."""
    from jaxpar.compat._offload_rules import HOST_UPDATE_REFUSED

    return False if cfg is not None and cfg.optimizer.name in HOST_UPDATE_REFUSED else None


def offload_line(model: Any, cluster: Any, result: Any) -> str | None:
    """``jaxpar plan``'s line on memory offloading, where the best plan has it (no plan fits without it):
    what lives in host memory, the predicted step with its host link and host update, and the slowdown.

    Args:
      model: the cost model's model.
      cluster: the cluster planned on.
      result: :func:`jaxpar.cost.plan`'s result.

    Returns:
      The line, or None (the best plan does not offload).
    """
    from jaxpar._text import format_bytes
    from jaxpar.cost._host_link import host_bytes, transfer_bytes

    best = result.best
    offload = best.plan.strategy.offload
    if not offload:
        return None
    moved, state = transfer_bytes(model, best.plan), host_bytes(model, best.plan)
    acts = (f", and the layers' inputs ({format_bytes(best.memory.host - state)}) go there in the forward and come "
            "back for the backward (model.remat=offload)") if offload.activations else ""
    link = f", {format_bytes(moved['to_host'])} to the host and {format_bytes(moved['to_device'])} back per step"
    slow = (f"; {best.without_offload * 1e3:.1f} ms without it (does not fit): "
            f"{best.time.total / best.without_offload:.2f}x slower") if best.without_offload else ""
    return (f"offload  proposed: no plan fits {cluster.num_devices} x {cluster.name} without it. The optimizer state "
            f"({format_bytes(state)} per device) lives in host memory and is updated there{acts} "
            f"(parallel.offload={yaml_text(offload)}): predicted {best.time.total * 1e3:.1f} ms "
            f"per step, {best.time.offload * 1e3:.1f} ms of it on the host link ({cluster.host_link / 1e9:g} GB/s "
            f"per direction{link}) and {best.time.optimizer * 1e3:.1f} ms the update in host memory "
            f"({cluster.host_memory_bandwidth / 1e9:g} GB/s){slow}; costed in jaxpar's fp32 layout (precision fp32)")


def plan_report(model: Any, cluster: Any, result: Any, top: int, *, as_json: bool = False,
                cfg: JobConfig | None = None) -> str:
    """``jaxpar plan``'s output: the model, the cluster and the ranked and rejected plans, each ranked one with
    its overrides (:func:`plan_overrides`; in the table those ``cfg`` lacks, :func:`changed_overrides`).

    Args:
      model: the cost model's model.
      cluster: the cluster.
      result: :func:`jaxpar.cost.plan`'s result.
      top: how many plans to show.
      as_json: JSON instead of tables.
      cfg: ``--config``'s config (None: none).

    Returns:
      The text.
    """
    if as_json:
        return json.dumps({"cluster": cluster.name, "devices": cluster.num_devices, "model": model.name,
                           "parameters": model.n_params, "considered": result.considered,
                           "ranked": [{**e.row(), "overrides": plan_overrides(e.plan)} for e in result.ranked[:top]],
                           "rejected": [{"plan": r.plan.name() if r.plan else None, "reason": r.reason}
                                        for r in result.rejected[:top]]}, indent=2)
    lines = [f"model    {model.name}: {model.n_params:,} parameters, batch {model.batch} x {model.seq}",
             f"cluster  {cluster.name}: {cluster.num_devices} devices ({cluster.nodes} x {cluster.devices_per_node})",
             f"plans    {result.considered} considered, {len(result.ranked)} fit, {len(result.rejected)} rejected",
             result.table(top)]
    if result.ranked:
        lines.append(f"\noverrides that make {'the config' if cfg else 'a config'} run each plan (jaxpar train CONFIG "
                     "...; jaxpar plan --write FILE --choose N writes it):")
        lines += [f"  {i:>2}  {shlex.join(changed_overrides(e.plan, cfg)) or '(none)'}"
                  for i, e in enumerate(result.ranked[:top], 1)]
    lines.append(fp8_line(result, cluster))
    if line := offload_line(model, cluster, result):
        lines.append(line)
    if result.rejected:
        lines += ["", result.rejected_table(min(top, 5))]
    if getattr(result, "refused", None):
        lines += ["", result.refused_table(min(top, 5))]
    return "\n".join(lines)


class RunPrediction(NamedTuple):
    """The cost model's prediction for ``jaxpar train``'s report (:func:`run_prediction`): the ``peak`` per
    device (None: not predicted) and what the prediction leaves out (``unmodelled``: the cluster preset's
    missing terms, the ``unmodelled`` of :class:`jaxpar.cost._time.StepTime`), which never stop the run."""

    peak: float | None
    cluster: str | None = None
    unmodelled: tuple[str, ...] = ()

    def line(self) -> str | None:
        """``predict  ...``: what the prediction lacks, in words (None: it lacks nothing).

        >>> from jaxpar._text import format_bytes
        >>> RunPrediction(2.0 ** 20, "cpu_sim", ("host transfers not modelled: cluster cpu_sim has no host "
        ...                                      "link (host_link_gbps)",)).line()
        'predict  cost model on cpu_sim: peak 1.0 MiB per device; host transfers not modelled: cluster cpu_sim has no host link (host_link_gbps)'
        """
        from jaxpar._text import format_bytes

        if not self.unmodelled:
            return None
        peak = f"peak {format_bytes(self.peak)} per device" if self.peak else "no peak"
        return f"predict  cost model on {self.cluster}: {peak}; {'; '.join(self.unmodelled)}"


def run_prediction(cfg: JobConfig, mesh: Any, strategy: Strategy) -> RunPrediction:
    """The cost model's prediction for ``jaxpar train``'s report: its peak per device as ``jaxpar inspect``
    predicts it on the run's platform, and what the cluster preset cannot model (a preset without a term,
    e.g. ``cpu_sim`` without a host link under ``parallel.offload``, leaves it out and says so).

    Args:
      cfg: the config.
      mesh: the run's mesh.
      strategy: the config's strategy.

    Returns:
      The :class:`RunPrediction` (its peak None: not predicted).
    """
    from jaxpar.cost._traffic import lowering_for_platform

    sizes = dict(mesh.shape)
    platform = {"gpu": "cuda"}.get(p := mesh.devices.flat[0].platform, p)
    cluster = {"cpu": "cpu_sim", "cuda": "h100"}.get(platform)
    if cluster is None or unpredicted(cfg, strategy, sizes) is not None:
        return RunPrediction(None)
    lowering = lowering_for_platform(platform)
    view = planner_view(cfg, sizes, strategy, cluster, lowering=lowering)
    peak = _predicted(view, strategy, lowering, platform)[3]
    return RunPrediction(peak, cluster, view.estimate.time.unmodelled)


def run_predicted_peak(cfg: JobConfig, mesh: Any, strategy: Strategy) -> float | None:
    """The cost model's peak per device for ``jaxpar train``'s report (None: not predicted).

    Args:
      cfg: the config.
      mesh: the run's mesh.
      strategy: the config's strategy.

    Returns:
      Bytes per device, as ``jaxpar inspect`` predicts them on the run's platform, or None
      (:func:`run_prediction`'s peak).
    """
    return run_prediction(cfg, mesh, strategy).peak
