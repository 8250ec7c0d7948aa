"""Dense capacity dispatch, the experts' MLPs, the combine, and expert parallelism (EP) over ``expert``.

The dense layout (GShard): each group's kept choices go into a buffer ``[groups, experts, capacity,
embed]`` (a one-hot einsum), every expert runs on its ``C`` slots, and the outputs are read back with
the combine weights. When the rules shard ``experts`` (:func:`expert_rules`), this runs in a
``jax.shard_map`` manual over the expert axes and the token axes, with two all-to-alls over
``expert`` each way (docs/strategies.md, "Expert parallelism", draws it). Expert axes the ``batch``
rule does not name split the batch on entry and gather the output on exit. Under context
parallelism (the axes of the ``length`` rule) the buffer is reduce-scattered over the slots first and
all-gathered back before the combine.

**The experts** (:func:`expert_mlp`): ``w2(act(x w1))``, or with an up projection ``w3`` the gated
MLP of Mixtral, Qwen-MoE and DeepSeek, ``w2(act(x w1) * (x w3))``; ``act`` is one of
:data:`ACTIVATIONS`.

>>> import jax, jax.numpy as jnp
>>> xe = jnp.ones((1, 2, 3, 4))
>>> expert_mlp(xe, jnp.ones((2, 4, 5)), jnp.ones((2, 5, 4))).shape
(1, 2, 3, 4)
>>> expert_mlp(xe, jnp.ones((2, 4, 5)), jnp.ones((2, 5, 4)), jnp.ones((2, 4, 5)), activation="silu").shape
(1, 2, 3, 4)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.mesh import EXPERT
from jaxpar.parallel._regions import collective_in, enter, reduce_dtype, region_axes, region_spec, spec_entry
from jaxpar.rules import axes_of, constrain, current_rules, logical_to_spec, manual_axes, shard_map_mesh
from jaxpar.parallel.moe._routing import MoEError

#: The experts' activations by name: ``gelu`` is ``jax.nn.gelu`` (its default, tanh-approximate), ``silu``
#: is ``jax.nn.silu`` (``x * sigmoid(x)``; Hugging Face's ``hidden_act="silu"``).
ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}


def activation_fn(activation: str):
    """The function of an activation's name, or an :class:`~jaxpar.parallel.moe.MoEError` naming it.

    Args:
      activation: a key of :data:`ACTIVATIONS`.

    Returns:
      The elementwise function.

    >>> activation_fn("relu")
    Traceback (most recent call last):
    ...
    jaxpar.errors.MoEError: activation='relu' is not a known activation; choose one of ('gelu', 'silu').
    """
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise MoEError(f"activation={activation!r} is not a known activation; choose one of {tuple(ACTIVATIONS)}.")
    return ACTIVATIONS[activation]


def expert_rules(axis_names) -> tuple:
    """The rule of the ``experts`` logical axis: over ``expert`` when the mesh has it, else replicated.

    Args:
      axis_names: the mesh's axis names.

    Returns:
      A rules tuple of one pair, ``("experts", "expert" | None)``.

    >>> expert_rules(("data", "expert")), expert_rules(("data",))
    ((('experts', 'expert'),), (('experts', None),))
    """
    return (("experts", EXPERT if EXPERT in tuple(axis_names) else None),)


def gated_hidden(eq: str, x: jax.Array, w1: jax.Array, w3: jax.Array | None, activation: str) -> jax.Array:
    """The hidden activations of an MLP: ``act(einsum(eq, x, w1))``, times ``einsum(eq, x, w3)`` when gated."""
    h = activation_fn(activation)(jnp.einsum(eq, x, w1))
    return h if w3 is None else h * jnp.einsum(eq, x, w3)


def expert_mlp(xe: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array | None = None, *,
               activation: str = "gelu") -> jax.Array:
    """Every expert's MLP on its buffer ``xe[G, E, C, D]``: ``act(xe w1) w2``, or gated ``(act(xe w1) * (xe w3)) w2``.

    Args:
      xe: the experts' buffers.
      w1: ``[E, D, M]``, the gate projection when ``w3`` is given.
      w2: ``[E, M, D]``, the down projection.
      w3: optional ``[E, D, M]`` up projection (a gated MLP: SwiGLU with ``activation="silu"``).
      activation: a key of :data:`ACTIVATIONS`.

    Returns:
      ``[G, E, C, D]``.
    """
    return jnp.einsum("gecm,emd->gecd", gated_hidden("gecd,edm->gecm", xe, w1, w3, activation), w2)


def _masks(expert, slot, weight, experts: int, cap: int, dtype):
    """One-hot dispatch and weighted combine masks ``[G, T, E, C]`` (a slot >= C is all zeros)."""
    e = jax.nn.one_hot(expert, experts, dtype=dtype)                       # [G, T, k, E]
    c = jax.nn.one_hot(slot, cap, dtype=dtype)                             # [G, T, k, C]
    dispatch = jnp.einsum("gtke,gtkc->gtec", e, c)
    combine = jnp.einsum("gtke,gtkc->gtec", e * weight.astype(dtype)[..., None], c)
    return dispatch, combine


def _local_moe(x, expert, slot, weight, w1, w2, w3=None, *, cap: int, experts: int, axes: tuple[str, ...],
               seq: tuple[str, ...] = (), activation: str = "gelu", wire=None):
    """Dispatch, experts (:func:`expert_mlp`), combine on one device's tokens; all-to-alls over ``axes``
    when given. With ``seq`` (the axes splitting the sequence: context parallelism) each device holds a
    part of every row: its buffer (only its tokens' slots filled) is summed over ``seq`` and scattered
    over the slots (``cap`` is a multiple of their size), so each device runs the experts on ``C / size``
    slots, and the outputs are gathered back over the slots before the combine; both in ``wire``
    (:func:`jaxpar.parallel._regions.reduce_dtype`; ``None``: the tokens' dtype)."""
    dispatch, combine = _masks(expert, slot, weight, experts, cap, x.dtype)
    xe = jnp.einsum("gtec,gtd->gecd", dispatch, x)
    wire = x.dtype if wire is None else wire
    if seq:
        xe = collective_in(wire, functools.partial(jax.lax.psum_scatter, axis_name=seq, scatter_dimension=2,
                                                   tiled=True), xe)
    if axes:
        xe = jax.lax.all_to_all(xe, axes, split_axis=1, concat_axis=0, tiled=True)
        h = constrain(gated_hidden("gecd,edm->gecm", xe, w1, w3, activation), (None, None, None, "mlp"))
        ye = jax.lax.all_to_all(jnp.einsum("gecm,emd->gecd", h, w2), axes, split_axis=0, concat_axis=1, tiled=True)
    else:
        ye = expert_mlp(xe, w1, w2, w3, activation=activation)
    if seq:
        ye = collective_in(wire, functools.partial(jax.lax.all_gather, axis_name=seq, axis=2, tiled=True), ye)
    return jnp.einsum("gtec,gecd->gtd", combine, ye)


def _split_axes(mesh, rules, logical: str, what: str) -> tuple[str, ...]:
    """The mesh axes of size > 1, not already manual, that the rules split the ``logical`` axis over
    (``experts``: the expert-parallel axes; ``batch``, ``length``: the tokens' group and sequence)."""
    spec = logical_to_spec((logical,), rules, mesh, what=what)
    return tuple(a for a in axes_of(spec[0]) if mesh.shape[a] > 1 and a not in manual_axes())


def _check_ep(experts: int, groups: int, ep: tuple[str, ...], tokens: tuple[str, ...], sizes) -> None:
    e_p, n = math.prod(sizes[a] for a in ep), math.prod(sizes[a] for a in tokens)
    if experts % e_p:
        raise MoEError(f"experts={experts} is not divisible by the expert-parallel mesh axes "
                       f"{', '.join(f'{a}={sizes[a]}' for a in ep)} (total {e_p}): each device keeps experts/E_p "
                       f"experts. Fix: a number of experts that is a multiple of {e_p}, or a smaller expert axis.")
    if groups % n:
        raise MoEError(f"the MoE layer got {groups} groups (batch rows), not divisible by the mesh axes that "
                       f"split its tokens, {', '.join(f'{a}={sizes[a]}' for a in tokens)} (total {n}). Fix: a "
                       f"batch that is a multiple of {n}.")


def dispatch_combine(x: jax.Array, expert: jax.Array, slot: jax.Array, weight: jax.Array, w1: jax.Array,
                     w2: jax.Array, *, capacity: int, w3: jax.Array | None = None,
                     activation: str = "gelu") -> jax.Array:
    """The experts' output for tokens ``x[G, T, D]`` routed by ``expert``, ``slot``, ``weight`` (``[G, T, k]``,
    see :class:`~jaxpar.parallel.moe.Routing`), with expert weights ``w1[E, D, M]``, ``w2[E, M, D]`` and
    optionally ``w3[E, D, M]`` (gated experts, :func:`expert_mlp`).

    Without rules, or when ``experts`` is not sharded, one dense computation (GSPMD shards it by the
    arrays' shardings). Otherwise expert parallelism as the module docstring draws it.

    Args:
      x: tokens.
      expert, slot, weight: the routing.
      w1, w2: stacked expert weights.
      capacity: buffer slots per group and expert.
      w3: optional stacked up projections (gated experts; ``w1`` is then the gate), split like ``w1``.
      activation: a key of :data:`ACTIVATIONS`.

    Returns:
      ``[G, T, D]``: ``sum_k weight * expert(x)`` over the kept choices.
    """
    if w3 is not None and w3.shape != w1.shape:
        raise MoEError(f"the experts' up projection w3 has shape {tuple(w3.shape)}; it must be shaped like the "
                       f"gate projection w1, {tuple(w1.shape)} ([experts, embed, mlp]).")
    E = w1.shape[0]
    local = dict(cap=capacity, experts=E, activation=activation)
    ws = (w1, w2) if w3 is None else (w1, w2, w3)
    ctx = current_rules()
    ep = () if ctx is None else _split_axes(*ctx, "experts", "MoE expert weights ('experts' axis)")
    if not ep:
        return _local_moe(x, expert, slot, weight, *ws, axes=(), **local)
    mesh, rules = ctx
    batch = _split_axes(mesh, rules, "batch", "MoE tokens ('batch' axis)")
    tokens = batch + tuple(a for a in ep if a not in batch)      # the group dimension's axes in the EP region
    _check_ep(E, x.shape[0], ep, tokens, dict(mesh.shape))
    seq = tuple(a for a in _split_axes(mesh, rules, "length", "MoE tokens ('length' axis)") if a not in tokens + ep)
    if seq:                     # the slots are scattered over the sequence axes: a multiple of their size
        n = math.prod(mesh.shape[a] for a in seq)
        local["cap"] = -(-capacity // n) * n
        slot = jnp.where(slot < capacity, slot, local["cap"])     # the padding slots stay empty
    tok = PartitionSpec(spec_entry(tokens), spec_entry(seq)) if seq else PartitionSpec(spec_entry(tokens))
    wspec = PartitionSpec(spec_entry(ep))
    manual = region_axes(mesh, tokens + ep + seq)
    local["wire"] = reduce_dtype(x.dtype, mesh, manual)    # bf16, or float32 where XLA:CPU needs it
    dtypes = [w.dtype for w in ws]
    ws = tuple(enter(w, wspec, mesh, manual, local["wire"]) for w in ws)   # unsplit over the token axes

    def body(x, expert, slot, weight, ws):      # ws: (w1, w2[, w3]), each split over ``ep`` on its experts axis
        ws = [w.astype(d) for w, d in zip(ws, dtypes)]
        return _local_moe(x, expert, slot, weight, *ws, axes=ep, seq=seq, **local)

    in_specs = (*(region_spec(tok, 2, mesh, manual),) * 4, region_spec(wspec, 3, mesh, manual))
    return jax.shard_map(body, mesh=shard_map_mesh(mesh), in_specs=in_specs, out_specs=tok, axis_names=manual,
                         check_vma=False)(x, expert, slot, weight, ws)
