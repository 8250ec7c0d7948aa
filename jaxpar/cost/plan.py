"""The planner: every ``pipe x data x fsdp x tensor`` factorisation of the cluster x ZeRO stage x
schedule x micro-batches x remat, those that do not fit dropped with the reason, the rest ranked.

For each factorisation and parallel option the cheapest remat policy that fits is kept
(``none``, then ``selective``, then ``full``: recomputation only adds time), and without a
pipeline the fewest accumulation micro-batches that fit. Usable memory is
``cluster memory x memory_fraction`` (the rest: workspace, fragmentation, the framework).

Example::

    >>> from jaxpar.cost.cluster import load_cluster
    >>> from jaxpar.cost.model import gpt
    >>> result = plan(gpt(12, 768, 12, 1024, 50304, 64), load_cluster("h100"), top=3)
    >>> result.best.plan.tensor, result.best.plan.pipe
    (1, 1)
    >>> print(result.table(2))      # doctest: +ELLIPSIS
    rank | plan ...
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..analysis.memory import format_bytes, render_table
from .cluster import Cluster
from .memory import LayoutError, MemoryEstimate, memory_per_device
from .model import ModelSpec
from .parallel import Plan
from .time import Overlap, StepTime, step_time
from .traffic import outer_at_ends

__all__ = ["PlanError", "Estimate", "Rejected", "PlanResult", "plan", "factorisations", "evaluate"]


class PlanError(ValueError):
    """No plan exists (bad sizes, or nothing fits); the message says why and what to change."""


@dataclass(frozen=True)
class Estimate:
    """A plan with its predicted time, memory per device and whether it fits."""

    plan: Plan
    time: StepTime
    memory: MemoryEstimate
    fits: bool

    def row(self) -> dict:
        """Plain values for ``--json``."""
        t, mem = self.time, self.memory
        return {"plan": self.plan.name(), **asdict(self.plan), "step_s": t.total, "compute_s": t.compute,
                "data_s": t.data, "tensor_s": t.tensor, "pipeline_s": t.pipeline, "optimizer_s": t.optimizer,
                "elementwise_s": t.elementwise, "bubble": t.bubble,
                "mfu": t.mfu, "memory_bytes": mem.total, "state_bytes": mem.params + mem.grads + mem.opt,
                "activation_bytes": mem.activations + mem.logits, "bytes_per_axis": t.bytes_per_axis}


@dataclass(frozen=True)
class Rejected:
    plan: Plan | None
    reason: str


@dataclass
class PlanResult:
    """Ranked estimates (fastest first) and the rejected plans with their reasons."""

    ranked: list[Estimate]
    rejected: list[Rejected] = field(default_factory=list)
    considered: int = 0

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def table(self, top: int = 10) -> str:
        """Printable ranked table."""
        rows = []
        for i, e in enumerate(self.ranked[:top], 1):
            t, mem = e.time, e.memory
            axes = " ".join(f"{a}:{format_bytes(b)}" for a, b in sorted(t.bytes_per_axis.items()))
            rows.append([str(i), e.plan.name(), f"{t.total * 1e3:.1f}", f"{t.compute * 1e3:.1f}",
                         f"{t.elementwise * 1e3:.1f}", f"{t.data * 1e3:.1f}", f"{t.tensor * 1e3:.1f}",
                         f"{t.pipeline * 1e3:.1f}",
                         f"{t.optimizer * 1e3:.1f}",
                         f"{t.bubble:.3f}", f"{t.mfu:.3f}", format_bytes(mem.total), axes or "-"])
        headers = ["rank", "plan", "step ms", "compute", "elementwise", "data", "tensor", "pipe", "update", "bubble",
                   "MFU", "memory", "bytes per axis"]
        return render_table(headers, rows, right=[True, False] + [True] * 10 + [False])

    def rejected_table(self, top: int = 10) -> str:
        rows = [[r.plan.name() if r.plan else "-", r.reason] for r in self.rejected[:top]]
        return render_table(["rejected plan", "reason"], rows, right=[False, False])


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def factorisations(n: int) -> list[tuple[int, int, int, int]]:
    """Every ``(pipe, data, fsdp, tensor)`` with product ``n``.

    >>> len(factorisations(8)), factorisations(2)
    (20, [(1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1)])
    """
    return [(p, d, f, n // (p * d * f)) for p in _divisors(n) for d in _divisors(n // p)
            for f in _divisors(n // (p * d))]


def _shape_problem(m: ModelSpec, p: int, d: int, f: int, t: int) -> str | None:
    for name, size in (("heads", m.heads), ("mlp", m.mlp), ("vocab", m.vocab)):
        if size % t:
            return f"tensor={t} does not divide model {name}={size}"
    if m.layers % p:
        return f"pipe={p} does not divide model layers={m.layers}"
    if m.batch % (d * f):
        return f"data*fsdp={d * f} does not divide the global batch={m.batch}"
    return None


def evaluate(m: ModelSpec, p: Plan, cluster: Cluster, *, dtype: str = "bfloat16", precision: str = "mixed",
             overlap: Overlap = Overlap(), memory_fraction: float = 0.9, lowering: str = "ideal",
             grad_bytes: float | None = None) -> Estimate:
    """Time and memory of one plan (no search); ``grad_bytes`` as :func:`jaxpar.cost.time.step_time`'s."""
    mem = _memory(m, p, dtype, precision, lowering)
    t = step_time(m, p, cluster, dtype=dtype, overlap=overlap, lowering=lowering, grad_bytes=grad_bytes)
    return Estimate(p, t, mem, mem.total <= cluster.memory_bytes * memory_fraction)


