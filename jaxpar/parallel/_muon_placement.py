"""Muon's Newton-Schulz on sharded matrices: where each matrix group's orthogonalisation runs on the mesh
(docs/muon.md). A matrix group is one Muon-routed parameter (:class:`jaxpar.logical.MatrixGroup`): its
stacked axes are a batch of matrices, its momentum sharded by its spec. Placements:

* ``gather``: one all-gather of the matrix dimensions, Newton-Schulz on every device for the matrices of its
  batch shard, each device keeps its slice;
* ``owner``: the batch of matrices spread over the matrix axes (one all-to-all to the owners, padded with zero
  matrices), Newton-Schulz once per matrix, one all-to-all back;
* ``local``: each device orthogonalises its own shard (no collective; an approximation);
* ``auto``: a chooser picks ``gather`` or ``owner`` per group (:func:`by_size` unless one is given; the
  planner's, :func:`jaxpar.cost.placement_chooser`, times both on a cluster).

Newton-Schulz itself is optax's (:func:`newton_schulz`).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxpar.errors import OptimizerError
from jaxpar.logical import PLACEMENTS, MatrixGroup
from jaxpar.rules import axes_of, shard_map_mesh

#: ``chooser(group, sizes, ns_steps) -> "gather" | "owner"``: ``auto``'s choice for a group a mesh axis splits.
Chooser = Callable[[MatrixGroup, Mapping[str, int], int], str]


class MuonPlacement(NamedTuple):
    """Where one matrix group's Newton-Schulz runs.

    Attributes:
      kind: ``"gather"``, ``"owner"`` or ``"local"``.
      group: the matrix group (its shape, sides and, per dimension, the mesh axes that shard its momentum).
      axes: the mesh axes that shard its matrix dimensions (the collectives' group; ``()``: none).
      dims: per dimension, the mesh axes (of ``axes``) that shard it.
      spec: the momentum's ``PartitionSpec`` (the ``shard_map``'s in and out specs).
    """

    kind: str
    group: MatrixGroup
    axes: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    spec: PartitionSpec


def newton_schulz(x: jax.Array, reduction: tuple, output: tuple, ns_steps: int) -> jax.Array:
    """optax's Newton-Schulz (its default coefficients, Frobenius normalisation) over the matrix axes
    ``reduction`` x ``output`` of ``x`` (the other axes: a batch), through optax's public
    ``scale_by_muon``: with ``beta=0`` and no Nesterov its update is exactly the orthogonalised input.

    Args:
      x: the array.
      reduction: its input-side axes.
      output: its output-side axes.
      ns_steps: the iterations.

    Returns:
      The orthogonalised array.
    """
    tx = optax.contrib.scale_by_muon(ns_steps=ns_steps, beta=0.0, nesterov=False,
                                     weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(reduction, output))
    return tx.update(x, tx.init(x))[0]


def by_size(group: MatrixGroup, sizes: Mapping[str, int], ns_steps: int) -> str:
    """``auto``'s default, without hardware rates: ``owner`` when its two all-to-alls move no more than
    ``gather``'s all-gather, ``2 ceil(b / p) <= b`` (``b``: the matrices of one device's batch shard, ``p``: the
    devices over the matrix axes), as it then also orthogonalises each matrix once; else ``gather``.

    Args:
      group: a matrix group some mesh axis splits.
      sizes: mesh axis sizes.
      ns_steps: Newton-Schulz iterations (the rule does not need them).

    Returns:
      ``"owner"`` or ``"gather"``.

    >>> g = MatrixGroup("wq", (8, 1024, 1024), (1,), (2,), ((), ("fsdp",), ()))
    >>> by_size(g, {"fsdp": 8}, 5), by_size(MatrixGroup("w", (64, 64), (0,), (1,), (("fsdp",), ())), {"fsdp": 8}, 5)
    ('owner', 'gather')
    """
    p = math.prod(sizes[a] for a in group.axes(group.reduction + group.output, sizes))
    b = group.matrices // math.prod(sizes[a] for a in group.axes(group.batch, sizes))
    return "owner" if 2 * -(-b // p) <= b else "gather"


def place(name: str, shape: tuple, reduction: tuple, output: tuple, spec: PartitionSpec, sizes: Mapping[str, int],
          placement: str, ns_steps: int, chooser: Chooser | None = None) -> MuonPlacement:
    """One matrix group's placement from its momentum's ``spec`` (manual mesh axes left out).

    Args:
      name: the parameter's path.
      shape: its shape.
      reduction: its input-side dims.
      output: its output-side dims.
      spec: its momentum's ``PartitionSpec``.
      sizes: mesh axis sizes.
      placement: one of :data:`jaxpar.logical.PLACEMENTS` (``local`` wherever no axis splits the matrix).
      ns_steps: Newton-Schulz iterations.
      chooser: ``auto``'s chooser (None: :func:`by_size`).

    Returns:
      The :class:`MuonPlacement`.
    """
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    split = tuple(tuple(a for a in axes_of(e) if sizes.get(a, 1) > 1 and a not in manual) for e in entries)
    group = MatrixGroup(name, tuple(shape), reduction, output, split)
    on = group.axes(reduction + output, sizes)
    kind = "local" if not on else placement if placement != "auto" else (chooser or by_size)(group, sizes, ns_steps)
    if kind not in PLACEMENTS[1:]:
        raise OptimizerError(f"muon(chooser=...): chose {kind!r} for {name!r}; a chooser returns 'gather' or 'owner'.")
    dims = tuple(split[d] if d in reduction + output else () for d in range(len(shape)))
    kept = PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in split))
    return MuonPlacement(kind, group, on, dims, kept)


def _assemble(blocks: jax.Array, dims: tuple, axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """``blocks [P, *local]`` (one block per device of ``axes``, row-major, as ``all_gather`` and
    ``all_to_all`` stack them) -> the array whose dims are whole (``dims[d]``: the axes that cut dim ``d``)."""
    k = len(axes)
    x = blocks.reshape(tuple(sizes[a] for a in axes) + blocks.shape[1:])
    perm, shape = [], []
    for d, own in enumerate(dims):
        perm += [axes.index(a) for a in own] + [k + d]
        shape.append(blocks.shape[1 + d] * math.prod(sizes[a] for a in own))
    return x.transpose(perm).reshape(shape)


def _split(x: jax.Array, dims: tuple, axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """The inverse of :func:`_assemble`: ``x`` -> ``[P, *local]``, one block per device of ``axes``."""
    shape, where, local, local_shape = [], {}, [], []
    for d, own in enumerate(dims):
        for a in own:
            where[a] = len(shape)
            shape.append(sizes[a])
        local.append(len(shape))
        local_shape.append(x.shape[d] // math.prod(sizes[a] for a in own))
        shape.append(local_shape[-1])
    y = x.reshape(shape).transpose([where[a] for a in axes] + local)
    return y.reshape((math.prod(sizes[a] for a in axes),) + tuple(local_shape))


def _gathered(x, place: MuonPlacement, sizes: dict, ns_steps: int) -> jax.Array:
    """``gather``: one all-gather of the matrix dims, Newton-Schulz, this device's slice kept."""
    g = place.group
    full = _assemble(jax.lax.all_gather(x, place.axes, axis=0, tiled=False), place.dims, place.axes, sizes)
    out = newton_schulz(full, g.reduction, g.output, ns_steps)
    return _split(out, place.dims, place.axes, sizes)[jax.lax.axis_index(place.axes)]    # row-major over the axes


