"""What a feature needs on its own: the rules of the compatibility table that name one feature.

A refused pair (:data:`jaxpar.compat._settings.RULES`) names two features; a rule here names one
feature and the setting it cannot run without (a ``pipe`` axis for the no-flush schedules, a data
axis for the noise scale and for a codec, the replicas of a sync kind, loop intervals that are
multiples of ``steps_per_call``, the noise scale for an adaptive batch ramp). The rules of the
strategy's own fields (:func:`strategy_needs`: ``local_clip`` needs a codec, ``update_every`` /
``vertical_sync`` weight stashing) are raised by :class:`~jaxpar.Strategy` itself, when it is built.
:data:`REQUIREMENTS` says the same in words, for ``docs/strategies.md``. Each rule gives a
:class:`~jaxpar.compat.Problem` whose ``features`` hold that one code, so the library raises
it (:func:`jaxpar.compat.raise_problems`) and the config layer renders it with YAML keys, as
it does the pairs.

Example:
    >>> from jaxpar import Strategy
    >>> s = Setting(Strategy(schedule="pipedream", microbatches=4, update_every=3), {"pipe": 2, "data": 2})
    >>> [(p.features, p.error.__name__) for rule in NEEDS for p in rule(s)]
    [(('ST',), 'StashingError')]
"""
from __future__ import annotations

from jaxpar.compat._settings import Problem, Setting, value_name
from jaxpar.errors import (AsyncPipelineError, CompressionError, LoopError, NoiseScaleError, RampError, StashingError,
                           StrategyError, SyncError, int_problem)


def strategy_needs(s: Setting) -> list[Problem]:
    """The strategy's fields that belong to another choice: ``local_clip`` clips before a codec;
    ``update_every`` and ``vertical_sync`` are weight stashing's (``Strategy`` raises these when built).

    Args:
      s: the setting (only its strategy is read).

    Returns:
      The :class:`Problem`\\ s (class ``StrategyError``), in that order.
    """
    st, out = s.strategy, []
    k, vs = st.update_every, st.vertical_sync
    if st.local_clip is not None and st.compression is None:
        out.append(Problem(("LC",), ("local_clip", "compression"),
                           "{n[local_clip]}={lc!r} clips each replica's gradient before a compressed exchange, but "
                           "{n[compression]} is {n[none]}. Set a codec (e.g. {n[compression]}=jaxpar.parallel."
                           "compression.topk(0.01)) or clip the averaged gradient with {n[clip_norm]}=...",
                           {"lc": st.local_clip}, StrategyError))
    if (k != 1 or vs) and st.schedule != "pipedream":
        out.append(Problem(("ST",), ("update_every", "vertical_sync", "schedule"),
                           "{n[update_every]}={k}, {n[vertical_sync]}={vs} are weight-stashing options, but "
                           "{n[schedule]}={sched!r} flushes the pipeline every step (one weight version): use "
                           "{n[schedule]}='pipedream', or drop them.",
                           {"k": k, "vs": vs, "sched": st.schedule}, StrategyError))
    return out


def _pipeline_needs(s: Setting) -> list[Problem]:
    """PipeDream-2BW and weight stashing are pipeline schedules; 2BW runs 1F1B's steady state (at
    least ``pipe`` micro-batches); stashing updates every ``update_every``."""
    st, p, out = s.strategy, s.size("pipe"), []
    kinds = {"pipedream-2bw": ("2B", AsyncPipelineError, "PipeDream-2BW is a pipeline schedule whose one-step-late "
                               "gradient lets the pipeline run without flushes"),
             "pipedream": ("ST", StashingError, "weight stashing is a pipeline schedule whose stages update their "
                           "own weights")}
    if st.schedule in kinds and p <= 1:
        code, error, what = kinds[st.schedule]
        out.append(Problem((code,), ("schedule", "pipe"), "{n[schedule]}={sched!r} needs {n[pipe_axis]} > 1 (got "
                           "{n[pipe]}={p}): " + what + ". Set {n[pipe]} > 1, or use {n[schedule]}='1f1b'.",
                           {"sched": st.schedule, "p": p}, error))
    k, m = st.update_every, st.microbatches
    if st.schedule == "pipedream-2bw" and p > 1 and m < p:
        out.append(Problem(("2B",), ("microbatches", "schedule", "pipe"),
                           "{n[microbatches]}={m} with {n[schedule]}='pipedream-2bw' and {n[pipe]}={p}: 2BW runs "
                           "1F1B's steady state with two weight versions, which needs m >= {p} micro-batches per "
                           "step; use microbatches >= {p}.", {"m": m, "p": p}, AsyncPipelineError))
    if st.schedule == "pipedream" and p > 1 and m % k:
        out.append(Problem(("ST",), ("update_every", "microbatches"),
                           "{n[update_every]}={k} does not divide {n[microbatches]}={m}: with {n[schedule]}="
                           "'pipedream' each stage updates after every {k} of its backwards and a step holds {m}; "
                           "use {n[update_every]} in {divisors}.",
                           {"k": k, "m": m, "divisors": [d for d in range(1, m + 1) if m % d == 0]}, StashingError))
    return out


def _noise_scale_needs(s: Setting) -> list[Problem]:
    """The noise scale compares each replica's gradient with the global one: it needs a data axis."""
    every = s.noise_scale_every
    # no measurement, a bad value (jaxpar.step._noise_scale.measure names it), or a data axis to measure over
    if int_problem(every, 1) is not None or s.size("data") * s.size("fsdp") >= 2:
        return []
    return [Problem(("NS",), ("noise_scale_every", "data", "fsdp"),
                    "{n[noise_scale_every]}={every}: the mesh has no data axis ({n[data]}={d}, {n[fsdp]}={f}) of "
                    "size > 1, so each replica's batch is the global batch and the two-batch estimate is undefined. "
                    "Use {n[data]} x {n[fsdp]} >= 2, or {n[noise_scale_every]}={n[none]}.",
                    {"every": every, "d": s.size("data"), "f": s.size("fsdp")}, NoiseScaleError)]


