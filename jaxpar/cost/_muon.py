"""Muon's Newton-Schulz on sharded matrices: which parameters are matrices (by logical names), the FLOPs of
``ns_steps`` iterations, and the collectives of each placement, timed on a cluster to choose one per
matrix group (docs/muon.md).

A *matrix group* is one parameter routed to Muon: its stacked axes (``layers``, ``experts``) are a batch of
matrices, its momentum is sharded by ``spec`` (mesh axes per dimension). Placements:

* ``gather``: the matrix dimensions all-gathered over the axes that shard them (one all-gather), Newton-Schulz
  on every device for the matrices of its batch shard, each device keeps its slice (no communication back);
* ``owner``: the batch of matrices spread over those axes, one owner per matrix (one all-to-all: each device
  gathers the matrices it owns), Newton-Schulz once per matrix, one all-to-all back (the scatter); a batch
  that the axes do not divide is padded with zero matrices;
* ``local``: each device orthogonalises its own shard (blockwise): no collective, an approximation.

Example::

    >>> g = MatrixGroup("blocks/w1", (2, 128, 512), (1,), (2,), ((), ("fsdp",), ()))
    >>> ns_flops(128, 512, 5) == 5 * (4 * 128**2 * 512 + 2 * 128**3)
    True
    >>> [(c.kind, c.bytes, c.count) for c in placement_cost(g, {"fsdp": 8}, "owner", 5).comms]
    [('all-to-all', 262144, 2)]
    >>> [(c.kind, c.bytes, c.count) for c in placement_cost(g, {"fsdp": 8}, "gather", 5).comms]
    [('all-gather', 524288, 1)]
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from jaxpar.cost._cluster import Cluster, load_cluster
from jaxpar.cost._memory import leaf_spec, zero_axes, zero_dim_of
from jaxpar.cost._model import Leaf, ModelSpec
from jaxpar.cost._parallel import AXES, Plan
from jaxpar.cost._roofline import Kernel, kernel_seconds, matmul
from jaxpar.cost._time import StepTime, comm_time, step_flops
from jaxpar.cost._traffic import Comm
from jaxpar.errors import CostModelError
from jaxpar.logical import PLACEMENTS, MatrixGroup, matrix_sides

#: The cluster preset the planner's ``auto`` times placements on, by the devices' platform.
PLATFORM_CLUSTERS = {"cpu": "cpu_sim", "gpu": "h100", "cuda": "h100", "rocm": "h100", "tpu": "tpu_v5p"}


class PlacementCost(NamedTuple):
    """One placement of a matrix group on one device: Newton-Schulz ``flops``, the ``comms`` (bytes: the
    result on one device, as the compiled program's inventory counts them), and ``seconds`` on a cluster
    (compute + collectives; 0 without a cluster)."""

    placement: str
    flops: float
    comms: tuple[Comm, ...]
    seconds: float

    @property
    def bytes(self) -> float:
        return sum(c.bytes * c.count for c in self.comms)


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of optax's Newton-Schulz on one ``rows x cols`` matrix: per iteration, with ``s = min`` and
    ``l = max`` side, ``A = X Xᵀ`` (``2 s² l``), ``A A`` (``2 s³``) and ``(b A + c A²) X`` (``2 s² l``).

    Args:
      rows, cols: the matrix's sides.
      steps: the iterations.

    Returns:
      FLOPs (the elementwise terms left out).

    >>> ns_flops(4, 8, 1)
    640
    """
    s, l = min(rows, cols), max(rows, cols)
    return steps * (4 * s * s * l + 2 * s ** 3)


def _kernels(rows: int, cols: int, matrices: float, steps: int, itemsize: int) -> list[Kernel]:
    s, l = min(rows, cols), max(rows, cols)
    return [matmul("ns-gram", matrices, s, l, s, itemsize, count=steps),
            matmul("ns-square", matrices, s, s, s, itemsize, count=steps),
            matmul("ns-apply", matrices, s, s, l, itemsize, count=steps)]


def _plan(group: MatrixGroup, sizes: Mapping[str, int], placement: str) -> tuple[float, int, int, tuple]:
    """``(matrices per device, rows, cols, comms)`` of one placement."""
    p_of = lambda axes: math.prod(sizes[a] for a in axes)            # noqa: E731
    on = group.axes(group.reduction + group.output, sizes)
    local = group.matrices // p_of(group.axes(group.batch, sizes))
    p, full = p_of(on), group.rows * group.cols * group.itemsize
    if placement == "local" or not on:
        rows = group.rows // p_of(group.axes(group.reduction, sizes))
        return local, rows, group.cols // p_of(group.axes(group.output, sizes)), ()
    if placement == "gather":
        return local, group.rows, group.cols, (Comm("all-gather", on, local * full, 1, "optimizer"),)
    owned = math.ceil(local / p)
    return owned, group.rows, group.cols, (Comm("all-to-all", on, owned * full, 2, "optimizer"),)


def placement_cost(group: MatrixGroup, sizes: Mapping[str, int], placement: str, ns_steps: int,
                   cluster: Cluster | None = None, dtype: str = "float32") -> PlacementCost:
    """The Newton-Schulz FLOPs and collectives of ``placement`` for one matrix group, on one device.

    Args:
      group: the matrix group.
      sizes: mesh axis sizes.
      placement: ``gather``, ``owner`` or ``local``.
      ns_steps: Newton-Schulz iterations.
      cluster: times it (None: ``seconds`` 0).
      dtype: the peak the matmuls run at (the momentum's dtype).

    Returns:
      The :class:`PlacementCost`.
    """
    if placement not in PLACEMENTS[1:]:
        raise CostModelError(f"placement={placement!r}: choose one of {', '.join(PLACEMENTS[1:])}.")
    n, rows, cols, comms = _plan(group, sizes, placement)
    flops = n * ns_flops(rows, cols, ns_steps)
    if cluster is None:
        return PlacementCost(placement, flops, comms, 0.0)
    dtype = dtype if dtype in cluster.compute_dtypes else cluster.compute_dtypes[0]
    known = {a: v for a, v in sizes.items() if a in AXES}
    compute = sum(kernel_seconds(k, cluster, dtype) for k in _kernels(rows, cols, n, ns_steps, group.itemsize))
    comm = sum(c.count * comm_time(Comm(c.kind, tuple(a for a in c.axes if a in AXES), c.bytes, c.count, c.phase),
                                   known, cluster) for c in comms)
    return PlacementCost(placement, flops, comms, compute + comm)


def choose_placement(group: MatrixGroup, sizes: Mapping[str, int], ns_steps: int, cluster: Cluster | str,
                     placement: str = "auto") -> str:
    """The placement of one matrix group: ``placement`` itself, or for ``auto`` the faster exact one
    (``gather`` or ``owner``) on ``cluster``; ``local`` when no mesh axis shards the matrix dims (every
    placement is then the same Newton-Schulz, without a collective).

    Args:
      group: the matrix group.
      sizes: mesh axis sizes.
      ns_steps: Newton-Schulz iterations.
      cluster: a :class:`~jaxpar.cost.Cluster` or a preset name.
      placement: one of :data:`PLACEMENTS`.

    Returns:
      ``gather``, ``owner`` or ``local``.

    >>> g = MatrixGroup("wq", (8, 1024, 1024), (1,), (2,), ((), ("fsdp",), ()))
    >>> choose_placement(g, {"fsdp": 8}, 5, "h100"), choose_placement(g, {"data": 8}, 5, "h100")
    ('owner', 'local')
    """
    if placement not in PLACEMENTS:
        raise CostModelError(f"placement={placement!r}: choose one of {', '.join(PLACEMENTS)}.")
    if not group.axes(group.reduction + group.output, sizes):
        return "local"
    if placement != "auto":
        return placement
    c = load_cluster(cluster) if isinstance(cluster, str) else cluster
    times = {p: placement_cost(group, sizes, p, ns_steps, c).seconds for p in ("gather", "owner")}
    return min(times, key=lambda p: (times[p], p != "gather"))


def placement_chooser(cluster: Cluster | str | None = None, platform: str = "gpu") -> Callable:
    """Muon's ``auto`` on the cost model: :func:`choose_placement` on ``cluster``, as the ``chooser`` of
    :func:`jaxpar.optimizers.muon` (``jaxpar train`` passes it).

    Args:
      cluster: a :class:`~jaxpar.cost.Cluster` or a preset name (None: by ``platform``, :data:`PLATFORM_CLUSTERS`).
      platform: the devices' platform (``mesh.devices.flat[0].platform``).

    Returns:
      ``chooser(group, sizes, ns_steps) -> "gather" | "owner"``.

    >>> g = MatrixGroup("w", (64, 64), (0,), (1,), (("fsdp",), ()))
    >>> placement_chooser("h100")(g, {"fsdp": 8}, 5)        # one small matrix: latency-bound
    'gather'
    """
    c = load_cluster(cluster or PLATFORM_CLUSTERS.get(platform, "h100")) if not isinstance(cluster, Cluster) \
        else cluster
    return lambda group, sizes, ns_steps: choose_placement(group, sizes, ns_steps, c)


def placements_table(placements: Mapping[str, Any], sizes: Mapping[str, int], ns_steps: int,
                     cluster: Cluster | str) -> str:
    """:func:`jaxpar.optimizers.muon_placements` as text, timed by the cost model (:func:`placement_table`).

    Args:
      placements: ``{path: MuonPlacement}`` (its ``kind``, ``group`` and ``axes``).
      sizes: mesh axis sizes.
      ns_steps: Newton-Schulz iterations.
      cluster: a :class:`~jaxpar.cost.Cluster` or a preset name.

    Returns:
      The table.
    """
    c = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return placement_table([(path, p.axes, placement_cost(p.group, sizes, p.kind, ns_steps, c))
                            for path, p in placements.items()])


def _momentum_spec(leaf: Leaf, sizes: Mapping[str, int], zero: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of a leaf's optimizer state: the tensor / pipe / expert rules, then ZeRO's dim."""
    spec = [tuple(e) for e in leaf_spec(leaf, sizes)]
    d = zero_dim_of(leaf, spec, sizes, zero)
    if d is not None:
        spec[d] = spec[d] + zero_axes(sizes, zero, "opt")
    return tuple(spec)


def matrix_groups(m: ModelSpec, sizes: Mapping[str, int], zero: int = 0) -> list[MatrixGroup]:
    """The model's Muon-routed leaves (:func:`matrix_sides` of their logical names; sides swapped for an
    ``out_in`` model, as :func:`jaxpar.optimizers.muon_routes` does) as matrix groups, their momentum sharded
    as jaxpar's layouts shard optimizer state.

    Args:
      m: the model (with leaves).
      sizes: mesh axis sizes.
      zero: the ZeRO stage.

    Returns:
      One :class:`MatrixGroup` per matrix leaf.

    >>> from jaxpar.cost._model import gpt
    >>> [g.name for g in matrix_groups(gpt(2, 32, 8, 16, 64, 16), {"fsdp": 2})]
    ['blocks/wq', 'blocks/wk', 'blocks/wv', 'blocks/wo', 'blocks/w1', 'blocks/w2']
    """
    out = []
    for leaf in m.leaves:
        red, outp, _, _ = matrix_sides(leaf.logical)
        if m.kernel_layout == "out_in":          # the first feature group is the output side (the Decoder's)
            red, outp = outp, red
        if red:
            out.append(MatrixGroup(leaf.name, leaf.shape, red, outp, _momentum_spec(leaf, sizes, zero)))
    return out


def placement_table(rows: Sequence[tuple[str, tuple[str, ...], PlacementCost]]) -> str:
    """Matrix groups as text, one line each: placement, the mesh axes it gathers over, its Newton-Schulz
    FLOPs and collectives on one device, the cost model's milliseconds.

    Args:
      rows: ``(name, axes, cost)`` per group.

    Returns:
      The table.
    """
    width = max((len(name) for name, _, _ in rows), default=0)
    lines = []
    for name, axes, c in rows:
        comms = ", ".join(f"{x.count} x {x.kind} {x.bytes / 2**10:.1f} KiB" for x in c.comms) or "no collective"
        lines.append(f"{name:<{width}}  {c.placement:<6}  over {'x'.join(axes) or '-'}  {c.flops / 1e6:.1f} MFLOP  "
                     f"{comms}  {c.seconds * 1e3:.3f} ms")
    return "\n".join(lines)


class MuonUpdate(NamedTuple):
    """Muon's Newton-Schulz in one step on one device: per matrix group its placement and cost, and the sums."""

    groups: tuple[tuple[MatrixGroup, PlacementCost], ...]

    @property
    def flops(self) -> float:
        return sum(c.flops for _, c in self.groups)

    @property
    def bytes(self) -> float:
        return sum(c.bytes for _, c in self.groups)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for _, c in self.groups)

    def table(self) -> str:
        """:func:`placement_table` of its groups (the axes: their collectives')."""
        return placement_table([(g.name, c.comms[0].axes if c.comms else (), c) for g, c in self.groups])


