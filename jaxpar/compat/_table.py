"""The one table of what combines: every pair of features either composes or is refused here.

A :class:`Setting` is what a run asks for (the strategy, the mesh sizes, the step's and the
loop's options). :func:`problems` runs the rules of :mod:`jaxpar.compat._settings` and returns the
:class:`Problem`\\ s of a setting: each names the two features, the fields and the values, says what
to do, and carries the :class:`~jaxpar.errors.JaxparError` subclass it is raised as. :func:`needs`
does the same for what one feature needs on its own (:mod:`jaxpar.compat._needs`). The library
raises them (:func:`raise_problems`, once from ``init_train_state`` and once from ``make_train_step``;
:class:`~jaxpar.Strategy` raises the rules of its own fields, :func:`raise_strategy_problems`, and
:func:`~jaxpar.parallel.compression.exchange_plan` those of a codec, :func:`codec_problems`); the config
layer (:func:`jaxpar.config.check`) renders the same problems with YAML keys instead of parameter
names; ``docs/strategies.md``'s table is generated from :data:`FEATURES` and :func:`pair_status`
(:mod:`jaxpar.compat._markdown`).

Example:
    >>> from jaxpar import Strategy
    >>> from jaxpar.parallel.compression import topk
    >>> s = Setting(Strategy(schedule="pipedream", microbatches=4, compression=topk(0.01)), {"pipe": 2, "data": 4})
    >>> [p.features for p in problems(s)]
    [('ST', 'CP')]
    >>> print(problems(s)[0].render(LIBRARY_NAMES))     # doctest: +ELLIPSIS
    Strategy.compression='topk...' with schedule='pipedream': each stage updates inside the pipeline...
    >>> problems(s)[0].error.__name__
    'StashingError'
    >>> pair_status("PP", "NS")
    'composes'
"""
from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

from jaxpar.compat._needs import NEEDS, codec_needs, strategy_needs
from jaxpar.compat._offload_rules import offload_problems
from jaxpar.compat._settings import (FLUSH_SCHEDULES, RULES, Problem, Setting, pipeline_schedule, replicas_on,
                                     sharded_moment_problems)
from jaxpar.errors import CompatError


class Feature(NamedTuple):
    """A feature of the table: its code, what it is, and whether a :class:`Setting` uses it."""

    code: str
    name: str
    on: Callable[[Setting], bool]


FEATURES: tuple[Feature, ...] = (
    Feature("Z", "ZeRO-1/2/3 and the fsdp axis", lambda s: s.strategy.zero > 0 or s.size("fsdp") > 1),
    Feature("TP", "tensor parallelism (tensor axis)", lambda s: s.size("tensor") > 1),
    Feature("SP", "sequence parallelism", lambda s: s.strategy.sequence_parallel),
    Feature("MB", "gradient accumulation (microbatches, pipe = 1)",
            lambda s: s.strategy.microbatches > 1 and s.size("pipe") == 1),
    Feature("BF", "bf16 compute, fp32 master weights", lambda s: s.strategy.compute_dtype == "bfloat16"),
    Feature("RM", "the model's remat policy", lambda s: False),
    Feature("EX", "explicit per-layer data-parallel collectives (explicit_dp=True)", lambda s: bool(s.explicit_dp)),
    Feature("PP", "flush pipelines (gpipe, 1f1b, interleaved, zb-h1)",
            lambda s: pipeline_schedule(s) in FLUSH_SCHEDULES),
    Feature("2B", "PipeDream-2BW", lambda s: pipeline_schedule(s) == "pipedream-2bw"),
    Feature("ST", "PipeDream weight stashing", lambda s: s.strategy.schedule == "pipedream"),
    Feature("K", "several optimizer steps per call (steps_per_call > 1)", lambda s: s.steps_per_call != 1),
    Feature("CP", "gradient compression (a codec)", lambda s: s.strategy.compression is not None),
    Feature("LC", "local clipping before the codec (local_clip)", lambda s: s.strategy.local_clip is not None),
    Feature("RS", "relaxed synchronisation (replica axis, sync)", replicas_on),
    Feature("CN", "global-norm clipping (clip_norm)", lambda s: s.clip_norm is not None),
    Feature("SN", "skipping non-finite steps (skip_nonfinite)", lambda s: False),
    Feature("NS", "the gradient noise scale (noise_scale_every)", lambda s: s.noise_scale_every is not None),
    Feature("BR", "batch ramps (fixed and adaptive)", lambda s: s.ramp is not None),
    Feature("LL", "LARS / LAMB (and optimizers across layers)", lambda s: s.optimizer_across_stages),
    Feature("1A", "1-bit Adam (a codec on Adam's first moment)",
            lambda s: bool(getattr(s.strategy.compression, "optimizer_momentum", 0.0))),
    Feature("CK", "checkpoint restore and reshard", lambda s: False),
    Feature("MP", "several processes (jax.distributed)", lambda s: False),
    Feature("CX", "context parallelism (context axis)", lambda s: s.size("context") > 1),
    Feature("EP", "expert parallelism (expert axis)", lambda s: s.size("expert") > 1),
    Feature("RB", "aux-loss-free router balancing (a router bias in the state: with_router_bias)",
            lambda s: s.router_bias_rate is not None),
    Feature("F8", "FP8 matmuls (Strategy.fp8)", lambda s: s.strategy.fp8 is not None),
    Feature("MU", "Muon on the matrices, AdamW on the rest (jaxpar.optimizers.muon)", lambda s: s.muon is not None),
    Feature("OF", "memory offloading to the host (Strategy.offload)",
            lambda s: s.strategy.offload is not None),
)
CODES = tuple(f.code for f in FEATURES)
_FEATURE = {f.code: f for f in FEATURES}

