"""Flax NNX models annotated with logical axis names only."""
from .decoder import Decoder as Decoder, DecoderConfig as DecoderConfig, DecoderMoE as DecoderMoE, RoPE as RoPE
from .decoder import decoder_loss as decoder_loss
from .gpt import GPT as GPT, GPTConfig as GPTConfig, lm_loss as lm_loss
from .mlp import MLPClassifier as MLPClassifier, classifier_loss as classifier_loss

__all__ = ["GPT", "GPTConfig", "lm_loss", "MLPClassifier", "classifier_loss", "Decoder", "DecoderConfig", "DecoderMoE",
           "RoPE", "decoder_loss"]
