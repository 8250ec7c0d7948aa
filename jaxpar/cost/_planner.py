"""The planner (docs/planning.md §4, §10): every ``pipe x data x fsdp x expert x context x tensor``
factorisation of the cluster x CP method x ZeRO stage x schedule x micro-batches x remat; the layouts
that cannot run the model *refused* with the reason, the candidates the compatibility table refuses
(:func:`plan_refusal`) and those that do not fit *rejected* with the reason, the rest ranked.

For each layout the cheapest remat policy that fits is kept (``none``, ``save-matmuls``, ``full``), and
without a pipeline the fewest accumulation micro-batches. Usable memory is the one capacity rule of every
command (:attr:`Cluster.capacity <jaxpar.cost.Cluster.capacity>`: on GPUs ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75
by default, of the device bytes); a plan is ranked only when its predicted peak x ``1 +`` :data:`PLAN_MARGIN` fits.

Example::

    >>> from jaxpar.cost._cluster import load_cluster
    >>> from jaxpar.cost._model import gpt
    >>> result = plan(gpt(12, 768, 12, 1024, 50304, 64), load_cluster("h100"), top=3)
    >>> result.best.plan.tensor, result.best.plan.pipe
    (1, 1)
    >>> print(result.table(2))      # doctest: +ELLIPSIS
    rank | plan ...
    >>> from jaxpar.parallel.compression import topk
    >>> print(plan_refusal(Plan(data=4, context=2), fixed={"compression": topk(0.01)}))   # doctest: +ELLIPSIS
    the compatibility table refuses it: Strategy.compression with context=2: a codec's exchange runs...
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, NamedTuple

from jaxpar._text import format_bytes, render_table
from jaxpar.compat._table import LIBRARY_NAMES, Setting, problems
from jaxpar.cost._context_experts import fused_context
from jaxpar.cost._device_bytes import memory_per_device
from jaxpar.cost._capacity import PLAN_MARGIN, Capacity, device_capacity
from jaxpar.cost._cluster import FP8, Cluster
from jaxpar.cost._host_link import PRECISION as OFFLOAD_PRECISION, PROPOSED as OFFLOAD_PROPOSED
from jaxpar.cost._memory import LayoutError, MemoryEstimate, muon_precision
from jaxpar.cost._model import ModelSpec
from jaxpar.cost._muon import with_muon
from jaxpar.cost._parallel import MODELLED, Plan
from jaxpar.cost._roofline import fp8_kernels
from jaxpar.cost._time import Overlap, StepTime, step_time
from jaxpar.cost._traffic import outer_at_ends
from jaxpar.errors import ClusterError, PlanError, int_problem
from jaxpar.options import CONTEXT_METHODS, LAYER_INPUT, ContextParallel, Fp8, Offload
from jaxpar.strategy import Strategy

#: The shortest sequence for which :func:`plan` searches CP degrees by default. NeMo's long-context
#: recipes (16k and 64k tokens) are where CP is used in practice; at 2k the model would pick CP 2 for
#: GPT-3 on 1,024 A100s (docs/planning.md, "CP and EP"), against the published layouts.
CONTEXT_MIN_SEQ = 8192


# ----------------------------------------------------------------------------- layouts
def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def factorisations(n: int) -> list[tuple[int, int, int, int]]:
    """Every ``(pipe, data, fsdp, tensor)`` with product ``n``, ascending."""
    return [(p, d, f, n // (p * d * f)) for p in divisors(n) for d in divisors(n // p)
            for f in divisors(n // (p * d))]


def mesh_factorisations(n: int, contexts=(1,), experts=(1,)) -> list[tuple[int, int, int, int, int, int]]:
    """Every ``(pipe, data, fsdp, expert, context, tensor)`` with product ``n``, ``expert`` in ``experts`` and
    ``context`` in ``contexts`` (in that order: the plans without CP / EP first).

    >>> len(mesh_factorisations(8)), len(mesh_factorisations(8, contexts=(1, 2, 4, 8)))
    (20, 35)
    >>> mesh_factorisations(4, contexts=(4,), experts=(1, 2))
    [(1, 1, 1, 1, 4, 1)]
    """
    return [(p, d, f, e, c, t) for e in experts if n % e == 0 for c in contexts if (n // e) % c == 0
            for p, d, f, t in factorisations(n // (e * c))]


def shape_problem(m: ModelSpec, p: int, d: int, f: int, t: int, e: int = 1) -> str | None:
    """Why the ``pipe``, ``data``, ``fsdp``, ``tensor`` and ``expert`` sizes cannot split the model's heads,
    MLP, vocabulary (and expert MLP), layers (and MoE layers) and global batch; None when they divide."""
    for name, size in (("heads", m.heads), ("mlp", m.mlp), ("vocab", m.vocab)) + (
            (("expert_mlp", m.expert_mlp),) if m.is_moe else ()):
        if size % t:
            return f"tensor={t} does not divide model {name}={size}"
    if m.layers % p:
        return f"pipe={p} does not divide model layers={m.layers}"
    if m.moe_layers % p:
        return f"pipe={p} does not divide the model's {m.moe_layers} MoE layers"
    if m.batch % (d * f * e):
        return (f"data*fsdp={d * f} does not divide the global batch={m.batch}" if e == 1 else
                f"data*fsdp*expert={d * f * e} does not divide the global batch={m.batch}")
    return None


def context_problem(m: ModelSpec, context: int, tensor: int, method: str) -> tuple[bool, str | None]:
    """``(balanced layout, why it cannot run or None)`` of ``context`` devices running ``method`` on ``m``:
    the balanced layout needs ``seq % 2C == 0``, the natural order ``seq % C == 0``; Ulysses needs the heads
    on a device (after the tensor split) divisible by ``C``.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 96, 12, 1000, 64, 8)
    >>> context_problem(m, 4, 1, "ring"), context_problem(m, 8, 1, "ring")[0]
    ((True, None), False)
    >>> context_problem(m, 8, 1, "ulysses")[1]
    'ulysses needs heads % (context * tensor) == 0: heads=12, context=8, tensor=1'
    """
    if method == "ulysses" and m.heads % (context * tensor):
        return True, (f"ulysses needs heads % (context * tensor) == 0: heads={m.heads}, context={context}, "
                      f"tensor={tensor}")
    if m.seq % (2 * context) == 0:
        return True, None
    if m.seq % context == 0:
        return False, None
    return False, f"context={context} does not divide the sequence length {m.seq} (seq % context != 0)"


def expert_problem(m: ModelSpec, expert: int) -> str | None:
    """Why an ``expert`` axis of this size cannot run ``m`` (None if it can).

    >>> from jaxpar.cost._model import gpt
    >>> expert_problem(gpt(2, 32, 8, 16, 64, 16), 2)
    'expert=2 but the model has no MoE layer (experts=0)'
    """
    if expert == 1:
        return None
    if not m.is_moe:
        return f"expert={expert} but the model has no MoE layer (experts=0)"
    if m.experts % expert:
        return f"experts={m.experts} is not divisible by expert={expert} (each device keeps experts / expert)"
    return None


# ----------------------------------------------------------------------------- the compatibility table
#: The strategy fields that no plan chooses: the search keeps them fixed (``fixed=`` of :func:`plan_setting`).
STRATEGY_FIELDS = ("compute_dtype", "compression", "sync", "local_clip")
#: The step's and the loop's options of :class:`~jaxpar.compat.Setting` that ``fixed=`` may also set.
SETTING_FIELDS = tuple(f for f in Setting._fields if f not in ("strategy", "sizes"))
#: How a reason of the table starts in the planner's rejected list.
REFUSED_PREFIX = "the compatibility table refuses it: "


def plan_setting(plan: Any, *, dtype: str = "bfloat16", fixed: Mapping[str, Any] | None = None) -> Setting:
    """The compatibility table's :class:`~jaxpar.compat.Setting` of a :class:`~jaxpar.cost.Plan` ranked for
    the compute ``dtype``, with the run's settings no plan chooses (``fixed``: :data:`STRATEGY_FIELDS`, where
    ``compute_dtype`` wins over ``dtype``, and :data:`SETTING_FIELDS`, such as ``clip_norm``)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(STRATEGY_FIELDS) - set(SETTING_FIELDS))
    if unknown:
        raise PlanError(f"fixed={fixed!r}: unknown key(s) {', '.join(unknown)}; the table reads the strategy's "
                        f"{', '.join(STRATEGY_FIELDS)} and the options {', '.join(SETTING_FIELDS)}.")
    strategy = replace(plan.strategy, compute_dtype=fixed.pop("compute_dtype", dtype),
                       **{k: fixed.pop(k) for k in STRATEGY_FIELDS[1:] if k in fixed})
    return Setting(strategy, dict(plan.sizes), **fixed)


