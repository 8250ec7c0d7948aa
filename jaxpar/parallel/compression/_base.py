"""What every gradient codec of :mod:`jaxpar.parallel.compression` shares: the base class
:class:`BaseCodec`, :class:`CompressionError`, and the check of the 1-bit Adam options
(``start_step``, ``optimizer_momentum``) that several codecs take.

There are three codec families, each a frozen dataclass made by a factory with keyword
options: quantizers (:class:`~jaxpar.parallel.compression.Codec`), sparsifiers
(:class:`~jaxpar.parallel.compression.Sparsifier`) and PowerSGD
(:class:`~jaxpar.parallel.compression.PowerSGD`). :class:`BaseCodec` gives each family the
defaults of the options it does not have, so the exchange
(:mod:`jaxpar.parallel.compression._collective`) reads them from any codec.

Example::

    >>> from jaxpar.parallel.compression import powersgd, qsgd
    >>> check_codec(qsgd()).name, powersgd().momentum, qsgd().seed
    ('qsgd', 0.0, 0)
    >>> check_codec("qsgd")
    Traceback (most recent call last):
    ...
    jaxpar.errors.CompressionError: compression='qsgd': expected a codec made by jaxpar.parallel.compression ...
"""
from __future__ import annotations

from typing import Any
from jaxpar.errors import CompressionError, check_int, is_number


class BaseCodec:
    """Base class of jaxpar's codecs. Every codec has a ``name``, a ``kind`` (``"quantize"``,
    ``"sparse"`` or ``"lowrank"``) and ``error_feedback``; the class attributes below are the
    defaults of the families whose fields do not set them (a subclass's dataclass field that
    shares a name with one of them needs its own default)."""

    momentum = 0.0             # > 0: the replica's momentum is what is compressed
    optimizer_momentum = 0.0   # > 0: Adam's first moment is what is compressed (1-bit Adam)
    precondition = 0.0         # > 0 (Adam's b2): top-k ranks entries by Adam's frozen second moment
    start_step = 0             # steps before it: the exact (uncompressed) exchange
    seed = 0                   # of the codec's random draws


def check_codec(codec: Any) -> Any:
    """Checks that ``codec`` is one of jaxpar's codecs.

    Args:
        codec: the value of ``Strategy(compression=...)``.

    Returns:
        ``codec`` itself.

    Raises:
        CompressionError: ``codec`` was not made by a factory of :mod:`jaxpar.parallel.compression`.
    """
    if not isinstance(codec, BaseCodec):
        raise CompressionError(f"compression={codec!r}: expected a codec made by jaxpar.parallel.compression "
                               "(qsgd, terngrad, sign, onebit, cast, topk, randomk, powersgd) or None.")
    return codec


def check_start(name: str, start_step, optimizer_momentum, momentum: float) -> tuple[int, float]:
    """Checks the exact start and 1-bit Adam's option of codec factory ``name``.

    Args:
        name: the factory, for the error messages.
        start_step: exact (uncompressed) steps before compression starts, an int >= 0.
        optimizer_momentum: Adam's b1 whose first moment is compressed, in (0, 1); ``None`` or
            0 for none. It needs ``start_step >= 1`` and no ``momentum``.
        momentum: the codec's own (already checked) replica momentum.

    Returns:
        ``(start_step, optimizer_momentum)``, the latter a float (0.0 for none).

    Raises:
        CompressionError: an option is out of range or the combination cannot work.
    """
    check_int(name, "start_step", start_step, 0, CompressionError)
    if optimizer_momentum is None or optimizer_momentum == 0:
        return start_step, 0.0
    if not is_number(optimizer_momentum) or not 0 < optimizer_momentum < 1:
        raise CompressionError(f"{name}(optimizer_momentum={optimizer_momentum!r}): Adam's b1, whose first moment "
                               "is compressed (1-bit Adam), must lie in (0, 1), e.g. optimizer_momentum=0.9.")
    if momentum:
        raise CompressionError(f"{name}(momentum={momentum}, optimizer_momentum={optimizer_momentum}): choose one: "
                               "momentum compresses each replica's own momentum (for plain SGD), "
                               "optimizer_momentum Adam's shared first moment (1-bit Adam).")
    if start_step < 1:
        raise CompressionError(f"{name}(optimizer_momentum={optimizer_momentum}, start_step={start_step}): 1-bit "
                               "Adam freezes Adam's second moment when compression starts, so it needs exact "
                               "warm-up steps first; use e.g. start_step = 15-25% of the steps.")
    return start_step, float(optimizer_momentum)
