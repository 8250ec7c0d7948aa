"""Tiny random Hugging Face checkpoints and transformers reference outputs, for importer/exporter tests.

``build_checkpoint`` writes a complete checkpoint directory (``config.json``, safetensors, tokenizer,
``generation_config.json``) for one of four families, with deliberately unequal dimensions (hidden 48,
intermediate 80, 6 query heads and 2 KV heads of head_dim 10, so heads*head_dim = 60 != hidden,
vocab 131) and random weights, norm weights included. ``reference_logits``, ``reference_greedy`` and
``reference_doc_losses`` run transformers (eager attention, fp32 matmuls at highest precision) on such
a directory.

The config comes in two dialects: ``"v5"`` is what the installed transformers 5 writes
(``rope_parameters``, ``dtype``, ``num_local_experts``, Gemma-3 ``layer_types``), ``"hub"`` is what
transformers 4.x wrote and most Hub checkpoints still carry (``rope_theta`` + ``rope_scaling``,
``torch_dtype``, ``num_experts``, Gemma-3 ``rope_local_base_freq`` + ``sliding_window_pattern``).
Transformers 5 loads both to the same model (checked by the smoke run at the bottom of this file).

Qwen3-MoE experts are written per expert (``mlp.experts.{j}.{gate,up,down}_proj.weight``, what the
Hub has and what transformers 5's ``save_pretrained`` writes) or, with ``experts_layout="fused"``,
as transformers 5's in-memory tensors: ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (rows ``:I`` are
expert j's ``gate_proj.weight``, rows ``I:`` its ``up_proj.weight``) and ``mlp.experts.down_proj``
``[E, H, I]`` (expert j's ``down_proj.weight``), the order of transformers 5's ``qwen2_moe`` conversion
mapping (``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``). Transformers 5 loads the fused
layout too (no conversion matches, the keys load as they are). moe_intermediate_size is 28, not 24:
with 24, ``gate_up_proj`` would be ``[8, 48, 48]``, square in its last two dims.

The references load with ``attn_implementation="eager"`` and ``experts_implementation="eager"``
(transformers 5's default for experts is ``grouped_mm``, another kernel, which on CPU also rejects
some shapes) and copy the mmapped weights, so that the logits do not depend on the file layout: the
v5, hub, fused and sharded forms of one checkpoint give bitwise equal logits.

Scale: with the default init_std 0.02 the logits have std ~0.14, attention is close to uniform and
the residual stream dominates, so some features act only weakly on the logits (max |change| over
2x40 tokens: Llama-3 RoPE scaling vs plain RoPE ~4e-3, Gemma-3 softcap 50/30 ~5e-5, Gemma-3 global
theta ~8e-2, sliding window ~0.8), and the tied Qwen3 model's greedy output repeats one token.
``init_std=0.1`` or ``0.2`` makes them act strongly (RoPE scaling ~2 to 6, softcap ~7e-3 to 0.2).

torch and transformers are imported inside the functions, so importing this module is cheap.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import random
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3")
DIALECTS = ("v5", "hub")
EXPERTS_LAYOUTS = ("per_expert", "fused")
DTYPES = ("float32", "bfloat16")

#: Shared dimensions (Gemma-3 uses GEMMA3_LAYERS layers)
VOCAB = 131
HIDDEN = 48
INTERMEDIATE = 80
HEADS = 6
KV_HEADS = 2
HEAD_DIM = 10
LAYERS = 2
GEMMA3_LAYERS = 7
MAX_POSITIONS = 128
#: Qwen3-MoE
NUM_EXPERTS = 8
TOP_K = 2
MOE_INTERMEDIATE = 28     # 2*I = 56 != hidden 48: the fused gate_up_proj [E, 2I, H] is not square
#: Gemma-3
SLIDING_WINDOW = 5
QUERY_PRE_ATTN_SCALAR = 12
SOFTCAP_ATTN = 50.0
SOFTCAP_FINAL = 30.0
#: Llama-3 RoPE scaling; original_max_position_embeddings is small so that it acts at short lengths
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

#: Tokenizer: special tokens (ids 0, 1, 2) and total vocabulary size (<= VOCAB)
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
TOKENIZER_VOCAB = 128

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}
TIE_DEFAULT = {"llama": False, "qwen3": True, "qwen3_moe": False, "gemma3": True}
#: transformers_version written into hub-dialect configs
HUB_TRANSFORMERS_VERSION = "4.51.3"

_WORDS = ("the a an quick brown fox jumps over lazy dog cat sat on mat model layer token data train "
          "test shard expert router norm weight small tiny random seed and of to in is was").split()


def corpus_lines(n: int = 300, seed: int = 0) -> list[str]:
    """Lower-case English-like lines the tokenizer is trained on (and that it encodes without gaps).

    Args:
        n: number of lines.
        seed: seed of the word choice.

    Returns:
        The lines.
    """
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + rng.choice(".!?,")
            for _ in range(n)]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                  special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    tok.train_from_iterator(corpus_lines(), trainer)
    return tok.to_str()


def train_tokenizer():
    """The fixtures' tokenizer: byte-level BPE trained on ``corpus_lines()``, deterministic.

    Its alphabet is only the bytes of the corpus (lower-case letters, space, ``.!?,``); other
    characters have no token. No BOS/EOS is added by ``encode``.

    Returns:
        A ``tokenizers.Tokenizer`` of TOKENIZER_VOCAB (<= VOCAB) entries, ``<pad>``/``<s>``/``</s>``
        being ids 0/1/2.
    """
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json())


def _save_tokenizer(tok, out_dir: Path, dialect: str, bos: bool = False) -> None:
    from transformers import PreTrainedTokenizerFast     # = TokenizersBackend in transformers 5

    if bos:             # as Llama-3's and Gemma-3's tokenizer.json: every encoding starts with BOS
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                                special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))])

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=MAX_POSITIONS)
    fast.save_pretrained(str(out_dir))
    if dialect == "hub":        # tokenizer_config.json as transformers 4.x wrote it
        added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                           "single_word": False, "special": True}
                 for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)}
        cfg = {"added_tokens_decoder": added, "bos_token": BOS_TOKEN, "clean_up_tokenization_spaces": False,
               "eos_token": EOS_TOKEN, "extra_special_tokens": {}, "model_max_length": MAX_POSITIONS,
               "pad_token": PAD_TOKEN, "tokenizer_class": "PreTrainedTokenizerFast"}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _torch_threads(n: int = 1):
    """Run torch single-threaded: the models are tiny, and threads only contend with JAX's."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _torch_threads(1):
            return fn(*args, **kwargs)
    return wrapper


