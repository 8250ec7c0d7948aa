"""Which kernel runs whole-sequence attention: cuDNN's flash attention, a Pallas (Triton) flash kernel,
or XLA's unfused path, and the call of the fused ones on the local shards.

:func:`use_attention_kernel` sets the choice (``"auto"`` by default); :func:`choose_kernel` applies it to
one call's masks, dtype and platform. ``auto`` keeps XLA's path on the CPU and TPU. On a GPU it takes
cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) for causal or full masks, with or without
a static causal window, where a GPU is attached; else a Pallas kernel: JAX's
(``jax.experimental.pallas.ops.gpu.attention.mha``) for causal or full masks and packed sequences (segment
ids), and jaxpar's flash block kernel (:mod:`jaxpar.parallel.context._flash`, at offset 0) for a soft-cap,
a sliding window (static or traced, one- or two-sided) and lengths JAX's blocks do not divide. Both also
run every mask they support when the program is compiled without a GPU (``jaxpar inspect --target``:
JAX's cuDNN lowering asks a local GPU for its version). What no kernel covers (explicit positions or a KV
cache, fp32 under ``auto``, odd head dims or lengths) runs XLA's path, and an
:class:`AttentionFallbackWarning` names the reason once. docs/strategies.md has the table and
docs/benchmarks.md the measured times.

A fused kernel is a custom call, which GSPMD cannot split. Under :func:`jaxpar.use_rules` it runs in a
``shard_map`` manual over the axes that split q/k/v (the batch and the heads), on each device's shard.

Example::

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    >>> choose_kernel(q, q, causal=True, segments=False, positions=False, window=None, softcap=None,
    ...               platform="cpu", setting="auto")
    ('xla', None)
    >>> choose_kernel(q, q, causal=True, segments=True, positions=False, window=None, softcap=None,
    ...               platform="gpu", setting="auto", local_gpu=True)
    ('pallas', None)
    >>> choose_kernel(q, q, causal=True, segments=False, positions=False, window=None, softcap=30.0,
    ...               platform="gpu", setting="auto", local_gpu=True), pallas_kernel(q, None, 30.0)
    (('pallas', None), 'flash')
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from typing import Any, ContextManager, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxpar.adapters._blocks import ATTENTION_RESIDUALS
from jaxpar.errors import AttentionError
from jaxpar.parallel._regions import keep_axes, region_axes, region_spec
from jaxpar.parallel.context import flash_attention, flash_tile, fused_ring_problem
from jaxpar.rules import axes_of, current_rules, logical_to_spec, manual_axes, scoped, scoped_kernel, shard_map_mesh

#: The settings of :func:`use_attention_kernel`.
KERNELS = ("auto", "cudnn", "pallas", "xla")
#: The dtypes ``auto`` fuses (fp32 runs XLA's path; ``use_attention_kernel("pallas")`` runs it in Pallas).
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
#: The Pallas kernel's blocks along the sequence (``BlockSizes``: forward, then both backward kernels).
PALLAS_BLOCKS = dict(block_q=128, block_k=128, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

_SETTING: contextvars.ContextVar = contextvars.ContextVar("jaxpar_attention_kernel", default="auto")


class AttentionFallbackWarning(UserWarning):
    """On a GPU, an attention ran XLA's unfused path (``[length, length]`` scores in memory): the message
    names the mask or dtype that no fused kernel covers."""


@contextlib.contextmanager
def use_attention_kernel(kernel: str = "auto") -> Iterator[str]:
    """Run :func:`jaxpar.attention.attention` with ``kernel`` inside this block.

    Read when a function is traced, like :func:`jaxpar.use_rules`. JAX keeps traces (``jax.checkpoint``'s
    among them) by function, not by this setting, so a block that changes it clears JAX's caches on entry
    and on exit (``jax.clear_caches``): what is traced inside runs ``kernel``, and what runs after it is
    traced anew.

    Args:
      kernel: one of :data:`KERNELS`. ``"cudnn"`` and ``"pallas"`` raise :class:`AttentionError` on a call
        they cannot run; ``"pallas"`` off a GPU runs the kernel in Pallas's interpreter (slow: for tests).

    Yields:
      ``kernel``.

    Raises:
      AttentionError: ``kernel`` is not one of :data:`KERNELS`.
    """
    if kernel not in KERNELS:
        raise AttentionError(f"use_attention_kernel: kernel={kernel!r} is not an attention kernel; choose one of "
                             f"{KERNELS} ('auto': cuDNN or Pallas on a GPU where they apply, XLA elsewhere).")
    with scoped_kernel(_SETTING, kernel):
        yield kernel


_COUNTS: contextvars.ContextVar = contextvars.ContextVar("jaxpar_attention_counts", default=None)


def count_attention_kernels() -> ContextManager[dict]:
    """Count the kernels the attentions traced inside this block get: ``{"cudnn" | "pallas" | "xla": calls}``,
    and under ``"why"`` the reasons of those that run XLA's path on a GPU. A layer body that ``lax.scan``
    runs is traced once, so it counts once."""
    return scoped(_COUNTS, {})


def current_attention_kernel() -> str:
    """The setting of the innermost :func:`use_attention_kernel` block, or ``"auto"``."""
    return _SETTING.get()


def choose_kernel(q, k, *, causal: bool, segments: bool, positions: bool, window: Any, softcap: float | None,
                  platform: str, setting: str, local_gpu: bool | None = None) -> tuple[str, str | None]:
    """The kernel for one attention call, and why it is not fused (``None`` when it is, or off a GPU).

    Args:
      q, k: the queries ``[b, t, heads, d]`` and keys ``[b, t, kv_heads, d]`` (shapes and dtypes).
      causal: the causal mask.
      segments: segment ids are given.
      positions: explicit positions, or keys other than the queries (a context-parallel block, a KV cache).
      window: the sliding window (int, traced int32 array or ``None``).
      softcap: the logit soft-cap, or ``None``.
      platform: the platform the program is compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``, ...).
      setting: one of :data:`KERNELS`.
      local_gpu: a GPU is attached (cuDNN can lower); ``None`` asks JAX.

    Returns:
      ``(kernel, reason)``: ``kernel`` in ``("cudnn", "pallas", "xla")``.

    Raises:
      AttentionError: ``setting`` names a fused kernel that cannot run this call.
    """
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if setting == "xla" or (setting == "auto" and not on_gpu):
        return "xla", None
    if local_gpu is None:
        local_gpu = on_gpu and jax.default_backend() == "gpu"
    why = {k_: _unsupported(k_, q, k, causal, segments, positions, window, softcap, platform, local_gpu)
           for k_ in ("cudnn", "pallas")}
    if setting != "auto":
        if why[setting]:
            raise AttentionError(f"attention: use_attention_kernel({setting!r}) cannot run this call: {why[setting]}. "
                                 "Fix: use_attention_kernel('auto') (XLA's path where no fused kernel applies).")
        return setting, None
    if q.dtype not in FUSED_DTYPES:          # Pallas runs fp32 when asked; auto keeps XLA's fp32 arithmetic
        return "xla", f"{q.dtype} q/k/v (the fused kernels run bfloat16 or float16)"
    order = ("pallas", "cudnn") if segments or not local_gpu else ("cudnn", "pallas")
    for kernel in order:
        if not why[kernel]:
            return kernel, None
    return "xla", f"cuDNN: {why['cudnn']}; Pallas: {why['pallas']}"


def _unsupported(kernel, q, k, causal, segments, positions, window, softcap, platform, local_gpu) -> str | None:
    """Why ``kernel`` cannot run this call, or ``None``."""
    d = q.shape[-1]
    if positions:
        return "explicit positions or a block of keys (a context-parallel block, a KV cache)"
    if kernel == "pallas":
        return _pallas_problem(q, window, softcap)
    if softcap is not None:
        return f"a soft-cap ({softcap}) on the scores"
    if q.dtype not in FUSED_DTYPES:
        return f"{q.dtype} q/k/v (cuDNN takes bfloat16 or float16)"
    if not local_gpu or platform == "rocm":
        return "no local NVIDIA GPU (JAX's cuDNN lowering asks the attached GPU for its version)"
    if segments:
        return "segment ids (cuDNN's packed layout takes offsets, not ids)"
    if window is not None and not (causal and isinstance(window, int)):
        return "a traced or two-sided window"
    if d % 8 or d > 128:
        return f"head_dim {d} (cuDNN: a multiple of 8, at most 128)"
    return None


def _mha_takes(q) -> bool:
    """JAX's Pallas kernel (``mha``) takes q's shape: head_dim a power of 2 of at least 16, and its forward and
    backward blocks (:data:`PALLAS_BLOCKS`) divide the length."""
    d, t = q.shape[-1], q.shape[1]
    blocks = (min(PALLAS_BLOCKS["block_q"], t), min(PALLAS_BLOCKS["block_q_dkv"], t))
    return not d & (d - 1) and d >= 16 and all(t % block == 0 for block in blocks)


def pallas_kernel(q, window: Any, softcap: float | None) -> str:
    """Which Pallas kernel ``"pallas"`` runs: ``"mha"`` (JAX's) where it applies (no window, no soft-cap,
    its blocks divide the length), else ``"flash"`` (jaxpar's flash block kernel at offset 0)."""
    return "mha" if window is None and softcap is None and _mha_takes(q) else "flash"


def _pallas_problem(q, window, softcap) -> str | None:
    """Why neither Pallas kernel can run this call (its head_dim or length), or ``None``."""
    if pallas_kernel(q, window, softcap) == "mha":
        return None
    return flash_tile(q.shape[1], q.shape[-1])


def kernel_for(q, k, *, causal: bool, segments: bool, positions: bool, window: Any,
               softcap: float | None) -> str:
    """:func:`choose_kernel` under the current setting, platform and rules; warns where a GPU runs XLA's path.

    Args:
      q, k, causal, segments, positions, window, softcap: as for :func:`choose_kernel`.

    Returns:
      ``"cudnn"``, ``"pallas"`` or ``"xla"``.

    Raises:
      AttentionError: the setting names a fused kernel that cannot run this call.
    """
    setting, platform = current_attention_kernel(), _platform()
    kernel, why = choose_kernel(q, k, causal=causal, segments=segments, positions=positions, window=window,
                                softcap=softcap, platform=platform, setting=setting)
    if kernel != "xla" and (split := _split_problem(q, k)):
        if setting != "auto":
            raise AttentionError(f"attention: use_attention_kernel({setting!r}) cannot run this call: {split}.")
        kernel, why = "xla", split
    _note(kernel, why)
    return kernel


def context_kernel(q, k, *, method: str, chunk: int) -> tuple[str, bool]:
    """The kernel of a ring or all-gather attention's blocks under the current setting and platform, counted
    and warned about like :func:`kernel_for`: ``"pallas"`` (the flash block kernel,
    :mod:`jaxpar.parallel.context._flash`) or ``"xla"`` (einsums and an online softmax).

    ``auto`` fuses bfloat16 and float16 on a GPU; ``"pallas"`` fuses any dtype (off a GPU in Pallas's
    interpreter); ``"xla"`` never fuses.

    Args:
      q, k: the local queries and keys (shapes and dtypes).
      method: ``"ring"`` or ``"all_gather"`` (whose XLA path is :func:`kernel_for`'s, counted there).
      chunk: the length of one query block (a shard, half of it balanced).

    Returns:
      ``(kernel, interpret)``: ``interpret`` when the program is not compiled for a GPU.

    Raises:
      AttentionError: the setting is ``"cudnn"``, or ``"pallas"`` and the kernel cannot run this call.
    """
    setting, platform = current_attention_kernel(), _platform()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if setting == "cudnn":
        raise AttentionError("attention: use_attention_kernel('cudnn') cannot run a ring or all-gather context-"
                             "parallel attention (cuDNN returns no block statistics). Fix: 'auto' or 'pallas' (the "
                             "flash block kernel), or use_context_parallel('ulysses').")
    why = None
    if setting == "auto" and q.dtype not in FUSED_DTYPES:
        why = f"{q.dtype} q/k/v (the fused kernels run bfloat16 or float16)"
    why = why or fused_ring_problem("pallas", chunk, q.shape[-1])
    if setting == "pallas" and why:
        raise AttentionError(f"attention: use_attention_kernel('pallas') cannot run this context-parallel call: "
                             f"{why}. Fix: use_attention_kernel('auto').")
    if setting == "xla" or (setting == "auto" and not on_gpu):
        kernel, why = "xla", None
    else:
        kernel = "xla" if why else "pallas"
    if kernel == "pallas" or method == "ring":
        _note(kernel, why)
    return kernel, not on_gpu


def _note(kernel: str, why: str | None) -> None:
    """Count ``kernel`` in :func:`count_attention_kernels` and warn when a GPU runs XLA's path."""
    if (counts := _COUNTS.get()) is not None:
        counts[kernel] = counts.get(kernel, 0) + 1
        if why:
            counts.setdefault("why", []).append(why)
    if why:
        warnings.warn(f"attention on a GPU runs XLA's unfused path ([length, length] scores in memory): {why}. "
                      "jaxpar.attention.use_attention_kernel and docs/strategies.md say which masks fuse.",
                      AttentionFallbackWarning, stacklevel=4)


def _platform() -> str:
    """The platform of the mesh of :func:`jaxpar.use_rules` (a deviceless target's too), else JAX's default."""
    ctx = current_rules()
    devices = getattr(ctx[0], "devices", None) if ctx is not None else None
    if devices is not None and getattr(devices, "size", 0):
        return devices.flat[0].platform
    return jax.default_backend()


def _local_spec(q) -> tuple[Any, PartitionSpec, set[str]] | None:
    """``(mesh, q's spec, the axes to make manual)`` under the rules, or ``None`` where q is whole here."""
    ctx = current_rules()
    if ctx is None:
        return None
    mesh, rules = ctx
    sizes = dict(mesh.shape)
    q_spec = logical_to_spec(("batch", "length", "heads", None), rules, mesh, shape=q.shape, what="attention: q")
    split = {a for e in q_spec for a in axes_of(e) if sizes[a] > 1} - manual_axes()
    return (mesh, q_spec, split) if split else None


def _split_problem(q, k) -> str | None:
    """Why the fused kernels cannot run on the shards the rules make of q/k/v, or ``None``."""
    local = _local_spec(q)
    if local is None:
        return None
    mesh, q_spec, _ = local
    sizes = dict(mesh.shape)
    if axes_of(q_spec[1]):
        return f"the rules split the sequence of q ({q_spec})"
    heads = math.prod(sizes[a] for a in axes_of(q_spec[2]))
    if k.shape[2] % heads:
        return f"the rules split the heads {heads} ways, which does not divide the {k.shape[2]} K/V heads"
    return None


def fused_attention(kernel: str, q, k, v, *, causal: bool, scale: float, segment_ids=None, window: Any = None,
                    softcap: float | None = None) -> jax.Array:
    """Attention by a fused ``kernel`` (``"cudnn"`` or ``"pallas"``), on each device's shard under the rules.

    Args:
      kernel: ``"cudnn"`` or ``"pallas"`` (as :func:`kernel_for` returned it).
      q: ``[batch, length, heads, head_dim]``.
      k, v: ``[batch, length, kv_heads, head_dim]``.
      causal: the causal mask.
      scale: the score scale.
      segment_ids: ``[batch, length]`` int ids, or ``None``.
      window: the sliding window (a Python int or a traced int32 scalar), or ``None``.
      softcap: the logit soft-cap, or ``None``.

    Returns:
      ``[batch, length, heads, head_dim]``.
    """
    static = window is None or isinstance(window, int)      # a traced window is an input of the kernel
    call = _saveable(functools.partial(_CALLS[kernel], causal=causal, scale=scale, softcap=softcap,
                                       window=window if static else None))
    traced = None if static else window                     # None segment ids or window: no input of the call
    local = _local_spec(q)
    if local is None:
        return call(q, k, v, segment_ids, traced)
    mesh, q_spec, split = local
    manual = region_axes(mesh, split)
    q_spec = keep_axes(q_spec, manual)
    qkv, seg = region_spec(q_spec, 4, mesh, manual), region_spec(PartitionSpec(q_spec[0], None), 2, mesh, manual)
    return jax.shard_map(call, mesh=shard_map_mesh(mesh), in_specs=(qkv, qkv, qkv, seg, PartitionSpec()),
                         out_specs=q_spec, axis_names=manual, check_vma=False)(q, k, v, segment_ids, traced)


def _saveable(call):
    """``call(q, k, v, seg, window)`` whose output and residuals carry the name :data:`ATTENTION_RESIDUALS`:
    under a remat policy that saves it (``save-matmuls``) the kernel's forward is not run again in the
    backward. ``seg`` and ``window`` (a traced one, or ``None``) take no gradient."""
    @jax.custom_vjp
    def run(q, k, v, seg, window):
        return call(q, k, v, seg, window)

    def forward(q, k, v, seg, window):
        out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, seg, window), q, k, v)
        return out, (jax.tree.map(lambda r: checkpoint_name(r, ATTENTION_RESIDUALS), vjp), seg, window)

    def backward(res, g):
        vjp, *ints = res
        return (*vjp(g), *(None if x is None else np.zeros(x.shape, jax.dtypes.float0) for x in ints))
    run.defvjp(forward, backward)
    return lambda q, k, v, seg, window: checkpoint_name(run(q, k, v, seg, window), ATTENTION_RESIDUALS)


