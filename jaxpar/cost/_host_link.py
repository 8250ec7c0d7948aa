"""Memory offloading in the cost model (docs/planning.md §12): what a plan with ``Plan.offload`` keeps in
host memory, what it moves over the host link per step, and the seconds that costs.

``Plan.offload`` is the :class:`jaxpar.options.Offload` of the state that ``Strategy.offload`` holds:
``optimizer`` (the optimizer state), ``master`` (the parameters, jaxpar's one fp32 copy) or both, and
``update="host"`` where the update runs in host memory (its label's parts ``opt``, ``master``, ``host``),
and the layers' inputs (``activations=(LAYER_INPUT,)``, label part ``act``) under ``remat="full"``: the
model's ``"offload"`` policy recomputes as full recomputation does, and writes each layer's input to host
memory in the forward and reads it back in the backward instead of keeping it (:func:`plan_offload`;
other names are not modelled). The state's terms are jaxpar's
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

The layers' inputs move each way once per micro-batch: ``layers`` times the input of a layer on one
device (:func:`jaxpar.cost._memory.layer_activations` under ``"full"``), in the compute dtype (the
compiled programs: tests/test_offload_cost.py). None of the state's transfers overlap with compute: the
stream-in precedes the forward (which reads every streamed parameter: the layer scan reads the stacked
arrays whole), and the host update's chain (gradients out, update, parameters back) follows the backward
(the update waits for the global gradient norm) and precedes the next step. The activations' transfers
are counted exposed too: the GPU overlaps part of them (one H200: 67 MB each way cost 1.4 ms of the 2.1 ms
the link takes, docs/benchmarks.md §22). The host update streams :func:`jaxpar.cost._time.update_bytes`
at the cluster's ``host_memory_gbps``.

Example::

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.cost._parallel import Plan
    >>> from jaxpar.strategy import Strategy
    >>> m = gpt(2, 32, 8, 16, 64, 16)
    >>> plan = Plan(data=8, strategy=Strategy(offload=Offload(optimizer=True, update="host")))
    >>> host_bytes(m, plan) == 8 * m.n_params
    True
    >>> transfer_bytes(m, plan) == {"to_host": 8 * m.n_params, "to_device": 4 * m.n_params}
    True
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from jaxpar.cost._memory import layer_activations, state_bytes
from jaxpar.options import LAYER_INPUT, Offload

#: What the planner proposes when no plan fits without offloading: the optimizer state in host memory, updated
#: there. It saves what ``opt-master-host`` saves at the device's peak (the step needs the parameters on the
#: device) and moves as many bytes; the device update (``opt``) saves nothing at the peak (the state is
#: streamed in for the step).
PROPOSED = Offload(optimizer=True, update="host")
#: Bytes per parameter of jaxpar's state (fp32 parameters, gradients and two moments): ``precision="fp32"``.
PRECISION = "fp32"


def plan_offload(offload: Offload | None, remat: str) -> Offload | None:
    """What the cost model models of a ``Strategy.offload`` under the model's ``remat`` policy: the state, and
    the layers' inputs where the policy is ``"offload"`` and they are what it offloads (other activation
    names are not modelled).

    Args:
      offload: ``Strategy.offload``.
      remat: the model's remat policy (``"none"``, ``"full"``, ``"save-matmuls"`` or ``"offload"``).

    Returns:
      The ``Plan.offload`` (None: nothing modelled in host memory).

    >>> plan_offload(Offload(optimizer=True, activations=("x",)), "offload").label
    'offload-opt'
    >>> acts = Offload(activations=(LAYER_INPUT,))
    >>> other = Offload(activations=("x",))
    >>> plan_offload(acts, "offload").label, plan_offload(acts, "full"), plan_offload(other, "offload")
    ('offload-act', None, None)
    """
    if offload is None:
        return None
    acts = (LAYER_INPUT,) if remat == "offload" and offload.activations == (LAYER_INPUT,) else ()
    if not (offload.optimizer or offload.master or acts):
        return None
    return replace(offload, activations=acts)


def host_bytes(model, plan) -> float:
    """Bytes one device's state keeps in host memory between steps under ``plan.strategy.offload`` (0 without).

    Args:
      model: the :class:`~jaxpar.cost.ModelSpec`.
      plan: the :class:`~jaxpar.cost.Plan`.

    Returns:
      The optimizer state's shard, and the parameters' under ``master``, in jaxpar's fp32 layout.
    """
    offload = plan.strategy.offload
    if offload is None:
        return 0.0
    st = state_bytes(model, plan.sizes, plan.strategy.zero, PRECISION)
    return st["opt"] * offload.optimizer + st["params"] * offload.master


def transfer_bytes(model, plan, activation_bytes: float = 2) -> dict[str, float]:
    """Bytes one device moves over the host link per step (see the module doc).

    Args:
      model: the model.
      plan: the plan.
      activation_bytes: bytes per activation value (the compute dtype's).

    Returns:
      ``{"to_host": bytes, "to_device": bytes}`` (zeros without offload).
    """
    offload = plan.strategy.offload
    acts = activation_transfer_bytes(model, plan, activation_bytes)
    if offload is None or not offload.host_update:
        s = host_bytes(model, plan) + acts
        return {"to_host": s, "to_device": s}
    st = state_bytes(model, plan.sizes, plan.strategy.zero, PRECISION)
    return {"to_host": st["opt"] + acts, "to_device": st["params"] * (2 if offload.master else 1) + acts}


def activation_transfer_bytes(model, plan, activation_bytes: float = 2) -> float:
    """Bytes of layer inputs one device writes to host memory per step, and reads back (0 without them).

    Args:
      model: the model.
      plan: the plan.
      activation_bytes: bytes per activation value.

    Returns:
      ``layers / pipe`` layers' inputs of every row the device computes in the step.
    """
    offload = plan.strategy.offload
    if offload is None or not offload.activations:
        return 0.0
    return plan.stage_depth(model.layers) * layer_activations(model, plan.sizes, model.batch / plan.batch_split, remat="full",
                                                         sequence_parallel=plan.strategy.sequence_parallel,
                                                         activation_bytes=activation_bytes)


class OffloadTime(NamedTuple):
    """Seconds per step that offloading adds: ``link`` (the transfers, exposed) and ``host_update`` (the
    update's arithmetic in host memory; 0 under the device update), and what the cluster preset lacks to time
    them (``unmodelled``: :func:`host_link_gaps`; a term it lacks counts 0 s)."""

    link: float
    host_update: float
    unmodelled: tuple[str, ...] = ()


def host_link_gaps(cluster, host_update: bool) -> tuple[str, ...]:
    """What a cluster preset lacks to time offloading (``host_link_gbps``, and under the host update
    ``host_memory_gbps``), each in words; the time leaves it out instead of refusing the plan.

    Args:
      cluster: the :class:`~jaxpar.cost.Cluster`.
      host_update: whether the update runs in host memory.

    Returns:
      One sentence per missing term (empty: the preset times offloading).

    >>> from jaxpar.cost._cluster import load_cluster
    >>> host_link_gaps(load_cluster("h100"), True)
    ()
    >>> host_link_gaps(load_cluster("cpu_sim"), False)
    ('host transfers not modelled: cluster cpu_sim has no host link (host_link_gbps)',)
    """
    gaps = []
    if cluster.host_link <= 0:
        gaps.append(f"host transfers not modelled: cluster {cluster.name} has no host link (host_link_gbps)")
    if host_update and cluster.host_memory_bandwidth <= 0:
        gaps.append(f"the host update not modelled: cluster {cluster.name} has no host memory bandwidth "
                    "(host_memory_gbps), so the update is timed as on the device")
    return tuple(gaps)


def offload_seconds(model, plan, cluster, update_bytes: float, activation_bytes: float = 2) -> OffloadTime:
    """The :class:`OffloadTime` of ``plan`` on ``cluster``.

    Args:
      model: the model.
      plan: the plan (``plan.strategy.offload`` set).
      cluster: the :class:`~jaxpar.cost.Cluster` (its ``host_link`` and ``host_memory_bandwidth``; a preset
        without one times its term as 0 s and says so in ``unmodelled``: :func:`host_link_gaps`).
      update_bytes: the bytes the update reads and writes on one device (:func:`jaxpar.cost._time.update_bytes`).
      activation_bytes: bytes per activation value.

    Returns:
      The seconds.
    """
    offload = plan.strategy.offload
    if offload is None:
        return OffloadTime(0.0, 0.0)
    moved = transfer_bytes(model, plan, activation_bytes)
    link = (moved["to_host"] + moved["to_device"]) / cluster.host_link if cluster.host_link > 0 else 0.0
    host = update_bytes / cluster.host_memory_bandwidth if offload.host_update and \
        cluster.host_memory_bandwidth > 0 else 0.0
    return OffloadTime(link, host, host_link_gaps(cluster, offload.host_update))
