"""Context parallelism's fused blocks (jaxpar.parallel.context._flash): exact against XLA's blocks on the CPU.

The flash block kernel runs in Pallas's interpreter here (slow, so the shapes are tiny: blocks of 16
tokens, head_dim 16). Every fused run is compared with the same call on today's XLA path (einsums and
the online softmax), values and the gradients w.r.t. q, k and v at fp32 1e-5. The compiled H100
programs (deviceless) are read for score-shaped arrays with
:func:`jaxpar.analysis._fused_attention.score_arrays`.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import need_devices
import jaxpar
from jaxpar.analysis._fused_attention import flash_blocks, score_arrays
from jaxpar.attention import AttentionError, attention, count_attention_kernels, use_attention_kernel
from jaxpar.errors import ContextParallelError
from jaxpar.parallel import context as cp
from jaxpar.parallel.context._flash import flash_attention, flash_forward, merge_blocks
from jaxpar.parallel.context._softmax import MASK_VALUE, allowed
from jaxpar.rules import use_rules

B, H, D = 2, 4, 16
RULES = (("batch", None), ("length", "context"), ("heads", None))


def inputs(length, kv_heads, segments, seed=0):
    """q, k, v, the output cotangent w and packed segment ids (about 3 documents a row)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    seg = np.cumsum(rng.random((B, length)) < 3 / length, axis=1).astype(np.int32)
    return (normal(B, length, H, D), normal(B, length, kv_heads, D), normal(B, length, kv_heads, D),
            normal(B, length, H, D), jnp.asarray(seg) if segments else None)


def assert_close(got, want):
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=name)


def window_args(window):
    """A window as a static int (``window``), traced (``"traced5"``: an int32 argument of the jitted
    function) or ``None``: ``(static window, traced arguments)``."""
    if isinstance(window, str):
        return None, (np.int32(window.removeprefix("traced")),)
    return window, ()


@functools.lru_cache(maxsize=None)
def ring_run(size, balance, causal, segments, kv_heads, kernel, window=None, softcap=None):
    """The ring's output and gradients on a ``context`` mesh of ``size`` (shards of 16 tokens a block), with a
    window (see :func:`window_args`) and a soft-cap."""
    length = 16 * size * (2 if balance else 1)
    q, k, v, w, seg = inputs(length, kv_heads, segments)
    mesh = jaxpar.make_mesh({"context": size}, devices=jax.devices()[:size])
    seq = P(None, "context")
    static, traced = window_args(window)
    ring = functools.partial(cp.ring_attention, axis_name="context", causal=causal, balance=balance, kernel=kernel,
                             softcap=softcap)
    call = jax.shard_map(lambda q, k, v, s, *win: ring(q, k, v, s, s, window=win[0] if win else static), mesh=mesh,
                         in_specs=(seq, seq, seq, seq) + (P(),) * len(traced), out_specs=seq,
                         check_vma=False)   # Pallas's interpreter refuses check_vma (JAX 0.10)
    seg = jnp.zeros((B, length), jnp.int32) if seg is None else seg

    def run(q, k, v, *win):
        out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, seg, *win), q, k, v)
        return (out, *vjp(w))
    kernels = str(jax.make_jaxpr(run)(q, k, v, *traced)).count("pallas_call")
    return jax.jit(run)(q, k, v, *traced), kernels


@need_devices(4)
@pytest.mark.parametrize("size,balance,causal,segments,kv_heads", [
    pytest.param(2, True, True, True, 2, marks=pytest.mark.slow),            # balanced, causal, packed, GQA
    (2, False, True, False, 4),                   # natural, causal, MHA
    pytest.param(4, True, True, True, 2, marks=pytest.mark.exhaustive),
    pytest.param(4, False, False, True, 1, marks=pytest.mark.exhaustive),    # full mask, packed, MQA
    pytest.param(2, True, False, False, 2, marks=pytest.mark.exhaustive),
    pytest.param(4, False, True, True, 2, marks=pytest.mark.exhaustive),
])
def test_the_fused_ring_equals_xlas_ring(size, balance, causal, segments, kv_heads):
    (fused, kernels), (want, none) = (ring_run(size, balance, causal, segments, kv_heads, kernel)
                                      for kernel in ("pallas", "xla"))
    assert kernels >= 3 and none == 0                 # forward, dQ and dK/dV kernels; XLA's path has none
    assert_close(fused, want)


