"""``jaxpar plan`` and ``jaxpar inspect`` from the command line (in-process, 8 simulated devices).

``inspect`` compiles the quickstart config's train step ahead of time (about 20-40 s here) and
must print the sharding table, the collectives and the memory report next to the cost model,
without running a step (no output directory is written).
"""
import json
import re
import shlex

import pytest

from jaxpar.cli import main
from jaxpar.config import load_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inspected(tmp_path_factory):
    import contextlib
    import io

    out_dir = tmp_path_factory.mktemp("inspect") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["inspect", str(ROOT / "configs" / "quickstart.yaml"), f"train.out_dir={out_dir}"])
    return code, buf.getvalue(), out_dir


def test_inspect_prints_shardings_collectives_and_memory_next_to_the_model(inspected):
    code, out, out_dir = inspected
    print(out)
    assert code == 0
    assert "strategy dp2-fsdp2-tp2" in out
    # the sharding table: one row per parameter, with the mesh axes of params / grads / optimizer moments
    row = next(line for line in out.splitlines() if line.startswith("blocks/w1 "))
    assert re.search(r"\(layers, embed, mlp\)\s*\|\s*\(-, fsdp, tensor\)", row), row
    assert "collectives of the compiled step" in out and "all-reduce | tensor" in out
    # predicted vs compiled, per device: bytes per mesh axis and arguments agree
    for what, tol in (("bytes over data per step", 0.05), ("bytes over fsdp per step", 0.05),
                      ("bytes over tensor per step", 0.05), ("arguments (state + batch)", 0.02)):
        line = next(x for x in out.splitlines() if x.startswith(what))
        ratio = float(line.rsplit("|", 1)[1])
        assert abs(ratio - 1) <= tol, line
    assert re.search(r"time     predicted [\d.]+ ms per step on cpu_sim", out)
    assert not out_dir.exists(), "inspect must not train (nor write the run directory)"


