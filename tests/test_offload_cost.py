"""Memory offloading in the cost model and the planner (jaxpar/cost/_host_link.py, docs/planning.md §12):
the host bytes and the transfers per step against programs compiled deviceless for H100, the planner's
proposal when nothing fits, and what it refuses."""
from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest

from jaxpar import cost
from jaxpar.cost._host_link import host_bytes, transfer_bytes
from jaxpar.cost._time import update_bytes
from jaxpar.options import LAYER_INPUT, Offload
from jaxpar.strategy import Strategy

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
GPT = ["model.layers=2", "model.embed=128", "model.heads=4", "model.vocab=256", "model.seq_len=64",
       "data.batch_size=16", "train.devices=0", "mesh.tensor=1", "optimizer.clip_norm=null", "train.on_nonfinite=stop"]
YAML = {"opt": "{optimizer: true}", "opt-host": "{optimizer: true, update: host}",
        "opt-master-host": "{optimizer: true, master: true, update: host}"}
KINDS = {"opt": Offload(optimizer=True), "opt-host": Offload(optimizer=True, update="host"),
         "opt-master-host": Offload(optimizer=True, master=True, update="host")}
#: The step's scalars that the host update also copies (a predicate the update reads): at most these bytes.
SCALARS = 8


def _compiled(mesh: dict, zero: int, offload: str | None, extra: tuple = ()):
    """The quickstart GPT's step compiled for h100:1x8 on ``mesh`` (``extra``: more overrides):
    ``(memory_report, host_transfers, the bytes of the optimizer state's scalars)``."""
    import jax

    from jaxpar.analysis._compiled_memory import host_transfers, memory_report
    from jaxpar.config import load_config
    from jaxpar.config._job import build_job
    from jaxpar.devices import parse_target, target_devices

    over = GPT + [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp")] + [f"parallel.zero={zero}"]
    cfg = load_config(QUICKSTART, over + [f"parallel.offload={YAML.get(offload, '{}')}", *extra])
    job = build_job(cfg, target_devices(parse_target("h100:1x8")), data=False)
    layout = job.state_layout()
    with jax.set_mesh(job.mesh):          # a target's devices list no memories: the abstract mesh's shardings
        step = job.compile(layout)["step"]
    scalars = sum(a.dtype.itemsize for a in jax.tree.leaves(layout.opt_shapes) if a.ndim == 0)
    return memory_report(step), host_transfers(step.as_text()), scalars


@pytest.mark.slow       # 3 or 4 deviceless H100 compiles per mesh (~45 s on 2 cores)
@pytest.mark.parametrize("mesh,zero", [({"data": 8}, 0), ({"data": 8}, 1), ({"fsdp": 8}, 0)])
def test_host_bytes_transfers_and_the_saving_match_the_compiled_step(mesh, zero):
    """The cost model's host-resident bytes equal the compiled program's host arguments; its transfers per
    step equal the program's copies (up to the step's scalars); the host update lowers the device peak by at
    least the optimizer state it keeps off the device (the memory model's saving), the device update not."""
    model = cost.gpt(2, 128, 4, 64, 256, 16)
    plain, _, _ = _compiled(mesh, zero, None)
    for kind in ("opt", "opt-host") + (("opt-master-host",) if zero == 0 else ()):
        plan = cost.Plan(data=mesh.get("data", 1), fsdp=mesh.get("fsdp", 1),
                         strategy=Strategy(zero=zero, offload=KINDS[kind]))
        report, moved, scalars = _compiled(mesh, zero, kind)
        # the model counts the arrays; the state's scalars (update counts, the learning rate) on top
        assert report.host_argument_bytes == host_bytes(model, plan) + scalars, kind
        streamed = scalars if KINDS[kind].update == "device" else 0            # the state's scalars stream too
        predicted = {k: v + streamed for k, v in transfer_bytes(model, plan).items()}
        reuse = predicted["to_device"] / 2 if kind == "opt-master-host" else 0     # XLA may reuse the stream-in
        assert 0 <= moved["to_host"] - predicted["to_host"] <= SCALARS, (kind, moved, predicted)
        assert -reuse <= moved["to_device"] - predicted["to_device"] <= SCALARS, (kind, moved, predicted)
        saved = plain.required_bytes - report.required_bytes
        opt = cost.memory_per_device(model, plan.with_strategy(offload=None), precision="fp32").opt
        if KINDS[kind].update == "host":
            assert saved >= opt, (kind, saved, opt)
        else:
            assert saved <= 0, (kind, saved)          # the state streams in for the step: no saving at the peak


@pytest.mark.slow       # 2 deviceless H100 compiles (~20 s on 2 cores)
def test_offloaded_activations_move_each_layers_input_and_leave_the_device():
    """Remat ``offload`` with the layer inputs offloaded: the compiled step writes each layer's input into a
    host buffer in the forward and reads it back in the backward (the GPU compiler's asynchronous slices of
    a host buffer), so it moves the layers' inputs each way, holds them in host memory, and needs about as
    much less device memory for temporaries as full recomputation, which keeps them on the device. The cost
    model's transfers and host bytes are the compiled program's, and its device activations fall by them."""
    layers, rows, seq, embed = 2, 16 // 8, 64, 128          # GPT, data.batch_size over mesh.data
    full, _, _ = _compiled({"data": 8}, 0, None, ("model.remat=full",))
    report, moved, _ = _compiled({"data": 8}, 0, None, ("model.remat=offload",
                                                     "parallel.offload={activations: [jaxpar_layer_input]}"))
    inputs = layers * rows * seq * embed * 4
    assert moved == {"to_host": inputs, "to_device": inputs}
    assert report.host_temp_bytes == inputs
    # full recomputation keeps the inputs on the device; the offloaded program 1 KiB of staging beside them
    assert full.temp_bytes - report.temp_bytes == pytest.approx(inputs, rel=0.01)
    model, acts = cost.gpt(2, 128, 4, 64, 256, 16), Offload(activations=(LAYER_INPUT,))
    plan = cost.Plan(data=8, remat="full", strategy=Strategy(offload=acts))
    assert transfer_bytes(model, plan, activation_bytes=4) == moved
    offloaded = cost.memory_per_device(model, plan, precision="fp32", activation_bytes=4)
    kept = cost.memory_per_device(model, plan.with_strategy(offload=None), precision="fp32", activation_bytes=4)
    assert offloaded.host == report.host_temp_bytes
    assert kept.activations - offloaded.activations == inputs and kept.total - offloaded.total == inputs


@pytest.mark.slow       # 2 deviceless H100 compiles of a 120 M-parameter Decoder (~15 s on 2 cores)
def test_one_devices_host_update_keeps_the_gradients_off_the_device():
    """On one device (no gradient reduction) the host update's compiled step writes the gradients to host
    memory as the backward makes them and holds the parameters' bf16 copy instead: it saves the optimizer
    state and the gradients less that copy, as the memory model says (within 10%), and the model does not
    predict less than the compiled peak."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.analysis._compiled_memory import memory_report
    from jaxpar.devices import parse_target, target_devices
    from jaxpar.models import Decoder, DecoderConfig, decoder_loss

    cfg = DecoderConfig(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=3584, layers=4, remat="full")
    mesh = jaxpar.make_mesh({"data": 1}, devices=target_devices(parse_target("h100:1x1")))
    tx, peaks = optax.adamw(3e-4, weight_decay=0.1), []
    for offload in (None, KINDS["opt-host"]):
        strategy = jaxpar.Strategy(compute_dtype="bfloat16", offload=offload)
        layout = jaxpar.state_layout(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy)
        with jax.set_mesh(mesh):
            tokens = jax.ShapeDtypeStruct((1, 1024), np.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
            step = jaxpar.make_train_step(decoder_loss, tx, layout, strategy)
            peaks.append(memory_report(step.lower(layout.abstract_state(), {"tokens": tokens, "targets": tokens})
                                       .compile()).required_bytes)
    n = sum(a.size for a in jax.tree.leaves(layout.abstract_state().params))
    mlp = (n - 2 * 32000 * 1024) // 4 // 2048 - 2048          # the cost model's GPT with the Decoder's parameters
    model = cost.gpt(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, batch=1, mlp=mlp)
    plans = (cost.Plan(remat="full", strategy=Strategy(offload=o)) for o in (None, KINDS["opt-host"]))
    plain, host = (cost.memory_per_device(model, p, precision="fp32") for p in plans)
    assert host.grads == plain.params / 2 and host.opt == 0           # the bf16 copy; the moments on the host
    assert plain.total - host.total == pytest.approx(peaks[0] - peaks[1], rel=0.1)
    assert host.total >= peaks[1]


def test_the_measured_table_takes_offloads_rule_from_offloaded():
    """One estimator: ``memory_per_device`` with a compiler's measured table (``keeps="cuda"``) applies
    ``offloaded``'s rule as the paper's table does: offloaded layer inputs move to the host, the host update keeps
    the moments there, and on one device the gradients too."""
    m, acts = cost.gpt(2, 64, 4, 32, 128, 8), Offload(activations=(LAYER_INPUT,))
    plan = cost.Plan(data=2, remat="full", strategy=Strategy(offload=acts))
    moved, kept = (cost.memory_per_device(m, p, precision="fp32", activation_bytes=4, keeps="cuda")
                   for p in (plan, plan.with_strategy(offload=None)))
    assert moved.activations == 0 and moved.host == kept.activations > 0
    assert moved.total == kept.total - kept.activations
    one = cost.Plan(strategy=Strategy(offload=KINDS["opt-host"]))
    for p in (one, replace(one, data=2), one.with_strategy(microbatches=2)):
        host, plain = (cost.memory_per_device(m, q, precision="fp32", activation_bytes=4, keeps="cuda")
                       for q in (p, p.with_strategy(offload=None)))
        assert host.opt == 0 and host.host >= plain.opt > 0
        assert host.grads == (0 if p.unsplit else plain.grads)


def test_the_plan_models_offloaded_layer_inputs_under_full_recomputation_alone():
    """``Plan.offload.activations`` is the layers' inputs under ``remat="full"`` (the model's ``offload``
    policy); another name, or another remat, is a ``PlanError`` naming it. A strategy's offload becomes the
    plan's (:func:`plan_offload`), and the plan's overrides give the config back."""
    from jaxpar.plan import plan_overrides
    from jaxpar.cost._host_link import plan_offload

    acts = Offload(activations=(LAYER_INPUT,))
    with pytest.raises(cost.PlanError, match=r"activations=\('mlp_out',\): the cost model models the layers' inputs"):
        cost.Plan(remat="full", strategy=Strategy(offload=Offload(activations=("mlp_out",))))
    with pytest.raises(cost.PlanError, match=r"activations with remat='save-matmuls'.*set remat='full'"):
        cost.Plan(remat="save-matmuls", strategy=Strategy(offload=acts))
    offload = plan_offload(Offload(optimizer=True, activations=(LAYER_INPUT,)), "offload")
    plan = cost.Plan(data=8, remat="full", strategy=Strategy(offload=offload))
    assert plan.name() == "dp8-offload-opt-act-remat-full"
    assert plan_overrides(plan)[-3:] == ["parallel.offload={optimizer: true, master: false, activations: "
                                         "[jaxpar_layer_input], update: device}", "parallel.stage_layers=null",
                                         "model.remat=offload"]
    model = cost.gpt(2, 128, 4, 64, 256, 16)
    t = cost.step_time(model, plan, cost.load_cluster("h100", num_devices=8))
    moved = transfer_bytes(model, plan)
    assert t.offload == pytest.approx((moved["to_host"] + moved["to_device"]) / cost.load_cluster("h100").host_link)
    assert moved["to_host"] - host_bytes(model, plan) == 2 * 16 // 8 * 64 * 128 * 2     # layers x rows x s x h x bf16


def test_the_planner_proposes_offload_only_when_nothing_fits_and_states_the_slowdown():
    """A GPT of 6.8 B parameters does not fit one H100 in fp32 with Adam (16 bytes per parameter); with the
    optimizer state on the host it does. The estimate carries the link's and the host update's seconds and
    the step without offload. A model that fits is planned without offload."""
    big = cost.gpt(32, 4096, 32, 1024, 50304, 4)
    h100 = cost.load_cluster("h100", num_devices=1)
    best = cost.plan(big, h100, precision="fp32").best
    plan = best.plan
    assert plan.strategy.offload == KINDS["opt-host"] and best.fits
    t = best.time
    moved = transfer_bytes(big, plan)
    assert t.offload == pytest.approx((moved["to_host"] + moved["to_device"]) / h100.host_link)
    assert t.optimizer == pytest.approx(update_bytes(big, plan, 4) / h100.host_memory_bandwidth)
    without = cost.step_time(big, plan.with_strategy(offload=None), h100)
    assert best.without_offload == pytest.approx(without.total) and best.without_offload < t.total
    assert best.memory.opt == 0 and best.memory.host == cost.memory_per_device(
        big, plan.with_strategy(offload=None), precision="fp32").opt
    small = cost.plan(cost.gpt(2, 256, 4, 128, 512, 8), h100, precision="fp32").best.plan
    assert small.strategy.offload is None


def test_the_planner_offloads_the_layer_inputs_when_the_state_alone_is_not_enough():
    """A 6.9 B GPT at 2 x 32768 tokens on one H100 (59.3 GiB usable): with the optimizer state on the host and
    full recomputation the layers' inputs still do not fit; the planner moves them to the host too (the model's
    ``offload`` policy) and the same plan with them on the device does not fit."""
    model, h100 = cost.gpt(32, 4096, 32, 32768, 32000, 2), cost.load_cluster("h100", num_devices=1)
    best = cost.plan(model, h100, precision="fp32").best
    offload = best.plan.strategy.offload
    assert best.fits and best.plan.remat == "full" and offload.activations == (LAYER_INPUT,) and offload.host_update
    kept = best.plan.with_strategy(offload=replace(offload, activations=()))
    assert not cost.evaluate(model, kept, h100, precision="fp32").fits
    assert best.memory.host > host_bytes(model, best.plan)         # the layers' inputs beside the state


def test_the_planner_refuses_offload_where_the_library_does_not_run_it():
    """Muon's update does not run in host memory; a cluster without a host link cannot time it; relaxed
    synchronisation refuses offloading by the compatibility table: no offloaded plan then."""
    from jaxpar.cost._planner import plan_refusal

    big = cost.gpt(32, 4096, 32, 1024, 50304, 4)
    h100 = cost.load_cluster("h100", num_devices=1)
    with pytest.raises(cost.PlanError, match="fits on no plan"):
        cost.plan(big, h100, precision="fp32", muon={"ns_steps": 5, "placement": "gather"})
    with pytest.raises(cost.PlanError, match="Muon's update does not run in host memory"):
        cost.plan(big, h100, precision="fp32", offload=True, muon={"ns_steps": 5, "placement": "gather"})
    with pytest.raises(cost.PlanError, match="models no host link"):
        cost.plan(big, cost.load_cluster("tpu_v5e", num_devices=1), offload=True)
    from jaxpar.parallel.sync import local_sgd

    why = plan_refusal(cost.Plan(data=2, strategy=Strategy(offload=KINDS["opt-host"])), fixed={"sync": local_sgd(4)})
    assert why is not None and "offload" in why


def test_jaxpar_plan_proposes_offload_for_a_model_larger_than_one_gpu():
    """``jaxpar plan`` on one H100 for a model that does not fit: the offloaded plan, the predicted step,
    its host link and the slowdown."""
    from jaxpar.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "1024", "--vocab",
                     "50304", "--batch", "4", "--cluster", "h100", "--devices", "1", "--precision", "fp32"])
    out = buf.getvalue()
    assert code == 0, out
    line = next(l for l in out.splitlines() if l.startswith("offload  proposed"))
    assert "parallel.offload={optimizer: true, master: false, activations: [], update: host}" in line, line
    assert "x slower" in line, line
    assert "offload-opt-host" in out.splitlines()[6], out          # the best plan (after model, cluster, capacity)


@pytest.mark.slow       # one compile per optimizer on 2 CPU devices (~7 s on 2 cores)
def test_the_host_update_refusals_are_the_optimizers_that_do_not_run_in_host_memory():
    """:data:`HOST_UPDATE_REFUSED` is exactly the optimizers whose host update the library refuses."""
    import jax

    from jaxpar.compat._offload_rules import HOST_UPDATE_REFUSED
    from jaxpar.config import OPTIMIZERS, load_config
    from jaxpar.config._job import build_job
    from jaxpar.errors import OffloadError

    refused = []
    for name in OPTIMIZERS:
        cfg = load_config(QUICKSTART, GPT + ["mesh.data=2", "mesh.fsdp=1", "train.devices=2", f"optimizer.name={name}",
                                             "parallel.offload={optimizer: true, update: host}"])
        job = build_job(cfg, jax.devices()[:2], data=False)
        try:
            job.compile(job.state_layout())
        except OffloadError:
            refused.append(name)
    assert tuple(sorted(refused)) == tuple(sorted(HOST_UPDATE_REFUSED))


def test_a_preset_without_a_host_link_times_offload_without_it_and_says_so():
    """cpu_sim and the TPU presets have no host_link_gbps / host_memory_gbps: an offloaded plan's time leaves
    those terms out (0 s) and names them in ``StepTime.unmodelled``, instead of refusing the plan."""
    model = cost.gpt(2, 64, 4, 32, 256, 8)
    plan = cost.Plan(data=8, strategy=Strategy(offload=KINDS["opt-host"]))
    sim = cost.load_cluster("cpu_sim")
    t, plain = (cost.step_time(model, p, sim, dtype="float32") for p in (plan, plan.with_strategy(offload=None)))
    assert t.offload == 0.0 and t.total == pytest.approx(plain.total) and not plain.unmodelled
    assert t.unmodelled == ("host transfers not modelled: cluster cpu_sim has no host link (host_link_gbps)",
                            "the host update not modelled: cluster cpu_sim has no host memory bandwidth "
                            "(host_memory_gbps), so the update is timed as on the device")
    assert cost.evaluate(model, plan, sim, dtype="float32").row()["unmodelled"] == list(t.unmodelled)
    assert not cost.step_time(model, plan, cost.load_cluster("h100", num_devices=8)).unmodelled


def test_train_offloads_on_the_cpu_mesh_and_says_what_the_prediction_lacks(tmp_path, capsys):
    """``jaxpar train configs/quickstart.yaml parallel.offload.optimizer=true`` trains on the simulated CPU mesh
    (docs/strategies.md: exact on every platform) although cpu_sim models no host link; its ``predict`` line
    says what the prediction lacks."""
    import json

    from jaxpar.cli import main

    out = tmp_path / "run"
    assert main(["train", str(QUICKSTART), "parallel.offload.optimizer=true", "train.steps=2", "train.log_every=1",
                 "train.eval_every=0", "train.eval_batches=0", f"train.out_dir={out}", "train.progress=none",
                 "model.embed=32", "model.layers=1", "model.seq_len=16", "data.batch_size=8",
                 "data.max_bytes=200000", "optimizer.warmup_steps=0", "checkpoint.enabled=false",
                 "logging.samples=0", "logging.tensorboard=false"]) == 0
    text = capsys.readouterr().out
    assert "strategy dp2-fsdp2-tp2-offload-opt" in text
    predict = next(line for line in text.splitlines() if line.startswith("predict"))
    assert predict.startswith("predict  cost model on cpu_sim: peak ") and predict.endswith(
        "; host transfers not modelled: cluster cpu_sim has no host link (host_link_gbps)"), predict
    summary = json.loads((out / "summary.json").read_text())
    assert summary["end_step"] == 2 and summary["memory"]["predicted_peak_bytes"] > 0