def plan_refusal(plan: Any, *, dtype: str = "bfloat16", fixed: Mapping[str, Any] | None = None) -> str | None:
    """Why the compatibility table refuses a plan (:func:`plan_setting`'s arguments): :data:`REFUSED_PREFIX`
    and every problem in the library's names, or None when it composes."""
    found = problems(plan_setting(plan, dtype=dtype, fixed=fixed))
    return REFUSED_PREFIX + " ".join(p.render(LIBRARY_NAMES) for p in found) if found else None


@dataclass(frozen=True)
class Estimate:
    """A plan with its predicted time, memory per device and whether it fits; for a plan with ``fp8``
    the search chose, ``without_fp8``: the seconds per step of the same plan without it; for a plan with
    ``offload``, ``without_offload`` likewise (a plan that does not fit without it: the slowdown)."""

    plan: Plan
    time: StepTime
    memory: MemoryEstimate
    fits: bool
    without_fp8: float | None = None
    without_offload: float | None = None

    def row(self) -> dict:
        """Plain values for ``--json``."""
        t, mem, plan = self.time, self.memory, asdict(self.plan)
        plan["strategy"] = {k: plan["strategy"][k] for k in MODELLED}
        return {"plan": self.plan.name(), **plan, "step_s": t.total, "compute_s": t.compute,
                "data_s": t.data, "tensor_s": t.tensor, "pipeline_s": t.pipeline, "optimizer_s": t.optimizer,
                "context_s": t.context, "expert_s": t.expert,
                "elementwise_s": t.elementwise, "bubble": t.bubble,
                "mfu": t.mfu, "memory_bytes": mem.total, "state_bytes": mem.params + mem.grads + mem.opt,
                "activation_bytes": mem.activations + mem.logits, "bytes_per_axis": t.bytes_per_axis,
                "without_fp8_s": self.without_fp8, "offload_s": t.offload, "host_bytes": mem.host,
                "without_offload_s": self.without_offload, "unmodelled": list(t.unmodelled)}


