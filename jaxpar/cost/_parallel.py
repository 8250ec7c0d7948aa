"""A parallel plan (:class:`Plan`): the mesh sizes of one point of the planner's search and what runs
on them, the cost model's counterpart of :class:`jaxpar.Strategy` plus the mesh. Mesh order
:data:`AXES`, outermost first (docs/planning.md §10 says why).

Example::

    >>> Plan(data=8, zero=2).name(), Plan(data=8, zero=2).devices
    ('dp8-zero2', 8)
    >>> p = Plan(data=2, expert=2, context=2, context_method="ulysses")
    >>> p.name(), p.devices, p.batch_split, p.sizes["context"]
    ('dp2-ep2-cp2-ulysses', 8, 4, 2)
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxpar.compat._settings import FLUSH_SCHEDULES
from jaxpar.cost._memory import REMAT
from jaxpar.errors import PlanError, check_int
from jaxpar.options import CONTEXT_METHODS, LAYER_INPUT, Fp8, Offload

#: The mesh axes in mesh order (outermost first, ``tensor`` innermost; docs/planning.md §10).
AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
#: The axes that split the batch's sequences (``context`` splits each sequence instead).
BATCH_AXES = ("data", "fsdp", "expert")


@dataclass(frozen=True)
class Plan:
    """One point of the search: mesh sizes and what to do with them (as :class:`jaxpar.Strategy`);
    ``fp8``: the FP8 options of the covered matmuls (:class:`jaxpar.options.Fp8`; None: none); ``offload``:
    what lives in host memory (:class:`jaxpar.options.Offload`: the state, and under ``remat="full"`` the
    layers' inputs, :data:`jaxpar.options.LAYER_INPUT`, which the model's ``"offload"`` policy moves there in
    place of keeping them: :func:`jaxpar.cost._host_link.plan_offload`; None: nothing)."""

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    remat: str = "none"
    expert: int = 1
    context: int = 1
    context_method: str = "ring"
    context_balance: bool = True
    fp8: Fp8 | None = None
    offload: Offload | None = None

    def __post_init__(self):
        for a in AXES + ("virtual", "microbatches"):
            check_int("Plan", a, getattr(self, a), 1, PlanError)
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Plan.zero={self.zero!r}: choose 0, 1, 2 or 3.")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"Plan.sequence_parallel={self.sequence_parallel!r}: must be True or False.")
        if self.schedule not in FLUSH_SCHEDULES:        # the pipeline schedules the cost model knows
            raise PlanError(f"Plan.schedule={self.schedule!r}: choose one of {', '.join(FLUSH_SCHEDULES)}.")
        if self.remat not in REMAT:
            raise PlanError(f"Plan.remat={self.remat!r}: choose one of {', '.join(REMAT)}.")
        if self.context_method not in CONTEXT_METHODS:
            raise PlanError(f"Plan.context_method={self.context_method!r}: choose one of "
                            f"{', '.join(CONTEXT_METHODS)}.")
        if not isinstance(self.context_balance, bool):
            raise PlanError(f"Plan.context_balance={self.context_balance!r}: must be True or False.")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8):
            raise PlanError(f"Plan.fp8={self.fp8!r}: give jaxpar.options.Fp8(...) or None (no FP8).")
        if self.offload is not None and not isinstance(self.offload, Offload):
            raise PlanError(f"Plan.offload={self.offload!r}: give jaxpar.options.Offload(...) or None.")
        if self.offload is not None and self.offload.activations not in ((), (LAYER_INPUT,)):
            raise PlanError(f"Plan.offload.activations={self.offload.activations!r}: the cost model models the "
                            f"layers' inputs alone, ({LAYER_INPUT!r},).")
        if self.offload is not None and self.offload.activations and self.remat != "full":
            raise PlanError(f"Plan.offload.activations with remat={self.remat!r}: the offloaded layer inputs are "
                            "what full recomputation keeps (the model's 'offload' policy); set remat='full'.")

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

    def name(self) -> str:
        """Short label in :meth:`jaxpar.Strategy.name`'s style, plus the remat policy.

        >>> Plan(pipe=4, data=2, tensor=8, zero=1, sequence_parallel=True, microbatches=8).name()
        'pp4-1f1b-m8-dp2-zero1-tp8-sp'
        >>> Plan(fsdp=2, context=4, context_balance=False).name(), Plan(fsdp=8, fp8=Fp8()).name()
        ('fsdp2-cp4-ring-natural', 'fsdp8-fp8')
        """
        parts = []
        if self.pipe > 1:
            parts += [f"pp{self.pipe}", self.schedule] + ([f"v{self.virtual}"] if self.virtual > 1 else [])
            parts += [f"m{self.microbatches}"]
        for axis, label in (("data", "dp"), ("fsdp", "fsdp"), ("expert", "ep"), ("context", "cp"), ("tensor", "tp")):
            if getattr(self, axis) > 1:
                parts.append(f"{label}{getattr(self, axis)}")
                if axis == "data" and self.zero:
                    parts.append(f"zero{self.zero}")
                if axis == "context":
                    parts += [self.context_method] + ([] if self.context_balance else ["natural"])
        if self.sequence_parallel:
            parts.append("sp")
        if self.microbatches > 1 and self.pipe == 1:
            parts.append(f"accum{self.microbatches}")
        if self.remat != "none":
            parts.append(f"remat-{self.remat}")
        if self.fp8:
            parts.append(self.fp8.label)
        if self.offload:
            parts.append(self.offload.label)
        return "-".join(parts) or "single"
