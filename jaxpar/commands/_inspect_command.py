"""``jaxpar inspect``: compile a config's train step ahead of time and say what it needs; ``jaxpar check``:
every check of a config, built on its devices, nothing compiled (:func:`~jaxpar.commands._check_command.check_config`).

On the simulated CPU mesh by default; with a target (:mod:`jaxpar.devices._targets`: ``h100:2x8``,
``tpu-v5e:4x4``) with the real GPU or TPU compiler, without the hardware. It prints the mesh, the
parameters' shardings, the collectives per mesh axis (bytes, async or not), the memory per device
against the device's capacity (fits / does not fit, and the plan that would), the compile time, and
the cost model's prediction beside each number.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

import jax

from jaxpar import cost
from jaxpar.attention import count_attention_kernels
from jaxpar.commands._job_devices import compile_job, job_devices, refuse_target
from jaxpar.commands._lines import header_lines, model_line, program_lines
from jaxpar.commands._planner_options import changed_overrides, plan_options
from jaxpar.config._build import build_option
from jaxpar.config._cost_model import config_view, cost_model, decoder_config_of, unpredicted
from jaxpar.config._job import build_job
from jaxpar.config._schema import JobConfig
from jaxpar.devices._targets import Target, parse_target
from jaxpar.plan import (attention_lines, collective_lines, expert_lines, fit_lines, fitting_plan, fp8_lines,
                         gather_lines, muon_lines, offload_lines, on_target, planner_table, sharding_lines)

#: ``jaxpar inspect --target``'s exit status when the program does not fit the device's memory.
DOES_NOT_FIT = 3


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

    Before anything is built, the target's refusals (:func:`~jaxpar.commands._job_devices.refuse_target`: ``jaxpar
    check --target``'s too).
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
    return jax.set_mesh(job.mesh) if job.strategy.offload is not None else contextlib.nullcontext()


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
