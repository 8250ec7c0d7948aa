"""The parallel strategies: data parallelism, ZeRO, tensor (+ sequence) parallelism here; pipelines,
context and expert parallelism, compressed exchanges and relaxed synchronisation in the packages
:mod:`~jaxpar.parallel.pipeline`, :mod:`~jaxpar.parallel.context`, :mod:`~jaxpar.parallel.moe`,
:mod:`~jaxpar.parallel.compression` and :mod:`~jaxpar.parallel.sync`.

>>> from jaxpar.parallel import ZERO_STAGES
>>> ZERO_STAGES
(0, 1, 2, 3)
"""
from jaxpar.parallel._data_parallel import (bucketed_all_gather, bucketed_reduce_scatter, data_parallel_block,
                                            explicit_by_default)
from jaxpar.parallel._fp8 import fp8_dot_general, fp8_layer, fp8_loss
from jaxpar.parallel._lookup import TABLE_EMBED, embed_lookup
from jaxpar.errors import moved_getattr
from jaxpar.parallel._cross_entropy import cross_entropy, linear_cross_entropy
from jaxpar.parallel._tensor import column_parallel, row_parallel, tensor_rules
from jaxpar.parallel._zero import ZERO_STAGES, add_zero_axes, analytic_state_bytes, zero_dim

__all__ = ["bucketed_all_gather", "bucketed_reduce_scatter", "data_parallel_block", "explicit_by_default",
           "fp8_dot_general", "fp8_layer", "fp8_loss", "TABLE_EMBED", "embed_lookup", "column_parallel",
           "cross_entropy", "linear_cross_entropy", "row_parallel", "tensor_rules",
           "ZERO_STAGES", "add_zero_axes", "analytic_state_bytes", "zero_dim"]
__getattr__ = moved_getattr(__name__)     # the names that moved out, for one release (jaxpar.errors.MOVED)
