"""Know before you run: an α-β cost model of collectives (:mod:`~jaxpar.cost._collectives`), memory and
step time, and a planner.

Pure Python + NumPy: JAX is imported only inside the function that traces a model
(:func:`~jaxpar.cost.from_nnx`); the measurements that calibrate a cluster run in :mod:`jaxpar.devices`
(:func:`~jaxpar.devices.calibrate`, :func:`~jaxpar.devices.calibrate_device`). docs/planning.md holds the
formulas, their sources and the checks against compiled programs (:mod:`jaxpar.analysis._axis_bytes`,
:mod:`jaxpar.analysis._cost_check`).

Example::

    >>> from jaxpar import cost
    >>> result = cost.plan(cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64),
    ...                    cost.load_cluster("h100"))
    >>> result.best.plan.name()
    'dp8-zero2'
"""
from jaxpar.cost._cluster import Cluster, ClusterError, cluster_from_dict, fit_gemm_efficiency, load_cluster, presets
from jaxpar.cost._device_bytes import device_argument_bytes, memory_per_device
from jaxpar.cost._collectives import (ALGORITHMS, KINDS as COLLECTIVE_KINDS, Link, best as best_algorithm,
                                      time as collective_time)
from jaxpar.cost._memory import PRECISIONS, BytesPerParam, activation_bytes_per_layer, muon_precision, zero_state_bytes
from jaxpar.cost._model import Leaf, ModelSpec, decoder, from_decoder_config, from_nnx, gpt
from jaxpar.cost._muon import (PLATFORM_CLUSTERS, MuonUpdate, PlacementCost, choose_placement, matrix_groups,
                               muon_comms, muon_update, ns_flops, placement_chooser, placement_cost, placement_table,
                               placements_table, with_muon)
from jaxpar.logical import FEATURES, PLACEMENTS, STACKS, MatrixGroup, matrix_sides
from jaxpar.cost._parallel import Plan
from jaxpar.cost._planner import Estimate, PlanError, PlanResult, evaluate, plan
from jaxpar.cost._time import Overlap, narayanan_flops, step_flops, step_time
from jaxpar.cost._traffic import comms, lowering_for_platform
from jaxpar.errors import moved_getattr

__all__ = ["fit_gemm_efficiency", "Cluster", "ClusterError", "cluster_from_dict", "load_cluster", "presets",
           "device_argument_bytes", "evaluate", "ALGORITHMS", "COLLECTIVE_KINDS", "Link", "best_algorithm",
           "collective_time", "PRECISIONS", "BytesPerParam",
           "activation_bytes_per_layer", "memory_per_device", "muon_precision", "zero_state_bytes", "Leaf", "ModelSpec",
           "from_nnx", "gpt", "decoder", "from_decoder_config", "Estimate", "PlanError", "PlanResult", "plan", "Overlap", "Plan",
           "comms", "lowering_for_platform", "narayanan_flops", "step_flops", "step_time", "FEATURES", "PLACEMENTS",
           "PLATFORM_CLUSTERS",
           "STACKS", "MatrixGroup", "MuonUpdate", "PlacementCost", "choose_placement", "matrix_groups",
           "matrix_sides", "muon_comms", "muon_update", "ns_flops", "placement_chooser", "placement_cost",
           "placement_table", "placements_table", "with_muon"]
__getattr__ = moved_getattr(__name__)     # the names that moved out, for one release (jaxpar.errors.MOVED)
