"""Run any valid schedule table as one SPMD program: ``shard_map`` manual over ``pipe``.

Each device holds its stages' layers (``[v, Lmax, ...]``: ``v`` chunks of at
most ``Lmax`` layers). The program is the lowered table (:mod:`.program`) run
by a ``lax.scan`` over its ticks; at every tick each device picks its own action
with a ``lax.switch`` on its row of the table (so idle stages compute nothing in
bubbles):

* **F**: the stage's layers on one micro-batch, one ``jax.vjp`` per layer; the
  residuals go to a slot of a fixed buffer (sized by the table's peak in-flight
  count, not by ``m``). Virtual stage 0 embeds the micro-batch first; the last
  virtual stage runs the head and the loss and keeps ``d loss / d y``.
* **B**: the stored per-layer vjps run in reverse on the received cotangent.
  With a fused backward it also accumulates the weight gradients; with a split
  backward (zero-bubble) it keeps each layer's output cotangent for **W**, which
  later computes the weight gradients from them.

After the switch, ``ppermute`` sends activations forward and cotangents
backward, only between the stages that send at that tick (wrap-around
``p-1 -> 0`` for interleaved chunks): each distinct set of pairs is one
``ppermute``, chosen by a ``lax.switch`` whose index is the same on every device. The other mesh axes stay automatic, so
data / ZeRO / tensor parallelism work inside a stage. Gradients accumulate over
micro-batches; the result equals the non-pipelined loss and gradients.

Example::

    >>> fn = pipeline_value_and_grad(parts, mesh, rules, lower(one_f_one_b(4, 8)),
    ...                              stage_layers=(2, 2, 2, 2))          # doctest: +SKIP
    >>> loss, (g_pre, g_blocks, g_post) = fn(pre, stage_blocks, post, microbatches)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..rules import drop_axes, use_block_transform, use_rules
from .parts import PipelineParts
from .program import Program

__all__ = ["pipeline_value_and_grad", "PIPE"]

PIPE = "pipe"


class _LayerVJP:
    """Static structure of one layer's ``jax.vjp``: the pytree of the pullback,
    which residual leaves are the layer's own parameters (not stored: they are
    passed back in) and the shapes of the stored ones."""

    def __init__(self, layer: Callable, p_shapes: Any, x_shape: jax.ShapeDtypeStruct):
        # The barrier makes the input an internal value of the layer, so JAX keeps it among
        # the opaque residuals in every trace (left alone, it is sometimes recorded as a
        # primal argument instead, which reorders the residuals between traces).
        self.layer = lambda p, x: layer(p, jax.lax.optimization_barrier(x))
        box: dict[str, Any] = {}

        def probe(p, x):
            _, vjp = jax.vjp(self.layer, p, x)
            leaves, box["tree"] = jax.tree.flatten(vjp)
            ids = {id(q): i for i, q in enumerate(jax.tree.leaves(p))}
            box["from_params"] = [ids.get(id(leaf)) for leaf in leaves]
            return [leaf for leaf, i in zip(leaves, box["from_params"]) if i is None]

        self.stored = jax.eval_shape(probe, p_shapes, x_shape)
        self.tree, self.from_params = box["tree"], box["from_params"]
        self._kinds = [(r.shape, r.dtype) for r in self.stored]

    def forward(self, p, x):
        """``(y, stored residuals)`` of one layer."""
        y, vjp = jax.vjp(self.layer, p, x)
        leaves = jax.tree.leaves(vjp)
        ids = {id(q): i for i, q in enumerate(jax.tree.leaves(p))}
        stored = [leaf for leaf, i in zip(leaves, self.from_params) if i is None]
        if [ids.get(id(leaf)) for leaf in leaves] != self.from_params or \
                [(r.shape, r.dtype) for r in stored] != self._kinds:
            raise RuntimeError("pipeline executor: this layer's residuals differ between two traces of the "
                               "same layer, so stored residuals could be misread. Please report it with the "
                               "layer; remat='full' (residuals = inputs only) avoids it.")
        return y, stored

    def pullback(self, p, stored):
        params, it = jax.tree.leaves(p), iter(stored)
        leaves = [next(it) if i is None else params[i] for i in self.from_params]
        return jax.tree.unflatten(self.tree, leaves)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _get(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _put(buf, i, value):
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _rows(program: Program, kinds: list, fwd_pats: list, bwd_pats: list) -> dict:
    """The lowered table as ``[ticks, stages]`` int arrays (scanned over ticks)."""
    ticks = program.ticks
    col = lambda f: jnp.asarray(np.array([[f(i) for i in t.instrs] for t in ticks], np.int32))   # noqa: E731
    fields = {"mb": "microbatch", "chunk": "chunk", "res": "res", "inbox": "inbox", "dy": "dy", "grad": "grad"}
    pat = lambda pats, pairs: pats.index(pairs) + 1 if pairs else 0   # noqa: E731
    return {
        "kind": col(lambda i: kinds.index(i.kind)),
        "ins": {k: col(lambda i, a=a: getattr(i, a)) for k, a in fields.items()},
        "fwd_pat": jnp.asarray([pat(fwd_pats, t.fwd_pairs) for t in ticks], jnp.int32),
        "bwd_pat": jnp.asarray([pat(bwd_pats, t.bwd_pairs) for t in ticks], jnp.int32),
        "fwd_recv": jnp.asarray([t.fwd_recv for t in ticks], jnp.int32),
        "bwd_recv": jnp.asarray([t.bwd_recv for t in ticks], jnp.int32),
    }


def _accumulate(acc: Any, grads: Any) -> Any:
    """``acc + grads`` leaf by leaf, in ``acc``'s dtypes."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, grads)


