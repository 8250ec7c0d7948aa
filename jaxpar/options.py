"""The strategy's options that are plain values, without JAX: context parallelism (:class:`ContextParallel`),
FP8 (:class:`Fp8`) and memory offloading (:class:`Offload`). :class:`jaxpar.Strategy` holds them, the cost
model's :class:`jaxpar.cost.Plan` holds the same FP8 and offload objects, and the YAML sections
``parallel.context``, ``parallel.fp8`` and ``parallel.offload`` build them; their defaults and allowed values
are written here only.

Example::

    >>> Fp8().label, Fp8(recipe="rowwise", min_dim=0).label
    ('fp8', 'fp8-rowwise')
    >>> o = Offload(optimizer=True, activations=("jaxpar_layer_input",))
    >>> o.fields, o.label
    (('opt_state',), 'offload-opt-act')
    >>> Offload(activations="mlp")
    Traceback (most recent call last):
    ...
    jaxpar.errors.OffloadError: Offload.activations='mlp': give a tuple of checkpoint_name names, e.g. ('jaxpar_layer_input',).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.errors import ContextParallelError, Fp8Error, OffloadError, int_problem

__all__ = ["ContextParallel", "Fp8", "Offload", "CONTEXT_METHODS", "LAYER_INPUT", "RECIPES", "UPDATES", "ZERO_STAGES"]

#: The ZeRO stages of ``Strategy.zero`` (0: plain data parallelism).
ZERO_STAGES = (0, 1, 2, 3)
#: The context-parallel attention methods, by name (the first is the default).
CONTEXT_METHODS = ("ring", "all_gather", "ulysses")
#: The FP8 scaling recipes (the first is the default): one scale per tensor, or one per row of each GEMM operand.
RECIPES = ("tensorwise", "rowwise")
#: Where the optimizer update runs (``Offload.update``; the first is the default).
UPDATES = ("device", "host")
#: The ``checkpoint_name`` of each layer's input under the ``"offload"`` remat policy (what a scan over the
#: layers keeps per layer; :func:`jaxpar.adapters.with_remat` names it): the activation the cost model models.
LAYER_INPUT = "jaxpar_layer_input"


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel attention setting.

    Attributes:
      method: ``"ring"`` (K/V blocks passed around the ``context`` axis with ``ppermute``, online
        softmax), ``"all_gather"`` (K/V gathered over ``context``) or ``"ulysses"`` (all-to-all of
        heads and sequence).
      balance: whether the sequence is in the balanced zig-zag order of
        :func:`jaxpar.parallel.context.balanced_order` (device ``i`` holds chunks ``i`` and ``2C-1-i`` of
        ``2C``), which evens out the causal work of the ring and the all-gather methods.

    >>> ContextParallel(method="rings")
    Traceback (most recent call last):
    ...
    jaxpar.errors.ContextParallelError: ContextParallel.method='rings' is not a context-parallel \
method; choose one of ('ring', 'all_gather', 'ulysses').
    """

    method: str = "ring"
    balance: bool = False
    #: What it takes, as errors name it (``parallel.context has unknown keys [...]; it takes ...``).
    TAKES = f"method ({' | '.join(CONTEXT_METHODS)}) and balance (true | false)"

    def __post_init__(self):
        if self.method not in CONTEXT_METHODS:
            raise ContextParallelError(f"ContextParallel.method={self.method!r} is not a context-parallel method; "
                                       f"choose one of {CONTEXT_METHODS}.")
        if not isinstance(self.balance, bool):
            raise ContextParallelError(f"ContextParallel.balance={self.balance!r} must be True or False.")


@dataclass(frozen=True)
class Fp8:
    """FP8 training of the covered matmuls (:func:`jaxpar.parallel.fp8_layer`'s options).

    - ``recipe``: ``"tensorwise"`` (one scale per operand) or ``"rowwise"`` (one per row: per
      index of the operand's dimensions that the GEMM does not contract), both current scaling
      (the scale comes from this step's absolute maximum);
    - ``min_dim``: a GEMM whose contracted or output size is below it stays in the compute dtype
      (FP8 gains nothing on small GEMMs).
    """

    recipe: str = "tensorwise"
    min_dim: int = 1024
    TAKES = f"recipe ({' | '.join(RECIPES)}) and min_dim (an int: smaller GEMMs stay in the compute dtype)"

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise Fp8Error(f"Fp8.recipe={self.recipe!r}: the recipes are {', '.join(RECIPES)}. A delayed "
                           "recipe (scales from an amax history) is not built; use tensorwise or rowwise.")
        if why := int_problem(self.min_dim, 0):
            raise Fp8Error(f"Fp8.min_dim={self.min_dim!r}: {why} (0: every covered GEMM in FP8).")

    @property
    def label(self) -> str:
        """The part of a strategy's or a plan's name: ``fp8``, or ``fp8-<recipe>`` for another recipe than the
        default."""
        return "fp8" if self.recipe == RECIPES[0] else f"fp8-{self.recipe}"


