"""The train step: the state, its layout and its parts, and the step composed from gradient, exchange,
update and program (:mod:`jaxpar.step._compose`). A feature's state part (:class:`PartLayout`:
:func:`noise_scale`, :func:`router_bias`) goes to ``init_train_state(parts=[...])``; how each optional part
restores from a checkpoint is the step's too (:data:`RESTORE_POLICIES`); the step, eval and
samples run under :func:`strategy_context`, which installs what the parts need.
"""
from jaxpar.step._state import (ParamLayout as ParamLayout, PartLayout as PartLayout, StateLayout as StateLayout,
                                TrainState as TrainState)
from jaxpar.step._init import (init_train_state as init_train_state, param_layout as param_layout,
                               state_layout as state_layout)
from jaxpar.step._compose import make_train_step as make_train_step, shard_batch as shard_batch
from jaxpar.step._exchange import compression_plan as compression_plan
from jaxpar.step._program import TrainStep as TrainStep, strategy_context as strategy_context
from jaxpar.step._noise_scale import (NoiseScaleError as NoiseScaleError, noise_scale as noise_scale,
                                      plot_noise_scale as plot_noise_scale, with_noise_scale as with_noise_scale)
from jaxpar.step._router_bias import router_bias as router_bias, with_router_bias as with_router_bias
from jaxpar.step._replica_mean import replica_bytes as replica_bytes
from jaxpar.step._restore import (RESTORE_POLICIES as RESTORE_POLICIES, PartPlan as PartPlan,
                                  RestorePolicy as RestorePolicy, shapes_of as shapes_of)

__all__ = ["ParamLayout", "PartLayout", "StateLayout", "TrainState", "init_train_state", "param_layout", "state_layout", "make_train_step",
           "shard_batch", "TrainStep", "strategy_context", "NoiseScaleError", "noise_scale", "plot_noise_scale",
           "with_noise_scale", "router_bias", "with_router_bias", "compression_plan", "replica_bytes",
           "RESTORE_POLICIES", "RestorePolicy", "PartPlan", "shapes_of"]
