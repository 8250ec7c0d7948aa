"""Grouped expert GEMMs for GPUs: the routed experts' GEMMs as one Pallas Triton kernel each, over the sorted
rows, in place of :mod:`jaxpar.parallel.moe._dispatch`'s loop of one small GEMM per tile.

**The layout.** The dispatch sorts a device's choices by expert and cuts each expert's run of rows into tiles
of ``tile`` rows (its tile table: each tile's expert, first row and its expert's end; ``used`` tiles of a static
bound ``T``). Here tile ``t`` is laid out at rows ``t·tile .. (t+1)·tile`` of a *padded* array ``[T·tile, .]``:
the rows past its expert's end and every row of an unused tile are zeros. Each tile then belongs to one
expert, and every block a kernel reads is aligned. The tile table lives on the device (:class:`Groups`):

- :func:`grouped_matmul` ``Y[tile] = X[tile] @ W[expert(tile)]`` (``W^T`` with ``transpose``: the input
  gradient), a grid of tiles x column blocks, each reading its expert from the table and slicing ``W`` there;
  unused tiles write zeros;
- :func:`grouped_weight_grad` ``dW[e] = sum over e's tiles of X[tile]^T @ G[tile]``, a grid of experts x row
  blocks x column blocks, each looping over its expert's tiles (contiguous in the sorted layout; an expert
  with none gets zeros).

Inputs in bf16 or fp32, fp32 accumulation. :func:`grouped_mlp_forward` and :func:`grouped_mlp_backward` run
a routed expert MLP (plain ``act(x w1) w2`` or gated ``(act(x w1) * (x w3)) w2``) on the padded rows with
them: 2 or 3 calls forward, 4 or 6 backward. The Triton backend compiles without a GPU (``jaxpar inspect
--target``); ``interpret=True`` runs the kernels in Pallas's interpreter (the CPU's exactness tests against
the tile loop, tests/test_moe_grouped.py).

**Which runs** (:func:`use_moe_kernel`, :func:`choose_moe_kernel`): ``auto`` runs these kernels on a GPU
mesh (Pallas Triton, compiled deviceless for A100 sm80, H100/H200 sm90 and B200 sm100) and the tile loop
on the CPU and TPU;
``"grouped"`` runs them anywhere (off a GPU in the interpreter: slow, for tests), ``"loop"`` the tile loop.

>>> import jax.numpy as jnp
>>> x = jnp.ones((32, 16)); w = jnp.stack([jnp.eye(16), 2 * jnp.eye(16)])
>>> groups = Groups.of(jnp.array([0, 1]), jnp.int32(2), experts=2)     # tile 0: expert 0, tile 1: expert 1
>>> y = grouped_matmul(x, w, groups, tile=16, interpret=True)
>>> y[0, 0].tolist(), y[16, 0].tolist()
(1.0, 2.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.errors import MoEError
from jaxpar.rules import scoped_kernel

_F32 = jnp.float32
#: The largest column block (``N``), contraction block (``K``) and weight-gradient block (``K x N`` of
#: ``dW``) by the inputs' bytes per element; each block is the largest power of 2 at most this that divides
#: the dimension (at least :data:`SMALLEST_BLOCK`). fp32 halves them to fit a stage in shared memory.
BLOCKS = {2: dict(n=128, k=64, wgrad=128), 4: dict(n=128, k=32, wgrad=64)}
#: Triton's smallest dot dimension: a tile, a column and a contraction block are at least this.
SMALLEST_BLOCK = 16
#: The largest tile (the kernels' row block): a weight-gradient stage holds two ``[tile, block]`` inputs.
LARGEST_TILE = 128
#: Triton's launch settings by the inputs' bytes per element (the Triton backend, not Mosaic GPU, runs the
#: kernels; untuned: no GPU has timed them). All compile deviceless for A100, H100 and B200.
_TRITON = {2: plgpu.CompilerParams(num_warps=8, num_stages=3), 4: plgpu.CompilerParams(num_warps=8, num_stages=2)}
#: The kernels' names in a compiled program (``name`` of the Triton custom call).
KERNEL_NAMES = ("moe_grouped_matmul", "moe_grouped_matmul_t", "moe_grouped_wgrad")

#: The settings of :func:`use_moe_kernel`.
MOE_KERNELS = ("auto", "grouped", "loop")
#: The platforms ``auto`` runs the grouped kernels on.
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_SETTING: contextvars.ContextVar = contextvars.ContextVar("jaxpar_moe_kernel", default="auto")


class Kernel(NamedTuple):
    """How a routed MLP runs: the grouped kernels (``interpret``: in Pallas's interpreter) or the tile loop."""

    grouped: bool = False
    interpret: bool = False


#: The tile loop.
LOOP = Kernel()


@contextlib.contextmanager
def use_moe_kernel(kernel: str = "auto") -> Iterator[str]:
    """Run the routed experts of MoE layers traced inside this block with ``kernel``.

    Read when a function is traced. As :func:`jaxpar.attention.use_attention_kernel`, a block that changes
    the setting clears JAX's caches on entry and on exit, so that what is traced inside runs ``kernel``.

    Args:
      kernel: one of :data:`MOE_KERNELS`: ``"auto"`` (grouped kernels on a GPU mesh, the tile loop elsewhere),
        ``"grouped"`` (everywhere; off a GPU in Pallas's interpreter, slow: for tests) or ``"loop"``.

    Yields:
      ``kernel``.

    Raises:
      MoEError: ``kernel`` is not one of :data:`MOE_KERNELS`.
    """
    if kernel not in MOE_KERNELS:
        raise MoEError(f"use_moe_kernel: kernel={kernel!r} is not an MoE kernel; choose one of {MOE_KERNELS} "
                       "('auto': the grouped kernels on a GPU mesh, the tile loop elsewhere).")
    with scoped_kernel(_SETTING, kernel):
        yield kernel


def current_moe_kernel() -> str:
    """The setting of the innermost :func:`use_moe_kernel` block, or ``"auto"``."""
    return _SETTING.get()


def _block(n: int, most: int) -> int | None:
    """The largest power of 2 at most ``most`` (and at least :data:`SMALLEST_BLOCK`) dividing ``n``, else None."""
    b = most
    while b >= SMALLEST_BLOCK:
        if n % b == 0:
            return b
        b //= 2
    return None


def _promoted(*arrays) -> list[jax.Array]:
    """``arrays`` in their promoted dtype (as ``x @ w`` would compute them)."""
    dtype = jnp.result_type(*arrays)
    return [a.astype(dtype) for a in arrays]


def _size(dtype) -> int:
    """The key of :data:`BLOCKS` for inputs of ``dtype``: 2 (bf16, fp16) or 4 (fp32)."""
    return 2 if jnp.dtype(dtype).itemsize <= 2 else 4


def grouped_problem(tile: int, embed: int, hidden: int) -> str | None:
    """Why the grouped kernels cannot run experts of ``embed x hidden`` on tiles of ``tile`` rows (None: they can).

    >>> grouped_problem(128, 2048, 768) is None
    True
    >>> print(grouped_problem(128, 2048, 100))
    the experts' hidden size 100 (the grouped kernels: a multiple of 16)
    """
    if not SMALLEST_BLOCK <= tile <= LARGEST_TILE or tile & (tile - 1):
        return f"tile {tile} rows (the grouped kernels: a power of 2 from {SMALLEST_BLOCK} to {LARGEST_TILE})"
    for name, n in (("embed", embed), ("hidden", hidden)):
        if _block(n, SMALLEST_BLOCK) is None:
            return f"the experts' {name} size {n} (the grouped kernels: a multiple of {SMALLEST_BLOCK})"
    return None


def choose_moe_kernel(platform: str, tile: int, embed: int, hidden: int, setting: str | None = None) -> Kernel:
    """The kernel of a routed MLP on ``platform`` (see the module docstring).

    Args:
      platform: the platform of the mesh's devices (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"tpu"``, ...).
      tile: rows per tile.
      embed, hidden: the experts' input width and (local) hidden width.
      setting: one of :data:`MOE_KERNELS`; the innermost :func:`use_moe_kernel`'s when None.

    Returns:
      The :class:`Kernel`.

    Raises:
      MoEError: ``"grouped"`` asked for shapes the kernels cannot run.

    >>> choose_moe_kernel("cuda", 128, 2048, 768), choose_moe_kernel("cpu", 32, 2048, 768)
    (Kernel(grouped=True, interpret=False), Kernel(grouped=False, interpret=False))
    """
    setting = current_moe_kernel() if setting is None else setting
    on_gpu = platform in GPU_PLATFORMS
    if setting == "loop" or (setting == "auto" and not on_gpu):
        return LOOP
    why = grouped_problem(tile, embed, hidden)
    if why is not None:
        if setting == "grouped":
            raise MoEError(f"use_moe_kernel('grouped') cannot run these experts: {why}. Fix: "
                           "use_moe_kernel('auto') (the tile loop where the kernels cannot run).")
        return LOOP
    return Kernel(grouped=True, interpret=not on_gpu)


class Groups(NamedTuple):
    """The tile table on the device: each tile's expert (``[T]``), the tiles used (``[1]``) and each expert's
    tiles ``start[e] .. stop[e]`` (``[E]`` each; contiguous in the sorted layout). All int32."""

    expert: jax.Array
    used: jax.Array
    start: jax.Array
    stop: jax.Array

    @classmethod
    def of(cls, tile_expert: jax.Array, used: jax.Array, experts: int) -> "Groups":
        """The table of tiles whose experts are ``tile_expert`` (ascending over the first ``used``)."""
        live = jnp.where(jnp.arange(tile_expert.shape[0]) < used, tile_expert, experts)[None, :]  # unused: last
        ids = jnp.arange(experts)[:, None]
        return cls(tile_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32),
                   jnp.sum(live < ids, axis=1, dtype=jnp.int32), jnp.sum(live <= ids, axis=1, dtype=jnp.int32))