def muon_update(m: ModelSpec, sizes: Mapping[str, int], cluster: Cluster | str, *, zero: int = 0,
                ns_steps: int = 5, placement: str = "auto") -> MuonUpdate:
    """Newton-Schulz FLOPs and the chosen placements' collectives of a Muon step (docs/muon.md).

    Args:
      m: the model (with leaves and logical names).
      sizes: mesh axis sizes.
      cluster: a :class:`~jaxpar.cost.Cluster` or a preset name.
      zero: the ZeRO stage (how the momentum is sharded).
      ns_steps: Newton-Schulz iterations.
      placement: one of :data:`PLACEMENTS` (``auto``: :func:`choose_placement` per group).

    Returns:
      The :class:`MuonUpdate`.

    >>> from jaxpar.cost._model import gpt
    >>> u = muon_update(gpt(2, 128, 4, 64, 256, 32), {"fsdp": 8}, "cpu_sim")   # the quickstart GPT
    >>> [c.placement for _, c in u.groups], u.bytes / 2**20     # 2 layers on 8 owners: 1 matrix each, 2 ways
    (['owner', 'owner', 'owner', 'owner', 'owner', 'owner'], 1.5)
    """
    c = load_cluster(cluster) if isinstance(cluster, str) else cluster
    groups = matrix_groups(m, sizes, zero)
    chosen = [(g, choose_placement(g, sizes, ns_steps, c, placement)) for g in groups]
    return MuonUpdate(tuple((g, placement_cost(g, sizes, p, ns_steps, c)) for g, p in chosen))


