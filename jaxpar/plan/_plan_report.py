"""``jaxpar plan``'s text: the ranked plans with the overrides that run each (:func:`plan_overrides`), the lines on
FP8 and memory offloading, and ``--verify``'s table of predicted vs compiled bytes (:func:`verify_plans`).

Example::

    >>> from jaxpar.cost import Plan
    >>> plan_overrides(Plan(data=8))[:2]
    ['mesh.pipe=1', 'mesh.data=8']
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from typing import Any, Callable, Sequence

from jaxpar._text import format_bytes, render_table
from jaxpar.analysis import compile_and_compare
from jaxpar.cost import memory_per_device
from jaxpar.cost._capacity import PLAN_MARGIN
from jaxpar.cost._host_link import host_bytes, transfer_bytes
from jaxpar.cost._parallel import AXES, MODELLED
from jaxpar.cost._traffic import lowering_for_platform
from jaxpar.devices._distributed import setup_devices
from jaxpar.devices._targets import fp8_problem, load_spec, presets, target_devices
from jaxpar.errors import ConfigError, JaxparError


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
    an option object as a mapping, ``{}`` for none; ``context`` on a ``context`` axis only), its stages' layers
    (``null``: even), and the model's remat policy.

    Args:
      plan: the plan (e.g. ``jaxpar.cost.plan(...).best.plan``).

    Returns:
      ``key=value`` strings.

    >>> from jaxpar.cost import Plan
    >>> from jaxpar.strategy import Strategy
    >>> interleaved = Strategy(microbatches=8, schedule="interleaved", virtual_stages=2)
    >>> plan_overrides(Plan(pipe=2, data=4, strategy=interleaved))[-6:]
    ['parallel.virtual_stages=2', 'parallel.context={}', 'parallel.fp8={}', 'parallel.offload={}', 'parallel.stage_layers=null', 'model.remat=none']
    >>> from jaxpar.options import Fp8
    >>> plan_overrides(Plan(fsdp=8, strategy=Strategy(fp8=Fp8())))[-4]
    'parallel.fp8={recipe: tensorwise, min_dim: 1024}'
    """
    s = plan.strategy
    remat = "offload" if s.offload and s.offload.activations else plan.remat
    out = [f"mesh.{a}={getattr(plan, a)}" for a in AXES] + ["mesh.replica=1"]
    value = lambda k: getattr(s, k) if k != "context" or plan.context > 1 else None     # noqa: E731
    out += [f"parallel.{k}={'{}' if value(k) is None else yaml_text(value(k))}" for k in MODELLED
            if k != "stage_layers"]
    stages = s.stage_layers if plan.pipe > 1 else None          # even stages unless the plan says otherwise
    return out + [f"parallel.stage_layers={'null' if stages is None else yaml_text(stages)}", f"model.remat={remat}"]


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


def verify_plans(estimates: Sequence[Any], check: Callable[[Any], dict], capacity: Any, heading: str,
                 lowering: str) -> list[Any]:
    """``jaxpar plan --verify``: compile each plan's train step ahead of time (``check``; nothing runs) and print
    predicted vs compiled argument bytes, peak memory and bytes per mesh axis, one row per plan compiled, with
    whether its compiled peak fits ``capacity``; then the line on those dropped (:func:`verified_fits`), which
    names exactly the rows that do not fit.

    Args:
      estimates: the ranked plans' estimates.
      check: compiles a plan and returns its figures: ``{"arguments": (predicted, compiled), "peak": (predicted,
        compiled), "axes": {axis: (predicted, compiled)}}`` in bytes per device (:func:`gpt_check`,
        :func:`compiled_check`); a :class:`jaxpar.errors.JaxparError` it raises marks the plan's row ``error``.
      capacity: the :class:`jaxpar.cost._capacity.Capacity` a compiled peak must fit (the target's, else the
        cluster's: the one rule).
      heading: the ``verify`` line: what is compiled, where, and in what precision.
      lowering: the cost model's lowering of the bytes per axis.

    Returns:
      The estimates whose compiled peak fits.
    """
    print(f"\nverify   {len(estimates)} plans compiled ahead of time {heading}")
    rows, peaks, errors = [], [], []
    for e in estimates:
        t0 = time.perf_counter()
        try:
            r = check(e.plan)
        except JaxparError as err:
            errors.append(f"error    {e.plan.name()}: {err}")
            peaks.append(None)
            rows.append([e.plan.name()] + ["-"] * 9 + ["error"])
            continue
        (pa, ca), (pm, cm) = r["arguments"], r["peak"]
        peaks.append(cm)
        axes = r["axes"]
        worst = max((abs(p - c) / c if c else float(p > 0) for p, c in axes.values()), default=0.0)
        rows.append([e.plan.name(), format_bytes(pa), format_bytes(ca), f"{abs(pa - ca) / ca:.2%}",
                     format_bytes(pm), format_bytes(cm), f"{pm / cm:.2f}",
                     " ".join(f"{ax}:{p / c:.3f}" if c else f"{ax}:-" for ax, (p, c) in axes.items()) or "-",
                     f"{worst:.1%}", f"{time.perf_counter() - t0:.0f}",
                     "yes" if cm <= capacity.usable else "NO"])
    print(render_table(["plan", "args predicted", "args compiled", "args error", "peak predicted", "peak compiled",
                        "peak ratio", f"bytes per axis predicted/compiled ({lowering})", "worst axis error",
                        "compile s", "fits"], rows, right=[False] + [True] * 6 + [False, True, True, False]))
    if errors:
        print("\n".join(errors))
    kept, line = verified_fits(estimates, peaks, capacity)
    print(line)
    return kept


