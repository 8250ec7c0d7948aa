"""The line protocol between ``benchmarks/peers/levanter.py`` and its two workers (one per venv).

Each worker reads one JSON command per line on stdin and writes one JSON reply per line on the
file descriptor that was its stdout; everything libraries print goes to stderr. This module imports
nothing but the standard library, so both venvs load it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable


def serve(handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer commands ``{"cmd": name, **kwargs}`` with ``{"ok": handlers[name](**kwargs)}`` or
    ``{"error": traceback}`` until stdin closes or ``{"cmd": "quit"}``.

    Args:
      handlers: the worker's commands by name.
    """
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                       # library output goes to stderr, the protocol keeps its own fd
    sys.stdout = sys.stderr
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            break
        try:
            out = {"ok": handlers[cmd](**msg)}
        except Exception:               # the driver shows the worker's traceback and stops
            out = {"error": traceback.format_exc()}
        reply.write(json.dumps(out) + "\n")


def memory_stats(compiled: Any) -> dict[str, int]:
    """The raw figures of ``compiled.memory_analysis()``, for :class:`jaxpar.analysis.MemoryReport`."""
    s = compiled.memory_analysis()
    peak = getattr(s, "peak_memory_in_bytes", 0)
    return {"argument_bytes": int(s.argument_size_in_bytes), "output_bytes": int(s.output_size_in_bytes),
            "temp_bytes": int(s.temp_size_in_bytes), "alias_bytes": int(s.alias_size_in_bytes),
            "generated_code_bytes": int(s.generated_code_size_in_bytes),
            "xla_peak_bytes": int(peak) if peak else None}


def cost(compiled: Any) -> dict[str, float | None]:
    """The compiler's FLOPs and bytes accessed of ``compiled`` (per device; ``None`` where it has none)."""
    c = compiled.cost_analysis()
    c = (c[0] if isinstance(c, (list, tuple)) else c) or {}
    return {k: float(c[name]) if name in c else None for k, name in (("flops", "flops"),
                                                                      ("bytes_accessed", "bytes accessed"))}


def compiled_report(compiled: Any, hlo: str, compile_s: float, devices: list[Any], mesh: Any) -> dict[str, Any]:
    """A compiled program's reply: its HLO text written to ``hlo``, its compile time, memory, cost, device, mesh."""
    with open(hlo, "w") as f:
        f.write(compiled.as_text())
    return {"compile_s": compile_s, "memory": memory_stats(compiled), **cost(compiled),
            "device": str(devices[0].device_kind), "mesh": dict(mesh.shape)}


def start_cuda_compiler(targets_dir: str) -> None:
    """Load the CUDA plugin from jaxpar's targets directory into this process, for deviceless compiles
    (what ``jaxpar.devices._targets`` does; the plugin must match this process's jax exactly)."""
    import importlib

    import jax
    from jax._src import lib, xla_bridge
    from jax._src.lib import xla_client

    jax.config.update("jax_platforms", "cpu")
    if targets_dir not in sys.path:
        xla_bridge._discover_and_register_pjrt_plugins()
        sys.path.append(targets_dir)
        importlib.invalidate_caches()
    if not xla_client.pjrt_plugin_loaded("cuda"):
        importlib.import_module("jax_plugins.xla_cuda12").initialize()
    if lib.cuda_path is None:
        lib.cuda_path = lib._cuda_path()


def gpu_devices(name: str, target_config: str, hosts: int, per_host: int) -> list[Any]:
    """The abstract devices of a GPU topology (after :func:`start_cuda_compiler`)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology_name=name, target_config=target_config,
                                        topology=f"1x{hosts}x{per_host}")
    return list(topo.devices)
