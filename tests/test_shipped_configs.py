"""Every shipped config in ``configs/`` that runs on the CPU mesh trains a step, and ``jaxpar check`` agrees with
``jaxpar train`` on it; the others are named with the test that runs them."""
from pathlib import Path

import pytest

from jaxpar.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))

#: The configs that do not run on the CPU mesh as shipped, and the tests that run them.
ELSEWHERE = {
    "gpt124m_gpu.yaml": "GPU: tests/test_check_command.py, tests/test_cost_verify.py (check / plan --target)",
    "llama3_8b_gpu.yaml": "GPU: tests/test_context_fused.py (its h100:1x8 program)",
    "qwen3_moe_gpu.yaml": "GPU: tests/test_qwen3_moe_config.py",
    "multihost.yaml": "2 nodes x 8 GPUs: tests/test_multiprocess.py (processes on the CPU)",
    "hf_finetune.yaml": "a checkpoint to fill in: tests/test_cli_hf.py (a tiny Hugging Face fixture)",
    "hf_documents.yaml": "a checkpoint and corpus to fill in: tests/test_data_documents.py",
}
ON_CPU = [c for c in CONFIGS if c not in ELSEWHERE]
#: One step, nothing written beyond the step's own report: the test is the compile and the step.
ONE_STEP = ["train.steps=1", "optimizer.warmup_steps=0", "train.eval_batches=0", "checkpoint.enabled=false",
            "logging.samples=0", "logging.tensorboard=false", "data.max_bytes=200000"]


def test_every_config_is_run_somewhere():
    assert set(ELSEWHERE) <= set(CONFIGS), sorted(set(ELSEWHERE) - set(CONFIGS))
    assert len(ON_CPU) >= 20, ON_CPU


@pytest.mark.parametrize("name", ON_CPU, ids=lambda n: n.removesuffix(".yaml"))
def test_shipped_config_checks_and_trains_a_step(name, tmp_path, capsys):
    path = str(ROOT / "configs" / name)
    overrides = [*ONE_STEP, f"train.out_dir={tmp_path / 'run'}"]
    assert main(["check", path, *overrides]) == 0, capsys.readouterr().err
    assert main(["train", path, *overrides]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step      1/1  loss" in out and "done     loss" in out, out


def test_what_the_cost_model_cannot_price_is_said_and_never_stops_the_run(monkeypatch):
    from types import SimpleNamespace

    import jax

    from jaxpar import Strategy, make_mesh
    from jaxpar.commands import _train_command
    from jaxpar.config import load_config
    from jaxpar.errors import LayoutError

    def refuses(*args, **kwargs):
        raise LayoutError("parameter 'blocks/w1' dimension 0 (layers) has size 6, not divisible by pipe=4")

    monkeypatch.setattr(_train_command, "config_view", refuses)
    mesh = make_mesh({"data": 8}, devices=jax.devices()[:8])
    got = _train_command._predict(load_config(ROOT / "configs" / "dp.yaml"), SimpleNamespace(strategy=Strategy()),
                                  SimpleNamespace(mesh=mesh))
    assert got.peak is None and "not predicted (LayoutError: parameter 'blocks/w1'" in got.line(), got
