"""Compressed gradient exchange over the data axes, inside a ``shard_map`` manual over them.

The leaves are laid out as one buffer of ``N`` rows (``N`` replicas): row ``i`` of a leaf sharded over
the data axes is replica ``i``'s shard; other leaves are flattened, padded and cut into ``N`` rows.
Quantizers (:mod:`._codecs`) encode the rows, all-to-all, decode and average (a compressed
reduce-scatter), then re-encode and all-gather the unsharded rows (error feedback on both sides);
top-k all-gathers ``(values, indices)``, random-k all-reduces its values; PowerSGD
(:mod:`._powersgd`) all-reduces ``P`` then ``Q``. docs/compression.md gives the bytes of each.

One replica's state is a dict of arrays; the train step stacks the replicas' states on a leading
axis sharded over the data axes.

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.parallel.compression import exchange_plan, qsgd
    >>> mesh = jaxpar.make_mesh({"data": 4}, devices=jax.devices()[:4])
    >>> plan = exchange_plan(qsgd(), [(64, 32)], dims=[None], grad_axes=[()], stacked=[False],
    ...                      mesh_sizes={"data": 4})
    >>> def mean(g):                                   # g: this replica's gradient
    ...     out, _, stats = plan.exchange([g[0]], plan.init(), jnp.int32(0))
    ...     return out[0][None]
    >>> g = jax.random.normal(jax.random.key(0), (4, 64, 32))      # one gradient per replica
    >>> f = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    >>> out = f(g)
    >>> bool(jnp.all(out == out[0]))                   # every replica gets the same mean
    True
    >>> bool(jnp.linalg.norm(out[0] - g.mean(0)) < 0.2 * jnp.linalg.norm(g.mean(0)))   # unbiased, some noise
    True
    >>> plan.wire_bytes(), plan.uncompressed_bytes()   # bytes each device sends, codec vs fp32 ring
    (3096, 12288)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.compat._table import codec_problems, raise_first
from jaxpar.parallel._data_parallel import axis_name, unflatten_leaf
from jaxpar.parallel.compression._codecs import Codec, round_up
from jaxpar.parallel.compression._bits import from_bytes, to_bytes
from jaxpar.parallel.compression._powersgd import PowerSGD, mean_of
from jaxpar.parallel.compression._sparse import Sparsifier


@dataclass(frozen=True)
class ExchangePlan:
    """How one step's gradient leaves are exchanged (see the module docstring)."""

    codec: Any
    axes: tuple[str, ...]
    replicas: int
    shapes: tuple
    dims: tuple
    grad_axes: tuple
    stacked: tuple

    # ------------------------------------------------------------------ layout
    @property
    def scattered(self) -> tuple[bool, ...]:
        """Leaves whose gradient is sharded over every exchange axis (in their order)."""
        return tuple(d is not None and tuple(a) == self.axes for d, a in zip(self.dims, self.grad_axes))

    @property
    def widths(self) -> tuple[int, int, int]:
        """``(Ks, Kr, Lr)``: row width of the sharded part and of the rest (both padded to
        the codec's block), and the rest's true length."""
        n, block = self.replicas, self.codec.block if isinstance(self.codec, Codec) else 1
        ks = sum(math.prod(s) // n for s, sc in zip(self.shapes, self.scattered) if sc)
        lr = sum(math.prod(s) for s, sc in zip(self.shapes, self.scattered) if not sc)
        return round_up(ks, block), round_up(-(-lr // n), block), lr

    @property
    def flat_size(self) -> int:
        ks, kr, _ = self.widths
        return self.replicas * (ks + kr)

    def _pack(self, leaves: list) -> jax.Array:
        """``f32[N, Ks + Kr]`` from the local gradient leaves."""
        n, (ks, kr, lr) = self.replicas, self.widths
        sc = [jnp.moveaxis(g, d, 0).reshape(n, -1) for g, d, s in zip(leaves, self.dims, self.scattered) if s]
        rest = [g.reshape(-1) for g, s in zip(leaves, self.scattered) if not s]
        zero = jnp.zeros((n, 0), jnp.float32)
        left = jnp.concatenate(sc, axis=1) if sc else zero
        left = jnp.pad(left, ((0, 0), (0, ks - left.shape[1])))
        right = jnp.concatenate(rest) if rest else jnp.zeros((0,), jnp.float32)
        right = jnp.pad(right, (0, n * kr - lr)).reshape(n, kr)
        return jnp.concatenate([left, right], axis=1)

    def _unpack(self, mine: jax.Array, rest: jax.Array) -> list:
        """Leaves from this replica's averaged sharded row ``mine`` (``[Ks]``) and the averaged
        rest (``[Lr]``); leaves sharded over a subset of the axes take their own slice."""
        out, a, b = [], 0, 0
        for shape, d, ax, sc in zip(self.shapes, self.dims, self.grad_axes, self.scattered):
            size = math.prod(shape)
            if sc:
                k = size // self.replicas
                out.append(unflatten_leaf(mine[a:a + k], d, shape[d] // self.replicas, shape))   # this replica's shard
                a += k
                continue
            full = rest[b:b + size].reshape(shape)
            b += size
            out.append(_own_slice(full, d, ax))
        return out

    # ------------------------------------------------------------------ state
    def init(self) -> dict:
        """One replica's state (arrays without a replica axis)."""
        c, (_, kr, _) = self.codec, self.widths
        if isinstance(c, PowerSGD):
            mats = [c.matrix(tuple(s), st) for s, st in zip(self.shapes, self.stacked)]
            key = jax.random.key(c.seed)
            qs = tuple(c.init_q(jax.random.fold_in(key, i), m) for i, m in enumerate(mats) if m is not None)
            return {"residual": tuple(jnp.zeros(s, jnp.float32) for s in self.shapes), "q": qs}
        state = {}
        if c.error_feedback:
            state["residual"] = jnp.zeros((self.flat_size,), jnp.float32)
        if isinstance(c, Codec) and c.error_feedback and kr:
            state["server"] = jnp.zeros((kr,), jnp.float32)
        if c.momentum or c.optimizer_momentum:
            state["velocity"] = jnp.zeros((self.flat_size,), jnp.float32)
        if c.precondition:
            state["second_moment"] = jnp.zeros((self.flat_size,), jnp.float32)
        if c.start_step:
            state["count"] = jnp.zeros((), jnp.int32)     # exchanges applied (a skipped step rolls it back)
        return state

    # ------------------------------------------------------------------ bytes
    def wire_bytes(self, step: int | None = None) -> int:
        """Bytes each device sends per step (ring algorithms; at ``step`` for schedules that change).

        Args:
          step: the step, or ``None`` (after any schedule's changes).

        Returns:
          The bytes.
        """
        c, n, (ks, kr, _) = self.codec, self.replicas, self.widths
        if step is not None and step < c.start_step:
            return self.uncompressed_bytes()
        if isinstance(c, PowerSGD):
            return c.wire_bytes([tuple(s) for s in self.shapes], list(self.stacked), n)
        if isinstance(c, Sparsifier):
            d = c.densities[min(step // c.warmup_steps, len(c.warmup))] if (step is not None and c.warmup) else None
            return c.wire_bytes(self.flat_size, n, density=d)
        return (n - 1) * c.row_bytes(ks + kr) + ((n - 1) * c.row_bytes(kr) if kr else 0)

    def uncompressed_bytes(self) -> int:
        """What fp32 ring collectives would send: reduce-scatter of the sharded leaves,
        all-reduce of the rest."""
        n = self.replicas
        sharded = sum(math.prod(s) for s, sc in zip(self.shapes, self.scattered) if sc)
        rest = sum(math.prod(s) for s, sc in zip(self.shapes, self.scattered) if not sc)
        return round((n - 1) / n * 4 * (sharded + 2 * rest))

    # ------------------------------------------------------------------ the exchange
    def exchange(self, leaves: list, state: dict, step) -> tuple[list, dict, dict]:
        """The replicas' mean gradient; call inside a ``shard_map`` manual over :attr:`axes`.

        Args:
          leaves: this replica's full fp32 gradients.
          state: this replica's exchange state (:meth:`init`).
          step: the step (traced).

        Returns:
          ``(averaged leaves, new state, stats)``: the leaves in their gradient layout (sharded leaves:
          this replica's shard); ``stats``: ``{"residual_norm"}``, the replicas' RMS of the residuals' norms.
        """
        c = self.codec
        index = jax.lax.axis_index(axis_name(self.axes))
        if isinstance(c, PowerSGD):
            out, state = self._powersgd(leaves, state, step)
            res = jnp.sqrt(sum(jnp.sum(r * r) for r in state["residual"]))
        else:
            x = self._pack([g.astype(jnp.float32) for g in leaves])
            mine, rest, state = self._compressed(x, state, step, index)
            out = self._unpack(mine, rest)
            res = jnp.linalg.norm(state["residual"]) if "residual" in state else jnp.zeros(())
        rms = jnp.sqrt(jax.lax.psum(res * res, axis_name(self.axes)) / self.replicas)
        return out, state, {"residual_norm": rms}

    def _keys(self, step, index):
        base = jax.random.fold_in(jax.random.key(self.codec.seed), step)
        return base, jax.random.fold_in(base, index + 1)

    def _compressed(self, x, state, step, index):
        """Quantizers and sparsifiers, with their exact start (``start_step``) and 1-bit Adam's moment.
        The start counts applied exchanges (``count``, rolled back with a skipped step like Adam's own
        count), so compression starts exactly when ``adamw_frozen_variance`` freezes."""
        c, n, (_, kr, lr) = self.codec, self.replicas, self.widths
        fn = self._quantized if isinstance(c, Codec) else self._sparse
        state = dict(state)
        if isinstance(c, Codec) and c.momentum:   # dist-EF-SGDM: the replica's momentum is exchanged, not g
            state["velocity"] = c.momentum * state["velocity"] + x.reshape(-1)
            x = state["velocity"].reshape(x.shape)
        b1 = c.optimizer_momentum
        if b1:                # 1-bit Adam: this replica's Adam first moment, from the shared one
            m = state.pop("velocity").reshape(x.shape)
            x = b1 * m + (1 - b1) * x
        if c.start_step:
            count = state.pop("count")
            mine, rest, state = jax.lax.cond(count >= c.start_step, fn, self._exact, x, state, step, index)
            state["count"] = count + 1
        else:
            mine, rest, state = fn(x, state, step, index)
        if b1:                # every replica now holds the exchanged moment (no sharded leaves: checked)
            rows = jnp.pad(rest, (0, n * kr - lr)).reshape(n, kr)
            state["velocity"] = rows.reshape(-1)
            g = (rows - b1 * m) / (1 - b1)                         # Adam's b1 m + (1 - b1) g = the exchanged moment
            rest = g.reshape(-1)[:lr]
            if c.precondition and c.start_step:   # the exact steps' second moment, frozen with Adam's
                b2, s = c.precondition, state["second_moment"]
                state["second_moment"] = jnp.where(count >= c.start_step, s, b2 * s + (1 - b2) * (g * g).reshape(-1))
        return mine, rest, state

    def _exact(self, x, state, step, index):
        """The uncompressed mean (before ``start_step``): reduce-scatter of the sharded part, all-reduce of the rest."""
        n, (ks, kr, lr) = self.replicas, self.widths
        ax = axis_name(self.axes)
        none = jnp.zeros((0,), jnp.float32)
        mine = jax.lax.psum_scatter(x[:, :ks], ax, scatter_dimension=0, tiled=True)[0] / n if ks else none
        rest = (jax.lax.psum(x[:, ks:], ax) / n).reshape(-1)[:lr] if kr else none
        return mine, rest, state

    def _quantized(self, x, state, step, index):
        c, n, (ks, kr, lr) = self.codec, self.replicas, self.widths
        ax = axis_name(self.axes)
        _, key = self._keys(step, index)
        k1, k2 = jax.random.split(key)
        state = dict(state)
        v = x + state["residual"].reshape(x.shape) if c.error_feedback else x
        p1 = c.encode(v, k1)
        if c.error_feedback:
            state["residual"] = (v - c.decode(p1)).reshape(-1)
        recv = jax.lax.all_to_all(to_bytes(p1), ax, 0, 0, tiled=True)     # row i: replica i's copy of my row
        mine = jnp.sum(c.decode(from_bytes(recv, p1)) / n, axis=0)          # divide, then sum, in fp32
        if not kr:
            return mine[:ks], jnp.zeros((0,), jnp.float32), state
        u = mine[ks:]
        if c.error_feedback:
            u = u + state["server"]
        p2 = c.encode(u[None], k2)
        if c.error_feedback:
            state["server"] = u - c.decode(p2)[0]
        full = jax.lax.all_gather(to_bytes(p2)[0], ax, axis=0, tiled=False)   # [N, B]
        rest = c.decode(from_bytes(full, p2)).reshape(-1)[:lr]
        return mine[:ks], rest, state

    def _sparse(self, x, state, step, index):
        c, n, (ks, kr, lr) = self.codec, self.replicas, self.widths
        ax = axis_name(self.axes)
        shared, own = self._keys(step, index)
        flat = x.reshape(-1)
        state = dict(state)
        if c.momentum:
            state["velocity"] = c.momentum * state["velocity"] + flat
            flat = state["velocity"]
        v = state["residual"] + flat
        u = state.get("velocity", jnp.zeros((0,), jnp.float32))
        weight = 1.0 / (jnp.sqrt(state["second_moment"]) + 1e-8) if c.precondition else None   # Adam's 1 / sqrt(v)

        def branch(density):
            def run(v, u):
                k = c.k(v.shape[0], density, n)
                if c.partitioned:   # among the entries j = index (mod n), then all n k picked ones everywhere
                    own_w = None if weight is None else weight.reshape(-1, n)[:, index]
                    idx = c.indices(v.reshape(-1, n)[:, index], own, k, own_w) * n + index
                    idx = jax.lax.all_gather(idx, ax, axis=0, tiled=True)
                elif c.name == "randomk":
                    idx = c.indices(v, shared, k)
                else:
                    idx = c.indices(v, own, k, weight)
                if c.partitioned or c.name == "randomk":   # the same indices everywhere: all-reduce the values
                    dense = jnp.zeros_like(v).at[idx].set(jax.lax.psum(v[idx], ax) / n)
                else:
                    p = {"values": v[idx][None], "indices": idx[None]}
                    got = from_bytes(jax.lax.all_gather(to_bytes(p)[0], ax, axis=0, tiled=False), p)
                    dense = c.decode(got, v.shape[0]) / n
                # what was sent leaves the residual (and, with momentum correction, the velocity)
                return dense, v.at[idx].set(0.0), (u.at[idx].set(0.0) if c.momentum else u)
            return run

        branches = [branch(d) for d in c.densities]
        run = branches[0] if len(branches) == 1 else functools.partial(jax.lax.switch, c.stage(step), branches)
        dense, state["residual"], vel = run(v, u)
        if c.momentum:
            state["velocity"] = vel
        rows = dense.reshape(n, ks + kr)
        mine = jax.lax.dynamic_index_in_dim(rows, index, 0, keepdims=False)[:ks]
        return mine, rows[:, ks:].reshape(-1)[:lr], state

    def _powersgd(self, leaves, state, step):
        c, n = self.codec, self.replicas
        ax = axis_name(self.axes)
        mean = lambda flat: jax.lax.psum(flat, ax) / n   # noqa: E731
        ms = [g.astype(jnp.float32) + r for g, r in zip(leaves, state["residual"])]
        mats = [c.matrix(tuple(s), st) for s, st in zip(self.shapes, self.stacked)]

        def compressed(ms, qs):
            big = [m.reshape(mt[:3]) for m, mt in zip(ms, mats) if mt is not None]
            plain = [m for m, mt in zip(ms, mats) if mt is None]
            if not c.warm_start:
                base = jax.random.fold_in(jax.random.key(c.seed), step)
                live = [mt for mt in mats if mt is not None]
                qs = [c.init_q(jax.random.fold_in(base, i), mt) for i, mt in enumerate(live)]
            approx, qs, plain = c.compress(big, list(qs), plain, mean)
            ai, pi, full = iter(approx), iter(plain), []
            for m, mt in zip(ms, mats):
                full.append(next(ai).reshape(m.shape) if mt is not None else next(pi))
            res = tuple(m - f if mt is not None else jnp.zeros_like(m) for m, f, mt in zip(ms, full, mats))
            return full, tuple(qs), res

        def uncompressed(ms, qs):
            return mean_of(mean, ms), tuple(qs), tuple(jnp.zeros_like(m) for m in ms)

        if c.start_step > 0:
            full, qs, res = jax.lax.cond(step >= c.start_step, compressed, uncompressed, ms, state["q"])
        else:
            full, qs, res = compressed(ms, state["q"])
        return [_own_slice(f, d, a) for f, d, a in zip(full, self.dims, self.grad_axes)], {"residual": res, "q": qs}


def _own_slice(full: jax.Array, d: int | None, axes: tuple[str, ...]) -> jax.Array:
    """This device's block of ``full`` along ``d`` over ``axes`` (``tiled`` order); ``full`` where none."""
    if d is None or not axes:
        return full
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    i = jax.lax.axis_index(axis_name(tuple(axes)))
    size = full.shape[d] // n
    return jax.lax.dynamic_slice_in_dim(full, i * size, size, axis=d)


def exchange_plan(codec, shapes: list, *, dims: list, grad_axes: list, stacked: list,
                  mesh_sizes: dict, zero: int = 0, checked: bool = True) -> ExchangePlan:
    """An :class:`ExchangePlan` over the data axes of ``mesh_sizes`` larger than 1.

    Args:
      codec: a codec of :mod:`jaxpar.parallel.compression`.
      shapes: each gradient leaf's shape.
      dims, grad_axes: each leaf's ZeRO dimension and the data axes its gradient is sharded over
        (:func:`jaxpar.parallel._data_parallel.manual_layout`).
      stacked: whether each leaf's axis 0 is the stacked ``layers`` axis (PowerSGD compresses each layer).
      mesh_sizes: the mesh's axis sizes by name.
      zero: the ZeRO stage; gradients sharded over the data axes count as ZeRO-2 where it is lower.
      checked: check the compatibility table's rules of a codec (:func:`jaxpar.compat.codec_problems`);
        ``False`` where the table has run for the strategy (``init_train_state``, ``make_train_step``).

    Returns:
      The plan.

    Raises:
      CompressionError: the table's refusal (no data axis; 1-bit Adam with sharded gradients).
    """
    if checked:         # a data axis; 1-bit Adam x gradients sharded by ZeRO-2/3 or fsdp
        raise_first(codec_problems(codec, mesh_sizes, zero))
    axes = tuple(a for a in ("fsdp", "data") if mesh_sizes.get(a, 1) > 1)
    order = [a for ga in grad_axes for a in ga]
    if any(set(ga) == set(axes) for ga in grad_axes):
        axes = next(tuple(ga) for ga in grad_axes if set(ga) == set(axes))   # the gradients' own order
    elif order:
        axes = tuple(sorted(axes, key=lambda a: order.index(a) if a in order else len(order)))
    plan = ExchangePlan(codec, axes, math.prod(mesh_sizes[a] for a in axes), tuple(tuple(s) for s in shapes),
                        tuple(dims), tuple(tuple(a) for a in grad_axes), tuple(stacked))
    if checked and any(plan.scattered):     # ... gradients sharded over the data axes, whatever ``zero`` says
        raise_first(codec_problems(codec, mesh_sizes, max(zero, 2)))
    return plan
