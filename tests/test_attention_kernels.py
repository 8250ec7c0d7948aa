"""jaxpar.attention's kernels: which kernel each call gets, the Pallas flash kernel against
XLA's path (run in Pallas's interpreter on the CPU: forward and the three input gradients at fp32 1e-5), on
the shards of a data x tensor mesh, and compiled deviceless for an H100: no ``[length, length]`` array, and
a Llama-3-8B-shaped layer whose memory grows linearly up to 32k tokens. The cuDNN kernel needs a GPU;
``benchmarks/gpu.py`` checks it there (docs/benchmarks.md §21)."""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import need_devices
import jaxpar
from jaxpar.devices import parse_target, target_devices
from jaxpar.errors import AttentionError
from jaxpar.attention import (AttentionFallbackWarning, attention, choose_kernel, current_attention_kernel,
                              use_attention_kernel)
from jaxpar.analysis._fused_attention import attention_report, flash_blocks
from jaxpar.attention._kernels import pallas_kernel

BF16 = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)


@pytest.mark.parametrize("platform,local_gpu,kw,want,why", [
    ("cpu", False, {}, "xla", None),
    ("tpu", False, {}, "xla", None),
    ("gpu", True, {}, "cudnn", None),
    ("gpu", True, {"window": 128}, "cudnn", None),
    ("gpu", True, {"segments": True}, "pallas", None),
    ("gpu", False, {}, "pallas", None),                  # deviceless: cuDNN asks the attached GPU
    ("gpu", True, {"softcap": 50.0}, "pallas", None),            # jaxpar's flash block kernel
    ("gpu", True, {"window": jnp.int32(128)}, "pallas", None),
    ("gpu", True, {"window": 128, "causal": False}, "pallas", None),
    ("gpu", True, {"segments": True, "window": 128}, "pallas", None),
    ("gpu", False, {"window": 128}, "pallas", None),
    ("gpu", True, {"positions": True}, "xla", "explicit positions"),
    ("gpu", True, {"softcap": 50.0, "positions": True}, "xla", "Pallas: explicit positions"),
])
def test_auto_takes_a_fused_kernel_on_a_gpu_where_one_applies(platform, local_gpu, kw, want, why):
    args = dict(causal=True, segments=False, positions=False, window=None, softcap=None) | kw
    kernel, reason = choose_kernel(BF16, KV, platform=platform, setting="auto", local_gpu=local_gpu, **args)
    assert kernel == want
    assert (reason is None) if why is None else (why in reason)


@pytest.mark.parametrize("kw,want", [({}, "mha"), ({"softcap": 30.0}, "flash"), ({"window": 128}, "flash"),
                                     ({"window": jnp.int32(128)}, "flash")])
def test_pallas_runs_jaxs_kernel_where_it_applies_else_the_flash_block_kernel(kw, want):
    assert pallas_kernel(BF16, kw.get("window"), kw.get("softcap")) == want


def test_fp32_and_odd_shapes_keep_xla_and_a_named_kernel_that_cannot_run_is_refused():
    f32 = jax.ShapeDtypeStruct(BF16.shape, jnp.float32)
    none = dict(causal=True, segments=False, positions=False, window=None, softcap=None)
    assert choose_kernel(f32, f32, platform="gpu", setting="auto", local_gpu=True, **none)[0] == "xla"
    odd = jax.ShapeDtypeStruct((2, 200, 8, 64), jnp.bfloat16)     # 200 tokens: no Pallas block divides it
    kernel, why = choose_kernel(odd, odd, platform="gpu", setting="auto", local_gpu=False, **none)
    assert kernel == "xla" and "length 200" in why
    capped = none | {"softcap": 30.0}
    kernel, why = choose_kernel(odd, odd, platform="gpu", setting="auto", local_gpu=False, **capped)
    assert kernel == "xla" and "length 200" in why
    assert choose_kernel(f32, f32, platform="gpu", setting="auto", local_gpu=True, **capped)[0] == "xla"
    with pytest.raises(AttentionError, match=r"use_attention_kernel\('cudnn'\) cannot run this call: segment ids"):
        choose_kernel(BF16, KV, platform="gpu", setting="cudnn", local_gpu=True, **(none | {"segments": True}))
    with pytest.raises(AttentionError, match="not an attention kernel"):
        with use_attention_kernel("flash"):
            pass
    assert current_attention_kernel() == "auto"