def pipeline_value_and_grad(parts: PipelineParts, mesh, rules, program: Program, *,
                            stage_layers: Sequence[int]) -> Callable:
    """Build ``fn(pre, blocks, post, microbatches) -> (loss, (g_pre, g_blocks, g_post))``.

    - ``blocks``: every block parameter as ``[v, p, Lmax, ...]`` (chunk, stage,
      layer), sharded ``P(None, 'pipe', ...)``; see :func:`jaxpar.pipeline.partition.to_stages`.
    - ``microbatches``: the batch pytree as ``[m, rows, ...]``.
    - ``stage_layers``: layers of each virtual stage ``k = chunk * p + stage``;
      layers beyond a stage's count are padding and are skipped at run time.

    The loss is the mean of the micro-batch losses; the gradients are those of
    that mean (float32), ``g_blocks`` in the ``blocks`` layout.
    """
    sched = program.schedule
    p, m, v = sched.num_stages, sched.num_microbatches, sched.num_chunks
    if dict(mesh.shape).get(PIPE, 1) != p:
        raise ValueError(f"the schedule {sched.name!r} has {p} stages but the mesh's {PIPE!r} axis has size "
                         f"{dict(mesh.shape).get(PIPE, 1)}; build the schedule with num_stages equal to the "
                         f"pipe axis (mesh axes: {dict(mesh.shape)}).")
    counts = np.asarray(stage_layers, np.int32).reshape(v, p)      # [chunk, stage]
    lmax = int(counts.max())
    uneven = bool((counts != lmax).any())
    inner_rules = drop_axes(rules, (PIPE,))
    split = program.split_backward

    def body(pre, blocks, post, mbs):
        s = jax.lax.axis_index(PIPE)
        blocks = jax.tree.map(lambda a: a[:, 0], blocks)                        # [v, Lmax, ...]
        mb0 = _index(mbs, 0)
        x_shape = jax.eval_shape(parts.pre, pre, mb0)
        lv = _LayerVJP(parts.layer, _index(_index(blocks, 0), 0), x_shape)
        n_layers = _get(jnp.asarray(counts.T), s)                                  # [v] on this stage

        def stage_forward(bp, x, n):
            def one(h, pl):
                return lv.forward(pl[0], h)

            def skip(h, pl):
                return h, [jnp.zeros(r.shape, r.dtype) for r in lv.stored]

            def step(h, pl):
                return jax.lax.cond(pl[1] < n, one, skip, h, pl) if uneven else one(h, pl)

            return jax.lax.scan(step, x, (bp, jnp.arange(lmax)))

        def stage_backward(bp, res, dy, n, want):
            """Reverse over the layers. want='both': (dx, dparams); 'input': (dx, per-layer dys)."""
            def one(g, item):
                pl, r, _ = item
                dp, dx = lv.pullback(pl, r)(g)
                return dx, (dp if want == "both" else g)

            def skip(g, item):
                zero = jax.tree.map(jnp.zeros_like, item[0]) if want == "both" else jnp.zeros_like(g)
                return g, zero

            def step(g, item):
                return jax.lax.cond(item[2] < n, one, skip, g, item) if uneven else one(g, item)

            return jax.lax.scan(step, dy, (bp, res, jnp.arange(lmax)), reverse=True)

        def weight_grads(bp, res, gys, n):
            def one(item):
                pl, r, g, _ = item
                return lv.pullback(pl, r)(g)[0]

            def step(_, item):
                if uneven:
                    return None, jax.lax.cond(item[3] < n, one, lambda it: jax.tree.map(jnp.zeros_like, it[0]), item)
                return None, one(item)

            return jax.lax.scan(step, None, (bp, res, gys, jnp.arange(lmax)))[1]

        def branch(kind):
            """One action on one slot of each buffer: ``o`` holds what was read at this
            tick's slots; the result says what to write back (unchanged for other actions)."""
            def run(o):
                op, ins, o = kind[0], o["ins"], dict(o)
                c = ins["chunk"]
                n = n_layers[c]
                bp = _index(blocks, c) if op != "idle" else None
                mb = _index(mbs, ins["mb"])
                o["send_f"] = o["send_b"] = jnp.zeros(x_shape.shape, x_shape.dtype)
                if op == "F":
                    first, last = kind[1], kind[2]
                    x = parts.pre(pre, mb) if first else o["x"]
                    y, o["res"] = stage_forward(bp, x, n)
                    if last:
                        loss, (g_post, dy) = jax.value_and_grad(parts.post, argnums=(0, 1))(post, y, mb)
                        o["loss"] = o["loss"] + loss.astype(jnp.float32)
                        o["g_post"] = jax.tree.map(lambda a, d: a + d.astype(a.dtype) / m, o["g_post"], g_post)
                        o["dy_out"] = (dy / m).astype(x_shape.dtype)
                    else:
                        o["send_f"] = y.astype(x_shape.dtype)
                elif op == "B":
                    if split:
                        dx, o["gys"] = stage_backward(bp, o["res"], o["dy"], n, "input")
                    else:
                        dx, dps = stage_backward(bp, o["res"], o["dy"], n, "both")
                        o["g_chunk"] = _accumulate(o["g_chunk"], dps)
                    if kind[1]:   # first virtual stage: backprop the embedding
                        _, pull = jax.vjp(lambda q: parts.pre(q, mb), pre)
                        g_pre = pull(dx.astype(x_shape.dtype))[0]
                        o["g_pre"] = _accumulate(o["g_pre"], g_pre)
                    else:
                        o["send_b"] = dx.astype(x_shape.dtype)
                elif op == "W":
                    dps = weight_grads(bp, o["res"], o["gys"], n)
                    o["g_chunk"] = _accumulate(o["g_chunk"], dps)
                del o["ins"], o["x"], o["dy"]
                return o
            return run

        f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)   # noqa: E731
        buf = lambda n, shape, dtype: jnp.zeros((max(n, 1), *shape), dtype)            # noqa: E731
        st = {   # inboxes get one more slot: where stages that receive nothing write the ppermute's zeros
            "res": [buf(program.n_res, (lmax, *r.shape), r.dtype) for r in lv.stored],
            "inbox_f": buf(program.n_fwd + 1, x_shape.shape, x_shape.dtype),
            "inbox_b": buf(program.n_bwd + 1, x_shape.shape, x_shape.dtype),
            "grads_y": buf(program.n_grad if split else 0, (lmax, *x_shape.shape), x_shape.dtype),
            "g_blocks": f32(blocks), "g_pre": f32(pre), "g_post": f32(post),
            "loss": jnp.zeros((), jnp.float32),
        }
        kinds = sorted({ins.kind for tick in program.ticks for ins in tick.instrs}, key=repr)
        branches = [branch(k) for k in kinds]
        fwd_pats = sorted({t.fwd_pairs for t in program.ticks if t.fwd_pairs})
        bwd_pats = sorted({t.bwd_pairs for t in program.ticks if t.bwd_pairs})

        def exchange(pats, pat, x):
            """Send ``x`` along the tick's pairs; the pattern is the same on every device."""
            fns = [jnp.zeros_like] + [lambda y, q=q: jax.lax.ppermute(y, PIPE, q) for q in pats]
            return jax.lax.switch(pat, fns, x) if len(fns) > 1 else fns[0](x)

        def tick(st, row):
            ins = {k: _get(a, s) for k, a in row["ins"].items()}
            st = dict(st)
            # Read one slot of each buffer, run the action on it, write the slot back:
            # the big buffers never enter the switch (a conditional would copy them).
            o = {"ins": ins, "x": _get(st["inbox_f"], ins["inbox"]), "dy": _get(st["inbox_b"], ins["inbox"]),
                 "dy_out": _get(st["inbox_b"], ins["dy"]), "res": [_get(b, ins["res"]) for b in st["res"]],
                 "gys": _get(st["grads_y"], ins["grad"]), "g_chunk": _index(st["g_blocks"], ins["chunk"]),
                 "g_pre": st["g_pre"], "g_post": st["g_post"], "loss": st["loss"]}
            o = jax.lax.switch(_get(row["kind"], s), branches, o)
            st["res"] = [_put(b, ins["res"], r) for b, r in zip(st["res"], o["res"])]
            st["inbox_b"] = _put(st["inbox_b"], ins["dy"], o["dy_out"])
            st["grads_y"] = _put(st["grads_y"], ins["grad"], o["gys"])
            st["g_blocks"] = jax.tree.map(lambda a, g: _put(a, ins["chunk"], g), st["g_blocks"], o["g_chunk"])
            st.update(g_pre=o["g_pre"], g_post=o["g_post"], loss=o["loss"])
            send_f, send_b = o["send_f"], o["send_b"]
            got = exchange(fwd_pats, row["fwd_pat"], send_f)
            st["inbox_f"] = _put(st["inbox_f"], _get(row["fwd_recv"], s), got)
            got = exchange(bwd_pats, row["bwd_pat"], send_b)
            st["inbox_b"] = _put(st["inbox_b"], _get(row["bwd_recv"], s), got)
            return st, None

        rows = _rows(program, kinds, fwd_pats, bwd_pats)
        st, _ = jax.lax.scan(tick, st, rows)
        psum = lambda t: jax.tree.map(lambda a: jax.lax.psum(a, PIPE), t)   # noqa: E731
        g_blocks = jax.tree.map(lambda a: a[:, None], st["g_blocks"])
        return jax.lax.psum(st["loss"], PIPE) / m, (psum(st["g_pre"]), g_blocks, psum(st["g_post"]))

    stage_spec = lambda t: jax.tree.map(lambda _: P(None, PIPE), t)   # noqa: E731
    rep = lambda t: jax.tree.map(lambda _: P(), t)                    # noqa: E731

    def fn(pre, blocks, post, mbs):
        if jax.tree.leaves(blocks)[0].shape[:2] != (v, p):
            raise ValueError(f"pipeline blocks must be laid out [chunks={v}, stages={p}, layers, ...]; got "
                             f"leading dims {jax.tree.leaves(blocks)[0].shape[:2]}.")
        smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE}, check_vma=False,
                             in_specs=(rep(pre), stage_spec(blocks), rep(post), rep(mbs)),
                             out_specs=(P(), (rep(pre), stage_spec(blocks), rep(post))))
        with use_rules(mesh, inner_rules), use_block_transform(None):
            return smap(pre, blocks, post, mbs)

    return fn

