"""``jaxpar inspect``'s sections about a compiled train step: whether it fits the target's memory and the cost
model's plan that would (:func:`fit_lines`, :func:`fitting_plan`), its FP8 GEMMs, Muon's routing and placement,
fused attention, offloaded bytes, FSDP's gathers and the experts' tile loops. Each takes the compiled program, the
state's layout or the cost model's model, never a config.

Example::

    >>> from jaxpar.options import Fp8
    >>> fp8_lines(Fp8(), None, None, None, "cpu")[0][:40]
    'fp8      tensorwise: emulated by XLA:CPU'
"""
from __future__ import annotations

import math
import shlex
from dataclasses import replace
from typing import Any, Callable

import jax

from jaxpar import cost
from jaxpar._text import format_bytes, render_table
from jaxpar.analysis import collectives, collectives_table, grouped_calls, grouped_flops, memory_report, tile_loop_flops
from jaxpar.analysis._compiled_memory import host_transfers
from jaxpar.analysis._fused_attention import attention_report, flash_blocks, score_arrays
from jaxpar.analysis._gemms import all_gather_dtypes, check_fp8_gemms, gathered_weights
from jaxpar.analysis._sharding_table import sharding_table
from jaxpar.cost import PLATFORM_CLUSTERS, placement_chooser, placements_table
from jaxpar.devices._targets import Target
from jaxpar.errors import Fp8Error
from jaxpar.mesh import CONTEXT, batch_axes
from jaxpar.optimizers import muon_placements, muon_routing_table
from jaxpar.parallel.moe import tile_rows
from jaxpar.plan._plan_report import plan_overrides
from jaxpar.plan._ranking import PlanOptions, rank_plans, same_plan


def sharding_lines(layout: Any) -> list[str]:
    """The parameters' shardings as printable lines.

    Args:
      layout: the train state's layout.

    Returns:
      A title and the table: mesh axes per dimension, ``-`` replicated.
    """
    return ["parameters (mesh axes per dimension; '-' replicated)", sharding_table(layout)]


def collective_lines(name: str, compiled: Any, mesh: Any) -> list[str]:
    """The collectives of a compiled program as printable lines.

    Args:
      name: the program's name (``"step"``, ...).
      compiled: the compiled program.
      mesh: its mesh.

    Returns:
      A title and the table (one device's bytes), or ``(none)``.
    """
    colls = collectives(compiled, mesh) if mesh.size > 1 else []
    return ["collectives of the compiled " + ("step" if name == "step" else f"{name} program")
            + " (bytes: one device's results, each instruction once, not times its loop's trips)",
            collectives_table(colls) if colls else "(none)"]


def fit_lines(compiled: Any, target: Target, predicted: float | None = None) -> tuple[bool, list[str]]:
    """Whether the compiled program fits the target's device memory, as printable lines.

    Args:
      compiled: the compiled program.
      target: the target.
      predicted: the cost model's peak per device (None: not predicted).

    Returns:
      ``(fits, lines)``.
    """
    report, capacity = memory_report(compiled), target.capacity
    need, cap = report.required_bytes, capacity.usable
    pred = f"; the cost model predicted {format_bytes(predicted)}" if predicted else ""
    lines = [f"memory   per device: peak {format_bytes(need)} (arguments {format_bytes(report.argument_bytes)}, "
             f"temporaries {format_bytes(report.temp_bytes)}, XLA's peak "
             f"{format_bytes(report.xla_peak_bytes or 0)}){pred}",
             f"capacity {capacity.text()} on {target.spec.device}"]
    if need <= cap:
        return True, lines + [f"fits     with {format_bytes(cap - need)} to spare ({need / cap:.0%} used)"]
    return False, lines + [f"DOES NOT FIT by {format_bytes(need - cap)} ({need / cap:.0%} of the capacity)"]


