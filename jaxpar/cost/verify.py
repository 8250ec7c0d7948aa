"""Check the cost model against compiled programs: bytes per mesh axis and argument bytes.

Imports JAX only inside its functions. The compiled side counts every collective of the
HLO inventory (:func:`jaxpar.analysis.hlo.collectives`) times the trip counts of the while
loops around it (``known_trip_count`` in the HLO: the layer scans), so both sides are bytes
per step; a collective over several mesh axes counts for each of them.

Example::

    >>> import jax
    >>> from jaxpar.cost.model import gpt
    >>> from jaxpar.cost.time import Plan
    >>> row = compile_and_compare(gpt(2, 32, 8, 16, 64, 16), Plan(data=2), devices=jax.devices()[:2])
    >>> row["axes"]["data"]["error"] < 0.01, row["arguments"]["error"] < 0.01
    (True, True)
"""
from __future__ import annotations

import re
from typing import Any

from .memory import argument_bytes
from .model import ModelSpec
from .time import Plan, bytes_per_axis, comms

__all__ = ["trip_counts", "compiled_bytes_per_axis", "compare", "compile_plan", "compile_and_compare"]

_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')


def trip_counts(text: str, branch_weights: dict[str, list[float]] | None = None) -> dict[str, float]:
    """``{computation: times it runs per execution of the entry}`` from the while loops' trip counts.

    ``branch_weights`` (``{conditional name: [fraction of its executions that take branch i]}``)
    counts a conditional's branches by how often they are taken; without it every branch counts
    as taken on every execution (an upper bound)."""
    from ..analysis import hlo

    instrs = hlo._parse_instructions(text)
    by_comp: dict[str, list] = {}
    for ins in instrs:
        by_comp.setdefault(ins.computation, []).append(ins)
    trips = _while_trips(text)
    weights = branch_weights or {}
    entry = next((m.group(1) for m in re.finditer(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)), None)
    mult: dict[str, float] = {}

    def visit(comp: str, k: float) -> None:
        if comp in mult and mult[comp] >= k:      # a branch never taken is recorded with 0
            return
        mult[comp] = k
        for ins in by_comp.get(comp, ()):
            trip = trips.get(ins.name, 1) if ins.opcode == "while" else 1
            branches = [c for key, c in hlo._called(ins) if key.endswith("computation") or key == "branch_computations"]
            w = weights.get(ins.name)
            for key, callee in hlo._called(ins):
                f = w[branches.index(callee)] if w is not None and callee in branches else 1
                visit(callee, k * f * (trip if key in ("body", "condition") else 1))

    if entry:
        visit(entry, 1)
    return mult


def _while_trips(text: str) -> dict[str, int]:
    """``{while instruction: known trip count}`` (read from the raw text: the parser blanks strings)."""
    trips = {}
    for line in text.splitlines():
        if " while(" in line:
            name, trip = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)", line), _TRIP.search(line)
            if name and trip:
                trips[name.group(1)] = int(trip.group(1))
    return trips


def compiled_bytes_per_axis(compiled: Any, mesh: Any, plan: Plan | None = None) -> dict[str, float]:
    """Bytes per step per mesh axis of the collectives in ``compiled`` (loops unrolled by trip count).
    For a pipelined ``plan``, the busiest pipeline stage's device, axis by axis, with the tick loop's
    switches counted by how often the schedule takes each branch (:mod:`jaxpar.cost.pipecount`)."""
    from ..analysis.hlo import collectives

    text = compiled.as_text()
    colls = collectives(compiled, mesh)
    if plan is None or plan.pipe == 1:
        return _sum_axes(colls, trip_counts(text))
    from .pipecount import stage_branch_weights

    out: dict[str, float] = {}
    for weights in stage_branch_weights(compiled, mesh, plan):
        for a, v in _sum_axes(colls, trip_counts(text, weights)).items():
            out[a] = max(out.get(a, 0.0), v)
    return out


