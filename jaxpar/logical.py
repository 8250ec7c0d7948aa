"""What logical names mean, without JAX: which axes are features and which are stacks, which parameters are
matrices, a matrix group on the mesh, and the mesh axes in their order (:data:`AXES`, which :mod:`jaxpar.mesh`
builds meshes of). Muon's routing and placement (:mod:`jaxpar.optimizers`, :mod:`jaxpar.parallel._muon_placement`)
and the cost model (:mod:`jaxpar.cost`) read these facts here.

Example::

    >>> matrix_sides(("layers", "embed", "heads", "kv"))
    ((1,), (2, 3), (0,), 'matrix')
    >>> g = MatrixGroup("blocks/w1", (8, 128, 512), (1,), (2,), ((), ("fsdp",), ()))
    >>> g.rows, g.cols, g.matrices, g.axes(g.reduction + g.output, {"fsdp": 8})
    (128, 512, 8, ('fsdp',))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from jaxpar.errors import OptimizerError

#: The axes every mesh has. ``pipe`` is outermost (least traffic), ``tensor`` innermost (most traffic).
STANDARD_AXES = ("pipe", "data", "fsdp", "tensor")
REPLICA = "replica"   # the outermost axis of relaxed synchronisation (jaxpar.parallel.sync), present only when > 1
CONTEXT = "context"   # the sequence axis of context parallelism (jaxpar.parallel.context), beside tensor, only when > 1
EXPERT = "expert"     # the axis of expert parallelism (jaxpar.parallel.moe), inside the data axes, only when > 1
#: Every axis :class:`jaxpar.MeshSpec` names, in mesh order (``replica``, ``expert`` and ``context`` only when > 1).
AXES = (REPLICA, "pipe", "data", "fsdp", EXPERT, CONTEXT, "tensor")

#: Logical names of feature axes: a parameter whose feature axes form two groups is a matrix.
FEATURES = ("embed", "heads", "kv_heads", "kv", "mlp")
#: Feature axes that flatten into one matrix side when adjacent (``wq``: ``embed x heads*kv``).
HEAD_GROUP = ("heads", "kv_heads", "kv")
#: Logical names of stacked axes (``None``: an unnamed sub-layer axis): batch dimensions of Newton-Schulz.
STACKS = ("layers", "experts", "stage", "stages", None)
#: Where Newton-Schulz runs on a sharded matrix group (docs/muon.md); ``auto``: a chooser picks gather or owner.
PLACEMENTS = ("auto", "gather", "owner", "local")
#: A weight with ``embed`` and one of these runs its matmuls in FP8 (``Strategy(fp8=...)``).
FP8_FEATURES = ("heads", "kv_heads", "mlp")
#: The logical names of a token table as the lookup and a tied head compute with it.
TOKEN_TABLE = ("vocab", "embed")
#: The logical names of a token table that :func:`jaxpar.parallel.embed_lookup` reads: ZeRO-3 / FSDP stores
#: it split on ``table_embed`` (its ``embed``), so that the lookup moves rows. A table with
#: :data:`TOKEN_TABLE`'s names is stored split on its largest dimension, which a plain ``jnp.take`` needs.
ROW_TABLE = ("vocab", "table_embed")


def zero_dim_order(shape: Sequence[int], logical: Sequence) -> tuple[int, ...]:
    """The dimensions ZeRO / FSDP tries to split, in order: the largest first, but a :data:`ROW_TABLE`'s
    ``embed`` first, so that its lookup moves rows rather than the table.

    >>> zero_dim_order((512, 64), ("vocab", "table_embed")), zero_dim_order((512, 64), ("vocab", "embed"))
    ((1, 0), (0, 1))
    """
    if tuple(logical) == ROW_TABLE:
        return (1, 0)
    return tuple(sorted(range(len(shape)), key=lambda d: -shape[d]))


def fp8_covered(names: Sequence) -> bool:
    """Whether a weight with these logical names runs its matmuls in FP8: ``embed`` and a feature axis
    (:data:`FP8_FEATURES`: the attention projections and the MLP; not the embedding, the head, the
    router, norms or biases, nor the routed experts (``experts``), whose tile loops are no ``dot_general``
    of the layer's program).

    >>> fp8_covered(("embed", "mlp")), fp8_covered(("vocab", "embed")), fp8_covered(("experts", "embed", "mlp"))
    (True, False, False)
    """
    return "embed" in names and any(n in names for n in FP8_FEATURES) and "experts" not in names


def feature_groups(names: Sequence) -> list[tuple[int, ...]]:
    """Runs of feature axes: ``embed`` and ``mlp`` alone, adjacent ``heads`` / ``kv_heads`` / ``kv`` together.

    Args:
      names: one logical name (or None) per dimension.

    Returns:
      The groups, as tuples of dimension indices.

    >>> feature_groups(("layers", "embed", "heads", "kv"))
    [(1,), (2, 3)]
    """
    groups: list[list[int]] = []
    for i, name in enumerate(names):
        if name not in FEATURES:
            continue
        joined = groups and name in HEAD_GROUP and names[i - 1] in HEAD_GROUP and groups[-1][-1] == i - 1
        groups[-1].append(i) if joined else groups.append([i])
    return [tuple(g) for g in groups]


def matrix_sides(names: Sequence) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], str]:
    """A parameter's matrix from its logical names: its input side, output side and stacked (batch) dims.

    Args:
      names: one logical name (or None) per dimension.

    Returns:
      ``(reduction, output, batch, why)``; ``reduction`` and ``output`` are ``()`` when it is no matrix
      (``why`` says why).

    >>> matrix_sides(("layers", "embed", "mlp"))
    ((1,), (2,), (0,), 'matrix')
    >>> matrix_sides(("vocab", "embed"))[3]
    "axis 'vocab' is not a feature (embedding / head / other)"
    """
    other = [n for n in names if n not in FEATURES and n not in STACKS]
    groups = feature_groups(names)
    batch = tuple(i for i, n in enumerate(names) if n in STACKS)
    if other:
        return (), (), batch, f"axis {other[0]!r} is not a feature (embedding / head / other)"
    if len(groups) != 2:
        return (), (), batch, f"{len(groups)} feature axis group(s), not a matrix"
    return groups[0], groups[1], batch, "matrix"


@dataclass(frozen=True)
class MatrixGroup:
    """One Muon-routed parameter: ``shape``, the dims of its input (``reduction``) and output sides (the
    others are stacked: a batch of matrices), and ``spec``, its momentum's mesh axes per dimension."""

    name: str
    shape: tuple[int, ...]
    reduction: tuple[int, ...]
    output: tuple[int, ...]
    spec: tuple[tuple[str, ...], ...]
    itemsize: int = 4

    def __post_init__(self):
        if len(self.spec) != len(self.shape):
            raise OptimizerError(f"MatrixGroup {self.name!r}: spec {self.spec} has {len(self.spec)} entries for "
                                 f"shape {self.shape}; give one tuple of mesh axes per dimension.")

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduction + self.output)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[d] for d in self.reduction)

    @property
    def cols(self) -> int:
        return math.prod(self.shape[d] for d in self.output)

    @property
    def matrices(self) -> int:
        return math.prod(self.shape[d] for d in self.batch)

    def axes(self, dims: Sequence[int], sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that shard ``dims``, in the order of the dims and their spec entries.

        Args:
          dims: dimension indices.
          sizes: mesh axis sizes.

        Returns:
          The axes.
        """
        return tuple(a for d in dims for a in self.spec[d] if sizes.get(a, 1) > 1)
