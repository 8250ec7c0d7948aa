"""How K model replicas (the ``replica`` mesh axis) are kept in step: the synchronisation kinds.

Each kind is a small frozen object made by a factory with keyword options, checked when made:

* :func:`synchronous`: average the replicas' gradients every step (data parallelism over
  ``replica``; the baseline the others reduce to);
* :func:`diloco` / :func:`local_sgd`: ``every`` = H inner steps with no communication over
  ``replica``, then the pseudo-gradient ``outer - mean(replicas)`` goes through an outer optax
  optimizer (Douillard et al. 2023: Nesterov SGD, lr 0.7, momentum 0.9; plain model averaging:
  SGD lr 1);
* :func:`easgd`: every ``every`` steps each replica is pulled toward a centre variable by
  ``alpha`` and the centre moves by ``alpha`` times the sum of the differences (Zhang et al. 2015);
* :func:`stale`: stale-synchronous parallel (Ho et al. 2013): replica ``r``'s gradient is computed
  on the parameters of ``delay_r <= max_delay`` steps ago; ``mode='async'`` applies each replica's
  gradient on its own, in turn, on the newest parameters (an asynchronous parameter server);
* :func:`backup`: ``backups`` extra replicas; a seeded straggler model gives each replica's compute
  time and the update averages the fastest ``K - backups`` (Chen et al. 2016).

Delays and straggler times are drawn from ``seed`` and the step number, so a run is reproducible
and a resumed run draws the same ones.

    >>> s = diloco(every=50)
    >>> s.name, s.every, s.outer_options
    ('diloco-h50', 50, {'outer_lr': 0.7, 'outer_momentum': 0.9, 'nesterov': True})
    >>> stale(max_delay=-1)
    Traceback (most recent call last):
    ...
    jaxpar.errors.SyncError: stale(max_delay=-1): the largest delay in steps must be an int >= 0, e.g. max_delay=4.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from jaxpar.errors import SyncError, int_problem, is_number


def _int(name: str, option: str, value: Any, low: int, example: str) -> int:
    if int_problem(value, low) is not None:
        raise SyncError(f"{name}({option}={value!r}): {example}")
    return value


def _float(name: str, option: str, value: Any, low: float, high: float, example: str) -> float:
    if not is_number(value) or not low <= value <= high:
        raise SyncError(f"{name}({option}={value!r}): {example}")
    return float(value)


@dataclass(frozen=True)
class Synchronous:
    """Gradients averaged over ``replica`` every step."""

    kind = name = "sync"
    min_replicas = 1


@dataclass(frozen=True)
class DiLoCo:
    """``every`` inner steps, then the outer step on the averaged pseudo-gradient; before
    ``start_step``, synchronous (gradients averaged every step)."""

    every: int
    outer: optax.GradientTransformation
    outer_options: Mapping[str, Any] = field(default_factory=dict)
    label: str = "diloco"
    start_step: int = 0
    kind = "diloco"
    min_replicas = 2

    @property
    def name(self) -> str:
        return f"{self.label}-h{self.every}" + (f"-from{self.start_step}" if self.start_step else "")


@dataclass(frozen=True)
class EASGD:
    """Elastic averaging every ``every`` steps with moving rate ``alpha``."""

    alpha: float
    every: int
    kind = "easgd"
    min_replicas = 2

    @property
    def name(self) -> str:
        return f"easgd-a{self.alpha:g}-t{self.every}"


@dataclass(frozen=True)
class Stale:
    """Per-replica gradient delays ``<= max_delay``: seeded uniform draws, or a fixed ``pattern``
    (rows = steps, cycled; columns = replicas)."""

    max_delay: int
    pattern: tuple | None = None
    mode: str = "ssp"
    seed: int = 0
    kind = "stale"
    min_replicas = 2

    @property
    def name(self) -> str:
        return f"stale-s{self.max_delay}" + ("-async" if self.mode == "async" else "")

    def delays(self, step: jax.Array, replicas: int) -> jax.Array:
        """int32 ``[replicas]``: this step's delays, clipped to ``step`` (no version before the first).

        Args:
          step: the step (traced).
          replicas: the replica axis size.

        Returns:
          The delays in steps.
        """
        if self.pattern is not None:
            table = jnp.asarray(self.pattern, jnp.int32)
            d = table[step % table.shape[0]]
        else:
            key = jax.random.fold_in(jax.random.key(self.seed), step)
            d = jax.random.randint(key, (replicas,), 0, self.max_delay + 1, jnp.int32)
        return jnp.minimum(d, step)


STRAGGLERS = ("lognormal", "spike")


@dataclass(frozen=True)
class Backup:
    """``backups`` of the K replicas are spares: each step averages the K - backups fastest."""

    backups: int
    straggler: str = "lognormal"
    sigma: float = 0.5
    p: float = 0.1
    slowdown: float = 4.0
    seed: int = 0
    kind = "backup"
    min_replicas = 2

    @property
    def name(self) -> str:
        return f"backup-b{self.backups}"

    def times(self, step: jax.Array, replicas: int) -> jax.Array:
        """float32 ``[replicas]``: this step's modelled compute time of each replica (mean step = 1).
        ``lognormal``: ``exp(sigma * z - sigma**2 / 2)``; ``spike``: 1, or ``slowdown`` with
        probability ``p``.

        Args:
          step: the step (traced).
          replicas: the replica axis size.

        Returns:
          The times.
        """
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        if self.straggler == "lognormal":
            z = jax.random.normal(key, (replicas,), jnp.float32)
            return jnp.exp(self.sigma * z - 0.5 * self.sigma ** 2)
        slow = jax.random.uniform(key, (replicas,)) < self.p
        return jnp.where(slow, jnp.float32(self.slowdown), jnp.float32(1.0))


def synchronous() -> Synchronous:
    """Data parallelism over ``replica``: every step averages the replicas' gradients."""
    return Synchronous()