def _matmul_kernel(expert_ref, used_ref, x_ref, w_ref, o_ref, *, tile: int, bk: int, bn: int, transpose: bool):
    t, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(t * tile, tile), pl.ds(j * bn, bn)

    @pl.when(t < used_ref[0])
    def _():
        e = expert_ref[t]

        def body(k, acc):
            ks = pl.ds(k * bk, bk)
            w, contract = (w_ref[e, cols, ks], 1) if transpose else (w_ref[e, ks, cols], 0)
            return acc + lax.dot_general(x_ref[rows, ks], w, (((1,), (contract,)), ((), ())),
                                         preferred_element_type=_F32)
        acc = lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros((tile, bn), _F32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(t >= used_ref[0])
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, groups: Groups, *, tile: int, transpose: bool = False,
                   out_dtype=None, interpret: bool = False) -> jax.Array:
    """``Y[tile t] = X[tile t] @ W[expert of t]`` (``W[e]^T`` with ``transpose``) over padded rows.

    Args:
      x: ``[T·tile, K]`` padded rows (see the module docstring).
      w: ``[E, K, N]`` (``[E, N, K]`` with ``transpose``).
      groups: the tile table.
      tile: rows per tile.
      transpose: multiply by each expert's ``W^T`` (the input gradient).
      out_dtype: the result's dtype (``x`` and ``w``'s promoted dtype when None); accumulated in fp32.
      interpret: run in Pallas's interpreter (off a GPU).

    Returns:
      ``[T·tile, N]``; the rows of unused tiles are zeros.
    """
    (p, k), n = x.shape, w.shape[1 if transpose else 2]
    x, w = _promoted(x, w)
    size = _size(x.dtype)
    bk, bn = _block(k, BLOCKS[size]["k"]), _block(n, BLOCKS[size]["n"])
    kernel = functools.partial(_matmul_kernel, tile=tile, bk=bk, bn=bn, transpose=transpose)
    return pl.pallas_call(
        kernel, grid=(p // tile, n // bn),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((tile, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((p, n), out_dtype or x.dtype), interpret=interpret,
        compiler_params=_TRITON[size], name=KERNEL_NAMES[1 if transpose else 0],
    )(groups.expert, groups.used, x, w)


def _wgrad_kernel(start_ref, stop_ref, x_ref, g_ref, o_ref, *, tile: int):
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = o_ref.shape
    ks, ns = pl.ds(i * bk, bk), pl.ds(j * bn, bn)

    def body(t, acc):
        rows = pl.ds(t * tile, tile)
        return acc + lax.dot_general(x_ref[rows, ks], g_ref[rows, ns], (((0,), (0,)), ((), ())),
                                     preferred_element_type=_F32)
    o_ref[...] = lax.fori_loop(start_ref[e], stop_ref[e], body, jnp.zeros((bk, bn), _F32))


def grouped_weight_grad(x: jax.Array, g: jax.Array, groups: Groups, *, tile: int,
                        interpret: bool = False) -> jax.Array:
    """``dW[e] = sum over e's tiles t of X[t]^T @ G[t]``, fp32.

    Args:
      x: ``[T·tile, K]`` padded rows.
      g: ``[T·tile, N]`` padded rows.
      groups: the tile table (``start``/``stop``: each expert's tiles).
      tile: rows per tile.
      interpret: run in Pallas's interpreter.

    Returns:
      ``[E, K, N]`` fp32; an expert without tiles gets zeros.
    """
    (_, k), n, experts = x.shape, g.shape[1], groups.start.shape[0]
    x, g = _promoted(x, g)
    size = _size(x.dtype)
    bk, bn = _block(k, BLOCKS[size]["wgrad"]), _block(n, BLOCKS[size]["wgrad"])
    return pl.pallas_call(
        functools.partial(_wgrad_kernel, tile=tile), grid=(experts, k // bk, n // bn),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((None, bk, bn), lambda e, i, j: (e, i, j)),
        out_shape=jax.ShapeDtypeStruct((experts, k, n), _F32), interpret=interpret,
        compiler_params=_TRITON[size], name=KERNEL_NAMES[2],
    )(groups.start, groups.stop, x, g)


# ----------------------------------------------------------------- a routed expert MLP on the padded rows

def _hidden(act: Callable, a: jax.Array, b: jax.Array | None) -> jax.Array:
    return act(a) if b is None else act(a) * b


def grouped_mlp_forward(xp: jax.Array, ws: tuple, groups: Groups, act: Callable, *, tile: int,
                        interpret: bool = False) -> tuple[jax.Array, tuple]:
    """The experts ``w2(act(x w1) [* (x w3)])`` on padded rows ``xp[T·tile, D]``: 2 grouped calls, 3 gated.

    Args:
      xp: the padded rows.
      ws: ``(w1 [E, D, M], w2 [E, M, D], w3 [E, D, M] or None)``.
      groups: the tile table.
      act: the activation (elementwise, ``act(0) = 0``: the padding rows stay zeros).
      tile: rows per tile.
      interpret: run in Pallas's interpreter.

    Returns:
      ``(y [T·tile, D], (x w1, x w3 or None))``: the output and the pre-activations, each in its GEMM's
      inputs' dtype, as the tile loop's.
    """
    w1, w2, w3 = ws
    run = functools.partial(grouped_matmul, groups=groups, tile=tile, interpret=interpret)
    a = run(xp, w1)
    b = None if w3 is None else run(xp, w3)
    return run(_hidden(act, a, b), w2), (a, b)


def grouped_mlp_backward(xp: jax.Array, gp: jax.Array, wp: jax.Array, pre: tuple, ws: tuple, groups: Groups,
                         act: Callable, *, tile: int, interpret: bool = False) -> tuple:
    """The backward of ``wp * grouped_mlp_forward(xp)`` from its output's cotangent ``gp``: 4 grouped calls, 6 gated.

    Args:
      xp: ``[T·tile, D]`` padded rows.
      gp: ``[T·tile, D]`` the cotangent of each row's expert output, before its weight.
      wp: ``[T·tile]`` fp32, each row's combine weight (0 on padding).
      pre: the forward's pre-activations.
      ws, groups, act, tile, interpret: as for :func:`grouped_mlp_forward`.

    Returns:
      ``(dx [T·tile, D], dweight [T·tile] fp32, (dw1, dw2, dw3 or None) fp32)``; ``dx`` in its GEMMs' inputs'
      dtype, as the tile loop's.
    """
    (w1, w2, w3), (a, b) = ws, pre
    run = functools.partial(grouped_matmul, groups=groups, tile=tile, interpret=interpret)
    wgrad = functools.partial(grouped_weight_grad, groups=groups, tile=tile, interpret=interpret)
    h, hidden_vjp = jax.vjp(functools.partial(_hidden, act), a, b)
    gh = run(gp, w2, transpose=True)                           # d loss / d h, before the weight
    dweight = jnp.sum(gh * h, -1, _F32)
    da, db = hidden_vjp((gh * wp[:, None]).astype(h.dtype))
    dw2 = wgrad(h, (gp * wp[:, None]).astype(h.dtype))
    dx = run(da, w1, transpose=True)
    if w3 is not None:
        dx = dx + run(db, w3, transpose=True)
    return dx, dweight, (wgrad(xp, da), dw2, None if w3 is None else wgrad(xp, db))
