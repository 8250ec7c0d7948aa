"""The cost model's decoder (:func:`jaxpar.cost.decoder`, :func:`jaxpar.cost.from_decoder_config`): its leaves are
jaxpar's Decoder's (read with ``jax.eval_shape``, nothing compiled), its FLOPs are a gated GQA layer's by hand, the
GPT's numbers are unchanged, and a ``model.hf`` directory with ``config.json`` only is planned without weights."""

import json

import pytest

from jaxpar import cost
from jaxpar.cost._device_bytes import BLOCK_KEEPS, REMAT_KEEPS, model_keeps
from jaxpar.cost._memory import activation_widths, leaf_spec
from jaxpar.cost._roofline import layer_kernels
from jaxpar.cost._time import step_flops
from jaxpar.errors import CostModelError


def _decoder_configs():
    from jaxpar.models import DecoderConfig, DecoderMoE

    return {"gqa-qk-norm-sandwich": DecoderConfig(vocab=40, embed=16, layers=2, heads=4, kv_heads=2, head_dim=8,
                                                  mlp=24, qk_norm=True, sandwich_norms=True),
            "tied-moe": DecoderConfig(vocab=40, embed=16, layers=2, heads=4, kv_heads=1, head_dim=4, mlp=24,
                                      tie_embeddings=True, moe=DecoderMoE(experts=4, top_k=2, mlp=12))}


@pytest.mark.parametrize("name", ["gqa-qk-norm-sandwich", "tied-moe"])
def test_decoder_leaves_are_the_decoders(name):
    """Every leaf's path, shape and logical names, and the parameter count, are those of a real Decoder."""
    from flax import nnx

    from jaxpar.models import Decoder

    cfg = _decoder_configs()[name]
    traced = cost.from_nnx(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), layers=2, hidden=16, heads=4, seq=8, vocab=40,
                           batch=2)
    spec = cost.from_decoder_config(cfg, seq=8, batch=2)
    assert [(l.name, l.shape, l.logical) for l in spec.leaves] == [(l.name, l.shape, l.logical) for l in traced.leaves]
    assert spec.n_params == traced.n_params and spec.kv_heads == cfg.kv_heads and spec.head_dim == cfg.head_dim


def test_a_gated_gqa_layer_counts_its_flops_by_hand():
    """Per token forward: q, k, v, o = 2·h·(2·q + 2·kv), the gated MLP 3·2·h·f, the scores 4·s·q."""
    h, s, f, q, kv = 64, 32, 160, 8 * 16, 2 * 16
    m = cost.decoder(layers=1, hidden=h, heads=8, seq=s, vocab=128, batch=1, mlp=f, kv_heads=2, head_dim=16)
    forward = 2 * h * (2 * q + 2 * kv) + 3 * 2 * h * f + 4 * s * q
    assert step_flops(m) == 3 * s * forward + 6 * s * h * 128
    ks = {k.name: k for k in layer_kernels(m, cost.Plan(), 1, 2)}
    assert ks["qkv"].flops * ks["qkv"].count == 2 * s * h * (q + 2 * kv)
    assert ks["fc1"].count == 2 and ks["fc1"].flops * 2 + ks["fc2"].flops == 3 * 2 * s * h * f
    assert ks["proj"].flops == 2 * s * q * h


def test_the_gpt_keeps_its_numbers():
    """The GPT's own widths give back the constants its formulas had before decoders: ``4h^2`` attention, two MLP
    matrices, Korthikanti's ``(10, 24)`` and the measured keeps."""
    m = cost.gpt(layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=8, mlp=96)
    assert (m.kv_heads, m.head_dim, m.attention_params, m.mlp_matrices) == (4, 16, 4 * 64 * 64, 2)
    assert activation_widths(m) == (10, 24) and model_keeps(m, BLOCK_KEEPS) == BLOCK_KEEPS
    assert step_flops(m) == 8 * (2 * 3 * 2 * 32 * (4 * 64 * 64 + 2 * 64 * 96 + 2 * 32 * 64) + 6 * 32 * 64 * 128)
    assert m.n_params == cost.gpt(2, 64, 4, 32, 128, 8, mlp=96).n_params == 2 * (4 * 64 * 64 + 2 * 64 * 96 + 96 + 5 * 64) \
        + 2 * 128 * 64 + 32 * 64 + 2 * 64


def test_gqa_and_a_gated_mlp_change_what_a_layer_keeps():
    """Narrower K/V keep less, a gated MLP of width f more (the keeps are estimates for decoders)."""
    m = cost.decoder(layers=2, hidden=64, heads=8, seq=32, vocab=128, batch=8, mlp=224, kv_heads=2)
    assert activation_widths(m) == (10, 4 * (64 + 16) / 64 + 8 * 224 / 64)
    assert model_keeps(m, REMAT_KEEPS["save-matmuls"]) == (2.0, 2 * (64 + 16) / 64 + 2 * 224 / 64, 1.0)
    assert model_keeps(m, REMAT_KEEPS["full"]) == REMAT_KEEPS["full"]


