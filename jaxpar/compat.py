"""The one table of what combines: every pair of features either composes or is refused here.

A :class:`Setting` is what a run asks for (the strategy, the mesh sizes, the step's and the
loop's options). :func:`problems` returns the :class:`Problem`\\ s of a setting: each names the
two features, the fields and the values, and says what to do. The library raises them
(:func:`raise_problems`, from ``init_train_state`` and ``make_train_step``); the config layer
(:func:`jaxpar.config.check`) renders the same problems with YAML keys instead of parameter
names; ``docs/strategies.md``'s table is generated from :data:`FEATURES` and :func:`pair_status`
(:mod:`jaxpar.compat_docs`).

Example:
    >>> from jaxpar import Strategy
    >>> from jaxpar.compression import topk
    >>> s = Setting(Strategy(schedule="pipedream", microbatches=4, compression=topk(0.01)), {"pipe": 2, "data": 4})
    >>> [p.features for p in problems(s)]
    [('ST', 'CP')]
    >>> print(problems(s)[0].render(LIBRARY_NAMES))     # doctest: +ELLIPSIS
    Strategy.compression='topk...' with schedule='pipedream': each stage updates inside the pipeline...
    >>> pair_status("PP", "NS")
    'composes'
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, NamedTuple

__all__ = ["Feature", "FEATURES", "CODES", "Setting", "Problem", "problems", "raise_problems", "pair_status",
           "REFUSED", "PARTLY", "ALTERNATIVES", "LIBRARY_NAMES", "all_pairs"]


class Setting(NamedTuple):
    """What a run asks for: everything the compatibility table reads.

    Attributes:
      strategy: the :class:`~jaxpar.Strategy`.
      sizes: the mesh axis sizes.
      explicit_dp: ``make_train_step(explicit_dp=...)``.
      steps_per_call: optimizer steps per call.
      clip_norm: ``make_train_step(clip_norm=...)``.
      noise_scale_every: ``make_train_step(noise_scale_every=...)``.
      ramp: ``None``, ``"fixed"`` or ``"adaptive"`` (the loop's batch ramp), with ``ramp_steps``.
      ramp_steps: the steps at which a fixed ramp changes the batch size.
    """

    strategy: Any
    sizes: Mapping[str, int]
    explicit_dp: bool | None = None
    steps_per_call: int = 1
    clip_norm: float | None = None
    noise_scale_every: int | None = None
    ramp: str | None = None
    ramp_steps: tuple = ()

    def size(self, axis: str) -> int:
        """The size of mesh axis ``axis`` (1 when absent)."""
        return dict(self.sizes).get(axis, 1)


class Feature(NamedTuple):
    """A feature of the table: its code, what it is, and whether a :class:`Setting` uses it."""

    code: str
    name: str
    on: Callable[[Setting], bool]


def _schedule(s: Setting) -> str:
    return s.strategy.schedule if s.size("pipe") > 1 else "none"


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
            lambda s: _schedule(s) in ("gpipe", "1f1b", "interleaved", "zb-h1")),
    Feature("2B", "PipeDream-2BW", lambda s: _schedule(s) == "pipedream-2bw"),
    Feature("ST", "PipeDream weight stashing", lambda s: s.strategy.schedule == "pipedream"),
    Feature("K", "several optimizer steps per call (steps_per_call > 1)", lambda s: s.steps_per_call != 1),
    Feature("CP", "gradient compression (a codec)", lambda s: s.strategy.compression is not None),
    Feature("LC", "local clipping before the codec (local_clip)", lambda s: s.strategy.local_clip is not None),
    Feature("RS", "relaxed synchronisation (replica axis, sync)",
            lambda s: s.strategy.sync is not None or s.size("replica") > 1),
    Feature("CN", "global-norm clipping (clip_norm)", lambda s: s.clip_norm is not None),
    Feature("SN", "skipping non-finite steps (skip_nonfinite)", lambda s: False),
    Feature("NS", "the gradient noise scale (noise_scale_every)", lambda s: s.noise_scale_every is not None),
    Feature("BR", "batch ramps (fixed and adaptive)", lambda s: s.ramp is not None),
    Feature("LL", "LARS / LAMB", lambda s: False),
    Feature("1A", "1-bit Adam (a codec on Adam's first moment)",
            lambda s: bool(getattr(s.strategy.compression, "optimizer_momentum", 0.0))),
    Feature("CK", "checkpoint restore and reshard", lambda s: False),
    Feature("MP", "several processes (jax.distributed)", lambda s: False),
)
CODES = tuple(f.code for f in FEATURES)

#: How the library names the fields a problem mentions (the config layer has its YAML keys).
LIBRARY_NAMES = {
    "zero": "Strategy.zero", "sequence_parallel": "Strategy.sequence_parallel", "schedule": "schedule",
    "compression": "Strategy.compression", "sync": "Strategy.sync", "local_clip": "Strategy.local_clip",
    "microbatches": "Strategy.microbatches", "compute_dtype": "Strategy.compute_dtype", "explicit_dp": "explicit_dp",
    "steps_per_call": "steps_per_call",
    "clip_norm": "clip_norm", "noise_scale_every": "noise_scale_every", "pipe": "pipe", "replica": "replica",
    "tensor": "tensor", "ramp": "the batch ramp", "ramp_steps": "the batch ramp's steps", "true": "True",
    "false": "False",
}


class Problem(NamedTuple):
    """A combination that is refused: the two feature codes, the fields involved, and the message
    (a template over the fields' names, :meth:`render` fills them in)."""

    features: tuple[str, str]
    fields: tuple[str, ...]
    template: str
    values: Mapping[str, Any]
    error: str = "ValueError"

    def render(self, names: Mapping[str, str]) -> str:
        """The message with the fields called ``names[field]`` (``LIBRARY_NAMES`` or YAML keys)."""
        return self.template.format(n=_Names(names), **self.values)


class _Names(dict):
    def __missing__(self, key):
        return key


def _name(v: Any) -> str:
    return repr(getattr(v, "name", v))


def _pipeline_problems(s: Setting) -> list[Problem]:
    st, p = s.strategy, s.size("pipe")
    out = []
    if p > 1 and st.sequence_parallel and s.size("tensor") > 1 and _schedule(s) != "none":
        code = {"pipedream-2bw": "2B", "pipedream": "ST"}.get(st.schedule, "PP")
        out.append(Problem(("SP", code), ("sequence_parallel", "pipe"),
                           "{n[sequence_parallel]}={n[true]} with {n[pipe]}={p} is not supported: XLA reorders "
                           "sequence-parallel activations with collective-permutes that span every pipeline stage, "
                           "which would deadlock inside a stage's own branch. Use {n[sequence_parallel]}={n[false]} "
                           "with {n[pipe]} > 1 (tensor parallelism itself works).", {"p": p}))
    if s.steps_per_call != 1 and st.schedule not in ("pipedream-2bw", "pipedream"):
        out.append(Problem(("K", "PP"), ("steps_per_call", "schedule"),
                           "{n[steps_per_call]}={k} with {n[schedule]}={sched!r}: only schedule='pipedream-2bw' (or "
                           "'pipedream') runs several optimizer steps per call (its pipeline does not flush between "
                           "them). Use {n[steps_per_call]}=1, or schedule='pipedream-2bw'.",
                           {"k": s.steps_per_call, "sched": st.schedule}, "AsyncPipelineError"))
    if (s.size("replica") > 1 or st.sync is not None) and p > 1:
        out.append(Problem(("RS", "PP"), ("sync", "pipe"),
                           "{n[sync]}={sync} with {n[pipe]}={p} on {n[replica]}={r}: pipelined replicas are not "
                           "supported yet; use data / fsdp / tensor inside each replica ({n[pipe]}=1).",
                           {"sync": _name(st.sync or "sync"), "p": p, "r": s.size("replica")}, "SyncError"))
    return out


def _explicit_dp_problems(s: Setting) -> list[Problem]:
    if not s.explicit_dp:
        return []
    st = s.strategy
    where = [(("EX", "ST"), "schedule", "{n[schedule]}='pipedream'")] if st.schedule == "pipedream" else []
    where += [(("EX", "K"), "steps_per_call", "{n[steps_per_call]}=" + str(s.steps_per_call))] \
        if s.steps_per_call != 1 else []
    where += [(("EX", "2B" if st.schedule == "pipedream-2bw" else "PP"), "pipe", "{n[pipe]}=" + str(s.size("pipe")))] \
        if s.size("pipe") > 1 and not where else []
    out = [Problem(feats, ("explicit_dp", f), "{n[explicit_dp]}=True with " + what + ": a pipeline stage runs its "
                   "layers inside the pipeline executor, where the data-axis collectives are left to XLA. Use "
                   "{n[explicit_dp]}=None or False with pipe > 1.", {}, "ExplicitDPError") for feats, f, what in where]
    if st.compression is not None:
        out.append(Problem(("EX", "CP"), ("explicit_dp", "compression"),
                           "{n[explicit_dp]}=True with {n[compression]}={c}: the compressed exchange already makes "
                           "the data-axis collectives explicit (once per step, after accumulation). Use "
                           "{n[explicit_dp]}=None with compression.", {"c": _name(st.compression)}, "ExplicitDPError"))
    if st.sync is not None or s.size("replica") > 1:
        out.append(Problem(("EX", "RS"), ("explicit_dp", "sync"),
                           "{n[explicit_dp]}=True with {n[sync]}={sync}: inside replicas the data-axis collectives "
                           "are left to XLA (jaxpar's per-layer shard_map does not lower under the replicas' vmap "
                           "for every ZeRO layout). Use {n[explicit_dp]}=None or False.",
                           {"sync": _name(st.sync or "sync")}, "ExplicitDPError"))
    return out


def _no_flush_problems(s: Setting) -> list[Problem]:
    """PipeDream-2BW and weight stashing against codecs, replicas and clipping."""
    st, out = s.strategy, []
    kinds = {"pipedream-2bw": ("2B", "the delayed gradient is computed by the plain pipelined step only"),
             "pipedream": ("ST", "each stage updates inside the pipeline, where no codec or replica exchange runs")}
    if st.schedule in kinds:
        code, why = kinds[st.schedule]
        for field, value, other in (("compression", st.compression, "CP"), ("sync", st.sync, "RS")):
            if value is not None:
                out.append(Problem((code, other), (field, "schedule"),
                                   "{n[" + field + "]}={v} with {n[schedule]}={sched!r}: " + why + ". Drop {n["
                                   + field + "]}, or use schedule='1f1b'.", {"v": _name(value), "sched": st.schedule},
                                   "AsyncPipelineError" if code == "2B" else "StashingError"))
    if st.schedule == "pipedream" and s.clip_norm is not None:
        out.append(Problem(("ST", "CN"), ("clip_norm", "schedule"),
                           "{n[clip_norm]}={c} with {n[schedule]}='pipedream': global-norm clipping needs the norm "
                           "over every stage, but each stage updates alone, at its own ticks. Use "
                           "{n[clip_norm]}=None, or schedule='1f1b'.", {"c": s.clip_norm}, "StashingError"))
    return out


def _codec_problems(s: Setting) -> list[Problem]:
    st, out = s.strategy, []
    if st.compression is not None and (st.sync is not None or s.size("replica") > 1):
        out.append(Problem(("CP", "RS"), ("compression", "sync"),
                           "{n[compression]}={c} with {n[sync]}={sync} on {n[replica]}={r}: relaxed synchronisation "
                           "does not run through a gradient codec yet. Fold the replica devices into the data axis "
                           "to compress the exchange, or drop one of the two.",
                           {"c": _name(st.compression), "sync": _name(st.sync or "sync"), "r": s.size("replica")},
                           "SyncError"))
    b1 = getattr(st.compression, "optimizer_momentum", 0.0)
    if b1 and s.clip_norm is not None:
        out.append(Problem(("1A", "CN"), ("clip_norm", "compression"),
                           "{n[clip_norm]}={clip} with {n[compression]}={c}(optimizer_momentum={b1}): with 1-bit "
                           "Adam the gradient handed to Adam carries the moment's compression error times 1 / (1 - "
                           "b1), so its norm says little and a clip after the exchange would shrink every step. Clip "
                           "each replica's gradient before the codec instead: {n[local_clip]}={clip} and "
                           "{n[clip_norm]}=None.", {"clip": s.clip_norm, "c": st.compression.name, "b1": b1},
                           "CompressionError"))
    return out


def _noise_scale_problems(s: Setting) -> list[Problem]:
    if s.noise_scale_every is None:
        return []
    st, key = s.strategy, "{n[noise_scale_every]}={every}"
    out = []
    if st.sync is not None or s.size("replica") > 1:
        out.append(Problem(("NS", "RS"), ("noise_scale_every", "sync"), key + " with {n[sync]}={sync} on "
                           "{n[replica]}={r}: relaxed synchronisation keeps several replicas with their own "
                           "parameters; measure without it.",
                           {"sync": _name(st.sync or "sync"), "r": s.size("replica")}, "NoiseScaleError"))
    if st.schedule in ("pipedream", "pipedream-2bw") and s.size("pipe") > 1:
        out.append(Problem(("NS", "ST" if st.schedule == "pipedream" else "2B"), ("noise_scale_every", "schedule"),
                           key + " with {n[schedule]}={sched!r}: gradients at older weight versions inside a pipeline "
                           "that does not flush; measure with a flush schedule (gpipe, 1f1b, interleaved, zb-h1).",
                           {"sched": st.schedule}, "NoiseScaleError"))
    if s.steps_per_call != 1:
        out.append(Problem(("NS", "K"), ("noise_scale_every", "steps_per_call"), key + " with "
                           "{n[steps_per_call]}={k}: the measuring program runs one step; use "
                           "{n[steps_per_call]}=1.", {"k": s.steps_per_call}, "NoiseScaleError"))
    return [p._replace(values={**p.values, "every": s.noise_scale_every}) for p in out]


def _ramp_problems(s: Setting) -> list[Problem]:
    k, out = s.steps_per_call, []
    if s.ramp == "adaptive" and k != 1:
        out.append(Problem(("BR", "K"), ("ramp", "steps_per_call"),
                           "{n[steps_per_call]}={k} with an adaptive batch ramp: the batch can change only between "
                           "calls; use a fixed ramp, or {n[steps_per_call]}=1.", {"k": k}))
    inside = [t for t in s.ramp_steps if k != 1 and t % k]
    if s.ramp == "fixed" and inside:
        out.append(Problem(("BR", "K"), ("ramp_steps", "steps_per_call"),
                           "{n[ramp_steps]}={steps} with {n[steps_per_call]}={k}: step {first} falls inside a call "
                           "of {k} steps, whose batches are stacked and must have one size. Make every ramp step a "
                           "multiple of {k}.", {"steps": list(s.ramp_steps), "k": k, "first": inside[0]}))
    return out


def _sequence_parallel_problems(s: Setting) -> list[Problem]:
    """Sequence parallelism against replicas and bf16 (both fail inside XLA, not by name)."""
    st, out = s.strategy, []
    if not (st.sequence_parallel and s.size("tensor") > 1):
        return out
    if st.sync is not None or s.size("replica") > 1:
        out.append(Problem(("SP", "RS"), ("sequence_parallel", "sync"),
                           "{n[sequence_parallel]}={n[true]} with {n[sync]}={sync} on {n[replica]}={r}: the "
                           "sequence-parallel regions' shard_map does not lower under the replicas' vmap (XLA's "
                           "verifier rejects the shapes). Use {n[sequence_parallel]}={n[false]} with replicas.",
                           {"sync": _name(st.sync or "sync"), "r": s.size("replica")}, "SyncError"))
    if st.compute_dtype == "bfloat16" and s.size("data") * s.size("fsdp") > 1:
        out.append(Problem(("SP", "BF"), ("sequence_parallel", "compute_dtype"),
                           "{n[sequence_parallel]}={n[true]} with {n[compute_dtype]}='bfloat16' on a mesh with data "
                           "axes {d} and tensor {t}: XLA aborts while compiling this step ('Invalid binary "
                           "instruction opcode copy', XLA:CPU with jax 0.10). Use {n[compute_dtype]}='float32' or "
                           "{n[sequence_parallel]}={n[false]} (bf16 with sequence parallelism on the tensor axis "
                           "alone compiles).", {"d": s.size("data") * s.size("fsdp"), "t": s.size("tensor")}))
    return out


_RULES = (_sequence_parallel_problems, _pipeline_problems, _explicit_dp_problems, _no_flush_problems, _codec_problems,
          _noise_scale_problems, _ramp_problems)


def problems(setting: Setting) -> list[Problem]:
    """Every refused combination in ``setting``.

    Args:
      setting: what the run asks for.

    Returns:
      The :class:`Problem`\\ s, in the table's order (empty: every pair composes).
    """
    return [p for rule in _RULES for p in rule(setting)]


def raise_problems(setting: Setting, errors: Mapping[str, type]) -> None:
    """Raise the first problem of ``setting`` with its error class and the library's names.

    Args:
      setting: what the run asks for.
      errors: the error classes by name (``{"ExplicitDPError": ExplicitDPError, ...}``); a
        problem whose class is not given raises ``ValueError``.
    """
    found = problems(setting)
    if found:
        raise errors.get(found[0].error, ValueError)(found[0].render(LIBRARY_NAMES))


#: The pairs refused whatever the values: ``{(code, code): why}``. Every other pair composes,
#: and a test compares it with its reference (``tests/test_combinations.py``).
REFUSED = {
    ("SP", "PP"): "XLA's sequence-parallel resharding would deadlock inside a pipeline stage",
    ("SP", "2B"): "as SP x PP", ("SP", "ST"): "as SP x PP",
    ("EX", "PP"): "a stage's layers run inside the executor", ("EX", "2B"): "as EX x PP",
    ("EX", "ST"): "as EX x PP", ("EX", "K"): "as EX x PP", ("EX", "CP"): "the codec's exchange is explicit already",
    ("EX", "RS"): "the per-layer shard_map does not lower under the replicas' vmap",
    ("EX", "1A"): "as EX x CP", ("EX", "LC"): "as EX x CP",
    ("PP", "K"): "a flush pipeline runs one step per call", ("PP", "RS"): "pipelined replicas",
    ("2B", "CP"): "the delayed gradient runs through the plain pipelined step", ("2B", "RS"): "as 2B x CP",
    ("2B", "LC"): "as 2B x CP", ("2B", "1A"): "as 2B x CP", ("2B", "NS"): "gradients at older weights",
    ("ST", "CP"): "stages update inside the pipeline", ("ST", "RS"): "as ST x CP", ("ST", "LC"): "as ST x CP",
    ("ST", "1A"): "as ST x CP", ("ST", "CN"): "each stage updates alone", ("ST", "NS"): "gradients at older weights",
    ("K", "CP"): "K > 1 needs a no-flush schedule, which refuses codecs", ("K", "LC"): "as K x CP",
    ("K", "RS"): "as K x CP", ("K", "1A"): "as K x CP", ("K", "NS"): "the measuring program runs one step",
    ("CP", "RS"): "relaxed synchronisation does not run through a codec", ("LC", "RS"): "as CP x RS",
    ("RS", "1A"): "as CP x RS", ("RS", "NS"): "replicas have their own parameters",
    ("1A", "CN"): "clip before the codec",
    ("SP", "RS"): "the sequence-parallel shard_map does not lower under the replicas' vmap",
    ("SP", "K"): "K > 1 needs a pipeline, which refuses sequence parallelism",
}

#: Pairs where some values compose and others are refused: ``{(code, code): (composes, refused)}``.
PARTLY = {
    ("Z", "1A"): ("ZeRO-1", "ZeRO-2/3 and fsdp: 1-bit Adam needs the whole exchanged moment on every replica"),
    ("ST", "LL"): ("LARS / LAMB with per-layer trust ratios (the logical mask)",
                   "optimizers that are not per stage (a global norm, clip_by_global_norm)"),
    ("SP", "BF"): ("on the tensor axis alone", "with a data axis: XLA aborts the compile"),
    ("BR", "K"): ("fixed ramps whose steps are multiples of K", "adaptive ramps, and a ramp step inside a call"),
}

#: Pairs that are alternatives, never both on: one schedule at a time, and a pipeline's
#: micro-batches are its schedule's (not gradient accumulation).
ALTERNATIVES = {("PP", "2B"), ("PP", "ST"), ("2B", "ST"), ("MB", "PP"), ("MB", "2B"), ("MB", "ST"), ("MB", "K")}


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
            raise ValueError(f"pair_status: unknown feature {code!r}; the features are {CODES}.")
    for status, table in (("refused", REFUSED), ("partly", PARTLY), ("alternatives", ALTERNATIVES)):
        if (a, b) in table or (b, a) in table:
            return status
    return "composes"


def all_pairs() -> list[tuple[str, str]]:
    """Every pair of feature codes, in the table's order."""
    return list(itertools.combinations(CODES, 2))