@dataclass(frozen=True)
class Rejected:
    plan: Plan | None
    reason: str


@dataclass
class PlanResult:
    """Ranked estimates (fastest first), the rejected plans (do not fit) and the refused ones (cannot run:
    CP / EP sizes), with their reasons; ``fp8``: the FP8 options of the plans with FP8 (None: ``fp8=False``)."""

    ranked: list[Estimate]
    rejected: list[Rejected] = field(default_factory=list)
    considered: int = 0
    refused: list[Rejected] = field(default_factory=list)
    top: int = 10
    fp8: Fp8 | None = None

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def table(self, top: int | None = None) -> str:
        """Printable ranked table (``cp`` and ``ep`` columns when a listed plan has those axes).

        Args:
          top: how many plans, fastest first (default: ``plan(top=...)``).

        Returns:
          The table's text.
        """
        shown = self.ranked[:self.top if top is None else top]
        extra = [(k, k[:2] if k != "expert" else "ep") for k in ("context", "expert")
                 if any(getattr(e.plan, k) > 1 for e in shown)]
        ms = ["total", "compute", "elementwise", "data", "tensor", "pipeline", *(k for k, _ in extra), "optimizer"]
        rows = []
        for i, e in enumerate(shown, 1):
            t, mem = e.time, e.memory
            axes = " ".join(f"{a}:{format_bytes(b)}" for a, b in sorted(t.bytes_per_axis.items()))
            rows.append([str(i), e.plan.name(), *(f"{getattr(t, k) * 1e3:.1f}" for k in ms),
                         f"{t.bubble:.3f}", f"{t.mfu:.3f}", format_bytes(mem.total), axes or "-"])
        headers = (["rank", "plan", "step ms", "compute", "elementwise", "data", "tensor", "pipe"]
                   + [label for _, label in extra] + ["update", "bubble", "MFU", "memory", "bytes per axis"])
        right = [True, False] + [True] * (10 + len(extra)) + [False]
        if any(e.without_fp8 for e in shown):       # FP8 chosen: the step without it, and the gain
            headers.append("without fp8 ms (gain)")
            right.append(True)
            for r, e in zip(rows, shown):
                r.append(f"{e.without_fp8 * 1e3:.1f} ({e.without_fp8 / e.time.total:.2f}x)" if e.without_fp8 else "-")
        if any(e.plan.strategy.offload for e in shown):      # offloading: its link, and the step without it
            headers += ["host link", "without offload ms (slowdown)"]
            right += [True, True]
            for r, e in zip(rows, shown):
                r += [f"{e.time.offload * 1e3:.1f}", f"{e.without_offload * 1e3:.1f} "
                      f"({e.time.total / e.without_offload:.2f}x)" if e.without_offload else "-"]
        return render_table(headers, rows, right=right)

    def rejected_table(self, top: int | None = None) -> str:
        """The plans that do not fit, with the reason.

        Args:
          top: how many, in the order they were found (default: ``plan(top=...)``).

        Returns:
          The table's text.
        """
        return self._reasons("rejected plan", self.rejected, top)

    def refused_table(self, top: int | None = None) -> str:
        """The plans that cannot run (CP / EP sizes), with the reason.

        Args:
          top: how many, in the order they were found (default: ``plan(top=...)``).

        Returns:
          The table's text.
        """
        return self._reasons("refused plan", self.refused, top)

    def _reasons(self, title: str, found: list[Rejected], top: int | None) -> str:
        rows = [[r.plan.name() if r.plan else "-", r.reason] for r in found[:self.top if top is None else top]]
        return render_table([title, "reason"], rows, right=[False, False])


