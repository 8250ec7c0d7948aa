"""jaxpar: declarative SPMD parallelism for Flax NNX models on JAX meshes.

The names a user needs sit here: the mesh and its rules, the strategy, the train state and step, the
run around it (``train``, ``Checkpointer``), and every error class (:mod:`jaxpar.errors`).
"""

from jaxpar import errors
from jaxpar.errors import *  # noqa: F401,F403  (every error class, listed in jaxpar.errors.__all__)
from jaxpar.mesh import MeshSpec, make_mesh, simulate_cpu_devices, use_devices, data_axes
from jaxpar.rules import logical_to_spec, resolve, named_shardings, use_rules, constrain
from jaxpar.adapters._blocks import scan_blocks, run_layers
from jaxpar.adapters._layer_lists import stack_layers
from jaxpar.strategy import Strategy
from jaxpar.parallel._tensor import tensor_rules
from jaxpar.parallel._zero import analytic_state_bytes
from jaxpar.step._state import ParamLayout, TrainState, StateLayout
from jaxpar.step._init import init_train_state, param_layout, state_layout
from jaxpar.batch import shard_batch
from jaxpar.adapters._loss_metrics import report_metric
from jaxpar.step._compose import make_train_step
from jaxpar.step._program import TrainStep
from jaxpar.step._noise_scale import plot_noise_scale, with_noise_scale
from jaxpar.data._rows import make_global_batch
from jaxpar.errors import moved_getattr
from jaxpar.run import (AdaptiveRamp, BatchRamp, Checkpointer, LogOptions, greedy_generate, ramp_batch_fn, train,
                        train_with_checkpoints)

__version__ = "0.1.0"

__all__ = [
    "MeshSpec", "make_mesh", "simulate_cpu_devices", "use_devices", "data_axes",
    "logical_to_spec", "resolve", "named_shardings", "use_rules", "constrain",
    "scan_blocks", "run_layers", "stack_layers", "Strategy", "tensor_rules", "analytic_state_bytes",
    "TrainState", "StateLayout", "ParamLayout", "init_train_state", "param_layout", "state_layout",
    "make_train_step", "shard_batch",
    "report_metric", "TrainStep", "plot_noise_scale", "with_noise_scale", "make_global_batch", "AdaptiveRamp",
    "BatchRamp", "Checkpointer", "LogOptions", "greedy_generate", "ramp_batch_fn", "train",
    "train_with_checkpoints", "errors", *errors.__all__,
]
__getattr__ = moved_getattr(__name__)     # the names that moved out, for one release (jaxpar.errors.MOVED)
