"""What a checkpoint proves of its state: a checksum of every array, recorded at save and compared at restore,
and that its parameters and optimizer moments are finite.

A checksum is the sum over an array's elements of ``(bits_i ^ (i * 0x9E3779B1)) * (2i + 1)`` modulo
``2**32``, ``bits_i`` the element's bits (a float's too; an 8-byte element's two halves xor-ed) and ``i``
its index in the whole array: integer arithmetic, so each device's shard adds its part wherever the array
lives (device or host memory, any sharding, any process), and a changed element or two swapped ones change
it. It runs in NumPy on the host copies of the shards, so it takes no device memory and compiles nothing.

>>> import jax.numpy as jnp
>>> sums, bad = inspect_state({"params": {"w": jnp.ones(3)}, "opt_state": (jnp.array([1.0, jnp.nan]),)})
>>> sorted(sums), bad
(['opt_state/0', 'params/w'], ['opt_state/0'])
>>> inspect_state({"params": {"w": jnp.ones(3)}})[0] == inspect_state({"params": {"w": jnp.ones(3)}})[0]
True
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxpar.rules import path_str

#: The parts of a train state whose arrays are checked (another tree: all of it).
CHECKED = ("params", "opt_state")
_MIX = np.uint32(0x9E3779B1)


def _checked(state: Any) -> dict:
    fields = getattr(state, "_fields", None) or (state.keys() if isinstance(state, dict) else ())
    parts = [f for f in CHECKED if f in fields]
    if not parts:
        return {"": state}
    return {f: getattr(state, f) if hasattr(state, "_fields") else state[f] for f in parts}


def _words(a: np.ndarray) -> np.ndarray:
    """One uint32 of bits per element."""
    if a.dtype == np.bool_:
        return a.astype(np.uint32)
    if a.dtype.itemsize == 8:
        w = a.view(np.uint64)
        return (w ^ (w >> np.uint64(32))).astype(np.uint32)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.uint32)


def _index(shape: tuple, index: tuple) -> np.ndarray:
    """The flat index in the whole array of each element of the block ``index`` (slices), modulo ``2**32``."""
    strides = np.cumprod((1,) + tuple(shape[:0:-1]))[::-1]
    flat = np.zeros((), np.uint64)
    for size, stride, part in zip(shape, strides, index):
        start, stop, _ = part.indices(size)
        flat = np.add.outer(flat, np.arange(start, stop, dtype=np.uint64) * np.uint64(stride))
    return flat.astype(np.uint32)


def _blocks(x: Any) -> list[tuple[np.ndarray, tuple]]:
    """This process's blocks of ``x`` with their slices, one per distinct shard."""
    if isinstance(x, jax.Array):
        return [(np.asarray(s.data), s.index) for s in x.addressable_shards if s.replica_id == 0]
    a = np.asarray(x)
    return [(a, tuple(slice(None) for _ in a.shape))] if jax.process_index() == 0 else []


def _leaf(x: Any) -> tuple[int, bool]:
    """This process's part of a leaf's checksum, and whether its blocks are finite."""
    total, finite = 0, True
    for block, index in _blocks(x):
        i = _index(np.shape(x), index)
        total += int(np.sum((_words(block) ^ (i * _MIX)) * (i * np.uint32(2) + np.uint32(1)), dtype=np.uint32))
        if np.issubdtype(block.dtype, np.inexact) or block.dtype.name == "bfloat16":
            finite = finite and bool(np.isfinite(block.astype(np.float32)).all())
    return total % 2 ** 32, finite


def inspect_state(state: Any) -> tuple[dict[str, list], list[str]]:
    """Each checked array's checksum, and the checked arrays that hold a non-finite value.

    Args:
      state: a train state (its ``params`` and ``opt_state`` are checked) or another tree (all of it).

    Returns:
      ``({path: [checksum, dtype]}, [paths of non-finite arrays])``, paths as the checkpoint's tree names them
      (the dtype: a restore into another dtype is not compared).
    """
    named = jax.tree_util.tree_flatten_with_path(_checked(state))[0]
    parts = np.array([_leaf(x) for _, x in named], np.uint64).reshape(-1, 2)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(parts))
        parts = np.stack([every[..., 0].sum(0) % 2 ** 32, every[..., 1].min(0)], axis=-1)
    paths = [path_str(p).lstrip("/") for p, _ in named]
    dtypes = [str(x.dtype) if hasattr(x, "dtype") else str(np.asarray(x).dtype) for _, x in named]
    return ({p: [int(s), d] for p, (s, _), d in zip(paths, parts, dtypes)},
            [p for p, (_, ok) in zip(paths, parts) if not ok])


def verify_state(state: Any, recorded: dict | None) -> str | None:
    """Why a restored state is corrupt, or None.

    Args:
      state: the restored state.
      recorded: the checksums its checkpoint recorded at save (None: a checkpoint that recorded none;
        only finiteness is checked).

    Returns:
      A reason naming the arrays: a checksum that differs from the recorded one, or a non-finite parameter
      or moment.
    """
    sums, bad = inspect_state(state)
    wrong = sorted(k for k, v in (recorded or {}).items() if k in sums and sums[k][1] == v[1] and sums[k] != v)
    if wrong:
        return (f"its data differ from the checksums recorded at save in {len(wrong)} array(s) "
                f"({', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}): the files were changed after the save")
    if bad:
        return f"non-finite values in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
    return None
