"""jaxpar: declarative SPMD parallelism for Flax NNX models on JAX meshes."""

from .mesh import MeshSpec as MeshSpec, MeshError as MeshError, make_mesh as make_mesh
from .mesh import simulate_cpu_devices as simulate_cpu_devices, use_devices as use_devices, data_axes as data_axes
from .rules import RulesError as RulesError, logical_to_spec as logical_to_spec, resolve as resolve
from .rules import named_shardings as named_shardings, use_rules as use_rules, constrain as constrain
from .blocks import scan_blocks as scan_blocks, run_layers as run_layers
from .layer_lists import stack_layers as stack_layers, LayerListError as LayerListError
from .strategy import Strategy as Strategy
from .tensor import tensor_rules as tensor_rules
from .zero import analytic_state_bytes as analytic_state_bytes
from .train.state import TrainState as TrainState, StateLayout as StateLayout
from .train.init import init_train_state as init_train_state, state_layout as state_layout
from .batch import shard_batch as shard_batch
from .loss_metrics import report_metric as report_metric
from .train.step import make_train_step as make_train_step, ExplicitDPError as ExplicitDPError
from .train.state import StrategyMismatchError as StrategyMismatchError

__version__ = "0.1.0"

__all__ = [
    "MeshSpec", "MeshError", "make_mesh", "simulate_cpu_devices", "use_devices", "data_axes",
    "RulesError", "logical_to_spec", "resolve", "named_shardings", "use_rules", "constrain",
    "scan_blocks", "run_layers", "stack_layers", "LayerListError", "Strategy", "tensor_rules", "analytic_state_bytes",
    "TrainState", "StateLayout", "init_train_state", "state_layout", "make_train_step", "ExplicitDPError",
    "StrategyMismatchError", "shard_batch", "report_metric",
]
