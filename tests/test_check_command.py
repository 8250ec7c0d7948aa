"""``jaxpar check CONFIG`` (:func:`jaxpar.config._inspection.check_config`): every check of a config, the
ones that need the devices included, with no step compiled."""
import re
from pathlib import Path

import jax
import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.cli import main
from jaxpar.config._inspection import check_config

QUICK = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
TINY = ["model.layers=1", "model.embed=32", "model.seq_len=16", "train.devices=8"]


def test_a_good_config_passes_without_compiling_its_programs(capsys):
    compiled = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert main(["check", str(QUICK), *TINY]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    out = capsys.readouterr().out
    assert "quickstart: ok" in out and "strategy dp2-fsdp2-tp2" in out and "programs step" in out
    assert not [name for name in compiled if "traced" in name or "init" in name], compiled   # no step, no init


def test_the_mesh_is_checked_on_the_devices():
    cfg = load_config(QUICK, [*TINY, "mesh.data=4"])        # 4 x 2 x 2 = 16 devices, train.devices=8
    with pytest.raises(ConfigError, match=re.escape("train.devices=8")):
        check_config(cfg)


def test_a_bad_option_is_one_line_naming_its_key(capsys):
    assert main(["check", str(QUICK), *TINY, "optimizer.clip_norm=-1"]) == 2
    assert "optimizer.clip_norm=-1.0: must be a finite number > 0" in capsys.readouterr().err


def test_muon_options_without_muon_are_named(capsys):
    with pytest.raises(ConfigError, match=r"optimizer.muon.placement='owner': optimizer.muon is only used by "
                                          r"optimizer.name=muon \(here 'adamw'\)"):
        load_config(QUICK, ["optimizer.muon.placement=owner"])
    assert main(["check", str(QUICK), "optimizer.muon.routing={b1: adam}"]) == 2
    assert "optimizer.muon.routing={'b1': 'adam'}: optimizer.muon is only used by" in capsys.readouterr().err
    load_config(QUICK, ["optimizer.name=muon", "optimizer.muon.placement=owner"])      # with Muon: taken
