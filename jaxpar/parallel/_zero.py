"""ZeRO stages as shardings of parameters, gradients and optimizer state.

The ``fsdp`` mesh axis always shards all three (ZeRO-3 / FSDP). The ``data``
axis shards what the ZeRO ``stage`` says: 1 = optimizer state, 2 = + gradients,
3 = + parameters. Each array is sharded on its largest dimension that is not
already sharded (a dimension split only over axes of size 1 counts as free), is not the scanned
``layers`` axis, and is divisible by the ZeRO axes that shard any of the leaf's state at the stage
(``fsdp x data`` from stage 1, ``fsdp`` alone at stage 0; a token table named
:data:`~jaxpar.logical.ROW_TABLE` on ``embed`` first, so that :func:`embed_lookup` moves rows, not
the table); arrays with no such dimension (biases, norms) stay replicated over those axes and are
counted exactly by :func:`analytic_state_bytes`. :func:`warn_replicated` names those of at least
:data:`REPLICATED_WARN_BYTES` per device.

Example::

    >>> zero_axes({"data": 4, "fsdp": 2}, stage=1, kind="params")
    ('fsdp',)
    >>> zero_axes({"data": 4, "fsdp": 2}, stage=1, kind="opt")     # fsdp major, data minor
    ('fsdp', 'data')
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from jaxpar._text import format_bytes
from jaxpar.parallel._regions import spec_entry
from jaxpar.rules import axes_of, path_str
from jaxpar.errors import ReplicatedLeafWarning, StrategyError
from jaxpar.logical import zero_dim_order
from jaxpar.options import ZERO_STAGES


_FIRST_STAGE = {"opt": 1, "grads": 2, "params": 3}
_STATE_NAMES = {"params": "parameters", "grads": "gradients", "opt": "optimizer state"}
_ZERO_AXES = ("fsdp", "data")      # the axes ZeRO shards over
#: A leaf that ZeRO / FSDP leave replicated warns (:func:`warn_replicated`) from this many bytes per device:
#: a weight matrix of a small model (128 x 128 fp32) but no norm or bias of a toy one.
REPLICATED_WARN_BYTES = 64 * 1024
_LISTED = 10                       # leaves a warning lists by name; the rest are counted


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
                  exclude: tuple[str, ...] = ("layers",), *, stage: int = 3) -> PartitionSpec:
    """Shard ``spec`` additionally over ``axes`` on one dimension.

    The dimension is the largest one that is not yet sharded (axes of size 1 split nothing),
    not in ``exclude`` and divisible by the product of the ZeRO axes that shard any state
    of the leaf at ``stage`` (:func:`zero_dim`) and that ``spec`` does not use yet, so
    parameters, gradients and optimizer state of a leaf are always split on the same
    dimension, each layout refining the previous one (``fsdp`` major, ``data`` minor).
    An axis ``spec`` already uses (a model's own ``P("fsdp", ...)``) is not added again;
    the others go on a free dimension, else minor on the dimension the model already
    split over a ZeRO axis, else nowhere (the leaf stays replicated over them).

    Args:
      spec: the leaf's ``PartitionSpec``.
      shape: the leaf's shape.
      logical: the leaf's logical names.
      axes: the ZeRO axes to add.
      mesh_sizes: mesh axis name -> size.
      exclude: logical names never sharded.
      stage: the ZeRO stage (at stage 0 the dimension need not divide ``data``).

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
    d = zero_dim(shape, logical, spec, mesh_sizes, exclude, stage=stage)
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
             mesh_sizes: Mapping[str, int], exclude: tuple[str, ...] = ("layers",), *,
             stage: int = 3) -> int | None:
    """The dimension ZeRO shards for this leaf, or ``None`` when none fits.

    The first of :func:`~jaxpar.logical.zero_dim_order` that is not in ``exclude``, is split
    by ``spec`` over no axis of size > 1 and is divisible by :func:`zero_divisor`.

    Args:
      shape: the leaf's shape.
      logical: the leaf's logical names.
      spec: the leaf's ``PartitionSpec`` before ZeRO.
      mesh_sizes: mesh axis name -> size.
      exclude: logical names never sharded.
      stage: the ZeRO stage (3, the default, asks for every ZeRO axis of the mesh).

    Returns:
      The dimension index, or ``None``.

    >>> sizes = {"data": 2, "fsdp": 4, "tensor": 1}
    >>> w1 = ((2, 129, 516), ("layers", "embed", "mlp"), PartitionSpec(None, None, "tensor"))
    >>> zero_dim(*w1, sizes, stage=0), zero_dim(*w1, sizes, stage=1)     # 516 = 4 x 129: not a multiple of 8
    (2, None)
    """
    n = zero_divisor(spec, mesh_sizes, stage)
    for d in _free_dims(shape, logical, spec, mesh_sizes, exclude):
        if shape[d] % n == 0:
            return d
    return None


def zero_divisor(spec: PartitionSpec, mesh_sizes: Mapping[str, int], stage: int = 3) -> int:
    """What the ZeRO dimension of a leaf with ``spec`` must be divisible by.

    Args:
      spec: the leaf's ``PartitionSpec`` before ZeRO.
      mesh_sizes: mesh axis name -> size.
      stage: the ZeRO stage.

    Returns:
      The product of the ZeRO axes that shard the leaf's optimizer state at ``stage`` (the most
      any of its states uses: :func:`zero_axes`) and that ``spec`` does not name already.
    """
    used = {a for e in spec for a in axes_of(e)}
    return math.prod(mesh_sizes[a] for a in zero_axes(mesh_sizes, stage, "opt") if a not in used)