def _qkv(b, t, h, hk, d, seed=0):
    k0, k1, k2, k3 = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k0, (b, t, h, d)), jax.random.normal(k1, (b, t, hk, d)),
            jax.random.normal(k2, (b, t, hk, d)), jax.random.normal(k3, (b, t, h, d)))


def _value_and_grads(kernel, q, k, v, dout, **kw):
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, **kw) * dout)
    with use_attention_kernel(kernel):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


SEGMENTS = jnp.asarray(np.repeat([[0, 1, 2, 3]], 2, 0).repeat([40, 24, 50, 14], axis=1), jnp.int32)


@pytest.mark.parametrize("case,kv_heads,kw", [
    ("causal gqa", 2, {}),
    ("full", 4, {"causal": False}),
    ("packed", 2, {"segment_ids": SEGMENTS}),
])
def test_the_pallas_kernel_equals_xla_forward_and_gradients(case, kv_heads, kw):
    q, k, v, dout = _qkv(2, 128, 4, kv_heads, 32)
    want = _value_and_grads("xla", q, k, v, dout, **kw)
    got = _value_and_grads("pallas", q, k, v, dout, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_the_flash_block_kernel_equals_xla_with_a_soft_cap_and_a_traced_window():
    """A soft-cap and a traced window (an argument of the jitted step): jaxpar's flash block kernel."""
    q, k, v, dout = _qkv(1, 128, 4, 2, 16, seed=2)

    def output_and_grads(kernel):
        def run(q, k, v, window):
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, window=window, softcap=5.0), q, k, v)
            return out, vjp(dout)
        with use_attention_kernel(kernel):
            return jax.jit(run)(q, k, v, jnp.int32(40))
    want, got = output_and_grads("xla"), output_and_grads("pallas")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


@need_devices(4)
def test_the_pallas_kernel_runs_on_each_devices_shard_of_a_data_tensor_mesh():
    q, k, v, dout = _qkv(4, 128, 4, 2, 32, seed=1)
    want = _value_and_grads("xla", q, k, v, dout, segment_ids=SEGMENTS[:1].repeat(4, 0))
    mesh = jaxpar.make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    rules = (("batch", "data"), ("length", None), ("heads", "tensor"))
    shard = NamedSharding(mesh, P("data", None, "tensor"))
    args = [jax.device_put(x, shard) for x in (q, k, v, dout)]
    seg = jax.device_put(SEGMENTS[:1].repeat(4, 0), NamedSharding(mesh, P("data")))

    def loss(q, k, v, dout, seg):
        return jnp.sum(attention(q, k, v, segment_ids=seg) * dout)
    with jaxpar.use_rules(mesh, rules), use_attention_kernel("pallas"):
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        got = f(*args, seg)
        text = f.lower(*args, seg).compile().as_text()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    assert "all-gather" not in text and "all-to-all" not in text        # each device its batch rows and heads


def test_changing_the_kernel_retraces_a_remat_body():
    """jax.checkpoint keeps its traces by function: the setting clears them, so the second trace runs Pallas."""
    def body(x):
        return attention(x, x, x)
    f = jax.checkpoint(body, policy=jax.checkpoint_policies.checkpoint_dots)
    x = jnp.ones((1, 128, 2, 32))
    with use_attention_kernel("xla"):
        assert "pallas_call" not in str(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x))
    with use_attention_kernel("pallas"):
        assert "pallas_call" in str(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x))


def _h100(n=1):
    return target_devices(parse_target(f"h100:1x{n}"))


def _largest_square(text: str, t: int) -> int:
    """The elements of the largest array of the compiled text whose last two dimensions are ``t x t``."""
    sizes = [int(np.prod([int(d) for d in dims.split(",")]))
             for dims in re.findall(rf"\[((?:\d+,)*{t},{t})\]", text)]
    return max(sizes, default=0)


