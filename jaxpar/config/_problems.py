"""The checks' vocabulary: each appends a problem (a line naming the YAML key) to a list.

>>> p = []
>>> choice(p, "data.pack", "tight", ("best_fit", "first_fit", "none")); at_least(p, "data.batch_size", 0, 1)
>>> p
["data.pack='tight': unknown value; allowed: best_fit, first_fit, none.", 'data.batch_size=0: must be >= 1.']
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxpar.config._schema import ConfigError


def choice(problems: list[str], key: str, value: Any, allowed: Sequence[Any]) -> None:
    """A problem unless ``value`` is one of ``allowed``.

    Args:
      problems: the list the problem is appended to.
      key: the YAML key, dotted (``data.pack``).
      value: its value.
      allowed: the values it may take.
    """
    if value not in allowed:
        problems.append(f"{key}={value!r}: unknown value; allowed: {', '.join(map(str, allowed))}.")


def at_least(problems: list[str], key: str, value: Any, low: float) -> None:
    """A problem unless ``value`` is ``None`` or ``>= low``.

    Args:
      problems: the list the problem is appended to.
      key: the YAML key, dotted (``data.batch_size``).
      value: its value, or None (not set).
      low: the smallest allowed value.
    """
    if value is not None and value < low:
        problems.append(f"{key}={value!r}: must be >= {low}.")


def collect(problems: list[str], build: Callable[[], Any]) -> Any:
    """Build something, keeping its error as a problem.

    Args:
      problems: the list a :class:`ConfigError`'s message is appended to.
      build: a function of no arguments that builds the object or raises :class:`ConfigError`.

    Returns:
      ``build()``, or None when it raised.
    """
    try:
        return build()
    except ConfigError as e:
        problems.append(str(e))
        return None
