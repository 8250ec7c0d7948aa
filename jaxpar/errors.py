"""Every error jaxpar raises, under one base: :class:`JaxparError`, a ``ValueError``.

Each error names the field, the values and the fix. A command (``jaxpar train``, ``inspect``, ...)
prints any :class:`JaxparError` as a one-line usage error.

Example:
    >>> import jaxpar
    >>> try:
    ...     jaxpar.MeshSpec(data=3).sizes(8)
    ... except jaxpar.JaxparError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    MeshError True
"""

from __future__ import annotations

__all__ = ["JaxparError", "MeshError", "StrategyError", "MaskError", "RulesError", "LayerListError", "ModelMeshError",
           "CompressionError", "AttentionError", "ContextParallelError", "MoEError", "PipelineCutError",
           "PartitionError", "StashingError", "ScheduleError", "AsyncPipelineError", "SyncError",
           "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "RampError", "NonFiniteError",
           "LoopError",
           "ExplicitDPError", "NoiseScaleError", "StrategyMismatchError", "DataError", "SourceError",
           "TokenizerError", "CacheError", "HFConfigError", "HFExportError", "HFFilesError",
           "HFCheckpointError", "ClusterError", "LayoutError", "PlanError", "DistributedError", "TargetError",
           "ConfigError", "UnusedAxisWarning"]


class JaxparError(ValueError):
    """The base of every error jaxpar raises: input that jaxpar has named as wrong, with the fix."""


# The core: meshes, rules, strategies, optimizers.


class MeshError(JaxparError):
    """A mesh cannot be built from the given sizes or devices."""


class StrategyError(JaxparError):
    """A :class:`~jaxpar.Strategy` field with a value it does not take (a ZeRO stage, a dtype, a count)."""


class MaskError(JaxparError):
    """A trust-ratio / weight-decay mask names no parameter, or does not fit the parameters."""


class RulesError(JaxparError):
    """A logical annotation cannot be mapped onto the mesh."""


# The user's model.


class LayerListError(JaxparError):
    """An ``nnx.List`` of layers cannot be stacked, or its stacked form was used in a way a list allows."""


class ModelMeshError(JaxparError):
    """A model that pins shardings by mesh axes cannot run where jaxpar asked it to."""


# The parallel strategies.


class CompressionError(JaxparError):
    """A compression option or combination that cannot work (the message names it and the fix)."""


class AttentionError(JaxparError):
    """The q/k/v or segment ids given to :func:`jaxpar.parallel.context.attention` do not fit together."""


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
    """A schedule table is illegal (missing/duplicate action or broken dependency)."""


class AsyncPipelineError(JaxparError):
    """A PipeDream-2BW setting that cannot run (names the field, the value and the fix)."""


class SyncError(JaxparError):
    """A synchronisation kind was asked with an option it cannot take, or on a mesh it cannot use."""


# The step and the run.


class CheckpointError(JaxparError, RuntimeError):
    """No usable checkpoint (the message names the directory and what was found there)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is readable but its parameters or optimizer state are another tree than the
    target's (the message names the part and the differences); no older checkpoint is tried."""


class CheckpointWarning(UserWarning):
    """A checkpoint was unreadable and an older one is used instead, or a part of the state it
    holds was dropped or started afresh (the message says which and why)."""


class UnusedAxisWarning(UserWarning):
    """A mesh axis of size > 1 splits nothing (e.g. ``tensor`` over a model without tensor-parallel
    annotations): its devices repeat each other's work. The message names the axis, its size and the fix."""


class RampError(JaxparError):
    """A batch ramp that cannot be run."""


class NonFiniteError(JaxparError, FloatingPointError):
    """A step's loss or gradient norm was NaN / inf and the run was told to stop (or could not skip it)."""


class LoopError(JaxparError):
    """Options of the training loop that do not fit together: an interval (``steps``, ``log_every``,
    ...) that ``steps_per_call`` does not divide."""


class ExplicitDPError(JaxparError):
    """``explicit_dp=True`` was asked where jaxpar cannot make the data-axis collectives explicit."""


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


class LayoutError(JaxparError):
    """A parameter cannot be laid out on the mesh (a size does not divide)."""


class PlanError(JaxparError):
    """No plan exists (bad sizes, or nothing fits); the message says why and what to change."""


class DistributedError(JaxparError):
    """Inconsistent or incomplete multi-process settings (the message names the flag / variable and the fix)."""


class TargetError(JaxparError):
    """A target that cannot be built or compiled for: the message names the value and the fix."""


# Configs.


class ConfigError(JaxparError):
    """A configuration is invalid; the message names the key (e.g. ``mesh.tensor``)."""
