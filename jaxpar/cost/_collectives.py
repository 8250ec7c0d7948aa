"""Alpha-beta(-gamma) time of collectives, algorithm by algorithm (Thakur, Rabenseifner & Gropp 2005).

The formulas, the fold for ``p`` not a power of two and the shared-memory algorithms are in
docs/planning.md §1. ``n`` is always the size in bytes of the *whole* buffer one process holds.

Example::

    >>> link = Link(alpha=1e-6, beta=1e-9)            # 1 us, 1 GB/s
    >>> round(time("all-reduce", 2**30, 8, link, "ring") * 1e3, 3)     # ms: 2*7us + 2*7/8 GiB / GB/s
    1879.062
    >>> best("all-reduce", 1024, 8, link)[0], best("all-reduce", 2**30, 8, link)[0]
    ('recursive-doubling', 'rabenseifner')
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxpar.errors import CostModelError, finite_number, int_problem

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

#: Algorithms of each kind (``lower-bound`` is a bound, never chosen by :func:`best`).
ALGORITHMS = {
    "all-reduce": ("ring", "tree", "recursive-doubling", "rabenseifner", "lower-bound"),
    "reduce-scatter": ("ring", "recursive-halving", "lower-bound"),
    "all-gather": ("ring", "recursive-doubling", "bruck", "lower-bound"),
    "all-to-all": ("pairwise", "bruck", "lower-bound"),
    "collective-permute": ("direct", "lower-bound"),
}

#: Algorithms of a shared-memory link (``Link(shared_memory=True)``), docs/planning.md §1.
SHARED_MEMORY_ALGORITHMS = {
    "all-reduce": ("one-shot", "two-shot"),
    "reduce-scatter": ("one-shot",),
    "all-gather": ("one-shot",),
    "all-to-all": ("one-shot",),
    "collective-permute": ("one-shot",),
}


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` s per message, ``beta`` s per byte, ``gamma`` s per byte reduced;
    ``shared_memory``: collectives read peers' buffers after one rendezvous (docs/planning.md §1).

    >>> Link.from_bandwidth(alpha=5e-6, bandwidth=50e9).beta
    2e-11
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    shared_memory: bool = False

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not finite_number(value) or value < 0:
                raise CostModelError(f"Link.{name}={value!r}: must be a finite number >= 0 (seconds"
                                     f"{' per message' if name == 'alpha' else ' per byte'}).")

    @classmethod
    def from_bandwidth(cls, alpha: float, bandwidth: float, reduce_bandwidth: float | None = None,
                       shared_memory: bool = False) -> "Link":
        """``bandwidth`` in bytes/s (one direction, per device); ``reduce_bandwidth`` bytes/s reduced.

        Args:
          alpha: seconds per message.
          bandwidth: bytes/s sent.
          reduce_bandwidth: bytes/s reduced, or ``None`` (no reduction cost).
          shared_memory: the processes share memory (one node's devices).

        Returns:
          The :class:`Link`.
        """
        for name, value in (("bandwidth", bandwidth), ("reduce_bandwidth", reduce_bandwidth)):
            if value is not None and (not finite_number(value) or value <= 0):
                raise CostModelError(f"Link.from_bandwidth({name}={value!r}): must be a positive number of bytes/s, "
                                     f"e.g. 50e9 for 50 GB/s.")
        return cls(alpha, 1.0 / bandwidth, 0.0 if reduce_bandwidth is None else 1.0 / reduce_bandwidth,
                   bool(shared_memory))


def _check(kind: str, n: float, p: int) -> None:
    if kind not in ALGORITHMS:
        raise CostModelError(f"kind={kind!r}: choose one of {', '.join(KINDS)}.")
    if not finite_number(n) or n < 0:
        raise CostModelError(f"n={n!r}: the buffer size must be a number of bytes >= 0.")
    if int_problem(p, 1):
        raise CostModelError(f"p={p!r}: the number of processes must be a positive int.")


def time(kind: str, n: float, p: int, link: Link, algorithm: str = "best") -> float:
    """Seconds for one ``kind`` collective of ``n`` bytes over ``p`` processes on ``link``.

    Args:
      kind: one of :data:`KINDS`.
      n: bytes of the whole buffer of one process.
      p: the number of processes.
      link: the link.
      algorithm: one of ``ALGORITHMS[kind]``, or ``"best"``: the fastest of :data:`ALGORITHMS`
        (the bound excluded).

    Returns:
      Seconds.

    >>> time("all-gather", 8 * 2**20, 8, Link(1e-5, 1e-10), "ring") == 7e-5 + 7 / 8 * 8 * 2**20 * 1e-10
    True
    """
    _check(kind, n, p)
    if algorithm == "best":
        return _best(kind, n, p, link)[1]
    if algorithm not in ALGORITHMS[kind] + SHARED_MEMORY_ALGORITHMS[kind]:
        raise CostModelError(f"algorithm={algorithm!r} is not an algorithm of {kind}; choose one of "
                             f"{', '.join(ALGORITHMS[kind] + SHARED_MEMORY_ALGORITHMS[kind])} or 'best'.")
    if p == 1:
        return 0.0
    return _formula(kind, algorithm, n, p, link)


def _formula(kind: str, algorithm: str, n: float, p: int, link: Link) -> float:
    """Seconds of one (checked) algorithm over ``p > 1`` processes: the table of docs/planning.md §1."""
    a, b, g = link.alpha, link.beta, link.gamma
    frac = (p - 1) / p
    if algorithm in ("one-shot", "two-shot"):
        if kind == "all-reduce":
            return a + (p - 1) * n * (b + g) if algorithm == "one-shot" else 2 * a + 2 * frac * n * b + frac * n * g
        if kind == "reduce-scatter":
            return a + frac * n * (b + g)
        return a + (n * b if kind == "collective-permute" else frac * n * b)
    lg = math.ceil(math.log2(p))          # p > 1
    q = 1 << (p.bit_length() - 1)         # the largest power of 2 <= p
    fold = p != q
    if kind == "all-reduce":
        if algorithm == "ring":
            return 2 * (p - 1) * a + 2 * frac * n * b + frac * n * g
        if algorithm == "tree":
            return 2 * lg * (a + n * b) + lg * n * g
        if algorithm == "recursive-doubling":
            return math.log2(q) * (a + n * b + n * g) + (2 * a + 2 * n * b + n * g) * fold
        if algorithm == "rabenseifner":
            fq = (q - 1) / q
            return 2 * math.log2(q) * a + 2 * fq * n * b + fq * n * g + (2 * a + 2 * n * b + n * g) * fold
        return lg * a + 2 * frac * n * b + frac * n * g
    if kind == "reduce-scatter":
        if algorithm == "ring":
            return (p - 1) * a + frac * n * (b + g)
        if algorithm == "recursive-halving":
            fq = (q - 1) / q
            return math.log2(q) * a + fq * n * (b + g) + (2 * a + n * b + n * b / p + n * g) * fold
        return lg * a + frac * n * (b + g)
    if kind == "all-gather":
        if algorithm == "ring":
            return (p - 1) * a + frac * n * b
        if algorithm == "recursive-doubling":
            return math.inf if fold else lg * a + frac * n * b
        return lg * a + frac * n * b          # bruck and the lower bound
    if kind == "all-to-all":
        if algorithm == "pairwise":
            return (p - 1) * a + frac * n * b
        if algorithm == "bruck":
            return lg * a + lg * n / 2 * b
        return lg * a + frac * n * b
    return a + n * b       # permute: one message of n bytes (direct), which is also its own bound


def algorithm_times(kind: str, n: float, p: int, link: Link) -> dict[str, float]:
    """``{algorithm: seconds}`` for every algorithm of ``kind`` on ``link`` (the lower bound included,
    except on a shared-memory link).

    Args:
      kind: one of :data:`KINDS`.
      n: bytes of the whole buffer of one process.
      p: the number of processes.
      link: the link.

    Returns:
      Algorithm name -> seconds.

    >>> sorted(algorithm_times("reduce-scatter", 1024, 4, Link(1e-6, 1e-9)))
    ['lower-bound', 'recursive-halving', 'ring']
    >>> sorted(algorithm_times("all-reduce", 1024, 4, Link(1e-6, 1e-9, shared_memory=True)))
    ['one-shot', 'two-shot']
    """
    _check(kind, n, p)
    algs = SHARED_MEMORY_ALGORITHMS[kind] if link.shared_memory else ALGORITHMS[kind]
    return {alg: time(kind, n, p, link, alg) for alg in algs}


def best(kind: str, n: float, p: int, link: Link) -> tuple[str, float]:
    """``(algorithm, seconds)`` of the fastest algorithm for this size, as NCCL / MPICH pick by size.

    Args:
      kind: one of :data:`KINDS`.
      n: bytes of the whole buffer of one process.
      p: the number of processes.
      link: the link.

    Returns:
      The algorithm's name and its seconds.

    >>> best("all-gather", 2**30, 6, Link(1e-6, 1e-9))[0]      # not a power of 2: no recursive doubling
    'bruck'
    """
    _check(kind, n, p)
    return _best(kind, n, p, link)


@functools.lru_cache(maxsize=65536)
def _best(kind: str, n: float, p: int, link: Link) -> tuple[str, float]:
    """:func:`best` for checked arguments, memoised: a planner asks the same few (size, group, link)
    questions for thousands of candidate plans."""
    times = {k: v for k, v in algorithm_times(kind, n, p, link).items() if k != "lower-bound"}
    name = min(times, key=times.get)      # the first of equally fast ones
    return name, times[name]
