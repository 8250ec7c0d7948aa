"""Compressed gradient exchange over the data axes: codecs and the collectives that carry them.

Declare it on the strategy: ``Strategy(compression=jaxpar.parallel.compression.powersgd(rank=4))``
(or ``parallel.compression: {kind: powersgd, rank: 4}`` in YAML).
"""
import inspect

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
    >>> make_codec("topk", ratoi=0.01)
    Traceback (most recent call last):
    ...
    jaxpar.errors.CompressionError: compression kind='topk': needs ratio; unknown ratoi. It takes ratio, momentum, \
warmup, warmup_steps, optimizer_momentum, start_step, partitioned, precondition \
(help(jaxpar.parallel.compression.topk)).
    """
    if kind not in CODECS:
        raise CompressionError(f"compression kind={kind!r}: choose one of {tuple(CODECS)}.")
    params = inspect.signature(CODECS[kind]).parameters
    missing = [name for name, p in params.items() if p.default is p.empty and name not in options]
    if (unknown := sorted(set(options) - set(params))) or missing:
        said = [f"needs {', '.join(missing)}"] * bool(missing) + [f"unknown {', '.join(unknown)}"] * bool(unknown)
        raise CompressionError(f"compression kind={kind!r}: {'; '.join(said)}. It takes {', '.join(params)} "
                               f"(help(jaxpar.parallel.compression.{kind})).")
    return CODECS[kind](**options)
