"""Bits and bytes of a compressed payload: 8 signs or 4 ternary codes per byte, and a
payload (a dict of arrays with a leading row axis) as one ``uint8`` buffer per row, so
that one collective carries codes and scales together, whatever their dtypes.

Example::

    >>> import jax.numpy as jnp
    >>> bits = jnp.array([[1, 0, 0, 0, 0, 0, 0, 1]], jnp.uint8)
    >>> pack_bits(bits, 1).tolist(), unpack_bits(pack_bits(bits, 1), 1, 8).tolist()
    ([[129]], [[1, 0, 0, 0, 0, 0, 0, 1]])
    >>> payload = {"codes": jnp.ones((2, 4), jnp.int8), "scale": jnp.full((2, 1), 0.5)}
    >>> wire = to_bytes(payload)                 # 4 codes + one fp32 scale per row
    >>> wire.shape, wire.dtype
    ((2, 8), dtype('uint8'))
    >>> back = from_bytes(wire, payload)
    >>> back["scale"].tolist(), back["codes"].dtype
    ([[0.5], [0.5]], dtype('int8'))
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """``codes`` (``[..., n]``, values < 2**bits) packed ``8 // bits`` per byte (``n`` a
    multiple of that), first code in the lowest bits.

    Args:
      codes: ``[..., n]`` integer codes.
      bits: bits per code: 1, 2, 4 or 8.

    Returns:
      ``uint8[..., n * bits // 8]``.
    """
    per = 8 // bits
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.bitwise_or.reduce(jnp.left_shift(c, shifts), axis=-1) if per > 1 else c[..., 0]


def unpack_bits(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: ``[..., n]`` codes as ``uint8``.

    Args:
      packed: ``uint8[..., m]``, of :func:`pack_bits`.
      bits: bits per code.
      n: the number of codes (at most ``m * 8 // bits``).

    Returns:
      ``uint8[..., n]``.
    """
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    mask = jnp.uint8((1 << bits) - 1)
    out = jnp.bitwise_and(jnp.right_shift(packed[..., None], shifts), mask)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n]


def to_bytes(payload: dict[str, jax.Array]) -> jax.Array:
    """Every array of ``payload`` (leading row axis) as bytes, concatenated per row: ``uint8[rows, B]``.

    Args:
      payload: arrays by name, each ``[rows, ...]``.

    Returns:
      The bytes, arrays in sorted name order.
    """
    rows = [jax.lax.bitcast_convert_type(payload[k], jnp.uint8).reshape(payload[k].shape[0], -1)
            for k in sorted(payload)]
    return jnp.concatenate(rows, axis=1)


def payload_bytes(template: Any) -> int:
    """Bytes per row of a payload (arrays or ``ShapeDtypeStruct``s with a leading row axis).

    Args:
      template: arrays or ``ShapeDtypeStruct`` s by name.

    Returns:
      The bytes.
    """
    return sum(int(a.size // a.shape[0]) * jnp.dtype(a.dtype).itemsize for a in template.values())


def from_bytes(wire: jax.Array, template: Any) -> dict[str, jax.Array]:
    """Inverse of :func:`to_bytes`; ``template`` gives each array's shape (after the row
    axis, which is taken from ``wire``) and dtype.

    Args:
      wire: ``uint8[rows, B]``, of :func:`to_bytes`.
      template: the payload's arrays or ``ShapeDtypeStruct`` s by name (any leading size).

    Returns:
      The payload, ``[rows, ...]`` arrays by name.
    """
    rows, out, start = wire.shape[0], {}, 0
    for k in sorted(template):
        t = template[k]
        item, per_row = jnp.dtype(t.dtype).itemsize, tuple(t.shape[1:])
        n = item * math.prod(per_row)
        chunk = wire[:, start:start + n]
        start += n
        arr = jax.lax.bitcast_convert_type(chunk if item == 1 else chunk.reshape(rows, n // item, item), t.dtype)
        out[k] = arr.reshape(rows, *per_row)
    return out
