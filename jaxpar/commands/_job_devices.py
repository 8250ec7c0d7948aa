"""The devices a command's job runs on, and what a target refuses: ``train.devices`` simulated CPU devices or a
target's (:mod:`jaxpar.devices._targets`: ``h100:2x8``, ``tpu-v5e:4x4``), the refusal of JAX's CPU devices for
``train.devices=0``, the refusals that ``jaxpar inspect --target`` and ``jaxpar check --target`` share before
anything is built, and a job compiled for a target with the compiler's errors explained.

Example::

    >>> from pathlib import Path
    >>> from jaxpar.config import load_config
    >>> from jaxpar.devices import parse_target
    >>> cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml", ["train.devices=0"])
    >>> target_mesh_problem(cfg, parse_target("h100:2x8"))
    "target h100:2x8 has 16 devices, but the config's mesh pipe=1 x data=2 x fsdp=2 x tensor=2 has 8: choose a target of 8 devices (e.g. h100:1x8) or resize the mesh (e.g. mesh.data=4), or set one axis to -1."
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxpar.config._build import mesh_spec
from jaxpar.config._schema import ConfigError, JobConfig
from jaxpar.devices._distributed import setup_devices
from jaxpar.devices._targets import (COMPILER_NOTES, Target, TargetError, compile_error, fp8_problem,
                                     memory_fraction_problem, target_devices, topology_problem, without_notes)
from jaxpar.errors import Fp8Error, JaxparError
from jaxpar.mesh import STANDARD_AXES, MeshError, MeshSpec


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
    >>> from jaxpar.devices import parse_target
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


def job_devices(cfg: JobConfig, tgt: Target | None, command: str = "inspect") -> list:
    """The target's devices (:func:`refuse_target` has run), else ``train.devices`` (else the product of the
    mesh sizes) simulated CPU devices."""
    if tgt is not None:
        return target_devices(tgt)
    sizes = dataclasses.astuple(cfg.mesh)          # every axis: data, fsdp, tensor, pipe, replica, context, expert
    if cfg.train.devices == 0 and -1 in sizes:
        raise ConfigError(f"jaxpar {command}: mesh has a -1 axis and train.devices=0, so the device count is "
                          "unknown; set train.devices=N (e.g. train.devices=8) or give every mesh axis a size.")
    return setup_devices(cfg.train.devices or int(math.prod(sizes)))


def refuse_cpu_only(devices: int, *, simulated: bool = False) -> None:
    """``train.devices=0`` (the accelerators JAX finds) where JAX found only CPU devices: a config written for
    GPUs, on a machine or a JAX without them. Refused before anything compiles (``simulated``:
    ``--local-devices`` asked for CPU devices).

    Raises:
      ConfigError: the backend is the CPU; the message says what JAX found and the two fixes.
    """
    if devices != 0 or simulated or jax.default_backend() != "cpu":
        return
    n = jax.device_count()
    raise ConfigError(
        f"train.devices=0 trains on the GPUs or TPUs JAX finds, and this JAX found none: only {n} CPU "
        f"device{'s' if n > 1 else ''} (jax.default_backend()='cpu'). On a GPU host, install JAX for CUDA "
        "(pip install -U 'jax[cuda12]'; docs/gpu.md) and check with python -c 'import jax; print(jax.devices())'. "
        "To run on simulated CPU devices instead, set train.devices=N (e.g. train.devices=8) and a model that fits "
        "in host memory (jaxpar inspect CONFIG train.devices=8 shows its memory).")


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