@need_devices(4)
@pytest.mark.parametrize("size,balance,causal,segments,kv_heads,window,softcap", [
    (2, False, True, True, 2, 5, None),                                   # static window, packed, GQA
    (2, False, True, False, 4, "traced20", 2.0),                          # traced window and soft-cap
    pytest.param(2, True, True, True, 2, "traced20", 2.0, marks=pytest.mark.slow),           # balanced
    pytest.param(2, True, True, False, 2, None, 2.0, marks=pytest.mark.exhaustive),          # soft-cap only
    pytest.param(2, False, False, True, 1, "traced9", None, marks=pytest.mark.exhaustive),   # both sides, MQA
    pytest.param(4, True, True, True, 2, 7, 2.0, marks=pytest.mark.exhaustive),
    pytest.param(2, True, False, False, 2, 20, 2.0, marks=pytest.mark.exhaustive),
])
def test_the_fused_ring_with_a_window_or_softcap_equals_xlas_ring(size, balance, causal, segments, kv_heads, window,
                                                                  softcap):
    (fused, kernels), (want, none) = (ring_run(size, balance, causal, segments, kv_heads, kernel, window, softcap)
                                      for kernel in ("pallas", "xla"))
    assert kernels >= 3 and none == 0
    assert_close(fused, want)


def block_reference(q, k, v, q_seg, k_seg, causal, offset, scale, window=None, softcap=None):
    """A block's softmax attention and log-sum-exp by jnp (K/V heads repeated for GQA), with a window and a
    soft-cap as XLA's path applies them."""
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s if softcap is None else softcap * jnp.tanh(s / softcap)
    mask = allowed(offset + np.arange(q.shape[1]), np.arange(k.shape[1]), q_seg, k_seg, causal=causal, window=window)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), jax.nn.logsumexp(s, axis=-1)


def test_a_block_at_an_offset_with_other_keys_segments_is_softmax_attention():
    q, _, _, _, _ = inputs(32, 2, False, seed=1)
    _, k, v, _, seg = inputs(64, 2, True, seed=2)
    q_seg = seg[:, 32:]                               # the queries' ids differ from the keys'
    out, lse = flash_forward(q, k, v, q_seg, seg, causal=True, scale=0.3, offset=jnp.int32(32), interpret=True)
    want, want_lse = block_reference(q, k, v, q_seg, seg, True, 32, 0.3)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)   # natural log, not log2


@pytest.mark.parametrize("causal,offset,window", [
    (True, 96, 40),            # 2 x 4 tiles of 64: each query tile skips a key tile on either side
    pytest.param(False, -32, 20, marks=pytest.mark.exhaustive),   # keys after the queries; some rows see none
])
def test_a_windowed_capped_block_skips_the_tiles_it_masks_and_is_softmax_attention(causal, offset, window):
    """Blocks of several tiles, a traced window and a soft-cap: the output and lse, and (rows that see a key)
    the gradients of :func:`flash_attention`; a row that sees no key has output 0 and lse MASK_VALUE."""
    q, _, _, _, _ = inputs(128, 2, False, seed=5)
    _, k, v, _, _ = inputs(256, 2, False, seed=6)
    scale, softcap, at = 0.3, 2.0, jnp.int32(offset)
    out, lse = flash_forward(q, k, v, causal=causal, scale=scale, offset=at, window=jnp.int32(window),
                             softcap=softcap, interpret=True)
    want, want_lse = block_reference(q, k, v, None, None, causal, offset, scale, window, softcap)
    seen = np.isfinite(want_lse)                        # [b, heads, rows]
    np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, want_lse, 0), rtol=1e-5, atol=1e-5)
    assert (seen.all() if causal else 0 < seen.sum() < seen.size) and np.all(lse[~seen] == MASK_VALUE)
    rows = seen.transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, want, 0), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[np.broadcast_to(~rows, out.shape)] == 0)
    if causal:
        fused = lambda q, k, v: flash_attention(q, k, v, None, None, at, jnp.int32(window), causal, scale,  # noqa: E731
                                                softcap, True)
        plain = lambda q, k, v: block_reference(q, k, v, None, None, causal, offset, scale, window,  # noqa: E731
                                                softcap)[0]
        w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)
        grads = [jax.vjp(f, q, k, v)[1](w) for f in (fused, plain)]
        for name, got, expect in zip(("dq", "dk", "dv"), *grads):
            np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5, err_msg=name)


