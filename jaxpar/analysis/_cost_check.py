"""Check the cost model against compiled programs: bytes per mesh axis and argument bytes.

:func:`compile_plan` builds jaxpar's train step for a :class:`~jaxpar.cost.Plan` and
compiles it ahead of time from abstract state (nothing runs). :func:`compare` sets the cost
model's prediction (the ``xla-cpu`` lowering of :func:`jaxpar.cost.comms`, fp32, and
:func:`jaxpar.cost.device_argument_bytes`) beside what the compiled program has: the bytes per
step per mesh axis of :func:`jaxpar.analysis._axis_bytes.compiled_bytes_per_axis` and XLA's
memory analysis (temporaries are reported, not predicted). :func:`compile_and_compare` does
both for jaxpar's GPT.

Example::

    >>> import jax
    >>> from jaxpar.cost._model import gpt
    >>> from jaxpar.cost._parallel import Plan
    >>> row = compile_and_compare(gpt(2, 32, 8, 16, 64, 16), Plan(data=2), devices=jax.devices()[:2])
    >>> row["axes"]["data"]["error"] < 0.01, row["arguments"]["error"] < 0.01
    (True, True)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxpar.analysis._axis_bytes import compiled_bytes_per_axis
from jaxpar.analysis._compiled_memory import memory_report
from jaxpar.batch import batch_sharding
from jaxpar.cost import device_argument_bytes
from jaxpar.cost._device_bytes import layout_for_platform
from jaxpar.cost._model import ModelSpec
from jaxpar.cost._parallel import Plan
from jaxpar.cost._traffic import bytes_per_axis, comms
from jaxpar.errors import MeshError
from jaxpar.mesh import make_mesh
from jaxpar.step import make_train_step, state_layout


def compare(model: ModelSpec, plan: Plan, compiled: Any, mesh: Any, *, lowering: str = "xla-cpu") -> dict:
    """Predicted vs compiled: bytes per mesh axis and argument bytes (temporaries reported only).

    Args:
      model: the cost model's description of the model that was compiled.
      plan: the plan it was compiled for.
      compiled: the compiled train step (``jax.stages.Compiled``).
      mesh: the mesh it was compiled for.
      lowering: the cost model's lowering to predict with (:data:`jaxpar.cost._traffic.LOWERINGS`).

    Returns:
      ``{"plan": name, "axes": {axis: {"predicted", "compiled", "error"}}, "arguments": {"predicted",
      "compiled", "error"}, "temp_bytes", "peak_bytes"}``; an error is ``|predicted - compiled| / compiled``
      (for an axis without compiled bytes: 1 if something is predicted, else 0).
    """
    pred = bytes_per_axis(comms(model, plan, lowering=lowering, compute_bytes=4, grad_bytes=4))
    got = compiled_bytes_per_axis(compiled, mesh, plan)
    axes = {}
    for a in sorted(set(pred) | set(got)):
        p, g = pred.get(a, 0.0), got.get(a, 0.0)
        axes[a] = {"predicted": p, "compiled": g, "error": abs(p - g) / g if g else float(p > 0)}
    rep = memory_report(compiled)
    layout = layout_for_platform("tpu" if lowering == "xla-tpu" else "cuda")      # libtpu's tiled layout
    args = device_argument_bytes(model, plan.sizes, plan.strategy.zero, layout=layout)
    return {"plan": plan.name(), "axes": axes,
            "arguments": {"predicted": args, "compiled": rep.argument_bytes,
                          "error": abs(args - rep.argument_bytes) / rep.argument_bytes},
            "temp_bytes": rep.temp_bytes, "peak_bytes": rep.peak_bytes}


def compile_plan(model_fn: Callable, plan: Plan, batch: int, seq: int, *, devices: Sequence | None = None):
    """Compile the train step of ``plan`` ahead of time from abstract state (nothing runs): AdamW (learning
    rate 1e-3, weight decay 0.1) on :func:`jaxpar.models.lm_loss`, jaxpar's GPT's loss.

    Args:
      model_fn: builds the NNX model (only traced).
      plan: mesh sizes and strategy; the mesh has the plan's axes of size > 1 (``{"data": 1}`` if none).
      batch: global batch, in sequences.
      seq: tokens per sequence.
      devices: the devices of the mesh (default: the first ``plan.devices`` of ``jax.devices()``).

    Returns:
      ``(mesh, compiled)``.

    Raises:
      MeshError: fewer devices than the plan needs.
    """
    n = plan.devices
    devices = jax.devices()[:n] if devices is None else devices
    if len(devices) < n:
        raise MeshError(f"plan {plan.name()} needs {n} devices, have {len(devices)}; simulate more CPU devices "
                        f"(jaxpar.mesh.use_devices({n}) before JAX starts).")
    mesh = make_mesh({k: v for k, v in plan.sizes.items() if v > 1} or {"data": 1}, devices=devices)
    strategy = plan.strategy if plan.data > 1 else replace(plan.strategy, zero=0)
    from jaxpar.models._gpt import lm_loss

    tx = optax.adamw(1e-3, weight_decay=0.1)
    layout = state_layout(model_fn, tx, mesh, strategy)
    step = make_train_step(lm_loss, tx, layout, strategy)
    spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding(mesh))
    return mesh, step.lower(layout.abstract_state(), {"tokens": spec, "targets": spec}).compile()


def compile_and_compare(model: ModelSpec, plan: Plan, *, devices: Sequence | None = None,
                        lowering: str = "xla-cpu") -> dict:
    """Compile ``plan`` for jaxpar's GPT of ``model``'s sizes and :func:`compare` (see the module example).

    Args:
      model: the sizes of the GPT (layers, hidden, heads, seq, vocab, MLP width, batch).
      plan: the plan; its ``remat`` becomes the GPT's recomputation policy.
      devices: as for :func:`compile_plan`.
      lowering: as for :func:`compare` (``ideal`` for the GPU and TPU compilers).

    Returns:
      :func:`compare`'s dict.
    """
    from flax import nnx

    from jaxpar.models._gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=model.vocab, seq_len=model.seq, embed=model.hidden, heads=model.heads,
                    layers=model.layers, mlp=model.mlp, remat=plan.remat)
    mesh, compiled = compile_plan(lambda: GPT(cfg, rngs=nnx.Rngs(0)), plan, model.batch, model.seq, devices=devices)
    return compare(model, plan, compiled, mesh, lowering=lowering)
