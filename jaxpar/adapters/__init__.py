"""How jaxpar reads a user's Flax NNX model: its layers (scanned blocks, lists of layers), the mesh axes
its own annotations name, its shapes, and the metrics its loss reports.

>>> from jaxpar.adapters import REMAT_POLICIES
>>> "full" in REMAT_POLICIES
True
"""
from jaxpar.adapters._blocks import REMAT_POLICIES, remat_policy, run_layers, scan_blocks
from jaxpar.adapters._layer_lists import LayerListError, StackedLayers, list_form, stack_layers, stacked_form
from jaxpar.adapters._loss_metrics import report_metric
from jaxpar.adapters._mesh_axes import ModelMeshError, abstract_model

__all__ = ["REMAT_POLICIES", "remat_policy", "run_layers", "scan_blocks", "LayerListError", "StackedLayers",
           "list_form", "stack_layers", "stacked_form", "report_metric", "ModelMeshError", "abstract_model"]