def _owned(x, place: MuonPlacement, sizes: dict, ns_steps: int) -> jax.Array:
    """``owner``: the local batch of matrices spread over the matrix axes (padded with zero matrices),
    one all-to-all to the owners, Newton-Schulz once per matrix, one all-to-all back."""
    g = place.group
    matrix = tuple(sorted(g.reduction + g.output))
    order = g.batch + matrix
    xt = x.transpose(order)
    nb, p = math.prod(xt.shape[:len(g.batch)]), math.prod(sizes[a] for a in place.axes)
    c = -(-nb // p)
    flat = xt.reshape((nb,) + xt.shape[len(g.batch):])
    flat = jnp.pad(flat, [(0, c * p - nb)] + [(0, 0)] * len(matrix))
    dims = ((),) + tuple(place.dims[d] for d in matrix)
    received = jax.lax.all_to_all(flat.reshape((p, c) + flat.shape[1:]), place.axes, 0, 0, tiled=False)
    full = _assemble(received, dims, place.axes, sizes)
    new = lambda side: tuple(1 + matrix.index(d) for d in side)          # noqa: E731
    out = newton_schulz(full, new(g.reduction), new(g.output), ns_steps)
    back = jax.lax.all_to_all(_split(out, dims, place.axes, sizes), place.axes, 0, 0, tiled=False)
    back = back.reshape((p * c,) + back.shape[2:])[:nb].reshape(xt.shape)
    return back.transpose(tuple(order.index(d) for d in range(x.ndim)))


def placed_newton_schulz(x: jax.Array, reduction: tuple, output: tuple, place: MuonPlacement | None, mesh,
                         ns_steps: int) -> jax.Array:
    """Newton-Schulz of one matrix group where ``place`` says (None: as XLA partitions it).

    Args:
      x: the group's (bias-corrected) momentum.
      reduction: its input-side dims.
      output: its output-side dims.
      place: its :class:`MuonPlacement`, or None.
      mesh: the mesh (with ``place``).
      ns_steps: Newton-Schulz iterations.

    Returns:
      The orthogonalised momentum, sharded as ``x``.
    """
    if place is None:
        return newton_schulz(x, reduction, output, ns_steps)
    sizes = dict(mesh.shape)
    body = {"gather": _gathered, "owner": _owned,
            "local": lambda v, pl, *_: newton_schulz(v, pl.group.reduction, pl.group.output, ns_steps)}[place.kind]
    return jax.shard_map(lambda v: body(v, place, sizes, ns_steps), mesh=shard_map_mesh(mesh),
                         in_specs=place.spec, out_specs=place.spec, check_vma=False)(x)