def evaluate(m: ModelSpec, p: Plan, cluster: Cluster, *, dtype: str = "bfloat16", precision: str = "mixed",
             overlap: Overlap = Overlap(), memory_fraction: float | None = None, lowering: str = "ideal",
             grad_bytes: float | None = None, muon: dict | None = None) -> Estimate:
    """Time and memory of one plan (no search).

    Args:
      m: the model.
      p: the plan.
      cluster: the cluster.
      dtype, precision, overlap, memory_fraction, lowering: as for :func:`plan`.
      grad_bytes: as for :func:`jaxpar.cost.step_time`.
      muon: Muon's ``{"ns_steps", "placement"}``: its Newton-Schulz in the update (:func:`jaxpar.cost.with_muon`)
        and its one moment per matrix (:func:`jaxpar.cost.muon_precision`).

    Returns:
      The :class:`Estimate`.

    Raises:
      PlanError: the plan's CP / EP cannot run the model (:func:`context_problem`, :func:`expert_problem`).
    """
    cp = p.strategy.context_setting
    why = expert_problem(m, p.expert) or (context_problem(m, p.context, p.tensor, cp.method)[1]
                                          if p.context > 1 else None)
    if why is None and p.context > 1 and cp.balance and m.seq % (2 * p.context):
        why = f"the balanced layout needs seq % (2 * context) == 0: seq={m.seq}, context={p.context}"
    if why:
        raise PlanError(f"plan {p.name()} cannot run this model: {why}.")
    precision = OFFLOAD_PRECISION if p.strategy.offload else precision     # offloading: jaxpar's fp32 layout
    mem = _memory(m, p, dtype, muon_precision(precision) if muon is not None else precision, lowering,
                  cluster.fused_attention)
    t = step_time(m, p, cluster, dtype=dtype, overlap=overlap, lowering=lowering, grad_bytes=grad_bytes)
    t = with_muon(t, m, p, cluster, dtype, **muon) if muon is not None else t
    return Estimate(p, t, mem, mem.total <= _capacity(cluster, memory_fraction).plan_bytes)


def _capacity(cluster: Cluster, memory_fraction: float | None) -> Capacity:
    """The cluster's capacity (:attr:`Cluster.capacity`), or ``memory_fraction`` of its memory when given."""
    return cluster.capacity if memory_fraction is None else device_capacity(cluster.memory_bytes, cluster.platform,
                                                                              fraction=memory_fraction)