def test_kv_heads_fewer_than_the_tensor_axis_are_replicated():
    m = cost.decoder(layers=2, hidden=64, heads=8, seq=32, vocab=128, batch=8, mlp=128, kv_heads=2)
    assert leaf_spec(m.leaf("layers/wk"), {"tensor": 4}) == ((), (), (), ())
    assert leaf_spec(m.leaf("layers/wk"), {"tensor": 2}) == ((), ("tensor",), (), ())
    assert m.kv_split(4) == 1 and m.kv_split(2) == 2
    assert cost.evaluate(m, cost.Plan(data=2, tensor=4), cost.load_cluster("h100")).memory.total > 0


def test_the_head_is_a_matmul_on_the_last_stage():
    from jaxpar.cost._memory import pipe_end

    m = cost.decoder(layers=2, hidden=64, heads=8, seq=32, vocab=128, batch=8, mlp=128)
    assert m.leaf("lm_head").matmul and pipe_end(m.leaf("lm_head")) == "last" and pipe_end(m.leaf("embed")) == "first"
    assert "lm_head" not in {l.name for l in cost.decoder(2, 64, 8, 32, 128, 8, 128, tied=True).leaves}


def test_bad_decoder_fields_are_named():
    with pytest.raises(CostModelError, match="kv_heads=3 does not divide heads=8"):
        cost.decoder(layers=2, hidden=64, heads=8, seq=32, vocab=128, batch=8, mlp=128, kv_heads=3)
    with pytest.raises(CostModelError, match="head_dim=-1"):
        cost.ModelSpec(2, 64, 8, 32, 128, 8, head_dim=-1)
    with pytest.raises(CostModelError, match="kernel_layout='rows'"):
        cost.ModelSpec(2, 64, 8, 32, 128, 8, kernel_layout="rows")


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rope_theta": 500000.0, "tie_word_embeddings": False, "max_position_embeddings": 64}


def test_a_config_json_alone_is_planned_without_weights(tmp_path):
    """``model.hf`` with ``config.json`` only: the cost model's decoder, a plan, no refusal; the checkpoint opens
    without weights for planning and says so when asked for them."""
    from jaxpar.config import load_config
    from jaxpar.config._hf_model import open_hf
    from jaxpar.config._cost_model import cost_model, unpredicted
    from jaxpar.errors import HFCheckpointError, HFFilesError
    from jaxpar.hf import open_checkpoint
    from jaxpar.strategy import Strategy

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    cfg = load_config(_yaml(tmp_path))
    spec = cost_model(cfg)
    assert (spec.kv_heads, spec.head_dim, spec.gated, spec.positions, spec.seq, spec.batch) == (2, 8, True, False, 64, 8)
    assert spec.n_params == 2 * 64 * 32 + 32 + 2 * (32 * 2 * (32 + 16) + 3 * 32 * 80 + 2 * 32)   # tables, norm, layers
    assert unpredicted(cfg, Strategy(), {"data": 8}) is None
    assert cost.plan(spec, cost.load_cluster("h100")).best.time.total > 0
    ckpt = open_hf(cfg.model)
    assert not ckpt.has_weights
    with pytest.raises(HFCheckpointError, match="config.json only, no \\*.safetensors"):
        ckpt.load(None, {})
    with pytest.raises(HFFilesError, match="no \\*.safetensors"):
        open_checkpoint(tmp_path)


def _yaml(directory):
    path = directory / "job.yaml"
    path.write_text(f"model: {{hf: {directory}, seq_len: 64}}\ndata: {{kind: synthetic, batch_size: 8}}\n")
    return str(path)


def test_the_decoders_column_regions_reduce_once_each_on_the_cpu():
    """The Decoder runs q, k, v (and gate, up) in one column-parallel region: XLA:CPU all-reduces one input
    gradient each, 2 forward + 2 backward per layer. Its compiled dp4-tp2 step (fp32, this model) moved 658,468
    bytes over ``tensor``; the model says 659,456 (the norms' small reductions aside)."""
    from jaxpar.cost._traffic import bytes_per_axis, comms

    m = cost.decoder(layers=2, hidden=64, heads=8, seq=64, vocab=256, batch=16, mlp=160, kv_heads=2, head_dim=16)
    got = bytes_per_axis(comms(m, cost.Plan(data=4, tensor=2), lowering="xla-cpu", compute_bytes=4, grad_bytes=4))
    act = 4 * 64 * 64 * 4                                  # 4 sequences a device, fp32
    assert got["tensor"] == (4 * 2 + 2) * act + 4 * 4 * 64 * 4 == 659456     # the blocks, both ends, loss stats
