"""jaxpar.parallel.context: attention under context parallelism (ring, all-gather, Ulysses) against one device.

Every sharded run is compared, values and gradients w.r.t. q, k and v at fp32 1e-5, with
``reference`` below: plain jnp softmax(QK^T * scale + mask) V on one device, GQA by repeating the
K/V heads. The balanced runs permute their inputs with ``to_balanced`` (segment ids too) and
un-permute outputs and gradients with ``from_balanced`` before comparing, so they are checked on the
natural sequence. One compiled program per case serves both the numbers and the HLO checks.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import need_devices
import jaxpar
from jaxpar.attention import AttentionError, attention
from jaxpar.parallel import context as cp
from jaxpar.options import ContextParallel
from jaxpar.analysis import collectives, count
from jaxpar.parallel.context._ring import RingSpec, ring_forward
from jaxpar.rules import drop_axes, logical_to_spec, use_rules

B, L, H, D = 2, 32, 8, 4
RULES = (("batch", "data"), ("length", "context"), ("heads", "tensor"))
QKV, SEG = ("batch", "length", "heads", None), ("batch", "length")


def reference(q, k, v, seg, causal, window=None, softcap=None):
    """softmax(cap(Q K^T / sqrt(D)) + mask) V on one device; K/V heads repeated for GQA. The mask:
    causal, the sliding window (query p sees keys p - window < k, and k < p + window without causal)
    and the segments; the cap: softcap * tanh(s / softcap)."""
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = jnp.ones((1, L, L), bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((L, L), bool))[None]
    if window is not None:
        gap = np.arange(L)[:, None] - np.arange(L)[None, :]
        mask = mask & ((gap < window) & (causal | (-gap < window)))[None]
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def inputs(kv_heads, segments, scale=1.0):
    """q, k, v, the output cotangent w and segment ids (3-4 packed documents a row; row 1 ends in
    padding, id 0), all in the natural order."""
    rng = np.random.default_rng(kv_heads)
    normal = lambda *s: (scale * rng.normal(size=s)).astype(np.float32)  # noqa: E731
    seg = np.cumsum(rng.random((B, L)) < 0.12, axis=1).astype(np.int32) + 1
    seg[1, -5:] = 0
    return normal(B, L, H, D), normal(B, L, kv_heads, D), normal(B, L, kv_heads, D), normal(B, L, H, D), \
        (seg if segments else None)


def attention_vjp(q, k, v, w, *seg, causal):
    """The attention's output and its gradients w.r.t. q, k, v for the output cotangent w."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg[0] if seg else None),
                       q, k, v)
    return out, vjp(w)


@functools.lru_cache(maxsize=None)
def expected(kv_heads, causal, segments, scale=1.0, window=None, softcap=None):
    q, k, v, w, seg = inputs(kv_heads, segments, scale)
    out, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, seg, causal, window, softcap), q, k, v)
    return np.asarray(out), [np.asarray(g) for g in vjp(w)]


class Case(NamedTuple):
    method: str
    mesh: tuple          # ((axis, size), ...)
    causal: bool = True
    segments: bool = True
    kv_heads: int = 2
    balance: bool = True
    rules: tuple = RULES

    @property
    def context(self):
        return dict(self.mesh)["context"]

    def __str__(self):
        mesh = "x".join(f"{a}{n}" for a, n in self.mesh)
        return (f"{self.method}-{mesh}-{'causal' if self.causal else 'full'}-{'seg' if self.segments else 'noseg'}"
                f"-kv{self.kv_heads}-{'bal' if self.balance else 'nat'}")


def make_mesh(case):
    sizes = dict(case.mesh)
    return jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])


def placed(case, mesh, arrays):
    """The arrays, balanced if the case says so, placed by the rules' ``NamedSharding``."""
    perm = (lambda x: cp.to_balanced(x, 1, case.context)) if case.balance else (lambda x: x)
    out = []
    for x in arrays:
        names = QKV if x.ndim == 4 else SEG
        if x.ndim == 5:                                   # stacked over pipe
            names, x = ("pipe",) + QKV, np.stack([perm(y) for y in x])
        else:
            x = perm(x)
        out.append(jax.device_put(x, NamedSharding(mesh, logical_to_spec(names, case.rules, mesh, shape=x.shape))))
    return out


