"""Reading a box of a parameter from the checkpoint's file tensors, and a whole file tensor back.

A *box* is one slice per axis of a parameter (what one device holds, from
``sharding.addressable_devices_indices_map``). :func:`read_box` reads only the file tensors of the
stacked indices in the box, and of each only the range the box needs: a reshaped axis
(``[heads * head_dim]`` as ``[heads, head_dim]``) is read as the rows of the box's heads, then
sliced on the host. :func:`file_tensor` does the inverse, for export.

>>> import numpy as np
>>> from jaxpar.hf._keys import TensorMap
>>> m = TensorMap("w{layer}", (6, 2), ("layer",), view=(3, 2, 2))
>>> class Files:                      # two layers of 6 x 2 values
...     def read(self, key, box): return np.arange(12.0).reshape(6, 2)[box] + 100 * int(key[1:])
>>> read_box(Files(), m, (slice(1, 2), slice(1, 3), slice(0, 1), slice(0, 2)))[0, :, 0, 0].tolist()
[104.0, 108.0]
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from jaxpar.hf._keys import TensorMap


def view_groups(taken: tuple[int, ...], view: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Which consecutive axes of ``view`` each axis of ``taken`` splits into (row-major reshape).

    Args:
      taken: the file tensor's shape (after ``part``).
      view: the shape it is reshaped to.

    Returns:
      One tuple of ``view`` axes per axis of ``taken``.

    >>> view_groups((6, 4), (2, 3, 4))
    [(0, 1), (2,)]
    """
    groups, axis = [], 0
    for size in taken:
        group, product = [axis], view[axis]
        axis += 1
        while product < size:
            group.append(axis)
            product *= view[axis]
            axis += 1
        groups.append(tuple(group))
    return groups


def _read_element(files: Any, key: str, m: TensorMap, inner: tuple[slice, ...]) -> np.ndarray:
    """One file tensor's part for the element box ``inner`` (slices with start and stop)."""
    view = m.view or m.taken
    perm = m.perm or tuple(range(len(inner)))
    wanted: list[slice] = [slice(None)] * len(view)
    for j, s in enumerate(inner):
        wanted[perm[j]] = s
    file_box, shape, rest = [], [], []
    for axis, group in enumerate(view_groups(m.taken, view)):
        first, size = wanted[group[0]], math.prod(view[a] for a in group[1:])
        start, stop = first.start * size, first.stop * size
        if m.part is not None and m.part[0] == axis:
            start, stop = start + m.part[1], stop + m.part[1]
        file_box.append(slice(start, stop))
        shape += [first.stop - first.start] + [view[a] for a in group[1:]]
        rest += [slice(None)] + [wanted[a] for a in group[1:]]
    out = files.read(key, tuple(file_box)).reshape(shape)[tuple(rest)]
    return out.transpose(m.perm) if m.perm else out


def read_box(files: Any, m: TensorMap, box: tuple[slice, ...], dtype: Any = None) -> np.ndarray:
    """The parameter's ``box`` (slices with start and stop, one per axis).

    Args:
      files: a :class:`~jaxpar.hf.CheckpointFiles` (``read(key, box)``).
      m: the parameter's :class:`~jaxpar.hf.TensorMap`.
      box: one slice per axis of the parameter (stacked axes first).
      dtype: the result's dtype (``None``: the files'). Each file tensor's part is cast as it is
        copied into the result, so the host holds the result and one part at a time.

    Returns:
      The box's values, ``[stop - start for each slice]``.
    """
    n = len(m.stack)
    outer, inner = box[:n], box[n:]
    out = None
    for combo in itertools.product(*(range(s.start, s.stop) for s in outer)):
        part = _read_element(files, m.key.format(**dict(zip(m.stack, combo))), m, inner)
        if out is None:
            out = np.empty(tuple(s.stop - s.start for s in outer) + part.shape, dtype or part.dtype)
        out[tuple(c - s.start for c, s in zip(combo, outer))] = part
    return out


def file_tensor(elements: list[tuple[TensorMap, np.ndarray]]) -> np.ndarray:
    """A file tensor from the elements that take parts of it (one, or the gate and up halves of a
    fused ``gate_up_proj``): each transposed back and reshaped to its part, then joined in order.

    Args:
      elements: ``(map, element)`` pairs: the parameter's :class:`~jaxpar.hf.TensorMap` and its
        element for this file tensor.

    Returns:
      The file tensor, of shape ``map.file``.
    """
    parts = []
    for m, element in sorted(elements, key=lambda e: e[0].part[1] if e[0].part else 0):
        if m.perm:
            element = element.transpose(np.argsort(m.perm))
        parts.append(element.reshape(m.taken))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts, axis=elements[0][0].part[0])
