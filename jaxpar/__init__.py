"""jaxpar: declarative SPMD parallelism for Flax NNX models on JAX meshes."""

from jaxpar.mesh import MeshSpec as MeshSpec, MeshError as MeshError, make_mesh as make_mesh
from jaxpar.mesh import simulate_cpu_devices as simulate_cpu_devices, use_devices as use_devices, data_axes as data_axes
from jaxpar.rules import RulesError as RulesError, logical_to_spec as logical_to_spec, resolve as resolve
from jaxpar.rules import named_shardings as named_shardings, use_rules as use_rules, constrain as constrain
from jaxpar.blocks import scan_blocks as scan_blocks, run_layers as run_layers
from jaxpar.layer_lists import stack_layers as stack_layers, LayerListError as LayerListError
from jaxpar.strategy import Strategy as Strategy
from jaxpar.tensor import tensor_rules as tensor_rules
from jaxpar.zero import analytic_state_bytes as analytic_state_bytes
from jaxpar.train.state import TrainState as TrainState, StateLayout as StateLayout
from jaxpar.train.init import init_train_state as init_train_state, state_layout as state_layout
from jaxpar.batch import shard_batch as shard_batch
from jaxpar.loss_metrics import report_metric as report_metric
from jaxpar.train.step import make_train_step as make_train_step, ExplicitDPError as ExplicitDPError
from jaxpar.train.state import StrategyMismatchError as StrategyMismatchError

__version__ = "0.1.0"

__all__ = [
    "MeshSpec", "MeshError", "make_mesh", "simulate_cpu_devices", "use_devices", "data_axes",
    "RulesError", "logical_to_spec", "resolve", "named_shardings", "use_rules", "constrain",
    "scan_blocks", "run_layers", "stack_layers", "LayerListError", "Strategy", "tensor_rules", "analytic_state_bytes",
    "TrainState", "StateLayout", "init_train_state", "state_layout", "make_train_step", "ExplicitDPError",
    "StrategyMismatchError", "shard_batch", "report_metric",
]