@dataclass(frozen=True)
class Offload:
    """What lives in host memory (``Strategy.offload``).

    - ``optimizer``: the optimizer state (Adam's moments, counts) between steps;
    - ``master``: the parameters between steps. jaxpar keeps one copy of the parameters, the fp32 master
      (a bf16 ``compute_dtype`` casts it inside the step), so this is that copy: it is streamed to the
      device at the start of the step, the compute copy is cast there, and the update writes it back;
    - ``activations``: ``checkpoint_name`` names of residuals moved to host memory after the forward and
      back for the backward, under a model whose remat policy is ``"offload"``
      (:data:`LAYER_INPUT`: each layer's input, what a scan over the layers keeps);
    - ``update``: where the optimizer update runs: ``"device"`` (default: the offloaded state is streamed to
      the device and updated there, with every optimizer and schedule, bit for bit the run without
      offload) or ``"host"`` (ZeRO-Offload's design, with ``optimizer=True``: the gradients go to host
      memory and the update runs there, on the state where it lives,
      :func:`jaxpar.parallel._offload.host_placement`, so the device never holds the optimizer state;
      docs/strategies.md says what it saves and what it costs).
    """

    optimizer: bool = False
    master: bool = False
    activations: tuple[str, ...] = ()
    update: str = "device"
    TAKES = (f"optimizer (true | false), master (true | false), update ({' | '.join(UPDATES)}: where the optimizer "
             "update runs) and activations (a list of checkpoint names, with model.remat: offload)")

    def __post_init__(self):
        for key in ("optimizer", "master"):
            if not isinstance(getattr(self, key), bool):
                raise OffloadError(f"Offload.{key}={getattr(self, key)!r}: must be True or False.")
        names = self.activations
        if isinstance(names, str) or not isinstance(names, (tuple, list)) or \
                not all(isinstance(n, str) and n for n in names):
            raise OffloadError(f"Offload.activations={names!r}: give a tuple of checkpoint_name names, e.g. "
                               "('jaxpar_layer_input',).")
        object.__setattr__(self, "activations", tuple(names))
        if self.update not in UPDATES:
            raise OffloadError(f"Offload.update={self.update!r}: must be 'device' (the state is streamed to the device "
                               "and updated there) or 'host' (the update runs in host memory, where the state lives).")
        if self.host_update and not self.optimizer:
            raise OffloadError("Offload.update='host' with optimizer=False: the host update reads the optimizer state "
                               "where it lives, in host memory. Set optimizer=True, or update='device'.")
        if not (self.optimizer or self.master or self.activations):
            raise OffloadError("Offload() offloads nothing: set optimizer=True, master=True or activations=(...), "
                               "or leave Strategy.offload=None.")

    @property
    def fields(self) -> tuple[str, ...]:
        """The :class:`~jaxpar.step.TrainState` fields that live in host memory between steps."""
        return ("opt_state",) * self.optimizer + ("params",) * self.master

    @property
    def streamed(self) -> tuple[str, ...]:
        """The offloaded fields a step copies to device memory first: every one under a device update, the
        parameters alone (the forward's) under a host update."""
        return tuple(f for f in self.fields if f == "params") if self.host_update else self.fields

    @property
    def host_update(self) -> bool:
        """Whether the optimizer update runs in host memory (``update="host"``)."""
        return self.update == "host"

    @property
    def label(self) -> str:
        """The part of a strategy's name (``offload-opt-master-act``, ``-host`` with the host update)."""
        return "-".join(["offload"] + ["opt"] * self.optimizer + ["master"] * self.master
                        + ["act"] * bool(self.activations) + ["host"] * self.host_update)
