"""Know before you run: an α-β cost model of collectives, memory and step time, and a planner.

Pure Python + NumPy: no module of this package imports JAX (only :func:`~jaxpar.cost.model.from_nnx`
does, inside the function). Checking the model against compiled programs is done elsewhere:
:mod:`jaxpar.analysis.axis_bytes` reads the bytes per mesh axis of a compiled step and
:mod:`jaxpar.step.cost_check` compiles a plan's train step and compares.

* :mod:`~jaxpar.cost.collectives`: ring / tree / recursive doubling-halving / Rabenseifner /
  lower bound (Thakur, Rabenseifner & Gropp 2005), the best algorithm per size.
* :mod:`~jaxpar.cost.cluster`: nodes, memory, peak FLOP/s, intra- and inter-node links; YAML presets.
* :mod:`~jaxpar.cost.memory`: ZeRO stages, Korthikanti activations (:mod:`~jaxpar.cost.activations`),
  pipeline in-flight micro-batches, how each parameter is sharded on a mesh.
* :mod:`~jaxpar.cost.context_experts`: context parallelism (ring / all-gather / Ulysses: collectives,
  attention work and memory) and expert parallelism (all-to-alls, the MoE layer's buffers).
* :mod:`~jaxpar.cost.parallel`: :class:`Plan`, one point of the search (mesh sizes, ZeRO, CP method, schedule,
  remat).
* :mod:`~jaxpar.cost.schedule`: bubble and in-flight micro-batches of the pipeline schedules.
* :mod:`~jaxpar.cost.traffic`: each strategy's collectives per step and mesh axis, for jaxpar's programs
  and for Megatron-LM's (lowering ``megatron``, to compare with published runs).
* :mod:`~jaxpar.cost.roofline`: each kernel of a layer on the device's roofline.
* :mod:`~jaxpar.cost.flops`: FLOPs per token and per step (Narayanan et al.'s count, and the model's own).
* :mod:`~jaxpar.cost.time`: the step through the pipeline schedule, the collectives' time and what the
  schedule hides of them.
* :mod:`~jaxpar.cost.model`: a model from numbers or from an NNX model.
* :mod:`~jaxpar.cost.refusals`: a plan as the compatibility table's setting (:mod:`jaxpar.compat.table`, pure Python
  too), and why the table refuses it.
* :mod:`~jaxpar.cost.layouts`: the mesh factorisations of a cluster, and why a context / expert size
  cannot run.
* :mod:`~jaxpar.cost.planner`: enumerate, reject what the table refuses or does not fit (with the reason), rank.

Example::

    >>> from jaxpar import cost
    >>> result = cost.plan(cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64),
    ...                    cost.load_cluster("h100"))
    >>> result.best.plan.name()
    'dp8-zero2'
"""
from jaxpar.cost.cluster import Cluster, ClusterError, load_cluster, presets
from jaxpar.cost.collectives import Link
from jaxpar.cost.memory import PRECISIONS, BytesPerParam, activation_bytes_per_layer, memory_per_device, zero_state_bytes
from jaxpar.cost.model import Leaf, ModelSpec, from_gpt_config, from_nnx, gpt
from jaxpar.cost.parallel import Plan
from jaxpar.cost.planner import Estimate, PlanError, PlanResult, plan
from jaxpar.cost.time import Overlap, flops_per_token, narayanan_flops, step_flops, step_time
from jaxpar.cost.traffic import comms

__all__ = ["Cluster", "ClusterError", "load_cluster", "presets", "Link", "PRECISIONS", "BytesPerParam",
           "activation_bytes_per_layer", "memory_per_device", "zero_state_bytes", "Leaf", "ModelSpec",
           "from_gpt_config", "from_nnx", "gpt", "Estimate", "PlanError", "PlanResult", "plan", "Overlap", "Plan",
           "comms", "flops_per_token", "narayanan_flops", "step_flops", "step_time"]