def too_big(need: float, capacity: Capacity) -> str:
    """Why a plan of predicted peak ``need`` is not ranked, in words (the same in every rejection).

    >>> too_big(60 * 2**30, Capacity(80 * 2**30, 0.75, "XLA_PYTHON_CLIENT_MEM_FRACTION"))
    'needs 60.0 GiB per device, 66.0 GiB with the 10% margin > 60.0 GiB usable (75% of 80.0 GiB: XLA_PYTHON_CLIENT_MEM_FRACTION)'
    """
    return (f"needs {format_bytes(need)} per device, {format_bytes(need * (1 + PLAN_MARGIN))} with the "
            f"{PLAN_MARGIN:.0%} margin > {capacity.text()}")


#: The compiler whose measured tables (:func:`jaxpar.cost._device_bytes.memory_table`) a lowering reads;
#: the others read the paper's.
_MEASURED_ON = {"xla": "cuda", "xla-tpu": "tpu"}


def _memory(m: ModelSpec, p: Plan, dtype: str, precision: str, lowering: str = "ideal", fused: bool = False):
    return memory_per_device(m, p, precision=precision, activation_bytes=4 if dtype == "float32" else 2,
                             ends=outer_at_ends(lowering), fused_attention=fused_context(fused, dtype),
                             keeps=_MEASURED_ON.get(lowering, "paper"))


def _options(m: ModelSpec, p: int, d: int, f: int, t: int, schedules, e: int = 1) -> list[dict]:
    replica = m.batch // (d * f * e)
    zeros = (0, 1, 2, 3) if d > 1 else (0,)
    sps = (False, True) if t > 1 else (False,)
    if p == 1:
        accum = [k for k in (1, 2, 4, 8, 16, 32, 64) if replica % k == 0]
        return [dict(zero=z, sequence_parallel=sp, accum=accum) for z in zeros for sp in sps]
    out = []
    for z, sp, sched, k in itertools.product(zeros, sps, schedules, (1, 2, 4, 8)):
        interleaved = sched == "interleaved"
        if replica % (p * k) or (interleaved and m.layers % (2 * p)):
            continue
        virtual = {"virtual_stages": 2} if interleaved else {}
        out.append(dict(zero=z, sequence_parallel=sp, schedule=sched, microbatches=p * k, **virtual))
    return out


