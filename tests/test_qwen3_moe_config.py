"""``configs/qwen3_moe_gpu.yaml``, a Qwen3-MoE-shaped decoder (Qwen3-30B-A3B's layer, 24 layers, from its
``config.json`` without weights): it loads and checks for 8 H100s, ``plan --config`` ranks plans on one node and on
two (fast, nothing compiled); the best plan's overrides compile deviceless for the target and fit, with the cost
model's peak within 10% of the compiled one (slow)."""
import contextlib
import functools
import io
import json
import re

import pytest

from jaxpar.cli import main

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "qwen3_moe_gpu.yaml")
TARGETS = ("h100:1x8", "h100:2x8")


def _run(*args) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(args))
    return code, buf.getvalue()


@functools.cache
def planned(target: str) -> dict:
    code, out = _run("plan", "--config", CONFIG, "--target", target, "--top", "1", "--json")
    assert code == 0, out
    return json.loads(out)


def best_plan(target: str) -> dict:
    return planned(target)["ranked"][0]


def test_the_config_reads_qwen3_moe_and_checks_for_h100(capsys):
    code, out = _run("check", CONFIG, "--target", "h100:1x8")
    assert code == 0, out
    assert "qwen3_moe of configs/hf/qwen3-moe-24l's config.json, no *.safetensors" in out
    assert "15,577,227,264 parameters" in out


@pytest.mark.parametrize("target", TARGETS)
def test_plan_ranks_a_plan_that_fits_with_its_margin(target):
    got = planned(target)
    best, capacity = got["ranked"][0], got["capacity"]
    assert best["overrides"] and best["memory_bytes"] * (1 + capacity["margin"]) <= capacity["usable_bytes"], best


@functools.cache
def inspected(target: str) -> tuple[int, str]:
    return _run("inspect", CONFIG, "--target", target, *best_plan(target)["overrides"])


def _gib(out: str, pattern: str) -> float:
    return float(re.search(pattern, out).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_the_best_plan_compiles_for_the_target_and_fits(target):
    code, out = inspected(target)
    assert code == 0 and re.search(r"^fits ", out, re.M), out


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_the_predicted_peak_is_within_10_percent_of_the_compiled(target):
    _, out = inspected(target)
    compiled = _gib(out, r"per device: peak ([\d.]+) GiB")
    predicted = _gib(out, r"the cost model predicted ([\d.]+) GiB")
    print(target, [line for line in out.splitlines() if line.startswith("plan") or "per device: peak" in line])
    assert abs(predicted / compiled - 1) <= 0.10, (predicted, compiled)
