"""Flax NNX models annotated with logical axis names only."""
from jaxpar.models._decoder import Decoder, DecoderConfig, DecoderMoE, RoPE, KVCache, decoder_loss
from jaxpar.models._gpt import GPT, GPTConfig, MoESettings, lm_loss
from jaxpar.models._mlp import MLPClassifier, classifier_loss

__all__ = ["GPT", "GPTConfig", "MoESettings", "lm_loss", "MLPClassifier", "classifier_loss", "Decoder", "DecoderConfig", "DecoderMoE",
           "KVCache", "RoPE", "decoder_loss"]
