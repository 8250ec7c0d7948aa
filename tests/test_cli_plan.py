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
