"""A parallel plan (:class:`Plan`): the mesh sizes of one point of the planner's search, the
:class:`jaxpar.Strategy` that runs on them and the model's recomputation policy. Mesh order :data:`AXES`,
outermost first (docs/planning.md §10 says why).

Example::

    >>> Plan(data=8, strategy=Strategy(zero=2)).name(), Plan(data=8).devices
    ('dp8-zero2', 8)
    >>> from jaxpar.options import ContextParallel
    >>> p = Plan(data=2, expert=2, context=2, strategy=Strategy(context=ContextParallel("ulysses")))
    >>> p.name(), p.devices, p.batch_split, p.sizes["context"]
    ('dp2-cp2-ulysses-ep2', 8, 4, 2)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from jaxpar.compat._settings import FLUSH_SCHEDULES
from jaxpar.cost._memory import REMAT
from jaxpar.errors import PlanError, check_int
from jaxpar.logical import AXES as MESH_AXES, REPLICA
from jaxpar.options import LAYER_INPUT
from jaxpar.strategy import Strategy

#: The mesh axes a plan sizes, in mesh order: :data:`jaxpar.logical.AXES` without the replicas (docs/planning.md §10).
AXES = tuple(a for a in MESH_AXES if a != REPLICA)
#: The axes that split the batch's sequences (``context`` splits each sequence instead).
BATCH_AXES = ("data", "fsdp", "expert")
#: The fields of :class:`jaxpar.Strategy` the cost model reads. The table (:func:`jaxpar.cost.plan_refusal`)
#: reads the rest; the compute dtype is the one :func:`jaxpar.cost.evaluate` is given.
MODELLED = ("zero", "sequence_parallel", "microbatches", "schedule", "virtual_stages", "stage_layers", "context", "fp8",
            "offload")


@dataclass(frozen=True)
class Plan:
    """One point of the search: the mesh sizes, the ``strategy`` run on them (the fields the cost model
    reads: :data:`MODELLED`) and the model's ``remat`` policy. ``strategy.offload`` may hold the layers' inputs
    (:data:`jaxpar.options.LAYER_INPUT`) under ``remat="full"``: the model's ``"offload"`` policy moves them to
    host memory in place of keeping them (:func:`jaxpar.cost._host_link.plan_offload`)."""

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    context: int = 1
    remat: str = "none"
    strategy: Strategy = Strategy()

    def __post_init__(self):
        for a in AXES:
            check_int("Plan", a, getattr(self, a), 1, PlanError)
        if self.remat not in REMAT:
            raise PlanError(f"Plan.remat={self.remat!r}: choose one of {', '.join(REMAT)}.")
        if not isinstance(self.strategy, Strategy):
            raise PlanError(f"Plan.strategy={self.strategy!r}: give a jaxpar.Strategy(...).")
        if self.strategy.schedule not in FLUSH_SCHEDULES:        # the pipeline schedules the cost model knows
            raise PlanError(f"Plan.strategy.schedule={self.strategy.schedule!r}: the cost model knows "
                            f"{', '.join(FLUSH_SCHEDULES)}.")
        counts = self.strategy.stage_layers
        if isinstance(counts, tuple) and len(counts) != self.pipe * self.strategy.virtual_stages:
            raise PlanError(f"Plan.strategy.stage_layers={counts!r}: give pipe * virtual_stages = "
                            f"{self.pipe * self.strategy.virtual_stages} counts, one per virtual stage.")
        acts = self.strategy.offload.activations if self.strategy.offload is not None else ()
        if acts not in ((), (LAYER_INPUT,)):
            raise PlanError(f"Plan.strategy.offload.activations={acts!r}: the cost model models the layers' inputs "
                            f"alone, ({LAYER_INPUT!r},).")
        if acts and self.remat != "full":
            raise PlanError(f"Plan.strategy.offload.activations with remat={self.remat!r}: the offloaded layer "
                            "inputs are what full recomputation keeps (the model's 'offload' policy); set "
                            "remat='full'.")

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def devices(self) -> int:
        return self.pipe * self.data * self.fsdp * self.expert * self.context * self.tensor

    @property
    def batch_split(self) -> int:
        """Into how many parts the global batch's sequences are split (``data * fsdp * expert``)."""
        return self.data * self.fsdp * self.expert

    @property
    def unsplit(self) -> bool:
        """One device and one micro-batch: the step neither reduces nor accumulates its gradients."""
        return self.devices * self.strategy.microbatches == 1

    def stage_depth(self, layers: int) -> float:
        """Layers on the busiest pipeline stage, its virtual stages together: ``layers / pipe``, or the most
        ``strategy.stage_layers`` gives one stage (an uneven pipeline; ``"auto"`` is priced as the even split).

        Args:
          layers: the model's layers.

        Returns:
          The layers one stage's devices run.

        >>> Plan(pipe=4, strategy=Strategy(schedule="zb-h1", microbatches=8, stage_layers=(1, 2, 2, 1))).stage_depth(6)
        2.0
        >>> Plan(pipe=2).stage_depth(8)
        4.0
        """
        counts, p = self.strategy.stage_layers, self.pipe
        if p == 1 or not isinstance(counts, tuple):
            return layers / p
        return float(max(sum(counts[d::p]) for d in range(p)))

    def stored_layers(self, layers: int) -> int:
        """Layers of a stacked parameter one device stores: ``layers / pipe``, or all of them where ``pipe`` does
        not divide them (an uneven pipeline: ``Strategy.rules`` stores them replicated).

        Args:
          layers: the model's layers.

        Returns:
          The layers a device holds.

        >>> Plan(pipe=4).stored_layers(8), Plan(pipe=4).stored_layers(6)
        (2, 6)
        """
        return layers // self.pipe if layers % self.pipe == 0 else layers

    def with_strategy(self, **changes) -> Plan:
        """This plan with other values of some of its strategy's fields.

        Args:
          **changes: :class:`jaxpar.Strategy` fields and their new values (``plan.with_strategy(zero=1)``).

        Returns:
          The new :class:`Plan`.
        """
        return replace(self, strategy=replace(self.strategy, **changes))

    def name(self) -> str:
        """The strategy's label on these sizes (:meth:`jaxpar.Strategy.name`), plus the remat policy.

        >>> Plan(pipe=4, data=2, tensor=8, strategy=Strategy(zero=1, sequence_parallel=True, microbatches=8)).name()
        'pp4-1f1b-m8-dp2-zero1-tp8-sp'
        >>> Plan(fsdp=2, context=4, remat="full").name()
        'fsdp2-cp4-ring-remat-full'
        """
        label = self.strategy.name(self.sizes)
        if self.remat == "none":
            return label
        return ("" if label == "single" else f"{label}-") + f"remat-{self.remat}"
