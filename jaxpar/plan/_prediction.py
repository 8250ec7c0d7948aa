"""The cost model's prediction beside a compiled or a running train step: a model and a mesh's plan with its
estimate (:func:`planner_view`), ``jaxpar inspect``'s table of predicted vs compiled bytes
(:func:`planner_table`), ``jaxpar train``'s predicted peak (:func:`run_prediction`) and ``jaxpar profile``'s
predicted terms (:func:`predicted_rows`).

Example::

    >>> from jaxpar.cost import gpt
    >>> from jaxpar.strategy import Strategy
    >>> view = planner_view(gpt(2, 64, 4, 32, 128, 8), {"data": 2, "fsdp": 2, "tensor": 2}, Strategy(), "cpu_sim")
    >>> view.plan.name(), view.estimate.time.total > 0
    ('dp2-fsdp2-tp2', True)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, NamedTuple

from jaxpar import cost
from jaxpar._text import format_bytes, render_table
from jaxpar.analysis import find_trace, read_trace, step_profiles
from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
from jaxpar.analysis._compiled_memory import memory_report
from jaxpar.analysis._profile_report import (axes_key, expected_per_device, profile_record, profile_table,
                                             program_collectives)
from jaxpar.cost import (PLATFORM_CLUSTERS, device_argument_bytes, memory_per_device, muon_comms, muon_precision,
                         muon_update)
from jaxpar.cost._device_bytes import layout_for_platform
from jaxpar.cost._host_link import host_bytes, plan_offload
from jaxpar.cost._parallel import AXES
from jaxpar.cost._planner import evaluate
from jaxpar.cost._time import comm_time
from jaxpar.cost._traffic import bytes_per_axis, comms, lowering_for_platform
from jaxpar.strategy import Strategy

#: The cluster preset of ``jaxpar train``'s prediction on each platform (none: not predicted there).
RUN_CLUSTERS = {"cpu": "cpu_sim", "cuda": "h100"}


class PlannerView(NamedTuple):
    """The cost model's description of a job: ``model``, ``plan`` and its ``estimate`` on ``cluster`` (a
    :class:`jaxpar.cost.Cluster` of the plan's devices) for ``platform``'s compiler, with ``muon``'s settings."""

    model: Any
    plan: Any
    estimate: Any
    cluster: Any
    platform: str = "cpu"
    muon: dict | None = None


def platform_of(mesh: Any) -> str:
    """The JAX platform of a mesh's devices, ``"gpu"`` named ``"cuda"``.

    Args:
      mesh: the mesh.

    Returns:
      ``"cpu"``, ``"cuda"``, ``"tpu"``, ...
    """
    return {"gpu": "cuda"}.get(p := mesh.devices.flat[0].platform, p)


def planner_view(model: Any, mesh_sizes: Mapping[str, int], strategy: Strategy, cluster_name: str, *,
                 remat: str = "none", muon: dict | None = None, platform: str = "cpu") -> PlannerView:
    """The cost model's plan and estimate for a model on a mesh.

    Args:
      model: the cost model's model (:class:`jaxpar.cost.ModelSpec`).
      mesh_sizes: the mesh's axis sizes.
      strategy: the job's strategy.
      cluster_name: a cluster preset or YAML path (its devices are set to the mesh's).
      remat: the model's remat policy (``none``, ``full``, ``save-matmuls``, ``offload``).
      muon: Muon's ``ns_steps`` and ``placement`` (None: another optimizer).
      platform: the compiler's platform (``cpu``, ``cuda``, ``tpu``): the cost model's lowering
        (:func:`~jaxpar.cost._traffic.lowering_for_platform`).

    Returns:
      The :class:`PlannerView`, estimated with fp32 parameters and moments (with the strategy's FP8 where
      the cluster has FP8 GEMMs).
    """
    sizes = {a: mesh_sizes.get(a, 1) for a in AXES}
    plan = cost.Plan(**sizes, remat="full" if remat == "offload" else remat, strategy=replace(
        strategy, zero=strategy.zero if sizes["data"] > 1 else 0, offload=plan_offload(strategy.offload, remat)))
    n = plan.devices
    cluster = cost.load_cluster(cluster_name)
    cluster = cluster.with_devices(n) if n <= cluster.devices_per_node or n % cluster.devices_per_node == 0 else \
        cost.load_cluster(cluster_name, nodes=1)
    if not cluster.has_fp8:         # FP8 is emulated there: the step's own matmuls
        plan = plan.with_strategy(fp8=None)
    dtype = "float32" if strategy.compute_dtype == "float32" else "bfloat16"
    if dtype not in cluster.compute_dtypes:
        dtype = cluster.compute_dtypes[0]
    estimate = evaluate(model, plan, cluster, dtype=dtype, precision="fp32",
                        lowering=lowering_for_platform(platform), muon=muon)
    return PlannerView(model, plan, estimate, cluster, platform, muon)


