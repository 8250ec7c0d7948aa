"""A new user's trial (docs/reviews, newcomer review at e46ff18, trips 10 and 17, old trips 5, 12 and 14):
the command line's errors and outputs. Nothing here compiles a program.

* FP8's errors name the YAML keys (``parallel.fp8.min_dim=768``), through the relabelling of the other
  ``Strategy`` errors (:func:`jaxpar.config._build.strategy_message`);
* the config's files (``model.hf``) are checked before the run directory;
* an option that ``jaxpar train`` does not have (``--steps 10``) is shown as its override (``train.steps=10``);
* printed paths are relative to the working directory (or absolute), normalised; XLA's rematerialization
  notices are dropped from ``jaxpar inspect``'s compile (``summary.json``'s ``wall_time`` is goodput's:
  tests/test_goodput.py).
"""
import os
import re
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError
from jaxpar.config._build import build_option, strategy_message
from jaxpar.errors import Fp8Error

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
HF = str(ROOT / "configs" / "hf_finetune.yaml")


def test_fp8_errors_name_the_yaml_keys():
    """The options' own checks and the train step's check of the model, under ``parallel.fp8.*``."""
    with pytest.raises(ConfigError, match=re.escape("parallel.fp8.recipe='tensorwsie': the recipes are tensorwise, "
                                                    "rowwise. A delayed recipe")):
        build_option("fp8", {"recipe": "tensorwsie"})
    with pytest.raises(ConfigError, match=re.escape("parallel.fp8.min_dim=-1: must be an int >= 0")):
        build_option("fp8", {"min_dim": -1})
    library = Fp8Error("Strategy.fp8: every covered weight's GEMM is below min_dim=1024 (the largest, 'blocks/w1', "
                       "has 768), so no matmul would run in FP8. Fix: Strategy.fp8.min_dim=768 or less, or turn "
                       "Strategy.fp8 off.")
    assert strategy_message(library) == (
        "parallel.fp8: every covered weight's GEMM is below min_dim=1024 (the largest, 'blocks/w1', has 768), so no "
        "matmul would run in FP8. Fix: parallel.fp8.min_dim=768 or less, or turn parallel.fp8 off.")


def test_check_names_fp8_min_dim_by_its_key(capsys, tmp_path):
    """``jaxpar check`` builds the train step: the quickstart's widest GEMM (128) is below the default min_dim."""
    assert main(["check", QUICK, "parallel.fp8.recipe=tensorwise", "model.layers=1", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Fix: parallel.fp8.min_dim=128 or less, or turn parallel.fp8 off." in err, err
    assert "Strategy" not in err and "Fp8(" not in err, err


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_missing_model_hf_is_named_before_the_run_directory(tmp_path, capsys, command):
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "summary.json").write_text("{}")           # a finished run: train refuses a new one here
    assert main([command, HF, f"model.hf={tmp_path / 'nope'}", f"train.out_dir={earlier}"]) == 2
    err = capsys.readouterr().err
    assert f"model.hf='{tmp_path / 'nope'}': " in err and "does not exist" in err, err
    assert "earlier run" not in err, err


def test_an_option_train_lacks_is_shown_as_its_override(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", QUICK, "--steps", "10"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: jaxpar train "), err
    assert "--steps is not an option of jaxpar train" in err and "e.g. train.steps=10." in err, err
    with pytest.raises(SystemExit):
        main(["train", QUICK, "--lr=1e-3", "--nothing"])
    err = capsys.readouterr().err
    assert "--lr, --nothing are not options of jaxpar train" in err and "e.g. optimizer.lr=1e-3." in err, err
    with pytest.raises(SystemExit):
        main(["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "2", "--steps", "3"])
    err = capsys.readouterr().err
    assert err.startswith("usage: jaxpar schedule ") and "unrecognized arguments: --steps 3" in err, err


def test_printed_paths_are_relative_or_absolute_and_normalised(tmp_path, monkeypatch):
    from jaxpar._text import shown_path

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert shown_path(tmp_path / "work" / ".." / "work" / "runs" / "x") == os.path.join("runs", "x")
    assert shown_path("runs/./x/") == os.path.join("runs", "x") and shown_path(".") == "."
    assert shown_path("../elsewhere/ck") == str(tmp_path / "elsewhere" / "ck")


def test_inspect_drops_xla_rematerialization_notices(capfd):
    """The compile of ``jaxpar inspect`` keeps its other output on stderr."""
    from jaxpar.commands._job_devices import compile_job

    class Job:
        def compile(self, layout):
            os.write(2, b"W1128 15:58:59.192437 13815 hlo_rematerialization.cc:3231] Can't reduce memory use below "
                        b"60.21GiB (64650523038 bytes) by rematerialization; only reduced to 480.18GiB\n"
                        b"another line\n")
            return {"step": "compiled"}

    assert compile_job(Job(), None, None) == {"step": "compiled"}
    assert capfd.readouterr().err == "another line\n"

