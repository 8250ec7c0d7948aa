"""Which mesh axes an HLO collective communicates over.

A collective names its participants as replica groups (explicit
``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, or the
mesh-axes form ``mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_1'}``)
or, for ``collective-permute``, as ``source_target_pairs``. This module expands
those forms into lists of ids and compares them with the groups every subset
of the mesh axes induces. Ids are mesh positions here (indices into
``mesh.devices.flat``); :mod:`jaxpar.analysis._hlo` maps partition ids to them.

Example:
    >>> groups = parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)")
    >>> groups
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> axes_of_groups(groups, (2, 4), ("data", "tensor"))
    ('data',)
    >>> pairs = source_target_pairs("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}")
    >>> axes_of_pairs(pairs, (2, 4), ("data", "tensor"))
    ('tensor',)
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from jaxpar.errors import AnalysisError


# ----------------------------------------------------------------------------- replica groups


def iota_replica_groups(
    group_shape: Sequence[int], reshape_dims: Sequence[int], perm: Sequence[int] | None = None
) -> list[list[int]]:
    """Expand XLA's iota list ``[G,S]<=[reshape_dims]T(perm)`` into G groups of S ids.

    Args:
      group_shape: ``[G, S]``.
      reshape_dims: the dimensions the iota ``0 .. G*S-1`` is reshaped to.
      perm: the transpose of those dimensions, or ``None`` (none).

    Returns:
      G lists of S partition ids.
    """
    if len(group_shape) != 2:
        raise AnalysisError(f"group_shape must be [num_groups, group_size], got {list(group_shape)}")
    if math.prod(group_shape) != math.prod(reshape_dims):
        raise AnalysisError(f"group_shape {list(group_shape)} and reshape_dims {list(reshape_dims)} differ in size")
    perm = list(range(len(reshape_dims))) if perm is None else list(perm)
    if sorted(perm) != list(range(len(reshape_dims))):
        raise AnalysisError(f"perm {perm} is not a permutation of the {len(reshape_dims)} reshape_dims")
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims).transpose(perm)
    return ids.reshape(group_shape).tolist()


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


_EXPLICIT = re.compile(r"replica_groups=\{((?:\s*\{[\d,\s]*\}\s*,?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{([^}]*)\}"
)


def _mesh_device_ids(text: str | None, size: int) -> np.ndarray:
    if not text:
        return np.arange(size)
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if iota:
        perm = _ints(iota.group(2)) if iota.group(2) else None
        return np.array(iota_replica_groups([1, size], _ints(iota.group(1)), perm)).reshape(-1)
    return np.array(_ints(re.sub(r"^\s*\[[\d,]*\]", "", text)))


def _mesh_axis_refs(text: str, names: list[str]) -> list[tuple[int, int | None, int | None]]:
    refs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", part)
        if not match or match.group(1) not in names:
            raise AnalysisError(f"replica_groups names unknown mesh axis {part!r}")
        pre, size = match.group(2), match.group(3)
        refs.append((names.index(match.group(1)), int(pre) if pre else None, int(size) if size else None))
    return refs


def _mesh_axes_groups(axes_text: str, device_ids: str | None, refs_text: str) -> list[list[int]]:
    """Expand ``mesh[...] , device_ids=(...) {axes}`` (XLA's MeshAxesReplicaGroupList)."""
    pairs = [re.fullmatch(r"\s*'?([^'=]+)'?=(\d+)\s*", p) for p in axes_text.split(",")]
    if not all(pairs):
        raise AnalysisError(f"replica_groups mesh {axes_text!r} is not name=size pairs")
    names, sizes = [p.group(1) for p in pairs], [int(p.group(2)) for p in pairs]
    refs = _mesh_axis_refs(refs_text, names)
    dims: list[int] = []
    grouped: list[int] = [0] * len(refs)
    for axis, size in enumerate(sizes):
        mine = sorted((pre or 1, k, sub or size) for k, (a, pre, sub) in enumerate(refs) if a == axis)
        prefix = 1
        for pre, k, sub in mine:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[k] = len(dims)
            dims.append(sub)
            prefix *= sub
        if prefix != size:
            dims.append(size // prefix)
    devices = _mesh_device_ids(device_ids, math.prod(sizes)).reshape(dims)
    rest = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    return devices.transpose(rest + grouped).reshape(-1, group_size).tolist()


def parse_replica_groups(text: str) -> list[list[int]] | None:
    """Replica groups named in an instruction's attribute text.

    Returns ``[]`` for an empty or absent list (meaning: all devices) and
    ``None`` for a form this parser does not know (e.g. ``maximal_mesh``).

    Args:
      text: the attribute text (an instruction's ``rest``).

    Returns:
      The groups of ids, ``[]`` or ``None`` as above.

    >>> parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)")
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    if "replica_groups=" not in text:
        return []
    if match := _IOTA.search(text):
        perm = _ints(match.group(3)) if match.group(3) else None
        return iota_replica_groups(_ints(match.group(1)), _ints(match.group(2)), perm)
    if match := _MESH.search(text):
        return _mesh_axes_groups(*match.groups())
    if match := _EXPLICIT.search(text):
        return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", match.group(1))]
    return None


def source_target_pairs(text: str) -> list[tuple[int, int]]:
    """``(source, target)`` ids of a collective-permute's attribute text; ``[]`` if absent.

    Args:
      text: the attribute text (an instruction's ``rest``).

    Returns:
      The pairs, in order.
    """
    match = re.search(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\}", text)
    if not match:
        return []
    return [(int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", match.group(1))]


# ----------------------------------------------------------------------------- mesh axes


@functools.lru_cache(maxsize=64)
def _axis_subset_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> list[tuple[tuple[str, ...], frozenset]]:
    """(axes, groups) for every subset of mesh axes, smallest subsets first."""
    positions = np.arange(math.prod(shape)).reshape(shape)
    out = []
    for k in range(len(names) + 1):
        for subset in itertools.combinations(range(len(names)), k):
            rest = [d for d in range(len(names)) if d not in subset]
            size = math.prod(shape[d] for d in subset)
            groups = positions.transpose(rest + list(subset)).reshape(-1, size)
            out.append((tuple(names[d] for d in subset), frozenset(frozenset(g) for g in groups.tolist())))
    return out


def axes_of_groups(groups: list[list[int]], shape, names) -> tuple[str, ...] | None:
    """The mesh axes whose groups these are; for groups that split an axis (XLA
    decomposes some reshardings into pairwise exchanges along part of an axis),
    the smallest set of axes whose groups each of them lies within.

    Args:
      groups: the replica groups, as mesh positions.
      shape: the mesh's shape.
      names: its axis names.

    Returns:
      The axes in mesh order (``()`` for device-local groups), or ``None`` when none fits.
    """
    wanted = frozenset(frozenset(g) for g in groups)
    subsets = _axis_subset_groups(tuple(shape), tuple(names))
    for axes, induced in subsets:
        if induced == wanted:
            return axes
    for axes, induced in subsets:
        if all(any(g <= h for h in induced) for g in wanted):
            return axes
    return None


def axes_of_pairs(pairs: list[tuple[int, int]], shape, names) -> tuple[str, ...] | None:
    """The mesh axes along which some source and target differ (``None`` if an id is off the mesh).

    Args:
      pairs: ``(source, target)`` mesh positions.
      shape: the mesh's shape.
      names: its axis names.

    Returns:
      The axes in mesh order.
    """
    size = math.prod(shape)
    if any(not (0 <= i < size) for pair in pairs for i in pair):
        return None
    differs = np.zeros(len(shape), dtype=bool)
    for src, dst in pairs:
        differs |= np.array(np.unravel_index(src, shape)) != np.array(np.unravel_index(dst, shape))
    return tuple(n for n, d in zip(names, differs) if d)
