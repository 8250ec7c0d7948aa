"""How :func:`jaxpar.attention.attention` parallelises over the ``context`` mesh axis.

The method and the load balancing are a context setting, not arguments of the model's code: a model
calls ``attention(q, k, v)`` the same way under every strategy, and the train step (or a user) opens
:func:`use_context_parallel` around the step, as it opens :func:`jaxpar.use_rules`. Outside any
``use_context_parallel`` block the setting is ``ContextParallel()``: ring attention, not balanced.

``balance=True`` is a contract with the data: the batch's sequence dimension must have been put into
the balanced (zig-zag) order by :func:`jaxpar.parallel.context.to_balanced` (tokens, targets, segment ids and
positions alike). The attention then computes its masks from the true positions of the tokens each
device holds. ``balance=False`` (the default) expects the natural order, so a model whose data was not
permuted is never silently wrong, only unbalanced.

Example::

    >>> with use_context_parallel("ulysses", balance=True):
    ...     current_context_parallel()
    ContextParallel(method='ulysses', balance=True)
    >>> current_context_parallel().method
    'ring'
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import ContextManager

from jaxpar.rules import scoped
from jaxpar.options import ContextParallel

_SETTING: contextvars.ContextVar = contextvars.ContextVar("jaxpar_context_parallel", default=ContextParallel())


def use_context_parallel(method: str = "ring", *, balance: bool = False) -> ContextManager[ContextParallel]:
    """Use ``method`` (and ``balance``) for :func:`jaxpar.attention.attention` inside this block.

    It only matters where the mesh of :func:`jaxpar.use_rules` has a ``context`` axis of size > 1.
    Like the rules, it is read when a function is traced: open it around ``jax.jit(...)``'s first
    call (or its ``lower``). ``jax.jit`` caches the trace, so a function already traced keeps the
    method it was traced with; jit a new function to change it.

    Args:
      method: one of :data:`jaxpar.options.CONTEXT_METHODS`.
      balance: the batch is in the order of :func:`jaxpar.parallel.context.to_balanced` (see the module).

    Returns:
      A context manager that yields the :class:`ContextParallel` setting.
    """
    return scoped(_SETTING, ContextParallel(method, balance))


def current_context_parallel() -> ContextParallel:
    """The setting of the innermost :func:`use_context_parallel` block, or ``ContextParallel()``."""
    return _SETTING.get()


@dataclass
class ContextCalls:
    """What a traced function asked of context parallelism: ``attention`` calls that ran over a
    ``context`` axis, and ``order`` calls (:func:`jaxpar.parallel.context.sequence_order`) that laid the
    sequence out for it. The train step checks them: a model that never calls
    :func:`jaxpar.attention.attention` under a ``context`` axis, or ignores the balanced order, is
    refused rather than silently gathered or silently wrong."""

    attention: int = 0
    order: int = 0


_CALLS: contextvars.ContextVar = contextvars.ContextVar("jaxpar_context_calls", default=None)


def count_context_calls() -> ContextManager[ContextCalls]:
    """Count the context-parallel calls traced inside this block.

    >>> with count_context_calls() as calls:
    ...     note_context_call("attention")
    >>> calls
    ContextCalls(attention=1, order=0)
    """
    return scoped(_CALLS, ContextCalls())


def note_context_call(kind: str) -> None:
    """Record one ``kind`` call (``"attention"`` or ``"order"``) in the innermost :func:`count_context_calls`.

    Args:
      kind: ``"attention"`` or ``"order"``.
    """
    calls = _CALLS.get()
    if calls is not None:
        setattr(calls, kind, getattr(calls, kind) + 1)
