"""Sparsifying codecs with local accumulation (Deep Gradient Compression, Lin et al. 2018): each replica
sends ``k = ratio * n`` values (and their int32 indices) and keeps the rest in a residual.

* ``topk(ratio)``: the ``k`` largest magnitudes; the exchange all-gathers ``(values, indices)``.
* ``randomk(ratio)``: ``k`` evenly spaced indices at an offset drawn with the same seed on every
  replica, so only the values are all-reduced (``O(k)`` to draw).

Options: DGC's ``momentum`` correction and sparsity ``warmup`` (each density its own compiled branch);
for top-k, ``partitioned=True`` and ``precondition=b2`` (docs/compression.md).

Example::

    >>> import jax, jax.numpy as jnp
    >>> codec = topk(0.25)
    >>> v = jnp.array([0.1, -3.0, 0.2, 2.0, 0.0, 0.5, -0.1, 0.3])
    >>> p = codec.encode(v, None)
    >>> sorted(p["indices"].tolist()), codec.decode(p, 8).tolist()
    ([1, 3], [0.0, -3.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    >>> codec.wire_bytes(8, replicas=4)          # all-gather of 2 x (fp32 value + int32 index) from 3 others
    48
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.errors import check_int, is_number
from jaxpar.parallel.compression._base import BaseCodec, CompressionError, check_start


@dataclass(frozen=True)
class Sparsifier(BaseCodec):
    """A top-k or random-k codec (see the module docstring)."""

    name: str
    ratio: float
    momentum: float = 0.0
    warmup: tuple = ()
    warmup_steps: int = 0
    seed: int = 0
    kind: str = "sparse"
    error_feedback: bool = True     # local accumulation of what was not sent
    optimizer_momentum: float = 0.0   # > 0: Adam's first moment is what is sparsified (as 1-bit Adam)
    start_step: int = 0             # steps before it: the exact (uncompressed) exchange
    partitioned: bool = False       # replica i picks among entries i mod N; all values on the N k picked
    precondition: float = 0.0       # > 0 (Adam's b2): rank by |v| / sqrt(second moment of the exact steps)

    @property
    def densities(self) -> tuple[float, ...]:
        return tuple(self.warmup) + (self.ratio,)

    def k(self, n: int, density: float | None = None, replicas: int = 1) -> int:
        """Entries each replica picks out of ``n`` (partitioned: out of its ``n / replicas``).

        Args:
          n: the values exchanged.
          density: the share sent, or ``None``: ``ratio``.
          replicas: the devices the mean is over.

        Returns:
          ``k``, at least 1.
        """
        k = max(1, min(n, math.ceil((self.ratio if density is None else density) * n)))
        return min(k, n // replicas) if self.partitioned else k

    def stage(self, step) -> jax.Array:
        """Index into :attr:`densities` at ``step`` (traced).

        Args:
          step: the step (traced).

        Returns:
          An ``int32`` scalar.
        """
        if not self.warmup:
            return jnp.zeros((), jnp.int32)
        return jnp.minimum(step // self.warmup_steps, len(self.warmup)).astype(jnp.int32)

    def indices(self, v: jax.Array, key, k: int, weight: jax.Array | None = None) -> jax.Array:
        """Which ``k`` entries of ``v`` to send (random-k: ``key`` must agree on every replica;
        top-k: the largest ``|v| * weight``).

        Args:
          v: ``f32[n]``.
          key: a PRNG key (random-k).
          k: how many.
          weight: ``f32[n]`` ranking weights (top-k), or ``None``.

        Returns:
          ``int32[k]``.
        """
        if self.name == "randomk":    # a random offset, stride n // k: every index equally likely, O(k) to draw
            n = v.shape[0]
            offset = jax.random.randint(key, (), 0, n)
            return ((offset + jnp.arange(k) * (n // k)) % n).astype(jnp.int32)
        score = jnp.abs(v) if weight is None else jnp.abs(v) * weight
        return jax.lax.top_k(score, k)[1].astype(jnp.int32)

    def encode(self, v: jax.Array, key, density: float | None = None) -> dict:
        """The payload of ``v``: the values at :meth:`indices`.

        Args:
          v: ``f32[n]``.
          key: a PRNG key (random-k).
          density: the share sent, or ``None``: ``ratio``.

        Returns:
          ``{"values": f32[k], "indices": int32[k]}``.
        """
        idx = self.indices(v, key, self.k(v.shape[0], density))
        return {"values": v[idx], "indices": idx}

    def decode(self, payload: dict, n: int) -> jax.Array:
        """Dense ``f32[n]`` from a payload; leading replica axes are summed (scatter-add).

        Args:
          payload: ``values`` and ``indices``, ``[..., k]`` each.
          n: the values exchanged.

        Returns:
          ``f32[n]``.
        """
        out = jnp.zeros((n,), jnp.float32)
        return out.at[payload["indices"].reshape(-1)].add(payload["values"].reshape(-1).astype(jnp.float32))

    def wire_bytes(self, n: int, replicas: int, *, density: float | None = None) -> int:
        """Bytes one device sends: top-k all-gathers ``k`` (fp32 value, int32 index) pairs to the
        ``replicas - 1`` others; random-k all-reduces ``k`` fp32 values (a ring: ``2 (N-1)/N`` of
        them).

        Args:
          n: the values exchanged.
          replicas: the devices the mean is over.
          density: the share sent, or ``None``: ``ratio``.

        Returns:
          The bytes.
        """
        k = self.k(n, density, replicas)
        if self.name == "randomk":
            return round(2 * (replicas - 1) / replicas * 4 * k)
        if self.partitioned:        # all-gather of k int32 indices, all-reduce of N k fp32 values
            return (replicas - 1) * 4 * k + round(2 * (replicas - 1) / replicas * 4 * replicas * k)
        return (replicas - 1) * 8 * k


def _check(name: str, ratio, momentum, warmup, warmup_steps) -> None:
    if not is_number(ratio) or not 0 < ratio <= 1:
        raise CompressionError(f"{name}(ratio={ratio!r}): the fraction of values sent must be in (0, 1], "
                               "e.g. ratio=0.01 for 1%.")
    if not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise CompressionError(f"{name}(momentum={momentum!r}): momentum correction needs 0 <= momentum < 1 "
                               "(0 turns it off).")
    for d in warmup:
        if not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise CompressionError(f"{name}(warmup={tuple(warmup)!r}): every warm-up density must be in (0, 1], "
                                   "e.g. warmup=(0.25, 0.063, 0.015, 0.004).")
    if warmup:
        check_int(name, "warmup_steps", warmup_steps, 1, CompressionError)


def topk(ratio: float, *, momentum: float = 0.0, warmup: tuple = (), warmup_steps: int = 0,
         optimizer_momentum: float | None = None, start_step: int = 0, partitioned: bool = False,
         precondition: float | None = None) -> Sparsifier:
    """Send each replica's ``ceil(ratio * n)`` largest-magnitude values; accumulate the rest.

    Args:
      ratio: the share of the values sent, in (0, 1].
      momentum: DGC's momentum correction, in [0, 1) (0: none).
      warmup: densities in (0, 1] used before ``ratio``, each for ``warmup_steps`` steps.
      warmup_steps: steps per warm-up density.
      optimizer_momentum, start_step: as for :func:`jaxpar.parallel.compression.sign` (1-bit Adam's
        scheme with top-k on Adam's first moment).
      partitioned: replica ``i`` picks among the entries ``j = i mod N`` (see the module docstring).
      precondition: Adam's ``b2``: rank by Adam's step size (see the module docstring); ``None``: by magnitude.

    Returns:
      The :class:`Sparsifier`.

    What passes the 300-step test of docs/compression.md::

        topk(0.01, optimizer_momentum=0.9, start_step=60, partitioned=True, precondition=0.95)
    """
    _check("topk", ratio, momentum, tuple(warmup), warmup_steps)
    start_step, optimizer_momentum = check_start("topk", start_step, optimizer_momentum, momentum)
    if momentum and start_step:
        raise CompressionError(f"topk(momentum={momentum}, start_step={start_step}): momentum correction "
                               "is not applied during exact steps; use one or the other.")
    if warmup and start_step:
        raise CompressionError(f"topk(warmup={tuple(warmup)!r}, start_step={start_step}): choose one way to "
                               "start: a sparsity warm-up, or exact steps before compression.")
    if not isinstance(partitioned, bool):
        raise CompressionError(f"topk(partitioned={partitioned!r}): expected True or False.")
    if precondition is not None and precondition != 0:
        if not is_number(precondition) or not 0 < precondition < 1:
            raise CompressionError(f"topk(precondition={precondition!r}): Adam's b2, whose second moment ranks the "
                                   "entries, must lie in (0, 1), e.g. precondition=0.95 (the optimizer's b2).")
        if not optimizer_momentum:
            raise CompressionError(f"topk(precondition={precondition}) ranks Adam's first moment by Adam's frozen "
                                   f"second moment: it needs 1-bit Adam's scheme, e.g. topk({ratio}, "
                                   f"optimizer_momentum=0.9, start_step=60, precondition={precondition}).")
    return Sparsifier("topk", float(ratio), float(momentum), tuple(warmup), warmup_steps,
                      optimizer_momentum=optimizer_momentum, start_step=start_step, partitioned=partitioned,
                      precondition=float(precondition or 0.0))


def randomk(ratio: float, *, momentum: float = 0.0, warmup: tuple = (), warmup_steps: int = 0,
            seed: int = 0) -> Sparsifier:
    """Send ``ceil(ratio * n)`` values at indices drawn from ``seed`` and the step (the same on
    every replica); accumulate the rest.

    Args:
      ratio: the share of the values sent, in (0, 1].
      momentum: DGC's momentum correction, in [0, 1) (0: none).
      warmup: densities in (0, 1] used before ``ratio``, each for ``warmup_steps`` steps.
      warmup_steps: steps per warm-up density.
      seed: the indices' seed.

    Returns:
      The :class:`Sparsifier`.
    """
    _check("randomk", ratio, momentum, tuple(warmup), warmup_steps)
    return Sparsifier("randomk", float(ratio), float(momentum), tuple(warmup), warmup_steps, seed)
