"""Every error jaxpar raises, under one base: :class:`JaxparError`, a ``ValueError``.

Each error names the field, the values and the fix. A command (``jaxpar train``, ``inspect``, ...)
prints any :class:`JaxparError` as a one-line usage error.
:func:`check_int` is the one check of an int option (:func:`int_problem` says why, for the config layer);
:func:`is_number` and :func:`finite_number` the one test of a number option (a bool is not a number).

Example:
    >>> import jaxpar
    >>> try:
    ...     jaxpar.MeshSpec(data=3).sizes(8)
    ... except jaxpar.JaxparError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    MeshError True
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, Callable

__all__ = ["JaxparError", "MeshError", "StrategyError", "MaskError", "RulesError", "LayerListError", "ModelMeshError",
           "CompressionError", "Fp8Error", "OffloadError", "AttentionError", "ContextParallelError", "MoEError", "PipelineCutError",
           "PartitionError", "StashingError", "ScheduleError", "AsyncPipelineError", "SyncError",
           "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "RunDirectoryError", "RampError",
           "NonFiniteError", "LoopError", "OutOfMemoryError", "StepHangError", "GenerationError",
           "ProgramMismatchError",
           "ExplicitDPError", "NoiseScaleError", "StrategyMismatchError", "DataError", "SourceError",
           "TokenizerError", "CacheError", "HFConfigError", "HFExportError", "HFFilesError",
           "HFCheckpointError", "ClusterError", "LayoutError", "PlanError", "DistributedError", "TargetError",
           "ConfigError", "UnusedAxisWarning", "ReplicatedLeafWarning", "ScheduleWarning", "BatchError", "OptimizerError",
           "BackendStartedError",
           "ModelStateError", "ModelConfigError", "StepError", "CompatError", "CostModelError", "AnalysisError"]


class JaxparError(ValueError):
    """The base of every error jaxpar raises: input that jaxpar has named as wrong, with the fix."""


# The core: meshes, rules, strategies, optimizers.


class MeshError(JaxparError):
    """A mesh cannot be built from the given sizes or devices."""


class BackendStartedError(MeshError, RuntimeError):
    """JAX's backend already runs with another device count than asked; the count cannot change in a
    running process (the message names both counts and how to start with the right one)."""


class BatchError(JaxparError):
    """A batch that does not fit the mesh or the step: a scalar leaf, leaves of different leading
    sizes, a global batch that the data axes x micro-batches do not divide, or stacked batches of
    another count than ``steps_per_call``."""


class StrategyError(JaxparError):
    """A :class:`~jaxpar.Strategy` field with a value it does not take (a ZeRO stage, a dtype, a count)."""


class MaskError(JaxparError):
    """A trust-ratio / weight-decay mask names no parameter, or does not fit the parameters."""


class RulesError(JaxparError):
    """A logical annotation cannot be mapped onto the mesh."""


class OptimizerError(JaxparError):
    """An optimizer option out of its range (a learning rate, ``b1`` / ``b2``, ``eps``, ``weight_decay``,
    ``momentum``, a trust coefficient: negative, NaN, a bool), an unknown learning-rate scaling rule, or
    an update called without what it needs (the message names the function, the option and the fix)."""


class CompatError(JaxparError):
    """A feature code that the compatibility table (:mod:`jaxpar.compat`) does not hold."""


# The user's model.


class LayerListError(JaxparError):
    """An ``nnx.List`` of layers cannot be stacked, or its stacked form was used in a way a list allows."""


class ModelMeshError(JaxparError):
    """A model that pins shardings by mesh axes cannot run where jaxpar asked it to."""


class ModelStateError(JaxparError):
    """A model holds state that jaxpar does not train (variables other than ``nnx.Param``: RNG streams,
    caches, counters); the message names their kinds and where to keep them."""


class ModelConfigError(JaxparError):
    """A field of one of jaxpar's model configs (:class:`~jaxpar.models.GPTConfig`,
    :class:`~jaxpar.models.DecoderConfig`) with a value the model cannot be built with."""


# The parallel strategies.


class CompressionError(JaxparError):
    """A compression option or combination that cannot work (the message names it and the fix)."""


class Fp8Error(JaxparError):
    """An FP8 option, or a covered matmul that would not run in FP8 (the message names the weight)."""


class OffloadError(JaxparError):
    """A memory-offloading option (``Strategy.offload``) that cannot work: the message names it and the fix."""


class AttentionError(JaxparError):
    """The q/k/v or segment ids given to :func:`jaxpar.attention.attention` do not fit together."""


class ContextParallelError(JaxparError):
    """Context-parallel attention cannot run on these inputs, this mesh or these rules."""


class MoEError(JaxparError):
    """A mixture-of-experts layer got options or a mesh it cannot run with."""


class PipelineCutError(JaxparError):
    """The model cannot be cut into pipeline stages as it is written."""


class PartitionError(JaxparError):
    """Layers cannot be split over the stages as asked."""


class StashingError(JaxparError):
    """A weight-stashing setting that cannot run (names the field, the value and the fix)."""


class ScheduleError(JaxparError):
    """A pipeline schedule that cannot be built or run: an unknown kind, stage / micro-batch / chunk
    counts it does not take, a table that is illegal (a missing or duplicate action, a broken
    dependency), or a mesh whose ``pipe`` axis is not the table's stage count."""


