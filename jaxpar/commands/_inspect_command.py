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
from typing import Any

import jax

from jaxpar.mesh import STANDARD_AXES, MeshError, MeshSpec
from jaxpar.devices._targets import (COMPILER_NOTES, Target, TargetError, compile_error, fp8_problem,
                                     memory_fraction_problem, parse_target, target_devices, topology_problem,
                                     without_notes)
from jaxpar.errors import Fp8Error, JaxparError
from jaxpar.attention import count_attention_kernels
from jaxpar.config._build import build_option, mesh_spec
from jaxpar.commands._planner_options import changed_overrides, plan_options
from jaxpar.config._cost_model import config_view, cost_model, decoder_config_of, unpredicted
from jaxpar.config._job import build_job, header_lines, model_line, program_lines
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.plan import (attention_lines, collective_lines, expert_lines, fit_lines, fitting_plan, fp8_lines,
                         gather_lines, muon_lines, offload_lines, on_target, planner_table, sharding_lines)

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
    sizes = {a: getattr(cfg.mesh, a) for a in STANDARD_AXES}
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

    >>> from pathlib import Path
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
    tgt = parse_target(target) if target else None
    if tgt is not None:
        refuse_target(cfg, tgt)             # what check --target refuses too
    devices = job_devices(cfg, tgt)
    job = build_job(cfg, devices, data=False)
    layout = job.state_layout()
    where = f"the {tgt.spec.platform} compiler for {tgt}" if tgt else "simulated CPU devices"
    print(f"job      {cfg.name} (dry run: compiled ahead of time by {where}, no step runs)")
    print("\n".join(header_lines(job)))
    print(model_line(cfg.model, job.hf, layout))
    start = time.perf_counter()
    with count_attention_kernels() as kernels, _offload_mesh(job):
        compiled = compile_job(job, layout, tgt)
    print(f"compile  {time.perf_counter() - start:.1f} s")
    print("\n".join(program_lines(job, compiled)))
    if tgt is not None and tgt.spec.platform == "cuda":
        print("\n".join(attention_lines(kernels, compiled["step"], batch_length(job), cfg.mesh.context)))
    if cfg.parallel.offload:        # beside the same step without offload
        plain = build_job(replace(cfg, parallel=replace(cfg.parallel, offload={})), devices, data=False)
        plain_step = plain.compile(plain.state_layout())["step"]
        print("\n" + "\n".join(offload_lines(cfg.parallel.offload, compiled["step"], plain_step, tgt is None)))
    return _report(cfg, job, layout, compiled, tgt, cluster or (tgt.spec.cluster if tgt else "cpu_sim"))


def batch_length(job: Any) -> int:
    """The sequence length of the job's batches: ``model.seq_len`` for token windows, else the second dimension
    of the first batch's first array of two or more (a model of one's own: ``model.seq_len`` is not its length).

    Args:
      job: the built job.

    Returns:
      The length.
    """
    if job.token_batches:
        return job.seq_len
    lead = 1 if job.steps_per_call > 1 else 0
    shapes = [a.shape for a in jax.tree.leaves(job.abstract_batch()) if len(a.shape) >= lead + 2]
    return int(shapes[0][lead + 1]) if shapes else job.seq_len


def _offload_mesh(job: Any):
    """Under offload, the job's mesh set (``jax.set_mesh``): a target's devices list no memories, so the
    offloaded state's shardings are over the mesh's abstract mesh (:func:`jaxpar.parallel._offload.with_kind`)."""
    import contextlib

    return jax.set_mesh(job.mesh) if job.strategy.offload is not None else contextlib.nullcontext()


def job_devices(cfg: JobConfig, tgt: Target | None, command: str = "inspect") -> list:
    """The target's devices (:func:`refuse_target` has run), else ``train.devices`` (else the product of the
    mesh sizes) simulated CPU devices."""
    if tgt is not None:
        return target_devices(tgt)
    from jaxpar.devices._distributed import setup_devices

    sizes = dataclasses.astuple(cfg.mesh)          # every axis: data, fsdp, tensor, pipe, replica, context, expert
    if cfg.train.devices == 0 and -1 in sizes:
        raise ConfigError(f"jaxpar {command}: mesh has a -1 axis and train.devices=0, so the device count is "
                          "unknown; set train.devices=N (e.g. train.devices=8) or give every mesh axis a size.")
    return setup_devices(cfg.train.devices or int(math.prod(sizes)))


