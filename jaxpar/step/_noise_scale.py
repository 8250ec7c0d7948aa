"""The gradient noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018), estimated from two batch sizes.

McCandlish, Kaplan, Amodei and the OpenAI Dota team, *An Empirical Model of Large-Batch
Training* (arXiv:1812.06162), §2.2 and appendix A.1. ``G`` is the true gradient and ``Σ`` the
per-example gradient covariance; the gradient ``G_B`` of a batch of ``B`` examples drawn
independently has ``E|G_B|² = |G|² + tr(Σ) / B``. With the squared norms of gradients of two
batch sizes ``B_small < B_big`` the unbiased estimators are::

    |G|²  ≈  (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈  (|G_small|² − |G_big|²) / (1 / B_small − 1 / B_big)

In data-parallel training over ``N`` replicas ``B_small = B / N`` (one replica's batch) and
``B_big = B`` (the global batch); ``|G_small|²`` is the mean over the replicas of each
replica's squared gradient norm (``N`` draws: less variance than one). Each estimate alone is
noisy (``|G|²`` can come out negative), so, as in the paper, exponential moving averages of
``tr(Σ)`` and ``|G|²`` are kept separately (:func:`update`, bias-corrected like Adam's
moments) and ``B_simple`` is their ratio. ``B_simple`` is in the units of ``B`` (batch rows:
sequences for a language model; times the sequence length for tokens).

Here: the estimators and their moving averages (:func:`update`), the state part ``stats["noise_scale"]``
(:func:`noise_scale`, passed to ``init_train_state(parts=[...])``; how the step measures: docs/large_batch.md) and a PNG of the estimate.

Example::

    >>> state = init_state()
    >>> state, m = update(state, sq_small=5.0, sq_big=2.0, b_small=4, b_big=16, ema=0.9)
    >>> round(float(m["noise_grad_sq"]), 3), round(float(m["noise_trace"]), 3)   # (16*2 - 4*5) / 12, 3 / (1/4 - 1/16)
    (1.0, 16.0)
    >>> round(float(m["noise_scale"]), 3)                                        # B_simple = 16 / 1
    16.0
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxpar._text import agg_axes, save_plot
from jaxpar.step._state import PartLayout, add_parts, stats_part
from jaxpar.errors import NoiseScaleError, int_problem, is_number

#: The key of the noise-scale state in ``TrainState.stats``.
KEY = "noise_scale"
#: The metrics a measuring step reports (logged by :mod:`jaxpar.run._progress`).
METRICS = ("noise_scale", "grad_sq_small", "grad_sq_big", "noise_trace", "noise_grad_sq")


#: The moving averages' default decay.
EMA = 0.95


class Measure(NamedTuple):
    """How often the step measures (every ``every`` steps) and the moving averages' decay ``ema``."""

    every: int
    ema: float = EMA


def measure(every: Any, ema: Any, owner: str) -> Measure:
    """The part's :class:`Measure`: ``every`` an int >= 1 and ``ema`` a float in [0, 1).

    Args:
      every: measure every that many steps.
      ema: the moving averages' decay.
      owner: the function named in an error.

    Returns:
      ``Measure(every, ema)``.

    Raises:
      NoiseScaleError: naming the bad option and what it must be.

    >>> measure(0, 0.95, "with_noise_scale")
    Traceback (most recent call last):
    ...
    jaxpar.errors.NoiseScaleError: with_noise_scale(every=0): must be an int >= 1 ...
    """
    if int_problem(every, 1) is not None:
        raise NoiseScaleError(f"{owner}(every={every!r}): must be an int >= 1 (measure every that many "
                              "steps); to measure nothing, build the state without the noise-scale part.")
    if not is_number(ema) or not 0 <= ema < 1:
        raise NoiseScaleError(f"{owner}(ema={ema!r}): must be a float in [0, 1), the decay of the moving "
                              "averages of tr(Σ) and |G|² per measurement (0: no averaging; e.g. 0.95).")
    return Measure(every, ema)


def init_state() -> dict:
    """The running state before any measurement: the two moving averages and the number of measurements.

    >>> sorted(init_state())
    ['count', 'ema_grad_sq', 'ema_trace']
    """
    return {"ema_trace": jnp.zeros((), jnp.float32), "ema_grad_sq": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.int32)}


def noise_scale_of(state: dict):
    """``B_simple`` of a running state.

    Args:
      state: the running state (:func:`init_state`, :func:`update`).

    Returns:
      A float32 scalar: the ratio of the moving averages, in batch rows (NaN before any measurement).
    """
    return jnp.where(state["count"] > 0, state["ema_trace"] / state["ema_grad_sq"], jnp.nan)