def diloco(every: int = 50, *, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
           outer: optax.GradientTransformation | None = None, start_step: int = 0) -> DiLoCo:
    """DiLoCo (Douillard et al. 2023): ``every`` inner steps per replica, then the outer step
    ``outer.update(outer_params - mean(replicas))``.

    Args:
      every: inner steps between syncs (H), >= 1.
      outer_lr: the default outer optimizer's learning rate, > 0.
      outer_momentum: its momentum, in [0, 1) (0: none).
      nesterov: Nesterov momentum.
      outer: an optax transformation that replaces the default Nesterov SGD(``outer_lr``,
        ``outer_momentum``), or ``None``.
      start_step: synchronous steps (gradients averaged every step) before the first inner phase,
        as DiLoCo starts from a pretrained model and post-local SGD (Lin et al. 2020) from a
        synchronous phase.

    Returns:
      The :class:`DiLoCo` kind.
    """
    every = _int("diloco", "every", every, 1, "the inner steps between syncs (H) must be an int >= 1, e.g. every=50.")
    start_step = _int("diloco", "start_step", start_step, 0, "the synchronous steps before the first inner phase "
                      "must be an int >= 0, e.g. start_step=100.")
    if outer is None:
        lr = _float("diloco", "outer_lr", outer_lr, 1e-12, 1e6, "the outer learning rate must be > 0, e.g. 0.7.")
        mom = _float("diloco", "outer_momentum", outer_momentum, 0.0, 0.999999,
                     "the outer momentum must lie in [0, 1), e.g. 0.9 (0 = none).")
        options = {"outer_lr": lr, "outer_momentum": mom, "nesterov": bool(nesterov)}
        outer = optax.sgd(lr, momentum=mom or None, nesterov=bool(nesterov) and mom > 0)
    elif not isinstance(outer, optax.GradientTransformation):
        raise SyncError(f"diloco(outer={type(outer).__name__}): the outer optimizer must be an optax "
                        "GradientTransformation (e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)), with init / "
                        "update; got an object without them.")
    else:
        options = {"outer": "custom"}
    return DiLoCo(every, outer, options, start_step=start_step)


def local_sgd(every: int = 10, *, start_step: int = 0) -> DiLoCo:
    """Local SGD / periodic model averaging: DiLoCo with an outer SGD of lr 1 and no momentum
    (``start_step``: post-local SGD, synchronous before it).

    Args:
      every: inner steps between averages, >= 1.
      start_step: synchronous steps before the first inner phase.

    Returns:
      The :class:`DiLoCo` kind, named ``local_sgd``.
    """
    return replace(diloco(every, outer_lr=1.0, outer_momentum=0.0, nesterov=False, start_step=start_step),
                   label="local_sgd")


def easgd(alpha: float = 0.1, every: int = 1) -> EASGD:
    """Elastic averaging SGD (Zhang et al. 2015), synchronous form, every ``every`` steps.

    Args:
      alpha: the moving rate, in [0, 1] (0: independent replicas); ``alpha * replicas <= 1`` keeps the
        centre stable.
      every: steps between elastic updates (tau), >= 1.

    Returns:
      The :class:`EASGD` kind.
    """
    alpha = _float("easgd", "alpha", alpha, 0.0, 1.0, "the moving rate must lie in [0, 1], e.g. alpha=0.1 "
                   "(0: independent replicas); alpha x replicas <= 1 keeps the centre stable.")
    every = _int("easgd", "every", every, 1, "the steps between elastic updates (tau) must be an int >= 1.")
    return EASGD(alpha, every)