def _family_config(family: str, tie: bool, softcap: bool, special: dict[str, int], overrides: dict):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, bos_token_id=special["bos"], eos_token_id=special["eos"])
    if family == "llama":
        cls, kw = transformers.LlamaConfig, dict(rope_parameters=dict(LLAMA3_ROPE))
    elif family == "qwen3":
        cls, kw = transformers.Qwen3Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3_moe":
        cls, kw = transformers.Qwen3MoeConfig, dict(
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTERMEDIATE, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cls, kw = transformers.Gemma3TextConfig, dict(
            num_hidden_layers=GEMMA3_LAYERS, sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR, pad_token_id=special["pad"])
        if softcap:
            kw.update(attn_logit_softcapping=SOFTCAP_ATTN, final_logit_softcapping=SOFTCAP_FINAL)
    return cls(**{**common, **kw, **overrides})


def _randomize(model, family: str, seed: int, init_std: float) -> None:
    """Normal(0, init_std) weights; norm weights 1 + 0.1*N(0,1) (Gemma's (1+w) norms: 0.1*N(0,1)).

    Each tensor draws from its own generator, seeded by ``seed`` and the tensor's name, so a tensor
    has the same value whatever else the model holds (tied or not, any layout).
    """
    import zlib

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 0.1 * noise if family == "gemma3" else 1.0 + 0.1 * noise
            else:
                value = init_std * noise
            p.copy_(value.to(p.dtype))


def _safetensors_files(out_dir: Path) -> tuple[list[Path], Path | None]:
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [out_dir / n for n in names], index
    return [out_dir / "model.safetensors"], None


def _rewrite_tensors(out_dir: Path, edit) -> None:
    """Apply ``edit(file_name, tensors) -> tensors`` to every safetensors file and refresh the index.

    Shards left empty are dropped and the rest renumbered ``model-0000x-of-0000y.safetensors``.
    """
    from safetensors.torch import load_file, save_file

    files, index = _safetensors_files(out_dir)
    edited = [edit(f.name, load_file(str(f))) for f in files]
    if index is None:
        save_file(edited[0], str(files[0]), metadata={"format": "pt"})
        return
    for f in files:
        f.unlink()
    edited = [t for t in edited if t]
    weight_map, total = {}, 0
    for i, tensors in enumerate(edited):
        name = f"model-{i + 1:05d}-of-{len(edited):05d}.safetensors"
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    data = json.loads(index.read_text())
    data["weight_map"] = dict(sorted(weight_map.items()))
    data.setdefault("metadata", {})["total_size"] = total
    index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fuse_experts(out_dir: Path) -> None:
    """Replace each layer's per-expert tensors by ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    import re

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    files, _ = _safetensors_files(out_dir)
    pattern = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    experts: dict[str, dict] = {}       # layer prefix -> {"home": file name, (j, proj): tensor}
    for f in files:
        with safe_open(str(f), "pt") as h:
            names = [k for k in h.keys() if pattern.match(k)]
        if names:
            tensors = load_file(str(f))
            for k in names:
                prefix, j, proj = pattern.match(k).groups()
                layer = experts.setdefault(prefix, {})
                layer[int(j), proj] = tensors[k]
                if (int(j), proj) == (0, "gate_proj"):
                    layer["home"] = f.name       # the fused tensors go where expert 0's gate_proj was

    def edit(fname, tensors):
        for k in [k for k in tensors if pattern.match(k)]:
            del tensors[k]
        for prefix, layer in experts.items():
            if layer["home"] != fname:
                continue
            count = 1 + max(j for key in layer if key != "home" for j in key[:1])
            gate = torch.stack([layer[j, "gate_proj"] for j in range(count)])    # [E, I, H]
            up = torch.stack([layer[j, "up_proj"] for j in range(count)])        # [E, I, H]
            tensors[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            tensors[prefix + "down_proj"] = torch.stack([layer[j, "down_proj"] for j in range(count)]).contiguous()
        return tensors

    _rewrite_tensors(out_dir, edit)


def _add_lm_head(out_dir: Path) -> None:
    files, index = _safetensors_files(out_dir)
    home = (json.loads(index.read_text())["weight_map"]["model.embed_tokens.weight"] if index is not None
            else files[0].name)

    def edit(fname, tensors):
        if fname == home:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        return tensors

    _rewrite_tensors(out_dir, edit)


def to_hub_dialect(cfg: dict, family: str, tie: bool | None) -> dict:
    """Rewrite a transformers-5 config dict into the transformers-4.x dialect of Hub checkpoints.

    Args:
        cfg: config.json contents as transformers 5 writes them.
        family: one of FAMILIES.
        tie: the ``tie`` given to ``build_checkpoint`` (None: family default).

    Returns:
        A new dict: ``rope_theta`` + ``rope_scaling`` (None for default RoPE, else the v5 dict without
        ``rope_theta``, ``rope_type`` kept) for ``rope_parameters``, ``torch_dtype`` for ``dtype``,
        ``transformers_version`` 4.x, no ``layer_types`` (Llama/Qwen3 derive it); Qwen3-MoE:
        ``num_experts`` for ``num_local_experts`` and ``max_window_layers``; Gemma-3: ``rope_theta``
        (full-attention layers), ``rope_local_base_freq`` (sliding layers), ``sliding_window_pattern``
        and ``cache_implementation: "hybrid"`` for ``layer_types`` and ``_sliding_window_pattern``.
        ``pad_token_id: null`` is left out (4.x wrote only values that differ from the defaults) and so
        is ``tie_word_embeddings`` where ``tie`` is None and 4.x would have left it out (Gemma-3: its
        config class and the base class both default to tied).

    Raises:
        ValueError: the config (after overrides) has no 4.x spelling (e.g. irregular layer_types).
    """
    out = dict(cfg)
    out["torch_dtype"] = out.pop("dtype")
    out["transformers_version"] = HUB_TRANSFORMERS_VERSION
    rope = out.pop("rope_parameters")
    if family == "gemma3":
        full, local = dict(rope["full_attention"]), dict(rope["sliding_attention"])
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
            raise ValueError(f"overrides: 4.x Gemma-3 configs cannot express scaled sliding-layer RoPE {local}")
        out["rope_theta"] = full.pop("rope_theta")
        out["rope_local_base_freq"] = local["rope_theta"]
        out["rope_scaling"] = None if full == {"rope_type": "default"} else full
        pattern = out.pop("_sliding_window_pattern", 6)
        layer_types = out.pop("layer_types")
        expected = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(layer_types))]
        if layer_types != expected:
            raise ValueError(f"overrides: layer_types {layer_types} is not a sliding_window_pattern layout")
        out["sliding_window_pattern"] = pattern
        out["cache_implementation"] = "hybrid"
        if not out.get("use_bidirectional_attention"):
            out.pop("use_bidirectional_attention", None)
    else:
        rope = dict(rope)
        out["rope_theta"] = rope.pop("rope_theta")
        out["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
        # 4.x Qwen3/Llama had no layer_types (Qwen3 derived sliding layers from max_window_layers)
        layer_types = out.pop("layer_types", None)
        if layer_types is not None:
            window, first = out.get("sliding_window"), out.get("max_window_layers", 0)
            expected = ["sliding_attention" if window is not None and i >= first else "full_attention"
                        for i in range(len(layer_types))]
            if layer_types != expected:
                raise ValueError(f"overrides: layer_types {layer_types} cannot be written in the hub dialect")
    if family == "qwen3_moe":
        out["num_experts"] = out.pop("num_local_experts")
        out.setdefault("max_window_layers", out["num_hidden_layers"])
    if out.get("pad_token_id", 0) is None:
        del out["pad_token_id"]
    if tie is None and family == "gemma3" and out.get("tie_word_embeddings") is True:
        del out["tie_word_embeddings"]
    return dict(sorted(out.items()))


@_single_threaded
def build_checkpoint(family: str, out_dir: str | Path, *, dialect: str = "v5", tie: bool | None = None,
                     experts_layout: str = "per_expert", dtype: str = "float32", seed: int = 0,
                     softcap: bool = False, lm_head_on_disk: bool = False, shard_size: str | int | None = None,
                     init_std: float = 0.02, bos: bool = False, **overrides: Any) -> Path:
    """Write a tiny random Hugging Face checkpoint (config, safetensors, tokenizer, generation config).

    Args:
        family: "llama" (Llama-3 RoPE scaling), "qwen3" (QK-norm), "qwen3_moe" (8 experts, top-2)
            or "gemma3" (7 layers, sliding window 5, the full-attention layer at index 5).
        out_dir: directory to write (created; existing files of the same names are overwritten).
        dialect: "v5" (config as transformers 5 writes it) or "hub" (the 4.x dialect, see
            ``to_hub_dialect``).
        tie: tie lm_head to the embedding; None is the family default (``TIE_DEFAULT``).
        experts_layout: "per_expert" or "fused" (qwen3_moe only; see the module docstring).
        dtype: "float32" or "bfloat16", the dtype of the saved tensors.
        seed: seed of the weights (the same seed gives the same weights in every dialect/layout).
        softcap: gemma3 only: attn_logit_softcapping 50.0 and final_logit_softcapping 30.0.
        lm_head_on_disk: qwen3 only, tied: also store ``lm_head.weight`` (equal to the embedding).
        shard_size: ``max_shard_size`` for ``save_pretrained`` (e.g. "20KB"): several
            ``model-0000x-of-0000y.safetensors`` files and ``model.safetensors.index.json``.
        init_std: standard deviation of the non-norm weights.
        bos: the tokenizer's post-processor adds BOS to every encoding (as Llama-3's and Gemma-3's do).
        **overrides: config fields, passed to the config class after the family settings.

    Returns:
        ``out_dir`` as a Path.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
    if experts_layout not in EXPERTS_LAYOUTS:
        raise ValueError(f"experts_layout must be one of {EXPERTS_LAYOUTS}, got {experts_layout!r}")
    if experts_layout == "fused" and family != "qwen3_moe":
        raise ValueError(f"experts_layout='fused' needs family 'qwen3_moe', got {family!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if tie is not None and not isinstance(tie, bool):
        raise ValueError(f"tie must be None, True or False, got {tie!r}")
    if softcap and family != "gemma3":
        raise ValueError(f"softcap=True needs family 'gemma3', got {family!r}")
    tied = TIE_DEFAULT[family] if tie is None else tie
    if lm_head_on_disk and (family != "qwen3" or not tied):
        raise ValueError("lm_head_on_disk=True needs family 'qwen3' with tied embeddings (tie None or True)")
    if "tie_word_embeddings" in overrides:
        raise ValueError("overrides: pass tie=... rather than tie_word_embeddings")
    if not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std!r}")
    overrides = copy.deepcopy(overrides)       # the config classes edit rope dicts in place

    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    special = {"pad": tok.token_to_id(PAD_TOKEN), "bos": tok.token_to_id(BOS_TOKEN), "eos": tok.token_to_id(EOS_TOKEN)}
    config = _family_config(family, tied, softcap, special, overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[family])(config)
    model.config._attn_implementation = "eager"
    _randomize(model, family, seed, init_std)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    if not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": special["bos"], "eos_token_id": special["eos"]}, indent=2) + "\n")
    _save_tokenizer(tok, out, dialect, bos)

    if experts_layout == "fused":
        _fuse_experts(out)
    if lm_head_on_disk:
        _add_lm_head(out)
    if dialect == "hub":
        cfg_path = out / "config.json"
        cfg = to_hub_dialect(json.loads(cfg_path.read_text()), family, tie)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen_path = out / "generation_config.json"      # 4.x wrote only the non-default fields
        gen = json.loads(gen_path.read_text())
        for key, default in (("output_attentions", False), ("output_hidden_states", False), ("use_cache", True)):
            if gen.get(key, default) == default:
                gen.pop(key, None)
        gen["transformers_version"] = HUB_TRANSFORMERS_VERSION
        gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------------------------------------
# transformers references


def _load_model(ckpt_dir, dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # eager experts too: the plain per-expert loop (the default, grouped_mm, is a different kernel)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=getattr(torch, dtype),
                                                 attn_implementation="eager", experts_implementation="eager")
    # fresh (aligned) copies of the mmapped tensors: kernels round alike whatever the file layout
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model.eval()


def _forward_logits(model, ids: np.ndarray):
    import torch

    with torch.no_grad():
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        return model(input_ids=x, use_cache=False).logits[0].float().numpy()


@_single_threaded
def reference_logits(ckpt_dir, tokens: np.ndarray, dtype: str = "float32",
                     segment_lengths: Sequence[int] | Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """Logits of transformers on ``tokens`` (eager attention, highest-precision fp32 matmuls).

    Args:
        ckpt_dir: a checkpoint directory.
        tokens: int array ``[B, T]``.
        dtype: "float32" or "bfloat16", the dtype the model runs in.
        segment_lengths: packed rows: a list of segment lengths for all rows, or one list per row.
            Each segment runs as a separate sequence (positions from 0, no attention across
            segments); if the lengths sum to less than T, the rest of the row is one more segment.

    Returns:
        float32 ``[B, T, V]``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype} {tokens.shape}")
    B, T = tokens.shape
    if segment_lengths is None:
        rows = [[T]] * B
    elif len(segment_lengths) and np.ndim(segment_lengths[0]) == 0:
        rows = [list(segment_lengths)] * B
    else:
        rows = [list(r) for r in segment_lengths]
    if len(rows) != B:
        raise ValueError(f"segment_lengths has {len(rows)} rows for {B} rows of tokens")
    model = _load_model(ckpt_dir, dtype)
    out = np.zeros((B, T, model.config.vocab_size), np.float32)
    for b, lengths in enumerate(rows):
        if any(int(n) <= 0 for n in lengths) or sum(lengths) > T:
            raise ValueError(f"segment_lengths row {b}: {lengths} must be positive and sum to <= {T}")
        if sum(lengths) < T:
            lengths = lengths + [T - sum(lengths)]
        start = 0
        for n in lengths:
            out[b, start:start + n] = _forward_logits(model, tokens[b, start:start + n])
            start += n
    return out


@_single_threaded
def reference_greedy(ckpt_dir, prompt_tokens: Sequence[int], new_tokens: int = 32, dtype: str = "float32") -> list[int]:
    """Greedy continuation by ``model.generate``: exactly ``new_tokens`` argmax tokens, EOS does not stop it.

    Args:
        ckpt_dir: a checkpoint directory.
        prompt_tokens: 1-D ints.
        new_tokens: number of tokens to generate.
        dtype: "float32" or "bfloat16".

    Returns:
        The ``new_tokens`` generated ids (prompt excluded).
    """
    import torch
    from transformers import GenerationConfig

    prompt = np.asarray(prompt_tokens)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_tokens must be non-empty 1-D ints, got {prompt.dtype} {prompt.shape}")
    if int(new_tokens) < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    model = _load_model(ckpt_dir, dtype)
    # no eos_token_id: nothing stops generation early, and no logits processor masks EOS (pure argmax).
    # generate fills the None fields of ``gen`` from model.generation_config, so clear EOS there too.
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=int(new_tokens), eos_token_id=None,
                           pad_token_id=model.config.pad_token_id, bos_token_id=None)
    with torch.no_grad():
        ids = torch.as_tensor(prompt.astype(np.int64))[None]
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    result = seq[0, prompt.size:].tolist()
    if len(result) != int(new_tokens):
        raise RuntimeError(f"generate returned {len(result)} tokens, expected {new_tokens}")
    return result


@_single_threaded
def reference_doc_losses(ckpt_dir, docs: Sequence[np.ndarray], dtype: str = "float32") -> list[np.ndarray]:
    """Per-token next-token cross-entropy of each document, each run on its own.

    Args:
        ckpt_dir: a checkpoint directory.
        docs: 1-D int arrays of length >= 2.
        dtype: "float32" or "bfloat16" (the model's dtype; the loss is computed in float32).

    Returns:
        One float32 array of ``len(doc) - 1`` losses per doc (position t predicts token t+1).
    """
    import torch

    model = _load_model(ckpt_dir, dtype)
    losses = []
    for i, doc in enumerate(docs):
        doc = np.asarray(doc)
        if doc.ndim != 1 or doc.size < 2 or not np.issubdtype(doc.dtype, np.integer):
            raise ValueError(f"docs[{i}] must be 1-D ints of length >= 2, got {doc.dtype} {doc.shape}")
        logits = torch.as_tensor(_forward_logits(model, doc))
        target = torch.as_tensor(doc[1:].astype(np.int64))
        ce = torch.nn.functional.cross_entropy(logits[:-1], target, reduction="none")
        losses.append(ce.numpy().astype(np.float32))
    return losses


# ------------------------------------------------------------------------------------------------
# smoke check


def _print_keys(d: Path) -> None:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                shapes[k] = (h.get_slice(k).get_shape(), h.get_slice(k).get_dtype())
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")}
    for k in sorted(shapes):
        if k.startswith("model.layers.") and not k.startswith("model.layers.0."):
            continue
        print(f"    {k:52s} {shapes[k][0]} {shapes[k][1]}")
    print(f"    ({len(shapes)} tensors; layers {sorted(layers)} all have the keys of layer 0)")
    for i in layers:
        same = sorted(k.replace(f".{i}.", ".0.", 1) for k in shapes if k.startswith(f"model.layers.{i}."))
        if same != sorted(k for k in shapes if k.startswith("model.layers.0.")):
            raise RuntimeError(f"layer {i} keys differ from layer 0")


def _manual_greedy(d: Path, prompt: np.ndarray, n: int) -> list[int]:
    """Greedy decoding by full forward passes (no KV cache), the check of ``reference_greedy``."""
    model = _load_model(d, "float32")
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_forward_logits(model, np.asarray(seq))[-1].argmax()))
    return seq[len(prompt):]


#: loaded-config attributes in which a hub-dialect dir may differ from the v5 one without changing the model
_CONFIG_KEYS_4X_ONLY = ("_name_or_path", "transformers_version", "cache_implementation", "max_window_layers",
                        "sliding_window_pattern")


@_single_threaded
def _smoke() -> None:
    import tempfile
    import time

    from transformers import AutoConfig, AutoTokenizer

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, 24))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.time()
        for family in FAMILIES:
            variants: dict[str, dict] = {"v5": {}, "hub": dict(dialect="hub")}
            if family == "qwen3_moe":
                variants["fused"] = dict(experts_layout="fused")
                variants["fused_hub_sharded"] = dict(experts_layout="fused", dialect="hub", shard_size="20KB")
            if family == "qwen3":
                variants["lm_head_on_disk"] = dict(lm_head_on_disk=True)
                variants["lm_head_on_disk_hub_sharded"] = dict(lm_head_on_disk=True, dialect="hub", shard_size="20KB")
            if family == "gemma3":
                variants["softcap"] = dict(softcap=True)
                variants["softcap_hub"] = dict(softcap=True, dialect="hub")
            variants["sharded"] = dict(shard_size="20KB")
            variants["tie_flipped_hub"] = dict(tie=not TIE_DEFAULT[family], dialect="hub")
            variants["tie_flipped"] = dict(tie=not TIE_DEFAULT[family])
            variants["bf16"] = dict(dtype="bfloat16")
            variants["bf16_hub"] = dict(dtype="bfloat16", dialect="hub")
            logits, dirs = {}, {}
            for name, kw in variants.items():
                dirs[name] = build_checkpoint(family, root / f"{family}-{name}", **kw)
                logits[name] = reference_logits(dirs[name], tokens, dtype=kw.get("dtype", "float32"))
            print(f"=================== {family}")
            for name in ("v5", "hub"):
                print(f"--- config.json ({name})")
                print((dirs[name] / "config.json").read_text())
            for name in ("v5", "fused", "lm_head_on_disk", "tie_flipped"):
                if name in dirs:
                    print(f"--- tensors ({name})")
                    _print_keys(dirs[name])
            index = json.loads((dirs["sharded"] / "model.safetensors.index.json").read_text())
            print(f"--- sharded: {len(set(index['weight_map'].values()))} files + model.safetensors.index.json")
            # the same model whatever the dialect / layout: the loaded configs and the logits agree
            pairs = [("hub", "v5"), ("sharded", "v5"), ("tie_flipped_hub", "tie_flipped"), ("bf16_hub", "bf16")]
            pairs += [(n, "v5") for n in ("fused", "fused_hub_sharded", "lm_head_on_disk", "lm_head_on_disk_hub_sharded")
                      if n in dirs]
            pairs += [("softcap_hub", "softcap")] if "softcap" in dirs else []
            for a, b in pairs:
                ca, cb = (AutoConfig.from_pretrained(str(dirs[n])).to_dict() for n in (a, b))
                differ = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)
                                and k not in _CONFIG_KEYS_4X_ONLY)
                diff = np.abs(logits[a] - logits[b]).max()
                print(f"    {a:28s} vs {b:12s}: max|dlogits| = {diff:.3g}, loaded configs differ in {differ}")
                if diff != 0 or differ:
                    raise RuntimeError(f"{family}: {a} and {b} do not load to the same model")
            for name in ("tie_flipped", "bf16") + (("softcap",) if "softcap" in dirs else ()):
                print(f"    {name:28s} vs v5          : max|dlogits| = {np.abs(logits[name] - logits['v5']).max():.3g}")
            print(f"    logits std {logits['v5'].std():.4g}")
            greedy = reference_greedy(dirs["v5"], tokens[0, :6], 20)
            if greedy != _manual_greedy(dirs["v5"], tokens[0, :6], 20):
                raise RuntimeError(f"{family}: generate differs from full-forward argmax decoding")
            print(f"    greedy (== full-forward argmax): {greedy}")
        print(f"built and ran all variants in {time.time() - t0:.1f}s")

        print("=================== tokenizer")
        raw = train_tokenizer()
        line = corpus_lines(1, seed=1)[0]
        for name in ("v5", "hub"):
            d = root / f"llama-{name}"
            tok = AutoTokenizer.from_pretrained(str(d))
            ids = tok(line)["input_ids"]
            if ids != raw.encode(line).ids or tok.decode(ids) != line:
                raise RuntimeError("AutoTokenizer does not reproduce the trained tokenizer")
            print(f"    {name}: {type(tok).__name__}, {len(tok)} tokens, pad/bos/eos ids "
                  f"{tok.pad_token_id}/{tok.bos_token_id}/{tok.eos_token_id}; {line!r} -> {ids}")
            print("    tokenizer_config.json:", json.dumps(json.loads((d / "tokenizer_config.json").read_text())))
            print("    generation_config.json:", json.dumps(json.loads((d / "generation_config.json").read_text())))

        d = root / "qwen3-v5"
        losses = reference_doc_losses(d, [tokens[0, :7], tokens[1, :9]])
        direct = reference_logits(d, tokens[:1, :7])[0]
        logp = direct[:-1] - np.log(np.exp(direct[:-1]).sum(-1, keepdims=True))
        print("doc losses:", [x.shape for x in losses], "vs log-softmax of reference_logits:",
              np.abs(losses[0] + logp[np.arange(6), tokens[0, 1:7]]).max())
        seg = reference_logits(d, tokens, segment_lengths=[10, 14])
        print("segments [10, 14]: first == unpacked prefix:",
              np.abs(seg[:, :10] - reference_logits(d, tokens[:, :10])).max(),
              " second == unpacked suffix:", np.abs(seg[:, 10:] - reference_logits(d, tokens[:, 10:])).max())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _smoke()