def test_the_gpt_attention_compiled_for_an_h100_holds_no_length_by_length_array():
    mesh = jaxpar.make_mesh({"data": 8}, devices=_h100(8))
    sharded = jax.ShapeDtypeStruct((16, 1024, 12, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32))
    with jaxpar.use_rules(mesh, (("batch", "data"), ("length", None), ("heads", None))):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(sharded, sharded, sharded).compile().as_text()
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 3       # forward, delta, backward
    assert _largest_square(text, 1024) == 0
    with jaxpar.use_rules(mesh, (("batch", "data"), ("length", None), ("heads", None))):
        f32 = jax.ShapeDtypeStruct(sharded.shape, jnp.float32, sharding=sharded.sharding)
        with pytest.warns(AttentionFallbackWarning, match="float32 q/k/v"):
            jax.jit(lambda q: attention(q, q, q, softcap=30.0)).lower(f32)
        with use_attention_kernel("cudnn"), pytest.raises(AttentionError, match="no local NVIDIA GPU"):
            jax.jit(lambda q: attention(q, q, q)).lower(sharded)


def test_a_soft_capped_attention_with_a_traced_window_compiled_for_an_h100_runs_the_flash_block_kernel():
    mesh = jaxpar.make_mesh({"data": 1}, devices=_h100(1))
    x = jax.ShapeDtypeStruct((2, 1024, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def loss(q, k, v, window):
        return jnp.sum(attention(q, k, v, window=window, softcap=30.0).astype(jnp.float32))
    with jaxpar.use_rules(mesh, (("batch", None), ("length", None), ("heads", None))), warnings.catch_warnings():
        warnings.simplefilter("error", AttentionFallbackWarning)
        window = jax.ShapeDtypeStruct((), jnp.int32)
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, window).compile().as_text()
    assert _largest_square(text, 1024) == 0
    assert flash_blocks(text) == {"ring_flash_forward": 1, "ring_flash_dq": 1, "ring_flash_dkv": 1}
    assert attention_report(text, 1024).pallas == 1                   # jaxpar inspect counts it fused


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.exhaustive)])
def test_a_llama_8b_layer_compiled_for_an_h100_grows_linearly_to_32k_tokens(packed):
    """One Llama-3-8B-shaped layer (embed 4096, 32 / 8 heads, MLP 14336; a small vocabulary, so the layer is
    what is measured), forward and backward, bf16, at 8k, 16k and 32k tokens."""
    from jaxpar.models import Decoder, DecoderConfig, decoder_loss
    cfg = DecoderConfig(vocab=256, embed=4096, layers=1, heads=32, kv_heads=8, head_dim=128, mlp=14336)
    mesh = jaxpar.make_mesh({"data": 1}, devices=_h100(1))
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    temps = {}
    for t in (8192, 16384, 32768):
        tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
        batch = {"tokens": tokens, "targets": tokens} | ({"segment_ids": tokens} if packed else {})

        def loss(p, batch):
            return decoder_loss(nnx.merge(graphdef, p), batch)
        with jaxpar.use_rules(mesh, jaxpar.Strategy().rules(mesh)):
            compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
        text, temps[t] = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
        assert _largest_square(text, t) == 0, t
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 3
    assert temps[32768] < 8 * 2**30, temps                            # XLA's path: 128 GiB of fp32 scores alone
    # a * t + b * t^2 at t, 2t, 4t: the second difference over the first is 2 when b = 0, 4 when a = 0
    growth = (temps[32768] - temps[16384]) / (temps[16384] - temps[8192])
    assert 1.6 < growth < 2.4 and 1.9 < temps[32768] / temps[16384] < 2.1, temps


@pytest.mark.parametrize("remat,forwards,softcap", [("save-matmuls", 1, None), ("full", 2, None),
                                                    ("save-matmuls", 1, 30.0)])
def test_save_matmuls_keeps_the_fused_attentions_residuals(remat, forwards, softcap):
    """Under ``save-matmuls`` the flash kernel's forward runs once per layer; ``full`` runs it again in the
    backward (compiled for an H100: Pallas's kernel, with a soft-cap jaxpar's flash block kernel, counted in
    the scanned layers' bodies)."""
    from jaxpar.adapters._blocks import remat_policy
    mesh = jaxpar.make_mesh({"data": 1}, devices=_h100(1))
    x = jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    w = jax.ShapeDtypeStruct((3, 256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def layer(x, w):
        q = (x @ w).reshape(2, 256, 4, 64)
        return attention(q, q, q, softcap=softcap).reshape(2, 256, 256) @ w, None

    def loss(x, w):
        return jax.lax.scan(jax.checkpoint(layer, policy=remat_policy(remat)), x, w)[0].astype(jnp.float32).sum()
    with jaxpar.use_rules(mesh, (("batch", None), ("length", None), ("heads", None))):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert attention_report(text, 256).pallas == forwards
