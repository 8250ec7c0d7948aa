"""Pipeline parallelism: schedule tables as data (_schedules.py, with their lockstep re-timing),
their lowering to slotted per-tick programs (_instructions.py), the shard_map executor (_executor.py)
and what it runs per stage (_stage.py: the program as arrays, the actions F / B / W, the tick;
_buffers.py: the slotted buffers; _layer_vjp.py: what a layer's backward stores, split into B and W),
stage partitioning (_partition.py), the cut of any model at its stacked blocks (_cut.py), a
forward-only pass through the stages (_sweep.py), the pipelined loss-and-grad of a train step
(_piped.py, loaded by ``make_train_step`` only when ``pipe > 1``), Gantt charts (_render.py), and
PipeDream-2BW and weight stashing: their version rules and the stage that reads weight versions
(_pipedream.py; where their update runs is in :mod:`jaxpar.step`)."""
from jaxpar.errors import PartitionError as PartitionError, ScheduleError as ScheduleError
from jaxpar.parallel.pipeline._cut import PipelineParts as PipelineParts
from jaxpar.parallel.pipeline._executor import pipeline_value_and_grad as pipeline_value_and_grad
from jaxpar.parallel.pipeline._instructions import Program as Program, lower as lower, sends as sends
from jaxpar.parallel.pipeline._partition import (from_stages as from_stages, layer_costs as layer_costs,
                                                 partition_layers as partition_layers, to_stages as to_stages,
                                                 uniform_layers as uniform_layers)
from jaxpar.parallel.pipeline._pipedream import (stashed_versions as stashed_versions, step_windows as step_windows,
                                                 two_bw_versions as two_bw_versions)
from jaxpar.parallel.pipeline._schedules import (Action as Action, Schedule as Schedule, bubble_fraction as bubble_fraction,
                                                 get_schedule as get_schedule, is_lockstep as is_lockstep,
                                                 lockstep as lockstep, peak_in_flight as peak_in_flight,
                                                 pipedream as pipedream, pipedream_2bw as pipedream_2bw,
                                                 to_text as to_text, validate as validate)

__all__ = ["Action", "Schedule", "ScheduleError", "bubble_fraction", "get_schedule", "peak_in_flight",
           "to_text", "validate", "Program", "lower", "sends", "pipeline_value_and_grad", "PipelineParts",
           "PartitionError", "partition_layers", "uniform_layers", "layer_costs", "to_stages",
           "from_stages", "pipedream", "pipedream_2bw", "is_lockstep", "lockstep",
           "stashed_versions", "step_windows", "two_bw_versions"]