def _free_dims(shape: Sequence[int], logical: Sequence[str | None], spec: PartitionSpec,
               mesh_sizes: Mapping[str, int], exclude: tuple[str, ...]) -> list[int]:
    """The dimensions ZeRO may split, in :func:`~jaxpar.logical.zero_dim_order`: not in ``exclude``,
    and split by ``spec`` over no axis of size > 1 (a size-1 axis splits nothing)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    logical = tuple(logical) + (None,) * (len(shape) - len(tuple(logical)))
    return [d for d in zero_dim_order(shape, logical)
            if logical[d] not in exclude and all(mesh_sizes.get(a, 1) == 1 for a in axes_of(entries[d]))]


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
    return jax.tree.map(lambda s, a, lg: add_zero_axes(s, a.shape, tuple(lg), axes, mesh_sizes, stage=stage),
                        base_specs, shapes, logical, is_leaf=lambda x: isinstance(x, PartitionSpec))


def warn_replicated(shapes: Any, opt_specs: Any, logical: Any, mesh_sizes: Mapping[str, int],
                    stage: int) -> list[str]:
    """Warn (:class:`~jaxpar.errors.ReplicatedLeafWarning`) about the large leaves ZeRO / FSDP leave replicated.

    A leaf warns when ZeRO shards some of the state at ``stage`` (:func:`zero_axes`), its optimizer
    state names none of those axes (no dimension fits: :func:`zero_dim`), and its copy on one device
    is at least :data:`REPLICATED_WARN_BYTES`. One warning names such leaves (the first ten, then
    their count), each with its shape, dtype and bytes per device.

    Args:
      shapes: the parameters' tree of arrays or ``ShapeDtypeStruct``s.
      opt_specs: the mirroring tree of optimizer-state ``PartitionSpec``s (:func:`zero_specs`).
      logical: the mirroring tree of logical names.
      mesh_sizes: mesh axis name -> size.
      stage: the ZeRO stage.

    Returns:
      The names of the leaves it warned about (empty: no warning).

    >>> sizes = {"data": 2, "fsdp": 4}
    >>> shapes = {"w": jax.ShapeDtypeStruct((129, 515), "float32"), "b": jax.ShapeDtypeStruct((515,), "float32")}
    >>> specs = {"w": PartitionSpec(), "b": PartitionSpec()}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_replicated(shapes, specs, {"w": (None, None), "b": (None,)}, sizes, stage=3)
    ['w']
    """
    axes = zero_axes(mesh_sizes, stage, "opt")
    if not axes:
        return []
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    specs, names = treedef.flatten_up_to(opt_specs), treedef.flatten_up_to(logical)
    lines, warned = [], []
    for (path, a), spec, lg in zip(flat, specs, names):
        per_device = a.size * a.dtype.itemsize / spec_shards(spec, mesh_sizes)
        if per_device >= REPLICATED_WARN_BYTES and not {x for e in spec for x in axes_of(e)} & set(axes):
            warned.append(path_str(path))
            lines.append(_replicated_line(warned[-1], a, tuple(lg or ()), spec, mesh_sizes, stage, per_device))
    if lines:
        warnings.warn(_replicated_message(lines, mesh_sizes, stage), ReplicatedLeafWarning, stacklevel=2)
    return warned


def _replicated_line(name: str, a: Any, logical: tuple, spec: PartitionSpec, mesh_sizes: Mapping[str, int],
                     stage: int, per_device: float) -> str:
    """One leaf of :func:`warn_replicated`'s message: its shape, dtype, bytes and why no dimension fits."""
    n = zero_divisor(spec, mesh_sizes, stage)
    dims = [a.shape[d] for d in _free_dims(a.shape, logical, spec, mesh_sizes, ("layers",))]
    why = (f"no dimension that is not 'layers' or split already ({', '.join(map(str, dims))}) is a multiple of {n} "
           f"(e.g. {dims[0]} -> {-(-dims[0] // n) * n})" if dims else "every dimension is 'layers' or split already")
    shape = "x".join(map(str, a.shape)) or "()"
    return f"  {name}: {shape} {a.dtype}, {format_bytes(per_device)} per device; {why}"


def _replicated_message(lines: list[str], mesh_sizes: Mapping[str, int], stage: int) -> str:
    """:func:`warn_replicated`'s message: the axes, what stays whole on every device, the leaves and the fix."""
    axes = zero_axes(mesh_sizes, stage, "opt")
    kinds = [v for k, v in _STATE_NAMES.items() if zero_axes(mesh_sizes, stage, k)]
    what = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
    group = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
    more = [f"  ... and {len(lines) - _LISTED} more"] if len(lines) > _LISTED else []
    return (f"ZeRO / FSDP (zero={stage}) leave {len(lines)} parameter(s) replicated over {group}: each device of "
            f"that group holds their whole {what}.\n" + "\n".join(lines[:_LISTED] + more) + "\n"
            f"Fix: make one dimension of each a multiple of the size given (e.g. model.embed / model.mlp), or choose "
            f"mesh sizes whose {' x '.join(axes)} divides one. (Warned from {format_bytes(REPLICATED_WARN_BYTES)} per "
            f"device and leaf: jaxpar.parallel._zero.REPLICATED_WARN_BYTES.)")


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

