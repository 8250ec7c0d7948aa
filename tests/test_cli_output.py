"""What jaxpar's commands print besides their reports (:func:`jaxpar.cli.command_output`): jaxpar's warnings as
``XWarning: message``, without the path and source line of the call, and none of XLA's C++ warnings (the SPMD
partitioner's ``Involuntary full rematerialization``, the rematerialization pass's ``Can't reduce memory use``,
the GPU compiler's ``Missing deviceless CUB scratch size data``) unless ``TF_CPP_MIN_LOG_LEVEL`` says otherwise.

No command cheap enough for a test shows XLA's warnings on the CPU (``plan --verify`` compiles large models; the
GPU compiler's warning needs a sort compiled for a target, tens of seconds), so the tests of XLA's lines compile a
reshard that XLA:CPU's partitioner warns about, outside and inside ``command_output``.
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.cli import command_output
from jaxpar.errors import ScheduleWarning

QUICK = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")


def test_a_jaxpar_warning_prints_without_its_source_line(tmp_path):
    """``jaxpar check`` (nothing compiled) warns that the warm-up is the whole run: one line, its own process (the
    test session's warnings are recorded, not printed)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    command = ["check", QUICK, "train.steps=5", "optimizer.warmup_steps=10", "model.layers=1",
               f"train.out_dir={tmp_path}"]
    run = subprocess.run([sys.executable, "-m", "jaxpar.cli", *command], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("ScheduleWarning: optimizer.warmup_steps=10 is not below train.steps=5: "), run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr                       # no path, no source line
    assert "check    quickstart: ok" in run.stdout, run.stdout


def test_recorders_get_jaxpar_warnings_and_other_warnings_keep_their_format():
    formatted = warnings.formatwarning
    with command_output():
        with pytest.warns(ScheduleWarning, match="^the message$"):           # pytest.warns, catch_warnings(record)
            warnings.warn("the message", ScheduleWarning)
        assert warnings.formatwarning("m", ScheduleWarning, "/any/where.py", 3) == "ScheduleWarning: m\n"
        elsewhere = warnings.formatwarning("m", UserWarning, "/elsewhere/lib.py", 7, "")
        assert elsewhere == "/elsewhere/lib.py:7: UserWarning: m\n"
    assert warnings.formatwarning is formatted


def _compile_a_full_rematerialization() -> None:
    """Compile ``[5, 7]`` from P('a', 'b') to P(('a', 'b'), None) on a 2 x 4 mesh, which XLA's SPMD partitioner
    can only do by a full rematerialization (it logs a warning); the random constant makes each program new, so
    no compilation cache skips the partitioner."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    salt = float(np.random.default_rng().random())

    def f(x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("a", "b")))
        return jax.lax.with_sharding_constraint(jnp.sin(x) + salt, NamedSharding(mesh, P(("a", "b"), None)))

    jax.jit(f).lower(jax.ShapeDtypeStruct((5, 7), jnp.float32)).compile()


def test_xla_warnings_are_held_back_while_a_command_runs(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")             # import jax's default: warnings up
    _compile_a_full_rematerialization()
    assert "Involuntary full rematerialization" in capfd.readouterr().err      # XLA does warn here
    with command_output():
        assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"                     # for the compilers loaded later
        _compile_a_full_rematerialization()
    assert "Involuntary" not in capfd.readouterr().err
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    _compile_a_full_rematerialization()
    assert "Involuntary" in capfd.readouterr().err                             # restored after


def test_a_chosen_tf_cpp_min_log_level_is_kept(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with command_output():
        assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
        _compile_a_full_rematerialization()
    assert "Involuntary full rematerialization" in capfd.readouterr().err