def _memory(m: ModelSpec, p: Plan, dtype: str, precision: str, lowering: str = "ideal"):
    return memory_per_device(m, p.sizes, zero=p.zero, microbatches=p.microbatches, schedule=p.schedule,
                             virtual=p.virtual, remat=p.remat, sequence_parallel=p.sequence_parallel,
                             precision=precision, activation_bytes=4 if dtype == "float32" else 2,
                             ends=outer_at_ends(lowering))


def _options(m: ModelSpec, p: int, d: int, f: int, t: int, schedules) -> list[dict]:
    replica = m.batch // (d * f)
    zeros = (0, 1, 2, 3) if d > 1 else (0,)
    sps = (False, True) if t > 1 else (False,)
    out = []
    if p == 1:
        accum = [k for k in (1, 2, 4, 8, 16, 32, 64) if replica % k == 0]
        for z in zeros:
            for sp in sps:
                out.append(dict(zero=z, sequence_parallel=sp, accum=accum))
        return out
    for z in zeros:
        for sp in sps:
            for sched in schedules:
                for k in (1, 2, 4, 8):
                    mb = p * k
                    if replica % mb:
                        continue
                    if sched == "interleaved":
                        if m.layers % (2 * p):
                            continue
                        out.append(dict(zero=z, sequence_parallel=sp, schedule=sched, virtual=2, microbatches=mb))
                    else:
                        out.append(dict(zero=z, sequence_parallel=sp, schedule=sched, microbatches=mb))
    return out


def plan(model: ModelSpec, cluster: Cluster, *, top: int = 10, dtype: str = "bfloat16", precision: str = "mixed",
         overlap: Overlap = Overlap(), memory_fraction: float = 0.9, schedules=("gpipe", "1f1b", "interleaved", "zb-h1"),
         lowering: str = "ideal") -> PlanResult:
    """Rank every plan of ``model`` on ``cluster`` (see the module doc); raises :class:`PlanError`
    with the reasons when none is possible or none fits."""
    if not isinstance(model, ModelSpec):
        raise PlanError(f"model must be a jaxpar.cost.ModelSpec (e.g. jaxpar.cost.gpt(...)), got {type(model).__name__}.")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction={memory_fraction!r}: must be in (0, 1], e.g. 0.9.")
    cluster.peak(dtype)
    n = cluster.num_devices
    ranked, rejected, considered = [], [], 0
    usable = cluster.memory_bytes * memory_fraction
    shape_reasons = []
    for p, d, f, t in factorisations(n):
        problem = _shape_problem(model, p, d, f, t)
        if problem:
            shape_reasons.append(problem)
            continue
        for opt in _options(model, p, d, f, t, schedules):
            accum = opt.pop("accum", [opt.get("microbatches", 1)])
            best = None
            for mb in accum:
                for remat in ("none", "selective", "full"):
                    considered += 1
                    cand = Plan(pipe=p, data=d, fsdp=f, tensor=t, remat=remat, **{**opt, "microbatches": mb})
                    try:     # memory first: a plan that does not fit needs no step time (most of the search)
                        mem = _memory(model, cand, dtype, precision, lowering)
                        if mem.total <= usable:
                            best = Estimate(cand, step_time(model, cand, cluster, dtype=dtype, overlap=overlap,
                                                            lowering=lowering), mem, True)
                            break
                    except LayoutError as err:
                        rejected.append(Rejected(cand, str(err)))
                        break
                    rejected.append(Rejected(cand, f"needs {format_bytes(mem.total)} per device > "
                                                   f"{format_bytes(usable)} usable "
                                                   f"({memory_fraction:g} of {format_bytes(cluster.memory_bytes)})"))
                if best:
                    break
            if best:
                ranked.append(best)
    if not ranked:
        if not rejected:
            reasons = "; ".join(sorted(set(shape_reasons))[:6])
            raise PlanError(f"no factorisation pipe x data x fsdp x tensor of the cluster's {n} devices fits the "
                            f"model's sizes: {reasons}. Fix: use a device count whose factors divide the batch, "
                            f"heads and layers (e.g. a power of 2), or change the model / batch.")
        smallest = min(rejected, key=lambda r: _needed(r.reason))
        raise PlanError(f"the model ({model.n_params / 1e9:.2f} B parameters, batch {model.batch}) fits on no plan "
                        f"of {n} x {cluster.name} ({format_bytes(cluster.memory_bytes)} each): the smallest, "
                        f"{smallest.plan.name() if smallest.plan else '-'}, {smallest.reason}. Fix: more devices "
                        f"(--devices / nodes), a smaller batch, or devices with more memory.")
    ranked.sort(key=lambda e: e.time.total)
    return PlanResult(ranked, rejected, considered)


def _needed(reason: str) -> float:
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
    parts = reason.split()
    try:
        return float(parts[1]) * units[parts[2]]
    except (IndexError, ValueError, KeyError):
        return math.inf
