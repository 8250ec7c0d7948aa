"""The collective-permutes inside one pipeline stage's work, found by compiling that work once.

A collective-permute has no replica groups: XLA:CPU's rendezvous for it waits for every device of the
program, while the per-stage program runs each action in a conditional on the stage index. Inside one,
only that stage's devices reach it, and the step waits until XLA aborts it.
XLA adds collective-permutes where the partitioner reshards a value along a sharded dimension: a
``jnp.split`` of a fused ``qkv`` projection sharded over ``tensor``, a roll, slice or concatenation
along the batch's data axes, sequence parallelism's reordering. :func:`stage_reshards` compiles
``pre``, one layer and ``post`` with their gradients, as one stage runs them (a ``shard_map`` manual
over ``pipe``, the stage's shardings and rules), and names those it holds; a pipeline with any runs
as a lockstep program (docs/pipeline.md, "Lockstep programs").
"""
from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.adapters._blocks import use_layer_runner
from jaxpar.adapters._loss_metrics import with_reported_metrics
from jaxpar.parallel.pipeline._cut import PipelineParts
from jaxpar.parallel.pipeline._stage import PIPE
from jaxpar.rules import current_rules, drop_axes, use_rules

_PERMUTE = re.compile(r"\scollective-permute(?:-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_KEEP = 64                  # programs whose answer is kept, oldest dropped first
_FOUND: dict = {}           # (lowered text, platform, device kind, device ids) -> the answer


def stage_reshards(parts: PipelineParts, mesh, outer: Any, layer: Any, microbatch: Any) -> tuple[str, ...]:
    """Where XLA puts collective-permutes into one stage's work: ``pre``, one layer, ``post`` and their
    gradients, compiled in a ``shard_map`` manual over ``pipe`` under the current rules (less ``pipe``).

    Args:
      parts: the model's ``pre``, ``layer`` and ``post``.
      mesh: the mesh, with a ``pipe`` axis.
      outer: ``pre``'s and ``post``'s parameters, ``jax.ShapeDtypeStruct`` s with their shardings.
      layer: one layer's parameters, likewise.
      microbatch: one micro-batch, likewise.

    Returns:
      The source operation of each collective-permute (the tail of its ``op_name``, e.g.
      ``'jvp()/split'``), once each in text order; ``()`` when there is none, or when no axis but ``pipe``
      has a size > 1 (nothing in a stage is sharded). A program lowered to the same text before is not
      compiled again.
    """
    if all(size == 1 for axis, size in mesh.shape.items() if axis != PIPE):
        return ()
    post = with_reported_metrics(parts.post)

    def body(outer, layer, mb):
        def loss(o, w):
            return post(o, parts.layer(w, parts.pre(o, mb)), mb)[0]
        return jax.grad(loss, argnums=(0, 1))(outer, layer)

    smap = jax.shard_map(body, mesh=mesh, axis_names={PIPE}, check_vma=False, in_specs=P(), out_specs=P())
    ctx = current_rules()
    with use_rules(mesh, drop_axes(ctx[1] if ctx else (), (PIPE,))), use_layer_runner(None):
        lowered = jax.jit(smap).lower(outer, layer, microbatch)
    first = mesh.devices.flat[0]
    key = (lowered.as_text(), first.platform, first.device_kind, tuple(d.id for d in mesh.devices.flat))
    if key not in _FOUND:
        text = lowered.compile().as_text()
        _FOUND[key] = tuple(dict.fromkeys(_source(line) for line in text.splitlines() if _PERMUTE.search(line)))
        while len(_FOUND) > _KEEP:
            _FOUND.pop(next(iter(_FOUND)))
    return _FOUND[key]


def _source(line: str) -> str:
    """The tail of an HLO instruction's ``op_name`` (``'jvp()/split'``), or its opcode without one."""
    found = _OP_NAME.search(line)
    return "/".join(found.group(1).split("/")[-2:]) if found else "collective-permute"
