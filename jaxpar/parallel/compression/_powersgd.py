"""PowerSGD (Vogels et al. 2019): rank-``r`` gradient compression with error feedback.

For each weight matrix ``M`` (the local gradient plus its residual, ``n x m``; a stacked
``[L, n, ...]`` leaf is ``L`` matrices): ``P = M Q``, all-reduce ``P``, orthonormalise,
``Q = M^T P``, all-reduce ``Q``; the gradient is ``P Q^T`` and the residual ``M - P Q^T``
(orthonormalised by Gram-Schmidt, :func:`orthonormalize`).
``Q`` is kept for the next step (``warm_start``). Vectors and matrices for which
``(n + m) r * min_compression_rate >= n m`` are averaged uncompressed, in the same
all-reduce as ``P``: two all-reduces per step in all.

Example::

    >>> import jax, jax.numpy as jnp
    >>> codec = powersgd(rank=2)
    >>> codec.matrix((64, 32), stacked=False), codec.matrix((64,), stacked=False)   # (batch, n, m, r)
    ((1, 64, 32, 2), None)
    >>> codec.matrix((4, 64, 8, 4), stacked=True)        # 4 stacked layers of 64 x 32
    (4, 64, 32, 2)
    >>> m = jax.random.normal(jax.random.key(0), (1, 64, 32))
    >>> approx, q = codec.compress([m], [codec.init_q(jax.random.key(1), (1, 64, 32, 2))], [], lambda x: x)[0:2]
    >>> approx[0].shape, q[0].shape
    ((1, 64, 32), (1, 32, 2))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxpar.errors import check_int
from jaxpar.parallel.compression._base import BaseCodec, CompressionError


@dataclass(frozen=True)
class PowerSGD(BaseCodec):
    """Options of :func:`powersgd`."""

    rank: int
    warm_start: bool = True
    start_step: int = 0
    min_compression_rate: float = 2.0
    seed: int = 0
    name: str = "powersgd"
    kind: str = "lowrank"
    error_feedback: bool = True

    def matrix(self, shape: tuple, stacked: bool) -> tuple[int, int, int, int] | None:
        """``(batch, n, m, r)`` of a leaf compressed as ``batch`` matrices ``n x m`` of rank
        ``r``, or ``None`` for a leaf sent uncompressed.

        Args:
          shape: the leaf's shape.
          stacked: whether its axis 0 is the stacked ``layers`` axis.

        Returns:
          ``(batch, n, m, r)`` (``n``: axis 0 of a matrix, ``m``: the product of the others), or ``None``.
        """
        batch, rest = (shape[0], shape[1:]) if stacked else (1, tuple(shape))
        if len(rest) < 2:
            return None
        n, m = rest[0], math.prod(rest[1:])
        r = min(self.rank, n, m)
        if (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return batch, n, m, r

    def init_q(self, key, matrix: tuple[int, int, int, int]) -> jax.Array:
        """A random first ``Q`` of a matrix.

        Args:
          key: a PRNG key.
          matrix: ``(batch, n, m, r)``, of :meth:`matrix`.

        Returns:
          ``f32[batch, m, r]``, standard normal.
        """
        batch, _, m, r = matrix
        return jax.random.normal(key, (batch, m, r), jnp.float32)

    def compress(self, ms: list, qs: list, plain: list, mean: Callable) -> tuple[list, list, list]:
        """``(approximations, new Qs, averaged plain leaves)`` of matrices ``ms`` (``[b, n, m]``)
        with ``qs`` (``[b, m, r]``); ``mean`` averages a flat fp32 vector over the replicas
        (called twice: for ``P`` with the plain leaves, then for ``Q``).

        Args:
          ms: ``f32[b, n, m]`` matrices (gradient plus residual).
          qs: their ``Q`` s.
          plain: the leaves sent uncompressed.
          mean: ``f32[k] -> f32[k]``, the mean over the replicas.

        Returns:
          The three lists.
        """
        ps = [jnp.einsum("bnm,bmr->bnr", m, q) for m, q in zip(ms, qs)]
        pieces = mean_of(mean, ps + list(plain))
        ps, plain = [orthonormalize(p) for p in pieces[:len(ps)]], pieces[len(ps):]
        qs = [jnp.einsum("bnm,bnr->bmr", m, p) for m, p in zip(ms, ps)]
        qs = mean_of(mean, qs) if qs else []
        approx = [jnp.einsum("bnr,bmr->bnm", p, q) for p, q in zip(ps, qs)]
        return approx, qs, plain

    def wire_bytes(self, shapes: list, stacked: list, replicas: int) -> int:
        """Bytes one device sends for the two ring all-reduces (``P`` plus the plain leaves, then ``Q``).

        Args:
          shapes: the gradient leaves' shapes.
          stacked: whether each leaf's axis 0 is the stacked ``layers`` axis.
          replicas: the devices the mean is over.

        Returns:
          The bytes.
        """
        first = second = 0
        for s, st in zip(shapes, stacked):
            mat = self.matrix(tuple(s), st)
            if mat is None:
                first += math.prod(s)
            else:
                b, n, m, r = mat
                first, second = first + b * n * r, second + b * m * r
        ring = 2 * (replicas - 1) / replicas * 4
        return round(ring * first) + round(ring * second)


def orthonormalize(p: jax.Array) -> jax.Array:
    """Orthonormal columns of each ``[b, n, r]`` matrix, by Gram-Schmidt with one
    re-orthogonalisation per column ("twice is enough"); an all-zero column stays zero.

    Plain array operations on purpose: LAPACK's QR inside a program whose devices wait in
    collectives can starve XLA:CPU's thread pool (a deadlock with 8 simulated devices).

    Args:
      p: ``[b, n, r]``.

    Returns:
      ``p``'s shape, orthonormal columns.

    >>> import jax, jax.numpy as jnp
    >>> q = orthonormalize(jax.random.normal(jax.random.key(0), (2, 16, 4)))
    >>> bool(jnp.allclose(jnp.einsum("bnr,bns->brs", q, q), jnp.eye(4), atol=1e-5))
    True
    """
    r = p.shape[-1]

    def column(j, q):
        c = q[..., j]
        for _ in range(2):
            coef = jnp.einsum("bnr,bn->br", q, c) * (jnp.arange(r) < j)
            c = c - jnp.einsum("bnr,br->bn", q, coef)
        norm = jnp.linalg.norm(c, axis=-1, keepdims=True)       # scale-free: gradients can be tiny
        return q.at[..., j].set(jnp.where(norm > 0, c / jnp.where(norm > 0, norm, 1.0), 0.0))

    return jax.lax.fori_loop(0, r, column, p)


def mean_of(mean: Callable, xs: list) -> list:
    """``xs`` averaged by ``mean`` (``f32[k] -> f32[k]``, over the replicas) as one flat vector: one collective.

    Args:
      mean: the mean of a flat fp32 vector over the replicas.
      xs: fp32 arrays.

    Returns:
      The averaged arrays, ``xs``' shapes.
    """
    flat, unflatten = ravel_pytree(list(xs))
    return unflatten(mean(flat))


def powersgd(rank: int = 4, *, warm_start: bool = True, start_step: int = 0,
             min_compression_rate: float = 2.0, seed: int = 0) -> PowerSGD:
    """PowerSGD of rank ``rank`` (see the module docstring). Before ``start_step`` gradients
    are averaged uncompressed; ``warm_start=False`` draws a fresh ``Q`` every step.

    Args:
      rank: the rank ``r``, >= 1.
      warm_start: keep ``Q`` from step to step.
      start_step: exact (uncompressed) steps before compression.
      min_compression_rate: a matrix is compressed only if that shrinks it at least this many times
        (0: every matrix).
      seed: the seed of the first ``Q``.

    Returns:
      The :class:`PowerSGD` codec.
    """
    check_int("powersgd", "rank", rank, 1, CompressionError)
    check_int("powersgd", "start_step", start_step, 0, CompressionError)
    if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 0:
        raise CompressionError(f"powersgd(min_compression_rate={min_compression_rate!r}): must be >= 0 "
                               "(0 compresses every matrix; 2 only those that shrink at least 2x).")
    return PowerSGD(rank, bool(warm_start), start_step, float(min_compression_rate), seed)