def natural(case, x, axis=1):
    return np.asarray(cp.from_balanced(x, axis, case.context) if case.balance else x)


@functools.lru_cache(maxsize=None)
def run(case):
    """(mesh, compiled program, output, gradients) of a case, in the natural order."""
    mesh = make_mesh(case)
    q, k, v, w, seg = inputs(case.kv_heads, case.segments)
    args = placed(case, mesh, [q, k, v, w] + ([seg] if case.segments else []))
    with use_rules(mesh, case.rules), cp.use_context_parallel(case.method, balance=case.balance):
        compiled = jax.jit(functools.partial(attention_vjp, causal=case.causal)).lower(*args).compile()
    out, grads = compiled(*args)
    return mesh, compiled, natural(case, out), [natural(case, g) for g in grads]


def assert_matches(out, grads, want):
    np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-5)
    for name, g, e in zip("qkv", grads, want[1]):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


CASES = [
    Case("ring", (("context", 2),)),
    Case("ring", (("context", 8),)),
    Case("ring", (("context", 4),), causal=False, balance=False),
    Case("ring", (("context", 8),), segments=False, kv_heads=8, balance=False),
    Case("all_gather", (("context", 2),), balance=False),
    Case("all_gather", (("context", 8),)),
    Case("all_gather", (("context", 4),), causal=False, segments=False, kv_heads=8),
    Case("ulysses", (("context", 2),)),
    Case("ulysses", (("context", 8),)),                  # 2 K/V heads < C = 8: repeated 4x
    Case("ulysses", (("context", 4),), causal=False, segments=False, kv_heads=8, balance=False),
    Case("ring", (("data", 2), ("context", 4))),
    Case("all_gather", (("data", 2), ("context", 4)), balance=False),
    Case("ring", (("context", 4), ("tensor", 2))),
    Case("ulysses", (("context", 4), ("tensor", 2))),    # 4 heads and 1 K/V head a tensor shard
]


@pytest.mark.parametrize("causal,segments,kv_heads", [(True, True, 2), (False, False, 8), (True, False, 8)])
def test_one_device_is_the_reference(causal, segments, kv_heads):
    q, k, v, w, seg = inputs(kv_heads, segments)
    out, grads = jax.jit(functools.partial(attention_vjp, causal=causal))(q, k, v, w, *([seg] if segments else []))
    assert_matches(np.asarray(out), [np.asarray(g) for g in grads], expected(kv_heads, causal, segments))


@need_devices(8)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_context_parallel_matches_one_device(case):
    _, _, out, grads = run(case)
    assert_matches(out, grads, expected(case.kv_heads, case.causal, case.segments))


def kv_stack_bytes(case):
    """Bytes of one device's K and V shards (fp32)."""
    sizes = dict(case.mesh)
    return 2 * B // sizes.get("data", 1) * L // case.context * case.kv_heads // sizes.get("tensor", 1) * D * 4


def seg_bytes(case):
    """Bytes of one device's segment ids (int32)."""
    return B // dict(case.mesh).get("data", 1) * L // case.context * 4


@need_devices(8)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_collectives_are_the_methods_over_context_only(case):
    """Forward + backward program: the method's collectives, all over ``context`` and nothing else.

    ring: forward C-1 hops of one device's K, V (and key segment ids) in one buffer, backward C-1
    hops of K, V (segment ids), dK, dV and one of dK, dV to bring them home; no all-gather, and no hop
    carries more than one device's K/V and their gradients.
    all_gather: K, V (and segment ids) gathered, dK, dV reduce-scattered.
    ulysses: all-to-alls of q, k, v, out and of their cotangents; segment ids gathered.
    """
    mesh, compiled, _, _ = run(case)
    colls, c, seg = collectives(compiled, mesh), case.context, int(case.segments)
    assert all(x.axes == ("context",) for x in colls), {(x.kind, x.axes) for x in colls}
    kinds = {kind: count(colls, kind, axes=("context",)) for kind in ("collective-permute", "all-gather",
                                                                      "reduce-scatter", "all-to-all", "all-reduce")}
    want = {"ring": {"collective-permute": 2 * c - 1},
            "all_gather": {"all-gather": 2 + seg, "reduce-scatter": 2},
            "ulysses": {"all-to-all": 8, "all-gather": seg}}[case.method]
    assert kinds == {kind: want.get(kind, 0) for kind in kinds}
    if case.method == "ring":
        assert max(x.bytes for x in colls) == 2 * kv_stack_bytes(case) + seg * seg_bytes(case)


