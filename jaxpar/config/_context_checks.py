"""Context parallelism's rules in YAML keys: the sequence and the heads a ``context`` axis splits, and a
``parallel.context`` that has no ``context`` axis to run on.

The rules are the library's, raised when the step is traced: :func:`jaxpar.parallel.context._zigzag.check_length`
(``model.seq_len`` a multiple of ``mesh.context``, of ``2 x mesh.context`` in the balanced layout) and
:func:`jaxpar.parallel.context.ulysses_kv_repeat` (Ulysses: the query heads on a device a multiple of
``mesh.context``). :func:`jaxpar.config.check` calls them with the config's sizes and renders their messages
with the YAML keys, so that ``check`` refuses what ``train`` would, before anything is compiled.

Example::

    >>> print(seq_len_problem(1004, 4, True))       # doctest: +NORMALIZE_WHITESPACE
    model.seq_len=1004 is not divisible by 8 (balanced layout (parallel.context.balance=true), 2*C = 8 chunks
    over mesh.context=4). Fix: pad or cut the sequence to a multiple of 8 (e.g. model.seq_len=1008), or change
    mesh.context or set parallel.context.balance=false.
    >>> print(ulysses_heads_problem(2, 2, 4, 1, "model.heads"))     # doctest: +NORMALIZE_WHITESPACE
    model.heads=2 with mesh.tensor=1 and parallel.context.method=ulysses: the 2 query heads on each device are
    not divisible by mesh.context=4 (Ulysses gives each device heads / 4 heads). Fix:
    parallel.context.method=ring or all_gather, a mesh.context that divides 2, or a smaller mesh.tensor.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from jaxpar.errors import ContextParallelError


def _relabel(message: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """``message`` with each regex of ``pairs`` replaced by its YAML wording."""
    for pattern, repl in pairs:
        message = re.sub(pattern, repl, message)
    return message


def seq_len_problem(seq_len: int, context: int, balance: bool) -> str | None:
    """Why ``mesh.context`` cannot split ``model.seq_len`` (the library's
    :func:`~jaxpar.parallel.context._zigzag.check_length`), in YAML keys; None when it can.

    Args:
      seq_len: ``model.seq_len``.
      context: ``mesh.context`` (> 1).
      balance: ``parallel.context.balance``.

    Returns:
      The problem, or None.
    """
    from jaxpar.parallel.context._zigzag import check_length

    try:
        check_length(seq_len, context, balance, what="model.seq_len")
    except ContextParallelError as e:
        return _relabel(str(e), (
            (rf"^model\.seq_len {seq_len}\b", f"model.seq_len={seq_len}"),
            (r"balanced layout,", "balanced layout (parallel.context.balance=true),"),
            (r"\(C = ", "(natural order (parallel.context.balance=false), C = "),
            (rf"(a )?context axis of size {context}\b", f"mesh.context={context}"),
            (r"\(e\.g\. (\d+)\)", r"(e.g. model.seq_len=\1)"),
            (r"change the context axis size", "change mesh.context"),
            (r"turn balance off", "set parallel.context.balance=false")))
    return None


def ulysses_heads_problem(heads: int, kv_heads: int, context: int, tensor: int, key: str) -> str | None:
    """Why Ulysses cannot split the query heads over ``mesh.context`` (the library's
    :func:`~jaxpar.parallel.context.ulysses_kv_repeat`, on the heads a device holds after ``mesh.tensor``'s
    split), in YAML keys; None when it can, or when ``mesh.tensor`` does not divide the heads (another
    problem, reported by its own check).

    Args:
      heads, kv_heads: the model's query and K/V heads.
      context: ``mesh.context`` (> 1).
      tensor: ``mesh.tensor``.
      key: where the head count comes from (``model.heads``, ``model.hf's num_attention_heads``).

    Returns:
      The problem, or None.
    """
    from jaxpar.parallel.context import ulysses_kv_repeat

    if heads % tensor:
        return None
    try:
        ulysses_kv_repeat(heads // tensor, max(1, kv_heads // tensor), context)
    except ContextParallelError as e:
        message = _relabel(str(e), (
            (r"^attention \(ulysses\):\s*", ""),
            (rf"the context axis size {context}\b", f"mesh.context={context}"),
            (r"method 'ring' or 'all_gather'", "parallel.context.method=ring or all_gather"),
            (r"a context size that divides", "a mesh.context that divides"),
            (r"fewer tensor-parallel splits of the heads", "a smaller mesh.tensor")))
        return f"{key}={heads} with mesh.tensor={tensor} and parallel.context.method=ulysses: {message}"
    return None


def unused_context_problem(setting: Mapping[str, Any], context: int) -> str | None:
    """A ``parallel.context`` set on a mesh without a ``context`` axis: it would do nothing (the sequence is
    not split), so it is refused, as a codec without a data axis is.

    Args:
      setting: the ``parallel.context`` mapping (empty: not set).
      context: ``mesh.context``.

    Returns:
      The problem, or None.
    """
    if not setting or context > 1:
        return None
    text = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in setting.items())
    return (f"parallel.context={{{text}}} on a mesh with no context axis of size > 1 (mesh.context={context}): "
            "there is no split sequence for a context-parallel method to run over, so it would do nothing. Remove "
            "parallel.context (~parallel.context, or parallel.context={}), or split the sequence over a context axis "
            "(mesh.context > 1, e.g. mesh.context=2 with mesh.data halved).")


def context_problems(cfg: Any, strategy: Any, sizes: Mapping[str, int], *, seq_len: int | None,
                     heads: tuple[int, int, str] | None) -> list[str]:
    """The context-parallel problems of a config on a mesh, in YAML keys.

    Args:
      cfg: the config (its ``parallel.context`` mapping).
      strategy: its built :class:`~jaxpar.Strategy` (the method and balance).
      sizes: the mesh's axis sizes.
      seq_len: the sequence length the ``context`` axis splits (``model.seq_len``); None: not known here.
      heads: ``(query heads, K/V heads, their YAML key)`` of the model; None: not known here.

    Returns:
      The problems: ``parallel.context`` without a ``context`` axis; else the sequence length, then (Ulysses)
      the heads.
    """
    context = sizes.get("context", 1)
    if (why := unused_context_problem(cfg.parallel.context, context)) is not None:
        return [why]
    if context <= 1:
        return []
    cp, out = strategy.context_setting, []
    if seq_len is not None and (why := seq_len_problem(seq_len, context, cp.balance)) is not None:
        out.append(why)
    if heads is not None and cp.method == "ulysses":
        if (why := ulysses_heads_problem(*heads[:2], context, sizes.get("tensor", 1), heads[2])) is not None:
            out.append(why)
    return out
