"""A failed run can be retried, and says why it failed (``jaxpar train``, in process, on the 8 CPU devices).

* An out-of-memory failure is a named error with the bytes, the predicted peak and the devices' memory, and it
  leaves no "earlier run": the retry takes the directory without ``--overwrite``.
* A failed ``--resume`` creates nothing, before the job is built.
* ``keep`` never prunes a good checkpoint while it keeps an interrupted (empty) or unreadable one.
* A config written for GPUs (``train.devices=0``) that finds only CPU devices is refused before compiling.
"""
import shutil
import time
from pathlib import Path

import pytest

from jaxpar.cli import main

TESTS = Path(__file__).resolve().parent
MLP = str(TESTS / "cli_mlp.yaml")
QUICK = str(TESTS.parent / "configs" / "quickstart.yaml")
RUN = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "checkpoint.enabled=true", "checkpoint.async_save=false",
       "train.eval_every=0", "train.log_every=1", "train.progress=none", "logging.tensorboard=false"]
#: the MLP with a 1 TiB first layer (2^19 x 2^19 fp32) on each device: XLA:CPU's allocation fails at once
HUGE = ["model.kwargs.features=524288", "model.kwargs.embed=524288", "data.kwargs.features=524288", "train.steps=2"]


def _steps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_out_of_memory_is_named_and_its_retry_takes_the_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", MLP, *HUGE, *RUN, f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "jaxpar train: error: out of memory on the devices: XLA could not allocate 1.0 TiB (" in err, err
    assert "the train state alone is 3.0 TiB per device (the cost model predicts no peak for this model)" in err
    assert "GiB of host memory, shared by this process's 8 cpu device(s)" in err
    assert f"jaxpar inspect {MLP} model.kwargs.features=524288" in err and "Traceback" not in err
    assert main(["train", MLP, *RUN, "train.steps=2", f"train.out_dir={out}"]) == 0       # no --overwrite
    captured = capsys.readouterr()
    assert "earlier run" not in captured.err and "moved" not in captured.out
    assert _steps(out / "checkpoints") == ["2"] and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_failed_resume_creates_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    assert main(["train", MLP, *RUN, f"train.out_dir={out}", "--resume"]) == 2
    assert time.perf_counter() - t0 < 5                 # refused before the job is built
    assert (f"jaxpar train: error: no checkpoint to resume from in {out / 'checkpoints'}: the directory has no "
            "complete checkpoint") in capsys.readouterr().err
    assert not out.exists()
    (out / "checkpoints" / "4").mkdir(parents=True)        # an interrupted save only
    assert main(["train", MLP, *RUN, f"train.out_dir={out}", "--resume"]) == 2
    assert "(only unfinished saves: 4)" in capsys.readouterr().err
    assert _steps(out) == ["checkpoints"] and _steps(out / "checkpoints") == ["4"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """Checkpoints of steps 2 and 4 (keep=2)."""
    out = tmp_path_factory.mktemp("good") / "run"
    assert main(["train", MLP, *RUN, "checkpoint.every=2", "checkpoint.keep=2", "train.steps=4",
                 f"train.out_dir={out}"]) == 0
    return out


@pytest.mark.filterwarnings("ignore::jaxpar.errors.CheckpointWarning")     # train.steps 4 -> 6: the schedule's
@pytest.mark.parametrize("bad", ["empty", "unreadable"])
def test_keep_prunes_good_checkpoints_only(good_run, bad, tmp_path, capsys):
    """A newer bad checkpoint (step 8: an interrupted save, or one whose files are gone) beside the good 2 and
    4: the resume falls back to 4 and trains to 6 with keep=2; it keeps 4 and 6, and sets the bad one aside."""
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    if bad == "empty":
        (out / "checkpoints" / "8").mkdir()
    else:
        shutil.copytree(out / "checkpoints" / "4", out / "checkpoints" / "8")
        shutil.rmtree(out / "checkpoints" / "8" / "state")
    assert main(["train", MLP, *RUN, "checkpoint.every=2", "checkpoint.keep=2", "train.steps=6",
                 f"train.out_dir={out}", "--resume"]) == 0
    assert "resume   step 4 from" in capsys.readouterr().out
    assert _steps(out / "checkpoints") == ["4", "6", f"8.{'incomplete' if bad == 'empty' else 'unreadable'}"]


def test_a_gpu_config_on_cpu_only_is_refused_before_compiling(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(TESTS.parent / "configs" / "gpt124m_gpu.yaml"), f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert ("train.devices=0 trains on the GPUs or TPUs JAX finds, and this JAX found none: only 8 CPU devices "
            "(jax.default_backend()='cpu')") in err and "docs/gpu.md" in err and "train.devices=8" in err
    assert not out.exists()
