"""Pipeline parallelism: schedule tables as data (_tick_table.py: types and validation; _schedules.py:
the builders; _schedule_stats.py: bubble and in-flight counts; _lockstep.py: one action kind per tick),
their lowering to slotted per-tick programs (_instructions.py), the shard_map executor (_executor.py)
and the per-stage machinery it runs (_tick_arrays.py: the tick table as arrays, the sends, the
one-of-kinds conditional; _stage.py: the actions F / B / W, one tick;
_lockstep_stage.py: the same, masked, for lockstep tables; _buffers.py: the slotted buffers;
_layer_vjp.py: what a layer's backward stores, with _vjp_residuals.py and _split_backward.py),
stage partitioning (_partition.py), the cut of any model at its stacked blocks (_cut.py -> _parts.py),
a forward-only pass through the stages (_sweep.py), the pipelined loss-and-grad of a train step
(_piped.py, loaded by ``make_train_step`` only when ``pipe > 1``), Gantt charts (_render.py),
PipeDream-2BW's delayed-gradient rule with its no-flush table (_two_bw.py), and PipeDream's weight
stashing: its version rule and slots (_stash_versions.py) and which optimizers it can run per stage
(_stash_optimizer.py); the stage both run, which reads the weight version a table names
(_versioned_stage.py: one program for both); where their update runs is in :mod:`jaxpar.step`
(:mod:`jaxpar.step._no_flush_steps`, :mod:`jaxpar.step._stashing_step`)."""
from jaxpar.parallel.pipeline._executor import pipeline_value_and_grad as pipeline_value_and_grad
from jaxpar.parallel.pipeline._partition import (PartitionError as PartitionError, from_stages as from_stages, layer_costs as layer_costs,
                                                 partition_layers as partition_layers, to_stages as to_stages,
                                                 uniform_layers as uniform_layers)
from jaxpar.parallel.pipeline._parts import PipelineParts as PipelineParts
from jaxpar.parallel.pipeline._lockstep import is_lockstep as is_lockstep, lockstep as lockstep
from jaxpar.parallel.pipeline._instructions import Program as Program, lower as lower, sends as sends
from jaxpar.parallel.pipeline._schedules import (Action as Action, Schedule as Schedule, ScheduleError as ScheduleError,
                                                 bubble_fraction as bubble_fraction, get_schedule as get_schedule,
                                                 peak_in_flight as peak_in_flight, to_text as to_text, validate as validate)
from jaxpar.parallel.pipeline._schedules import pipedream as pipedream, pipedream_2bw as pipedream_2bw
from jaxpar.parallel.pipeline._stash_versions import stashed_versions as stashed_versions
from jaxpar.parallel.pipeline._two_bw import step_windows as step_windows, two_bw_versions as two_bw_versions

__all__ = ["Action", "Schedule", "ScheduleError", "bubble_fraction", "get_schedule", "peak_in_flight",
           "to_text", "validate", "Program", "lower", "sends", "pipeline_value_and_grad", "PipelineParts",
           "PartitionError", "partition_layers", "uniform_layers", "layer_costs", "to_stages",
           "from_stages", "pipedream", "pipedream_2bw", "is_lockstep", "lockstep",
           "stashed_versions", "step_windows", "two_bw_versions"]