@need_devices(8)
@pytest.mark.parametrize("size,segments", [(2, True), (8, False)])
def test_ring_forward_passes_kv_c_minus_1_times(size, segments):
    """The forward alone: C-1 collective-permutes over context, each one device's K and V (and key
    segment ids)."""
    case = Case("ring", (("context", size),), segments=segments, kv_heads=8)
    mesh = make_mesh(case)
    q, k, v, _, seg = inputs(8, segments)
    args = placed(case, mesh, [q, k, v] + ([seg] if segments else []))
    with use_rules(mesh, RULES), cp.use_context_parallel("ring", balance=True):
        compiled = jax.jit(lambda q, k, v, *s: attention(q, k, v, segment_ids=s[0] if s else None)).lower(
            *args).compile()
    hop = ("collective-permute", ("context",), kv_stack_bytes(case) + segments * seg_bytes(case))
    assert [(x.kind, x.axes, x.bytes) for x in collectives(compiled, mesh)] == [hop] * (size - 1)


@need_devices(2)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_inside_a_users_shard_map_over_context_it_runs_on_the_local_shards(method):
    """Called where ``context`` is already manual (the user's own shard_map), attention runs the
    method on the shards it is given."""
    mesh = jaxpar.make_mesh({"context": 2}, devices=jax.devices()[:2])
    q, k, v, _, seg = inputs(2, True)

    def local(q, k, v, seg):
        with use_rules(mesh, RULES), cp.use_context_parallel(method):
            return attention(q, k, v, segment_ids=seg)
    smap = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "context"),) * 3 + (P(None, "context"),),
                         out_specs=P(None, "context"), check_vma=False)
    np.testing.assert_allclose(jax.jit(smap)(q, k, v, seg), expected(2, True, True)[0], rtol=1e-5, atol=1e-5)


@need_devices(8)
def test_nested_in_a_shard_map_manual_over_pipe():
    """Each of 2 pipeline stages (an outer shard_map manual over ``pipe``) runs ring attention over a
    context axis of 4 on its own inputs, as the pipeline executor would; both match one device, and
    the 2C - 1 hops (C - 1 forward, C backward) are all-gathers over context on XLA:CPU."""
    case = Case("ring", (("pipe", 2), ("context", 4)), kv_heads=2)
    mesh = make_mesh(case)
    q, k, v, w, seg = inputs(2, True)
    stacked = [np.stack([x, 0.5 * x]) for x in (q, k, v, w)]
    args = placed(case, mesh, stacked + [seg])
    inner_rules = drop_axes(RULES, ("pipe",))

    def stage(q2, k2, v2, w2, s):
        with use_rules(mesh, inner_rules):
            out, grads = attention_vjp(q2[0], k2[0], v2[0], w2[0], s, causal=True)
        return out[None], tuple(g[None] for g in grads)
    smap = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipe"),) * 4 + (P(),), out_specs=P("pipe"),
                         axis_names={"pipe"}, check_vma=False)
    with use_rules(mesh, RULES), cp.use_context_parallel("ring", balance=True):
        compiled = jax.jit(smap).lower(*args).compile()
    out, grads = compiled(*args)
    for p, scale in enumerate((1.0, 0.5)):
        assert_matches(natural(case, out[p]), [natural(case, g[p]) for g in grads], expected(2, True, True, scale))
    colls = collectives(compiled, mesh)      # XLA:CPU inside a stage: each hop an all-gather (context.ring, hop)
    assert count(colls, "all-gather", axes=("context",)) == 2 * 4 - 1 == len(colls), colls