#: How the library names the fields a problem mentions (the config layer has its YAML keys).
LIBRARY_NAMES = {
    "zero": "Strategy.zero", "sequence_parallel": "Strategy.sequence_parallel", "schedule": "schedule",
    "compression": "Strategy.compression", "sync": "Strategy.sync", "local_clip": "Strategy.local_clip",
    "microbatches": "Strategy.microbatches", "update_every": "Strategy.update_every",
    "vertical_sync": "vertical_sync",
    "compute_dtype": "Strategy.compute_dtype", "explicit_dp": "explicit_dp", "steps_per_call": "steps_per_call",
    "clip_norm": "clip_norm", "noise_scale_every": "noise_scale_every", "optimizer": "the optimizer (tx)",
    "pipe": "pipe", "pipe_axis": "a 'pipe' mesh axis", "replica": "replica",
    "replica_axis": "a 'replica' mesh axis", "data": "data", "fsdp": "fsdp",
    "tensor": "tensor", "context": "context", "expert": "expert",
    "ramp": "the batch ramp", "ramp_steps": "the batch ramp's steps",
    "steps": "steps", "start": "the start step", "log_every": "log_every", "eval_every": "eval_every",
    "checkpoint_every": "the checkpointer's every", "stop_check_every": "stop_check_every",
    "router_bias_rate": "with_router_bias(rate)", "aux_weight": "MoESettings.aux_weight",
    "fp8": "Strategy.fp8", "offload": "Strategy.offload", "true": "True", "false": "False", "none": "None",
}


#: Features that are a part of another: a refusal of the whole (``CP``, a codec) is also a
#: refusal of each part that is on, reported as its own pair: ``{part: (whole, what it says)}``.
IMPLIES = {
    "LC": ("CP", "{n[local_clip]}={lc} clips each replica's gradient before the codec, so: "),
    "1A": ("CP", "1-bit Adam ({n[compression]} with optimizer_momentum={b1}) is a codec, so: "),
}


def _parts_of(s: Setting, found: list[Problem]) -> list[Problem]:
    """The problems of :data:`IMPLIES`' parts: each problem of a whole, once per part that is on."""
    out = []
    values = {"lc": s.strategy.local_clip, "b1": getattr(s.strategy.compression, "optimizer_momentum", 0.0)}
    for p in found:
        for part, (whole, says) in IMPLIES.items():
            if whole in p.features and _FEATURE[part].on(s):
                features = tuple(part if f == whole else f for f in p.features)
                out.append(p._replace(features=features, template=says + p.template,
                                      values={**p.values, **values}))
    return out


def problems(setting: Setting) -> list[Problem]:
    """Every refused combination in ``setting``.

    Args:
      setting: what the run asks for.

    Returns:
      The :class:`Problem`\\ s, in the table's order (empty: every pair composes); a refusal of a
      codec is repeated for each of its parts that is on (:data:`IMPLIES`).
    """
    found = [p for rule in RULES + (offload_problems,) for p in rule(setting)]
    return found + _parts_of(setting, found)


