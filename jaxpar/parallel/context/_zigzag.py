"""The balanced (zig-zag, "head-tail") layout of a sequence over ``C`` context devices.

Under a causal mask the device holding the end of the sequence has ``C`` times the work of the one
holding its start; the balanced layout gives device ``i`` chunks ``i`` and ``2C-1-i`` of ``2C``
(docs/strategies.md draws it). :func:`to_balanced` permutes every per-token array of the batch along
the sequence, the attention masks by the true positions (:func:`balanced_order`), and
:func:`from_balanced` restores the natural order of per-token outputs.

Example::

    >>> balanced_order(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5])
    >>> x = np.arange(8) * 10
    >>> to_balanced(x, 0, 2)
    array([ 0, 10, 60, 70, 20, 30, 40, 50])
    >>> from_balanced(to_balanced(x, 0, 2), 0, 2)
    array([ 0, 10, 20, 30, 40, 50, 60, 70])
    >>> ring_block_pairs(16, 4, balance=False)    # causal ring: device i computes i + 1 blocks
    RingWork(pairs=(1, 2, 3, 4), block=4)
    >>> ring_block_pairs(16, 4, balance=True)     # half-size blocks, the same count everywhere
    RingWork(pairs=(9, 9, 9, 9), block=2)
    >>> ring_block_pairs(16, 4, balance=False, window=3)   # sliding window: its block and the one before
    RingWork(pairs=(1, 2, 2, 2), block=4)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ContextParallelError


def check_length(length: int, size: int, balance: bool, what: str = "sequence length") -> int:
    """The chunk length of a sequence of ``length`` tokens over ``size`` context devices.

    Args:
      length: the (global) sequence length.
      size: the ``context`` axis size C.
      balance: the balanced layout (``2C`` chunks) or the natural one (``C`` chunks).
      what: names the length in the error message.

    Returns:
      ``length // (2C)`` if ``balance`` else ``length // C``.

    Raises:
      ContextParallelError: ``length`` is not a multiple of the number of chunks.
    """
    chunks = size * chunks_per_shard(balance)
    if length % chunks:
        layout = f"balanced layout, 2*C = {chunks} chunks" if balance else f"C = {chunks} shards"
        raise ContextParallelError(
            f"{what} {length} is not divisible by {chunks} ({layout} over a context axis of size {size}). "
            f"Fix: pad or cut the sequence to a multiple of {chunks} (e.g. {length + (-length) % chunks}), "
            "or change the context axis size" + (" or turn balance off." if balance else "."))
    return length // chunks


def chunks_per_shard(balance: bool) -> int:
    """How many chunks of the sequence each context device holds: 2 balanced, 1 natural.

    Args:
      balance: the balanced (zig-zag) layout.

    Returns:
      2 or 1.
    """
    return 2 if balance else 1


def chunk_index(device: Any, part: int, size: int, balance: bool) -> Any:
    """The chunk of the sequence held as part ``part`` of ``device``'s shard (works on tracers).

    Balanced: part 0 is chunk ``device`` and part 1 chunk ``2C-1-device`` (of ``2C``); natural:
    chunk ``device`` (of ``C``).

    Args:
      device: the device's index on the context axis (an int or a tracer).
      part: 0 or 1.
      size: the context axis size ``C``.
      balance: the balanced (zig-zag) layout.

    Returns:
      The chunk's index in the sequence.
    """
    return 2 * size - 1 - device if balance and part == 1 else device


def pair_needed(q_chunk: Any, k_chunk: Any, causal: bool, window: Any = None, chunk: int = 1) -> Any:
    """Whether a (query chunk, key chunk) pair of equal-length chunks has any unmasked entry.

    Causal: the key chunk does not lie wholly after the query chunk. Window: the closest pair of
    positions, ``(q_chunk - k_chunk) * chunk - (chunk - 1)`` apart, is less than ``window`` apart
    (without a causal mask, on either side). Works on tracers (chunk indices or a traced window):
    it returns a Python or NumPy bool when everything is static, else a traced bool.

    Args:
      q_chunk, k_chunk: the chunks' indices in the sequence.
      causal: the causal mask.
      window: the sliding window, or ``None``.
      chunk: the chunk length (only the window needs it).

    Returns:
      A bool, static or traced.
    """
    need = True if not causal else k_chunk <= q_chunk
    if window is None:
        return need
    gap = (q_chunk - k_chunk) * chunk
    near = gap - (chunk - 1) < window
    if not causal:
        near = near & (gap + (chunk - 1) > -window)
    return near if need is True else need & near


@functools.lru_cache(maxsize=None)
def ring_schedule(size: int, balance: bool, causal: bool, window: int | None, chunk: int) -> tuple:
    """The ring's static schedule: ``[t][d][a][b]``, whether device ``d`` at ring step ``t`` (holding
    the K/V of device ``(d - t) % C``) computes its query chunk ``a`` against key chunk ``b``.

    Args:
      size: the ``context`` axis size C.
      balance: the balanced layout (2 chunks a device) or the natural one (1).
      causal: the causal mask.
      window: a static sliding window, or ``None``.
      chunk: the chunk length.

    Returns:
      Nested tuples of Python bools.
    """
    parts = range(chunks_per_shard(balance))
    return tuple(tuple(tuple(tuple(
        bool(pair_needed(chunk_index(d, a, size, balance), chunk_index((d - t) % size, b, size, balance), causal,
                         window, chunk)) for b in parts) for a in parts) for d in range(size)) for t in range(size))


def balanced_order(length: int, size: int) -> np.ndarray:
    """The true positions of the balanced sequence: ``to_balanced(x)[j] == x[balanced_order(...)[j]]``.

    Args:
      length: the sequence length, a multiple of ``2 * size``.
      size: the ``context`` axis size C.

    Returns:
      An int array of the ``length`` positions in balanced order (device ``i`` holds chunks ``i``
      and ``2C-1-i`` of ``2C``).
    """
    return to_balanced(np.arange(length), 0, size)


def to_balanced(x: Any, axis: int, size: int) -> Any:
    """``x`` with its sequence axis ``axis`` put into the balanced order (numpy in, numpy out).

    Args:
      x: a NumPy or JAX array whose ``axis`` is the sequence.
      axis: the sequence axis.
      size: the ``context`` axis size C.

    Returns:
      ``x`` reordered along ``axis``: ``to_balanced(x)[j] == x[balanced_order(...)[j]]``.
    """
    return _chunks(x, axis, size, inverse=False)


def _chunks(x: Any, axis: int, size: int, inverse: bool) -> Any:
    """``x``'s ``2C`` equal chunks along ``axis`` put into the balanced order (``inverse``: back into the
    natural one): static slices, no gather (XLA's gather partitioner fails inside a ``shard_map``'s
    manual region)."""
    n = check_length(x.shape[axis], size, True)
    placed = [c for i in range(size) for c in (i, 2 * size - 1 - i)]
    order = [placed.index(c) for c in range(2 * size)] if inverse else placed
    if isinstance(x, np.ndarray):
        return np.concatenate([np.take(x, range(c * n, (c + 1) * n), axis) for c in order], axis)
    return jnp.concatenate([jax.lax.slice_in_dim(x, c * n, (c + 1) * n, axis=axis) for c in order], axis=axis)


def from_balanced(x: Any, axis: int, size: int) -> Any:
    """The inverse of :func:`to_balanced`: the natural order back.

    Args:
      x: a NumPy or JAX array in the balanced order along ``axis``.
      axis: the sequence axis.
      size: the ``context`` axis size C.

    Returns:
      ``x`` with its sequence axis in the natural order.
    """
    return _chunks(x, axis, size, inverse=True)


def shard_positions(device: Any, shard_length: int, size: int, balance: bool) -> jnp.ndarray:
    """The true positions of the tokens of ``device``'s shard (``device`` may be a tracer).

    Args:
      device: the index along the context axis (e.g. ``jax.lax.axis_index("context")``).
      shard_length: the tokens per device, ``length // C``.
      size: the ``context`` axis size C.
      balance: whether the sequence is in the balanced order.

    Returns:
      An int32 array of ``shard_length`` positions.
    """
    parts = chunks_per_shard(balance)
    chunk = shard_length // parts
    return jnp.concatenate([chunk_index(device, part, size, balance) * chunk + jnp.arange(chunk, dtype=jnp.int32)
                            for part in range(parts)])


def sequence_positions(length: int, size: int, balance: bool) -> np.ndarray:
    """The true positions of a whole sequence as it is laid out: :func:`balanced_order` or ``arange``.

    Args:
      length: the sequence length.
      size: the context axis size.
      balance: the balanced (zig-zag) layout.

    Returns:
      ``int[length]``.
    """
    return balanced_order(length, size) if balance else np.arange(length)


class RingWork(NamedTuple):
    """Per device, how many (query block, key block) pairs the ring computes, and the block length:
    each pair is ``block x block`` scores per head (the diagonal pairs are computed whole)."""

    pairs: tuple[int, ...]
    block: int


def ring_block_pairs(length: int, size: int, *, balance: bool, causal: bool = True,
                     window: int | None = None) -> RingWork:
    """The block pairs each device's ring attention computes (the rest are skipped).

    It walks the ring's own schedule with the ring's own test (:func:`ring_schedule`,
    :func:`pair_needed`): at step ``t`` device ``d`` holds the K/V shard of device ``(d - t) % C``,
    and each of its query chunks meets each chunk of that shard; a pair that the causal mask or the
    sliding window masks wholly is skipped.

    Args:
      length: the sequence length.
      size: the ``context`` axis size C.
      balance: the balanced layout (blocks of ``length / 2C``) or the natural one (``length / C``).
      causal: the causal mask (without it and without a window every pair is computed).
      window: a static sliding window (a Python int >= 1), or ``None``.

    Returns:
      A :class:`RingWork`.

    Raises:
      ContextParallelError: ``window`` is not ``None`` or a positive int.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ContextParallelError(f"ring_block_pairs: window={window!r} must be a positive int (a static window) "
                                   "or None. Fix: pass the window as a Python int >= 1.")
    block = check_length(length, size, balance)
    plan = ring_schedule(size, balance, causal, None if window is None else int(window), block)
    pairs = tuple(sum(sum(map(sum, step[d])) for step in plan) for d in range(size))
    return RingWork(pairs, block)
