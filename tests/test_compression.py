"""Codecs and the compressed exchange on their own: packing, statistics (unbiasedness,
QSGD's variance bound), error feedback's conservation law through the real multi-replica
exchange, and bad input."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.parallel.compression import (CompressionError, cast, exchange_plan, make_codec, onebit, powersgd, qsgd,
                                randomk, sign, terngrad, topk)
from jaxpar.parallel.compression._bits import from_bytes, pack_bits, to_bytes, unpack_bits

DRAWS = 2000


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_bits_roundtrip(bits):
    codes = jax.random.randint(jax.random.key(bits), (3, 64), 0, 2 ** bits).astype(jnp.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 64 * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_bits(packed, bits, 64), codes)


def test_bytes_roundtrip_mixed_dtypes():
    payload = {"a": jnp.arange(6, dtype=jnp.int8).reshape(2, 3), "b": jnp.array([[1.5], [-2.0]]),
               "c": jnp.array([[7, 9], [11, 13]], jnp.int32), "d": jnp.ones((2, 4), jnp.bfloat16)}
    wire = to_bytes(payload)
    assert wire.dtype == jnp.uint8 and wire.shape == (2, 3 + 4 + 8 + 8)
    back = from_bytes(wire, payload)
    for k in payload:
        assert back[k].dtype == payload[k].dtype
        np.testing.assert_array_equal(back[k], payload[k])


def _draws(codec, x, n=DRAWS):
    keys = jax.random.split(jax.random.key(42), n)
    return jax.jit(jax.vmap(lambda k: codec.decode(codec.encode(x, k))))(keys)     # [n, 1, d]


@pytest.mark.parametrize("codec", [qsgd(levels=4, bucket=64), qsgd(levels=127, bucket=64),
                                   terngrad(bucket=64, clip=None)], ids=["qsgd4", "qsgd127", "terngrad"])
def test_stochastic_codecs_are_unbiased(codec):
    x = jax.random.normal(jax.random.key(0), (1, 128)) * jnp.linspace(0.1, 3.0, 128)
    d = np.asarray(_draws(codec, x), np.float64)[:, 0]
    mean, se = d.mean(0), d.std(0, ddof=1) / math.sqrt(d.shape[0])
    x = np.asarray(x[0])
    assert np.all(np.abs(mean - x) <= 4 * se + 1e-6 * np.abs(x)), np.max(np.abs(mean - x) / (se + 1e-12))
    assert np.any(se > 0)      # really random


def test_terngrad_clips_then_is_unbiased_for_the_clipped_value():
    x = jnp.concatenate([jnp.full((1, 63), 0.1), jnp.array([[100.0]])], axis=1)    # one outlier
    d = np.asarray(_draws(terngrad(bucket=64, clip=2.5), x), np.float64)[:, 0]
    v = np.asarray(x[0])
    c = 2.5 * v.std()
    clipped = np.clip(v, -c, c)
    se = d.std(0, ddof=1) / math.sqrt(d.shape[0])
    assert np.all(np.abs(d.mean(0) - clipped) <= 4 * se + 1e-6)
    assert d.max() <= c * (1 + 1e-6)     # the outlier is sent as the clip value, never more


@pytest.mark.parametrize("levels", [2, 8, 127])
def test_qsgd_variance_within_bound(levels):
    b = 64
    x = jax.random.normal(jax.random.key(1), (1, 4 * b))
    d = np.asarray(_draws(qsgd(levels=levels, bucket=b), x), np.float64)[:, 0]
    v = np.asarray(x[0]).reshape(4, b)
    var = ((d.reshape(-1, 4, b) - v) ** 2).sum(-1).mean(0)            # E||Q(v) - v||^2 per bucket
    bound = min(b / levels ** 2, math.sqrt(b) / levels) * (v ** 2).sum(-1)
    assert np.all(var <= bound), (var, bound)


@pytest.mark.parametrize("codec", [sign(bucket=64), onebit(bucket=64), cast("bfloat16", bucket=64),
                                   cast("float8_e4m3fn", bucket=64), cast("float8_e5m2", bucket=64)],
                         ids=lambda c: c.name)
def test_deterministic_codecs_error(codec):
    x = jax.random.normal(jax.random.key(2), (2, 256))
    y = codec.decode(codec.encode(x, jax.random.key(0)))
    rel = float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    limit = {"sign": 0.8, "onebit": 0.7, "cast-bfloat16": 0.005, "cast-float8_e4m3fn": 0.05,
             "cast-float8_e5m2": 0.1}[codec.name]
    assert rel < limit
    if codec.name in ("sign", "onebit"):          # signs are kept exactly
        assert bool(jnp.all(jnp.sign(y) == jnp.where(x >= 0, 1.0, -1.0)))


@pytest.mark.parametrize("codec", [sign(bucket=64), onebit(bucket=64)], ids=lambda c: c.name)
def test_sign_codecs_decode_to_their_bucket_scales(codec):
    """Scaled sign: ``|y|`` is the bucket's mean ``|x|``; 1-bit SGD: the mean of the bucket's
    non-negative values where ``x >= 0``, of its negative ones elsewhere (fp32 round-off)."""
    x = jax.random.normal(jax.random.key(2), (2, 256))
    y = np.asarray(codec.decode(codec.encode(x, jax.random.key(0)))).reshape(-1, 64)
    v = np.asarray(x, np.float64).reshape(-1, 64)
    if codec.name == "sign":
        want = np.sign(v + (v == 0)) * np.mean(np.abs(v), axis=1, keepdims=True)
    else:
        pos = v >= 0
        hi = (v * pos).sum(1, keepdims=True) / pos.sum(1, keepdims=True)
        lo = (v * ~pos).sum(1, keepdims=True) / (~pos).sum(1, keepdims=True)
        want = np.where(pos, hi, lo)
    np.testing.assert_allclose(y, want, rtol=1e-5)


def test_payloads_are_packed():
    k = 4096
    assert qsgd(bucket=512).row_bytes(k) == k + 4 * 8                 # int8 codes + fp32 norms
    assert terngrad(bucket=512).row_bytes(k) == k // 4 + 4 * 8        # 4 codes per byte
    assert sign(bucket=512).row_bytes(k) == k // 8 + 4 * 8            # 8 signs per byte
    assert onebit(bucket=512).row_bytes(k) == k // 8 + 8 * 8
    assert cast("bfloat16").row_bytes(k) == 2 * k
    assert cast("float8_e4m3fn", bucket=512).row_bytes(k) == k + 4 * 8


# ----------------------------------------------------------------------------- the exchange, 4 replicas

REPLICAS = 4
SHAPES = [(64, 48), (48,), (3, 32, 16), (40, 24)]     # a matrix, a vector, 3 stacked layers, a sharded one
DIMS = [None, None, None, 0]
STACKED = [False, False, True, False]


def _plan(codec, zero_sharded=True):
    grad_axes = [(), (), (), ("data",) if zero_sharded else ()]
    return exchange_plan(codec, SHAPES, dims=DIMS, grad_axes=grad_axes, stacked=STACKED,
                         mesh_sizes={"data": REPLICAS})


def _run_exchange(plan, steps):
    """``steps`` exchanges of seeded per-replica gradients; returns (sum of the true mean
    gradients, sum of what the exchange delivered (gathered to whole leaves), final states)."""
    mesh = jaxpar.make_mesh({"data": REPLICAS}, devices=jax.devices()[:REPLICAS])
    sharded = [sc for sc in plan.scattered]

    def one(gs, state, step):
        gs = [g[0] for g in gs]
        state = jax.tree.map(lambda a: a[0], state)
        out, state, _ = plan.exchange(gs, state, step)
        out = [jax.lax.all_gather(o, "data", axis=DIMS[i], tiled=True) if sharded[i] else o
               for i, o in enumerate(out)]
        return [o[None] for o in out], jax.tree.map(lambda a: a[None], state)

    state0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (REPLICAS, *a.shape)), plan.init())
    spec = jax.tree.map(lambda _: P("data"), state0)
    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=([P("data")] * len(SHAPES), spec, P()),
                              out_specs=([P("data")] * len(SHAPES), spec), check_vma=False))
    true = [np.zeros(s) for s in SHAPES]
    got = [np.zeros(s) for s in SHAPES]
    state = state0
    for t in range(steps):
        keys = jax.random.split(jax.random.key(100 + t), len(SHAPES))
        gs = [jax.random.normal(k, (REPLICAS, *s)) for k, s in zip(keys, SHAPES)]
        out, state = f(gs, state, jnp.int32(t))
        for i in range(len(SHAPES)):
            true[i] += np.asarray(gs[i], np.float64).mean(0)
            got[i] += np.asarray(out[i][0], np.float64)
            np.testing.assert_array_equal(out[i][0], out[i][-1])     # every replica got the same
    return true, got, state


def _leaves_from_flat(plan, flat):
    """Split a flat ``[N * (Ks + Kr)]`` buffer (the exchange's layout) back into leaves."""
    n, (ks, kr, lr) = plan.replicas, plan.widths
    rows = flat.reshape(n, ks + kr)
    left, right = rows[:, :ks], rows[:, ks:].reshape(-1)[:lr]
    out, a, b = [], 0, 0
    for s, d, sc in zip(plan.shapes, plan.dims, plan.scattered):
        size = math.prod(s)
        if sc:
            k = size // n
            moved = (s[d],) + tuple(x for j, x in enumerate(s) if j != d)
            block = left[:, a:a + k].reshape(n, s[d] // n, *moved[1:]).reshape(moved)
            out.append(np.moveaxis(block, 0, d))
            a += k
        else:
            out.append(right[b:b + size].reshape(s))
            b += size
    return out


@pytest.mark.parametrize("codec", [sign(bucket=64), onebit(bucket=64), topk(0.05), randomk(0.05),
                                   topk(0.05, momentum=0.0, warmup=(0.5, 0.2), warmup_steps=5),
                                   topk(0.05, partitioned=True),
                                   topk(0.05, warmup=(0.5, 0.2), warmup_steps=5, partitioned=True),
                                   powersgd(rank=2, min_compression_rate=1)], ids=lambda c: c.name)
def test_error_feedback_conserves_the_gradient(codec):
    """Sum over 50 steps of what was delivered + the residuals left = sum of the true mean
    gradients (error feedback loses nothing), through the 4-replica exchange."""
    plan = _plan(codec)
    true, got, state = _run_exchange(plan, steps=50)
    state = jax.tree.map(np.asarray, state)
    if codec.name == "powersgd":
        left = [r.astype(np.float64).mean(0) for r in state["residual"]]
    else:
        left = _leaves_from_flat(plan, state["residual"].astype(np.float64).mean(0))
        if "server" in state:        # the all-gather's error, kept by each row's owner
            ks, kr, lr = plan.widths
            server = np.zeros((REPLICAS, ks + kr))
            server[:, ks:] = state["server"]
            left = [a + b for a, b in zip(left, _leaves_from_flat(plan, server.reshape(-1)))]
    for t, g, r in zip(true, got, left):
        scale = np.abs(t).max()
        np.testing.assert_allclose(g + r, t, atol=2e-5 * scale * 50 ** 0.5, rtol=0)
        assert np.abs(r).max() > 1e-3 * scale or codec.name == "powersgd"    # something really was held back


def test_codec_momentum_is_compressed_in_place_of_the_gradient():
    """dist-EF-SGDM: with ``momentum=m`` the replica's velocity u = m u + g goes through the codec;
    with m = 0 the exchange is the plain one (same deliveries)."""
    _, plain, _ = _run_exchange(_plan(sign(bucket=64)), steps=3)
    _, zero, st0 = _run_exchange(_plan(sign(bucket=64, momentum=0.0)), steps=3)
    for a, b in zip(plain, zero):
        np.testing.assert_array_equal(a, b)
    assert "velocity" not in st0
    _, got, st = _run_exchange(_plan(sign(bucket=64, momentum=0.9)), steps=3)
    assert st["velocity"].shape == st["residual"].shape and float(np.abs(st["velocity"]).max()) > 0
    assert any(not np.allclose(a, b) for a, b in zip(got, plain))


def test_unbiased_exchange_without_feedback_keeps_no_state():
    assert _plan(qsgd()).init() == {} and _plan(terngrad()).init() == {}


def test_full_rank_powersgd_and_dense_topk_are_exact_in_the_exchange():
    for codec in (powersgd(rank=64, min_compression_rate=0), topk(1.0), randomk(1.0), topk(1.0, partitioned=True)):
        true, got, _ = _run_exchange(_plan(codec), steps=2)
        for t, g in zip(true, got):
            np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-5)


def test_partitioned_topk_averages_every_replica_at_the_picked_entries():
    """One step: the replicas pick ``N k`` distinct entries (replica ``i`` among those ``= i mod N``);
    there the delivered value is the exact mean over all replicas, elsewhere nothing is delivered,
    and every replica's residual is cleared exactly at the picked entries."""
    plan = _plan(topk(0.05, partitioned=True))
    true, got, state = _run_exchange(plan, steps=1)
    n, (ks, kr, _) = plan.replicas, plan.widths
    k = plan.codec.k(plan.flat_size, replicas=n)
    picked = np.concatenate([g.reshape(-1) != 0 for g in got])
    assert picked.sum() == n * k                            # distinct entries (none is exactly 0 here)
    for t, g in zip(true, got):
        on = g != 0
        np.testing.assert_allclose(g[on], t[on], rtol=1e-5, atol=1e-6)
    res = np.asarray(state["residual"])                     # [replicas, N * (Ks + Kr)]; SHAPES need no padding,
    cleared = res == 0                                      # so an exact 0 is a picked entry
    np.testing.assert_array_equal(cleared, np.broadcast_to(cleared[0], cleared.shape))
    assert cleared[0].sum() == n * k
    owners = np.flatnonzero(cleared[0]) % n                 # each replica picked k among its own entries
    np.testing.assert_array_equal(np.bincount(owners, minlength=n), [k] * n)


def test_preconditioned_topk_ranks_by_adams_step_size():
    """``precondition``: after the exact steps, entries are ranked by ``|v| / sqrt(s)``, ``s`` the second
    moment of the exact steps' mean gradients: a small entry with a tiny ``s`` beats a large one."""
    n, d = REPLICAS, 64
    codec = topk(1 / d, optimizer_momentum=0.5, start_step=1, precondition=0.9)
    plan = exchange_plan(codec, [(d,)], dims=[None], grad_axes=[()], stacked=[False], mesh_sizes={"data": n})
    mesh = jaxpar.make_mesh({"data": n}, devices=jax.devices()[:n])

    def one(g, state, step):
        out, state, _ = plan.exchange([g[0]], jax.tree.map(lambda a: a[0], state), step)
        return out[0][None], jax.tree.map(lambda a: a[None], state)

    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), plan.init())
    spec = jax.tree.map(lambda _: P("data"), state)
    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("data"), spec, P()), out_specs=(P("data"), spec),
                              check_vma=False))
    scale = jnp.where(jnp.arange(d) == 7, 1e-3, 1.0)        # entry 7's exact-step gradients are tiny
    g0 = jnp.broadcast_to(scale, (n, d))
    _, state = f(g0, state, jnp.int32(0))                   # the exact step
    s = np.asarray(state["second_moment"])[0][:d]
    np.testing.assert_allclose(s, 0.1 * np.asarray(scale) ** 2, rtol=1e-5)
    g1 = jnp.broadcast_to(jnp.where(jnp.arange(d) == 7, 0.05, 1.0), (n, d))   # 7 is now the smallest ...
    _, state = f(g1, state, jnp.int32(1))
    sent = np.flatnonzero(np.asarray(state["velocity"])[0][:d])          # the exchanged moment's entries
    assert list(sent) == [7]                                # ... but its step |m| / sqrt(s) is the largest
    np.testing.assert_array_equal(np.asarray(state["second_moment"])[0][:d], s)   # frozen after the start


