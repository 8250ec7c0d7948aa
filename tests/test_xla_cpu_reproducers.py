"""Reproducers of an upstream XLA:CPU bug that jaxpar works around (:mod:`jaxpar.parallel._regions`), in JAX alone.

XLA:CPU (jax 0.10) aborts the process while compiling a bf16 reduction inside a *partly manual*
``jax.shard_map`` (manual over some mesh axes, ``axis_names={...}``, automatic over the others):
``hlo_instruction.cc: Invalid binary instruction opcode copy``, from its ``AllReducePromotion``
pass. Each case below compiles one such program in a subprocess (the abort kills the process) on 8
CPU devices, mesh ``data 2 x tensor 4`` (both axes automatic), region manual over ``tensor``:

- ``psum`` over ``tensor``;
- ``psum_scatter`` over ``tensor``;
- the transpose of a ``psum``: the gradient of an input that enters the region unsplit over
  ``tensor`` (with ``check_vma=False`` autodiff sums its cotangent over ``tensor`` inside the region);
- the transpose of an ``all_gather`` (a reduce-scatter in the backward);
- a ``psum`` where the only automatic axis has size 1 (mesh ``data 1 x tensor 8``).

They are ``xfail(strict=True)``: they document the bug, and they will XPASS (and fail the suite)
once XLA:CPU compiles them; then :mod:`jaxpar.parallel._regions` can stop widening bf16 reductions on CPU.
The controls (:func:`test_what_jaxpar_relies_on_compiles`) are what the workaround stands on: the
same reductions compile in fp32 and in fp16 with ``data`` automatic, and in bf16 in a region manual
over the whole mesh; a bf16 ``all_gather`` without its transpose compiles too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROLOGUE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import AxisType, PartitionSpec as P

    def mesh(data, tensor):
        return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)

    def region(body, m, in_specs, out_specs, manual):
        return jax.shard_map(body, mesh=m, in_specs=in_specs, out_specs=out_specs, axis_names=manual,
                             check_vma=False)

    def psum(dt, m, manual):
        f = region(lambda a: jax.lax.psum(a, "tensor"), m, P(None, "tensor"), P(), manual)
        jax.jit(f).lower(jnp.ones((8, 16), dt)).compile()

    def psum_scatter(dt, m, manual):
        f = region(lambda a: jax.lax.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True), m, P(),
                   P(None, "tensor"), manual)
        jax.jit(f).lower(jnp.ones((8, 16), dt)).compile()

    def transpose_of_psum(dt, m, manual):      # w enters unsplit over tensor: its cotangent is psummed
        f = region(lambda a, w: a @ w, m, (P(None, "tensor"), P()), P(None, "tensor"), manual)
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))
        jax.jit(jax.grad(loss, argnums=1)).lower(jnp.ones((8, 16), dt), jnp.ones((4, 4), dt)).compile()

    def transpose_of_all_gather(dt, m, manual, grad=True):
        f = region(lambda a: jax.lax.all_gather(a, "tensor", axis=1, tiled=True), m, P(None, "tensor"), P(), manual)
        loss = lambda x: jnp.sum(f(x).astype(jnp.float32) ** 2)
        jax.jit(jax.grad(loss) if grad else f).lower(jnp.ones((8, 16), dt)).compile()
""")

#: The programs XLA:CPU aborts on: ``{name: statement}`` run after :data:`_PROLOGUE`.
ABORTS = {
    "psum": 'psum(jnp.bfloat16, mesh(2, 4), {"tensor"})',
    "psum_scatter": 'psum_scatter(jnp.bfloat16, mesh(2, 4), {"tensor"})',
    "transpose_of_psum": 'transpose_of_psum(jnp.bfloat16, mesh(2, 4), {"tensor"})',
    "transpose_of_all_gather": 'transpose_of_all_gather(jnp.bfloat16, mesh(2, 4), {"tensor"})',
    "psum_size1_automatic_axis": 'psum(jnp.bfloat16, mesh(1, 8), {"tensor"})',
}


def _compile(statements: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = _PROLOGUE + statements + '\nprint("COMPILED")\n'
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


class OtherFailure(Exception):
    """The program failed for another reason than the bug (a real failure, not the expected one)."""


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="upstream XLA:CPU bug (jax 0.10): a bf16 reduction in a partly manual shard_map aborts the "
                   "compile ('Invalid binary instruction opcode copy'); jaxpar.parallel._regions works around it. This "
                   "XPASSes once XLA:CPU compiles it.")
@pytest.mark.parametrize("case", list(ABORTS))
def test_bf16_reduction_in_a_partly_manual_region_compiles(case):
    run = _compile(ABORTS[case] + "\n")
    assert "Invalid binary instruction opcode copy" not in run.stderr, f"{case}: XLA:CPU aborted the compile"
    if run.returncode != 0 or "COMPILED" not in run.stdout:
        raise OtherFailure(run.stderr[-2000:])


def test_what_jaxpar_relies_on_compiles():
    """fp32 and fp16 reductions with ``data`` automatic, bf16 ones in a region manual over the whole
    mesh, and a bf16 all-gather without its transpose: all compile (one process)."""
    statements = [f"{fn}(jnp.{dt}, mesh(2, 4), {{'tensor'}})" for fn in ("psum", "psum_scatter", "transpose_of_psum",
                                                                        "transpose_of_all_gather")
                  for dt in ("float32", "float16")]
    statements += [f"{fn}(jnp.bfloat16, mesh(2, 4), {{'data', 'tensor'}})"
                   for fn in ("psum", "psum_scatter", "transpose_of_psum", "transpose_of_all_gather")]
    statements += ["transpose_of_all_gather(jnp.bfloat16, mesh(2, 4), {'tensor'}, grad=False)"]
    run = _compile("\n".join(statements) + "\n")
    assert run.returncode == 0 and "COMPILED" in run.stdout, run.stderr[-2000:]
