"""A declarative parallelism strategy: ZeRO stage, tensor / sequence parallelism,
pipeline schedule, gradient accumulation and precision, composed on one mesh.

The mesh says *how many* devices each axis has (``data``, ``fsdp``, ``tensor``,
``pipe``); the strategy says *what to do* with them. Any product
``pipe x data x fsdp x tensor`` works. With ``pipe > 1`` the ``microbatches``
are the pipeline's micro-batches, run by the ``schedule``.

Example::

    >>> s = Strategy(zero=1, sequence_parallel=True, microbatches=2)
    >>> s.name({"data": 2, "fsdp": 1, "tensor": 4, "pipe": 1})
    'dp2-zero1-tp4-sp-accum2'
    >>> Strategy(microbatches=8, schedule="interleaved", virtual_stages=2).name({"pipe": 4, "data": 2})
    'pp4-interleaved-v2-m8-dp2'
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from jaxpar.compat._table import raise_strategy_problems
from jaxpar.errors import StrategyError, int_problem, is_number
from jaxpar.options import ZERO_STAGES, ContextParallel, Fp8, Offload
from jaxpar.parallel.pipeline._schedules import canonical_kind

__all__ = ["Strategy", "COMPUTE_DTYPES", "option_types"]

#: The compute dtypes, by name (:meth:`Strategy.cast` makes them JAX dtypes).
COMPUTE_DTYPES = ("float32", "bfloat16")
#: The positive int fields, with what each counts.
_COUNTS = {"microbatches": " (gradient accumulation steps per train step; with a pipeline, its micro-batches)",
           "virtual_stages": "", "update_every": " (backwards per stage update, schedule='pipedream')"}


@dataclass(frozen=True)
class Strategy:
    """What to do with the mesh axes.

    - ``zero``: 0 = plain data parallel over ``data``; 1 / 2 / 3 = ZeRO stages
      over ``data``. The ``fsdp`` axis always shards parameters, gradients and
      optimizer state (ZeRO-3).
    - ``sequence_parallel``: shard the norm / residual regions over ``tensor``.
    - ``microbatches``: gradient accumulation steps inside one train step.
    - ``compute_dtype``: ``'float32'`` or ``'bfloat16'`` (fp32 master weights).
    - ``extra_rules``: user rules placed *before* jaxpar's (first match wins).
    - ``schedule`` (``pipe > 1``): ``'gpipe'``, ``'1f1b'``, ``'interleaved'``, ``'zb-h1'``,
      ``'pipedream-2bw'`` or ``'pipedream'`` (weight stashing, :mod:`jaxpar.parallel.pipeline._pipedream`).
    - ``update_every`` / ``vertical_sync`` (``'pipedream'`` only): each stage updates its weights
      after every ``update_every`` of its backwards; with ``vertical_sync`` every stage runs a
      micro-batch on the version stage 0 used for it.
    - ``virtual_stages``: model chunks per pipeline stage (``interleaved`` only).
    - ``stage_layers``: layers of each virtual stage (uneven pipelines, e.g. from
      :func:`jaxpar.parallel.pipeline.partition_layers`); ``None`` splits evenly; ``'auto'``
      balances the compiled FLOPs of the layers, the embedding and the head.
    - ``compression``: a codec of :mod:`jaxpar.parallel.compression` (``qsgd()``, ``powersgd(rank=4)``,
      ...) for the gradient exchange over the data axes, once per step; ``None``: exact.
    - ``local_clip`` (with ``compression``): each replica's gradient is clipped to this global
      norm before it enters the codec (Deep Gradient Compression's local gradient clipping), so
      released error-feedback residual is not clipped away after the exchange.
    - ``sync``: how the replicas of a ``replica`` mesh axis are kept in step (:mod:`jaxpar.parallel.sync`:
      ``diloco(every=50)``, ``easgd(alpha)``, ``stale(max_delay)``, ``backup(backups)``, ...);
      ``None``: synchronous (gradients averaged over ``replica`` every step).
    - ``context``: how attention runs over a ``context`` mesh axis (context parallelism,
      :mod:`jaxpar.parallel.context`): ``jaxpar.options.ContextParallel(method="ring" | "all_gather" |
      "ulysses", balance=...)``; ``None``: ring, natural order. The ``length`` of activations is
      split over ``context`` (and their ``norm_length``, over ``context`` and, with sequence
      parallelism, ``tensor``). Needs a ``context`` axis > 1, and a model that calls
      :func:`jaxpar.attention.attention` (and, balanced, :func:`jaxpar.parallel.context.sequence_order`).
    - ``fp8``: ``jaxpar.options.Fp8(recipe="tensorwise" | "rowwise")``: the covered matmuls of the
      model's stacked layers (attention projections, MLP, experts: :func:`jaxpar.parallel.fp8_layer`)
      run in FP8 with current scaling; ``None``: in the compute dtype.
    - ``offload``: ``jaxpar.options.Offload(optimizer=..., master=..., activations=(...))``: the optimizer
      state and / or the fp32 master weights live in host memory between steps, named activations
      between the forward and the backward (:mod:`jaxpar.parallel._offload`); ``None``: all on the device.
    """

    zero: int = 0
    sequence_parallel: bool = False
    microbatches: int = 1
    compute_dtype: str = "float32"
    extra_rules: tuple = ()
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple | str | None = None
    compression: Any = None
    sync: Any = None
    update_every: int = 1
    vertical_sync: bool = False
    local_clip: float | None = None
    context: ContextParallel | None = None
    fp8: Fp8 | None = None
    offload: Offload | None = None

    def __post_init__(self):
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise StrategyError(f"Strategy.zero={self.zero!r}: choose one of {ZERO_STAGES}.")
        for key in ("sequence_parallel", "vertical_sync"):
            if not isinstance(getattr(self, key), bool):
                raise StrategyError(f"Strategy.{key}={getattr(self, key)!r}: must be True or False.")
        for key, what in _COUNTS.items():
            if int_problem(getattr(self, key), 1):
                raise StrategyError(f"Strategy.{key}={getattr(self, key)!r}: must be a positive int{what}.")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise StrategyError(f"Strategy.compute_dtype={self.compute_dtype!r}: choose one of "
                                f"{COMPUTE_DTYPES}.")
        object.__setattr__(self, "schedule", canonical_kind(self.schedule))
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise StrategyError(f"Strategy.virtual_stages={self.virtual_stages} needs schedule='interleaved' "
                                f"(got {self.schedule!r}); the other schedules run one chunk per stage.")
        if self.stage_layers is not None and self.stage_layers != "auto":
            layers = self.stage_layers
            if not isinstance(layers, str) and hasattr(layers, "__iter__"):
                layers = tuple(layers)
            if not isinstance(layers, tuple) or not all(
                    isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 for n in layers):
                raise StrategyError(f"Strategy.stage_layers={self.stage_layers!r}: give one positive int per virtual "
                                    "stage (e.g. (3, 5)), 'auto' (balance the compiled FLOPs) or None (split evenly).")
            object.__setattr__(self, "stage_layers", layers)
        if self.compression is not None:
            from jaxpar.parallel.compression import check_codec

            check_codec(self.compression)
        if self.local_clip is not None:
            if not is_number(self.local_clip) or not self.local_clip > 0:
                raise StrategyError(f"Strategy.local_clip={self.local_clip!r}: the norm each replica's gradient is "
                                    "clipped to must be a positive number, e.g. local_clip=1.0.")
        for key, cls in option_types().items():
            if (value := getattr(self, key)) is not None and not isinstance(value, cls):
                raise StrategyError(f"Strategy.{key}={value!r}: give a {cls.__name__} ({cls.TAKES}) or None.")
        if self.sync is not None:
            from jaxpar.parallel.sync import check_sync

            check_sync(self.sync)          # with a codec: refused by the table (jaxpar.compat._table), at init
        raise_strategy_problems(self)      # the table's rules of the fields alone (local_clip, update_every, ...)

    def rules(self, mesh) -> tuple:
        """Logical rules for this strategy on ``mesh`` (user rules first). With a
        ``pipe`` axis the stacked ``layers`` dimension is split over it (replicated
        when the layer count does not divide); with an ``expert`` axis the ``experts`` dimension
        of MoE weights is split over it, and the batch too. The rule ``stored_rows`` names the axes
        ZeRO splits a row-looked-up token table's ``embed`` over (:func:`jaxpar.parallel.embed_lookup`).

        Args:
          mesh: the mesh the rules map onto.

        Returns:
          The logical rules, an ordered tuple of ``(logical, mesh axis | tuple | None)`` pairs.
        """
        from jaxpar.mesh import data_axes
        from jaxpar.parallel._lookup import STORED_ROWS, TABLE_EMBED
        from jaxpar.parallel._tensor import tensor_rules
        from jaxpar.parallel._zero import zero_axes

        sizes = dict(mesh.shape)
        pipe = (("layers", "pipe"),) if sizes.get("pipe", 1) > 1 else ()
        context = ()
        if sizes.get("context", 1) > 1:     # the sequence over context; the residual stream too (and tensor with SP)
            norm = ("context", "tensor") if self.sequence_parallel and sizes.get("tensor", 1) > 1 else "context"
            context = (("length", "context"), ("norm_length", norm))
        ep = ("expert",) if sizes.get("expert", 1) > 1 else ()
        experts = (("experts", ep[0] if ep else None),)        # MoE weights' expert dimension
        stored = zero_axes(sizes, self.zero, "params") or None
        table = ((TABLE_EMBED, None), (STORED_ROWS, stored), (STORED_ROWS, None))
        return tuple(self.extra_rules) + pipe + context + experts + table + tuple(
            tensor_rules(sequence_parallel=self.sequence_parallel, batch_axes=data_axes(mesh) + ep))

    @property
    def context_setting(self) -> ContextParallel:
        """The context-parallel attention setting (ring, natural order, when ``context`` is ``None``)."""
        return self.context if self.context is not None else ContextParallel()

    def cast(self, params: Any) -> Any:
        """``params`` in the compute dtype (fp32 parameters are returned as they are).

        Args:
          params: a pytree of parameters.

        Returns:
          The same pytree, floating leaves in ``compute_dtype``.
        """
        import jax

        if self.compute_dtype == "float32":
            return params
        return jax.tree.map(lambda a: a.astype(self.compute_dtype), params)

    def name(self, mesh_sizes: Mapping[str, int]) -> str:
        """Short label such as ``'dp2-fsdp2-tp2'``.

        Args:
          mesh_sizes: mesh axis name -> size.

        Returns:
          The label.
        """
        parts = [f"r{mesh_sizes['replica']}"] if mesh_sizes.get("replica", 1) > 1 else []
        piped = mesh_sizes.get("pipe", 1) > 1
        if piped:
            parts += [f"pp{mesh_sizes['pipe']}", self.schedule]
            parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
            parts += [f"k{self.update_every}"] if self.update_every > 1 else []
            parts += ["vsync"] if self.vertical_sync else []
            parts += [f"m{self.microbatches}"]
        for axis, label in (("data", "dp"), ("fsdp", "fsdp"), ("tensor", "tp")):
            if mesh_sizes.get(axis, 1) > 1:
                parts.append(f"{label}{mesh_sizes[axis]}")
                if axis == "data" and self.zero:
                    parts.append(f"zero{self.zero}")
        if mesh_sizes.get("context", 1) > 1:
            cp = self.context_setting
            parts += [f"cp{mesh_sizes['context']}", cp.method.replace("_", "")] + (["bal"] if cp.balance else [])
        if mesh_sizes.get("expert", 1) > 1:
            parts.append(f"ep{mesh_sizes['expert']}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.microbatches > 1 and not piped:
            parts.append(f"accum{self.microbatches}")
        if self.compute_dtype != "float32":
            parts.append(self.compute_dtype)
        if self.fp8 is not None:
            parts.append(self.fp8.label)
        if self.offload is not None:
            parts.append(self.offload.label)
        if self.compression is not None:
            parts.append(self.compression.name)
        if self.local_clip is not None:
            parts.append(f"lclip{self.local_clip:g}")
        if self.sync is not None:
            parts.append(self.sync.name)
        return "-".join(parts) or "single"


@functools.cache
def option_types() -> dict[str, type]:
    """:class:`Strategy`'s option-object fields by name, with their class: each field typed ``X | None`` with ``X``
    a dataclass (``context``, ``fp8``, ``offload``). YAML's ``parallel.<name>`` is a mapping of ``X``'s fields.

    >>> option_types()
    {'context': <class 'jaxpar.options.ContextParallel'>, 'fp8': <class 'jaxpar.options.Fp8'>, \
'offload': <class 'jaxpar.options.Offload'>}
    """
    hints = typing.get_type_hints(Strategy)
    return {f.name: cls for f in dataclasses.fields(Strategy)
            for cls in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(cls)}
