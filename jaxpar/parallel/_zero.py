"""ZeRO stages as shardings of parameters, gradients and optimizer state.

The ``fsdp`` mesh axis always shards all three (ZeRO-3 / FSDP). The ``data``
axis shards what the ZeRO ``stage`` says: 1 = optimizer state, 2 = + gradients,
3 = + parameters. Each array is sharded on its largest dimension that is not
already sharded, is not the scanned ``layers`` axis, and divides evenly (a token
table named :data:`~jaxpar.logical.ROW_TABLE` on ``embed`` first, so that :func:`embed_lookup`
moves rows, not the table); arrays with no such dimension (biases, norms) stay replicated over
those axes and are counted exactly by :func:`analytic_state_bytes`.

Example::

    >>> zero_axes({"data": 4, "fsdp": 2}, stage=1, kind="params")
    ('fsdp',)
    >>> zero_axes({"data": 4, "fsdp": 2}, stage=1, kind="opt")     # fsdp major, data minor
    ('fsdp', 'data')
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from jaxpar.parallel._regions import spec_entry
from jaxpar.rules import axes_of
from jaxpar.errors import StrategyError
from jaxpar.logical import zero_dim_order
from jaxpar.options import ZERO_STAGES


_FIRST_STAGE = {"opt": 1, "grads": 2, "params": 3}
_ZERO_AXES = ("fsdp", "data")      # the axes ZeRO shards over


def zero_axes(mesh_sizes: Mapping[str, int], stage: int, kind: str) -> tuple[str, ...]:
    """Mesh axes over which state of ``kind`` ('params' | 'grads' | 'opt') is sharded.

    Args:
      mesh_sizes: mesh axis name -> size.
      stage: the ZeRO stage (0 to 3).
      kind: ``'params'``, ``'grads'`` or ``'opt'``.

    Returns:
      The mesh axis names (``fsdp`` first), empty when not sharded.
    """
    if stage not in ZERO_STAGES:
        raise StrategyError(f"zero stage={stage!r}: choose one of {ZERO_STAGES}.")
    if kind not in _FIRST_STAGE:
        raise StrategyError(f"kind={kind!r}: choose one of {tuple(_FIRST_STAGE)}.")
    wanted = {"fsdp": True, "data": stage >= _FIRST_STAGE[kind]}      # fsdp shards all three
    return tuple(a for a in _ZERO_AXES if wanted[a] and mesh_sizes.get(a, 1) > 1)


def spec_shards(spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> int:
    """How many pieces ``spec`` cuts an array into.

    Args:
      spec: the ``PartitionSpec``.
      mesh_sizes: mesh axis name -> size.

    Returns:
      The product of the sizes of the axes ``spec`` uses.
    """
    return math.prod(mesh_sizes[a] for e in spec for a in axes_of(e))


def add_zero_axes(spec: PartitionSpec, shape: Sequence[int], logical: Sequence[str | None],
                  axes: tuple[str, ...], mesh_sizes: Mapping[str, int],
                  exclude: tuple[str, ...] = ("layers",)) -> PartitionSpec:
    """Shard ``spec`` additionally over ``axes`` on one dimension.

    The dimension is the largest one that is not yet sharded, not in ``exclude``
    and divisible by the product of *all* ZeRO axes of the mesh that ``spec`` does not
    use yet, so parameters, gradients and optimizer state of a leaf are always split on
    the same dimension, each layout refining the previous one (``fsdp`` major, ``data``
    minor). An axis ``spec`` already uses (a model's own ``P("fsdp", ...)``) is not
    added again; the others go on a free dimension, else minor on the dimension the
    model already split over a ZeRO axis, else nowhere (the leaf stays replicated over
    them).

    Args:
      spec: the leaf's ``PartitionSpec``.
      shape: the leaf's shape.
      logical: the leaf's logical names.
      axes: the ZeRO axes to add.
      mesh_sizes: mesh axis name -> size.
      exclude: logical names never sharded.

    Returns:
      The ``PartitionSpec``.

    >>> sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    >>> add_zero_axes(PartitionSpec(None, "fsdp"), (8, 16), (None, None), ("fsdp", "data"), sizes)
    P('data', 'fsdp')
    >>> add_zero_axes(PartitionSpec("tensor", "fsdp"), (8, 16), (None, None), ("fsdp", "data"), sizes)
    P('tensor', ('fsdp', 'data'))
    """
    used = {a for e in spec for a in axes_of(e)}
    axes = tuple(a for a in axes if a not in used)
    if not axes:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    d = zero_dim(shape, logical, spec, mesh_sizes, exclude)
    if d is not None:
        entries[d] = spec_entry(axes)
        return PartitionSpec(*entries)
    n = math.prod(mesh_sizes.get(a, 1) for a in axes)
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        own = axes_of(entries[d])
        if set(own) & set(_ZERO_AXES) and shape[d] % (n * math.prod(mesh_sizes.get(a, 1) for a in own)) == 0:
            entries[d] = own + axes
            return PartitionSpec(*entries)
    return spec


def zero_dim(shape: Sequence[int], logical: Sequence[str | None], spec: PartitionSpec,
             mesh_sizes: Mapping[str, int], exclude: tuple[str, ...] = ("layers",)) -> int | None:
    """The dimension ZeRO shards for this leaf, or ``None`` when none fits.

    Args:
      shape: the leaf's shape.
      logical: the leaf's logical names.
      spec: the leaf's ``PartitionSpec`` before ZeRO.
      mesh_sizes: mesh axis name -> size.
      exclude: logical names never sharded.

    Returns:
      The dimension index, or ``None``.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in axes_of(e)}
    n = math.prod(mesh_sizes.get(a, 1) for a in _ZERO_AXES if a not in used)
    logical = tuple(logical) + (None,) * (len(shape) - len(tuple(logical)))
    for d in zero_dim_order(shape, logical):
        free = all(mesh_sizes.get(a, 1) == 1 for a in axes_of(entries[d]))   # size-1 axes split nothing
        if logical[d] not in exclude and free and shape[d] % n == 0:
            return d
    return None


