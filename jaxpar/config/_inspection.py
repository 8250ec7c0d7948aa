"""``jaxpar inspect``: compile a config's train step ahead of time and say what it needs; ``jaxpar check``:
every check of a config, built on its devices, nothing compiled (:func:`check_config`).

On the simulated CPU mesh by default; with a target (:mod:`jaxpar.devices._targets`: ``h100:2x8``,
``tpu-v5e:4x4``) with the real GPU or TPU compiler, without the hardware. It prints the mesh, the
parameters' shardings, the collectives per mesh axis (bytes, async or not), the memory per device
against the device's capacity (fits / does not fit, and the plan that would), the compile time, and
the cost model's prediction beside each number.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import load_config
    >>> cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml", ["train.devices=0"])
    >>> target_mesh_problem(cfg, parse_target("h100:2x8"))
    "target h100:2x8 has 16 devices, but the config's mesh pipe=1 x data=2 x fsdp=2 x tensor=2 has 8: choose a target of 8 devices (e.g. h100:1x8) or resize the mesh (e.g. mesh.data=4), or set one axis to -1."
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax

from jaxpar.mesh import MeshError, MeshSpec
from jaxpar.devices._targets import (COMPILER_NOTES, Target, TargetError, compile_error, fp8_problem,
                                     memory_fraction_problem, parse_target, target_devices, topology_problem,
                                     without_notes)
from jaxpar.errors import Fp8Error, JaxparError
from jaxpar.attention import count_attention_kernels
from jaxpar.config._build import mesh_spec
from jaxpar.config._schema import ConfigError, JobConfig

#: ``jaxpar inspect --target``'s exit status when the program does not fit the device's memory.
DOES_NOT_FIT = 3


def target_mesh_problem(cfg: JobConfig, target: Target) -> str | None:
    """Why the config's mesh cannot run on the target's devices (None: it can).

    Args:
      cfg: the config.
      target: the target.

    Returns:
      The problem, naming both counts and the fix, or None.
    """
    spec: MeshSpec = mesh_spec(cfg.mesh)
    n = target.num_devices
    if cfg.train.devices not in (0, n):
        return (f"target {target} has {n} devices, but train.devices={cfg.train.devices}: set train.devices=0 "
                f"(or {n}), or choose a target of {cfg.train.devices} devices.")
    try:
        spec.sizes(n)
        return None
    except MeshError:
        pass
    sizes = {a: getattr(cfg.mesh, a) for a in ("pipe", "data", "fsdp", "tensor")}
    have = math.prod(sizes.values()) * max(1, cfg.mesh.replica)
    if -1 in sizes.values():
        return (f"target {target} has {n} devices, which the config's fixed mesh axes "
                f"{', '.join(f'mesh.{a}={v}' for a, v in sizes.items() if v != -1)} do not divide: resize them.")
    example = f"{target.spec.name}:1x{have}" if target.spec.platform == "cuda" else "a slice of that many chips"
    others = have // sizes["data"]                 # the devices of every axis but data
    fix = f" (e.g. mesh.data={n // others})" if n % others == 0 else ""
    return (f"target {target} has {n} devices, but the config's mesh "
            f"{' x '.join(f'{a}={v}' for a, v in sizes.items())} has {have}: choose a target of {have} devices "
            f"(e.g. {example}) or resize the mesh{fix}, or set one axis to -1.")


def target_refusals(cfg: JobConfig, target: Target) -> list[JaxparError]:
    """Every refusal of the config on the target that is decided before anything is built or compiled: the
    one list that ``jaxpar inspect --target`` and ``jaxpar check --target`` both refuse (:func:`refuse_target`).

    In order: ``parallel.fp8`` on a device without FP8 GEMMs (:class:`Fp8Error`,
    :func:`~jaxpar.devices._targets.fp8_problem`), a mesh or ``train.devices`` that the target's device count
    does not fill (:class:`ConfigError`, :func:`target_mesh_problem`), a TPU chip grid that is not whole hosts
    (:func:`~jaxpar.devices._targets.topology_problem`) and an ``XLA_PYTHON_CLIENT_MEM_FRACTION`` that is no
    number on a GPU (:class:`TargetError`). Only ``inspect`` compiles; what the compiler refuses then is its own.

    Args:
      cfg: the config.
      target: the target.

    Returns:
      The errors, each naming the setting, its value and the fix; empty when the target takes the config.
    """
    found: list[JaxparError] = []
    if cfg.parallel.fp8 and (why := fp8_problem(target.spec)):
        found.append(Fp8Error(why))
    if why := target_mesh_problem(cfg, target):
        found.append(ConfigError(why))
    if why := topology_problem(target):
        found.append(TargetError(why))
    if target.spec.platform == "cuda" and (why := memory_fraction_problem()):
        found.append(TargetError(why))
    return found


def refuse_target(cfg: JobConfig, target: Target) -> None:
    """Raise the first of :func:`target_refusals` (its class), with the others' messages after its own.

    Args:
      cfg: the config.
      target: the target.

    Raises:
      Fp8Error, ConfigError, TargetError: the target refuses the config.

    >>> from jaxpar.config import load_config
    >>> cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml",
    ...                   ["train.devices=0", "parallel.fp8.recipe=tensorwise"])
    >>> refuse_target(cfg, parse_target("a100-80gb:1x16"))        # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxpar.errors.Fp8Error: target a100-80gb has no FP8 GEMMs: ...
      target a100-80gb:1x16 has 16 devices, but the config's mesh ... has 8: ...
    """
    if found := target_refusals(cfg, target):
        raise type(found[0])("\n  ".join(str(e) for e in found))


def fit_lines(report: Any, target: Target, predicted: float | None = None) -> tuple[bool, list[str]]:
    """Whether the compiled program fits the target's device memory, as printable lines.

    Args:
      report: the program's :class:`~jaxpar.analysis.MemoryReport`.
      target: the target.
      predicted: the cost model's peak per device (None: not predicted).

    Returns:
      ``(fits, lines)``.
    """
    from jaxpar._text import format_bytes

    need, cap = report.required_bytes, target.capacity_bytes
    share = "" if target.spec.platform != "cuda" else \
        f" ({cap / target.spec.memory_bytes:.0%} of {format_bytes(target.spec.memory_bytes)}: XLA_PYTHON_CLIENT_MEM_FRACTION)"
    pred = f"; the cost model predicted {format_bytes(predicted)}" if predicted else ""
    lines = [f"memory   per device: peak {format_bytes(need)} (arguments {format_bytes(report.argument_bytes)}, "
             f"temporaries {format_bytes(report.temp_bytes)}, XLA's peak "
             f"{format_bytes(report.xla_peak_bytes or 0)}){pred}",
             f"capacity {format_bytes(cap)} usable on {target.spec.device}{share}"]
    if need <= cap:
        return True, lines + [f"fits     with {format_bytes(cap - need)} to spare ({need / cap:.0%} used)"]
    return False, lines + [f"DOES NOT FIT by {format_bytes(need - cap)} ({need / cap:.0%} of the capacity)"]


def fitting_plan(cfg: JobConfig, target: Target, *, most: int = 64) -> str:
    """The cost model's best plan of the config's GPT that fits: on the target's devices, else on the
    fewest multiples of them (up to ``most`` times as many) that hold it.

    Args:
      cfg: the config.
      target: the target.
      most: the largest multiple of the target's devices to try.

    Returns:
      A line naming the devices, the plan and its predicted memory, or why none fits.
    """
    from jaxpar import cost
    from jaxpar._text import format_bytes
    from jaxpar.config._plan_command import cost_model, unpredicted

    if why := unpredicted(cfg, None, {}):         # a model of your own or model.hf
        return f"plan     {why}: no plan suggested"
    model, usable = cost_model(cfg), target.capacity_bytes / target.spec.memory_bytes
    k = 1
    while k <= most:
        n = target.num_devices * k
        cluster = replace(cost.load_cluster(target.spec.cluster, num_devices=n),
                          memory_bytes=float(target.spec.memory_bytes))
        try:
            best = cost.plan(model, cluster, top=1, precision="fp32", memory_fraction=usable).ranked[0]
        except cost.PlanError:
            k *= 2
            continue
        p = best.plan
        knobs = f"zero={p.strategy.zero}, remat={p.remat}, microbatches={p.strategy.microbatches}" + \
            (f", schedule={p.strategy.schedule}" if p.pipe > 1 else "")
        where = "these devices" if k == 1 else f"{n} x {target.spec.device} ({k} times the target's devices)"
        return (f"plan     the cost model's best plan that fits on {where}: {p.name()} ({knobs}), predicted "
                f"{format_bytes(best.memory.total)} per device")
    return (f"plan     no plan of the cost model fits even {most} times the target's devices "
            f"({target.num_devices * most} x {target.spec.device}) at global batch {model.batch}")


def fp8_lines(cfg: JobConfig, job: Any, compiled: Any, platform: str) -> list[str]:
    """``jaxpar inspect``'s FP8 section (``parallel.fp8`` on): on a GPU target, the GEMMs of the covered
    weights compiled in FP8 against those the recipe covers, per weight
    (:func:`jaxpar.analysis._gemms.check_fp8_gemms`), and the all-gathers' bytes per step by element type
    (:func:`jaxpar.analysis._gemms.all_gather_dtypes`); on the simulated CPU mesh, one line: emulated.

    Args:
      cfg: the config.
      job: its built job (the mesh and the model factory are read).
      compiled: the compiled train step.
      platform: ``"cuda"`` or ``"cpu"``.

    Returns:
      The lines.

    Raises:
      Fp8Error: a covered weight's GEMM compiled without FP8 operands, or a weight the recipe covers
        (:meth:`jaxpar.cost.Leaf.fp8`) with no FP8 GEMM in the program; the message names the weight.
    """
    from jaxpar._text import format_bytes, render_table
    from jaxpar.analysis._gemms import all_gather_dtypes, check_fp8_gemms
    from jaxpar.config._build import build_fp8
    from jaxpar.config._plan_command import cost_model

    fp8 = build_fp8(cfg.parallel.fp8)
    recipe, min_dim = fp8.recipe, fp8.min_dim
    if platform != "cuda":
        return [f"fp8      {recipe}: emulated by XLA:CPU on the simulated mesh (no FP8 GEMMs there: the matmuls "
                "round as FP8 ones do, at the CPU's speed); --target h100:1x8 compiles them for a GPU and checks them"]
    counts = check_fp8_gemms(compiled.as_text())
    leaves = cost_model(cfg, job.model_fn).leaves
    missing = [l.name for l in leaves if l.fp8(min_dim) and not any(l.name.split("/")[-1] == k for k in counts)]
    if missing:
        raise Fp8Error(f"fp8: the covered weights {missing} (parallel.fp8 min_dim {min_dim}) have no FP8 GEMM in the "
                       "compiled program: their matmuls ran in the compute dtype. Turn parallel.fp8 off or report it.")
    n = sum(int(c["fp8"]) for c in counts.values())
    per = ", ".join(f"{k} {int(c['fp8'])}" for k, c in sorted(counts.items()))
    lines = [f"fp8      {recipe}, min_dim {min_dim}: all {n} GEMMs of the {len(counts)} covered weights compiled "
             f"in FP8 (each layer's, once per compiled layer body: {per or 'none'})"]
    gathers = all_gather_dtypes(compiled, job.mesh) if job.mesh.size > 1 else {}
    if gathers:
        rows = [[axes, dtype, str(v["count"]), format_bytes(v["bytes"])] for (axes, dtype), v in sorted(gathers.items())]
        lines += ["all-gathers by element type (FP8 values or the compute dtype's), per device",
                  render_table(["axes", "dtype", "arrays", "bytes per step"], rows, right=[False, False, True, True])]
    return lines


def muon_lines(cfg: JobConfig, layout: Any) -> list[str]:
    """``jaxpar inspect``'s Muon section (``optimizer.name: muon``): which half updates each parameter, its
    matrix (input x output side) and batch dims (:func:`jaxpar.optimizers.muon_routing_table`).

    Args:
      cfg: the config (``optimizer.muon.routing`` overrides the logical names).
      layout: the train state's layout (its parameter shapes and logical names).

    Returns:
      The lines; none for another optimizer.
    """
    if cfg.optimizer.name != "muon":
        return []
    from jaxpar.optimizers import muon_routing_table

    table = muon_routing_table(layout.shapes, layout.logical, routing=dict(cfg.optimizer.muon.routing),
                               kernel_layout=layout.kernel_layout)
    return ["", "muon routing (parameter, rule, matrix: input x output, batch dims: one Newton-Schulz each, why)",
            table] + muon_placement_lines(cfg, layout)


def muon_placement_lines(cfg: JobConfig, layout: Any) -> list[str]:
    """Where Newton-Schulz runs on each matrix group of the layout (``optimizer.muon.placement``), with the
    cost model's FLOPs, collectives and time (:func:`jaxpar.cost.placements_table`).

    Args:
      cfg: the config.
      layout: the train state's layout.

    Returns:
      The lines.
    """
    from jaxpar.cost import PLATFORM_CLUSTERS, placement_chooser, placements_table
    from jaxpar.optimizers import muon_placements

    m, sizes, platform = cfg.optimizer.muon, dict(layout.mesh.shape), layout.mesh.devices.flat[0].platform
    places = muon_placements(layout.shapes, layout.logical, mesh=layout.mesh, specs=layout.opt_param_specs,
                             placement=m.placement, ns_steps=m.ns_steps, routing=dict(m.routing),
                             chooser=placement_chooser(platform=platform))
    return ["", f"muon placement ({m.placement}; Newton-Schulz per device: FLOPs, collectives, cost model's time)",
            placements_table(places, sizes, m.ns_steps, PLATFORM_CLUSTERS.get(platform, "h100"))]


def inspect_config(cfg: JobConfig, *, cluster: str | None = None, target: str | None = None) -> int:
    """Compile the config's train step and print the report (see the module docstring).

    Args:
      cfg: the config.
      cluster: the cost model's cluster preset (default: the target's, else ``cpu_sim``).
      target: a target string (None: the simulated CPU mesh).

    Returns:
      The exit status: 0, or :data:`DOES_NOT_FIT` when a target's memory is too small.

    Raises:
      ConfigError: the config does not fit the target's devices.
      TargetError: the target cannot be built or compiled for.
      Fp8Error: ``parallel.fp8`` on a target without FP8 GEMMs, or a covered matmul compiled without FP8
        operands (:func:`fp8_lines`).

    Before anything is built, the target's refusals (:func:`refuse_target`: ``jaxpar check --target``'s too).
    """
    from jaxpar.config._job import build_job, header_lines, model_line, program_lines

    tgt = parse_target(target) if target else None
    if tgt is not None:
        refuse_target(cfg, tgt)             # what check --target refuses too
    devices = _devices(cfg, tgt)
    job = build_job(cfg, devices, data=False)
    layout = job.state_layout()
    where = f"the {tgt.spec.platform} compiler for {tgt}" if tgt else "simulated CPU devices"
    print(f"job      {cfg.name} (dry run: compiled ahead of time by {where}, no step runs)")
    print("\n".join(header_lines(job)))
    print(model_line(cfg.model, job.hf, layout))
    start = time.perf_counter()
    with count_attention_kernels() as kernels, _offload_mesh(job):
        compiled = _compile(job, layout, tgt)
    print(f"compile  {time.perf_counter() - start:.1f} s")
    print("\n".join(program_lines(job, compiled)))
    if tgt is not None and tgt.spec.platform == "cuda":
        print("\n".join(attention_lines(kernels, compiled["step"], job.seq_len)))
    if cfg.parallel.offload:
        print("\n" + "\n".join(offload_lines(cfg, devices, compiled["step"], tgt)))
    return _report(cfg, job, layout, compiled, tgt, cluster or (tgt.spec.cluster if tgt else "cpu_sim"))


def _offload_mesh(job: Any):
    """Under offload, the job's mesh set (``jax.set_mesh``): a target's devices list no memories, so the
    offloaded state's shardings are over the mesh's abstract mesh (:func:`jaxpar.parallel._offload.with_kind`)."""
    import contextlib

    return jax.set_mesh(job.mesh) if job.strategy.offload is not None else contextlib.nullcontext()


def attention_lines(kernels: dict, compiled: Any, length: int) -> list[str]:
    """``jaxpar inspect --target``'s attention line on a GPU: the kernel each traced attention got
    (:func:`jaxpar.attention.count_attention_kernels`), the fused forwards of the compiled step and
    its largest ``[..., length, length]`` array (:func:`jaxpar.analysis._fused_attention.attention_report`).

    Args:
      kernels: the counts of the traced attentions.
      compiled: the compiled train step.
      length: the sequence length.

    Returns:
      The lines.
    """
    from jaxpar.analysis._fused_attention import attention_report
    from jaxpar._text import format_bytes

    report = attention_report(compiled.as_text(), length)
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
    lines += [f"          XLA's path: {why}" for why in dict.fromkeys(kernels.get("why", []))]
    return lines


def offload_lines(cfg: JobConfig, devices: list, compiled: Any, tgt: Target | None) -> list[str]:
    """``jaxpar inspect``'s offload section (``parallel.offload`` on): the bytes the step holds in host memory
    (its host-resident arguments and temporaries), its device peak beside the same config's without offload
    (compiled too), and the bytes it copies between device and host per step
    (:func:`jaxpar.analysis._compiled_memory.host_transfers`).

    Args:
      cfg: the config.
      devices: the devices the job was built on.
      compiled: the compiled train step.
      tgt: the target (None: the simulated CPU mesh, where host and device memory are one).

    Returns:
      The lines; none without offload.
    """
    if not cfg.parallel.offload:
        return []
    from jaxpar._text import format_bytes
    from jaxpar.analysis._compiled_memory import host_transfers, memory_report
    from jaxpar.config._job import build_job

    plain_cfg = replace(cfg, parallel=replace(cfg.parallel, offload={}))
    plain_job = build_job(plain_cfg, devices, data=False)
    plain = plain_job.compile(plain_job.state_layout())["step"]
    rep, moved = memory_report(compiled), host_transfers(compiled.as_text())
    with_off, without = rep.required_bytes, memory_report(plain).required_bytes
    lines = [f"offload  {cfg.parallel.offload}: host memory holds {format_bytes(rep.host_argument_bytes)} of "
             f"state per device between steps, {format_bytes(rep.host_temp_bytes)} of temporaries in the step",
             f"         device peak {format_bytes(with_off)} with offload, {format_bytes(without)} without "
             f"({format_bytes(without - with_off)} saved)",
             f"         per step and device: {format_bytes(moved['to_host'])} device -> host, "
             f"{format_bytes(moved['to_device'])} host -> device"]
    if tgt is None:
        lines.append("         on the simulated CPU mesh host and device memory are one: XLA:CPU copies nothing, "
                     "so compile for a target (--target h100:1x8) to see the transfers")
    return lines


def check_config(cfg: JobConfig) -> int:
    """``jaxpar check``: every check of ``cfg`` that needs no compiled program, and what it would train.

    It builds what ``jaxpar train`` builds, as far as it can without running: the mesh on the config's
    devices (simulated CPU devices when they are not there), the library's objects, the train state's
    layout (traced, not allocated: the compatibility table's refusals) and the train step with its
    options. The data section's files are not read (``jaxpar data show`` reads them).

    Args:
      cfg: the loaded config (:func:`jaxpar.config.load_config` has run its own checks).

    Returns:
      The exit status, 0 (a problem raises).

    Raises:
      ConfigError: a setting the config or the library refuses, named by its YAML key.
      JaxparError: a refusal of the library that no YAML check knows (the compatibility table's, the
        train step's), named by the library's field; FP8's by its YAML keys (``Job.train_step``).

    >>> quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    >>> from jaxpar.config import load_config
    >>> check_config(load_config(quickstart, ["model.layers=1", "model.embed=32", "model.seq_len=16"]))
    ... # doctest: +ELLIPSIS
    check    quickstart: ok (every check passed; no step compiled or run)
    devices  8 x cpu (cpu)
    mesh     pipe=1 x data=2 x fsdp=2 x tensor=2
    strategy dp2-fsdp2-tp2
    model    gpt: ... parameters
    state    ... per device (params ..., optimizer ...)
    programs step
    0
    """
    from jaxpar.config._job import build_job, header_lines, model_line, state_line

    job = build_job(cfg, _devices(cfg, None, "check"), data=False)
    layout = job.state_layout()
    step = job.train_step(layout)           # make_train_step's checks; its programs are built lazily
    job.log_options(layout, None)           # the loop's logging options
    print(f"check    {cfg.name}: ok (every check passed; no step compiled or run)")
    print("\n".join(header_lines(job)))
    print(model_line(cfg.model, job.hf, layout))
    print(state_line(layout))
    print(f"programs {', '.join(step.programs)}")
    return 0


def _devices(cfg: JobConfig, tgt: Target | None, command: str = "inspect") -> list:
    """The target's devices (:func:`refuse_target` has run), else ``train.devices`` (else the product of the
    mesh sizes) simulated CPU devices."""
    if tgt is not None:
        return target_devices(tgt)
    import jax

    from jaxpar.devices._distributed import setup_devices

    sizes = dataclasses.astuple(cfg.mesh)          # every axis: data, fsdp, tensor, pipe, replica, context, expert
    if cfg.train.devices == 0 and -1 in sizes:
        raise ConfigError(f"jaxpar {command}: mesh has a -1 axis and train.devices=0, so the device count is "
                          "unknown; set train.devices=N (e.g. train.devices=8) or give every mesh axis a size.")
    n = cfg.train.devices or int(math.prod(sizes))
    setup_devices(n)
    return jax.devices()[:n]


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
    from jaxpar._text import format_bytes
    from jaxpar.analysis._gemms import gathered_weights

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


def _compile(job: Any, layout: Any, tgt: Target | None) -> dict:
    """The job's programs, compiled without XLA's own log lines about them (:data:`COMPILER_NOTES`)."""
    try:
        with without_notes(COMPILER_NOTES):
            return job.compile(layout)
    except TargetError:
        raise
    except Exception as e:         # the compiler's own error: jaxpar says what it means where it can
        better = compile_error(tgt, e) if tgt else None
        if better is None:
            raise
        raise better from None


def expert_lines(cfg: JobConfig, job: Any, compiled: Any) -> list[str]:
    """The GPT's routed experts in the compiled step: what their tile loops compute at most, against the
    routed rows' FLOPs and every expert on every token's (docs/strategies.md, "The sorted dispatch")."""
    from jaxpar.analysis import tile_loop_flops
    from jaxpar.parallel.moe import tile_rows
    moe, sizes = cfg.model.moe, dict(job.mesh.shape)
    experts, k = moe["experts"], moe.get("top_k", 2)
    f0, per_trip = tile_loop_flops(compiled.as_text())
    tile = tile_rows(job.mesh)
    tokens = cfg.data.batch_size * cfg.model.seq_len / math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert",
                                                                                              "context"))
    tiles = tokens * k / tile + experts / sizes.get("expert", 1)
    routed = per_trip / tile * tokens * k
    def fl(x):
        return f"{x / 1e12:.3g} TFLOP" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP"
    return [f"experts  {experts} experts, top-{k}: the tile loops compute at most {fl(per_trip * tiles)} per device "
            f"per step ({tiles:.0f} tiles of {tile} rows a loop); the routed rows are {fl(routed)}, every expert "
            f"on every token would be {fl(routed * experts / k)}; the other GEMMs {fl(f0)}"]


def _report(cfg: JobConfig, job: Any, layout: Any, compiled: dict, tgt: Target | None, cluster: str) -> int:
    from jaxpar.analysis._hlo import collectives, collectives_table
    from jaxpar.analysis._compiled_memory import memory_report
    from jaxpar.analysis._sharding_table import sharding_table
    from jaxpar.cost._traffic import lowering_for_platform
    from jaxpar.config._plan_command import planner_table

    print("\nparameters (mesh axes per dimension; '-' replicated)")
    print(sharding_table(layout))
    if lines := muon_lines(cfg, layout):
        print("\n".join(lines))
    for name, c in compiled.items():
        print("\ncollectives of the compiled " + ("step" if name == "step" else f"{name} program"))
        colls = collectives(c, job.mesh) if job.mesh.size > 1 else []
        print(collectives_table(colls) if colls else "(none)")
    if lines := gather_lines(layout, compiled["step"]):
        print("\n" + "\n".join(lines))
    if cfg.parallel.fp8:
        print("\n" + "\n".join(fp8_lines(cfg, job, compiled["step"], tgt.spec.platform if tgt else "cpu")))
    if getattr(cfg.model, "moe", None) and cfg.model.name == "gpt":
        print("\n" + "\n".join(expert_lines(cfg, job, compiled["step"])))
    platform = tgt.spec.platform if tgt else "cpu"
    lowering = lowering_for_platform(platform)
    table, predicted = planner_table(cfg, compiled["step"], job.mesh, job.strategy, cluster, job.steps_per_call,
                                     lowering=lowering, platform=platform)
    print(table)
    if tgt is None:
        return 0
    report = memory_report(compiled["step"])
    fits, lines = fit_lines(report, tgt, predicted)
    print("\n" + "\n".join(lines))
    if fits:
        return 0
    print(fitting_plan(cfg, tgt))
    return DOES_NOT_FIT