def test_blocks_merged_by_their_lse_are_the_attention_over_both():
    q, k, v, _, _ = inputs(32, 2, False, seed=3)
    halves = [flash_forward(q, k[:, s], v[:, s], causal=False, scale=0.25, interpret=True)
              for s in (slice(0, 16), slice(16, 32))]
    out, lse = merge_blocks(*halves)
    want, want_lse = block_reference(q, k, v, None, None, False, 0, 0.25)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def attention_run(method, balance, segments, kernel, window=None, softcap=None, causal=True):
    """``attention`` under a ``context`` mesh of 4, inputs in the layout's order, with kernel counts; a window
    as for :func:`window_args`."""
    size, length = 4, 128
    q, k, v, w, seg = inputs(length, 2, segments, seed=4)
    mesh = jaxpar.make_mesh({"context": size}, devices=jax.devices()[:size])
    place = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "context")))   # noqa: E731
    q, k, v, w = (place(cp.to_balanced(x, 1, size) if balance else x) for x in (q, k, v, w))
    seg = None if seg is None else place(cp.to_balanced(seg, 1, size) if balance else seg)
    static, traced = window_args(window)

    def run(q, k, v, *win):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg,
                                                     window=win[0] if win else static, softcap=softcap), q, k, v)
        return (out, *vjp(w))
    with use_attention_kernel(kernel), use_rules(mesh, RULES), cp.use_context_parallel(method, balance=balance), \
            count_attention_kernels() as counts:
        got = jax.jit(run)(q, k, v, *traced)
    return got, dict(counts)


@need_devices(4)
@pytest.mark.parametrize("method,balance,segments", [
    ("all_gather", True, True),
    pytest.param("ring", False, True, marks=pytest.mark.slow),
    pytest.param("all_gather", False, False, marks=pytest.mark.exhaustive),
])
def test_attention_runs_the_fused_blocks_when_asked_and_equals_xla(method, balance, segments):
    fused, counts = attention_run(method, balance, segments, "pallas")
    assert counts == {"pallas": 1}
    want, xla_counts = attention_run(method, balance, segments, "xla")
    assert xla_counts == {"xla": 1}
    assert_close(fused, want)


@need_devices(4)
@pytest.mark.parametrize("method,balance,segments,window,softcap,causal", [
    ("all_gather", True, True, 24, None, True),                 # static window, balanced, packed
    ("all_gather", False, True, "traced40", 2.0, True),         # traced window and soft-cap
    pytest.param("ring", True, True, "traced24", 2.0, True, marks=pytest.mark.slow),
    pytest.param("all_gather", True, False, 20, 2.0, False, marks=pytest.mark.exhaustive),   # both sides
    pytest.param("ring", False, False, 24, None, True, marks=pytest.mark.exhaustive),
])
def test_attention_with_a_window_or_softcap_runs_the_fused_blocks_and_equals_xla(method, balance, segments, window,
                                                                                 softcap, causal):
    fused, counts = attention_run(method, balance, segments, "pallas", window, softcap, causal)
    assert counts == {"pallas": 1}
    want, xla_counts = attention_run(method, balance, segments, "xla", window, softcap, causal)
    assert xla_counts == {"xla": 1}
    assert_close(fused, want)


@need_devices(2)
def test_the_fused_ring_refuses_a_block_it_cannot_tile_and_cudnn_refuses_the_ring():
    mesh = jaxpar.make_mesh({"context": 2}, devices=jax.devices()[:2])
    q = jnp.ones((1, 64, 2, 16))
    ring = jax.shard_map(lambda q: cp.ring_attention(q, q, q, window=8, softcap=2.0, kernel="pallas"), mesh=mesh,
                         in_specs=P(None, "context"), out_specs=P(None, "context"), check_vma=False)
    jax.eval_shape(ring, q)                          # a window and a soft-cap run fused
    odd = jnp.ones((1, 48, 2, 16))                   # blocks of 24 tokens
    with pytest.raises(ContextParallelError, match="kernel='pallas'.*block length 24.*Fix: kernel='xla'"):
        jax.eval_shape(ring, odd)
    with use_attention_kernel("cudnn"), use_rules(mesh, RULES), cp.use_context_parallel("ring"):
        with pytest.raises(AttentionError, match="cudnn.*ring or all-gather.*Fix"):
            jax.eval_shape(attention, q, q, q)


