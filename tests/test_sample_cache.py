"""Cached greedy decoding (jaxpar.models.Decoder.decode, jaxpar.run.greedy_generate) against the full recompute.

Tiny random decoders with the four families' flags (Llama-3's RoPE scaling, Qwen3's q/k norms and tied
head, Qwen3-MoE's routed experts, Gemma-3's sliding window, soft caps, (1 + w) norms and sandwich norms),
weights large enough that every feature moves the logits. The transformers parity of the whole decode
is in tests/test_hf.py::test_greedy_decode_matches_transformers.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import GenerationError, ModelConfigError
from jaxpar.models import Decoder, DecoderConfig, DecoderMoE, RoPE
from jaxpar.run import greedy_generate

BASE = dict(vocab=29, embed=16, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=24, init_std=0.3)
FAMILIES = {
    "llama": dict(rope=RoPE(theta=500000.0, kind="llama3", factor=8.0, original_max_positions=4)),
    "qwen3": dict(qk_norm=True, tie_embeddings=True),
    "qwen3_moe": dict(qk_norm=True, moe=DecoderMoE(experts=4, top_k=2, mlp=8)),
    "gemma3": dict(qk_norm=True, norm_offset=1.0, activation="gelu_pytorch_tanh", local_rope=RoPE(theta=10.0),
                   sliding_window=3, layer_types=("sliding_attention", "full_attention"), query_scale=0.3,
                   attn_softcap=2.0, final_softcap=3.0, embed_scale=True, sandwich_norms=True),
}
PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 6]]       # unequal lengths: the shorter row is left-padded in the cache


def decoder(**fields) -> Decoder:
    with nnx.use_eager_sharding(False):
        return Decoder(DecoderConfig(**{**BASE, **fields}), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "gemma3" else pytest.mark.exhaustive)
                                    for f in FAMILIES])
def test_cached_decode_equals_the_full_recompute(family):
    """Greedy tokens from a prefill and one-token steps equal the argmax of the model over the whole rows,
    and the prefill's and every step's logits equal the whole rows' logits there within 1e-5 (fp32)."""
    model = decoder(**FAMILIES[family])
    graphdef, params = nnx.split(model, nnx.Param)
    step = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).decode(t, c))
    longest, new = max(map(len, PROMPTS)), 7
    left = np.array([[0] * (longest - len(r)) + r for r in PROMPTS], np.int32)
    cache = model.init_cache(len(PROMPTS), 16, start=[longest - len(r) for r in PROMPTS])
    with jax.default_matmul_precision("highest"):
        logits, cache = step(params, left, cache)
        prefill, cached = np.asarray(logits), [np.asarray(logits[:, -1])]
        for _ in range(new - 1):
            logits, cache = step(params, jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32), cache)
            cached.append(np.asarray(logits[:, 0]))
        cached = np.stack(cached, axis=1)                       # [rows, new, vocab]: the logits of each new token
        rows = [r + cached[i].argmax(-1).tolist() for i, r in enumerate(PROMPTS)]
        padded = np.array([r + [0] * (longest + new - len(r)) for r in rows], np.int32)     # causal: padding after
        full = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, padded))
    for i, r in enumerate(PROMPTS):
        whole = full[i, len(r) - 1:len(r) - 1 + new]
        assert cached[i].argmax(-1).tolist() == whole.argmax(-1).tolist()
        np.testing.assert_allclose(cached[i], whole, rtol=0, atol=1e-5)
        np.testing.assert_allclose(prefill[i, longest - len(r):], full[i, :len(r)], rtol=0, atol=1e-5)


def test_greedy_generate_compiles_the_prefill_and_the_step_once():
    """N new tokens: two programs (the prefill, the one-token step); a model without a cache, over the
    whole sequence (no ``context``), gives the same tokens from one program."""
    model = decoder(**FAMILIES["gemma3"])
    graphdef, params = nnx.split(model, nnx.Param)
    compiles = collections.Counter()

    def count(event, _secs, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[fun_name] += 1

    class NoCache(nnx.Module):          # the same decoder seen as a user model: no init_cache / decode
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, tokens):
            return self.inner(tokens)

    plain_graphdef, plain_params = nnx.split(NoCache(model), nnx.Param)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        cached = greedy_generate(graphdef, params, PROMPTS, new_tokens=9)
        plain = greedy_generate(plain_graphdef, plain_params, PROMPTS, new_tokens=9)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles["jit(cached_step)"] == 2 and compiles["jit(recompute_step)"] == 1
    assert [len(r) for r in cached] == [len(p) + 9 for p in PROMPTS] and cached == plain


def test_greedy_generate_refuses_a_sequence_beyond_max_positions():
    model = decoder(max_positions=10)
    graphdef, params = nnx.split(model, nnx.Param)
    with pytest.raises(GenerationError, match=r"prompt of 6 tokens plus new_tokens=5 is 11 tokens, more than the "
                                              r"model's max_positions=10 .*; ask for fewer new_tokens: at most 4, or "
                                              r"shorten the prompt to 5 tokens\.$"):
        greedy_generate(graphdef, params, PROMPTS, new_tokens=5)
    with pytest.raises(GenerationError, match=r"max_positions=8 .*; shorten the prompt to 3 tokens \(the prompt "
                                              r"alone fills the 8 positions\)\.$"):
        greedy_generate(graphdef, params, [[1] * 8], new_tokens=5, max_positions=8)     # no room for a new token
    with pytest.raises(ModelConfigError, match=r"init_cache\(size=11\): longer than DecoderConfig.max_positions=10"):
        model.init_cache(1, 11)
    with pytest.raises(GenerationError, match=r"greedy_generate\(new_tokens=-1\): must be an int >= 0"):
        greedy_generate(graphdef, params, PROMPTS, new_tokens=-1)
    with pytest.raises(GenerationError, match=r"prompts \[1\] have no token"):
        greedy_generate(graphdef, params, [[1], []], new_tokens=1)