def verified_fits(estimates: Sequence[Any], peaks: Sequence[float | None], capacity: Any) -> tuple[list[Any], str]:
    """The verified plans whose compiled peak fits ``capacity``, and a line on those dropped: the plans that do not
    fit, then those that did not compile.

    Args:
      estimates: the plans' estimates.
      peaks: their compiled peaks per device, in order (None: it did not compile).
      capacity: the :class:`jaxpar.cost._capacity.Capacity` they must fit.

    Returns:
      ``(kept, line)``.

    >>> from jaxpar.cost import Plan
    >>> from jaxpar.cost._capacity import Capacity
    >>> e = [type("E", (), {"plan": Plan(data=8)})(), type("E", (), {"plan": Plan(fsdp=8)})()]
    >>> kept, line = verified_fits(e, [2 * 2**30, 5 * 2**30], Capacity(4 * 2**30))
    >>> [k.plan.name() for k in kept], line
    (['dp8'], 'dropped  fsdp8: its compiled peak does not fit 4.0 GiB usable (all of the device memory)')
    """
    kept = [e for e, peak in zip(estimates, peaks) if peak is not None and peak <= capacity.usable]
    big = [e.plan.name() for e, peak in zip(estimates, peaks) if peak is not None and peak > capacity.usable]
    failed = [e.plan.name() for e, peak in zip(estimates, peaks) if peak is None]
    if not big and not failed:
        return kept, f"fits     every compiled peak above fits {capacity.text()}"
    what = "its compiled peak does not" if len(big) == 1 else "their compiled peaks do not"
    parts = ([f"{', '.join(big)}: {what} fit {capacity.text()}"] if big else []) + \
        ([f"{', '.join(failed)}: {'it does' if len(failed) == 1 else 'they do'} not compile (error above)"]
         if failed else [])
    none = "; none of the plans verified is known to fit" if not kept else ""
    return kept, f"dropped  {'; '.join(parts)}{none}"


def gpt_check(model: Any, devices: Sequence[Any], lowering: str, keeps: str) -> Callable[[Any], dict]:
    """:func:`verify_plans`'s ``check`` for jaxpar's GPT of the cost model's sizes (``jaxpar plan`` without
    ``--config``): the step compiled with fp32 parameters, activations and Adam moments
    (:func:`jaxpar.analysis.compile_and_compare`), the peak predicted in the same precision.

    Args:
      model: the cost model's GPT.
      devices: the devices to compile for (:func:`verify_devices`).
      lowering: the cost model's lowering of the bytes per axis.
      keeps: the activation table of the peak's prediction: ``"paper"`` or a platform (:func:`jaxpar.cost.memory_per_device`).

    Returns:
      The function, ``plan -> figures``.
    """
    def check(plan: Any) -> dict:
        r = compile_and_compare(model, plan, devices=devices, lowering=lowering)
        mem = memory_per_device(model, plan, precision="fp32", activation_bytes=4, keeps=keeps).total
        axes = {a: (v["predicted"], v["compiled"]) for a, v in r["axes"].items()}
        return {"arguments": (r["arguments"]["predicted"], r["arguments"]["compiled"]), "peak": (mem, r["peak_bytes"]),
                "axes": axes}
    return check