def compile_for_h100(method, balance, kernel, length=2048, window=None, softcap=None):
    """An 8-GPU context-parallel attention's forward and backward (a window as for :func:`window_args`, a
    soft-cap), compiled deviceless: its HLO text."""
    from jaxpar.devices import parse_target, target_devices
    mesh = jaxpar.make_mesh({"context": 8}, devices=target_devices(parse_target("h100:1x8")))
    spec = NamedSharding(mesh, P(None, "context"))
    q, kv = (jax.ShapeDtypeStruct((1, length, h, 64), jnp.bfloat16, sharding=spec) for h in (8, 2))
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=spec)
    static, traced = window_args(window)

    def step(q, k, v, seg, *win):
        loss = lambda q, k, v: attention(q, k, v, segment_ids=seg, window=win[0] if win else static,  # noqa: E731
                                         softcap=softcap).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2))(q, k, v)
    with warnings.catch_warnings(), use_attention_kernel(kernel), use_rules(mesh, RULES), \
            cp.use_context_parallel(method, balance=balance):
        warnings.simplefilter("ignore")
        return jax.jit(step).lower(q, kv, kv, seg, *traced).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize("method,balance,window,softcap", [
    ("ring", True, None, None),
    ("all_gather", False, None, None),
    ("ring", True, 256, 50.0),                     # the Triton kernels lower with a window and a soft-cap
    pytest.param("all_gather", True, "traced256", 50.0, marks=pytest.mark.exhaustive),
])
def test_the_compiled_h100_program_holds_no_score_shaped_array(method, balance, window, softcap):
    lengths = (2048 // 16, 2048 // 8, 2048)
    unfused = score_arrays(compile_for_h100(method, balance, "xla", window=window, softcap=softcap), lengths)
    assert unfused.count > 0 and unfused.largest.startswith("f32[")    # the analysis sees XLA's scores
    text = compile_for_h100(method, balance, "auto", window=window, softcap=softcap)
    assert score_arrays(text, lengths) == (0, None, 0)
    assert flash_blocks(text)["ring_flash_forward"] > 0


def compile_decoder(tmp_path, method, balance, packed, length=16384):
    """A 2-layer Llama-shaped Decoder (8 / 2 heads of 64) trained over context 8, compiled deviceless for
    h100:1x8 through its config (configs/llama3_8b_gpu.yaml with a small config.json): its HLO text."""
    import dataclasses
    import json

    from jaxpar.config import load_config
    from jaxpar.config._job import build_job
    from jaxpar.devices import parse_target, target_devices
    shape = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000,
                 max_position_embeddings=length, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = load_config("configs/llama3_8b_gpu.yaml", [
        f"model.hf={tmp_path}", f"model.seq_len={length}", "mesh.context=8", "mesh.fsdp=1", "data.batch_size=1",
        "train.devices=0", f"parallel.context={{method: {method}, balance: {str(balance).lower()}}}"])
    job = build_job(cfg, target_devices(parse_target("h100:1x8")), data=False)
    job = dataclasses.replace(job, packed_batches=packed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return job.compile(job.state_layout())["step"].as_text()


@pytest.mark.slow
@pytest.mark.parametrize("method,balance,packed", [
    ("ring", True, True),
    ("all_gather", False, True),
    pytest.param("ring", False, False, marks=pytest.mark.exhaustive),
    pytest.param("ulysses", False, False, marks=pytest.mark.exhaustive),
])
def test_a_context_parallel_decoder_step_holds_no_score_shaped_array(tmp_path, method, balance, packed):
    """Acceptance 1 of the fused blocks on a model (its 131,072-token 8B numbers: docs/strategies.md)."""
    text = compile_decoder(tmp_path, method, balance, packed)
    assert score_arrays(text, (1024, 2048, 16384)) == (0, None, 0)
    blocks = flash_blocks(text)["ring_flash_forward"]
    assert blocks > 0 if method != "ulysses" else blocks == 0
