"""Know before you run: an α-β cost model of collectives, memory and step time, and a planner.

Pure Python + NumPy: no module of this package imports JAX (only :func:`~jaxpar.cost.from_nnx`
does, inside the function). Checking the model against compiled programs is done elsewhere:
:mod:`jaxpar.analysis._axis_bytes` reads the bytes per mesh axis of a compiled step and
:mod:`jaxpar.step._cost_check` compiles a plan's train step and compares.

* :mod:`~jaxpar.cost._collectives`: ring / tree / recursive doubling-halving / Rabenseifner /
  lower bound (Thakur, Rabenseifner & Gropp 2005), the best algorithm per size.
* :mod:`~jaxpar.cost._cluster`: nodes, memory, peak FLOP/s, intra- and inter-node links; YAML presets.
* :mod:`~jaxpar.cost._memory`: ZeRO stages, Korthikanti activations (:mod:`~jaxpar.cost._activations`),
  pipeline in-flight micro-batches, how each parameter is sharded on a mesh.
* :mod:`~jaxpar.cost._context_experts`: context parallelism (ring / all-gather / Ulysses: collectives,
  attention work and memory) and expert parallelism (all-to-alls, the MoE layer's buffers).
* :mod:`~jaxpar.cost._parallel`: :class:`Plan`, one point of the search (mesh sizes, ZeRO, CP method, schedule,
  remat).
* :mod:`~jaxpar.cost._schedule`: bubble and in-flight micro-batches of the pipeline schedules.
* :mod:`~jaxpar.cost._traffic`: each strategy's collectives per step and mesh axis, for jaxpar's programs
  and for Megatron-LM's (lowering ``megatron``, to compare with published runs).
* :mod:`~jaxpar.cost._roofline`: each kernel of a layer on the device's roofline.
* :mod:`~jaxpar.cost._flops`: FLOPs per token and per step (Narayanan et al.'s count, and the model's own).
* :mod:`~jaxpar.cost._time`: the step through the pipeline schedule, the collectives' time and what the
  schedule hides of them.
* :mod:`~jaxpar.cost._model`: a model from numbers or from an NNX model.
* :mod:`~jaxpar.cost._refusals`: a plan as the compatibility table's setting (:mod:`jaxpar.compat._table`, pure Python
  too), and why the table refuses it.
* :mod:`~jaxpar.cost._layouts`: the mesh factorisations of a cluster, and why a context / expert size
  cannot run.
* :mod:`~jaxpar.cost._planner`: enumerate, reject what the table refuses or does not fit (with the reason), rank.

Example::

    >>> from jaxpar import cost
    >>> result = cost.plan(cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64),
    ...                    cost.load_cluster("h100"))
    >>> result.best.plan.name()
    'dp8-zero2'
"""
from jaxpar.cost._cluster import Cluster, ClusterError, cluster_from_dict, load_cluster, presets
from jaxpar.cost._device_bytes import device_argument_bytes, step_peak_bytes
from jaxpar.cost._collectives import (ALGORITHMS, KINDS as COLLECTIVE_KINDS, Link, best as best_algorithm,
                                      time as collective_time)
from jaxpar.cost._memory import PRECISIONS, BytesPerParam, activation_bytes_per_layer, memory_per_device, zero_state_bytes
from jaxpar.cost._model import Leaf, ModelSpec, from_gpt_config, from_nnx, gpt
from jaxpar.cost._parallel import Plan
from jaxpar.cost._planner import Estimate, PlanError, PlanResult, evaluate, plan
from jaxpar.cost._time import Overlap, flops_per_token, narayanan_flops, step_flops, step_time
from jaxpar.cost._traffic import comms

__all__ = ["Cluster", "ClusterError", "cluster_from_dict", "load_cluster", "presets", "device_argument_bytes",
           "step_peak_bytes", "evaluate", "ALGORITHMS", "COLLECTIVE_KINDS", "Link", "best_algorithm",
           "collective_time", "PRECISIONS", "BytesPerParam",
           "activation_bytes_per_layer", "memory_per_device", "zero_state_bytes", "Leaf", "ModelSpec",
           "from_gpt_config", "from_nnx", "gpt", "Estimate", "PlanError", "PlanResult", "plan", "Overlap", "Plan",
           "comms", "flops_per_token", "narayanan_flops", "step_flops", "step_time"]
