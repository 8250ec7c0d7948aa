"""Read compiled programs: collectives inventory (hlo.py; mesh-axis attribution of replica groups in
replica_groups.py) and per-device memory (memory.py)."""
from .hlo import Collective as Collective, collectives as collectives, collectives_table as collectives_table
from .hlo import count as count, summarize as summarize
from .memory import MemoryReport as MemoryReport, memory_report as memory_report, memory_table as memory_table
from .memory import format_bytes as format_bytes

__all__ = ["Collective", "collectives", "collectives_table", "count", "summarize",
           "MemoryReport", "memory_report", "memory_table", "format_bytes"]
