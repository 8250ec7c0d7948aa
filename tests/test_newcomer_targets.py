"""A GPU target without the ``targets`` extra is a named :class:`TargetError`, from
the library, from ``jaxpar inspect --target`` and in notebooks/05_planning.ipynb's last cell.

The extra is installed here, so a plain install is simulated: ``importlib.util.find_spec`` of the
CUDA plugin raises as it does when no ``jax_plugins`` package exists at all (a dotted name whose
parent is missing raises ``ModuleNotFoundError`` instead of returning None), libtpu is not found, and the per-process
cache of target devices is emptied so that the check runs again.
"""
import importlib.util
import json
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.devices import _targets as targets
from jaxpar.errors import TargetError

ROOT = Path(__file__).resolve().parents[1]
INSTALL = (r"which is not installed in \S+jaxpar-targets .+ -m pip install --no-deps --upgrade --target \S+jaxpar-targets "
           r"jax-cuda12-plugin==.+ \(from a checkout: make targets")


@pytest.fixture
def plain_install(monkeypatch):
    """No jax_plugins package and no libtpu (a plain ``pip install jaxpar``), and no target devices made yet."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "libtpu":
            return None
        if name.split(".")[0] == "jax_plugins":
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(targets, "_DEVICES", {})


def test_gpu_target_without_the_extra_names_it(plain_install):
    with pytest.raises(TargetError, match=r"compiling for cuda targets needs jax-cuda12-plugin, " + INSTALL):
        targets.target_devices(targets.parse_target("h100:1x8"))


def test_plugin_module_without_its_distribution_names_the_extra(monkeypatch):
    import importlib.metadata as md

    def version(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(targets, "_DEVICES", {})
    monkeypatch.setattr(md, "version", version)
    with pytest.raises(TargetError, match="needs jax-cuda12-plugin, " + INSTALL):
        targets.target_devices(targets.parse_target("h100:1x8"))


def test_inspect_gpu_target_without_the_extra_is_a_usage_error(plain_install, capsys):
    rc = main(["inspect", str(ROOT / "configs" / "quickstart.yaml"), "--target", "h100:1x8"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "ModuleNotFoundError" not in err
    assert "jaxpar inspect: error: compiling for cuda targets needs jax-cuda12-plugin" in err
    assert "make targets" in err


def test_planning_notebook_last_cell_runs_after_a_plain_install(plain_install, capsys):
    """The cell prints each target's TargetError instead of failing (its figures need the extra)."""
    from jaxpar import cost

    nb = json.loads((ROOT / "notebooks" / "05_planning.ipynb").read_text())
    code = "".join(nb["cells"][-1]["source"])
    assert "target_devices(target)" in code, "the last cell is the targets cell"
    exec(compile(code, "05_planning.ipynb[-1]", "exec"), {"cost": cost})
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[0] for x in lines] == ["h100:2x8", "tpu-v5e:4x4"], lines
    gpu = lines[0]
    assert "not compiled: compiling for cuda targets needs jax-cuda12-plugin" in gpu, gpu
    assert "-m pip install --no-deps --upgrade --target" in gpu, gpu
    assert "not compiled: compiling for tpu targets needs libtpu" in lines[1], lines[1]