def fitting_plan(model: Any, target: Target, options: Any = None, *, shown: Any = None, most: int = 64,
                 overrides: Callable[[Any], list[str]] | None = None) -> str:
    """The cost model's best plan of a model that fits, other than ``shown`` (the plan just compiled and shown
    not to fit, compared by its fields: :func:`jaxpar.plan.same_plan`): on the target's devices, else on the fewest
    multiples of them (up to ``most`` times as many) that hold it, ranked by ``jaxpar plan``'s one call
    (:func:`jaxpar.plan.rank_plans`). The capacity is the one rule of every command (:attr:`Target.capacity`), with
    the planner's margin (:data:`jaxpar.cost._capacity.PLAN_MARGIN`). No compile has checked the plan, and the
    line says so.

    Args:
      model: the cost model's model (:class:`jaxpar.cost.ModelSpec`).
      target: the target.
      options: the planner's :class:`jaxpar.plan.PlanOptions` (None: jaxpar's fp32 state, the target's lowering).
      shown: the :class:`jaxpar.cost.Plan` shown not to fit (None: none); never suggested.
      most: the largest multiple of the target's devices to try.
      overrides: a plan's overrides as ``jaxpar plan`` prints them (None: all of :func:`plan_overrides`).

    Returns:
      The text: a line naming the devices, the plan, its rank in ``jaxpar plan``'s table and its predicted memory,
      then one with its overrides; or a line saying that no plan is known to fit.
    """
    if options is None:
        options = PlanOptions(precision="fp32", lowering=cost.lowering_for_platform(target.spec.platform))
    for k in (1 << i for i in range(most.bit_length())):        # 1, 2, 4, ... up to most
        n = target.num_devices * k
        found = _other_plan(model, on_target(cost.load_cluster(target.spec.cluster, num_devices=n), target), options,
                            shown)
        if found is None:
            continue
        rank, best = found
        where = "these devices" if k == 1 else f"{n} x {target.spec.device} ({k} times the target's devices)"
        pasted = shlex.join((overrides or plan_overrides)(best.plan)) or "(none)"
        return (f"plan     the cost model's best plan that fits on {where}: {best.plan.name()} (jaxpar plan's "
                f"#{rank}), predicted {format_bytes(best.memory.total)} per device of {target.capacity.text()}; not "
                f"verified: no compile has checked it (jaxpar inspect with its overrides does)\n"
                f"         overrides {pasted}")
    return (f"plan     no plan is known to fit: none of the cost model's, but the one shown, fits even {most} times "
            f"the target's devices ({target.num_devices * most} x {target.spec.device}) at global batch {model.batch}")


def on_target(cluster: Any, target: Any) -> Any:
    """``cluster`` with the target's device bytes and platform: its capacity is then the target's (the one rule
    of :attr:`jaxpar.cost.Cluster.capacity`).

    Args:
      cluster: the :class:`jaxpar.cost.Cluster`.
      target: the :class:`jaxpar.devices.Target`.

    Returns:
      The cluster.
    """
    return replace(cluster, memory_bytes=float(target.spec.memory_bytes), platform=target.spec.platform)


def _other_plan(model: Any, cluster: Any, options: Any, shown: Any) -> tuple[int, Any] | None:
    """The rank and estimate of the cost model's fastest plan on ``cluster`` that fits and is not ``shown`` (None:
    none)."""
    try:
        ranked = rank_plans(model, cluster, options, top=1).ranked
    except cost.PlanError:
        return None
    return next(((i, e) for i, e in enumerate(ranked, 1) if not same_plan(e.plan, shown)), None)


