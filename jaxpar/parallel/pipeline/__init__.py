"""Pipeline parallelism: schedule tables as data (tick_table.py: types and validation; schedules.py:
the builders; schedule_stats.py: bubble and in-flight counts; lockstep.py: one action kind per tick),
their lowering to slotted per-tick programs (instructions.py), the shard_map executor (executor.py)
and the per-stage machinery it runs (tick_arrays.py: the tick table as arrays, the sends, the
one-of-kinds conditional; stage.py: the actions F / B / W, one tick;
lockstep_stage.py: the same, masked, for lockstep tables; buffers.py: the slotted buffers;
layer_vjp.py: what a layer's backward stores, with vjp_residuals.py and split_backward.py),
stage partitioning (partition.py), the cut of any model at its stacked blocks (cut.py -> parts.py),
a forward-only pass through the stages (sweep.py), the pipelined loss-and-grad of a train step
(piped.py, loaded by ``make_train_step`` only when ``pipe > 1``), Gantt charts (render.py),
PipeDream-2BW's delayed-gradient rule with its no-flush table (two_bw.py), and PipeDream's weight
stashing: its version rule and slots (stash_versions.py) and which optimizers it can run per stage
(stash_optimizer.py); the stage both run, which reads the weight version a table names
(versioned_stage.py: one program for both); where their update runs is in :mod:`jaxpar.step`
(:mod:`jaxpar.step.no_flush_steps`, :mod:`jaxpar.step.stashing_step`)."""
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
