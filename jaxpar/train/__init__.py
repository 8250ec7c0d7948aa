"""Train state, step, loop: the names a user imports (``from jaxpar.train import train, Checkpointer``).

The step is composed from grads.py (gradient kinds), exchange.py (exact / compressed / measured
exchanges), update.py (the optimizer update, PipeDream-2BW's delayed one) and program.py (the
jitted programs, :class:`TrainStep`); init.py builds the sharded state and its layout.
"""
from jaxpar.train.state import StateLayout as StateLayout, TrainState as TrainState
from jaxpar.train.init import init_train_state as init_train_state, state_layout as state_layout
from jaxpar.train.step import make_train_step as make_train_step, shard_batch as shard_batch
from jaxpar.train.program import TrainStep as TrainStep
from jaxpar.train.loop import train as train
from jaxpar.train.report import LogOptions as LogOptions, NonFiniteError as NonFiniteError
from jaxpar.train.checkpoint import Checkpointer as Checkpointer, CheckpointWarning as CheckpointWarning
from jaxpar.train.resume import train_with_checkpoints as train_with_checkpoints
from jaxpar.data.rows import make_global_batch as make_global_batch
from jaxpar.train.sample import greedy_generate as greedy_generate
from jaxpar.train.noise_scale import (NoiseScaleError as NoiseScaleError, plot_noise_scale as plot_noise_scale,
                          with_noise_scale as with_noise_scale)
from jaxpar.train.ramp import AdaptiveRamp as AdaptiveRamp, BatchRamp as BatchRamp, ramp_batch_fn as ramp_batch_fn

__all__ = ["StateLayout", "TrainState", "init_train_state", "state_layout", "make_train_step", "shard_batch",
           "TrainStep", "train", "LogOptions", "NonFiniteError", "Checkpointer", "CheckpointWarning",
           "train_with_checkpoints", "make_global_batch", "greedy_generate", "NoiseScaleError", "plot_noise_scale",
           "with_noise_scale", "AdaptiveRamp", "BatchRamp", "ramp_batch_fn", "compression_plan", "replica_bytes"]

#: Re-exported names whose modules load only when used: compression and relaxed synchronisation
#: stay out of ``import jaxpar`` (as in step.py and init.py); ``from jaxpar.train import X`` loads them.
_FEATURE_EXPORTS = {"compression_plan": ".compressed", "replica_bytes": ".relaxed"}


def __getattr__(name):
    if name in _FEATURE_EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_FEATURE_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FEATURE_EXPORTS))
