"""Muon on a user's own Flax NNX model (tests/muon_user_model.py): unstacked ``nnx.Linear`` blocks whose kernels
are annotated and whose biases are not, an unannotated conv stem and LayerNorm, a head over ``classes``.

* Routing follows docs/muon.md: unnamed rank-0 / rank-1 leaves (biases, the norm) go to AdamW; the unnamed conv
  kernel (rank 3) is refused by name until ``routing=`` routes it.
* ``muon(routing=...)`` through ``init_train_state`` + ``make_train_step`` trains, with the layout's names or with
  no names tree at all, and each leaf's state is in the half the routing says.
* FSDP8 equals one device over 3 steps (tolerances as tests/test_muon.py's).
* ``optimizer.muon.routing`` from YAML trains through ``jaxpar train``; a pattern matching nothing is named.
"""
import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import abstract_model
from jaxpar.errors import OptimizerError
from jaxpar.optimizers import muon, muon_routes, muon_routing

from conftest import need_devices
from helpers import PARAM_ATOL, PARAM_RTOL, adam_atol, assert_grads_close, flat, keep_grads, mesh_for
from muon_user_model import SeqNet, batches, loss

TESTS = Path(__file__).resolve().parent
MUON_LR, ADAM_LR, BATCH = 0.02, 3e-3, 16
STEM = {"^stem/kernel$": "adam"}        # the conv kernel [3, 4, 16] has no names: the user routes it
#: What docs/muon.md says of each leaf: the annotated MLP kernels are matrices, the rest AdamW's.
EXPECTED = {"block1/up/kernel": "muon", "block1/down/kernel": "muon", "block2/up/kernel": "muon",
            "block2/down/kernel": "muon", "block1/up/bias": "adam", "block1/down/bias": "adam",
            "block2/up/bias": "adam", "block2/down/bias": "adam", "head/kernel": "adam", "head/bias": "adam",
            "norm/scale": "adam", "norm/bias": "adam", "stem/kernel": "adam", "stem/bias": "adam"}


def _model():
    return SeqNet(rngs=nnx.Rngs(0))


def _tx(logical, routing, **place):
    return muon(MUON_LR, logical=logical, routing=routing, adam=dict(lr=ADAM_LR), **place)


def test_routing_of_unannotated_leaves_follows_the_docs():
    _, shapes, logical = abstract_model(_model)
    assert logical["block1"]["up"]["bias"] == jax.sharding.PartitionSpec()         # unannotated: no names
    with pytest.raises(OptimizerError, match=r"'stem/kernel' of shape \(3, 4, 16\) .*routing=\{'<path regex>'"):
        muon_routes(shapes, logical)
    routes = muon_routes(shapes, logical, routing=STEM)
    assert {k: r.rule for k, r in routes.items()} == EXPECTED
    assert routes["block1/up/kernel"].reduction == (0,) and routes["block1/down/kernel"].output == (1,)
    assert routes["block1/up/bias"].why == "no logical names, rank 1 (bias / scale)"
    assert muon_routing(shapes, logical, routing={**STEM, "bias$": "adam"}) == EXPECTED   # routing= reaches them too
    # no names tree: the kernels are routed by pattern, the biases by their rank
    assert muon_routing(shapes, routing={r"block\d/(up|down)/kernel$": "muon", "(stem|head)/kernel$": "adam"}) \
        == EXPECTED
    forced = muon_routes(shapes, logical, routing={"^stem/kernel$": "muon"})["stem/kernel"]
    assert (forced.rule, forced.reduction, forced.output, forced.batch) == ("muon", (1,), (2,), (0,))
    with pytest.raises(OptimizerError, match=r"'head/bias' has rank 1; Muon needs a matrix"):
        muon_routes(shapes, logical, routing={**STEM, "^head/bias$": "muon"})
    with pytest.raises(OptimizerError, match=r"routing=\{'\(': 'adam'\}\): '\(' is not a valid regular expression"):
        muon(0.02, routing={"(": "adam"})


def _train(sizes, tx, steps, strategy=jaxpar.Strategy()):
    """``steps`` steps of ``tx`` on ``sizes``, all on one batch: the state, its losses and the layout."""
    mesh = mesh_for(sizes)
    state, layout = jaxpar.init_train_state(_model, tx, mesh, strategy)
    step = jaxpar.make_train_step(loss, tx, layout, strategy)
    losses = []
    for i in range(steps):
        state, metrics = step(state, jaxpar.shard_batch(batches(0, batch_size=BATCH), mesh))
        losses.append(float(metrics["loss"]))
    return state, losses, layout


