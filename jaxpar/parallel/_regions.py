"""The manual regions jaxpar's layers open: which mesh axes a ``jax.shard_map`` makes manual, and
the dtype its reductions run in.

Sequence parallelism (:func:`jaxpar.parallel.row_parallel`), expert parallelism and context-parallel
attention open ``shard_map`` s manual over some axes. XLA:CPU (jax 0.10) aborts on a bf16 reduction in
a partly manual region (docs/strategies.md, "bf16"), so :func:`region_axes` makes the region manual
over the whole mesh where the other axes have size 1 (:func:`region_spec` names them in the specs),
and :func:`reduce_dtype` runs the reductions in float32 on CPU where an automatic axis of size > 1
remains (:func:`collective_in`, :func:`enter`).

Example:
    >>> import jax, jaxpar, jax.numpy as jnp
    >>> mesh = jaxpar.make_mesh({"data": 2, "tensor": 4}, devices=jax.devices()[:8])
    >>> sorted(region_axes(mesh, {"tensor"})), sorted(region_axes(mesh, {"data", "tensor"}))
    (['tensor'], ['data', 'fsdp', 'pipe', 'tensor'])
    >>> reduce_dtype(jnp.bfloat16, mesh, {"tensor"}), reduce_dtype(jnp.bfloat16, mesh, {"data", "tensor"})
    (dtype('float32'), dtype(bfloat16))
"""
from __future__ import annotations

from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.rules import axes_of, manual_axes


def spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """The ``PartitionSpec`` entry over ``axes``: ``None`` for none, the name for one, else the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def keep_axes(spec: PartitionSpec, axes: Iterable[str]) -> PartitionSpec:
    """``spec`` keeping only the mesh ``axes`` in each entry."""
    return PartitionSpec(*(spec_entry(tuple(a for a in axes_of(e) if a in axes)) for e in spec))


def region_axes(mesh, axes: Iterable[str]) -> set[str]:
    """The axes a region asked to be manual over ``axes`` makes manual.

    Args:
      mesh: the mesh of the rules (:func:`jaxpar.rules.current_rules`).
      axes: the axes the region needs manual.

    Returns:
      ``axes`` less the axes an enclosing ``shard_map`` made manual already; or, where every other
      axis (not manual already) has size 1, all the axes not manual already (see the module).
    """
    outer, sizes = manual_axes(), dict(mesh.shape)
    wanted = set(axes) - outer
    rest = {a for a in sizes if a not in outer and a not in wanted}
    return wanted | rest if all(sizes[a] == 1 for a in rest) else wanted


def region_spec(spec: PartitionSpec, ndim: int, mesh, manual: Iterable[str]) -> PartitionSpec:
    """An input's ``in_specs`` entry that also names the region's manual axes of size 1 it leaves out.

    An input unsplit over a manual axis has its cotangent summed over that axis (``check_vma=False``):
    over an axis of size 1 that is an all-reduce of one device, still a rendezvous on XLA:CPU. Naming
    those axes (on the first dimension; a size-1 axis divides any dimension) leaves none.

    Args:
      spec: the input's ``PartitionSpec``.
      ndim: its number of dimensions (a scalar keeps ``spec``).
      mesh: the mesh of the rules.
      manual: the region's manual axes (:func:`region_axes`).

    Returns:
      The ``PartitionSpec``.

    >>> import jax
    >>> mesh = jax.sharding.AbstractMesh((1, 2), ("pipe", "data"))
    >>> region_spec(PartitionSpec("data", None), 2, mesh, {"pipe", "data"})
    P(('data', 'pipe'), None)
    """
    sizes, named = dict(mesh.shape), {a for e in spec for a in axes_of(e)}
    extra = tuple(sorted(a for a in manual if sizes.get(a, 1) == 1 and a not in named))
    if not extra or ndim == 0:
        return spec
    entries = list(spec) + [None] * (ndim - len(spec))
    return PartitionSpec(spec_entry(axes_of(entries[0]) + extra), *entries[1:])


def automatic_axes(mesh, manual: Iterable[str]) -> tuple[str, ...]:
    """The axes of size > 1 that stay automatic inside a region manual over ``manual``.

    Args:
      mesh: the mesh of the rules.
      manual: the axes the region makes manual (:func:`region_axes`).

    Returns:
      The axes, in the mesh's order; the axes an enclosing ``shard_map`` made manual are not among them.
    """
    taken = set(manual) | manual_axes()
    return tuple(a for a, n in dict(mesh.shape).items() if n > 1 and a not in taken)


def mesh_platform(mesh) -> str:
    """The platform of ``mesh``'s devices (``cpu``, ``gpu``, ``tpu``; the default backend's without devices)."""
    devices = getattr(mesh, "devices", None)
    if isinstance(devices, np.ndarray) and devices.size:
        return devices.flat[0].platform
    return jax.default_backend()


def reduce_dtype(dtype, mesh, manual: Iterable[str]) -> np.dtype:
    """The dtype a region's reductions of ``dtype`` values run in.

    Args:
      dtype: the values' dtype.
      mesh: the mesh of the rules (its devices say the platform).
      manual: the axes the region makes manual (:func:`region_axes`).

    Returns:
      ``float32`` for bf16 in a region that leaves an axis of size > 1 automatic on CPU devices
      (XLA:CPU aborts on those, see the module), else ``dtype`` itself.
    """
    dtype = np.dtype(dtype)
    if dtype == jnp.bfloat16 and automatic_axes(mesh, manual) and mesh_platform(mesh) == "cpu":
        return np.dtype(jnp.float32)
    return dtype


def collective_in(dtype, fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``fn(x)`` run in ``dtype``: ``x`` cast to it before, the result cast back to ``x.dtype`` after.

    Args:
      dtype: the dtype of the collective (:func:`reduce_dtype`).
      fn: the collective (``psum_scatter``, ``all_gather``: its transpose reduces in ``dtype`` too).
      x: the operand.

    Returns:
      ``fn(x)`` in ``x.dtype``.
    """
    if np.dtype(dtype) == x.dtype:
        return fn(x)
    return fn(x.astype(dtype)).astype(x.dtype)


def enter(x: jax.Array, spec: PartitionSpec, mesh, manual: Iterable[str], dtype) -> jax.Array:
    """``x`` as a region takes it: in ``dtype`` where ``spec`` leaves one of the region's manual
    axes of size > 1 unsplit (autodiff sums its cotangent over that axis inside the region), else as it is.
    The region casts it back to the values' dtype inside.

    Args:
      x: the input.
      spec: its ``PartitionSpec`` in the region's ``in_specs``.
      mesh: the mesh of the rules.
      manual: the region's manual axes.
      dtype: the dtype of the region's reductions (:func:`reduce_dtype`).

    Returns:
      ``x``, cast where needed.
    """
    sizes, named = dict(mesh.shape), {a for e in spec for a in axes_of(e)}
    unsplit = [a for a in manual if sizes.get(a, 1) > 1 and a not in named]
    return x.astype(dtype) if unsplit and jnp.issubdtype(x.dtype, jnp.floating) else x
