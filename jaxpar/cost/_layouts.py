"""Which meshes the planner (:mod:`jaxpar.cost._planner`) considers: the factorisations of the device count
into ``pipe x data x fsdp x expert x context x tensor``, and why a layout cannot run a model (sizes the
mesh axes do not divide; CP and EP problems).
"""
from __future__ import annotations

from jaxpar.cost._model import ModelSpec


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending.

    Args:
      n: a positive int.

    Returns:
      The divisors, 1 and ``n`` included.
    """
    return [k for k in range(1, n + 1) if n % k == 0]


def factorisations(n: int) -> list[tuple[int, int, int, int]]:
    """Every ``(pipe, data, fsdp, tensor)`` with product ``n``.

    Args:
      n: the device count.

    Returns:
      The tuples, ascending by ``pipe``, then ``data``, then ``fsdp``.

    >>> len(factorisations(8)), factorisations(2)
    (20, [(1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1)])
    """
    return [(p, d, f, n // (p * d * f)) for p in divisors(n) for d in divisors(n // p)
            for f in divisors(n // (p * d))]


def mesh_factorisations(n: int, contexts=(1,), experts=(1,)) -> list[tuple[int, int, int, int, int, int]]:
    """Every ``(pipe, data, fsdp, expert, context, tensor)`` with product ``n``, ``expert`` in ``experts`` and
    ``context`` in ``contexts`` (in that order: the plans without CP / EP first).

    Args:
      n: the device count.
      contexts: the ``context`` sizes to consider.
      experts: the ``expert`` sizes to consider.

    Returns:
      The tuples.

    >>> len(mesh_factorisations(8)), len(mesh_factorisations(8, contexts=(1, 2, 4, 8)))
    (20, 35)
    >>> mesh_factorisations(4, contexts=(4,), experts=(1, 2))
    [(1, 1, 1, 1, 4, 1)]
    """
    return [(p, d, f, e, c, t) for e in experts if n % e == 0 for c in contexts if (n // e) % c == 0
            for p, d, f, t in factorisations(n // (e * c))]


def shape_problem(m: ModelSpec, p: int, d: int, f: int, t: int, e: int = 1) -> str | None:
    """Why a mesh's axes cannot split the model's sizes: ``tensor`` its heads, MLP, vocabulary (and expert
    MLP), ``pipe`` its layers (and MoE layers), the data axes its global batch.

    Args:
      m: the model.
      p, d, f, t, e: the ``pipe``, ``data``, ``fsdp``, ``tensor`` and ``expert`` sizes.

    Returns:
      The first reason, or ``None`` when they divide.
    """
    for name, size in (("heads", m.heads), ("mlp", m.mlp), ("vocab", m.vocab)) + (
            (("expert_mlp", m.expert_mlp),) if m.is_moe else ()):
        if size % t:
            return f"tensor={t} does not divide model {name}={size}"
    if m.layers % p:
        return f"pipe={p} does not divide model layers={m.layers}"
    if m.moe_layers % p:
        return f"pipe={p} does not divide the model's {m.moe_layers} MoE layers"
    if m.batch % (d * f * e):
        return (f"data*fsdp={d * f} does not divide the global batch={m.batch}" if e == 1 else
                f"data*fsdp*expert={d * f * e} does not divide the global batch={m.batch}")
    return None


def context_problem(m: ModelSpec, context: int, tensor: int, method: str) -> tuple[bool, str | None]:
    """Whether ``context`` devices can run ``method`` on ``m``: ``(balanced layout, reason it cannot or None)``.

    The balanced layout needs the sequence divisible by ``2C``, the natural order by ``C``; Ulysses needs
    the heads on a device (after the tensor split) divisible by ``C``.

    Args:
      m: the model.
      context: the ``context`` axis size ``C``.
      tensor: the ``tensor`` axis size.
      method: ``"ring"``, ``"all_gather"`` or ``"ulysses"``.

    Returns:
      ``(balanced, reason)``.

    >>> from jaxpar.cost._model import gpt
    >>> m = gpt(2, 96, 12, 1000, 64, 8)
    >>> context_problem(m, 4, 1, "ring"), context_problem(m, 8, 1, "ring")[0]
    ((True, None), False)
    >>> context_problem(m, 8, 1, "ulysses")[1]
    'ulysses needs heads % (context * tensor) == 0: heads=12, context=8, tensor=1'
    """
    if method == "ulysses" and m.heads % (context * tensor):
        return True, (f"ulysses needs heads % (context * tensor) == 0: heads={m.heads}, context={context}, "
                      f"tensor={tensor}")
    if m.seq % (2 * context) == 0:
        return True, None
    if m.seq % context == 0:
        return False, None
    return False, f"context={context} does not divide the sequence length {m.seq} (seq % context != 0)"


def expert_problem(m: ModelSpec, expert: int) -> str | None:
    """Why an ``expert`` axis of this size cannot run ``m`` (None if it can).

    Args:
      m: the model.
      expert: the ``expert`` axis size.

    Returns:
      The reason, or ``None``.

    >>> from jaxpar.cost._model import gpt
    >>> expert_problem(gpt(2, 32, 8, 16, 64, 16), 2)
    'expert=2 but the model has no MoE layer (experts=0)'
    """
    if expert == 1:
        return None
    if not m.is_moe:
        return f"expert={expert} but the model has no MoE layer (experts=0)"
    if m.experts % expert:
        return f"experts={m.experts} is not divisible by expert={expert} (each device keeps experts / expert)"
    return None