def _ratio(p: float, g: float) -> str:
    return f"{p / g:.3f}" if g else ("-" if not p else "inf")


def _comms(view: PlannerView) -> list:
    """The cost model's collectives of the view's step, in its platform's lowering and dtypes."""
    lowering = lowering_for_platform(view.platform)
    act = 2 if view.plan.strategy.compute_dtype == "bfloat16" else 4
    grad = 4 if lowering == "xla-cpu" else act     # GPU / TPU: XLA reduces the compute dtype's gradients
    return comms(view.model, view.plan, lowering=lowering, compute_bytes=act, grad_bytes=grad)


#: What the table's predicted temporaries hold, by platform.
_TEMPS = {"cpu": " (model: activations + logits)"}


def _predicted(view: PlannerView) -> tuple:
    """The cost model's side of :func:`planner_table`: bytes per axis, arguments, temporaries and peak."""
    model, plan, est, _, platform, muon = view
    cs = _comms(view)
    if muon is not None:        # Newton-Schulz's placements, chosen on the platform's cluster as the optimizer does
        chooser = PLATFORM_CLUSTERS.get(platform, "h100")
        cs = cs + muon_comms(muon_update(model, plan.sizes, chooser, zero=plan.strategy.zero, **muon))
    pred = bytes_per_axis(cs)
    mem = est.memory if platform == "cpu" else _memory(model, plan, muon, platform)
    muon_state = {} if muon is None else {"matrix_moments": 1, "scalars": 3}    # Muon's momentum and its count
    args = device_argument_bytes(model, plan.sizes, plan.strategy.zero, layout=layout_for_platform(platform),
                                 **muon_state)
    args -= host_bytes(model, plan)          # offloaded: host-resident arguments, not the device's
    # on a GPU or TPU the temporaries are the peak less the arguments (gradients, activations, logits, gathered
    # weights: the measured model, docs/planning.md §8); XLA:CPU's are not predicted: the model's activations + logits
    return pred, args, mem.activations + mem.logits if platform == "cpu" else mem.total - args, mem.total