def fp8_lines(fp8: Any, model: Any, compiled: Any, mesh: Any, platform: str) -> list[str]:
    """``jaxpar inspect``'s FP8 section (``parallel.fp8`` on): on a GPU target, the GEMMs of the covered
    weights compiled in FP8 against those the recipe covers, per weight
    (:func:`jaxpar.analysis._gemms.check_fp8_gemms`), and the all-gathers' bytes per step by element type
    (:func:`jaxpar.analysis._gemms.all_gather_dtypes`); on the simulated CPU mesh, one line: emulated.

    Args:
      fp8: the strategy's :class:`~jaxpar.options.Fp8`.
      model: the cost model's model (its leaves; None off a GPU).
      compiled: the compiled train step.
      mesh: its mesh.
      platform: ``"cuda"`` or ``"cpu"``.

    Returns:
      The lines.

    Raises:
      Fp8Error: a covered weight's GEMM compiled without FP8 operands, or a weight the recipe covers
        (:meth:`jaxpar.cost.Leaf.fp8`) with no FP8 GEMM in the program; the message names the weight.
    """
    recipe, min_dim = fp8.recipe, fp8.min_dim
    if platform != "cuda":
        return [f"fp8      {recipe}: emulated by XLA:CPU on the simulated mesh (no FP8 GEMMs there: the matmuls "
                "round as FP8 ones do, at the CPU's speed); --target h100:1x8 compiles them for a GPU and checks them"]
    counts = check_fp8_gemms(compiled.as_text())
    leaves = model.leaves
    missing = [l.name for l in leaves if l.fp8(min_dim) and not any(l.name.split("/")[-1] == k for k in counts)]
    if missing:
        raise Fp8Error(f"fp8: the covered weights {missing} (parallel.fp8 min_dim {min_dim}) have no FP8 GEMM in the "
                       "compiled program: their matmuls ran in the compute dtype. Turn parallel.fp8 off or report it.")
    n = sum(int(c["fp8"]) for c in counts.values())
    per = ", ".join(f"{k} {int(c['fp8'])}" for k, c in sorted(counts.items()))
    lines = [f"fp8      {recipe}, min_dim {min_dim}: all {n} GEMMs of the {len(counts)} covered weights compiled "
             f"in FP8 (each layer's, once per compiled layer body: {per or 'none'})"]
    gathers = all_gather_dtypes(compiled, mesh) if mesh.size > 1 else {}
    if gathers:
        rows = [[axes, dtype, str(v["count"]), format_bytes(v["bytes"])] for (axes, dtype), v in sorted(gathers.items())]
        lines += ["all-gathers by element type (FP8 values or the compute dtype's), per device",
                  render_table(["axes", "dtype", "arrays", "bytes per step"], rows, right=[False, False, True, True])]
    return lines


def muon_lines(muon: Any, layout: Any) -> list[str]:
    """``jaxpar inspect``'s Muon section (``optimizer.name: muon``): which half updates each parameter, its
    matrix (input x output side) and batch dims (:func:`jaxpar.optimizers.muon_routing_table`).

    Args:
      muon: Muon's settings (``optimizer.muon``: its ``routing`` overrides the logical names; ``placement``,
        ``ns_steps``), None for another optimizer.
      layout: the train state's layout (its parameter shapes and logical names).

    Returns:
      The lines; none for another optimizer.
    """
    if muon is None:
        return []
    table = muon_routing_table(layout.shapes, layout.logical, routing=dict(muon.routing),
                               kernel_layout=layout.kernel_layout)
    return ["", "muon routing (parameter, rule, matrix: input x output, batch dims: one Newton-Schulz each, why)",
            table] + muon_placement_lines(muon, layout)


def muon_placement_lines(m: Any, layout: Any) -> list[str]:
    """Where Newton-Schulz runs on each matrix group of the layout (``optimizer.muon.placement``), with the
    cost model's FLOPs, collectives and time (:func:`jaxpar.cost.placements_table`).

    Args:
      m: Muon's settings (:func:`muon_lines`).
      layout: the train state's layout.

    Returns:
      The lines.
    """
    sizes, platform = dict(layout.mesh.shape), layout.mesh.devices.flat[0].platform
    places = muon_placements(layout.shapes, layout.logical, mesh=layout.mesh, specs=layout.opt_param_specs,
                             placement=m.placement, ns_steps=m.ns_steps, routing=dict(m.routing),
                             chooser=placement_chooser(platform=platform))
    return ["", f"muon placement ({m.placement}; Newton-Schulz per device: FLOPs, collectives, cost model's time)",
            placements_table(places, sizes, m.ns_steps, PLATFORM_CLUSTERS.get(platform, "h100"))]


