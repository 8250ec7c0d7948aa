"""Flax NNX models annotated with logical axis names only."""
from jaxpar.models._decoder import Decoder as Decoder, DecoderConfig as DecoderConfig, DecoderMoE as DecoderMoE, RoPE as RoPE
from jaxpar.models._decoder import KVCache as KVCache
from jaxpar.models._decoder import decoder_loss as decoder_loss
from jaxpar.models._gpt import GPT as GPT, GPTConfig as GPTConfig, MoESettings as MoESettings, lm_loss as lm_loss
from jaxpar.models._mlp import MLPClassifier as MLPClassifier, classifier_loss as classifier_loss

__all__ = ["GPT", "GPTConfig", "MoESettings", "lm_loss", "MLPClassifier", "classifier_loss", "Decoder", "DecoderConfig", "DecoderMoE",
           "KVCache", "RoPE", "decoder_loss"]
