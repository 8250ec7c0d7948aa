"""The checks' vocabulary: each appends a problem (a line naming the YAML key) to a list.

>>> p = []
>>> choice(p, "data.pack", "tight", ("best_fit", "first_fit", "none")); at_least(p, "data.batch_size", 0, 1)
>>> p
["data.pack='tight': unknown value; allowed: best_fit, first_fit, none.", 'data.batch_size=0: must be >= 1.']
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxpar.config.schema import ConfigError

__all__ = ["choice", "at_least", "collect"]


def choice(problems: list[str], key: str, value: Any, allowed: Sequence[Any]) -> None:
    """A problem unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        problems.append(f"{key}={value!r}: unknown value; allowed: {', '.join(map(str, allowed))}.")


def at_least(problems: list[str], key: str, value: Any, low: float) -> None:
    """A problem unless ``value`` is ``None`` or ``>= low``."""
    if value is not None and value < low:
        problems.append(f"{key}={value!r}: must be >= {low}.")


def collect(problems: list[str], build: Callable[[], Any]) -> Any:
    """``build()``, or None with its :class:`ConfigError` appended to ``problems``."""
    try:
        return build()
    except ConfigError as e:
        problems.append(str(e))
        return None
