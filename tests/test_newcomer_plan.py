"""``jaxpar plan --config`` plans in the config's compute dtype unless ``--dtype``
says otherwise (docs/planning.md's ``jaxpar plan --config configs/quickstart.yaml --cluster cpu_sim``
failed: ``--dtype`` defaulted to bfloat16, which cpu_sim has no peak FLOP/s for)."""
import json
from pathlib import Path

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
