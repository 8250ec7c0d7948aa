"""Compressed gradient exchange over the data axes: codecs and the collectives that carry them.

Declare it on the strategy: ``Strategy(compression=jaxpar.parallel.compression.powersgd(rank=4))``
(or ``parallel.compression: {kind: powersgd, rank: 4}`` in YAML).
"""
from jaxpar.parallel.compression._base import BaseCodec, CompressionError, check_codec
from jaxpar.parallel.compression._codecs import Codec, cast, onebit, qsgd, sign, terngrad
from jaxpar.parallel.compression._collective import ExchangePlan, exchange_plan
from jaxpar.parallel.compression._powersgd import PowerSGD, powersgd
from jaxpar.parallel.compression._sparse import Sparsifier, randomk, topk

__all__ = ["BaseCodec", "Codec", "CompressionError", "qsgd", "terngrad", "sign", "onebit", "cast", "topk",
           "randomk", "powersgd", "Sparsifier", "PowerSGD", "ExchangePlan", "exchange_plan", "check_codec",
           "make_codec", "CODECS"]

CODECS = {"qsgd": qsgd, "terngrad": terngrad, "sign": sign, "onebit": onebit, "cast": cast, "topk": topk,
          "randomk": randomk, "powersgd": powersgd}


def make_codec(kind: str, **options):
    """A codec by name (``kind``) with keyword options, as in YAML's ``parallel.compression``.

    Args:
      kind: a key of :data:`CODECS`.
      **options: the factory's keyword options.

    Returns:
      The codec.

    >>> make_codec("powersgd", rank=2).rank
    2
    """
    if kind not in CODECS:
        raise CompressionError(f"compression kind={kind!r}: choose one of {tuple(CODECS)}.")
    try:
        return CODECS[kind](**options)
    except TypeError as e:
        raise CompressionError(f"compression kind={kind!r}: {e}. See help(jaxpar.parallel.compression.{kind}).") from None