def planner_table(compiled: Any, mesh: Any, view: PlannerView | None, why: str | None, cluster: str,
                  steps_per_call: int = 1, *, platform: str = "cpu") -> tuple[str, float | None]:
    """``jaxpar inspect``'s table: the cost model's bytes per axis, arguments, temporaries and peak
    next to the compiled step's, per device (for a pipelined plan, counted on the busiest stage).

    Args:
      compiled: the compiled train step.
      mesh: its mesh.
      view: the cost model's view of the job (:func:`planner_view` on ``platform``; None: not predicted).
      why: why the cost model predicts nothing (with no ``view``).
      cluster: the cluster preset (or YAML path) of the prediction.
      steps_per_call: optimizer steps per call of ``compiled`` (its bytes per axis are divided by it).
      platform: the compiled program's (``"cpu"``, ``"cuda"``, ``"tpu"``): its array layout, and on a
        target its measured activation table (:func:`jaxpar.cost.memory_per_device`).

    Returns:
      ``(text, peak)``: the heading, the table and the predicted step time (or why there is none); the
      predicted peak per device (``None``: not predicted).
    """
    rep = memory_report(compiled)
    got = compiled_bytes_per_axis(compiled, mesh, view and view.plan) if mesh.size > 1 else {}
    got = {a: g / steps_per_call for a, g in got.items()}
    lines = [f"\nplanner  cost model (jaxpar.cost, lowering {lowering_for_platform(platform)}, cluster {cluster}) vs "
             "the compiled step, per device"]
    pred, args, temps, peak = _predicted(view) if view else ({}, None, None, None)

    def row(label: str, p: float | None, g: float) -> list[str]:
        return [label, "-" if p is None else format_bytes(p), format_bytes(g), "-" if p is None else _ratio(p, g)]

    rows = [row(f"bytes over {a} per step", pred.get(a, 0.0) if view else None, got.get(a, 0.0))
            for a in sorted(set(pred) | set(got))]
    rows += [row("arguments (state + batch)", args, rep.argument_bytes),
             row("temporaries" + (_TEMPS.get(platform, " (model: the peak less the arguments)") if view else ""),
                 temps, rep.temp_bytes),
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


def compiled_check(compiled: Any, mesh: Any, view: PlannerView, steps_per_call: int = 1) -> dict:
    """``jaxpar plan --verify``'s figures of a compiled train step (:func:`jaxpar.plan.verify_plans`) beside the cost
    model's view of it: the numbers of ``jaxpar inspect``'s table (:func:`planner_table`), the compiled peak its
    fit line's (:func:`jaxpar.plan.fit_lines`: the larger of the buffers' sum and XLA's own peak).

    Args:
      compiled: the compiled train step.
      mesh: its mesh.
      view: the cost model's view of the job (:func:`planner_view` on the compiler's platform).
      steps_per_call: optimizer steps per call of ``compiled`` (its bytes per axis are divided by it).

    Returns:
      ``{"arguments": (predicted, compiled), "peak": (predicted, compiled), "axes": {axis: (predicted,
      compiled)}}``, bytes per device (per step for the axes).
    """
    rep = memory_report(compiled)
    got = compiled_bytes_per_axis(compiled, mesh, view.plan) if mesh.size > 1 else {}
    pred, args, _, peak = _predicted(view)
    return {"arguments": (args, rep.argument_bytes), "peak": (peak, rep.required_bytes),
            "axes": {a: (pred.get(a, 0.0), got.get(a, 0.0) / steps_per_call) for a in sorted(set(pred) | set(got))}}


def _memory(model: Any, plan: Any, muon: dict | None, platform: str) -> Any:
    """The cost model's memory estimate on ``platform``'s compiler: fp32 parameters and moments (Muon's where
    it runs), the compiler's measured activation table where it was measured (docs/planning.md §8)."""
    return memory_per_device(model, plan, precision="fp32" if muon is None else muon_precision("fp32"),
                             activation_bytes=4 if plan.strategy.compute_dtype == "float32" else 2,
                             keeps=platform)


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
        if not self.unmodelled:
            return None
        peak = f"peak {format_bytes(self.peak)} per device" if self.peak else "no peak"
        return f"predict  cost model on {self.cluster}: {peak}; {'; '.join(self.unmodelled)}"




def run_prediction(view: PlannerView | None) -> RunPrediction:
    """The cost model's prediction for ``jaxpar train``'s report: its peak per device as ``jaxpar inspect``
    predicts it on the run's platform, and what the cluster preset cannot model (a preset without a term,
    e.g. ``cpu_sim`` without a host link under ``parallel.offload``, leaves it out and says so).

    Args:
      view: the cost model's view of the run on its platform's cluster (:data:`RUN_CLUSTERS`; None: not
        predicted).

    Returns:
      The :class:`RunPrediction` (its peak None: not predicted).
    """
    if view is None:
        return RunPrediction(None)
    return RunPrediction(_predicted(view)[3], view.cluster.name, view.estimate.time.unmodelled)


def predicted_rows(view: PlannerView | None, why: str | None, cluster: str) -> dict:
    """The cost model's terms for a job on its mesh's devices (its own lowering of the platform).

    Args:
      view: the cost model's view of the job (:func:`planner_view` on the mesh's platform; None: not predicted).
      why: why the cost model predicts nothing (with no ``view``).
      cluster: the cluster preset or YAML of ``view``.

    Returns:
      ``{"cluster", "why" (None, or why nothing is predicted), "compute": s, "compute_parts", "total": s,
      "collectives": {frozenset(axes) and kind: {"seconds", "count", "bytes"}}, "plan", "bubble"}``.
    """
    out = {"cluster": cluster, "why": why, "collectives": {}, "plan": None}
    if view is None:
        return out
    for x in _comms(view):
        row = out["collectives"].setdefault((x.kind, axes_key(x.axes)), {"seconds": 0.0, "count": 0.0, "bytes": 0.0})
        row["seconds"] += x.timed * comm_time(x, view.plan.sizes, view.cluster)
        row["count"] += x.count
        row["bytes"] += x.count * x.bytes
    t = view.estimate.time
    out.update(compute=t.compute + t.elementwise + t.optimizer, total=t.total, plan=view.plan, bubble=t.bubble,
               compute_parts=(t.compute, t.elementwise, t.optimizer))
    return out


def profile_report(trace_dir: Any, compiled: Mapping[str, Any], mesh: Any, strategy: Strategy, model: dict,
                   clock: Mapping[int, float]) -> tuple[list[str], dict, Any]:
    """``jaxpar profile``'s report: each traced step's time by row beside the cost model's terms.

    Args:
      trace_dir: the directory ``jax.profiler`` wrote the trace to.
      compiled: the programs that ran (``{"step": ...}``).
      mesh: their mesh.
      strategy: the job's strategy.
      model: :func:`predicted_rows` of the job.
      clock: the loop's wall seconds per traced step.

    Returns:
      ``(tables, record, trace path)``: a printable table per traced step, and the JSON record.
    """
    trace = read_trace(find_trace(trace_dir))
    profiles = step_profiles(trace, program_collectives(compiled, mesh))
    expected = expected_per_device(compiled["step"], mesh, strategy, model)
    tables = [profile_table(p, model, expected, clock.get(p.step)) for p in profiles]
    return tables, profile_record(profiles, model, expected, clock, trace.path), trace.path
