"""One helper for the context variables jaxpar sets while a step traces (rules, recorders, settings).

>>> import contextvars
>>> var = contextvars.ContextVar("example", default=None)
>>> with scoped(var, [1]) as value:
...     var.get() is value
True
>>> var.get() is None
True
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    """Set ``var`` to ``value`` inside the block, and back to what it was after.

    Args:
      var: the context variable to set.
      value: its value inside the block.

    Yields:
      ``value``.
    """
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