@need_devices(4)
def test_ring_in_bfloat16_is_as_close_as_one_device_in_bfloat16():
    """bf16 q/k/v: output and gradients come back in bf16 and are (within 1.5x) as close to the fp32
    reference as one device's bf16 attention (the ring's hops carry bf16 K/V and fp32 dK/dV, and it
    accumulates in fp32)."""
    case = Case("ring", (("context", 4),))
    mesh = make_mesh(case)
    q, k, v, w, seg = inputs(2, True)
    args = [x.astype(jnp.bfloat16) for x in placed(case, mesh, [q, k, v, w])] + placed(case, mesh, [seg])
    vjp = jax.jit(functools.partial(attention_vjp, causal=True))
    with use_rules(mesh, RULES), cp.use_context_parallel("ring", balance=True):
        out, grads = vjp(*args)
    one_out, one_grads = vjp(*[jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, w)], seg)
    assert {out.dtype, *(g.dtype for g in grads)} == {jnp.dtype(jnp.bfloat16)}
    want = expected(2, True, True)
    for got, one, ref in zip((out, *grads), (one_out, *one_grads), (want[0], *want[1])):
        err = np.abs(natural(case, got.astype(jnp.float32)) - ref).max()
        assert 0 < err <= 1.5 * np.abs(np.asarray(one, np.float32) - ref).max()


