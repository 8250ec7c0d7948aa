"""Quantizing gradient codecs: QSGD, TernGrad, scaled sign (EF-SignSGD), 1-bit SGD, casts.

A codec is an optax-sized object made by a factory with keyword options. It maps a
block of rows ``f32[rows, K]`` (``K`` a multiple of ``codec.block``) to a *payload*, a
dict of arrays with the same leading row axis, and back:

* ``encode(x, key) -> payload`` (``key``: stochastic rounding; unused by deterministic codecs)
* ``decode(payload) -> f32[rows, K]``
* ``wire_bytes(n, replicas)``: bytes one device sends for a compressed mean of ``n``
  values over ``replicas`` devices (:mod:`jaxpar.parallel.compression._collective`: all-to-all, then all-gather)
* error-feedback residuals and momenta are the exchange's state
  (:meth:`~jaxpar.parallel.compression.ExchangePlan.init`)

Codes are packed: 4 ternary codes or 8 signs per byte; scales are fp32 per bucket.
The payload travels as one ``uint8`` buffer per row (:func:`~jaxpar.parallel.compression._bits.to_bytes`).

Example::

    >>> import jax, jax.numpy as jnp
    >>> codec = qsgd(levels=127, bucket=256)
    >>> x = jax.random.normal(jax.random.key(0), (1, 1024))
    >>> payload = codec.encode(x, jax.random.key(1))
    >>> payload["codes"].dtype, payload["norm"].shape       # int8 codes, one fp32 norm per bucket
    (dtype('int8'), (1, 4))
    >>> err = jnp.linalg.norm(codec.decode(payload) - x) / jnp.linalg.norm(x)
    >>> bool(err < 0.2)
    True
    >>> round(codec.wire_bytes(8 * 1024, 8) / (2 * 7 / 8 * 4 * 8 * 1024), 4)   # vs an fp32 ring all-reduce
    0.2539
    >>> round(sign().wire_bytes(8 * 1024, 8) / (2 * 7 / 8 * 4 * 8 * 1024), 4)   # 1 bit + a scale per 512
    0.0332
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.compression._base import BaseCodec, CompressionError, check_start
from jaxpar.parallel.compression._bits import pack_bits, payload_bytes, unpack_bits
from jaxpar.errors import int_problem, is_number


@dataclass(frozen=True)
class Codec(BaseCodec):
    """A quantizing codec (see the module docstring). ``block``: ``K`` must be a multiple of it."""

    name: str
    encode: Callable[[jax.Array, Any], dict]
    decode: Callable[[dict], jax.Array]
    block: int
    error_feedback: bool
    options: dict = field(default_factory=dict)
    kind: str = "quantize"
    momentum: float = 0.0    # > 0: the replica's momentum is what is compressed (dist-EF-SGDM)
    optimizer_momentum: float = 0.0   # > 0: Adam's first moment is what is compressed (1-bit Adam)
    start_step: int = 0      # steps before it: the exact (uncompressed) exchange

    def row_bytes(self, k: int) -> int:
        """Payload bytes of one row of ``k`` values.

        Args:
          k: values per row (a multiple of ``block``).

        Returns:
          The bytes.
        """
        shapes = jax.eval_shape(self.encode, jax.ShapeDtypeStruct((1, k), jnp.float32), jax.random.key(0))
        return payload_bytes(shapes)

    def padded(self, n: int, replicas: int) -> int:
        """``n`` rounded up to ``replicas`` rows of a multiple of ``block``.

        Args:
          n: the values exchanged.
          replicas: the devices the mean is over.

        Returns:
          The padded count.
        """
        return round_up(n, replicas * self.block)

    def wire_bytes(self, n: int, replicas: int) -> int:
        """Bytes one device sends for the mean of ``n`` values over ``replicas`` devices: an
        all-to-all of its ``replicas - 1`` foreign rows, then an all-gather of its own re-encoded
        row to the others.

        Args:
          n: the values exchanged.
          replicas: the devices the mean is over.

        Returns:
          The bytes.
        """
        return 2 * (replicas - 1) * self.row_bytes(self.padded(n, replicas) // replicas)


def round_up(x: int, unit: int) -> int:
    """``x`` rounded up to a multiple of ``unit``."""
    return -(-x // unit) * unit


def _buckets(x: jax.Array, bucket: int) -> jax.Array:
    return x.reshape(x.shape[0], x.shape[1] // bucket, bucket)


def _check_bucket(name: str, bucket: int) -> None:
    if int_problem(bucket, 8) or bucket % 8:
        raise CompressionError(f"{name}(bucket={bucket!r}): the bucket (values sharing one scale) must be an int, "
                               "a multiple of 8 and >= 8, e.g. bucket=512.")


def qsgd(*, levels: int = 127, bucket: int = 512, error_feedback: bool = False) -> Codec:
    """QSGD (Alistarh et al. 2017): per bucket the 2-norm, then ``|x| / norm * levels``
    stochastically rounded to an int8 code. Unbiased; variance at most
    ``min(b / s**2, sqrt(b) / s) * ||v||**2`` per bucket of ``b`` values.

    Args:
      levels: quantization levels ``s``, 1 ... 127.
      bucket: values per norm (``b``).
      error_feedback: keep each replica's compression error and add it to its next gradient.

    Returns:
      The :class:`Codec`.
    """
    if int_problem(levels, 1) or levels > 127:
        raise CompressionError(f"qsgd(levels={levels!r}): int8 codes hold 1 ... 127 levels; "
                               "use e.g. levels=127 (or 15 for 4-bit-like precision).")
    _check_bucket("qsgd", bucket)

    def encode(x, key):
        v = _buckets(x, bucket)
        norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
        u = jnp.abs(v) / jnp.where(norm > 0, norm, 1.0) * levels
        low = jnp.floor(u)
        q = low + (jax.random.uniform(key, v.shape, jnp.float32) < u - low)
        codes = (jnp.sign(v) * q).astype(jnp.int8).reshape(x.shape)
        return {"codes": codes, "norm": norm[..., 0]}

    def decode(p):
        codes = _buckets(p["codes"].astype(jnp.float32), bucket)
        return (codes * (p["norm"][..., None] / levels)).reshape(p["codes"].shape)

    return Codec("qsgd", encode, decode, bucket, error_feedback, {"levels": levels, "bucket": bucket})


def terngrad(*, bucket: int = 512, clip: float | None = 2.5, error_feedback: bool = False) -> Codec:
    """TernGrad (Wen et al. 2017): values clipped at ``clip`` standard deviations of their
    bucket (``None``: no clipping), then ``scale * t`` with ``t`` in {-1, 0, +1} drawn so that
    the mean is the (clipped) value; 2-bit codes packed 4 per byte, one fp32 scale per bucket.

    Args:
      bucket: values per scale.
      clip: the clip in standard deviations, or ``None``.
      error_feedback: keep each replica's compression error and add it to its next gradient.

    Returns:
      The :class:`Codec`.
    """
    _check_bucket("terngrad", bucket)
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise CompressionError(f"terngrad(clip={clip!r}): the clip is a positive number of standard "
                               "deviations (2.5 in the paper), or None.")

    def encode(x, key):
        v = _buckets(x, bucket)
        if clip is not None:
            c = clip * jnp.std(v, axis=-1, keepdims=True)
            v = jnp.clip(v, -c, c)
        scale = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
        keep = jax.random.uniform(key, v.shape, jnp.float32) < jnp.abs(v) / jnp.where(scale > 0, scale, 1.0)
        t = (jnp.sign(v) * keep + 1).astype(jnp.uint8).reshape(x.shape)     # 0, 1, 2
        return {"codes": pack_bits(t, 2), "scale": scale[..., 0]}

    def decode(p):
        k = p["codes"].shape[1] * 4
        t = unpack_bits(p["codes"], 2, k).astype(jnp.float32) - 1.0
        return (_buckets(t, bucket) * p["scale"][..., None]).reshape(t.shape)

    return Codec("terngrad", encode, decode, bucket, error_feedback, {"bucket": bucket, "clip": clip})


def _signs(x):
    return pack_bits((x >= 0).astype(jnp.uint8), 1)


def _unsigns(packed):
    return unpack_bits(packed, 1, packed.shape[1] * 8)


def _one_bit(name: str, encode: Callable, decode: Callable, bucket: int, error_feedback: bool, momentum,
             optimizer_momentum, start_step) -> Codec:
    """The :class:`Codec` of :func:`sign` or :func:`onebit`, its options checked."""
    _check_bucket(name, bucket)
    if not is_number(momentum) or not 0 <= momentum < 1:
        raise CompressionError(f"{name}(momentum={momentum!r}): the momentum compressed in place of the gradient "
                               "must lie in [0, 1), e.g. momentum=0.9 with a momentum-free optimizer (SGD), or 0.")
    momentum = float(momentum)
    start_step, optimizer_momentum = check_start(name, start_step, optimizer_momentum, momentum)
    options = {"bucket": bucket, "momentum": momentum, "optimizer_momentum": optimizer_momentum,
               "start_step": start_step}
    return Codec(name, encode, decode, bucket, error_feedback, options, momentum=momentum,
                 optimizer_momentum=optimizer_momentum, start_step=start_step)


def sign(*, bucket: int = 512, error_feedback: bool = True, momentum: float = 0.0,
         optimizer_momentum: float | None = None, start_step: int = 0) -> Codec:
    """Scaled sign (EF-SignSGD, Karimireddy et al. 2019): ``sign(v) * ||v||_1 / b`` per bucket of
    ``b`` values, signs packed 8 per byte. Biased: use it with error feedback (the default).

    Args:
      bucket: values per scale (``b``).
      error_feedback: keep each replica's compression error and add it to its next gradient.
      momentum: ``m > 0``: each replica compresses its momentum ``u = m u + g`` instead of ``g``
        (dist-EF-SGDM, Zheng et al. 2019); use it with plain SGD (no optimizer momentum).
      optimizer_momentum: ``b1`` (1-bit Adam, Tang et al. 2021): each replica compresses Adam's first
        moment ``b1 m + (1 - b1) g`` (``m``: the last exchanged one), from ``start_step`` on; use it with
        :func:`jaxpar.optimizers.adamw_frozen_variance` (``freeze_step=start_step``) and no clipping
        after the exchange (``Strategy(local_clip=...)`` instead). ``None``: not.
      start_step: exact (uncompressed) steps before compression.

    Returns:
      The :class:`Codec`.
    """
    def encode(x, key):
        v = _buckets(x, bucket)
        return {"signs": _signs(x), "scale": jnp.mean(jnp.abs(v), axis=-1)}

    def decode(p):
        s = _unsigns(p["signs"]).astype(jnp.float32) * 2.0 - 1.0
        return (_buckets(s, bucket) * p["scale"][..., None]).reshape(s.shape)

    return _one_bit("sign", encode, decode, bucket, error_feedback, momentum, optimizer_momentum, start_step)


def onebit(*, bucket: int = 512, error_feedback: bool = True, momentum: float = 0.0,
           optimizer_momentum: float | None = None, start_step: int = 0) -> Codec:
    """1-bit SGD (Seide et al. 2014): one bit per value (``v >= 0``), decoded as the mean of
    the bucket's non-negative or of its negative values (two fp32 per bucket), with error feedback.

    Args:
      bucket: values per pair of means.
      error_feedback: keep each replica's compression error and add it to its next gradient.
      momentum, optimizer_momentum, start_step: as for :func:`sign`.

    Returns:
      The :class:`Codec`.
    """
    def encode(x, key):
        v = _buckets(x, bucket)
        pos = v >= 0
        n_pos = jnp.sum(pos, axis=-1)
        hi = jnp.sum(jnp.where(pos, v, 0.0), axis=-1) / jnp.maximum(n_pos, 1)
        lo = jnp.sum(jnp.where(pos, 0.0, v), axis=-1) / jnp.maximum(bucket - n_pos, 1)
        return {"signs": _signs(x), "hi": hi, "lo": lo}

    def decode(p):
        b = _buckets(_unsigns(p["signs"]), bucket) > 0
        return jnp.where(b, p["hi"][..., None], p["lo"][..., None]).reshape(b.shape[0], -1)

    return _one_bit("onebit", encode, decode, bucket, error_feedback, momentum, optimizer_momentum, start_step)


_CASTS = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float8_e4m3fn": jnp.float8_e4m3fn,
          "float8_e5m2": jnp.float8_e5m2}


def cast(dtype: str = "bfloat16", *, bucket: int = 512, error_feedback: bool = False) -> Codec:
    """Values cast to a narrower float (round to nearest). 8-bit floats are scaled per bucket
    so that the bucket's largest magnitude maps to the format's largest finite value.

    Args:
      dtype: ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``.
      bucket: values per scale (8-bit floats).
      error_feedback: keep each replica's compression error and add it to its next gradient.

    Returns:
      The :class:`Codec`.
    """
    if dtype not in _CASTS:
        raise CompressionError(f"cast(dtype={dtype!r}): choose one of {tuple(_CASTS)}.")
    _check_bucket("cast", bucket)
    target = _CASTS[dtype]
    scaled = jnp.dtype(target).itemsize == 1
    top = float(jnp.finfo(target).max)

    def encode(x, key):
        if not scaled:
            return {"values": x.astype(target)}
        v = _buckets(x, bucket)
        scale = jnp.max(jnp.abs(v), axis=-1, keepdims=True) / top
        q = (v / jnp.where(scale > 0, scale, 1.0)).astype(target).reshape(x.shape)
        return {"values": q, "scale": scale[..., 0]}

    def decode(p):
        v = p["values"].astype(jnp.float32)
        if not scaled:
            return v
        return (_buckets(v, bucket) * p["scale"][..., None]).reshape(v.shape)

    return Codec(f"cast-{dtype}", encode, decode, bucket, error_feedback, {"dtype": dtype, "bucket": bucket})
