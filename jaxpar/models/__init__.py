"""Flax NNX models annotated with logical axis names only."""
from jaxpar.models.decoder import Decoder as Decoder, DecoderConfig as DecoderConfig, DecoderMoE as DecoderMoE, RoPE as RoPE
from jaxpar.models.decoder import decoder_loss as decoder_loss
from jaxpar.models.gpt import GPT as GPT, GPTConfig as GPTConfig, lm_loss as lm_loss
from jaxpar.models.mlp import MLPClassifier as MLPClassifier, classifier_loss as classifier_loss

__all__ = ["GPT", "GPTConfig", "lm_loss", "MLPClassifier", "classifier_loss", "Decoder", "DecoderConfig", "DecoderMoE",
           "RoPE", "decoder_loss"]
