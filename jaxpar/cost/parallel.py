"""A parallel plan: the mesh sizes of one point of the planner's search and what runs on them.

:class:`Plan` is the cost model's counterpart of :class:`jaxpar.Strategy` plus the mesh: how many
devices each axis has (mesh order :data:`AXES`: ``pipe, data, fsdp, tensor``, ``tensor``
innermost), the ZeRO stage, sequence parallelism, the pipeline schedule and the recomputation
policy. :mod:`jaxpar.cost.traffic`, :mod:`jaxpar.cost.time` and :mod:`jaxpar.cost.plan` read it.

Example::

    >>> Plan(data=8, zero=2).name(), Plan(data=8, zero=2).devices
    ('dp8-zero2', 8)
"""
from __future__ import annotations

from dataclasses import dataclass

from .memory import REMAT

__all__ = ["AXES", "SCHEDULES", "Plan"]

#: The mesh axes in mesh order (``tensor`` innermost).
AXES = ("pipe", "data", "fsdp", "tensor")
#: The pipeline schedules the cost model knows.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Plan:
    """One point of the search: mesh sizes and what to do with them (as :class:`jaxpar.Strategy`)."""

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

    def __post_init__(self):
        for a in AXES + ("virtual", "microbatches"):
            v = getattr(self, a)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Plan.{a}={v!r}: must be a positive int.")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Plan.zero={self.zero!r}: choose 0, 1, 2 or 3.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}.")
        if self.remat not in REMAT:
            raise ValueError(f"Plan.remat={self.remat!r}: choose one of {', '.join(REMAT)}.")

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def devices(self) -> int:
        return self.pipe * self.data * self.fsdp * self.tensor

    def name(self) -> str:
        """Short label in :meth:`jaxpar.Strategy.name`'s style, plus the remat policy.

        >>> Plan(pipe=4, data=2, tensor=8, zero=1, sequence_parallel=True, microbatches=8).name()
        'pp4-1f1b-m8-dp2-zero1-tp8-sp'
        """
        parts = []
        if self.pipe > 1:
            parts += [f"pp{self.pipe}", self.schedule] + ([f"v{self.virtual}"] if self.virtual > 1 else [])
            parts += [f"m{self.microbatches}"]
        for axis, label in (("data", "dp"), ("fsdp", "fsdp"), ("tensor", "tp")):
            if getattr(self, axis) > 1:
                parts.append(f"{label}{getattr(self, axis)}")
                if axis == "data" and self.zero:
                    parts.append(f"zero{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.microbatches > 1 and self.pipe == 1:
            parts.append(f"accum{self.microbatches}")
        if self.remat != "none":
            parts.append(f"remat-{self.remat}")
        return "-".join(parts) or "single"