def attention_lines(kernels: dict, compiled: Any, length: int, context: int = 1) -> list[str]:
    """``jaxpar inspect --target``'s attention line on a GPU: the kernel each traced attention got
    (:func:`jaxpar.attention.count_attention_kernels`), the fused forwards of the compiled step and
    its largest ``[..., length, length]`` array (:func:`jaxpar.analysis._fused_attention.attention_report`);
    over a ``context`` axis, the ring / all-gather flash block calls and the score-shaped arrays of every
    block length (:func:`~jaxpar.analysis._fused_attention.score_arrays`).

    Args:
      kernels: the counts of the traced attentions.
      compiled: the compiled train step.
      length: the sequence length.
      context: the ``context`` axis's size.

    Returns:
      The lines.
    """
    text = compiled.as_text()
    report = attention_report(text, length)
    traced = sum(v for k, v in kernels.items() if k != "why")
    fused = traced - kernels.get("xla", 0)
    by = ", ".join(f"{kernels[k]} {k}" for k in ("cudnn", "pallas", "xla") if kernels.get(k))
    square = (f"largest [..., {length}, {length}] array {report.largest_square} ({format_bytes(report.square_bytes)})"
              if report.largest_square else f"no [..., {length}, {length}] array")
    lines = [f"attention {fused} of {traced} traced attentions fused ({by or 'none'}); compiled: {report.cudnn} "
             f"cuDNN and {report.pallas} Pallas flash forwards per layer body, {square}"]
    if kernels.get("pallas") and not kernels.get("cudnn"):
        lines.append("          compiled without a GPU, JAX cannot lower cuDNN's kernel: on the GPU, 'auto' runs "
                     "cuDNN where this program runs Pallas's (docs/strategies.md)")
    if context > 1:
        blocks, scores = flash_blocks(text), score_arrays(text, (length // context // 2, length // context, length))
        largest = f", the largest {scores.largest} ({format_bytes(scores.largest_bytes)})" if scores.largest else ""
        lines.append(f"          context {context}: {sum(blocks.values())} flash block calls "
                     f"({', '.join(f'{v} {k}' for k, v in blocks.items())}); {scores.count} score-shaped "
                     f"arrays{largest}")
    lines += [f"          XLA's path: {why}" for why in dict.fromkeys(kernels.get("why", []))]
    return lines


def offload_lines(offload: Any, compiled: Any, plain: Any, simulated: bool) -> list[str]:
    """``jaxpar inspect``'s offload section (``parallel.offload`` on): the bytes the step holds in host memory
    (its host-resident arguments and temporaries), its device peak beside the same config's without offload
    (compiled too), and the bytes it copies between device and host per step
    (:func:`jaxpar.analysis._compiled_memory.host_transfers`).

    Args:
      offload: the offload setting, as shown (``parallel.offload``).
      compiled: the compiled train step.
      plain: the same step compiled without offload.
      simulated: compiled for the simulated CPU mesh, where host and device memory are one.

    Returns:
      The lines.
    """
    rep, moved = memory_report(compiled), host_transfers(compiled.as_text())
    with_off, without = rep.required_bytes, memory_report(plain).required_bytes
    lines = [f"offload  {offload}: host memory holds {format_bytes(rep.host_argument_bytes)} of "
             f"state per device between steps, {format_bytes(rep.host_temp_bytes)} of temporaries in the step",
             f"         device peak {format_bytes(with_off)} with offload, {format_bytes(without)} without "
             f"({format_bytes(without - with_off)} saved)",
             f"         per step and device: {format_bytes(moved['to_host'])} device -> host, "
             f"{format_bytes(moved['to_device'])} host -> device"]
    if simulated:
        lines.append("         on the simulated CPU mesh host and device memory are one: XLA:CPU copies nothing, "
                     "so compile for a target (--target h100:1x8) to see the transfers")
    return lines


def gather_lines(layout: Any, compiled: Any) -> list[str]:
    """What a step whose parameters the data axes shard (FSDP, ZeRO-3) all-gathers: the weights' bytes and
    the activations' (:func:`jaxpar.analysis._gemms.gathered_weights`), and a warning, with the fix, where
    the activations outweigh the weights.

    Args:
      layout: the state's layout (its parameters' shapes and logical names, its mesh and strategy).
      compiled: the compiled train step.

    Returns:
      The lines (none where no data axis shards the parameters).
    """
    sizes = dict(layout.mesh.shape)
    if sizes.get("fsdp", 1) == 1 and not (layout.strategy.zero == 3 and sizes.get("data", 1) > 1):
        return []
    is_spec = lambda x: x is None or isinstance(x, tuple)     # noqa: E731
    shapes = [tuple(x.shape) for x in jax.tree.leaves(layout.shapes)]
    names = [tuple(n or ()) for n in jax.tree.leaves(layout.logical, is_leaf=is_spec)]
    specs = [s.spec for s in jax.tree.leaves(layout.shardings().params)]
    zero = [any(sizes.get(a, 1) > 1 for e in spec if e for a in ((e,) if isinstance(e, str) else e)
                if a in ("fsdp", "data")) for spec in specs]
    layer = [shape[1:] for shape, n in zip(shapes, names) if n[:1] == ("layers",)]
    # a layer's flat gather buffer holds its stacked leaves that ZeRO splits (the others stay replicated)
    flat = [shape[1:] for shape, n, z in zip(shapes, names, zero) if n[:1] == ("layers",) and z]
    got = gathered_weights(compiled, layout.mesh, shapes + layer, [sum(math.prod(s) for s in flat)])
    lines = [f"gathers  weights {format_bytes(got['weights'])}, activations {format_bytes(got['activations'])} "
             "per step and device (all-gathers over the data axes' shards)"]
    if got["activations"] > got["weights"]:
        lines.append("warning  the step gathers more activation bytes than weight bytes: XLA chose to gather "
                     "activations the model leaves unconstrained. Fix: pin them in the model, e.g. jaxpar.constrain(x, "
                     "('batch', 'length', 'embed')) (the GPT and the Decoder do), so that FSDP gathers the weights.")
    return lines


def expert_lines(experts: int, k: int, tokens: int, mesh: Any, compiled: Any) -> list[str]:
    """An MoE model's routed experts in the compiled step (jaxpar's GPT's or a Decoder's: the sorted dispatch of
    :mod:`jaxpar.parallel.moe`): on a GPU the grouped kernels' calls and work, else what the tile loops compute at
    most, against the routed rows' FLOPs and every expert on every token's (docs/strategies.md, "The sorted
    dispatch").

    Args:
      experts: the experts.
      k: the experts each token is routed to.
      tokens: the tokens of a global batch.
      mesh: the step's mesh.
      compiled: the compiled train step.

    Returns:
      The line, in a list.
    """
    sizes, text = dict(mesh.shape), compiled.as_text()
    f0, per_trip = tile_loop_flops(text)
    tile = tile_rows(mesh)
    tokens = tokens / math.prod(sizes.get(a, 1) for a in (*batch_axes(mesh), CONTEXT))
    tiles = tokens * k / tile + experts / sizes.get("expert", 1)
    head = f"experts  {experts} experts, top-{k}:"

    def fl(x):
        return f"{x / 1e12:.3g} TFLOP" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP"
    if calls := grouped_calls(text):          # a GPU mesh: the grouped kernels, no tile loop
        work = grouped_flops(text, tiles * tile)
        return [f"{head} grouped kernels (Pallas Triton), {sum(c.runs for c in calls):.0f} calls per device per step, "
                f"no tile loop; they compute {fl(work)} at {tiles * tile:,.0f} rows a call (the routed rows and a "
                f"tile of each local expert); the other GEMMs {fl(f0)}"]
    routed = per_trip / tile * tokens * k
    return [f"{head} the tile loops compute at most {fl(per_trip * tiles)} per device per step ({tiles:.0f} tiles "
            f"of {tile} rows a loop); the routed rows are {fl(routed)}, every expert on every token would be "
            f"{fl(routed * experts / k)}; the other GEMMs {fl(f0)}"]
