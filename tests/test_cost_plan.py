"""The planner's known answers and its errors on bad input; pure Python."""
import pytest

from jaxpar import cost
from jaxpar.cost import ClusterError
from jaxpar.cost import cluster_from_dict
from jaxpar.cost import Link
from jaxpar.cost import PlanError
from jaxpar.cost._capacity import PLAN_MARGIN
from jaxpar.strategy import Strategy

GPT3 = cost.gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
GPT2 = cost.gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, batch=64)


@pytest.fixture(scope="module")
def gpt3_plans():
    """The published run's capacity: Megatron-LM's PyTorch may use the whole A100 (no JAX client's share)."""
    return cost.plan(GPT3, cost.load_cluster("a100_80gb", num_devices=1024), top=5, memory_fraction=1.0)


def test_gpt3_on_1024_a100s_uses_tensor_in_a_node_and_pipelines_across(gpt3_plans):
    """Narayanan et al. (2021): tensor parallelism inside the 8-GPU node, pipelines across nodes."""
    for e in gpt3_plans.ranked[:5]:
        assert 1 < e.plan.tensor <= 8, e.plan.name()
        assert e.plan.pipe > 1, e.plan.name()
    assert gpt3_plans.best.plan.tensor == 8


def test_gpt3_rejects_what_does_not_fit_with_the_reason(gpt3_plans):
    reasons = [r.reason for r in gpt3_plans.rejected]
    assert len(reasons) > 100 and all(r.startswith("needs ") and "with the 10% margin > 79.3 GiB usable (100% of "
                                      "79.3 GiB: the share given)" in r for r in reasons)
    # e.g. 8 stages x TP8 x DP16 without recomputation does not fit; the plan kept recomputes
    assert any(r.plan.name() == "pp8-1f1b-m8-dp16-tp8" for r in gpt3_plans.rejected)


def test_gpt2_on_8_gpus_prefers_plain_dp_or_zero_1_2():
    r = cost.plan(GPT2, cost.load_cluster("h100"))
    best = r.best.plan
    assert (best.pipe, best.fsdp, best.tensor) == (1, 1, 1) and best.data == 8 and best.strategy.zero in (0, 1, 2)


def test_memory_drives_rejection_and_remat():
    tiny = cost.load_cluster("tpu_v5e", num_devices=8)           # 16 GiB chips
    r = cost.plan(cost.gpt(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, batch=32), tiny)
    assert all(e.memory.total * (1 + PLAN_MARGIN) <= tiny.capacity.usable for e in r.ranked)
    assert any("needs" in x.reason for x in r.rejected)


# ----------------------------------------------------------------------------- bad input
def test_device_count_that_does_not_factor():
    with pytest.raises(PlanError, match=r"no factorisation .* 7 devices .*heads=12.*Fix"):
        cost.plan(GPT2, cost.load_cluster("h100", num_devices=7))


def test_model_that_fits_nowhere():
    huge = cost.gpt(layers=128, hidden=32768, heads=128, seq=8192, vocab=128000, batch=8)
    with pytest.raises(PlanError, match=r"fits on no plan of 8 x h100 .* Fix: more devices"):
        cost.plan(huge, cost.load_cluster("h100"))


def test_unknown_preset():
    with pytest.raises(ClusterError, match=r"unknown cluster preset 'h1000'; presets: .*h100.* path of a cluster YAML"):
        cost.load_cluster("h1000")


def test_negative_bandwidth():
    d = {"devices_per_node": 8, "device_memory_gib": 80, "peak_tflops": {"bfloat16": 989},
         "intra_node": {"alpha_us": 10, "bandwidth_gbps": -450}}
    with pytest.raises(ClusterError, match=r"intra_node.bandwidth_gbps=-450 must be a positive number of GB/s"):
        cluster_from_dict(d, "mine")
    with pytest.raises(ValueError, match=r"Link.beta=-1e-09: must be a finite number >= 0"):
        Link(alpha=1e-6, beta=-1e-9)


@pytest.mark.parametrize("key,value,match", [
    ("devices_per_node", 0, r"devices_per_node=0 must be an int >= 1"),
    ("device_memory_gib", -1, r"device_memory_gib=-1 must be a positive number"),
    ("efficiency", 1.5, r"efficiency=1.5 must be in \(0, 1\]"),
    ("typo", 1, r"unknown key\(s\) \['typo'\]"),
])
def test_bad_cluster_fields(key, value, match):
    d = {"devices_per_node": 8, "device_memory_gib": 80, "peak_tflops": {"bfloat16": 989},
         "intra_node": {"alpha_us": 10, "bandwidth_gbps": 450}, key: value}
    with pytest.raises(ClusterError, match=match):
        cluster_from_dict(d, "mine")


def test_bad_model_and_plan_fields():
    with pytest.raises(ValueError, match=r"ModelSpec\(heads=0\): must be an int >= 1"):
        cost.gpt(layers=2, hidden=32, heads=0, seq=16, vocab=64, batch=8)
    with pytest.raises(ValueError, match=r"hidden=30 is not divisible by heads=8"):
        cost.gpt(layers=2, hidden=30, heads=8, seq=16, vocab=64, batch=8)
    with pytest.raises(ValueError, match=r"Plan.strategy.schedule='pipedream-2bw': the cost model knows gpipe, 1f1b"):
        cost.Plan(pipe=2, strategy=Strategy(schedule="pipedream-2bw", microbatches=2))
    with pytest.raises(ClusterError, match=r"no peak_tflops.float16"):
        cost.plan(GPT2, cost.load_cluster("h100"), dtype="float16")