def test_inspect_without_a_device_count_names_the_fix(capsys):
    code = main(["inspect", str(ROOT / "configs" / "quickstart.yaml"), "train.devices=0", "mesh.data=-1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "train.devices=0" in err and "set train.devices=N" in err


def test_inspect_with_other_devices_than_the_session_is_an_error(capsys):
    """The backend is up with 8 devices (conftest); a 4-device config cannot be simulated in-process."""
    assert len(__import__("jax").devices()) == 8       # up, whichever test of the worker ran first
    code = main(["inspect", str(ROOT / "configs" / "quickstart.yaml"), "train.devices=4", "mesh.data=1"])
    assert code == 2
    assert "train.devices=4" in capsys.readouterr().err


def test_plan_json_and_table(capsys):
    args = ["plan", "--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024", "--vocab", "50304",
            "--batch", "64", "--cluster", "h100", "--top", "3"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] == 8 and len(data["ranked"]) == 3
    assert data["ranked"][0]["plan"].startswith("dp8")
    assert sorted(data["ranked"], key=lambda r: r["step_s"]) == data["ranked"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rank | plan" in out and "considered" in out


def test_plan_overrides_paste_and_write_a_config_check_accepts(capsys, tmp_path):
    """Every ranked plan carries its overrides (all in --json; in the table, those the config lacks), in the
    model's remat names; --write writes the config with the chosen plan's, which check accepts on the target,
    and never overwrites a file."""
    config, out = str(ROOT / "configs" / "gpt124m_gpu.yaml"), tmp_path / "plan.yaml"
    args = ["plan", "--config", config, "--target", "h100:1x8", "--top", "3"]
    assert main(args + ["--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert all({"mesh.data", "parallel.zero", "parallel.microbatches", "model.remat"} <= {
        o.split("=")[0] for o in r["overrides"]} for r in ranked), ranked
    assert main(args + ["--write", str(out), "--choose", "2"]) == 0
    table = capsys.readouterr().out
    second = shlex.split(re.search(r"^\s+2  (.+)$", table, re.M).group(1))
    assert second and all(o in [*ranked[1]["overrides"]] for o in second), (second, ranked[1])
    assert "selective" not in table and f"wrote    {out}: {ranked[1]['plan']}" in table
    assert main(["check", str(out), "--target", "h100:1x8"]) == 0
    capsys.readouterr()
    written = out.read_text()                  # the keys off jaxpar's defaults; the run is the new file's
    assert len(written.splitlines()) < 60 and "out_dir" not in written and "gpt124m" not in written.split("\n", 1)[1]
    assert load_config(out).train.out_dir == "runs/plan"
    assert main(args + ["--write", str(out)]) == 2
    assert "the file exists; jaxpar never overwrites a file" in capsys.readouterr().err


def test_plan_searches_context_parallel_degrees_and_methods(capsys):
    """16k tokens, 6 heads, on the calibrated CPU mesh: --contexts 1,2,4,8 ranks the balanced ring over 8
    devices first (one device cannot hold the scores); Ulysses over 4 or 8 is refused by name (6 heads)."""
    cluster = str(ROOT / "configs" / "clusters" / "cpu_sim.yaml")
    assert main(["plan", "--layers", "2", "--hidden", "48", "--heads", "6", "--seq", "16384", "--vocab", "256",
                 "--batch", "1", "--cluster", cluster, "--contexts", "1,2,4,8", "--dtype", "float32",
                 "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+1 \| cp8-ring-bal ", out, re.M), out
    assert "ulysses needs heads % (context * tensor) == 0: heads=6, context=4" in out, out


def test_plan_ranks_expert_parallel_degrees_of_an_moe_config(capsys):
    """configs/moe.yaml (8 experts): the planner searches expert 1, 2, 4, 8 with the other axes, and the
    table carries the all-to-all time and bytes over expert."""
    assert main(["plan", "--config", str(ROOT / "configs" / "moe.yaml"), "--cluster", "cpu_sim", "--dtype", "float32",
                 "--precision", "fp32", "--top", "400"]) == 0
    out = capsys.readouterr().out
    ranked = re.findall(r"^\s+\d+ \| (\S+)", out, re.M)
    assert {m.group(1) for p in ranked if (m := re.search(r"ep(\d)", p))} == {"2", "4", "8"}, ranked
    assert any("ep" not in p for p in ranked) and re.search(r"expert:\d", out), out


def test_plan_errors_name_the_fix(capsys):
    assert main(["plan", "--layers", "12", "--hidden", "768"]) == 2
    assert "missing --heads, --seq, --vocab, --batch" in capsys.readouterr().err
    assert main(["plan", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--cluster", "nope"]) == 2
    assert "unknown cluster preset 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_reports_the_experts_routed_flops_against_every_expert_on_every_token(capsys):
    """configs/moe.yaml dropless (data 2 x expert 4, 2 layers of 8 experts of 128 -> 256, top-2): the routed
    rows' GEMM FLOPs read from the compiled step's tile loops are the formula's, 12 D M a row and layer
    (2 GEMMs forward, 4 backward); the loops at their bound within a tile a local expert of it."""
    code = main(["inspect", str(ROOT / "configs" / "moe.yaml"), "model.moe.capacity_factor=null"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("experts "))
    bound, routed, every = (float(v) * 1e9 for v in re.findall(r"([\d.]+) GFLOP", line)[:3])
    rows = 32 * 64 // 8 * 2                         # a device's tokens x top-2
    assert routed == pytest.approx(12 * 128 * 256 * 2 * rows, rel=0.01), line
    assert every == pytest.approx(routed * 8 / 2, rel=0.01) and routed < bound <= routed * (1 + 2 * 32 / rows), line


#: A tiny Llama (2 layers of 32, 4 query / 2 K/V heads, SwiGLU 64, vocab 128) and a tiny Qwen3-MoE (8 experts of
#: 16, top-2), each a ``config.json`` without weights for ``model.hf`` (jaxpar starts from random ones).
TINY_HF = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
                  max_position_embeddings=64, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=32, head_dim=8,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], num_hidden_layers=2, max_window_layers=2, vocab_size=128,
                      max_position_embeddings=64, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False),
}


def tiny_hf_config(tmp_path, family: str, dtype: str = "bfloat16") -> str:
    """A config of :data:`TINY_HF`'s ``family`` on 8 simulated devices (FSDP), 16 tokens a sequence, batch 16."""
    hf = tmp_path / family
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(TINY_HF[family]))
    config = tmp_path / f"tiny_{family}.yaml"
    config.write_text(f"base: {ROOT / 'configs' / 'quickstart.yaml'}\n"
                      f"model: {{name: tiny-{family}, hf: {hf}, seq_len: 16, remat: none, scan_layers: true}}\n"
                      "mesh: {data: 1, fsdp: -1, tensor: 1, pipe: 1}\n"
                      f"parallel: {{zero: 0, microbatches: 1, compute_dtype: {dtype}}}\n"
                      f"data: {{kind: synthetic, batch_size: 16}}\ntrain: {{devices: 8, out_dir: {tmp_path / 'run'}}}\n"
                      "logging: {samples: 0}\n")
    return str(config)


def test_plan_and_inspect_rank_through_one_call_with_equal_options(monkeypatch, capsys):
    """``plan --config C --target T`` and ``inspect C --target T``'s suggestion call the planner alike: the
    config's compute dtype, FP8 options, Muon, offload, precision and the target's lowering (inspect used to plan
    in bfloat16, the ideal lowering, without the config's FP8 options)."""
    from jaxpar import cost
    from jaxpar.commands._inspect_command import suggested_plan
    from jaxpar.config import load_config
    from jaxpar.config._cost_model import cost_model
    from jaxpar.devices import parse_target

    calls, real = [], cost.plan
    monkeypatch.setattr(cost, "plan", lambda model, cluster, **kw: calls.append((model, cluster, kw)) or
                        real(model, cluster, **kw))
    config = str(ROOT / "configs" / "gpt124m_gpu.yaml")
    fp8 = ["parallel.fp8={recipe: rowwise, min_dim: 512}"]
    assert main(["plan", "--config", config, *fp8, "--target", "h100:1x8", "--top", "1"]) == 0
    planned = capsys.readouterr().out
    cfg, tgt = load_config(config, fp8), parse_target("h100:1x8")
    text = suggested_plan(cfg, cost_model(cfg), tgt, None)
    (m1, c1, by_plan), (m2, c2, by_inspect) = calls
    assert m1 == m2 and c1 == c2 and {**by_plan, "top": 0} == {**by_inspect, "top": 0}
    assert by_plan["dtype"] == "bfloat16" and by_plan["lowering"] == "xla" and by_plan["precision"] == "fp32"
    assert by_plan["fp8_options"].recipe == "rowwise" and by_plan["fp8_options"].min_dim == 512
    best = re.search(r"^\s+1 \| (\S+)", planned, re.M).group(1)
    assert f": {best} (jaxpar plan's #1)" in text
    pasted = re.search(r"^\s+1  (.+)$", planned, re.M).group(1)        # plan's overrides line for #1
    assert text.splitlines()[1] == f"         overrides {pasted}"


def test_plan_mfu_is_against_the_peak_each_gemm_runs_at(capsys):
    """``--dtype float32`` with FP8 GEMMs: the MFU is against the FP8 peak for the FP8 GEMMs' FLOPs and the
    float32 peak for the rest, never above 1 (against the float32 peak alone, the best plan's was 1.86)."""
    from jaxpar import cost

    sizes = ["--layers", "4", "--hidden", "1024", "--heads", "8", "--seq", "512", "--vocab", "4096", "--batch", "64"]
    assert main(["plan", *sizes, "--cluster", "h100", "--devices", "8", "--dtype", "float32", "--json",
                 "--top", "1000"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    fp8 = [r for r in ranked if r["strategy"]["fp8"]]
    assert fp8 and all(0 < r["mfu"] <= 1 for r in ranked), max(r["mfu"] for r in ranked)
    from jaxpar.cost._cluster import FP8
    from jaxpar.cost._time import fp8_flops_share, gemm_peak

    model, h100 = cost.gpt(4, 1024, 8, 512, 4096, 64), cost.load_cluster("h100", num_devices=8)
    best = cost.plan(model, h100, dtype="float32").best          # the cost model's own MFU: the same
    assert best.plan.name() == ranked[0]["plan"] and best.time.mfu == pytest.approx(ranked[0]["mfu"], rel=1e-3)
    share = fp8_flops_share(model, best.plan)
    # against the float32 peak alone it would exceed 1
    assert 0.5 < share < 1 and best.time.mfu * gemm_peak(model, best.plan, h100, "float32") / h100.peak("float32") > 1
    assert gemm_peak(model, best.plan, h100, "float32") == pytest.approx(
        1 / ((1 - share) / h100.peak("float32") + share / h100.peak(FP8)))
    plain = best.plan.with_strategy(fp8=None)           # no FP8: against the float32 peak, as before
    assert gemm_peak(model, plain, h100, "float32") == h100.peak("float32")


def test_plan_verify_compiles_the_configs_own_model_in_its_dtype(capsys, tmp_path):
    """``plan --config --verify`` builds each plan's step from the config (a tiny Llama, bfloat16 compute) as
    ``inspect`` does, not jaxpar's GPT in fp32: the arguments compiled are the config's model's state, predicted
    exactly; each compiled plan is a row, with whether it fits."""
    config = tiny_hf_config(tmp_path, "llama")
    assert main(["plan", "--config", config, "--cluster", "cpu_sim", "--devices", "8", "--dtype", "float32",
                 "--top", "1", "--verify"]) == 0
    out = capsys.readouterr().out
    best = re.search(r"^\s+1 \| (\S+)", out, re.M).group(1)
    assert ("verify   1 plans compiled ahead of time on 8 simulated CPU devices (the config's model, tiny-llama, "
            "built by its job as jaxpar inspect builds it: bfloat16 compute") in out, out
    rows = [r.split("|") for r in out.split("\nverify ")[1].splitlines()[3:] if r.count("|") == 10]
    assert [r[0].strip() for r in rows] == [best] and rows[0][-1].strip() == "yes", out
    assert float(rows[0][3].strip().rstrip("%")) <= 0.01, rows        # args error
    assert "fits     every compiled peak above fits" in out


def test_verify_marks_each_plan_and_drops_exactly_the_rows_that_do_not_fit(capsys):
    """The table lists every plan compiled with whether it fits; the ``dropped`` line names exactly those that do
    not (and those that did not compile)."""
    from jaxpar import cost
    from jaxpar.cost._capacity import Capacity
    from jaxpar.errors import ConfigError
    from jaxpar.plan import verify_plans

    gib = 2 ** 30
    plans = [cost.Plan(data=8), cost.Plan(fsdp=8), cost.Plan(tensor=8), cost.Plan(data=4, fsdp=2)]

    def check(plan):
        if plan.tensor > 1:
            raise ConfigError("model.heads=6 is not divisible by mesh.tensor=8")
        peak = {8: 2, 1: 5}[plan.data] if plan.fsdp in (1, 8) else 6
        return {"arguments": (gib, gib), "peak": (peak * gib, peak * gib), "axes": {"data": (gib, 2 * gib)}}

    kept = verify_plans([type("E", (), {"plan": p})() for p in plans], check, Capacity(4 * gib), "here", "xla")
    out = capsys.readouterr().out
    fits = {r.split("|")[0].strip(): r.split("|")[-1].strip() for r in out.splitlines()[3:] if r.count("|") == 10}
    assert fits == {"dp8": "yes", "fsdp8": "NO", "tp8": "error", "dp4-fsdp2": "NO"}, out
    dropped = re.search(r"^dropped  (.+)$", out, re.M).group(1)
    assert re.findall(r"[\w-]+(?=[,:])", dropped) == ["fsdp8", "dp4-fsdp2", "tp8"], dropped
    assert [e.plan for e in kept] == plans[:1] and "error    tp8: model.heads=6" in out


def test_inspect_names_the_experts_of_every_moe_model():
    """``inspect``'s experts line reads the experts of jaxpar's GPT (``model.moe``) and of a Decoder
    (``model.hf``'s Qwen3-MoE); a dense model has none."""
    from jaxpar.commands._inspect_command import model_experts
    from jaxpar.config import load_config

    assert model_experts(load_config(ROOT / "configs" / "moe.yaml")) == (8, 2)
    assert model_experts(load_config(ROOT / "configs" / "qwen3_moe_gpu.yaml")) == (128, 8)
    assert model_experts(load_config(ROOT / "configs" / "llama3_8b_gpu.yaml")) is None
    assert model_experts(load_config(ROOT / "configs" / "quickstart.yaml")) is None


@pytest.mark.slow
def test_inspect_prints_the_experts_line_of_a_decoder_moe(capsys, tmp_path):
    """A tiny Qwen3-MoE through ``model.hf`` (8 experts, top-2) on 8 simulated devices: the experts line, with the
    routed rows' FLOPs and every expert on every token's (4 times as many: 8 experts over 2)."""
    assert main(["inspect", tiny_hf_config(tmp_path, "qwen3_moe", "float32")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("experts "))
    assert line.startswith("experts  8 experts, top-2: the tile loops compute at most"), line
    routed, every = (float(v) for v in re.findall(r"routed rows are ([\d.]+) GFLOP, every expert on every token "
                                                   r"would be ([\d.]+) GFLOP", line)[0])
    assert every == pytest.approx(routed * 4, rel=0.01), line
