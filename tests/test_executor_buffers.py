"""The executor's tick loop reads and writes its slotted buffers in place: no residual slot
is ever copied out of its buffer or back (it used to be, twice per tick, which cost 1F1B
20-30% of a step on the CPU mesh; docs/benchmarks.md section 4)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar.models._gpt import block_apply, embed_apply, head_apply
from jaxpar.parallel import cross_entropy
from jaxpar.parallel.pipeline import PipelineParts, get_schedule, lower, pipeline_value_and_grad, to_stages
from jaxpar.parallel.pipeline._stage import TICKS_SCOPE
from jaxpar.parallel.pipeline._layer_vjp import LayerVJP as _LayerVJP

from conftest import need_devices
from test_split_backward import E, T, V, _block

L = 5          # layers per stage: a leading size no other buffer of the program has


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, lines = {}, []
    for line in hlo.split("\n"):
        m = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if m:
            comps[m.group(1)] = lines = []
        else:
            lines.append(line)
    return comps


def _reachable(comps: dict, root: str) -> set[str]:
    """``root`` and every computation it calls (fusions, branches, loops), transitively."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += re.findall(r"(?:calls|body|condition|to_apply)=(%[\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [g.strip() for g in group.split(",")]
    return seen


def _tick_loop_shapes(kind: str) -> tuple[set, list]:
    """``(residual slot shapes, shapes of every array the tick loop makes)`` of a compiled
    GPT pipeline, p=2 stages of ``L`` layers."""
    p, m = 2, 4
    mesh = jaxpar.make_mesh({"pipe": p}, devices=jax.devices()[:p])
    parts = PipelineParts(pre=lambda o, mb: embed_apply(o, mb["tokens"]), layer=block_apply,
                          post=lambda o, y, mb: cross_entropy(head_apply(o, y), mb["targets"]))
    k = jax.random.split(jax.random.key(0), 4)
    outer = {"wte": 0.05 * jax.random.normal(k[0], (V, E)), "wpe": 0.05 * jax.random.normal(k[1], (T, E)),
             "head": 0.05 * jax.random.normal(k[2], (E, V)), "lnf_scale": jnp.ones(E), "lnf_bias": jnp.zeros(E)}
    blocks = _block(k[3], layers=L * p)
    tokens = jax.random.randint(k[3], (m, 2, T + 1), 0, V)
    mbs = {"tokens": tokens[..., :-1], "targets": tokens[..., 1:]}
    fn = jax.jit(pipeline_value_and_grad(parts, mesh, jaxpar.Strategy().rules(mesh), lower(get_schedule(kind, p, m)),
                                         stage_layers=(L,) * p))
    hlo = fn.lower(outer, to_stages(blocks, (L,) * p, p=p), mbs).compile().as_text()
    stored = _LayerVJP(block_apply, jax.tree.map(lambda a: a[0], blocks),
                       jax.ShapeDtypeStruct((2, T, E), jnp.float32)).stored
    slots = {(L, *r.shape) for r in stored if r.ndim}
    comps = _computations(hlo)
    bodies = [b for b, op in re.findall(r"body=(%[\w.\-]+), metadata=\{op_name=\"([^\"]*)\"", hlo)
              if op.endswith(f"{TICKS_SCOPE}/while")]
    assert len(bodies) == 1, bodies
    shapes = []
    for name in _reachable(comps, bodies[0]):
        for line in comps[name]:
            m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]+)\]\S* ([\w\-]+)\(", line)
            if m:
                shapes.append((tuple(int(d) for d in m.group(1).split(",")), m.group(2)))
    return slots, shapes


@need_devices(2)
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_no_residual_slot_is_copied_in_the_tick_loop(kind):
    slots, shapes = _tick_loop_shapes(kind)
    assert len(slots) >= 5 and len(shapes) > 100          # the GPT block stores many; the loop was found
    # F writes each layer's residuals into [slot, layer] of its buffer, B and W read them there: no
    # instruction of the loop (or of what it calls) makes a whole slot [L, ...]. The executor that
    # read slots before its switch and wrote them back after made 860 (copies, fusions, branch
    # parameters, tuple elements) in this program.
    made = [(s, op) for s, op in shapes if s in slots]
    assert made == [], made[:10]
