"""Sorted dispatch: each expert computes the rows routed to it and no others, with expert parallelism (EP)
over ``expert``.

**On one device** (:func:`routed_mlp`) a device's ``N·k`` choices are sorted by expert (a stable
argsort; dropped choices go last and are never computed). A loop over *tiles* of ``TILE_ROWS`` rows,
each inside one expert's run of sorted rows, gathers the tile's token rows, runs the expert and
scatter-adds ``weight · y`` back into the tokens. The loop runs only the tiles the routing uses:
``sum_e ceil(rows_e / tile)``, so the experts' FLOPs are the routed rows', padded per expert at most
to a tile. No row buffer is built: the forward saves only the experts' pre-activations, in the sorted
layout (``[N·k, M]``, ``[N·k, 2M]`` gated), and the backward (a custom VJP) walks the same tiles.

**On a GPU mesh** the same tiles run as grouped GEMMs (:mod:`jaxpar.parallel.moe._grouped`, Pallas Triton):
each tile is laid out at ``t·tile`` of a padded row array (its rows past its expert's end zero), and each
of the experts' GEMMs is one kernel over all tiles, the tile table on the device: 2 calls forward (3 gated),
4 backward (6 gated), no loop. The CPU and TPU run the tile loop, the reference the grouped kernels are
tested against; :func:`~jaxpar.parallel.moe.use_moe_kernel` picks either.

**Expert parallelism** (the rules shard ``experts``: :func:`expert_rules`): in a ``jax.shard_map``
manual over the token axes and the expert axes, each device sends the per-expert counts (``E`` int32)
with one ``all_to_all``, then in rounds packs its kept choices by destination peer into ``[E_p, S, D]``
(sorted by expert within a peer), sends the rows with one ``all_to_all``, runs the tile loop on what it
received, and one ``all_to_all`` brings the outputs back, where each choice adds its row with its
weight. A round sends a peer at most ``S`` rows (:func:`send_rows`): with capacity ``C`` all a device
can send it, ``G·(E/E_p)·min(C, T)`` (one round); dropless :data:`DROPLESS_SEND_FACTOR` times the mean,
and a device with more for some peer takes further rounds (docs/strategies.md, "How the exchange is
bounded"). Under context parallelism each device dispatches its own part of the sequence. Without a
rule for ``experts``, the same region is manual over the token axes alone, so that each device sorts
its own tokens.

**The experts**: ``w2(act(x w1))``, or with an up projection ``w3`` the gated MLP of Mixtral, Qwen-MoE and
DeepSeek, ``w2(act(x w1) * (x w3))``; ``act`` is one of :data:`ACTIVATIONS`.

>>> import jax, jax.numpy as jnp
>>> x = jnp.arange(6.0).reshape(3, 2)                  # 3 tokens
>>> w1, w2 = jnp.ones((2, 2, 4)), jnp.ones((2, 4, 2))  # 2 experts
>>> rows, expert = jnp.array([0, 2, 2]), jnp.array([1, 0, 2])   # expert 2 (= E): dropped
>>> routed_mlp(x, rows, jnp.array([1.0, 0.5, 1.0]), expert, w1, w2, activation="silu").tolist()[1]
[0.0, 0.0]
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.mesh import EXPERT
from jaxpar.parallel._regions import enter, mesh_platform, reduce_dtype, region_axes, region_spec, spec_entry
from jaxpar.rules import axes_of, current_rules, logical_to_spec, manual_axes, shard_map_mesh
from jaxpar.parallel.moe._grouped import (LOOP, Groups, Kernel, choose_moe_kernel, grouped_mlp_backward,
                                          grouped_mlp_forward)
from jaxpar.parallel.moe._routing import MoEError

#: The experts' activations by name: ``gelu`` is ``jax.nn.gelu`` (its default, tanh-approximate), ``silu``
#: is ``jax.nn.silu`` (``x * sigmoid(x)``; Hugging Face's ``hidden_act="silu"``).
ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}

#: Rows of one expert tile by platform: the GEMMs' row block (docs/strategies.md, "Expert parallelism").
TILE_ROWS = {"cpu": 32, "gpu": 128, "cuda": 128, "rocm": 128, "tpu": 128}


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
    """Deprecated (``jaxpar.parallel.moe.expert_mlp``, served by :func:`jaxpar.errors.moved_getattr` until the next release):
    every expert's MLP on its buffer ``xe[G, E, C, D]``, ``act(xe w1) w2`` or gated ``(act(xe w1) * (xe w3)) w2``.

    Args:
      xe: the experts' buffers.
      w1: ``[E, D, M]``, the gate projection when ``w3`` is given.
      w2: ``[E, M, D]``, the down projection.
      w3: optional ``[E, D, M]`` up projection.
      activation: a key of :data:`ACTIVATIONS`.

    Returns:
      ``[G, E, C, D]``.
    """
    return jnp.einsum("gecm,emd->gecd", gated_hidden("gecd,edm->gecm", xe, w1, w3, activation), w2)


def tile_rows(mesh=None) -> int:
    """The expert tile of the platform of ``mesh``'s devices (the default backend's without one).

    Args:
      mesh: a mesh, or None.

    Returns:
      Rows per tile, from :data:`TILE_ROWS`.

    >>> tile_rows()
    32
    """
    return TILE_ROWS.get(mesh_platform(mesh), 128)


# ----------------------------------------------------------------- the tiles of one device's sorted rows

def _tiles(expert: jax.Array, experts: int, tile: int):
    """The sorted order of ``expert`` (``experts``: not computed, last) and the tile table: the number of
    tiles used, and per tile (a static bound of them) its expert, first sorted row and end of its expert's rows."""
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=experts + 1)[:experts]
    ends = jnp.cumsum(counts)
    per = (counts + tile - 1) // tile
    last = jnp.cumsum(per)
    t = jnp.arange(-(-expert.shape[0] // tile) + experts)
    e = jnp.minimum(jnp.searchsorted(last, t, side="right"), experts - 1)
    first = ends[e] - counts[e] + (t - last[e] + per[e]) * tile
    return order, last[-1], e, first, ends[e]


def _sorted(v: jax.Array, order: jax.Array, tile: int) -> jax.Array:
    """``v[order]`` and ``tile`` zeros after it (a tile may start at the last rows)."""
    return jnp.concatenate([v[order], jnp.zeros((tile, *v.shape[1:]), v.dtype)])


def _tile(t, table, tile: int, *sorted_arrays):
    """Tile ``t``: its expert, first row, the mask of its expert's rows and its slices of ``sorted_arrays``."""
    e, first, end = table[0][t], table[1][t], table[2][t]
    valid = first + jnp.arange(tile) < end
    return e, first, valid, [jax.lax.dynamic_slice_in_dim(a, first, tile) for a in sorted_arrays]


def _pre(xt, w1e, w3e):
    """An expert's pre-activations on a tile: ``x w1`` (and ``x w3``, gated) side by side."""
    return xt @ w1e if w3e is None else jnp.concatenate([xt @ w1e, xt @ w3e], axis=-1)


def _hidden(pre, act, gated: bool):
    """``act(a)`` (times ``b``, gated) from the pre-activations ``[a | b]``."""
    if not gated:
        return act(pre)
    a, b = jnp.split(pre, 2, axis=-1)
    return act(a) * b


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _routed(x, rows, weight, expert, ws, tile, activation, mlp_axes=(), kernel=LOOP):
    return _forward(x, rows, weight, expert, ws, tile, activation, mlp_axes, save=False, kernel=kernel)[0]


def _routed_fwd(x, rows, weight, expert, ws, tile, activation, mlp_axes=(), kernel=LOOP):
    return _forward(x, rows, weight, expert, ws, tile, activation, mlp_axes, save=True, kernel=kernel)


def _padded(table, used, tile: int, srows, sweight):
    """The grouped kernels' padded layout (:mod:`jaxpar.parallel.moe._grouped`): tile ``t`` at rows
    ``t·tile ..``. Per padded row: its row of ``x``, its weight, its sorted position and whether it holds a choice."""
    e, first, end = table
    at = first[:, None] + jnp.arange(tile)
    valid = ((at < end[:, None]) & (jnp.arange(e.shape[0])[:, None] < used)).reshape(-1)
    at = jnp.where(valid, at.reshape(-1), 0)
    return srows[at], jnp.where(valid, sweight[at], 0.0), at, valid


def _forward(x, rows, weight, expert, ws, tile, activation, mlp_axes, *, save: bool, unique: bool = False,
             kernel: Kernel = LOOP):
    """The routed experts of :func:`routed_mlp` (the tile loop, or the grouped ``kernel``); with ``save``, the
    pre-activations the backward reads, too. ``mlp_axes``: manual axes splitting the experts' ``M`` (tensor
    parallelism): ``y`` is summed over them. ``unique``: each row has one choice, so ``y`` is written in
    ``x``'s dtype, else summed in float32."""
    order, used, *table = _tiles(expert, ws[0].shape[0], tile)
    srows, sweight = _sorted(rows, order, tile), _sorted(weight.astype(jnp.float32), order, tile)
    y0 = jnp.zeros(x.shape, x.dtype if unique else jnp.float32)
    run = _grouped_forward if kernel.grouped else _loop_forward
    y, pre = run(x, y0, srows, sweight, used, table, ws, tile, activation, save, kernel)
    y = jax.lax.psum(y, mlp_axes) if mlp_axes else y
    return y.astype(x.dtype), (x, rows, weight, expert, ws, order, used, table, pre)


def _loop_forward(x, y, srows, sweight, used, table, ws, tile, activation, save, kernel):
    """The tile loop: ``y`` plus each tile's weighted expert output, and (``save``) the sorted pre-activations."""
    w1, w2, w3 = ws
    act, M = activation_fn(activation), w1.shape[-1]
    pre0 = jnp.zeros((srows.shape[0] if save else 0, M * (1 + (w3 is not None))), x.dtype)

    def body(t, carry):
        y, pre = carry
        e, first, valid, (r, w) = _tile(t, table, tile, srows, sweight)
        p = _pre(x[r], w1[e], None if w3 is None else w3[e])
        yt = (_hidden(p, act, w3 is not None) @ w2[e]).astype(jnp.float32)
        y = y.at[r].add((yt * jnp.where(valid, w, 0.0)[:, None]).astype(y.dtype))
        return y, jax.lax.dynamic_update_slice_in_dim(pre, p, first, 0) if save else pre

    return jax.lax.fori_loop(0, used, body, (y, pre0))


def _gathered(v, token, valid):
    """``v[token]`` with zero rows where ``valid`` is False."""
    return jnp.where(valid[:, None], v[token], 0).astype(v.dtype)


def _grouped_forward(x, y, srows, sweight, used, table, ws, tile, activation, save, kernel):
    """The grouped kernels on the padded rows: ``y`` plus the weighted outputs, and (``save``) the padded
    pre-activations."""
    token, wp, _, valid = _padded(table, used, tile, srows, sweight)
    groups = Groups.of(table[0], used, ws[0].shape[0])
    yp, pre = grouped_mlp_forward(_gathered(x, token, valid), ws, groups, activation_fn(activation), tile=tile,
                                  interpret=kernel.interpret)
    y = y.at[token].add(jnp.where(valid[:, None], yp.astype(jnp.float32) * wp[:, None], 0.0).astype(y.dtype))
    return y, pre if save else None


def _routed_bwd(tile, activation, mlp_axes, kernel, res, g):
    # a manual region divides the cotangent of an output unsplit over an axis by its size and sums its
    # inputs' cotangents over it: the transpose of the forward's sum over ``mlp_axes`` is a sum
    g = jax.lax.psum(g, mlp_axes) if mlp_axes else g
    x, weight, ws = res[0], res[2], res[4]
    dx, dweight, dws = _backward(res, g, tile, activation, kernel=kernel)
    return (dx.astype(x.dtype), None, dweight.astype(weight.dtype), None,
            tuple(None if d is None else d.astype(w.dtype) for d, w in zip(dws, ws)))


def _backward(res, g, tile: int, activation: str, unique: bool = False, kernel: Kernel = LOOP):
    """The backward from the forward's residuals and the output's cotangent ``g`` (the tile loop, or the grouped
    ``kernel``): ``(dx, dweight, (dw1, dw2, dw3))``, float32 (``dx`` in ``x``'s dtype when ``unique``, as
    :func:`_forward`)."""
    return (_grouped_backward if kernel.grouped else _loop_backward)(res, g, tile, activation, unique, kernel)


def _grouped_backward(res, g, tile: int, activation: str, unique: bool, kernel: Kernel):
    """:func:`_backward` by the grouped kernels on the padded rows."""
    x, rows, weight, expert, ws, order, used, table, pre = res
    srows, sweight = _sorted(rows, order, tile), _sorted(weight.astype(jnp.float32), order, tile)
    token, wp, at, valid = _padded(table, used, tile, srows, sweight)
    groups = Groups.of(table[0], used, ws[0].shape[0])
    dxp, dwp, dws = grouped_mlp_backward(_gathered(x, token, valid), _gathered(g, token, valid), wp, pre, ws,
                                         groups, activation_fn(activation), tile=tile, interpret=kernel.interpret)
    dx = jnp.zeros(x.shape, x.dtype if unique else jnp.float32)
    dx = dx.at[token].add(jnp.where(valid[:, None], dxp, 0.0).astype(dx.dtype))
    dweight = jnp.zeros(weight.shape, jnp.float32).at[order[at]].add(jnp.where(valid, dwp, 0.0))
    return dx, dweight, dws


def _loop_backward(res, g, tile: int, activation: str, unique: bool, kernel: Kernel):
    """:func:`_backward` by the tile loop."""
    x, rows, weight, expert, (w1, w2, w3), order, used, table, pre = res
    act, gated = activation_fn(activation), w3 is not None
    srows, sweight = _sorted(rows, order, tile), _sorted(weight.astype(jnp.float32), order, tile)
    f32 = functools.partial(jnp.zeros, dtype=jnp.float32)

    def body(t, carry):
        dx, dws, dw1, dw2, dw3 = carry
        e, first, valid, (r, w, p) = _tile(t, table, tile, srows, sweight, pre)
        h, hidden_vjp = jax.vjp(lambda p: _hidden(p, act, gated), p)
        gh = g[r] @ w2[e].T                                      # d loss / d h, before the weight
        w = jnp.where(valid, w, 0.0)
        dws = jax.lax.dynamic_update_slice_in_dim(dws, jnp.where(valid, jnp.sum(gh * h, -1, jnp.float32), 0.0),
                                                  first, 0)
        dp = hidden_vjp((gh * w[:, None]).astype(h.dtype))[0]
        xt = x[r]
        dw2 = dw2.at[e].add(h.T @ (g[r] * w[:, None]).astype(h.dtype))
        if gated:
            da, db = jnp.split(dp, 2, axis=-1)
            dw1, dw3 = dw1.at[e].add(xt.T @ da), dw3.at[e].add(xt.T @ db)
            dxt = da @ w1[e].T + db @ w3[e].T
        else:
            dw1, dxt = dw1.at[e].add(xt.T @ dp), dp @ w1[e].T
        return dx.at[r].add(dxt.astype(dx.dtype)), dws, dw1, dw2, dw3

    init = (jnp.zeros(x.shape, x.dtype if unique else jnp.float32), f32(rows.shape[0] + tile), f32(w1.shape),
            f32(w2.shape), f32(w1.shape if gated else ()))
    dx, dws, dw1, dw2, dw3 = jax.lax.fori_loop(0, used, body, init)
    dweight = jnp.zeros(weight.shape, jnp.float32).at[order].set(dws[:rows.shape[0]])
    return dx, dweight, (dw1, dw2, dw3 if gated else None)


_routed.defvjp(_routed_fwd, _routed_bwd)


def routed_mlp(x: jax.Array, rows: jax.Array, weight: jax.Array, expert: jax.Array, w1: jax.Array, w2: jax.Array,
               w3: jax.Array | None = None, *, activation: str = "gelu", tile: int | None = None) -> jax.Array:
    """``y[rows[c]] += weight[c] * expert_{expert[c]}(x[rows[c]])`` over the choices ``c``, on one device's
    rows (see the module docstring): the experts compute the routed rows only, in tiles, by the kernel that
    :func:`~jaxpar.parallel.moe.use_moe_kernel` chooses on the default backend.

    Args:
      x: ``[R, D]`` rows.
      rows: int ``[n]``, each choice's row of ``x`` (and of the output).
      weight: ``[n]`` combine weights.
      expert: int ``[n]``, each choice's expert; ``E`` (the number of experts): not computed.
      w1, w2: ``[E, D, M]``, ``[E, M, D]`` stacked expert weights.
      w3: optional ``[E, D, M]`` up projection (gated experts; ``w1`` is then the gate).
      activation: a key of :data:`ACTIVATIONS`.
      tile: rows per tile; the default backend's :func:`tile_rows` when None.

    Returns:
      ``[R, D]``, ``x``'s dtype (accumulated in float32).
    """
    tile = tile or tile_rows()
    return _routed(x, rows, weight, expert, (w1, w2, w3), tile, activation, (), _kernel(None, tile, (w1,)))


# ----------------------------------------------------------------- the layer's dispatch, local or expert parallel

def _kernel(platform: str | None, tile: int, ws) -> Kernel:
    """The kernel of the routed experts ``ws`` (local shapes) on ``platform`` (None: the default backend's)."""
    return choose_moe_kernel(platform or jax.default_backend(), tile, ws[0].shape[1], ws[0].shape[2])


def _local_moe(x, expert, kept, weight, ws, *, activation: str, tile: int, platform: str | None = None,
               mlp_axes=()):
    """:func:`routed_mlp` over one device's tokens ``x[G, T, D]`` and their choices ``[G, T, k]``."""
    G, T, k = expert.shape
    rows = jnp.repeat(jnp.arange(G * T), k)
    e = jnp.where(kept, expert, ws[0].shape[0]).reshape(-1)
    y = _routed(x.reshape(G * T, -1), rows, weight.reshape(-1), e, ws, tile, activation, mlp_axes,
                _kernel(platform, tile, ws))
    return y.reshape(x.shape)


class _EP(NamedTuple):
    """The static options of one device's expert-parallel exchange."""

    axes: tuple[str, ...]       # the expert-parallel mesh axes
    peers: int                  # E_p
    send: int                   # S, rows to one peer per round
    top_k: int
    tile: int
    activation: str
    mlp_axes: tuple[str, ...]
    kernel: Kernel              # the routed experts' kernel


def _ep_moe(x, expert, kept, weight, ws, *, axes: tuple[str, ...], peers: int, send: int, activation: str,
            tile: int, platform: str, mlp_axes=()):
    """Expert parallelism on one device's tokens ``x[G, T, D]`` (see the module docstring)."""
    G, T, k = expert.shape
    e = jnp.where(kept, expert, ws[0].shape[0] * peers).reshape(-1)
    o = _EP(axes, peers, send, k, tile, activation, mlp_axes, _kernel(platform, tile, ws))
    return _exchange(x.reshape(G * T, -1), weight.reshape(-1), e, ws, o).reshape(x.shape)


def _plan(e, local: int, o: _EP):
    """Who sends what (integers, no gradient): the choices sorted by expert (``E``: dropped, last), each
    peer's first sorted choice and count, the rows each source sends this device per local expert
    (cumulative), and the rounds (the most any device of the group needs, at least 1)."""
    order = jnp.argsort(e, stable=True)
    counts = jnp.bincount(e, length=local * o.peers + 1)[:-1].reshape(o.peers, local)
    per_peer = counts.sum(1)
    received = jnp.cumsum(_swap(counts, o), axis=1)
    rounds = jax.lax.pmax(jnp.max((per_peer + o.send - 1) // o.send), o.axes)
    return order, jnp.cumsum(per_peer) - per_peer, per_peer, received, jnp.maximum(rounds, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _exchange(x, weight, e, ws, o: _EP):
    return _exchange_fwd(x, weight, e, ws, o)[0]


def _exchange_fwd(x, weight, e, ws, o: _EP):
    plan = _plan(e, ws[0].shape[0], o)
    contrib, tokens, res0 = _round_forward(x, weight, ws, plan, 0, o, save=True)
    y = jnp.zeros(x.shape, jnp.float32).at[tokens].add(contrib)

    def more(r, y):
        contrib, tokens, _ = _round_forward(x, weight, ws, plan, r, o, save=False)
        return y.at[tokens].add(contrib)

    y = jax.lax.fori_loop(1, plan[-1], more, y)
    return y.astype(x.dtype), (x, weight, ws, plan, res0)


def _exchange_bwd(o: _EP, res, g):
    g = jax.lax.psum(g, o.mlp_axes) if o.mlp_axes else g      # as in :func:`_routed_bwd`
    x, weight, ws, plan, res0 = res
    zero = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(weight.shape, jnp.float32),
            tuple(None if w is None else jnp.zeros(w.shape, jnp.float32) for w in ws))
    add = functools.partial(jax.tree.map, jnp.add)
    acc = add(zero, _round_backward(x, weight, ws, plan, 0, g, o, res0))
    acc = jax.lax.fori_loop(1, plan[-1], lambda r, acc: add(acc, _round_backward(x, weight, ws, plan, r, g, o)), acc)
    dx, dweight, dws = acc
    return (dx.astype(x.dtype), dweight.astype(weight.dtype), None,
            tuple(None if d is None else d.astype(w.dtype) for d, w in zip(dws, ws)))


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _chunk(plan, r, o: _EP):
    """Round ``r``: the choice in each send slot ``[E_p, S]``, whether it holds one, and the local expert
    of each row this device receives (``E / E_p``: none)."""
    order, start, per_peer, received, _ = plan
    at = r * o.send + jnp.arange(o.send)
    choice = order[jnp.minimum(start[:, None] + at, order.shape[0] - 1)]
    local_e = jax.vmap(lambda c: jnp.searchsorted(c, at, side="right"))(received)
    return choice, at < per_peer[:, None], local_e.reshape(-1)


def _swap(v, o: _EP):
    """``v[E_p, S, ...]``: block ``p`` to peer ``p``, the peers' blocks back in their order."""
    return jax.lax.all_to_all(v, o.axes, 0, 0, tiled=True)


def _received(x, choice, valid, o: _EP):
    """The rows ``x[token of choice]`` this device receives, ``[E_p * S, D]``."""
    out = jnp.where(valid[..., None], x[choice // o.top_k], 0)
    return _swap(out, o).reshape(-1, x.shape[-1])


def _round_forward(x, weight, ws, plan, r, o: _EP, *, save: bool):
    """Round ``r`` forward: the weighted rows back ``[E_p, S, D]``, their tokens, the residuals (``save``)."""
    choice, valid, local_e = _chunk(plan, r, o)
    recv = _received(x, choice, valid, o)
    m = recv.shape[0]
    y, *res = _forward(recv, jnp.arange(m), jnp.ones(m, jnp.float32), local_e, ws, o.tile, o.activation,
                       o.mlp_axes, save=save, unique=True, kernel=o.kernel)
    back = _swap(y.reshape(o.peers, o.send, -1), o)
    return jnp.where(valid, weight[choice], 0.0).astype(back.dtype)[..., None] * back, choice // o.top_k, \
        res[0] if save else None


def _round_backward(x, weight, ws, plan, r, g, o: _EP, res=None):
    """Round ``r`` backward: float32 ``(dx, dweight, dws)`` of its choices (the forward's residuals of
    round 0, else recomputed)."""
    choice, valid, local_e = _chunk(plan, r, o)
    if res is None:
        recv = _received(x, choice, valid, o)
        res = _forward(recv, jnp.arange(recv.shape[0]), jnp.ones(recv.shape[0], jnp.float32), local_e, ws, o.tile,
                       o.activation, o.mlp_axes, save=True, unique=True, kernel=o.kernel)[1]
    g_rows = _received(g, choice, valid, o)
    w_rows = _swap(jnp.where(valid, weight[choice], 0.0).astype(jnp.float32), o).reshape(-1)
    dx_rows, dw_rows, dws = _backward((*res[:2], w_rows, *res[3:]), g_rows, o.tile, o.activation, unique=True,
                                      kernel=o.kernel)
    dx_back = _swap(dx_rows.reshape(o.peers, o.send, -1), o)
    dw_back = _swap(dw_rows.reshape(o.peers, o.send), o)
    tokens = choice // o.top_k
    dx = jnp.zeros(x.shape, jnp.float32).at[tokens].add(jnp.where(valid[..., None], dx_back, 0.0))
    dweight = jnp.zeros(weight.shape, jnp.float32).at[choice].add(jnp.where(valid, dw_back, 0.0))
    return dx, dweight, dws


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


#: Dropless, one round of expert parallelism sends a peer at most this multiple of the mean, ``N·k / E_p``
#: rows; a device with more for some peer sends them in further rounds (docs/strategies.md).
DROPLESS_SEND_FACTOR = 1.25


def send_rows(groups: int, tokens: int, top_k: int, experts: int, peers: int, capacity: int, *,
              dropless: bool = False) -> int:
    """``S``, the rows one device's ``groups x tokens`` send one of ``peers`` expert-parallel peers in one
    round: with capacity, all it can, ``groups · (experts / peers) · min(capacity, tokens)``; dropless,
    :data:`DROPLESS_SEND_FACTOR` times the mean ``N·k / peers``; at most all its ``N·k`` choices.

    Args:
      groups, tokens: the device's groups (batch rows) and tokens of each (its part of a row under
        context parallelism).
      top_k: choices per token.
      experts: ``E``, all the experts.
      peers: ``E_p``, the expert-parallel devices.
      capacity: slots per group and expert (:func:`~jaxpar.parallel.moe.capacity`).
      dropless: the routing drops nothing (no capacity).

    Returns:
      ``S``.

    >>> send_rows(2, 64, 2, 8, 4, 20), send_rows(2, 64, 2, 8, 4, 64, dropless=True)     # capacity 1.25, dropless
    (80, 80)
    """
    n = groups * tokens * top_k
    if dropless:
        return min(n, math.ceil(DROPLESS_SEND_FACTOR * n / peers))
    return min(n, groups * (experts // peers) * min(capacity, tokens))


def _exchange_options(shape, top_k: int, experts: int, capacity: int, sizes, tokens, seq, ep) -> dict:
    """The expert-parallel options of :func:`_ep_moe` for tokens of global ``shape`` ``[G, T, D]``."""
    peers = math.prod(sizes[a] for a in ep)
    G, T = shape[0] // math.prod(sizes[a] for a in tokens), shape[1] // math.prod(sizes[a] for a in seq)
    send = send_rows(G, T, top_k, experts, peers, capacity, dropless=capacity >= shape[1])
    return dict(axes=ep, peers=peers, send=send)


def dispatch_combine(x: jax.Array, expert: jax.Array, slot: jax.Array, weight: jax.Array, w1: jax.Array,
                     w2: jax.Array, *, capacity: int, w3: jax.Array | None = None,
                     activation: str = "gelu") -> jax.Array:
    """The experts' output for tokens ``x[G, T, D]`` routed by ``expert``, ``slot``, ``weight`` (``[G, T, k]``,
    see :class:`~jaxpar.parallel.moe.Routing`), with expert weights ``w1[E, D, M]``, ``w2[E, M, D]`` and
    optionally ``w3[E, D, M]`` (gated experts); a choice whose slot is ``>= capacity`` is dropped.

    Without rules, one device's :func:`routed_mlp`. Under rules, a region manual over the token axes, and
    the expert axes when the rules shard ``experts`` (the module docstring).

    Args:
      x: tokens.
      expert, slot, weight: the routing.
      w1, w2: stacked expert weights.
      capacity: slots per group and expert.
      w3: optional stacked up projections (gated experts; ``w1`` is then the gate), split like ``w1``.
      activation: a key of :data:`ACTIVATIONS`.

    Returns:
      ``[G, T, D]``: ``sum_k weight * expert(x)`` over the kept choices.
    """
    if w3 is not None and w3.shape != w1.shape:
        raise MoEError(f"the experts' up projection w3 has shape {tuple(w3.shape)}; it must be shaped like the "
                       f"gate projection w1, {tuple(w1.shape)} ([experts, embed, mlp]).")
    activation_fn(activation)
    E, kept = w1.shape[0], slot < capacity
    ctx = current_rules()
    if ctx is None:
        return _local_moe(x, expert, kept, weight, (w1, w2, w3), activation=activation, tile=tile_rows())
    mesh, rules = ctx
    ep = _split_axes(mesh, rules, "experts", "MoE expert weights ('experts' axis)")
    batch = _split_axes(mesh, rules, "batch", "MoE tokens ('batch' axis)")
    tokens = batch + tuple(a for a in ep if a not in batch)      # the group dimension's axes in the region
    seq = tuple(a for a in _split_axes(mesh, rules, "length", "MoE tokens ('length' axis)") if a not in tokens + ep)
    local = dict(activation=activation, tile=tile_rows(mesh), platform=mesh_platform(mesh))
    if not tokens + seq:
        return _local_moe(x, expert, kept, weight, (w1, w2, w3), **local)
    # the experts' M over the tensor axes stays split (a sum of y in the region), unless they split the tokens
    mlp = local["mlp_axes"] = tuple(a for a in _split_axes(mesh, rules, "mlp", "MoE expert hidden ('mlp' axis)")
                                    if a not in tokens + seq)
    _check_ep(E, x.shape[0], ep, tokens, sizes := dict(mesh.shape))
    if ep:
        local |= _exchange_options(x.shape, expert.shape[-1], E, capacity, sizes, tokens, seq, ep)
    tok = PartitionSpec(spec_entry(tokens), spec_entry(seq))
    wspec = [PartitionSpec(spec_entry(ep), None, spec_entry(mlp)), PartitionSpec(spec_entry(ep), spec_entry(mlp))]
    manual = region_axes(mesh, tokens + ep + seq + mlp)
    wire = reduce_dtype(x.dtype, mesh, manual)      # bf16, or float32 where XLA:CPU needs it
    ws = tuple(w for w in (w1, w2, w3) if w is not None)
    dtypes = [w.dtype for w in ws]
    specs = (wspec[0], wspec[1], wspec[0])[:len(ws)]
    ws = tuple(enter(w, s, mesh, manual, wire) for w, s in zip(ws, specs))   # unsplit over the token axes

    def body(x, expert, kept, weight, ws):      # ws: (w1, w2[, w3]), each split over ``ep`` on its experts axis
        ws = [w.astype(d) for w, d in zip(ws, dtypes)]
        ws = (*ws, None) if len(ws) == 2 else tuple(ws)
        return (_ep_moe if ep else _local_moe)(x, expert, kept, weight, ws, **local)

    in_specs = (*(region_spec(tok, 2, mesh, manual),) * 4, tuple(region_spec(s, 3, mesh, manual) for s in specs))
    return jax.shard_map(body, mesh=shard_map_mesh(mesh), in_specs=in_specs, out_specs=tok, axis_names=manual,
                         check_vma=False)(x, expert, kept, weight, ws)
