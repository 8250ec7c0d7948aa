"""Pipeline parallelism: schedule tables as data (table.py: types and validation; schedules.py:
the builders; metrics.py: bubble and in-flight counts), their lowering to slotted per-tick
programs (program.py), the shard_map executor (executor.py) and the per-stage machinery it runs
(stage.py: the tick table, the actions F / B / W, one tick; buffers.py: the slotted buffers;
layer_vjp.py: what a layer's backward stores), stage partitioning (partition.py),
the cut of any model at its stacked blocks (cut.py -> parts.py), the pipelined loss-and-grad of
a train step (piped.py, loaded by ``make_train_step`` only when ``pipe > 1``), Gantt charts
(render.py), PipeDream-2BW's delayed-gradient rule with its no-flush table (two_bw.py) and
PipeDream's weight stashing: its version rule and slots (stash_versions.py) and its train step (stash_step.py)."""
from jaxpar.parallel.pipeline.executor import pipeline_value_and_grad as pipeline_value_and_grad
from jaxpar.parallel.pipeline.partition import (PartitionError as PartitionError, from_stages as from_stages, layer_costs as layer_costs,
                        partition_layers as partition_layers, to_stages as to_stages,
                        uniform_layers as uniform_layers)
from jaxpar.parallel.pipeline.parts import PipelineParts as PipelineParts
from jaxpar.parallel.pipeline.instructions import Program as Program, lower as lower, sends as sends
from jaxpar.parallel.pipeline.schedules import (Action as Action, Schedule as Schedule, ScheduleError as ScheduleError,
                        bubble_fraction as bubble_fraction, get_schedule as get_schedule,
                        peak_in_flight as peak_in_flight, to_text as to_text, validate as validate)
from jaxpar.parallel.pipeline.schedules import pipedream as pipedream, pipedream_2bw as pipedream_2bw

__all__ = ["Action", "Schedule", "ScheduleError", "bubble_fraction", "get_schedule", "peak_in_flight",
           "to_text", "validate", "Program", "lower", "sends", "pipeline_value_and_grad", "PipelineParts",
           "PartitionError", "partition_layers", "uniform_layers", "layer_costs", "to_stages",
           "from_stages", "pipedream", "pipedream_2bw"]