def _sum_axes(colls, mult: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in colls:
        for a in c.axes or ():
            out[a] = out.get(a, 0.0) + c.bytes * mult.get(c.computation, 1)
    return out


def compare(model: ModelSpec, plan: Plan, compiled: Any, mesh: Any, *, lowering: str = "xla-cpu") -> dict:
    """Predicted vs compiled: bytes per axis, argument bytes (and temporaries, reported only)."""
    from ..analysis.memory import memory_report

    pred = bytes_per_axis(comms(model, plan, lowering=lowering, compute_bytes=4, grad_bytes=4))
    got = compiled_bytes_per_axis(compiled, mesh, plan)
    axes = {}
    for a in sorted(set(pred) | set(got)):
        p, g = pred.get(a, 0.0), got.get(a, 0.0)
        axes[a] = {"predicted": p, "compiled": g, "error": abs(p - g) / g if g else float(p > 0)}
    rep = memory_report(compiled)
    args = argument_bytes(model, plan.sizes, plan.zero)
    return {"plan": plan.name(), "axes": axes,
            "arguments": {"predicted": args, "compiled": rep.argument_bytes,
                          "error": abs(args - rep.argument_bytes) / rep.argument_bytes},
            "temp_bytes": rep.temp_bytes, "peak_bytes": rep.peak_bytes}


def compile_plan(model_fn: Any, plan: Plan, batch: int, seq: int, *, devices=None, tx=None, loss_fn=None):
    """``(mesh, compiled)``: the train step of ``plan`` compiled ahead of time from abstract state
    (nothing runs; the model is the GPT's ``model_fn`` unless a ``loss_fn`` is given)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxpar
    from jaxpar.train.step import batch_sharding

    n = plan.devices
    devices = jax.devices()[:n] if devices is None else devices
    if len(devices) < n:
        raise ValueError(f"plan {plan.name()} needs {n} devices, have {len(devices)}; simulate more CPU devices "
                         f"(jaxpar.mesh.use_devices({n}) before JAX starts).")
    mesh = jaxpar.make_mesh({k: v for k, v in plan.sizes.items() if v > 1} or {"data": 1}, devices=devices)
    strategy = jaxpar.Strategy(zero=plan.zero if plan.data > 1 else 0, sequence_parallel=plan.sequence_parallel,
                               microbatches=plan.microbatches, schedule=plan.schedule,
                               virtual_stages=plan.virtual)
    tx = optax.adamw(1e-3, weight_decay=0.1) if tx is None else tx
    if loss_fn is None:
        from jaxpar.models.gpt import lm_loss as loss_fn
    layout = _layout(model_fn, tx, mesh, strategy)
    step = jaxpar.make_train_step(loss_fn, tx, layout, strategy)
    sh = batch_sharding(mesh)
    spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sh)
    state = layout.abstract_state()
    return mesh, step.lower(state, {"tokens": spec, "targets": spec}).compile()


def _layout(model_fn, tx, mesh, strategy):
    """The :class:`~jaxpar.StateLayout` that ``init_train_state`` builds, without materialising the
    state (the same steps: abstract model, rules, ZeRO specs, optimizer specs)."""
    from ..rules import resolve
    from ..train import state as S
    from ..zero import zero_specs

    graphdef, shapes, logical = S.abstract_model(model_fn)
    rules = tuple(strategy.rules(mesh))
    base = resolve(logical, rules, mesh, shapes)
    sizes = dict(mesh.shape)
    specs = [zero_specs(base, shapes, logical, sizes, strategy.zero, k) for k in ("params", "grads", "opt")]
    opt_shapes, opt_state = S._opt_specs(tx, shapes, specs[2])
    return S.StateLayout(mesh, rules, graphdef, shapes, logical, specs[0], specs[1], specs[2], opt_state, opt_shapes)


def compile_and_compare(model: ModelSpec, plan: Plan, *, devices=None, model_fn=None) -> dict:
    """Compile ``plan`` for jaxpar's GPT of ``model``'s sizes and :func:`compare` (see the example)."""
    from flax import nnx

    from jaxpar.models.gpt import GPT, GPTConfig

    if model_fn is None:
        cfg = GPTConfig(vocab=model.vocab, seq_len=model.seq, embed=model.hidden, heads=model.heads,
                        layers=model.layers, mlp=model.mlp, remat={"selective": "save-matmuls"}.get(plan.remat, plan.remat))
        model_fn = lambda: GPT(cfg, rngs=nnx.Rngs(0))   # noqa: E731
    mesh, compiled = compile_plan(model_fn, plan, model.batch, model.seq, devices=devices)
    return compare(model, plan, compiled, mesh)