@pytest.mark.parametrize("names", ["layout", "none"])
def test_muon_routing_through_init_train_state_trains(names):
    """``logical=`` the layout's names and ``routing=`` for the conv kernel, or no names tree and ``routing=`` for
    every matrix: the state's two halves hold exactly the routed leaves, and the loss falls."""
    logical, routing = (abstract_model(_model)[2], STEM) if names == "layout" else \
        (None, {r"block\d/(up|down)/kernel$": "muon", "(stem|head)/kernel$": "adam"})
    state, losses, layout = _train({}, _tx(logical, routing), steps=8)
    assert losses[-1] < 0.7 * losses[0], losses
    masked = lambda x: isinstance(x, optax.MaskedNode)         # noqa: E731
    halves = {k: state.opt_state.inner_states[k].inner_state[0].mu for k in ("muon", "adam")}   # optax.partition's
    for rule, tree in halves.items():
        held = {k for k, v in flat(jax.tree.map(lambda x: 0 if masked(x) else 1, tree, is_leaf=masked)).items()
                if v == 1}
        assert held == {k for k, r in EXPECTED.items() if r == rule}, rule
    with pytest.raises(OptimizerError, match=r"'\^nope\$' matches no parameter; parameter paths are block1/"):
        jaxpar.init_train_state(_model, _tx(logical, {**routing, "^nope$": "adam"}), layout.mesh)


def _placed(sizes, placement):
    """Muon's placement options on ``sizes`` (None: XLA places Newton-Schulz)."""
    if placement is None:
        return {}
    mesh = mesh_for(sizes)
    return dict(placement=placement, mesh=mesh, specs=jaxpar.state_layout(_model, optax.identity(), mesh).opt_param_specs)


@need_devices(8)
@pytest.mark.parametrize("sizes,placement", [
    ({"fsdp": 8}, None),
    pytest.param({"fsdp": 8}, "owner", marks=pytest.mark.exhaustive),
    pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, "gather", marks=pytest.mark.exhaustive),
    ({"data": 2, "fsdp": 2, "tensor": 2}, "auto"),
    pytest.param({"data": 8}, "owner", marks=pytest.mark.exhaustive),
], ids=["fsdp8-xla", "fsdp8-owner", "dp2-fsdp2-tp2-gather", "dp2-fsdp2-tp2-auto", "dp8-owner"])
def test_a_user_model_under_a_layout_equals_one_device(sizes, placement):
    """3 steps: the first gradients as tests/helpers.py compares them, the Muon-routed kernels at the fp32 parameter
    standard, the AdamW-routed leaves with ``adam_atol`` (tests/test_muon.py)."""
    def run(sizes, place):
        tx = optax.chain(keep_grads(), _tx(abstract_model(_model)[2], STEM, **place))
        state, _, _ = _train(sizes, tx, steps=3)
        return flat(jax.device_get(state.params)), jax.device_get(state.opt_state[0].grads)

    (ref, ref_grads), (got, grads) = run({}, {}), run(sizes, _placed(sizes, placement))
    assert_grads_close(grads, ref_grads)
    g1 = flat(ref_grads)
    for k, rule in EXPECTED.items():
        extra = 0.0 if rule == "muon" else adam_atol(g1[k], ADAM_LR, 3, b2=0.95)
        diff = np.abs(got[k] - ref[k].astype(np.float64))
        assert (diff <= PARAM_RTOL * np.abs(ref[k]) + PARAM_ATOL + extra).all(), f"{rule} {k}: {diff.max():.3g}"


YAML = """\
base: {base}
model:
  target: {module}:SeqNet
  kwargs: {{channels: 4, embed: 16, mlp: 32, classes: 4}}
  loss: {module}:loss
mesh: {{data: 2, fsdp: 4, tensor: 1}}
data:
  kind: import
  target: {module}:batches
  kwargs: {{channels: 4, classes: 4}}
  batch_size: 16
optimizer:
  name: muon
  lr: 0.02
  weight_decay: 0.0
  warmup_steps: 0
  lr_schedule: constant
  muon: {{adam_lr: 3.0e-3, routing: {routing}}}
train: {{steps: 6, log_every: 1, eval_every: 6, eval_batches: 1, progress: none}}
checkpoint: {{enabled: false}}
logging: {{tensorboard: false}}
"""


def test_yaml_muon_routing_trains_a_user_model(tmp_path, capsys):
    """``optimizer.muon.routing`` routes the unnamed conv kernel; ``jaxpar train`` runs Muon on DP2 x FSDP4 and
    the loss falls. A pattern that matches no parameter is a usage error naming the key and the pattern."""
    from jaxpar.cli import main

    def config(routing):
        path = tmp_path / "muon.yaml"
        path.write_text(YAML.format(base=TESTS / "cli_mlp.yaml", module=TESTS / "muon_user_model.py",
                                    routing=json.dumps(routing)))
        return str(path)

    out = tmp_path / "run"
    assert main(["train", config(STEM), f"train.out_dir={out}"]) == 0
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0], losses
    capsys.readouterr()
    assert main(["train", config({**STEM, "^nope$": "muon"}), f"train.out_dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "'^nope$' matches no parameter" in err and "optimizer.muon.routing" in err, err
    assert main(["train", config({}), f"train.out_dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "'stem/kernel' of shape (3, 4, 16)" in err and "optimizer.muon.routing" in err, err
