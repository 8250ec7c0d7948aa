"""Context parallelism (CP): attention over a sequence split along the ``context`` mesh axis.

A model calls :func:`jaxpar.attention.attention` (``[batch, length, heads, head_dim]``). Under rules that map
``length`` to a ``context`` axis of size C > 1 that runs :func:`context_attention`: one of three exact
methods, chosen by :func:`use_context_parallel`: ``ring`` (:mod:`jaxpar.parallel.context._ring`),
``all_gather`` or ``ulysses``. The balanced layout (:mod:`jaxpar.parallel.context._zigzag`) evens out the
causal work; the data pipeline permutes the batch with :func:`to_balanced`.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar, jaxpar.parallel.context as cp
    >>> from jaxpar.attention import attention
    >>> mesh = jaxpar.make_mesh({"context": 4}, devices=jax.devices()[:4])
    >>> rules = (("batch", None), ("length", "context"), ("heads", None))
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 4))
    >>> with jaxpar.use_rules(mesh, rules), cp.use_context_parallel("ring", balance=True):
    ...     y = jax.jit(attention)(cp.to_balanced(x, 1, 4), cp.to_balanced(x, 1, 4), cp.to_balanced(x, 1, 4))
    >>> bool(jnp.allclose(cp.from_balanced(y, 1, 4), attention(x, x, x), atol=1e-6))
    True
"""

from jaxpar.parallel.context._methods import (QKV_LOGICAL, context_attention, context_size, in_natural_order,
                                              in_sequence_order, sequence_order, ulysses_kv_repeat)
from jaxpar.parallel.context._zigzag import RingWork, balanced_order, from_balanced, ring_block_pairs, to_balanced
from jaxpar.errors import ContextParallelError
from jaxpar.mesh import CONTEXT
from jaxpar.parallel.context._options import current_context_parallel
from jaxpar.parallel.context._options import ContextCalls, count_context_calls, note_context_call, use_context_parallel
from jaxpar.parallel.context._ring import fused_ring_problem, ring_attention
from jaxpar.parallel.context._flash import flash_attention, flash_tile
from jaxpar.parallel.context._softmax import allowed, capped_attention, check_softcap, check_window
from jaxpar.errors import moved_getattr

__all__ = [
    "context_attention", "QKV_LOGICAL", "ulysses_kv_repeat", "sequence_order", "in_sequence_order", "in_natural_order",
    "context_size",
    "ContextCalls", "count_context_calls", "note_context_call",
    "balanced_order", "to_balanced", "from_balanced", "ring_block_pairs", "RingWork",
    "CONTEXT", "ContextParallelError", "use_context_parallel",
    "current_context_parallel", "ring_attention", "fused_ring_problem",
    # the flash block kernel and the attention arithmetic that jaxpar.attention runs too
    "flash_attention", "flash_tile", "allowed", "capped_attention", "check_softcap", "check_window",
]
__getattr__ = moved_getattr(__name__)     # the names that moved out, for one release (jaxpar.errors.MOVED)