class AsyncPipelineError(JaxparError):
    """A PipeDream-2BW setting that cannot run (names the field, the value and the fix)."""


class SyncError(JaxparError):
    """A synchronisation kind was asked with an option it cannot take, or on a mesh it cannot use."""


# The step and the run.


class CheckpointError(JaxparError, RuntimeError):
    """No usable checkpoint (the message names the directory and what was found there), or a
    :class:`~jaxpar.run.Checkpointer` option it cannot take."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is readable but its parameters or optimizer state are another tree than the
    target's (the message names the part and the differences); no older checkpoint is tried."""


class CheckpointWarning(UserWarning):
    """A checkpoint was unreadable and an older one is used instead, or a part of the state it
    holds was dropped or started afresh (the message says which and why)."""


class RunDirectoryError(JaxparError):
    """A run directory (``train.out_dir``, ``checkpoint.dir``) holds another run's checkpoints or metrics, and a
    new run there would mix with it: the message names the directory, what it holds and the choices
    (``--resume``, another ``train.out_dir``, ``--overwrite``)."""


class UnusedAxisWarning(UserWarning):
    """A mesh axis of size > 1 splits nothing (e.g. ``tensor`` over a model without tensor-parallel
    annotations): its devices repeat each other's work. The message names the axis, its size and the fix."""


class ReplicatedLeafWarning(UserWarning):
    """ZeRO / FSDP leaves a large parameter replicated over the data axes: none of its dimensions is a
    multiple of their size (:func:`jaxpar.parallel._zero.warn_replicated`). The message names each such
    parameter, its shape, dtype and bytes per device, the size a dimension must be a multiple of and the fix."""


class ScheduleWarning(UserWarning):
    """The learning-rate schedule does not run as written in this run: a warm-up as long as the run or longer
    (the message names both settings, where the rate ends and the fix)."""


class RampError(JaxparError):
    """A batch ramp that cannot be run."""


class NonFiniteError(JaxparError, FloatingPointError):
    """A step's loss or gradient norm was NaN / inf and the run was told to stop (or could not skip it)."""


class OutOfMemoryError(JaxparError, MemoryError):
    """XLA could not allocate what a step (or the train state) needs on a device (``RESOURCE_EXHAUSTED``): the
    message gives the bytes asked for, the cost model's predicted peak per device, the memory a device has,
    and points to ``jaxpar inspect``."""


class StepHangError(JaxparError, TimeoutError):
    """A training step took longer than its bound (:class:`~jaxpar.run.Watchdog`): a collective that never
    completes because a process is stuck or gone, or a step that stopped making progress. Every process dumps
    its Python stacks into the run directory and exits with :data:`~jaxpar.run.HUNG_EXIT`."""


class LoopError(JaxparError):
    """Options of the training loop, its logging or its metrics that it cannot run with (an int below its
    minimum, an unknown mode), or that do not fit together: an interval (``steps``, ``log_every``, ...) that
    ``steps_per_call`` does not divide."""