class _Search(NamedTuple):
    """The settings one search evaluates every candidate with."""

    model: ModelSpec
    cluster: Cluster
    dtype: str
    precision: str
    overlap: Overlap
    lowering: str
    capacity: Capacity
    fixed: dict | None = None
    fp8: Fp8 | None = None              # None: no FP8 plans; else FP8 plans with these options are considered too
    muon: dict | None = None            # Muon's {"ns_steps", "placement"}: its Newton-Schulz in the update
    offload: Offload | None = None      # the offload of every candidate's strategy (precision: jaxpar's fp32 layout)

    def timed(self, p: Plan) -> StepTime:
        """The step time of ``p`` (with Muon's Newton-Schulz, :func:`jaxpar.cost.with_muon`, when ``muon`` is set)."""
        t = step_time(self.model, p, self.cluster, dtype=self.dtype, overlap=self.overlap, lowering=self.lowering)
        return t if self.muon is None else with_muon(t, self.model, p, self.cluster, self.dtype, **self.muon)

    def best(self, base: Plan, opt: dict) -> tuple[Estimate | None, list[Rejected], int]:
        """The cheapest remat (and fewest accumulation steps) of ``base`` + ``opt`` that fits, the
        candidates rejected on the way, and how many were considered; none if the table refuses it."""
        accum = opt.pop("accum", [opt.get("microbatches", 1)])
        cand = base.with_strategy(**{**opt, "microbatches": accum[0]})
        why = plan_refusal(cand, dtype=self.dtype, fixed=self.fixed)   # the table reads no remat, no accumulation
        if why:
            return None, [Rejected(cand, why)], 1
        rejected, considered = [], 0
        # the recomputations, cheapest first: none, save-matmuls, full; in the offloaded search, outside pipelines
        # (which refuse offloaded activations), full with the layers' inputs in host memory last
        remats = [(remat, base.strategy.offload) for remat in ("none", "save-matmuls", "full")]
        if base.strategy.offload is not None and base.pipe == 1:
            remats.append(("full", replace(base.strategy.offload, activations=(LAYER_INPUT,))))
        for mb in accum:
            for remat, offload in remats:
                considered += 1
                cand = replace(base, remat=remat, strategy=replace(base.strategy, offload=offload,
                                                                   **{**opt, "microbatches": mb}))
                try:     # memory first: a plan that does not fit needs no step time (most of the search)
                    mem = _memory(self.model, cand, self.dtype, self.precision if self.muon is None else
                                  muon_precision(self.precision), self.lowering, self.cluster.fused_attention)
                    if mem.total <= self.capacity.plan_bytes:     # the capacity less the margin
                        return self.with_fp8(self.estimate(cand, mem)), rejected, \
                            considered + (self.fp8 is not None)
                except LayoutError as err:
                    rejected.append(Rejected(cand, str(err)))
                    break
                rejected.append(Rejected(cand, too_big(mem.total, self.capacity)))
        return None, rejected, considered

    def with_fp8(self, e: Estimate) -> Estimate:
        """The faster of ``e`` and ``e`` with FP8 (memory as without: FP8 keeps the fp32 state)."""
        if self.fp8 is None:
            return e
        fp8 = self.estimate(e.plan.with_strategy(fp8=self.fp8), e.memory, without_fp8=e.time.total)
        return fp8 if fp8.time.total < e.time.total else e

    def estimate(self, p: Plan, memory: MemoryEstimate, **more) -> Estimate:
        """The :class:`Estimate` of ``p``, a plan that fits with ``memory``: its step time and, offloaded, the
        step's time without offloading (``more``: ``without_fp8``)."""
        off = self.timed(p.with_strategy(offload=None)).total if p.strategy.offload else None
        return Estimate(p, self.timed(p), memory, True, without_offload=off, **more)

    def run(self, n: int, cs: list[int], es: list[int], methods: tuple[str, ...], schedules) -> tuple:
        """Every candidate of :func:`plan` on ``n`` devices: ``(ranked, rejected, refused, considered,
        shape reasons)``, the ranked ones not yet sorted."""
        model = self.model
        ranked, rejected, refused, considered = [], [], [], 0
        shape_reasons = []
        for p, d, f, e, c, t in mesh_factorisations(n, cs, es):
            problem = shape_problem(model, p, d, f, t, e)
            if problem:
                shape_reasons.append(problem)
                continue
            for method in methods if c > 1 else ("ring",):
                balance, why = context_problem(model, c, t, method) if c > 1 else (True, None)
                base = Plan(pipe=p, data=d, fsdp=f, tensor=t, expert=e, context=c, strategy=Strategy(
                    context=ContextParallel(method, balance), offload=self.offload))
                why = expert_problem(model, e) or why
                if why:
                    refused.append(Rejected(base, why))
                    continue
                for opt in _options(model, p, d, f, t, schedules, e):
                    best, rej, k = self.best(base, opt)
                    rejected += rej
                    considered += k
                    if best:
                        ranked.append(best)
        return ranked, rejected, refused, considered, shape_reasons


def _degrees(name: str, value, default: list[int]) -> list[int]:
    if value is None:
        return default
    if (isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")
            or not all(int_problem(v, 1) is None for v in value)):
        raise PlanError(f"{name}={value!r}: give the degrees to search as positive ints, e.g. {name}=(1, 2, 4, 8).")
    return sorted(set(value))


def _methods(value) -> tuple[str, ...]:
    if isinstance(value, str) or not value or not set(value) <= set(CONTEXT_METHODS):
        raise PlanError(f"context_methods={value!r}: choose some of {CONTEXT_METHODS}, e.g. ('ring', 'ulysses').")
    return tuple(value)


