"""A Hugging Face ``config.json`` read into a :class:`~jaxpar.models.DecoderConfig`.

Two dialects exist and both are read: the one most Hub checkpoints carry (``rope_theta`` /
``rope_scaling``, ``num_experts``, ``torch_dtype``; Gemma-3's ``rope_local_base_freq`` and
``sliding_window_pattern``) and the one ``transformers`` 5 writes (``rope_parameters``, per layer
type for Gemma-3; ``num_local_experts``; ``dtype``; ``layer_types``). A field the file leaves out
takes the architecture's default in ``transformers`` (e.g. ``tie_word_embeddings``: true for Gemma-3,
false for Llama and Qwen3).

Example::

    >>> cfg = decoder_config({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    ...                       "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...                       "num_key_value_heads": 2})
    >>> cfg.head_dim, cfg.kv_heads, cfg.tie_embeddings, cfg.rope.theta
    (4, 2, False, 10000.0)
    >>> decoder_config({"model_type": "gpt2"})
    Traceback (most recent call last):
    ...
    jaxpar.errors.HFConfigError: config.json: model_type 'gpt2' is not supported; jaxpar imports ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxpar.models._decoder import DecoderConfig, DecoderMoE, RoPE
from jaxpar.errors import HFConfigError


#: The supported ``model_type`` values, with their ``architectures`` entry and the defaults of
#: ``transformers`` for fields a file may leave out.
FAMILIES = {
    "llama": {"architecture": "LlamaForCausalLM", "tie": False},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "tie": False, "head_dim": 128},
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "tie": False},
    "gemma3_text": {"architecture": "Gemma3ForCausalLM", "tie": True, "head_dim": 256},
}
#: RoPE's scaling fields by kind: ``{RoPE field: (config.json key, type)}``.
_ROPE_FIELDS = {
    "default": {},
    "linear": {"factor": ("factor", float)},
    "llama3": {"factor": ("factor", float), "low_freq_factor": ("low_freq_factor", float),
               "high_freq_factor": ("high_freq_factor", float),
               "original_max_positions": ("original_max_position_embeddings", int)},
}
_ROPE_KINDS = tuple(_ROPE_FIELDS)


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory, as a dict.

    Args:
      path: the checkpoint directory.

    Returns:
      The parsed ``config.json``.

    Raises:
      HFConfigError: the directory has no ``config.json``, or it is not JSON.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFConfigError(f"{path}: no config.json; a Hugging Face checkpoint directory holds config.json, "
                            "*.safetensors and, with several files, model.safetensors.index.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file}: not valid JSON ({e}).") from e


def _get(hf: dict, name: str, default: Any = None, *, required: bool = False) -> Any:
    if name not in hf or hf[name] is None:
        if required:
            raise HFConfigError(f"config.json: the field {name!r} is missing; it is required for "
                                f"model_type {hf.get('model_type')!r}.")
        return default
    return hf[name]


def _rope(params: dict | None, theta: float) -> RoPE:
    """A :class:`RoPE` from a ``rope_parameters`` / ``rope_scaling`` dict (``None``: the default kind)."""
    if not params:
        return RoPE(theta=float(theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise HFConfigError(f"config.json: rope type {kind!r} is not supported; jaxpar implements {_ROPE_KINDS}.")
    theta = float(params.get("rope_theta", theta))
    scaling = {field: cast(params[key]) for field, (key, cast) in _ROPE_FIELDS[kind].items()}
    return RoPE(theta=theta, kind=kind, **scaling)


def _ropes(hf: dict, model_type: str) -> tuple[RoPE, RoPE | None]:
    """The global and (Gemma-3) local RoPE, from either dialect."""
    params = hf.get("rope_parameters")
    if model_type != "gemma3_text":
        if params is None:                          # the Hub dialect
            return _rope(hf.get("rope_scaling"), _get(hf, "rope_theta", 10000.0)), None
        return _rope(params, params.get("rope_theta", 10000.0)), None
    if params is not None and "full_attention" in params:       # transformers 5: per layer type
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        return _rope(full, full.get("rope_theta", 1e6)), _rope(local, local.get("rope_theta", 1e4))
    scaling = params if params is not None else hf.get("rope_scaling")
    return (_rope(scaling, _get(hf, "rope_theta", 1e6)), RoPE(theta=float(_get(hf, "rope_local_base_freq", 1e4))))


def _refuse(hf: dict, name: str, allowed: Any) -> None:
    value = hf.get(name)
    if value is not None and value != allowed:
        raise HFConfigError(f"config.json: {name}={value!r} is not supported (jaxpar imports {name}={allowed!r}).")


def _moe(hf: dict) -> DecoderMoE:
    _refuse(hf, "decoder_sparse_step", 1)
    _refuse(hf, "mlp_only_layers", [])
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        raise HFConfigError("config.json: neither num_local_experts nor num_experts is set (qwen3_moe).")
    return DecoderMoE(experts=int(experts), top_k=int(_get(hf, "num_experts_per_tok", required=True)),
                      mlp=int(_get(hf, "moe_intermediate_size", required=True)),
                      normalize=bool(_get(hf, "norm_topk_prob", False)))


def _layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def decoder_config(hf: dict[str, Any], **overrides: Any) -> DecoderConfig:
    """The :class:`DecoderConfig` of a ``config.json`` dict.

    Args:
      hf: the parsed ``config.json``.
      **overrides: :class:`DecoderConfig` fields to set besides (``remat``, ``scan_layers``).

    Returns:
      The config.

    Raises:
      HFConfigError: an unsupported ``model_type`` (the message lists the supported ones), a missing
        required field, or a feature jaxpar does not implement (named).
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError(f"config.json: model_type {model_type!r} is not supported; jaxpar imports "
                            f"{sorted(FAMILIES)} ({', '.join(f['architecture'] for f in FAMILIES.values())}).")
    family = FAMILIES[model_type]
    for name in ("attention_bias", "mlp_bias", "use_sliding_window"):
        _refuse(hf, name, False)
    embed, heads = int(_get(hf, "hidden_size", required=True)), int(_get(hf, "num_attention_heads", required=True))
    layers = int(_get(hf, "num_hidden_layers", required=True))
    head_dim = int(_get(hf, "head_dim", family.get("head_dim", embed // heads)))
    rope, local_rope = _ropes(hf, model_type)
    gemma = model_type == "gemma3_text"
    fields = dict(
        vocab=int(_get(hf, "vocab_size", required=True)), embed=embed, layers=layers, heads=heads,
        kv_heads=int(_get(hf, "num_key_value_heads", heads)), head_dim=head_dim,
        mlp=int(_get(hf, "intermediate_size", required=True)), norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        qk_norm=model_type != "llama", rope=rope,
        activation=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", family["tie"])))
    if gemma and hf.get("attn_logit_softcapping") is not None:
        raise HFConfigError(
            f"config.json: attn_logit_softcapping={hf['attn_logit_softcapping']!r} with model_type 'gemma3_text': "
            "transformers' Gemma-3 does not apply it (its attention is never given the cap), so the checkpoint's "
            "reference outputs are those without it. Set it to null to import the model as transformers runs it.")
    if gemma:
        fields.update(norm_offset=1.0, local_rope=local_rope, embed_scale=True, sandwich_norms=True,
                      sliding_window=int(_get(hf, "sliding_window", 4096)), layer_types=_layer_types(hf, layers),
                      query_scale=float(_get(hf, "query_pre_attn_scalar", 256)) ** -0.5,
                      final_softcap=hf.get("final_logit_softcapping"))
    if model_type == "qwen3_moe":
        fields["moe"] = _moe(hf)
    fields.update(overrides)
    try:
        return DecoderConfig(**fields)
    except ValueError as e:
        raise HFConfigError(f"config.json: {e}") from e


def _rope_dict(rope: RoPE) -> dict[str, Any]:
    scaling = {key: getattr(rope, field) for field, (key, _) in _ROPE_FIELDS.get(rope.kind, {}).items()}
    return {"rope_theta": rope.theta, "rope_type": rope.kind, **scaling}


def hf_config_dict(cfg: DecoderConfig, family: str, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` (``transformers`` 5's dialect) of a model built in jaxpar.

    Args:
      cfg: the decoder's config.
      family: the ``model_type`` to write (one of :data:`FAMILIES`).
      dtype: the tensors' dtype name.

    Returns:
      The dict; :func:`decoder_config` reads it back to ``cfg``.
    """
    if family not in FAMILIES:
        raise HFConfigError(f"model_type {family!r} is not supported; choose one of {sorted(FAMILIES)}.")
    hf: dict[str, Any] = {
        "architectures": [FAMILIES[family]["architecture"]], "model_type": family, "vocab_size": cfg.vocab,
        "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype,
        "hidden_act": cfg.activation, "rope_parameters": _rope_dict(cfg.rope)}
    if family == "gemma3_text":
        local = cfg.local_rope or cfg.rope
        hf.update(hidden_activation=cfg.activation, sliding_window=cfg.sliding_window,
                  layer_types=list(cfg.layer_types or ()), query_pre_attn_scalar=(cfg.query_scale or 1.0) ** -2,
                  attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                  rope_parameters={"full_attention": _rope_dict(cfg.rope), "sliding_attention": _rope_dict(local)})
    if cfg.moe is not None:
        hf.update(num_local_experts=cfg.moe.experts, num_experts_per_tok=cfg.moe.top_k,
                  moe_intermediate_size=cfg.moe.mlp, norm_topk_prob=cfg.moe.normalize, decoder_sparse_step=1,
                  mlp_only_layers=[])
    return hf