class GenerationError(JaxparError):
    """A greedy decode (:func:`~jaxpar.greedy_generate`) that cannot run as asked: an empty prompt, a count
    below its minimum, or a prompt plus continuation longer than the model's maximum positions (the
    message names the lengths and the fix)."""


class ExplicitDPError(JaxparError):
    """``explicit_dp=True`` was asked where jaxpar cannot make the data-axis collectives explicit."""


class StepError(JaxparError):
    """An option of :func:`~jaxpar.make_train_step` that it cannot take: a ``loss_fn`` that is not a function,
    ``clip_norm`` that is not None or a finite number > 0, or ``donate`` / ``skip_nonfinite`` /
    ``explicit_dp`` outside their values."""


class NoiseScaleError(JaxparError):
    """A gradient-noise-scale measurement that cannot be made as asked (the message names the option and the fix)."""


class StrategyMismatchError(JaxparError):
    """``make_train_step`` was given another strategy than the one its layout was built for."""


# Data.


class DataError(JaxparError):
    """Data that jaxpar cannot turn into batches (the base of the errors below)."""


class SourceError(DataError):
    """A document source that cannot be read: a missing file or field, an empty source, a malformed record."""


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded, or a special token it lacks."""


class CacheError(DataError):
    """A token cache that is missing, damaged, or was built from other sources, tokenizer or options."""


# Hugging Face checkpoints.


class HFConfigError(JaxparError):
    """A ``config.json`` that jaxpar cannot import: it names the field, the value and what is supported."""


class HFExportError(JaxparError):
    """An export that would overwrite files, or lacks what it needs to write the checkpoint."""


class HFFilesError(JaxparError):
    """The checkpoint's files are missing, unreadable or disagree with its index."""


class HFCheckpointError(JaxparError):
    """The checkpoint's tensors do not match its config: missing or unexpected keys, a shape, the head."""


# Devices, the cost model and the planner.


class ClusterError(JaxparError):
    """A cluster description is invalid; the message names the field and the fix."""


class CostModelError(JaxparError):
    """An input of the cost model it cannot take: a :class:`~jaxpar.cost.ModelSpec`, ``Link`` or
    ``Overlap`` field, a collective's kind, algorithm, size or process count, a recomputation policy or
    a precision name (the message names the field, the value and what it takes)."""


class AnalysisError(JaxparError):
    """An input that the analysis of compiled programs (:mod:`jaxpar.analysis`) cannot read: not a compiled
    program or HLO text, a program of another mesh or shape than asked, an HLO construct it does not parse,
    or an unknown collective kind."""


class LayoutError(JaxparError):
    """A parameter cannot be laid out on the mesh (a size does not divide)."""


class PlanError(JaxparError):
    """No plan exists (bad sizes, or nothing fits); the message says why and what to change."""


class DistributedError(JaxparError):
    """Inconsistent or incomplete multi-process settings (the message names the flag / variable and the fix)."""


class ProgramMismatchError(DistributedError):
    """The processes of one job would run different step programs (or could not compare them in time): the
    message lists the processes that differ, the first differing instruction and the config keys that differ."""


class TargetError(JaxparError):
    """A target that cannot be built or compiled for: the message names the value and the fix."""


# Configs.


class ConfigError(JaxparError):
    """A configuration is invalid; the message names the key (e.g. ``mesh.tensor``)."""


# The one check of an int option, for every layer (the config layer reports ``int_problem`` under its YAML key).


def int_problem(value, low: int) -> str | None:
    """Why ``value`` is not an int >= ``low`` (a bool is not an int here).

    Args:
      value: the value to check.
      low: the smallest value allowed.

    Returns:
      ``"must be an int >= low"``, or ``None`` when ``value`` is one.

    >>> int_problem(2, 1), int_problem(0, 1), int_problem(True, 0)
    (None, 'must be an int >= 1', 'must be an int >= 0')
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return f"must be an int >= {low}"
    return None


def is_number(value) -> bool:
    """Whether ``value`` is an int or float, inf and NaN included (a bool is not a number here).

    >>> is_number(2), is_number(float("inf")), is_number(True), is_number("1")
    (True, True, False, False)
    """
    return not isinstance(value, bool) and isinstance(value, (int, float))


def finite_number(value) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here).

    >>> finite_number(2), finite_number(1e-9), finite_number(True), finite_number(float("inf"))
    (True, True, False, False)
    """
    return is_number(value) and math.isfinite(value)