def muon_comms(update: MuonUpdate) -> list[Comm]:
    """The collectives of a Muon step's Newton-Schulz placements (for :func:`jaxpar.cost._traffic.bytes_per_axis`).

    Args:
      update: the :class:`MuonUpdate`.

    Returns:
      Its collectives, phase ``optimizer``.
    """
    return [c for _, cost in update.groups for c in cost.comms]


def with_muon(t: StepTime, m: ModelSpec, plan: Plan, cluster: Cluster, dtype: str, *, ns_steps: int = 5,
              placement: str = "auto") -> StepTime:
    """A step time with Muon's Newton-Schulz (FLOPs and the placements' collectives, :func:`muon_update`)
    added to its ``optimizer`` update, its bytes per axis and its MFU.

    Args:
      t: the step time of the plan (AdamW's update: :func:`jaxpar.cost._time.update_bytes`).
      m, plan, cluster: the model, the plan and the cluster.
      dtype: the compute dtype (the MFU's peak).
      ns_steps: Newton-Schulz iterations.
      placement: one of :data:`PLACEMENTS`.

    Returns:
      The :class:`~jaxpar.cost._time.StepTime`.

    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.cost._time import step_time
    >>> m, c = gpt(4, 1024, 16, 1024, 32000, 64), load_cluster("h100")
    >>> t = step_time(m, Plan(fsdp=8), c)
    >>> u = with_muon(t, m, Plan(fsdp=8), c, "bfloat16")
    >>> u.optimizer > t.optimizer, u.bytes_per_axis["fsdp"] > t.bytes_per_axis["fsdp"], u.mfu < t.mfu
    (True, True, True)
    """
    update = muon_update(m, plan.sizes, cluster, zero=plan.strategy.zero, ns_steps=ns_steps, placement=placement)
    per_axis = dict(t.bytes_per_axis)
    for c in muon_comms(update):
        for a in c.axes:
            per_axis[a] = per_axis.get(a, 0.0) + c.bytes * c.count
    out = replace(t, optimizer=t.optimizer + update.seconds, bytes_per_axis=per_axis)
    return replace(out, mfu=step_flops(m) / (out.total * plan.devices * cluster.peak(dtype)))