def codec_needs(codec, sizes) -> list[Problem]:
    """A codec compresses the gradient exchange over the data axes: it needs one of size > 1.

    Args:
      codec: the strategy's ``compression`` (``None``: no codec).
      sizes: the mesh axis sizes.

    Returns:
      The codec's :class:`Problem` (feature ``CP``), or none.
    """
    d, f = dict(sizes).get("data", 1), dict(sizes).get("fsdp", 1)
    if codec is None or d > 1 or f > 1:
        return []
    return [Problem(("CP",), ("compression", "data", "fsdp"),
                    "{n[compression]}={c} on a mesh with no data axis of size > 1 ({n[data]}={d}, {n[fsdp]}={f}): "
                    "there is no gradient exchange to compress. Remove {n[compression]}, or add data-parallel "
                    "devices ({n[data]} or {n[fsdp]} > 1).", {"c": value_name(codec), "d": d, "f": f},
                    CompressionError)]


def _codec_needs(s: Setting) -> list[Problem]:
    return codec_needs(s.strategy.compression, s.sizes)


def _sync_needs(s: Setting) -> list[Problem]:
    """A sync kind needs its replicas: at least its ``min_replicas``, and more than backup's spares."""
    sync, r = s.strategy.sync, s.size("replica")
    if sync is None:
        return []
    least, values = getattr(sync, "min_replicas", 1), {"sync": value_name(sync), "r": r}
    if r < least:
        return [Problem(("RS",), ("sync", "replica"),
                        "{n[sync]}={sync} needs {n[replica_axis]} of size >= {least}, but the mesh has "
                        "{n[replica]}={r}: the kind averages the replicas' gradients or parameters over that axis. "
                        "Set {n[replica]} >= {least} (e.g. {n[replica]}=4 with {n[data]}=2), or drop {n[sync]}.",
                        {**values, "least": least}, SyncError)]
    spares = getattr(sync, "backups", None)
    if spares is not None and spares >= r:
        return [Problem(("RS",), ("sync", "replica"),
                        "{n[sync]}=backup(backups={b}) on {n[replica]}={r}: the backups must be smaller than the "
                        "replica axis ({r}), so that at least one replica's gradient is averaged; use backups < "
                        "{r}, e.g. backups={e}.", {**values, "b": spares, "e": r // 4 or 1}, SyncError)]
    return []


def _calls_needs(s: Setting) -> list[Problem]:
    """``steps_per_call`` K: the loop acts only between calls, so each of its intervals is a multiple of K."""
    k = s.steps_per_call
    bad = [(key, value) for key, value in s.intervals if k != 1 and value % k]
    if not bad:
        return []
    key, value = bad[0]
    return [Problem(("K",), ("steps_per_call", key),
                    "{n[" + key + "]}={value} is not a multiple of {n[steps_per_call]}={k}: each call runs {k} "
                    "optimizer steps and the loop logs, evaluates, checkpoints and stops only between calls. Make "
                    "it a multiple of {k}.", {"value": value, "k": k}, LoopError)]


def _ramp_needs(s: Setting) -> list[Problem]:
    """An adaptive batch ramp grows the batch toward the measured noise scale: it needs the measurement."""
    if s.ramp != "adaptive" or s.noise_scale_every is not None:
        return []
    return [Problem(("BR",), ("ramp", "noise_scale_every"),
                    "{n[ramp]} is adaptive: it grows the batch toward the measured gradient noise scale, but "
                    "{n[noise_scale_every]} is not set, so nothing is measured. Measure it every k steps, k at most "
                    "the ramp's every ({n[noise_scale_every]}=k; in Python the state's part "
                    "jaxpar.with_noise_scale(state, layout, every=k)), or use a fixed ramp.", {}, RampError)]


NEEDS = (strategy_needs, _pipeline_needs, _noise_scale_needs, _codec_needs, _sync_needs, _calls_needs, _ramp_needs)
"""The rules of one feature each, in the order :func:`jaxpar.compat.needs` runs them."""

#: What each rule of :data:`NEEDS` asks, in words, in their order: ``(feature code, what it needs,
#: error class)``, one line per problem a rule can give (``docs/strategies.md`` lists them;
#: ``tests/test_compat_needs.py`` checks each against a setting that lacks it).
REQUIREMENTS = (
    ("LC", "a codec (compression)", StrategyError),
    ("ST", "update_every and vertical_sync: schedule='pipedream' (weight stashing)", StrategyError),
    ("2B", "a pipe axis > 1", AsyncPipelineError),
    ("2B", "microbatches >= pipe", AsyncPipelineError),
    ("ST", "a pipe axis > 1", StashingError),
    ("ST", "update_every divides microbatches", StashingError),
    ("NS", "a data axis > 1 (data x fsdp >= 2)", NoiseScaleError),
    ("CP", "a data axis > 1 (data x fsdp >= 2)", CompressionError),
    ("RS", "replica >= the sync kind's minimum (2; synchronous: 1)", SyncError),
    ("RS", "backup(backups): backups < replica", SyncError),
    ("K", "the loop's intervals (steps, start, log_every, eval_every, checkpoint every, stop_check_every) "
          "multiples of steps_per_call", LoopError),
    ("BR", "an adaptive ramp: the noise scale (noise_scale_every)", RampError),
)
