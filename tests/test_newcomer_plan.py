"""``jaxpar plan --config`` plans in the config's compute dtype unless ``--dtype``
says otherwise (docs/planning.md's ``jaxpar plan --config configs/quickstart.yaml --cluster cpu_sim``
failed: ``--dtype`` defaulted to bfloat16, which cpu_sim has no peak FLOP/s for). The Llama-3-8B config without
recomputation: ``inspect`` suggests a plan that compiles and fits, and ``plan --verify`` keeps the plans ``inspect``
shows fit (slow: 8B deviceless compiles)."""
import json
import re
import shlex
from pathlib import Path

import pytest

from jaxpar.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")           # parallel.compute_dtype: float32
MEGATRON = str(ROOT / "configs" / "megatron.yaml")          # parallel.compute_dtype: bfloat16


def _plan(capsys, *args):
    rc = main(["plan", *args, "--top", "3", "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


def test_documented_plan_command_runs_in_the_configs_dtype(capsys):
    rc, got, err = _plan(capsys, "--config", QUICK, "--cluster", "cpu_sim")
    assert rc == 0, err
    assert got["cluster"] == "cpu_sim" and got["ranked"]


def test_explicit_dtype_wins_over_the_configs(capsys):
    rows = {}
    for extra in ([], ["--dtype", "float32"], ["--dtype", "bfloat16"]):
        rc, got, err = _plan(capsys, "--config", QUICK, "--cluster", "h100", *extra)
        assert rc == 0, err
        rows[" ".join(extra)] = got["ranked"]
    assert rows[""] == rows["--dtype float32"]           # the config's float32
    assert rows[""] != rows["--dtype bfloat16"]          # h100's bf16 peak is ~15x its fp32 one
    rc, _, err = _plan(capsys, "--config", QUICK, "--cluster", "cpu_sim", "--dtype", "bfloat16")
    assert rc == 2 and "cluster 'cpu_sim' has no peak_tflops.bfloat16; it has float32" in err


def test_without_config_the_default_stays_bfloat16(capsys):
    sizes = ["--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64", "--vocab", "256", "--batch", "8"]
    rc, _, err = _plan(capsys, *sizes, "--cluster", "cpu_sim")
    assert rc == 2 and "no peak_tflops.bfloat16" in err
    rc, _, err = _plan(capsys, *sizes, "--cluster", "cpu_sim", "--dtype", "float32")
    assert rc == 0, err


def test_configs_dtype_the_cluster_lacks_names_both_and_the_fix(capsys):
    rc, _, err = _plan(capsys, "--config", MEGATRON, "--cluster", "cpu_sim")
    assert rc == 2
    assert ("parallel.compute_dtype is bfloat16, and cluster 'cpu_sim' has peak FLOP/s for float32 only; "
            "pass --dtype float32 to plan in that dtype, or choose another --cluster.") in err, err


LLAMA = str(ROOT / "configs" / "llama3_8b_gpu.yaml")


@pytest.mark.exhaustive      # an acceptance check (issue 87 / 88) of a minute or more; CI runs it in its share
def test_inspect_suggests_for_a_llama_that_does_not_fit_a_plan_that_compiles_and_fits(capsys):
    """``inspect configs/llama3_8b_gpu.yaml --target h100:1x8 model.remat=none`` does not fit (91.8 GiB); it
    suggests ``plan``'s #1, not verified, and its overrides pasted after the command's compile and fit (the trial
    at 8bb8566 got plan's #10, which did not fit, and then the same plan again)."""
    assert main(["inspect", LLAMA, "--target", "h100:1x8", "model.remat=none"]) == 3
    out = capsys.readouterr().out
    line = re.search(r"^plan     the cost model's best plan that fits on these devices: (\S+) \(jaxpar plan's #1\).*"
                     r"not verified.*\n\s+overrides (.+)$", out, re.M)
    assert line, out[-2000:]
    assert main(["inspect", LLAMA, "--target", "h100:1x8", "model.remat=none", *shlex.split(line.group(2))]) == 0
    again = capsys.readouterr().out
    shown = re.search(r"^time .*; plan (\S+)$", again, re.M).group(1)          # its label carries the dtype
    assert re.search(r"^fits     with", again, re.M) and shown.replace("-bfloat16", "") == line.group(1), again[-2000:]


@pytest.mark.exhaustive      # an acceptance check (issue 87 / 88) of a minute or more; CI runs it in its share
def test_plan_verify_keeps_the_llama_plans_that_fit(capsys):
    """``plan --verify --config configs/llama3_8b_gpu.yaml --target h100:2x8 --top 2`` compiles the config's Llama in
    bfloat16, as ``inspect`` does: both plans fit (43.1 and 24.3 GiB, 2026-11-29), each a row of the table, none
    dropped (at 8bb8566 it compiled jaxpar's GPT in fp32 and dropped both)."""
    assert main(["plan", "--verify", "--config", LLAMA, "--target", "h100:2x8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "(the config's model, llama3-8b, built by its job as jaxpar inspect builds it: bfloat16 compute" in out
    rows = [r.split("|") for r in out.split("\nverify ")[1].splitlines()[3:] if r.count("|") == 10]
    ranked = re.findall(r"^\s+\d+ \| (\S+)", out, re.M)
    assert [r[0].strip() for r in rows] == ranked and [r[-1].strip() for r in rows] == ["yes", "yes"], out
    assert "fits     every compiled peak above fits" in out and "dropped" not in out