def test_wire_bytes_formulas():
    n, k = 8, 1 << 16
    fp32 = 2 * (n - 1) / n * 4 * k
    plan = lambda c: exchange_plan(c, [(k,)], dims=[None], grad_axes=[()], stacked=[False],   # noqa: E731
                                   mesh_sizes={"data": n})
    assert plan(qsgd()).wire_bytes() / fp32 <= 0.27
    assert plan(terngrad()).wire_bytes() / fp32 <= 0.07
    assert plan(sign()).wire_bytes() / fp32 <= 0.04
    assert plan(topk(0.01)).wire_bytes() == (n - 1) * 8 * math.ceil(0.01 * k)
    assert plan(topk(0.01, partitioned=True)).wire_bytes() == (n - 1) * 12 * math.ceil(0.01 * k)   # 1.5x
    warm = plan(topk(0.01, warmup=(0.1,), warmup_steps=5, partitioned=True))
    assert [warm.wire_bytes(s) for s in (4, 5)] == [(n - 1) * 12 * math.ceil(d * k) for d in (0.1, 0.01)]
    p = exchange_plan(powersgd(rank=4), [(256, 128)], dims=[None], grad_axes=[()], stacked=[False],
                      mesh_sizes={"data": n})
    assert p.wire_bytes() / p.uncompressed_bytes() == pytest.approx((256 + 128) * 4 / (256 * 128), rel=1e-3)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("make, words", [
    (lambda: topk(0.0), ["topk(ratio=0.0)", "(0, 1]"]),
    (lambda: randomk(1.5), ["randomk(ratio=1.5)", "(0, 1]"]),
    (lambda: powersgd(rank=0), ["powersgd(rank=0)", ">= 1"]),
    (lambda: qsgd(levels=128), ["qsgd(levels=128)", "1 ... 127"]),
    (lambda: qsgd(levels=0), ["qsgd(levels=0)"]),
    (lambda: sign(bucket=12), ["sign(bucket=12)", "multiple of 8"]),
    (lambda: sign(momentum=1.0), ["sign(momentum=1.0)", "[0, 1)"]),
    (lambda: onebit(momentum=-0.5), ["onebit(momentum=-0.5)", "[0, 1)"]),
    (lambda: cast("int4"), ["cast(dtype='int4')", "bfloat16"]),
    (lambda: topk(0.1, warmup=(0.5,)), ["warmup_steps", ">= 1"]),
    (lambda: topk(0.1, precondition=0.95), ["topk(precondition=0.95)", "optimizer_momentum=0.9, start_step=60"]),
    (lambda: topk(0.1, optimizer_momentum=0.9, start_step=5, precondition=1.0), ["precondition=1.0", "(0, 1)"]),
    (lambda: topk(0.1, partitioned="yes"), ["topk(partitioned='yes')", "True or False"]),
    (lambda: make_codec("zip"), ["kind='zip'", "powersgd"]),
    (lambda: make_codec("topk", ratio=0.1, rank=3), ["kind='topk'", "rank"]),
    (lambda: jaxpar.Strategy(compression="qsgd"), ["compression='qsgd'", "jaxpar.parallel.compression"]),
    (lambda: exchange_plan(qsgd(), [(4,)], dims=[None], grad_axes=[()], stacked=[False],
                           mesh_sizes={"data": 1, "tensor": 8}), ["no data axis", "Remove Strategy.compression"]),
])
def test_bad_input_names_option_and_fix(make, words):
    with pytest.raises(CompressionError) as e:
        make()
    for w in words:
        assert w in str(e.value)
