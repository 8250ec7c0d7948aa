"""The rules of the compatibility table: what a run asks for (:class:`Setting`) and the
:class:`Problem`\\ s each rule finds in it. :mod:`jaxpar.compat._table` runs them (:func:`jaxpar.compat.problems`)
and holds the table itself.

Example:
    >>> from jaxpar import Strategy
    >>> s = Setting(Strategy(), {"data": 8}, steps_per_call=2, noise_scale_every=4)
    >>> [p.features for rule in RULES for p in rule(s)]
    [('NS', 'K')]
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from jaxpar.errors import (AsyncPipelineError, CompressionError, ContextParallelError, ExplicitDPError, Fp8Error, JaxparError,
                           MoEError, NoiseScaleError, RampError, StashingError, SyncError)


class Setting(NamedTuple):
    """What a run asks for: everything the compatibility table reads.

    Attributes:
      strategy: the :class:`~jaxpar.Strategy`.
      sizes: the mesh axis sizes.
      explicit_dp: ``make_train_step(explicit_dp=...)``.
      steps_per_call: optimizer steps per call.
      clip_norm: ``make_train_step(clip_norm=...)``.
      noise_scale_every: the noise-scale part's ``with_noise_scale(state, layout, every=...)``;
        ``True``: the state measures it, at an interval the caller does not see (:func:`jaxpar.run.train`).
      ramp: ``None``, ``"fixed"`` or ``"adaptive"`` (the loop's batch ramp), with ``ramp_steps``.
      ramp_steps: the steps at which a fixed ramp changes the batch size.
      optimizer_across_stages: the optimizer's update of a parameter reads other parameters or
        their gradients (a global norm: ``optax.clip_by_global_norm``, LARS / LAMB without a
        per-layer mask), so a pipeline stage cannot update on its own.
      intervals: the loop's intervals as ``(name, steps)`` pairs (``("log_every", 25)``: ``steps``,
        ``start``, ``log_every``, ``eval_every``, ``checkpoint_every``, ``stop_check_every``):
        ``steps_per_call`` must divide each.
      router_bias_rate: the router bias part's ``with_router_bias(state, layout, shape, rate=...)``
        (aux-loss-free MoE balancing; ``None``: the state keeps no bias).
      muon: Muon's matrices (an ``optax.contrib.MuonState`` in the optimizer state) as ``(path, mesh axes
        that shard its momentum)`` pairs; ``None``: no Muon.
    """

    strategy: Any
    sizes: Mapping[str, int]
    explicit_dp: bool | None = None
    steps_per_call: int = 1
    clip_norm: float | None = None
    noise_scale_every: int | None = None
    ramp: str | None = None
    ramp_steps: tuple = ()
    optimizer_across_stages: bool = False
    intervals: tuple[tuple[str, int], ...] = ()
    router_bias_rate: float | None = None
    muon: tuple[tuple[str, tuple[str, ...]], ...] | None = None

    def size(self, axis: str) -> int:
        """The size of a mesh axis.

        Args:
          axis: a mesh axis name (``"pipe"``, ``"tensor"``, ...).

        Returns:
          Its size, 1 when the setting has no such axis.
        """
        return dict(self.sizes).get(axis, 1)


#: The schedules whose pipeline drains every step.
FLUSH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
#: The feature code of each schedule whose pipeline does not drain.
NO_FLUSH = {"pipedream-2bw": "2B", "pipedream": "ST"}


def pipeline_schedule(s: Setting) -> str:
    """The pipeline schedule that runs.

    Args:
      s: the setting.

    Returns:
      The strategy's schedule name when ``pipe`` > 1, else ``"none"``.
    """
    return s.strategy.schedule if s.size("pipe") > 1 else "none"


def replicas_on(s: Setting) -> bool:
    """Whether a setting trains replicas.

    Args:
      s: the setting.

    Returns:
      True with a ``replica`` axis > 1 or a ``sync`` kind.
    """
    return s.strategy.sync is not None or s.size("replica") > 1


class Problem(NamedTuple):
    """A combination that is refused: the feature codes, the fields involved, the message (a
    template over the fields' names, :meth:`render` fills them in) and the error class it raises.

    Attributes:
      features: the two codes of a refused pair, or one code: a feature's own requirement
        (:mod:`jaxpar.compat._needs`).
      fields: the fields the message names (keys of the name maps).
      template: the message, with ``{n[field]}`` for each field's name.
      values: the values the template shows.
      error: the :class:`~jaxpar.errors.JaxparError` subclass that the library raises it as: the
        class of the feature that refuses (``SyncError``, ``StashingError``, ...).
    """

    features: tuple[str, ...]
    fields: tuple[str, ...]
    template: str
    values: Mapping[str, Any]
    error: type[JaxparError]

    def render(self, names: Mapping[str, str]) -> str:
        """The message, with each field called by its name in ``names``.

        Args:
          names: field -> the name to show (``LIBRARY_NAMES`` or YAML keys); a field missing from
            it shows as itself.

        Returns:
          The filled-in message.
        """
        return self.template.format(n=_Names(names), **self.values)


class _Names(dict):
    def __missing__(self, key):
        return key


def value_name(v: Any) -> str:
    """How a message shows an option's value.

    Args:
      v: the value: a codec, a sync kind (anything with a ``name``) or a plain value.

    Returns:
      ``repr`` of its ``name`` when it has one, else of itself.
    """
    return repr(getattr(v, "name", v))


def _pipeline_problems(s: Setting) -> list[Problem]:
    st, p = s.strategy, s.size("pipe")
    out = []
    no_flush = NO_FLUSH.get(st.schedule)
    if p > 1 and st.sequence_parallel and s.size("tensor") > 1 and no_flush:
        out.append(Problem(("SP", no_flush), ("sequence_parallel", "schedule"),
                           "{n[sequence_parallel]}={n[true]} with {n[schedule]}={sched!r} on {n[pipe]}={p} is not "
                           "supported: sequence parallelism's collectives sit inside each stage's actions, which "
                           "only the flush schedules (gpipe, 1f1b, interleaved, zb-h1) run in lockstep (every stage "
                           "the same action at each tick); the no-flush programs run a different action per stage, "
                           "and a collective that some stages do not reach hangs. Use a flush schedule, or "
                           "{n[sequence_parallel]}={n[false]}.", {"p": p, "sched": st.schedule},
                           AsyncPipelineError if no_flush == "2B" else StashingError))
    if replicas_on(s):
        if pipeline_schedule(s) in FLUSH_SCHEDULES:
            out.append(Problem(("RS", "PP"), ("sync", "pipe"),
                               "{n[sync]}={sync} with {n[pipe]}={p} on {n[replica]}={r}: pipelined replicas are not "
                               "supported yet; use data / fsdp / tensor inside each replica ({n[pipe]}=1).",
                               {"sync": value_name(st.sync or "sync"), "p": p, "r": s.size("replica")}, SyncError))
        if s.steps_per_call != 1:
            out.append(Problem(("K", "RS"), ("steps_per_call", "sync"),
                               "{n[steps_per_call]}={k} with {n[sync]}={sync} on {n[replica]}={r}: relaxed "
                               "synchronisation picks its inner, outer and warm-up programs on the host, step by "
                               "step. Use {n[steps_per_call]}=1 with replicas.",
                               {"k": s.steps_per_call, "sync": value_name(st.sync or "sync"), "r": s.size("replica")},
                               SyncError))
    return out


def _explicit_dp_problems(s: Setting) -> list[Problem]:
    if not s.explicit_dp:
        return []
    st = s.strategy
    where = [(("EX", "ST"), "schedule", "{n[schedule]}='pipedream'")] if st.schedule == "pipedream" else []
    where += [(("EX", "2B" if st.schedule == "pipedream-2bw" else "PP"), "pipe", "{n[pipe]}=" + str(s.size("pipe")))] \
        if s.size("pipe") > 1 and not where else []
    out = [Problem(feats, ("explicit_dp", f), "{n[explicit_dp]}=True with " + what + ": a pipeline stage runs its "
                   "layers inside the pipeline executor, where the data-axis collectives are left to XLA. Use "
                   "{n[explicit_dp]}=None or False with pipe > 1.", {}, ExplicitDPError) for feats, f, what in where]
    if st.compression is not None:
        out.append(Problem(("EX", "CP"), ("explicit_dp", "compression"),
                           "{n[explicit_dp]}=True with {n[compression]}={c}: the compressed exchange already makes "
                           "the data-axis collectives explicit (once per step, after accumulation). Use "
                           "{n[explicit_dp]}=None with compression.", {"c": value_name(st.compression)},
                           ExplicitDPError))
    if st.fp8 is not None and st.fp8.recipe == "rowwise":
        out.append(Problem(("EX", "F8"), ("explicit_dp", "fp8"),
                           "{n[explicit_dp]}=True with {n[fp8]}=Fp8(recipe='rowwise'): inside the per-layer shard_map "
                           "each device holds its own tokens, so a weight gradient's row scales (a maximum over the "
                           "tokens) would be its shard's, not the batch's. Use {n[explicit_dp]}=None (XLA's "
                           "collectives for rowwise FP8) or recipe='tensorwise'.", {}, Fp8Error))
    if replicas_on(s):
        out.append(Problem(("EX", "RS"), ("explicit_dp", "sync"),
                           "{n[explicit_dp]}=True with {n[sync]}={sync}: inside replicas the data-axis collectives "
                           "are left to XLA (jaxpar's per-layer shard_map does not lower under the replicas' vmap "
                           "for every ZeRO layout). Use {n[explicit_dp]}=None or False.",
                           {"sync": value_name(st.sync or "sync")}, ExplicitDPError))
    return out


def _no_flush_problems(s: Setting) -> list[Problem]:
    """PipeDream-2BW and weight stashing against codecs, replicas and clipping."""
    st, out = s.strategy, []
    kinds = {"pipedream-2bw": ("2B", "the delayed gradient is computed by the plain pipelined step only"),
             "pipedream": ("ST", "each stage updates inside the pipeline, where no codec or replica exchange runs")}
    sched = pipeline_schedule(s) if st.schedule == "pipedream-2bw" else st.schedule
    if sched in kinds:
        code, why = kinds[sched]
        for field, value, other in (("compression", st.compression, "CP"), ("sync", st.sync, "RS")):
            if value is not None or (other == "RS" and replicas_on(s)):
                out.append(Problem((code, other), (field, "schedule"),
                                   "{n[" + field + "]}={v} with {n[schedule]}={sched!r}: " + why + ". Drop {n["
                                   + field + "]}, or use schedule='1f1b'.",
                                   {"v": value_name(value or "sync"), "sched": st.schedule},
                                   AsyncPipelineError if code == "2B" else StashingError))
    if st.schedule == "pipedream" and s.clip_norm is not None:
        out.append(Problem(("ST", "CN"), ("clip_norm", "schedule"),
                           "{n[clip_norm]}={c} with {n[schedule]}='pipedream': global-norm clipping needs the norm "
                           "over every stage, but each stage updates alone, at its own ticks. Use "
                           "{n[clip_norm]}=None, or schedule='1f1b'.", {"c": s.clip_norm}, StashingError))
    if st.schedule == "pipedream" and s.optimizer_across_stages:
        out.append(Problem(("ST", "LL"), ("optimizer", "schedule"),
                           "{n[schedule]}='pipedream' with {n[optimizer]} that does not update each pipeline stage's "
                           "parameters on their own (its update of a parameter depends on other stages' parameters "
                           "or gradients: e.g. optax.clip_by_global_norm, or a norm over a whole stacked leaf). Each "
                           "stage updates alone under weight stashing; use an element-wise or per-layer optimizer "
                           "(sgd, adam, adamw, lars / lamb with per-layer trust ratios), or schedule='1f1b'.", {},
                           StashingError))
    split = [(path, a) for path, axes in s.muon or () for a in axes if a != "pipe" and s.size(a) > 1]
    if st.schedule == "pipedream" and split:
        out.append(Problem(("ST", "MU"), ("optimizer", "schedule"),
                           "{n[schedule]}='pipedream' with {n[optimizer]} Muon: its matrix {m!r} is split over {a!r} "
                           "inside a stage, so its Newton-Schulz collectives would run in each stage's own update "
                           "between the pipeline's sends (XLA:CPU deadlocks there). Use schedule='1f1b' or "
                           "'pipedream-2bw', or a mesh whose stages split no matrix (pipe x data, ZeRO-0/1/2).",
                           {"m": split[0][0], "a": split[0][1]}, StashingError))
    return out


def _codec_problems(s: Setting) -> list[Problem]:
    st, out = s.strategy, []
    if st.compression is not None and replicas_on(s):
        out.append(Problem(("CP", "RS"), ("compression", "sync"),
                           "{n[compression]}={c} with {n[sync]}={sync} on {n[replica]}={r}: relaxed synchronisation "
                           "does not run through a gradient codec yet. Fold the replica devices into the data axis "
                           "to compress the exchange, or drop one of the two.",
                           {"c": value_name(st.compression), "sync": value_name(st.sync or "sync"),
                            "r": s.size("replica")},
                           SyncError))
    out += sharded_moment_problems(st.compression, st.zero, s.sizes)
    b1 = getattr(st.compression, "optimizer_momentum", 0.0)
    if b1 and s.clip_norm is not None:
        out.append(Problem(("1A", "CN"), ("clip_norm", "compression"),
                           "{n[clip_norm]}={clip} with {n[compression]}={c}(optimizer_momentum={b1}): with 1-bit "
                           "Adam the gradient handed to Adam carries the moment's compression error times 1 / (1 - "
                           "b1), so its norm says little and a clip after the exchange would shrink every step. Clip "
                           "each replica's gradient before the codec instead: {n[local_clip]}={clip} and "
                           "{n[clip_norm]}=None.", {"clip": s.clip_norm, "c": st.compression.name, "b1": b1},
                           CompressionError))
    return out


def sharded_moment_problems(codec, zero: int, sizes: Mapping[str, int]) -> list[Problem]:
    """1-bit Adam (a codec with ``optimizer_momentum``) against gradients sharded over the data axes
    (the Z x 1A pair).

    Args:
      codec: the strategy's ``compression``.
      zero: the ZeRO stage (gradients sharded over ``data`` from ZeRO-2 on).
      sizes: the mesh axis sizes (``fsdp`` always shards them).

    Returns:
      The pair's :class:`Problem`, or none.
    """
    b1, f = getattr(codec, "optimizer_momentum", 0.0), dict(sizes).get("fsdp", 1)
    if not (b1 and (zero >= 2 or f > 1)):
        return []
    return [Problem(("Z", "1A"), ("zero", "compression"),
                    "{n[compression]}={c}(optimizer_momentum={b1}) with {n[zero]}={z} and {n[fsdp]}={f}: 1-bit Adam "
                    "needs the whole exchanged moment on every replica, but ZeRO-2/3 or fsdp shard the gradients "
                    "over the data axes. Use {n[zero]} <= 1 with {n[fsdp]}=1 (put the replicas on data).",
                    {"c": codec.name, "b1": b1, "z": zero, "f": f}, CompressionError)]


def _noise_scale_problems(s: Setting) -> list[Problem]:
    if s.noise_scale_every is None:
        return []
    st, key = s.strategy, "{n[noise_scale_every]}={every}"
    out = []
    if replicas_on(s):
        out.append(Problem(("NS", "RS"), ("noise_scale_every", "sync"), key + " with {n[sync]}={sync} on "
                           "{n[replica]}={r}: relaxed synchronisation keeps several replicas with their own "
                           "parameters; measure without it.",
                           {"sync": value_name(st.sync or "sync"), "r": s.size("replica")}, NoiseScaleError))
    if st.schedule in NO_FLUSH and s.size("pipe") > 1:
        out.append(Problem(("NS", NO_FLUSH[st.schedule]), ("noise_scale_every", "schedule"),
                           key + " with {n[schedule]}={sched!r}: gradients at older weight versions inside a pipeline "
                           "that does not flush; measure with a flush schedule (gpipe, 1f1b, interleaved, zb-h1).",
                           {"sched": st.schedule}, NoiseScaleError))
    if s.steps_per_call != 1:
        out.append(Problem(("NS", "K"), ("noise_scale_every", "steps_per_call"), key + " with "
                           "{n[steps_per_call]}={k}: the measuring program runs one step; use "
                           "{n[steps_per_call]}=1.", {"k": s.steps_per_call}, NoiseScaleError))
    return [p._replace(values={**p.values, "every": s.noise_scale_every}) for p in out]


def _ramp_problems(s: Setting) -> list[Problem]:
    k, out = s.steps_per_call, []
    if s.ramp == "adaptive" and k != 1:
        out.append(Problem(("BR", "K"), ("ramp", "steps_per_call"),
                           "{n[steps_per_call]}={k} with an adaptive batch ramp: the batch can change only between "
                           "calls; use a fixed ramp, or {n[steps_per_call]}=1.", {"k": k}, RampError))
    inside = [t for t in s.ramp_steps if k != 1 and t % k]
    if s.ramp == "fixed" and inside:
        out.append(Problem(("BR", "K"), ("ramp_steps", "steps_per_call"),
                           "{n[ramp_steps]}={steps} with {n[steps_per_call]}={k}: step {first} falls inside a call "
                           "of {k} steps, whose batches are stacked and must have one size. Make every ramp step a "
                           "multiple of {k}.", {"steps": list(s.ramp_steps), "k": k, "first": inside[0]}, RampError))
    return out


def _sequence_parallel_problems(s: Setting) -> list[Problem]:
    """Sequence parallelism against replicas (the shard_map fails inside XLA, not by name)."""
    st = s.strategy
    if not (st.sequence_parallel and s.size("tensor") > 1 and replicas_on(s)):
        return []
    return [Problem(("SP", "RS"), ("sequence_parallel", "sync"),
                    "{n[sequence_parallel]}={n[true]} with {n[sync]}={sync} on {n[replica]}={r}: the "
                    "sequence-parallel regions' shard_map does not lower under the replicas' vmap (XLA's "
                    "verifier rejects the shapes). Use {n[sequence_parallel]}={n[false]} with replicas.",
                    {"sync": value_name(st.sync or "sync"), "r": s.size("replica")}, SyncError)]


def _context_problems(s: Setting) -> list[Problem]:
    """Context parallelism (a ``context`` axis) against what runs the loss in other ``shard_map`` s."""
    c, st, out = s.size("context"), s.strategy, []
    if c == 1:
        return out
    key, values = "{n[context]}={c}", {"c": c}
    code = NO_FLUSH.get(st.schedule)
    if s.size("pipe") > 1 and code:
        out.append(Problem((code, "CX"), ("context", "schedule"), key + " with {n[schedule]}={sched!r}: context "
                           "parallelism runs in flush pipelines only (gpipe, 1f1b, interleaved, zb-h1). Use one of "
                           "those, or {n[context]}=1.",
                           {**values, "sched": st.schedule}, ContextParallelError))
    if s.explicit_dp:
        out.append(Problem(("EX", "CX"), ("explicit_dp", "context"), "{n[explicit_dp]}=True with " + key + ": the "
                           "explicit per-layer collectives run each layer in a shard_map over the data axes, and "
                           "context-parallel attention inside it is not supported yet. Use {n[explicit_dp]}=None.",
                           values, ExplicitDPError))
    return out + _per_replica_problems(s, "CX", "context", key, values, ContextParallelError)


def _per_replica_problems(s: Setting, code: str, axis: str, key: str, values: dict,
                          error: type[JaxparError]) -> list[Problem]:
    """A codec, relaxed synchronisation or the noise scale with a mesh axis (``axis``, feature ``code``)
    that their per-replica ``shard_map`` over the data axes does not reduce over."""
    st, out = s.strategy, []
    inside = [("CP", "compression", "a codec's exchange", st.compression is not None),
              ("RS", "sync", "relaxed synchronisation", replicas_on(s)),
              ("NS", "noise_scale_every", "the noise scale", s.noise_scale_every is not None)]
    for other, field, what, on in inside:
        if on:
            out.append(Problem((other, code), (field, axis), "{n[" + field + "]} with " + key + ": " + what +
                               " runs the loss per replica inside a shard_map over the data axes and reduces the "
                               "gradients over them only, not over {n[" + axis + "]}. Drop one of the two.", values,
                               error))
    return out


def _expert_problems(s: Setting) -> list[Problem]:
    """Expert parallelism (an ``expert`` axis) against what carries one activation per layer, or
    reduces the gradients over the data axes only."""
    e, st, out = s.size("expert"), s.strategy, []
    if e == 1:
        return out
    key, values = "{n[expert]}={e}", {"e": e}
    code = NO_FLUSH.get(st.schedule)
    if s.size("pipe") > 1 and code:
        out.append(Problem((code, "EP"), ("schedule", "expert"), "{n[schedule]}={sched!r} with " + key + ": the "
                           "asynchronous schedules run each micro-batch on its own weight version and report no "
                           "metrics, so the MoE layers' load-balancing loss has no whole-step load to use. Use a "
                           "flush schedule (gpipe, 1f1b, interleaved, zb-h1) with experts.",
                           {**values, "sched": st.schedule}, MoEError))
    if s.explicit_dp:
        out.append(Problem(("EX", "EP"), ("explicit_dp", "expert"), "{n[explicit_dp]}=True with " + key + ": the "
                           "explicit per-layer collectives run one activation per layer and reduce over the data "
                           "axes only. Use {n[explicit_dp]}=None.", values, MoEError))
    return out + _per_replica_problems(s, "EP", "expert", key, values, MoEError)


def _router_bias_problems(s: Setting) -> list[Problem]:
    """The router bias (aux-loss-free balancing) against steps without one load on one set of weights."""
    st, out = s.strategy, []
    code = "ST" if st.schedule == "pipedream" else "2B" if pipeline_schedule(s) == "pipedream-2bw" else None
    what = {"2B": "PipeDream-2BW's pipeline does not flush: a step's first micro-batches run before the previous "
                  "step's last ones reach the later stages' MoE layers, so the bias they should read is not known yet",
            "ST": "weight stashing's pipeline does not flush and each stage updates alone after every micro-batch, "
                  "so the loads are of no one step and no one set of weights",
            "RS": "relaxed synchronisation trains replicas on weights of their own or delayed ones (stale, local "
                  "SGD, DiLoCo, EASGD), whose loads are of no one step"}
    found = [(code, "schedule", "{n[schedule]}={sched!r}")] if code else []
    found += [("RS", "sync", "{n[sync]}={sync} on {n[replica]}={r}")] if replicas_on(s) else []
    values = {"rate": s.router_bias_rate, "sched": st.schedule, "sync": value_name(st.sync or "sync"),
              "r": s.size("replica")}
    for c, field, other in found if s.router_bias_rate is not None else ():
        out.append(Problem((c, "RB"), (field, "router_bias_rate"), "{n[router_bias_rate]}={rate} with " + other +
                           ": the router bias moves after every step by that step's load per expert, and " + what[c] +
                           ". Use a flush schedule (gpipe, 1f1b, interleaved, zb-h1) and synchronous data parallelism "
                           "(no sync kind, no replica axis), or balance with the load-balancing loss "
                           "({n[aux_weight]}) instead of the bias.", values, MoEError))
    if s.router_bias_rate is not None and s.explicit_dp:
        out.append(Problem(("EX", "RB"), ("explicit_dp", "router_bias_rate"), "{n[router_bias_rate]}={rate} and "
                           "{n[explicit_dp]}=True: the explicit per-layer collectives run one activation per "
                           "layer, and the MoE layers carry the router bias and their loads from layer to layer "
                           "beside it. Use {n[explicit_dp]}=None.", values, MoEError))
    return out


RULES = (_sequence_parallel_problems, _pipeline_problems, _explicit_dp_problems, _no_flush_problems, _codec_problems,
         _noise_scale_problems, _ramp_problems, _context_problems, _expert_problems, _router_bias_problems)
