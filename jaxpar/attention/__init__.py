"""Attention: the one function a model calls (:func:`attention`, context parallel under a ``context`` mesh
axis: :mod:`jaxpar.parallel.context`), the whole-sequence attention it runs on a device
(:func:`dense_attention`), and which kernel runs that: cuDNN's or a Pallas flash kernel, or XLA's path
(:func:`use_attention_kernel`, :mod:`jaxpar.attention._kernels`).

>>> import jax.numpy as jnp
>>> from jaxpar.attention import attention
>>> q = k = v = jnp.ones((1, 8, 2, 4))
>>> attention(q, k, v, segment_ids=jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])).shape   # two packed sequences
(1, 8, 2, 4)
"""
from jaxpar.attention._attention import attention, dense_attention
from jaxpar.attention._kernels import (KERNELS, AttentionFallbackWarning, choose_kernel, count_attention_kernels,
                                       current_attention_kernel, use_attention_kernel)
from jaxpar.errors import AttentionError

__all__ = ["attention", "dense_attention", "AttentionError", "KERNELS", "AttentionFallbackWarning", "choose_kernel",
           "count_attention_kernels", "current_attention_kernel", "use_attention_kernel"]