def needs(setting: Setting) -> list[Problem]:
    """What a feature of ``setting`` needs and does not get (:data:`jaxpar.compat._needs.NEEDS`).

    Args:
      setting: what the run asks for.

    Returns:
      The :class:`Problem`\\ s of one feature each (``features`` holds one code), in the rules' order.
    """
    return [p for rule in NEEDS for p in rule(setting)]


def raise_problems(setting: Setting) -> None:
    """Raise the first problem of ``setting`` (a refused pair, then a feature's own need), as its
    :attr:`Problem.error` class with the library's names (:data:`LIBRARY_NAMES`).

    Args:
      setting: what the run asks for.

    Raises:
      JaxparError: the subclass the problem declares (``SyncError``, ``StashingError``, ...).
    """
    raise_first(problems(setting) + needs(setting))


def raise_first(found: list[Problem]) -> None:
    """Raise the first of ``found`` as its :attr:`Problem.error` class with the library's names.

    Args:
      found: problems, in the table's order (empty: nothing is raised).

    Raises:
      JaxparError: the subclass the first problem declares.
    """
    if found:
        raise found[0].error(found[0].render(LIBRARY_NAMES))


def raise_strategy_problems(strategy) -> None:
    """Raise the first rule of the table that reads the strategy's own fields alone
    (:func:`jaxpar.compat._needs.strategy_needs`): :class:`~jaxpar.Strategy` raises it when built.

    Args:
      strategy: the strategy.

    Raises:
      StrategyError: ``local_clip`` without a codec; ``update_every`` / ``vertical_sync`` without weight stashing.
    """
    raise_first(strategy_needs(Setting(strategy, {})))


def codec_problems(codec, sizes, zero: int = 0) -> list[Problem]:
    """The table's rules of a codec on a mesh, for a caller that holds no strategy
    (:func:`~jaxpar.parallel.compression.exchange_plan`): 1-bit Adam with sharded gradients (Z x 1A),
    then a data axis to exchange over (CP's need).

    Args:
      codec: the codec.
      sizes: the mesh axis sizes.
      zero: the ZeRO stage the gradients are sharded for.

    Returns:
      The :class:`Problem`\\ s, in the table's order (pairs, then needs).
    """
    return sharded_moment_problems(codec, zero, sizes) + codec_needs(codec, sizes)


#: The pairs refused whatever the values: ``{(code, code): why}``. Every other pair composes,
#: and a test compares it with its reference (``tests/test_combinations.py``).
REFUSED = {
    ("SP", "2B"): "the no-flush program runs a different action per stage: SP's collectives would hang",
    ("SP", "ST"): "as SP x 2B",
    ("EX", "PP"): "a stage's layers run inside the executor", ("EX", "2B"): "as EX x PP",
    ("EX", "ST"): "as EX x PP", ("EX", "CP"): "the codec's exchange is explicit already",
    ("EX", "RS"): "the per-layer shard_map does not lower under the replicas' vmap",
    ("EX", "1A"): "as EX x CP", ("EX", "LC"): "as EX x CP",
    ("PP", "RS"): "pipelined replicas",
    ("2B", "CP"): "the delayed gradient runs through the plain pipelined step", ("2B", "RS"): "as 2B x CP",
    ("2B", "LC"): "as 2B x CP", ("2B", "1A"): "as 2B x CP", ("2B", "NS"): "gradients at older weights",
    ("ST", "CP"): "stages update inside the pipeline", ("ST", "RS"): "as ST x CP", ("ST", "LC"): "as ST x CP",
    ("ST", "1A"): "as ST x CP", ("ST", "CN"): "each stage updates alone", ("ST", "NS"): "gradients at older weights",
    ("K", "RS"): "relaxed synchronisation picks its programs on the host, step by step",
    ("K", "NS"): "the measuring program is chosen on the host, step by step",
    ("CP", "RS"): "relaxed synchronisation does not run through a codec", ("LC", "RS"): "as CP x RS",
    ("RS", "1A"): "as CP x RS", ("RS", "NS"): "replicas have their own parameters",
    ("1A", "CN"): "clip before the codec",
    ("SP", "RS"): "the sequence-parallel shard_map does not lower under the replicas' vmap",
    ("2B", "CX"): "context parallelism runs in flush pipelines only", ("ST", "CX"): "as 2B x CX",
    ("EX", "CX"): "context-parallel attention inside the per-layer shard_map", ("CP", "CX"): "the codec's "
    "exchange reduces over the data axes only", ("LC", "CX"): "as CP x CX", ("1A", "CX"): "as CP x CX",
    ("RS", "CX"): "as CP x CX", ("NS", "CX"): "as CP x CX",
    ("2B", "EP"): "each micro-batch on its own weight version: no whole-step load for the balancing loss",
    ("ST", "EP"): "as 2B x EP", ("EX", "EP"): "one activation per layer, reduced over "
    "the data axes only", ("CP", "EP"): "the codec's exchange reduces over the data axes only", ("LC", "EP"): "as "
    "CP x EP", ("1A", "EP"): "as CP x EP", ("RS", "EP"): "as CP x EP", ("NS", "EP"): "as CP x EP",
    ("EX", "RB"): "as EX x EP: the bias and the loads go from layer to layer beside the activation",
    ("2B", "RB"): "no flush: a step's micro-batches run before the last step's loads, which move the bias, are known",
    ("ST", "RB"): "no flush, and stages update alone: the loads are of no one step", ("RS", "RB"): "replicas on "
    "weights of their own or delayed ones: the loads are of no one step",
    ("RS", "OF"): "the replicas' parameters and moments live in TrainState.sync, in programs of their own",
}