def verify_devices(n: int, target: Any) -> tuple[list, str, str]:
    """The devices ``jaxpar plan --verify`` compiles ``n``-device plans for: the target's, else ``n`` simulated CPU
    devices.

    Args:
      n: the plans' device count.
      target: a :class:`jaxpar.devices.Target` (None: the CPU).

    Returns:
      ``(devices, where they are, the cost model's lowering for their compiler)``.

    Raises:
      ConfigError: a target of another device count, or more than 256 simulated devices.
    """
    if target is not None:
        if target.num_devices != n:
            raise ConfigError(f"--target {target} has {target.num_devices} devices, but the plans are for {n}; "
                              f"give --devices {target.num_devices} or a target of {n} devices.")
        return (target_devices(target), f"by the {target.spec.platform} compiler for {target}",
                lowering_for_platform(target.spec.platform))
    if n > 256:
        raise ConfigError(f"--verify simulates the cluster's {n} devices on the CPU; at most 256 (use --devices, "
                          f"or --target to compile for real devices).")
    return setup_devices(n), f"on {n} simulated CPU devices", "xla-cpu"


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


def capacity_line(cluster: Any) -> str:
    """``jaxpar plan``'s capacity line: the one capacity rule (:attr:`jaxpar.cost.Cluster.capacity`) and the margin.

    >>> from jaxpar import cost
    >>> capacity_line(cost.load_cluster("tpu_v5e"))
    'capacity 16.0 GiB usable (all of the device memory); a plan is ranked when its predicted peak + 10% fits'
    """
    return (f"capacity {cluster.capacity.text()}; a plan is ranked when its predicted peak + {PLAN_MARGIN:.0%} fits")


def plan_report(model: Any, cluster: Any, result: Any, top: int, changed: Callable[[Any], list[str]], *,
                as_json: bool = False, config: bool = False) -> str:
    """``jaxpar plan``'s output: the model, the cluster and the ranked and rejected plans, each ranked one with
    its overrides (:func:`plan_overrides`; in the table those the config lacks, ``changed``).

    Args:
      model: the cost model's model.
      cluster: the cluster.
      result: :func:`jaxpar.cost.plan`'s result.
      top: how many plans to show.
      changed: a plan's overrides that the config (or the schema's defaults) lacks.
      as_json: JSON instead of tables.
      config: whether the plans are ``--config``'s.

    Returns:
      The text.
    """
    if as_json:
        cap = cluster.capacity
        return json.dumps({"cluster": cluster.name, "devices": cluster.num_devices, "model": model.name,
                           "capacity": {"usable_bytes": cap.usable, "text": cap.text(), "margin": PLAN_MARGIN},
                           "parameters": model.n_params, "considered": result.considered,
                           "ranked": [{**e.row(), "overrides": plan_overrides(e.plan)} for e in result.ranked[:top]],
                           "rejected": [{"plan": r.plan.name() if r.plan else None, "reason": r.reason}
                                        for r in result.rejected[:top]]}, indent=2)
    lines = [f"model    {model.name}: {model.n_params:,} parameters, batch {model.batch} x {model.seq}",
             f"cluster  {cluster.name}: {cluster.num_devices} devices ({cluster.nodes} x {cluster.devices_per_node})",
             capacity_line(cluster),
             f"plans    {result.considered} considered, {len(result.ranked)} fit, {len(result.rejected)} rejected",
             result.table(top)]
    if result.ranked:
        lines.append(f"\noverrides that make {'the config' if config else 'a config'} run each plan (jaxpar train CONFIG "
                     "...; jaxpar plan --write FILE --choose N writes it):")
        lines += [f"  {i:>2}  {shlex.join(changed(e.plan)) or '(none)'}"
                  for i, e in enumerate(result.ranked[:top], 1)]
    lines.append(fp8_line(result, cluster))
    if line := offload_line(model, cluster, result):
        lines.append(line)
    if result.rejected:
        lines += ["", result.rejected_table(min(top, 5))]
    if getattr(result, "refused", None):
        lines += ["", result.refused_table(min(top, 5))]
    return "\n".join(lines)
