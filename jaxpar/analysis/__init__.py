"""Read compiled programs: collectives inventory (_hlo.py; mesh-axis attribution of replica groups in
_replica_groups.py; the HLO text itself in _hlo_text.py), how often each computation runs (_loops.py:
while loops' trip counts, known or read from the loop), per-device
memory (_compiled_memory.py), collectives inside device-dependent branches (_device_branches.py: a taint analysis
from ``partition-id``), and bytes per step per mesh axis for comparison with the cost model (_axis_bytes.py,
imported on its own: it reads pipeline schedules), the cost model against jaxpar's compiled train step
(_cost_check.py), a GPU program's GEMMs by operand type (_gemms.py), MoE's grouped-GEMM kernels and the loops
only the routing bounds (_moe_kernels.py),
and a ``jax.profiler`` trace's steps by compute and collective (_trace.py).

The planner's wing: these modules import the core and the cost model, never jaxpar.run, jaxpar.config or the CLI.
"""
from jaxpar.analysis._device_branches import BranchCollective as BranchCollective
from jaxpar.analysis._device_branches import device_dependent_collectives as device_dependent_collectives
from jaxpar.analysis._hlo import Collective as Collective, collectives as collectives, collectives_table as collectives_table
from jaxpar.analysis._hlo import count as count, summarize as summarize
from jaxpar.analysis._loops import trip_counts as trip_counts, while_trip_counts as while_trip_counts
from jaxpar.analysis._gemms import dot_flops as dot_flops, tile_loop_flops as tile_loop_flops
from jaxpar.analysis._moe_kernels import (GroupedCall as GroupedCall, grouped_calls as grouped_calls,
                                          grouped_flops as grouped_flops, routing_loops as routing_loops)
from jaxpar.analysis._cost_check import compile_and_compare as compile_and_compare, compile_plan as compile_plan
from jaxpar.analysis._compiled_memory import MemoryReport as MemoryReport, memory_report as memory_report, memory_table as memory_table
from jaxpar._text import format_bytes as format_bytes
from jaxpar.analysis._trace import StepProfile as StepProfile, Trace as Trace, find_trace as find_trace
from jaxpar.analysis._trace import read_trace as read_trace, step_profiles as step_profiles

__all__ = ["BranchCollective", "device_dependent_collectives", "Collective", "collectives", "collectives_table",
           "count", "dot_flops", "tile_loop_flops", "summarize", "trip_counts", "while_trip_counts", "MemoryReport", "memory_report", "memory_table",
           "GroupedCall", "grouped_calls", "grouped_flops", "routing_loops",
           "format_bytes", "StepProfile", "Trace", "find_trace", "read_trace", "step_profiles", "compile_and_compare",
           "compile_plan"]