def check_int(owner: str, name: str, value, low: int, error: type[JaxparError]) -> None:
    """Raise ``error`` naming ``owner(name=value)`` unless ``value`` is an int >= ``low``.

    Args:
      owner: the function or class named in the message.
      name: the argument's name.
      value: the value to check (a bool is not an int here).
      low: the smallest value allowed.
      error: the :class:`JaxparError` subclass to raise.

    >>> check_int("train", "steps", 0, 1, LoopError)
    Traceback (most recent call last):
    ...
    jaxpar.errors.LoopError: train(steps=0): must be an int >= 1.
    """
    if (why := int_problem(value, low)) is not None:
        raise error(f"{owner}({name}={value!r}): {why}.")


# ----------------------------------------------------------------------------- names that moved
# The public names that moved since the documented API of e46ff18, each still served at its old place for one
# release with a DeprecationWarning that names the new one (tests/test_public_api.py pins them). A package serves
# its old names from its module ``__getattr__ = moved_getattr(__name__)``; the new homes are looked up by name when
# an old name is read, so a package never imports the modules that moved out of it (several of them import it).

#: Old dotted name -> its new dotted name.
MOVED = {
    "jaxpar.compression_plan": "jaxpar.step.compression_plan",
    "jaxpar.replica_bytes": "jaxpar.step.replica_bytes",
    "jaxpar.cost.calibrate": "jaxpar.devices.calibrate",
    "jaxpar.cost.calibrate_device": "jaxpar.devices.calibrate_device",
    "jaxpar.parallel.context.METHODS": "jaxpar.options.CONTEXT_METHODS",
    "jaxpar.parallel.context.AttentionError": "jaxpar.errors.AttentionError",
    "jaxpar.parallel.Fp8": "jaxpar.options.Fp8",
    "jaxpar.parallel.Offload": "jaxpar.options.Offload",
    "jaxpar.parallel.context.ContextParallel": "jaxpar.options.ContextParallel",
    **{f"jaxpar.parallel.context.{name}": f"jaxpar.attention.{name}"
       for name in ("attention", "AttentionFallbackWarning", "KERNELS", "choose_kernel", "count_attention_kernels",
                    "current_attention_kernel", "use_attention_kernel")},
}

#: Old dotted name -> (where the object lives now, what replaced it): public names with no new public home.
RETIRED = {
    "jaxpar.parallel.moe.expert_mlp": (
        "jaxpar.parallel.moe._dispatch.expert_mlp",
        "the sorted dispatch replaced the [G, E, C, D] expert buffers it runs on: a MoE layer runs its experts "
        "on the routed rows only, by jaxpar.parallel.moe.routed_mlp"),
    "jaxpar.cost.step_peak_bytes": ("jaxpar.cost.memory_per_device", "the name gives jaxpar.cost.memory_per_device, "
                                    "and memory_per_device(model, plan, precision='fp32', activation_bytes=4, "
                                    "keeps=platform).total is the peak it returned"),
}


def _resolve(dotted: str) -> Any:
    """The object at ``dotted``, a module's attribute."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def moved_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that serves its :data:`MOVED` and :data:`RETIRED` names.

    Args:
      module: the package's ``__name__``.

    Returns:
      ``__getattr__(name)``: the object, after a :class:`DeprecationWarning` naming its new place (or its
      replacement); an :class:`AttributeError` for any other name.

    >>> import warnings
    >>> import jaxpar.parallel.context as cp
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     attention = cp.attention
    >>> import jaxpar.attention; attention is jaxpar.attention.attention
    True
    >>> str(caught[0].message).startswith("jaxpar.parallel.context.attention moved to jaxpar.attention.attention;")
    True
    """
    def __getattr__(name: str) -> Any:
        old = f"{module}.{name}"
        if old in MOVED:
            message = (f"{old} moved to {MOVED[old]}; import it from there (the old name goes in the next "
                       "release).")
            where = MOVED[old]
        elif old in RETIRED:
            where, instead = RETIRED[old]
            message = f"{old} is deprecated and goes in the next release: {instead}."
        else:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return _resolve(where)

    return __getattr__
