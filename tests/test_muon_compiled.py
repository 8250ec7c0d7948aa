"""Muon as ``jaxpar inspect`` shows it and as XLA compiles it (issue 57, docs/muon.md).

``jaxpar inspect`` with ``optimizer.name: muon`` prints the routing table of the state's layout
(:func:`jaxpar.plan.muon_lines`). Under FSDP8 the update alone (``tx.update`` on the
layout's shardings) of AdamW needs no all-gather; without a placement Muon's gathers the sharded
matrices for Newton-Schulz where XLA decides: at least one all-gather per Muon-routed parameter.
With ``placement="owner"`` it has one all-to-all to the owners and one back per matrix group, with
``"gather"`` one all-gather, and the bytes are the cost model's (:func:`jaxpar.cost.muon_update`).
"""
import re
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import cost
from jaxpar.adapters import abstract_model
from jaxpar.analysis import collectives, count
from jaxpar.config import load_config
from jaxpar.plan import muon_lines
from jaxpar.config._job import build_job
from jaxpar.models import GPT
from jaxpar.optimizers import muon, muon_routing

from conftest import need_devices
from helpers import CFG, mesh_for

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@need_devices(8)
def test_inspect_prints_the_muon_routing_of_the_layout():
    cfg = load_config(QUICKSTART, ["optimizer.name=muon", "model.embed=32", "model.layers=1"])
    layout = build_job(cfg, jax.devices()[:8], data=False).state_layout()
    text = "\n".join(muon_lines(cfg.optimizer.muon, layout))
    routing, placement = text.strip().split("\n\n")
    rows = {line.split()[0]: line.split()[1] for line in routing.splitlines()[1:]}
    assert rows["blocks/wq"] == "muon" and rows["wte"] == "adam" and rows["head"] == "adam"
    assert re.search(r"^blocks/wq\s+muon\s+embed\(32\) x heads\*kv\(32\)\s+batch layers\(1\)", text, re.M)
    places = {line.split()[0]: line.split()[1:4] for line in placement.splitlines()[1:]}
    assert sorted(places) == sorted(k for k, rule in rows.items() if rule == "muon")
    assert places["blocks/wq"][0] in ("gather", "owner") and places["blocks/wq"][1:] == ["over", "fsdpxtensor"]
    assert muon_lines(None, layout) == []        # another optimizer


@pytest.mark.slow
def test_inspect_predicts_the_muon_state_bytes(capsys):
    """The cost model's argument bytes of a Muon step (one fp32 moment per matrix, AdamW's two elsewhere, one
    counter more) equal the compiled step's, as they do for AdamW."""
    from jaxpar.cli import main

    for opt in ("muon", "adamw"):
        assert main(["inspect", str(QUICKSTART), f"optimizer.name={opt}", "model.embed=32", "model.layers=1"]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("arguments"))
        assert row.split("|")[-1].strip() == "1.000", (opt, row)


def _update_collectives(tx, mesh=None):
    mesh = mesh or mesh_for({"fsdp": 8})
    state, layout = jaxpar.init_train_state(lambda: GPT(CFG, rngs=nnx.Rngs(0)), tx, mesh, jaxpar.Strategy())
    sh = lambda specs: jaxpar.named_shardings(specs, mesh)   # noqa: E731
    update = jax.jit(lambda g, s, p: tx.update(g, s, p),
                     in_shardings=(sh(layout.grads), sh(layout.opt_state), sh(layout.params)))
    return collectives(update.lower(state.params, state.opt_state, state.params).compile(), mesh)


@pytest.mark.slow
@need_devices(8)
def test_muon_update_under_fsdp8_gathers_the_sharded_matrices():
    _, shapes, logical = abstract_model(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    matrices = sum(rule == "muon" for rule in muon_routing(shapes, logical).values())
    adamw = _update_collectives(optax.adamw(1e-3))
    ours = _update_collectives(muon(0.02, logical=logical))
    assert count(adamw, "all-gather") == 0
    assert count(ours, "all-gather") >= matrices


@pytest.mark.slow
@need_devices(8)
@pytest.mark.parametrize("placement", ["owner", "gather"])
def test_a_placed_update_has_one_collective_per_direction_and_group_with_the_cost_models_bytes(placement):
    """FSDP8, the update alone: ``owner`` compiles to one all-to-all to the owners and one back per matrix
    group (``gather``: one all-gather), over ``fsdp``, nothing else (no all-reduce: every norm and Gram
    matrix is whole on its device); the bytes within 5% of the cost model's."""
    mesh = mesh_for({"fsdp": 8})
    model_fn = lambda: GPT(CFG, rngs=nnx.Rngs(0))        # noqa: E731
    _, shapes, logical = abstract_model(model_fn)
    specs = jaxpar.state_layout(model_fn, optax.identity(), mesh, jaxpar.Strategy()).opt_param_specs
    colls = _update_collectives(muon(0.02, logical=logical, placement=placement, mesh=mesh, specs=specs), mesh)
    groups = sum(rule == "muon" for rule in muon_routing(shapes, logical).values())
    kind, per_group = ("all-to-all", 2) if placement == "owner" else ("all-gather", 1)
    assert count(colls, kind, "fsdp") == count(colls, kind) == per_group * groups
    assert len(colls) == per_group * groups, sorted({c.kind for c in colls})
    model = cost.gpt(CFG.layers, CFG.embed, CFG.heads, CFG.seq_len, CFG.vocab, 16)
    predicted = cost.muon_update(model, {"fsdp": 8}, "cpu_sim", placement=placement)
    assert len(predicted.groups) == groups and {c.placement for _, c in predicted.groups} == {placement}
    measured = sum(c.bytes for c in colls)
    assert abs(measured - predicted.bytes) <= 0.05 * predicted.bytes, (measured, predicted.bytes)