def update(state: dict, sq_small, sq_big, b_small: int, b_big: int, ema: float) -> tuple[dict, dict]:
    """Fold one measurement into the moving averages.

    Args:
      state: the running state (:func:`init_state`).
      sq_small: mean over the replicas of each replica's squared gradient norm (batch ``b_small``).
      sq_big: the squared norm of the global gradient (batch ``b_big``).
      b_small, b_big: one replica's batch and the global batch (rows).
      ema: the moving averages' decay per measurement, in [0, 1).

    Returns:
      ``(state, metrics)``: the new running state, and float32 scalars named :data:`METRICS`;
      ``noise_trace`` and ``noise_grad_sq`` are the bias-corrected averages (divided by
      ``1 - ema**count``), ``noise_scale`` their ratio.
    """
    sq_small, sq_big = jnp.asarray(sq_small, jnp.float32), jnp.asarray(sq_big, jnp.float32)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)                # the module docstring's estimators
    grad_sq = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    new = {"ema_trace": ema * state["ema_trace"] + (1 - ema) * trace,
           "ema_grad_sq": ema * state["ema_grad_sq"] + (1 - ema) * grad_sq,
           "count": state["count"] + 1}
    correction = 1 - jnp.float32(ema) ** new["count"].astype(jnp.float32)
    metrics = {"noise_scale": noise_scale_of(new), "grad_sq_small": sq_small, "grad_sq_big": sq_big,
               "noise_trace": new["ema_trace"] / correction, "noise_grad_sq": new["ema_grad_sq"] / correction}
    return new, metrics


def noise_scale(*, every: int, ema: float = EMA) -> PartLayout:
    """The noise-scale measurement as a state part: fresh moving averages in ``stats["noise_scale"]``
    (replicated scalars), moved by a second program every ``every`` steps from the step's two squared norms:
    ``init_train_state(..., parts=[noise_scale(every=k)])``.

    Args:
      every: measure every that many steps (the step runs a second program then); required. A run
        that measures nothing builds its state without this part (a checkpoint's measurements are
        then dropped, with a warning).
      ema: the moving averages' decay per measurement, in [0, 1).

    Returns:
      The part.

    Raises:
      NoiseScaleError: naming a bad ``every`` or ``ema``.
    """
    return _part(measure(every, ema, "noise_scale"))


def _part(m: Measure) -> PartLayout:
    def after_step(value, batch, metrics, measured, replicas):
        """The moving averages moved by a measuring step's two squared norms (``metrics``' ``grad_sq_small`` /
        ``grad_sq_big``, replaced by :data:`METRICS`)."""
        if not measured:
            return value, metrics
        metrics = dict(metrics)
        sq_small, sq_big = metrics.pop("grad_sq_small"), metrics.pop("grad_sq_big")
        b_big = jax.tree.leaves(batch)[0].shape[0]
        new, measured_ = update(value, sq_small, sq_big, b_big // replicas, b_big, m.ema)
        return new, {**metrics, **measured_}

    return stats_part(KEY, init_state, options=m, setting={"noise_scale_every": m.every}, every=m.every,
                      after_step=after_step)


def with_noise_scale(state, layout, *, every: int, ema: float = EMA) -> tuple[Any, Any]:
    """``(state, layout)`` with the :func:`noise_scale` part added to a state made without it (call it before
    restoring a checkpoint); ``make_train_step`` reads ``every`` and ``ema`` from the layout.

    Args:
      state: the train state.
      layout: its layout.
      every: as in :func:`noise_scale`.
      ema: as in :func:`noise_scale`.

    Returns:
      The state and layout with the part.

    Raises:
      NoiseScaleError: naming a bad ``every`` or ``ema``.

    >>> import jax, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models._mlp import MLPClassifier
    >>> mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> model_fn = lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=3, depth=1, rngs=nnx.Rngs(0))
    >>> state, layout = with_noise_scale(*jaxpar.init_train_state(model_fn, optax.sgd(0.1), mesh), every=10)
    >>> int(state.stats["noise_scale"]["count"]), layout.parts[KEY].options
    (0, Measure(every=10, ema=0.95))
    """
    return add_parts(state, layout, [_part(measure(every, ema, "with_noise_scale"))])


def noise_scale_value(state: Any) -> float | None:
    """``B_simple`` the state measures (``None``: it keeps no noise-scale part): what an adaptive ramp reads."""
    stats = state.stats
    return float(noise_scale_of(stats[KEY])) if isinstance(stats, dict) and KEY in stats else None


def plot_noise_scale(path: str | Path, steps: Sequence[int], values: Sequence[float], *,
                     batch: int | None = None, title: str = "gradient noise scale") -> str:
    """Write a PNG of ``B_simple`` over training (log scale where all values are positive).

    Args:
      path: the PNG file to write.
      steps: the steps of the measurements.
      values: ``B_simple`` at those steps; non-finite ones are left out.
      batch: the global batch, drawn as a dashed line (``None``: none).
      title: the plot's title.

    Returns:
      ``path`` as a string.
    """
    fig, ax = agg_axes()
    pts = [(s, v) for s, v in zip(steps, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    ax.plot([s for s, _ in pts], [v for _, v in pts], "o-", ms=3, lw=1.2, label="B_simple = tr(Σ) / |G|² (EMA)")
    if batch:
        ax.axhline(batch, ls="--", color="gray", lw=1, label=f"global batch {batch}")
    if pts and all(v > 0 for _, v in pts):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="noise scale (examples)", title=title)
    return save_plot(fig, ax, path)