def plan(model: ModelSpec, cluster: Cluster, *, top: int = 10, dtype: str = "bfloat16", precision: str = "mixed",
         overlap: Overlap = Overlap(), memory_fraction: float | None = None, schedules=("gpipe", "1f1b", "interleaved", "zb-h1"),
         lowering: str = "ideal", contexts=None, context_methods=CONTEXT_METHODS, experts=None,
         fixed=None, fp8: bool | None = None, fp8_options: Fp8 = Fp8(), muon: dict | None = None,
         offload: bool | None = None) -> PlanResult:
    """Rank every plan of ``model`` on ``cluster`` (see the module doc).

    Args:
      model: the model.
      cluster: the cluster.
      top: how many plans the result's tables print by default; every plan that fits is ranked.
      dtype: the compute dtype.
      precision: the bytes per parameter, gradient and optimizer state: a key of
        :data:`jaxpar.cost.PRECISIONS`.
      overlap: what communication hides behind compute.
      memory_fraction: the share of each device's memory a plan may use, in (0, 1] (None: the capacity rule,
        :attr:`Cluster.capacity`). Either way a plan's predicted peak x ``1 +`` :data:`PLAN_MARGIN` must fit.
      schedules: the pipeline schedules to search.
      lowering: the program the traffic is counted for, one of :data:`jaxpar.cost._traffic.LOWERINGS`.
      contexts: the CP degrees to search (None: every divisor of the device count when ``model.seq >=``
        :data:`CONTEXT_MIN_SEQ`, else none; ``(1,)``: no CP).
      context_methods: the CP methods.
      experts: the EP degrees (None: every divisor that divides the model's experts, ``(1,)`` for a dense model).
      fixed: the run's settings no plan chooses (a codec, ``clip_norm``, ...:
        :func:`plan_setting`), with which the table checks each candidate.
      fp8: consider each plan with FP8 too (``fp8_options``) and keep the faster: ``None`` where the cluster
        has FP8 GEMMs (``peak_tflops.float8``) and the model a GEMM FP8 covers; ``False``: never; ``True``: a
        :class:`PlanError` on a cluster without FP8 GEMMs.
      fp8_options: the FP8 plans' options (:class:`jaxpar.options.Fp8`).
      muon: Muon's ``{"ns_steps", "placement"}``: each plan's update counts its Newton-Schulz
        (:func:`jaxpar.cost.with_muon`) and its memory one fp32 moment per matrix (:func:`jaxpar.cost.muon_precision`).
      offload: when no plan fits, search again with the optimizer state in host memory and the host update
        (:data:`jaxpar.cost._host_link.PROPOSED`, in jaxpar's fp32 layout; the background material's rule:
        offload "when the model does not fit one GPU"): ``None`` where the cluster models a host link and the
        optimizer's update runs in host memory (not Muon's), ``False``: never, ``True``: a :class:`PlanError`
        where it cannot.

    Returns:
      The :class:`PlanResult`.

    Raises:
      PlanError: with the reasons, when no plan is possible or none fits.
    """
    _check_request(model, cluster, dtype, memory_fraction, fixed)
    n = cluster.num_devices
    cs = _degrees("contexts", contexts, divisors(n) if model.seq >= CONTEXT_MIN_SEQ else [1])
    es = _degrees("experts", experts, [e for e in divisors(n) if model.is_moe and model.experts % e == 0] or [1])
    methods = _methods(context_methods)
    search = _Search(model, cluster, dtype, precision, overlap, lowering, _capacity(cluster, memory_fraction), fixed,
                     fp8_options if _with_fp8(model, cluster, fp8, fp8_options) else None, muon)
    ranked, rejected, refused, considered, shape_reasons = search.run(n, cs, es, methods, schedules)
    if not ranked and _with_offload(cluster, offload, muon):        # nothing fits: the state to the host
        off = search._replace(precision=OFFLOAD_PRECISION, offload=OFFLOAD_PROPOSED)   # updated there, in fp32
        ranked, more, _, k, _ = off.run(n, cs, es, methods, schedules)
        rejected, considered = rejected + more, considered + k
    if not ranked:
        _nothing(model, cluster, n, rejected, refused, shape_reasons)
    ranked.sort(key=lambda e: e.time.total)
    return PlanResult(ranked, rejected, considered, refused, top, fp8=None if fp8 is False else fp8_options)


