"""Memory offloading in the cost model (docs/planning.md §12): what a plan with ``Plan.offload`` keeps in
host memory, what it moves over the host link per step, and the seconds that costs.

``Plan.offload`` is the :class:`jaxpar.options.Offload` of the state that ``Strategy.offload`` holds:
``optimizer`` (the optimizer state), ``master`` (the parameters, jaxpar's one fp32 copy) or both, and
``update="host"`` where the update runs in host memory (its label's parts ``opt``, ``master``, ``host``).
Offloaded activations are not modelled (:func:`state_offload`). The terms are jaxpar's
layout: fp32 parameters and gradients, two fp32 Adam moments per parameter (``precision="fp32"``), each
sharded as ZeRO / FSDP shards it. The transfers per step and device are those of the compiled program
(``jaxpar inspect --target``; docs/strategies.md, memory offloading):

- device update: the offloaded state ``S`` streams to the device at the step's start and back at its
  end (``S`` each way);
- host update: the gradients and the parameters of the optimizer state's shard go to host memory (``2 P_o``,
  ``P_o`` their fp32 bytes: the moments' bytes in all, as ZeRO-1/2 shard the state and not the parameters)
  and the new parameters come back in their own sharding (``P``); with ``master`` the parameters stream in
  for the forward and the update's result is written back to the host: XLA moves ``2 P`` to the device
  (FSDP8, a 2-layer GPT at DP8, a Llama-3-shaped Decoder on one H100) or ``P`` where it reuses the
  stream-in (a 4-layer GPT at DP8); the model counts ``2 P``. Measured on h100:1x8 and h100:1x1
  (tests/test_offload_cost.py; docs/planning.md §12).

None of it overlaps with compute: the stream-in precedes the forward (which reads every streamed
parameter: the layer scan reads the stacked arrays whole), and the host update's chain (gradients out,
update, parameters back) follows the backward (the update waits for the global gradient norm) and
precedes the next step. The host update streams :func:`jaxpar.cost._time.update_bytes` at the cluster's
``host_memory_gbps``.

Example::

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.cost._parallel import Plan
    >>> m = gpt(2, 32, 8, 16, 64, 16)
    >>> opt_host = Offload(optimizer=True, update="host")
    >>> host_bytes(m, Plan(data=8, offload=opt_host)) == 8 * m.n_params
    True
    >>> transfer_bytes(m, Plan(data=8, offload=opt_host)) == {"to_host": 8 * m.n_params, "to_device": 4 * m.n_params}
    True
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from jaxpar.cost._memory import state_bytes
from jaxpar.errors import CostModelError
from jaxpar.options import Offload

#: What the planner proposes when no plan fits without offloading: the optimizer state in host memory, updated
#: there. It saves what ``opt-master-host`` saves at the device's peak (the step needs the parameters on the
#: device) and moves as many bytes; the device update (``opt``) saves nothing at the peak (the state is
#: streamed in for the step).
PROPOSED = Offload(optimizer=True, update="host")
#: Bytes per parameter of jaxpar's state (fp32 parameters, gradients and two moments): ``precision="fp32"``.
PRECISION = "fp32"


def offload_overrides(offload: Offload | None) -> str:
    """The YAML value of ``parallel.offload`` that runs ``offload``.

    >>> offload_overrides(Offload(optimizer=True, master=True, update="host")), offload_overrides(None)
    ('{optimizer: true, master: true, update: host}', '{}')
    """
    if offload is None:
        return "{}"
    keys = [f"{k}: true" for k in ("optimizer", "master") if getattr(offload, k)]
    keys += ["update: host"] * offload.host_update
    return "{" + ", ".join(keys) + "}"


def state_offload(offload: Offload | None) -> Offload | None:
    """What the cost model models of a ``Strategy.offload``: the state's, without the activations.

    >>> state_offload(Offload(optimizer=True, activations=("x",))).label, state_offload(Offload(activations=("x",)))
    ('offload-opt', None)
    """
    if offload is None or not (offload.optimizer or offload.master):
        return None
    return replace(offload, activations=())


def host_bytes(model, plan) -> float:
    """Bytes one device's state keeps in host memory between steps under ``plan.offload`` (0 without).

    Args:
      model: the :class:`~jaxpar.cost.ModelSpec`.
      plan: the :class:`~jaxpar.cost.Plan`.

    Returns:
      The optimizer state's shard, and the parameters' under ``master``, in jaxpar's fp32 layout.
    """
    offload = getattr(plan, "offload", None)
    if offload is None:
        return 0.0
    st = state_bytes(model, plan.sizes, plan.zero, PRECISION)
    return st["opt"] * offload.optimizer + st["params"] * offload.master


def transfer_bytes(model, plan) -> dict[str, float]:
    """Bytes one device moves over the host link per step (see the module doc).

    Args:
      model: the model.
      plan: the plan.

    Returns:
      ``{"to_host": bytes, "to_device": bytes}`` (zeros without offload).
    """
    offload = getattr(plan, "offload", None)
    if offload is None or not offload.host_update:
        s = host_bytes(model, plan)
        return {"to_host": s, "to_device": s}
    st = state_bytes(model, plan.sizes, plan.zero, PRECISION)
    return {"to_host": st["opt"], "to_device": st["params"] * (2 if offload.master else 1)}


class OffloadTime(NamedTuple):
    """Seconds per step that offloading adds: ``link`` (the transfers, exposed) and ``host_update`` (the
    update's arithmetic in host memory; 0 under the device update)."""

    link: float
    host_update: float


def offload_seconds(model, plan, cluster, update_bytes: float) -> OffloadTime:
    """The :class:`OffloadTime` of ``plan`` on ``cluster``.

    Args:
      model: the model.
      plan: the plan (``plan.offload`` set).
      cluster: the :class:`~jaxpar.cost.Cluster` (its ``host_link`` and ``host_memory_bandwidth``).
      update_bytes: the bytes the update reads and writes on one device (:func:`jaxpar.cost._time.update_bytes`).

    Returns:
      The seconds.

    Raises:
      CostModelError: the cluster models no host link (or, under the host update, no host memory).
    """
    offload = getattr(plan, "offload", None)
    if offload is None:
        return OffloadTime(0.0, 0.0)
    if cluster.host_link <= 0 or (offload.host_update and cluster.host_memory_bandwidth <= 0):
        raise CostModelError(f"plan {plan.name()}: cluster {cluster.name!r} models no host link (host_link_gbps) or "
                             "no host memory bandwidth (host_memory_gbps); add them to the preset to time offloading.")
    moved = transfer_bytes(model, plan)
    link = (moved["to_host"] + moved["to_device"]) / cluster.host_link
    host = update_bytes / cluster.host_memory_bandwidth if offload.host_update else 0.0
    return OffloadTime(link, host)