def compile_job(job: Any, layout: Any, tgt: Target | None) -> dict:
    """The job's programs, compiled without XLA's own log lines about them (:data:`COMPILER_NOTES`); a compiler
    error jaxpar can explain for the target (:func:`~jaxpar.devices._targets.compile_error`) as that error.

    Args:
      job: the built job.
      layout: its state's layout.
      tgt: the target (None: the simulated CPU mesh).

    Returns:
      ``{name: compiled}`` (:meth:`jaxpar.config.Job.compile`).
    """
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


def _report(cfg: JobConfig, job: Any, layout: Any, compiled: dict, tgt: Target | None, cluster: str) -> int:
    print("\n" + "\n".join(sharding_lines(layout)))
    platform = tgt.spec.platform if tgt else "cpu"
    if lines := muon_lines(cfg.optimizer.muon if cfg.optimizer.name == "muon" else None, layout):
        print("\n".join(lines))
    for name, c in compiled.items():
        print("\n" + "\n".join(collective_lines(name, c, job.mesh)))
    if lines := gather_lines(layout, compiled["step"]):
        print("\n" + "\n".join(lines))
    if cfg.parallel.fp8:
        model = cost_model(cfg, job.model_fn) if platform == "cuda" else None
        fp8 = build_option("fp8", cfg.parallel.fp8)
        print("\n" + "\n".join(fp8_lines(fp8, model, compiled["step"], job.mesh, platform)))
    if routed := model_experts(cfg, job.model_fn):
        print("\n" + "\n".join(expert_lines(*routed, cfg.data.batch_size * cfg.model.seq_len, job.mesh,
                                              compiled["step"])))
    view, why = config_view(cfg, dict(job.mesh.shape), job.strategy, cluster, platform=platform)
    table, predicted = planner_table(compiled["step"], job.mesh, view, why, cluster, job.steps_per_call,
                                     platform=platform)
    print(table)
    if tgt is None:
        return 0
    fits, lines = fit_lines(compiled["step"], tgt, predicted)
    print("\n" + "\n".join(lines))
    if fits:
        return 0
    why = unpredicted(cfg, None, {})          # a model of your own
    print(f"plan     {why}: no plan suggested" if why else suggested_plan(cfg, cost_model(cfg, job.model_fn), tgt,
                                                                           getattr(view, "plan", None)))
    return DOES_NOT_FIT


def suggested_plan(cfg: JobConfig, model: Any, tgt: Target, shown: Any) -> str:
    """``jaxpar inspect --target``'s suggestion where the step does not fit: the cost model's best plan that fits,
    other than the one shown (:func:`jaxpar.plan.fitting_plan`), ranked with ``jaxpar plan``'s options for the
    config (:func:`~jaxpar.commands._planner_options.plan_options`) and given with the overrides ``jaxpar plan``
    prints (:func:`~jaxpar.commands._planner_options.changed_overrides`).

    Args:
      cfg: the config.
      model: its cost model's model.
      tgt: the target.
      shown: the plan just compiled (None: not predicted).

    Returns:
      The text.
    """
    from jaxpar import cost

    cluster = on_target(cost.load_cluster(tgt.spec.cluster, num_devices=tgt.num_devices), tgt)
    return fitting_plan(model, tgt, plan_options(cfg, cluster), shown=shown, overrides=changed_overrides(cfg))


def model_experts(cfg: JobConfig, model_fn: Any = None) -> tuple[int, int] | None:
    """The routed experts of the config's model and how many a token picks: jaxpar's GPT's ``model.moe``, or a
    Decoder's (``model.hf``'s ``config.json`` or a ``model.target`` that builds one); None for a dense model or a
    model of one's own.

    Args:
      cfg: the config.
      model_fn: the job's model factory (None: built from the config).

    Returns:
      ``(experts, top_k)`` or None.
    """
    m = cfg.model
    if m.target is None and m.hf is None:
        return (m.moe["experts"], m.moe.get("top_k", 2)) if m.moe else None
    decoder = decoder_config_of(m, model_fn)
    moe = getattr(decoder, "moe", None)
    return (moe.experts, moe.top_k) if moe is not None else None