def zero_specs(base_specs: Any, shapes: Any, logical: Any, mesh_sizes: Mapping[str, int], stage: int,
               kind: str) -> Any:
    """Apply :func:`add_zero_axes` to every leaf of a parameter-shaped tree.

    Args:
      base_specs: a tree of ``PartitionSpec``s before ZeRO.
      shapes: the mirroring tree of shapes (arrays or ``ShapeDtypeStruct``s).
      logical: the mirroring tree of logical names.
      mesh_sizes: mesh axis name -> size.
      stage: the ZeRO stage.
      kind: ``'params'``, ``'grads'`` or ``'opt'``.

    Returns:
      The mirroring tree of ``PartitionSpec``s.
    """
    axes = zero_axes(mesh_sizes, stage, kind)
    return jax.tree.map(lambda s, a, lg: add_zero_axes(s, a.shape, tuple(lg), axes, mesh_sizes),
                        base_specs, shapes, logical, is_leaf=lambda x: isinstance(x, PartitionSpec))


def analytic_state_bytes(shapes: Any, param_specs: Any, opt_specs: Any, mesh_sizes: Mapping[str, int], *,
                         param_bytes: int = 4, opt_bytes: int = 8) -> dict[str, float]:
    """Per-device bytes of parameters and optimizer state (Adam: ``opt_bytes=8``).

    The ZeRO formulas (DP ``12Ψ``, ZeRO-1/2 ``4Ψ + 8Ψ/N``, ZeRO-3 ``12Ψ/N``)
    applied leaf by leaf: a leaf that cannot be split keeps its full size.
    Returns ``{'params', 'opt', 'total', 'psi', 'psi_unsharded'}``.

    Args:
      shapes: a tree of arrays or ``ShapeDtypeStruct``s (the parameters).
      param_specs: the mirroring tree of parameter ``PartitionSpec``s.
      opt_specs: the mirroring tree of optimizer-state ``PartitionSpec``s.
      mesh_sizes: mesh axis name -> size.
      param_bytes: bytes per parameter element.
      opt_bytes: bytes of optimizer state per parameter element.

    Returns:
      ``{'params', 'opt', 'total', 'psi', 'psi_unsharded'}``: bytes per device, and the parameter counts.
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    out = {"params": 0.0, "opt": 0.0, "psi": 0, "psi_unsharded": 0}
    for a, ps, os_ in zip(jax.tree.leaves(shapes), jax.tree.leaves(param_specs, is_leaf=is_spec),
                          jax.tree.leaves(opt_specs, is_leaf=is_spec)):
        size = math.prod(a.shape)
        out["psi"] += size
        out["params"] += param_bytes * size / spec_shards(ps, mesh_sizes)
        out["opt"] += opt_bytes * size / spec_shards(os_, mesh_sizes)
        if spec_shards(os_, mesh_sizes) == 1:
            out["psi_unsharded"] += size
    out["total"] = out["params"] + out["opt"]
    return out