def stale(max_delay: int = 4, *, pattern=None, mode: str = "ssp", seed: int = 0) -> Stale:
    """Bounded staleness: replica ``r`` computes its gradient on the parameters of ``delay_r``
    steps ago, ``delay_r`` uniform in ``0..max_delay`` each step (or ``pattern[step % len][r]``).

    Args:
      max_delay: the largest delay in steps, >= 0.
      pattern: a table of delays, one row per step (cycled) and one column per replica, each in
        ``0..max_delay``; or ``None``: drawn.
      mode: ``"ssp"`` (delayed gradients averaged, one update per step) or ``"async"`` (each replica's
        gradient applied in turn on the newest parameters).
      seed: the draws' seed, >= 0.

    Returns:
      The :class:`Stale` kind.
    """
    max_delay = _int("stale", "max_delay", max_delay, 0, "the largest delay in steps must be an int >= 0, "
                     "e.g. max_delay=4.")
    if mode not in ("ssp", "async"):
        raise SyncError(f"stale(mode={mode!r}): choose 'ssp' (delayed gradients averaged, one update per step) "
                        "or 'async' (each replica's gradient applied in turn on the newest parameters).")
    if pattern is not None:
        rows = tuple(tuple(int(d) for d in row) for row in pattern)
        bad = [d for row in rows for d in row if not 0 <= d <= max_delay]
        if not rows or len({len(r) for r in rows}) != 1 or bad:
            raise SyncError(f"stale(pattern={pattern!r}): give a non-empty table of delays, one row per step "
                            f"(cycled) and one column per replica, each in 0..max_delay={max_delay}"
                            + (f"; out of range: {sorted(set(bad))}" if bad else "") + ".")
        pattern = rows
    return Stale(max_delay, pattern, mode, _int("stale", "seed", seed, 0, "the seed must be an int >= 0."))


def backup(backups: int = 1, *, straggler: str = "lognormal", sigma: float = 0.5, p: float = 0.1,
           slowdown: float = 4.0, seed: int = 0) -> Backup:
    """Backup workers: the update averages the ``K - backups`` replicas that the straggler model
    says finished first (``lognormal(sigma)`` or ``spike(p, slowdown)`` compute times).

    Args:
      backups: the backup replicas, >= 0 and smaller than the replica axis.
      straggler: ``"lognormal"`` or ``"spike"``.
      sigma: the lognormal spread, in [0, 10].
      p: the probability of a slow step (``spike``), in [0, 1].
      slowdown: a slow step's time factor (``spike``), >= 1.
      seed: the draws' seed, >= 0.

    Returns:
      The :class:`Backup` kind.
    """
    backups = _int("backup", "backups", backups, 0, "the number of backup replicas must be an int >= 0 and "
                   "smaller than the replica axis.")
    if straggler not in STRAGGLERS:
        raise SyncError(f"backup(straggler={straggler!r}): choose one of {STRAGGLERS}.")
    sigma = _float("backup", "sigma", sigma, 0.0, 10.0, "the lognormal spread must lie in [0, 10], e.g. 0.5.")
    p = _float("backup", "p", p, 0.0, 1.0, "the probability of a slow step must lie in [0, 1], e.g. 0.1.")
    slowdown = _float("backup", "slowdown", slowdown, 1.0, 1e6, "a slow step's time factor must be >= 1, e.g. 4.")
    return Backup(backups, straggler, sigma, p, slowdown, _int("backup", "seed", seed, 0, "the seed must be an int >= 0."))


SYNC_KINDS = {"sync": synchronous, "diloco": diloco, "local_sgd": local_sgd, "easgd": easgd, "stale": stale,
              "backup": backup}


def make_sync(options: Mapping[str, Any]):
    """A kind from a mapping such as ``{"kind": "diloco", "every": 50}`` (YAML ``parallel.sync``).

    Args:
      options: ``kind`` (a key of :data:`SYNC_KINDS`) and its factory's keyword options (not ``outer``).

    Returns:
      The kind.
    """
    options = dict(options)
    kind = options.pop("kind", None)
    if kind not in SYNC_KINDS:
        raise SyncError(f"sync kind {kind!r}: choose one of {tuple(SYNC_KINDS)}, e.g. {{kind: diloco, every: 50}}.")
    import inspect

    allowed = set(inspect.signature(SYNC_KINDS[kind]).parameters) - {"outer"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise SyncError(f"sync kind {kind!r}: unknown option(s) {unknown}; it takes {sorted(allowed)}.")
    return SYNC_KINDS[kind](**options)


def check_sync(sync: Any) -> None:
    """Raise :class:`SyncError` if ``sync`` is not a kind of this module. (What a kind needs of the
    mesh, a ``replica`` axis of ``min_replicas`` and more replicas than ``backups``, is the
    compatibility table's: :mod:`jaxpar.compat._needs`.)

    Args:
      sync: the value of ``Strategy(sync=...)``.
    """
    if not isinstance(sync, (Synchronous, DiLoCo, EASGD, Stale, Backup)):
        raise SyncError(f"Strategy.sync={sync!r}: use a kind of jaxpar.parallel.sync (synchronous(), diloco(every=50), "
                        "local_sgd(), easgd(alpha), stale(max_delay), backup(backups)).")