#: Pairs where some values compose and others are refused: ``{(code, code): (composes, refused)}``.
PARTLY = {
    ("Z", "1A"): ("ZeRO-1", "ZeRO-2/3 and fsdp: 1-bit Adam needs the whole exchanged moment on every replica"),
    ("ST", "LL"): ("LARS / LAMB with per-layer trust ratios (the logical mask)",
                   "optimizers that are not per stage (a global norm, clip_by_global_norm)"),
    ("BR", "K"): ("fixed ramps whose steps are multiples of K", "adaptive ramps, and a ramp step inside a call"),
    ("EX", "F8"): ("tensorwise (one scale per tensor, its maximum reduced over the data axes)",
                   "rowwise (Fp8Error: a weight gradient's row scales would be each device's tokens'; explicit_dp=None "
                   "runs XLA's collectives for it)"),
    ("ST", "MU"): ("stages whose Muon matrices no other axis splits (pipe x data, ZeRO-0/1/2)",
                   "matrices split over tensor / fsdp / ZeRO-3 inside a stage (StashingError: Newton-Schulz's "
                   "collectives would run in each stage's own update)"),
    ("PP", "OF"): ("the optimizer state and the master weights in host memory",
                   "offloaded activations (OffloadError: the pipeline keeps the residuals in one device buffer)"),
    ("2B", "OF"): ("as PP x OF", "as PP x OF"), ("ST", "OF"): ("as PP x OF", "as PP x OF"),
}

#: Pairs that are alternatives, never both on: one schedule at a time, a pipeline's micro-batches
#: are its schedule's (not gradient accumulation), and one optimizer at a time.
ALTERNATIVES = {("PP", "2B"), ("PP", "ST"), ("2B", "ST"), ("MB", "PP"), ("MB", "2B"), ("MB", "ST"),
                ("LL", "MU"), ("1A", "MU")}


def pair_status(a: str, b: str) -> str:
    """The status of the pair of feature codes ``a``, ``b`` in the table.

    Args:
      a: a feature code of :data:`FEATURES`.
      b: another.

    Returns:
      ``'composes'``, ``'refused'`` (:data:`REFUSED`), ``'partly'`` (:data:`PARTLY`: some values
      refused) or ``'alternatives'`` (:data:`ALTERNATIVES`: never both on).
    """
    for code in (a, b):
        if code not in CODES:
            raise CompatError(f"pair_status: unknown feature {code!r}; the features are {CODES}.")
    for status, table in (("refused", REFUSED), ("partly", PARTLY), ("alternatives", ALTERNATIVES)):
        if (a, b) in table or (b, a) in table:
            return status
    return "composes"


def all_pairs() -> list[tuple[str, str]]:
    """Every pair of feature codes, in the table's order."""
    return list(itertools.combinations(CODES, 2))