def _cudnn(q, k, v, seg, traced, *, causal, scale, window, softcap):
    del seg, traced, softcap                     # choose_kernel sends these to Pallas
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=local,
                                        implementation="cudnn")


def _pallas(q, k, v, seg, traced, *, causal, scale, window, softcap):
    """JAX's ``mha`` where it applies, else jaxpar's flash block kernel (:func:`pallas_kernel`)."""
    window = window if traced is None else traced
    if pallas_kernel(q, window, softcap) == "flash":
        return _flash(q, k, v, seg, causal=causal, scale=scale, window=window, softcap=softcap)
    return _mha(q, k, v, seg, causal=causal, scale=scale)


def _mha(q, k, v, seg, *, causal, scale):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    group = q.shape[2] // k.shape[2]
    if group > 1:                                # GQA: each query head's K/V head, repeated
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    t = q.shape[1]
    blocks = pallas_attention.BlockSizes(**{name: min(b, t) for name, b in PALLAS_BLOCKS.items()})
    seg = None if seg is None else seg.astype(jnp.int32)
    return pallas_attention.mha(q, k, v, seg, sm_scale=scale, causal=causal, block_sizes=blocks,
                                interpret=_platform() == "cpu")


def _flash(q, k, v, seg, *, causal, scale, window, softcap):
    """The flash block kernel over the whole sequence (queries at offset 0; GQA and segment ids its own)."""
    return flash_attention(q, k, v, seg, seg, 0, window, causal, scale, softcap, _platform() == "cpu")


_CALLS = {"cudnn": _cudnn, "pallas": _pallas}