@need_devices(8)
def test_ring_temporaries_fall_with_the_context_size():
    """Compiled forward + backward at length 1024: the ring's per-device temporaries over a context
    axis of 8 are at most 1/6 of one device's (measured: 0.9 vs 48 MiB) and below the all-gather
    method's, which holds the whole K/V and a [length / C, length] score matrix (6.3 MiB)."""
    length, heads, dim = 1024, 2, 16

    def temp_bytes(size, method):
        mesh = jaxpar.make_mesh({"context": size}, devices=jax.devices()[:size])
        rules = RULES if size > 1 else (("batch", None), ("length", None), ("heads", None))
        x = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "context" if size > 1 else None)))
        with use_rules(mesh, rules), cp.use_context_parallel(method, balance=True):
            compiled = jax.jit(functools.partial(attention_vjp, causal=True)).lower(x, x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, ring, gathered = temp_bytes(1, "ring"), temp_bytes(8, "ring"), temp_bytes(8, "all_gather")
    assert 6 * ring <= one and ring < gathered, (one, ring, gathered)


# ----------------------------------------------------------------------------- sliding window, soft-cap


BIG = 1 << 30        # a "global" layer's window in a scan over layers


def masked_vjp(q, k, v, w, seg, window, *, causal, softcap):
    """:func:`attention_vjp` with segment ids, a window (static, or traced when given to jit) and a soft-cap."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg, window=window,
                                                    softcap=softcap), q, k, v)
    return out, vjp(w)


class MaskCase(NamedTuple):
    method: str
    context: int
    balance: bool
    window: int | None
    traced: bool = False         # the window is an int32 argument of the jitted function
    softcap: float | None = None
    causal: bool = True

    def __str__(self):
        window = "nowin" if self.window is None else f"{'traced' if self.traced else 'static'}{self.window}"
        return (f"{self.method}-context{self.context}-{'bal' if self.balance else 'nat'}-{window}"
                f"-cap{self.softcap}-{'causal' if self.causal else 'full'}")


MASK_CASES = [            # L = 32: chunks of 4 (balanced, C = 4) to 16 (natural, C = 2)
    MaskCase("ring", 4, True, 3),
    MaskCase("ring", 4, False, 3, softcap=2.0),      # steps 0 and 1 of 4: 1 hop forward, 2 backward
    MaskCase("ring", 4, False, 5, causal=False),     # a window on both sides
    MaskCase("ring", 2, False, 5, traced=True, softcap=2.0),
    MaskCase("ring", 2, True, None, softcap=2.0),
    MaskCase("all_gather", 4, True, 6, traced=True, softcap=2.0),
    MaskCase("all_gather", 2, False, 3, causal=False),
    MaskCase("ulysses", 4, True, 3, softcap=2.0),
    MaskCase("ulysses", 2, False, 6, traced=True),
]


@functools.lru_cache(maxsize=None)
def run_masked(case):
    """(mesh, compiled program, output, gradients) of a :class:`MaskCase`, in the natural order."""
    layout = Case(case.method, (("context", case.context),), balance=case.balance)
    mesh = make_mesh(layout)
    q, k, v, w, seg = inputs(2, True)
    args = placed(layout, mesh, [q, k, v, w, seg]) + ([np.int32(case.window)] if case.traced else [])
    f = functools.partial(masked_vjp, causal=case.causal, softcap=case.softcap)
    if not case.traced:
        f = functools.partial(f, window=case.window)
    with use_rules(mesh, RULES), cp.use_context_parallel(case.method, balance=case.balance):
        compiled = jax.jit(f).lower(*args).compile()
    out, grads = compiled(*args)
    return mesh, compiled, natural(layout, out), [natural(layout, g) for g in grads]


@pytest.mark.parametrize("causal,window,traced,softcap", [
    (True, 5, False, None), (True, 6, True, 2.0), (False, 5, False, 2.0), (True, None, False, 2.0)])
def test_one_device_window_and_softcap_are_the_reference(causal, window, traced, softcap):
    q, k, v, w, seg = inputs(2, True)
    f = functools.partial(masked_vjp, causal=causal, softcap=softcap)
    out, grads = jax.jit(f)(q, k, v, w, seg, np.int32(window)) if traced else jax.jit(f, static_argnums=5)(
        q, k, v, w, seg, window)
    assert_matches(np.asarray(out), [np.asarray(g) for g in grads], expected(2, causal, True, 1.0, window, softcap))


@need_devices(4)
@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_context_parallel_window_and_softcap_match_one_device(case):
    mesh, compiled, out, grads = run_masked(case)
    assert_matches(out, grads, expected(2, case.causal, True, 1.0, case.window, case.softcap))
    if case.method == "ring" and not case.traced:  # a static window drops the steps no device needs, hops too:
        # natural, causal, window 3 < chunk 8: steps 0 and 1 (1 hop forward, 1 + 1 home backward); else all C
        steps = 2 if (case.window, case.balance, case.causal) == (3, False, True) else case.context
        assert count(collectives(compiled, mesh), "collective-permute", axes=("context",)) == 2 * steps - 1


@need_devices(4)
def test_a_per_layer_window_under_scan():
    """A model scanning over layers passes each layer's window as a traced int (local 6, global BIG):
    each layer's output and gradients match one device's with that window (ring, balanced)."""
    case = Case("ring", (("context", 4),))
    mesh = make_mesh(case)
    q, k, v, w, seg = inputs(2, True)
    args = placed(case, mesh, [q, k, v, w, seg])

    def layers(q, k, v, w, seg, windows):
        one = functools.partial(masked_vjp, q, k, v, w, seg, causal=True, softcap=None)
        return jax.lax.scan(lambda c, window: (c, one(window)), None, windows)[1]
    with use_rules(mesh, RULES), cp.use_context_parallel("ring", balance=True):
        out, grads = jax.jit(layers)(*args, jnp.asarray([6, BIG], jnp.int32))
    for i, window in enumerate((6, None)):
        want = expected(2, True, True, 1.0, window)
        assert_matches(natural(case, out[i]), [natural(case, g[i]) for g in grads], want)


def test_a_sliding_window_skips_the_blocks_it_masks():
    """L = 32 over C = 4: a window of 3 needs each natural block and the one before it (the causal ring
    computes 1..4); balanced, device 0 its 2 diagonal blocks and chunk 7's against chunk 6, the others
    4 of the 9 a device; a window of 1 only the diagonal; a window as long as the sequence all of the
    causal ones."""
    assert cp.ring_block_pairs(L, 4, balance=False, window=3) == cp.RingWork((1, 2, 2, 2), 8)
    assert cp.ring_block_pairs(L, 4, balance=False, window=1).pairs == (1, 1, 1, 1)
    assert cp.ring_block_pairs(L, 4, balance=True, window=3) == cp.RingWork((3, 4, 4, 4), 4)
    assert cp.ring_block_pairs(L, 4, balance=True, window=L) == cp.ring_block_pairs(L, 4, balance=True)
    full = cp.ring_block_pairs(L, 4, balance=False, causal=False, window=5).pairs
    assert full == (2, 3, 3, 2), full        # both sides: the neighbours' blocks only


# ----------------------------------------------------------------------------- balance


@need_devices(4)
@pytest.mark.parametrize("balance,window,traced", [(True, None, False), (False, None, False), (True, 3, False),
                                                   (False, 3, True), (True, 6, True)])
def test_ring_computes_the_block_pairs_it_counts(balance, window, traced):
    """The ring's own tally of the block pairs it runs (not skipped), per device, is what
    ``ring_block_pairs`` says, also with a static or a traced sliding window."""
    mesh = jaxpar.make_mesh({"context": 4}, devices=jax.devices()[:4])
    spec = RingSpec("context", 4, True, D ** -0.5, balance, window=None if traced else window)
    q, k, v, _, _ = inputs(2, False)
    tally = jax.shard_map(lambda q, k, v, *win: ring_forward(spec, q, k, v, window=win[0] if win else None)[2][None],
                          mesh=mesh, in_specs=(P(None, "context"),) * 3 + ((P(),) if traced else ()),
                          out_specs=P("context"))
    counted = jax.jit(tally)(q, k, v, *([np.int32(window)] if traced else []))
    assert tuple(int(n) for n in counted) == cp.ring_block_pairs(L, 4, balance=balance, window=window).pairs


@pytest.mark.parametrize("size", [2, 4, 8])
def test_balanced_ring_work_is_even_and_natural_is_not(size):
    """Causal ring work per device, in block pairs and in scores (pairs x block^2).

    Balanced: 2C+1 half-size pairs on every device. Natural: device i computes i+1 pairs, so the
    first and last devices differ C-fold (2x at C = 2), and the busiest device (which sets the step
    time) does 4C/(2C+1), about 2x, the work of a balanced one.
    """
    bal, nat = (cp.ring_block_pairs(L, size, balance=b) for b in (True, False))
    assert bal == cp.RingWork((2 * size + 1,) * size, L // (2 * size))
    assert nat == cp.RingWork(tuple(range(1, size + 1)), L // size)
    scores = lambda w: [p * w.block ** 2 for p in w.pairs]  # noqa: E731
    assert max(scores(nat)) * (2 * size + 1) == max(scores(bal)) * 4 * size
    assert cp.ring_block_pairs(L, size, balance=True, causal=False).pairs == (4 * size,) * size


def test_balanced_layout_round_trips():
    np.testing.assert_array_equal(cp.balanced_order(16, 4), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    for y in (x, jnp.asarray(x)):
        np.testing.assert_array_equal(cp.from_balanced(cp.to_balanced(y, 1, 4), 1, 4), x)
    np.testing.assert_array_equal(cp.to_balanced(x, 1, 4)[:, 2], x[:, 14])
    assert type(cp.to_balanced(x, 1, 4)) is np.ndarray


def test_the_setting_is_scoped():
    assert cp.current_context_parallel() == ContextParallel("ring", False)
    with cp.use_context_parallel("ulysses", balance=True):
        with cp.use_context_parallel("all_gather"):
            assert cp.current_context_parallel() == ContextParallel("all_gather", False)
        assert cp.current_context_parallel() == ContextParallel("ulysses", True)
    assert cp.current_context_parallel().method == "ring"


# ----------------------------------------------------------------------------- bad input


def trace(mesh_sizes, method, balance, q, k, v, seg=None, rules=RULES):
    mesh = jaxpar.make_mesh(mesh_sizes, devices=jax.devices()[:int(np.prod(list(mesh_sizes.values())))])
    with use_rules(mesh, rules), cp.use_context_parallel(method, balance=balance):
        return jax.eval_shape(lambda q, k, v: attention(q, k, v, segment_ids=seg), q, k, v)


def shapes(length=L, heads=H, kv_heads=2):
    return (jax.ShapeDtypeStruct((B, length, heads, D), jnp.float32),
            *[jax.ShapeDtypeStruct((B, length, kv_heads, D), jnp.float32)] * 2)


@need_devices(8)
@pytest.mark.parametrize("length,balance,match", [
    (36, False, r"sequence length 36 is not divisible by 8 \(C = 8 shards.*e\.g\. 40"),
    (40, True, r"sequence length 40 is not divisible by 16 \(balanced layout, 2\*C = 16 chunks.*turn balance off"),
])
def test_a_sequence_the_context_axis_cannot_split_is_refused(length, balance, match):
    with pytest.raises(cp.ContextParallelError, match=match):
        trace({"context": 8}, "ring", balance, *shapes(length))


@need_devices(8)
def test_ulysses_refuses_heads_not_divisible_by_the_context_size():
    with pytest.raises(cp.ContextParallelError, match=r"ulysses.*6 query heads on each device are not divisible "
                                                      r"by the context axis size 4.*'ring' or 'all_gather'"):
        trace({"context": 4}, "ulysses", False, *shapes(heads=6, kv_heads=2))
    with pytest.raises(cp.ContextParallelError, match=r"4 query heads on each device .* size 8"):
        trace({"context": 8, "tensor": 1}, "ulysses", False, *shapes(heads=4, kv_heads=4))


def test_an_unknown_method_is_refused():
    with pytest.raises(cp.ContextParallelError, match=r"method='ringg' is not a context-parallel method; "
                                                      r"choose one of \('ring', 'all_gather', 'ulysses'\)"):
        with cp.use_context_parallel("ringg"):
            pass


@need_devices(8)
def test_rules_that_do_not_split_the_length_over_context_are_refused():
    rules = (("batch", "data"), ("length", None), ("heads", "tensor"))
    with pytest.raises(cp.ContextParallelError, match=r"rules map the logical name 'length' to None.*\('length', "
                                                      r"'context'\)"):
        trace({"context": 4}, "ring", False, *shapes(), rules=rules)
    with pytest.raises(cp.ContextParallelError, match=r"8 query heads over \('tensor',\) \(size 2\), which does "
                                                      r"not divide the 1 K/V heads"):
        trace({"context": 4, "tensor": 2}, "ring", False, *shapes(kv_heads=1))


def test_inputs_that_do_not_fit_are_refused():
    q, k, v = shapes()
    with pytest.raises(AttentionError, match=r"k and v alike"):
        attention(q, k, jax.ShapeDtypeStruct((B, L, 4, D), jnp.float32))
    with pytest.raises(AttentionError, match=r"the 3 K/V heads must divide the 8 query heads"):
        attention(q, *shapes(kv_heads=3)[1:])
    with pytest.raises(AttentionError, match=r"segment_ids must be integers of shape \[batch, length\] = "
                                                r"\(2, 32\); got float32\[2, 32\]"):
        attention(q, k, v, segment_ids=jnp.zeros((B, L)))


@pytest.mark.parametrize("options,match", [      # options: built in the test (no jax array at collection)
    (lambda: dict(window=0), r"window=0 is not a positive int.*Fix: window >= 1"),
    (lambda: dict(window=2.5), r"window must be a positive int or an int scalar array.*got float 2\.5"),
    (lambda: dict(window=True), r"window must be a positive int.*got bool True"),
    (lambda: dict(window=jnp.asarray([3, 4])), r"window must be .*got int32\[2\] array"),
    (lambda: dict(window=jnp.float32(3)), r"window must be .*got float32\[\] array"),
    (lambda: dict(window=jnp.int32(-2)), r"window=-2 is not positive"),
    (lambda: dict(softcap=0.0), r"softcap=0\.0 \(float\); the logit soft-cap must be a finite Python number > 0"),
    (lambda: dict(softcap=float("nan")), r"softcap=nan"),
    (lambda: dict(softcap=jnp.float32(30.0)), r"softcap=.* \(ArrayImpl\).*Fix: a positive float"),
])
def test_a_bad_window_or_softcap_is_refused(options, match):
    with pytest.raises(AttentionError, match=match):
        attention(*shapes(), **options())
    with pytest.raises(cp.ContextParallelError, match="ring_attention: " + match):
        cp.ring_attention(*shapes(), **options())


def test_ring_block_pairs_refuses_a_window_that_is_not_a_positive_int():
    with pytest.raises(cp.ContextParallelError, match=r"ring_block_pairs: window=0 must be a positive int"):
        cp.ring_block_pairs(L, 4, balance=True, window=0)