def _check_request(model: ModelSpec, cluster: Cluster, dtype: str, memory_fraction: float | None, fixed) -> None:
    """:func:`plan`'s checks of its arguments (a :class:`PlanError` naming the fix)."""
    if not isinstance(model, ModelSpec):
        raise PlanError(f"model must be a jaxpar.cost.ModelSpec (e.g. jaxpar.cost.gpt(...)), got {type(model).__name__}.")
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction={memory_fraction!r}: must be in (0, 1], e.g. 0.75, or None for the "
                        "capacity rule (Cluster.capacity).")
    try:
        cluster.capacity
    except ClusterError as err:
        raise PlanError(str(err)) from None
    if dtype == FP8:
        raise PlanError(f"dtype={FP8!r} is not a compute dtype: the planner considers FP8 matmuls itself (fp8=); "
                        f"plan in one of {', '.join(cluster.compute_dtypes)}.")
    cluster.peak(dtype)
    try:
        plan_refusal(Plan(), dtype=dtype, fixed=fixed)
    except ValueError as err:
        raise PlanError(str(err)) from None


def _with_offload(cluster: Cluster, offload: bool | None, muon: dict | None) -> bool:
    """Whether :func:`plan` searches offloaded plans when nothing fits (see its ``offload``)."""
    if offload not in (None, True, False):
        raise PlanError(f"offload={offload!r}: None (where the cluster has a host link), True or False.")
    why = (f"cluster {cluster.name!r} models no host link (host_link_gbps, host_memory_gbps)"
           if cluster.host_link <= 0 or cluster.host_memory_bandwidth <= 0 else
           "Muon's update does not run in host memory (Offload.update='host' is refused)" if muon is not None else None)
    if offload and why:
        raise PlanError(f"offload=True: {why}; plan with offload=None or False.")
    return offload is not False and why is None


def _with_fp8(model: ModelSpec, cluster: Cluster, fp8: bool | None, options: Fp8) -> bool:
    """Whether :func:`plan` considers FP8 plans (see its ``fp8``)."""
    if fp8 not in (None, True, False):
        raise PlanError(f"fp8={fp8!r}: None (where the cluster has FP8 GEMMs), True or False.")
    if fp8 and not cluster.has_fp8:
        raise PlanError(f"fp8=True: cluster {cluster.name!r} has no FP8 GEMMs (no peak_tflops.float8); plan with "
                        "fp8=None or False, or choose a cluster with FP8 GEMMs (h100).")
    covers = bool(fp8_kernels(model, Plan(strategy=Strategy(fp8=options))))
    return fp8 is not False and cluster.has_fp8 and covers


def _nothing(model: ModelSpec, cluster: Cluster, n: int, rejected, refused, shape_reasons) -> None:
    if not rejected:
        reasons = "; ".join((sorted(set(shape_reasons)) + sorted({r.reason for r in refused}))[:6])
        raise PlanError(f"no factorisation pipe x data x fsdp x expert x context x tensor of the cluster's {n} "
                        f"devices fits the model's sizes: {reasons}. Fix: use a device count whose factors divide "
                        "the batch, heads and layers (e.g. a power of 2), or change the model / batch.")
    if all(r.reason.startswith(REFUSED_PREFIX) for r in rejected):
        first = rejected[0]
        raise PlanError(f"every plan of {n} x {cluster.name} that fits the model's sizes is refused by the "
                        f"compatibility table; the first, {first.plan.name()}: {first.reason[len(REFUSED_PREFIX):]}")
    smallest = min(rejected, key=lambda r: _needed(r.reason))
    raise PlanError(f"the model ({model.n_params / 1e9:.2f} B parameters, batch {model.batch}) fits on no plan "
                    f"of {n} x {cluster.name} ({format_bytes(cluster.memory_bytes)} each): the smallest, "
                    f"{smallest.plan.name() if smallest.plan else '-'}, {smallest.reason}. Fix: more devices "
                    f"(--devices / nodes), a smaller batch, or devices with more memory (memory offloading is searched "
                    f"where the cluster models a host link and the optimizer's update runs in host memory).")


def _needed(reason: str) -> float:
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
    parts = reason.split()
    try:
        return float(parts[1]) * units[parts[2]]
    except (IndexError, ValueError, KeyError):
        return math.inf
