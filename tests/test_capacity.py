"""The one capacity rule (jaxpar.cost._capacity): plan, inspect and check print the same usable bytes for a
target; plan ranks only plans that fit with the margin; inspect never suggests the plan it showed not to fit (the
same fields, whatever the label).
Nothing compiles but an `x + 1`
for inspect's capacity line."""
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxpar import cost
from jaxpar.cli import main
from jaxpar.cost._capacity import PLAN_MARGIN, device_capacity
from jaxpar.devices import parse_target
from jaxpar.errors import ClusterError
from jaxpar.plan import fit_lines, fitting_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

H100 = "59.3 GiB usable (75% of 79.1 GiB: XLA_PYTHON_CLIENT_MEM_FRACTION)"
GPT2 = ["--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024", "--vocab", "50304", "--batch", "64"]


@pytest.fixture(autouse=True)
def _jax_default_fraction(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)


def test_plan_inspect_and_check_print_one_capacity_for_a_target(capsys, tmp_path):
    tgt = parse_target("h100:1x8")
    assert tgt.capacity.text() == H100 == cost.load_cluster("h100").capacity.text()   # preset = target's bytes
    assert main(["plan", *GPT2, "--target", "h100:1x8"]) == 0
    planned = capsys.readouterr().out
    inspected = "\n".join(fit_lines(jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile(), tgt)[1])
    gpu = str(CONFIGS / "gpt124m_gpu.yaml")
    small = ["model.layers=1", "model.embed=64", "model.heads=2", "model.vocab=512", f"train.out_dir={tmp_path}"]
    assert main(["check", gpu, *small, "--target", "h100:1x8"]) == 0
    checked = capsys.readouterr().out
    for text in (planned, inspected, checked):
        assert f"capacity {H100}" in text, text


def test_the_fraction_is_the_environments(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert parse_target("h100:1x8").capacity.text() == "71.2 GiB usable (90% of 79.1 GiB: XLA_PYTHON_CLIENT_MEM_FRACTION)"
    assert parse_target("tpu-v5e:2x2").capacity.text() == "16.0 GiB usable (all of the device memory)"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ClusterError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' is not a fraction in \(0, 1\]"):
        device_capacity(2**30, "cuda")


def test_plans_ranked_fit_with_the_margin_and_the_rest_say_why():
    cluster = cost.load_cluster("h100")
    r = cost.plan(cost.gpt(layers=32, hidden=4096, heads=32, seq=4096, vocab=128256, batch=64), cluster)
    assert r.ranked and all(e.memory.total * (1 + PLAN_MARGIN) <= cluster.capacity.usable for e in r.ranked)
    assert all(e.fits for e in r.ranked)
    too_big = [x.reason for x in r.rejected if x.reason.startswith("needs ")]
    assert too_big and all(f"with the {PLAN_MARGIN:.0%} margin > {H100}" in x for x in too_big)


def test_fitting_plan_skips_the_plan_shown_not_to_fit():
    """The plan shown is excluded by its fields: inspect's plan carries the config's compute dtype, so its label
    (``...-bfloat16``) is not the planner's; the suggestion names its rank in ``jaxpar plan``'s table, its
    overrides as ``plan`` prints them, and that no compile has checked it."""
    import shlex

    from jaxpar.plan import PlanOptions, on_target, plan_overrides, rank_plans, same_plan

    tgt = parse_target("h100:1x8")
    model = cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64)
    options = PlanOptions(precision="fp32", lowering="xla")
    ranked = rank_plans(model, on_target(cost.load_cluster("h100"), tgt), options).ranked
    first, second = ranked[0].plan, ranked[1].plan
    assert f": {first.name()} (jaxpar plan's #1)" in fitting_plan(model, tgt, options)
    shown = first.with_strategy(compute_dtype="bfloat16")
    assert shown.name() == first.name() + "-bfloat16" and same_plan(shown, first)
    text = fitting_plan(model, tgt, options, shown=shown)
    line, pasted = text.splitlines()
    assert f": {second.name()} (jaxpar plan's #2)" in line and f": {first.name()} (" not in line and H100 in line
    assert "not verified: no compile has checked it" in line
    assert pasted == "         overrides " + shlex.join(plan_overrides(second))
    only = fitting_plan(model, tgt, options, shown=shown, overrides=lambda p: [f"mesh.data={p.data}"])
    assert only.splitlines()[1] == f"         overrides mesh.data={second.data}"


def test_plans_are_the_same_by_their_fields_not_their_labels():
    """Mesh sizes, remat and the modelled strategy fields that act on the sizes decide; the dtype in a label and a
    field that does nothing on the sizes (ZeRO without ``data``, a schedule without a pipeline) do not."""
    from jaxpar.options import Fp8
    from jaxpar.plan import same_plan
    from jaxpar.strategy import Strategy

    plan = cost.Plan(fsdp=8, remat="save-matmuls", strategy=Strategy(fp8=Fp8()))
    assert same_plan(plan, plan.with_strategy(compute_dtype="bfloat16", schedule="gpipe", zero=3))
    for other in (cost.Plan(data=8, remat="save-matmuls", strategy=Strategy(fp8=Fp8())),     # another mesh
                  cost.Plan(fsdp=8, remat="full", strategy=Strategy(fp8=Fp8())),             # another remat
                  cost.Plan(fsdp=8, remat="save-matmuls"),                                    # without FP8
                  cost.Plan(fsdp=8, remat="save-matmuls", strategy=Strategy(fp8=Fp8(min_dim=512))),
                  cost.Plan(fsdp=8, remat="save-matmuls", strategy=Strategy(fp8=Fp8(), microbatches=2))):
        assert not same_plan(plan, other), other.name()
    piped = cost.Plan(pipe=2, data=4, strategy=Strategy(microbatches=4, schedule="1f1b", zero=1))
    assert not same_plan(piped, piped.with_strategy(schedule="zb-h1"))
    assert not same_plan(piped, piped.with_strategy(zero=2))
    assert same_plan(None, None) and not same_plan(piped, None)


def test_fitting_plan_says_when_none_is_known_to_fit():
    huge = cost.gpt(layers=128, hidden=32768, heads=128, seq=8192, vocab=128000, batch=8)
    line = fitting_plan(huge, parse_target("h100:1x8"), most=1)
    assert line.startswith("plan     no plan is known to fit")
