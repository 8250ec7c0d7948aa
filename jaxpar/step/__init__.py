"""The train step: the state, its layout, and the step composed from gradient, exchange and update.

compose.py composes the step from grads.py (gradient kinds), exchange.py (exact / compressed /
measured exchanges over the data axes), replica_mean.py (the replicas' gradient, masked mean and
update over ``replica``), update.py (the optimizer update, PipeDream-2BW's delayed one) and
program.py (the jitted programs, :class:`TrainStep`); stashing_step.py and no_flush_steps.py place
the update of PipeDream's no-flush program (:mod:`jaxpar.parallel.pipeline.versioned_stage`) per
stage in the tick loop or on the whole model between steps, local_steps.py DiLoCo / local SGD / EASGD's inner and outer
programs; init.py builds the sharded state and its layout.
"""
from jaxpar.step.state import StateLayout as StateLayout, TrainState as TrainState
from jaxpar.step.init import init_train_state as init_train_state, state_layout as state_layout
from jaxpar.step.compose import make_train_step as make_train_step, shard_batch as shard_batch
from jaxpar.step.program import TrainStep as TrainStep
from jaxpar.step.noise_scale import (NoiseScaleError as NoiseScaleError, plot_noise_scale as plot_noise_scale,
                                     with_noise_scale as with_noise_scale)

__all__ = ["StateLayout", "TrainState", "init_train_state", "state_layout", "make_train_step", "shard_batch",
           "TrainStep", "NoiseScaleError", "plot_noise_scale", "with_noise_scale", "compression_plan",
           "replica_bytes"]

#: Re-exported names whose modules load only when used: compression and relaxed synchronisation
#: stay out of ``import jaxpar``; ``from jaxpar.step import X`` loads them.
_FEATURE_EXPORTS = {"compression_plan": "jaxpar.step.compressed", "replica_bytes": "jaxpar.step.replica_mean"}


def __getattr__(name):
    if name in _FEATURE_EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_FEATURE_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FEATURE_EXPORTS))
