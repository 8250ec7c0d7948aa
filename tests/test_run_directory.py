"""A run directory holds one run: ``jaxpar train`` without ``--resume`` into a directory that holds another
run's checkpoints or records stops before writing anything (``--overwrite`` moves that run aside, nothing
deleted), a checkpoint is never overwritten or pruned by another run, ``--resume`` says how to go on when
there is nothing to do and changes no file when it fails, and ``jaxpar export`` / ``model.hf`` name a
file or a missing directory.

Real tiny runs of ``jaxpar train`` in process: jaxpar's MLP classifier (tests/cli_mlp.yaml) on 8-way data
parallelism, checkpoints at steps 2 and 4."""
import hashlib
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import build_job, load_config
from jaxpar.errors import CheckpointWarning, RunDirectoryError
from jaxpar.run import Checkpointer, train
from jaxpar.step._state import TrainState

TESTS = Path(__file__).resolve().parent
MLP = str(TESTS / "cli_mlp.yaml")
HF = str(TESTS.parent / "configs" / "hf_finetune.yaml")
RUN = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "checkpoint.enabled=true", "checkpoint.async_save=false",
       "checkpoint.every=2", "train.eval_every=0", "train.log_every=1", "train.progress=none"]


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [f"train.out_dir={out}", f"train.steps={steps}", *RUN, *extra]


def _digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its relative path, with its sha256."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("first") / "run"
    assert main(["train", MLP, *_args(out, 4)]) == 0
    return out


@pytest.fixture
def run_copy(first_run, tmp_path):
    """A copy of the first run (each test may change it) and the digests of its files."""
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    return out, _digests(out)


def test_a_new_run_is_refused_and_overwrite_moves_the_earlier_one_aside(run_copy, capsys):
    out, before = run_copy
    assert main(["train", MLP, *_args(out, 2)]) == 2
    err = capsys.readouterr().err
    assert (f"jaxpar train: error: train.out_dir='{out}' holds an earlier run (checkpoints of steps [2, 4] in "
            f"{out / 'checkpoints'}; config.yaml, metrics.jsonl, summary.json)") in err
    assert "--resume" in err and "train.out_dir=NEW_DIR" in err and f"--overwrite to move the earlier run aside to " \
        f"{out}.old-1" in err and "Traceback" not in err
    assert _digests(out) == before                       # nothing written

    assert main(["train", MLP, *_args(out, 2), "--overwrite"]) == 0
    old = out.parent / "run.old-1"
    assert (f"moved    the earlier run in {out} to {old} (read it with train.out_dir={old} "
            f"checkpoint.dir={old / 'checkpoints'})") in capsys.readouterr().out
    assert _digests(old) == before                       # every file of the earlier run, unchanged
    with Checkpointer(out / "checkpoints") as ck:
        assert ck.steps() == [2]                         # the new run's only
    layout = build_job(load_config(MLP, _args(out, 2)), data=False).state_layout()
    with Checkpointer(old / "checkpoints") as ck:        # the earlier run is still readable
        assert ck.steps() == [2, 4] and ck.restore(layout).step == 4


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys):
    assert main(["train", MLP, *_args(tmp_path / "run", 2), "--overwrite", "--resume"]) == 2
    assert "give one of them" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_resume_with_nothing_to_do_says_how_to_continue(run_copy, capsys):
    out, before = run_copy
    assert main(["train", MLP, *_args(out, 4), "train.seed=1", "--resume"]) == 0
    assert ("done     the checkpoint is at step 4 >= train.steps=4; nothing to do. To train further, run again "
            "with train.steps=N --resume, N > 4 (e.g. train.steps=8).") in capsys.readouterr().out
    assert _digests(out) == before                       # config.yaml not rewritten with train.seed=1


def test_failed_resume_changes_no_file(run_copy, capsys):
    out, before = run_copy
    assert main(["train", MLP, *_args(out, 6), "model.kwargs.embed=16", "--resume"]) == 2     # another model
    assert "jaxpar train: error:" in capsys.readouterr().err
    assert _digests(out) == before


def _tiny_state(step: int) -> TrainState:
    return TrainState(jnp.int32(step), {"w": jnp.full((2,), float(step))}, ())


def test_a_checkpoint_is_never_overwritten_or_pruned_by_another_run(tmp_path):
    with Checkpointer(tmp_path, keep=1, async_save=False) as ck:
        assert ck.save(2, _tiny_state(2))
        with pytest.warns(CheckpointWarning, match=rf"checkpoint of step 2 not saved: {tmp_path / '2'} already "
                                                   r"holds a checkpoint of step 2, which is kept"):
            assert not ck.save(2, _tiny_state(7))
        with pytest.raises(RunDirectoryError, match=rf"Checkpointer.save\(step=1\): {tmp_path} holds checkpoints "
                                                    r"of later steps \[2\].*keep=1 would prune them"):
            ck.save(1, _tiny_state(1))                   # keep=1 would have pruned step 2
        with pytest.raises(RunDirectoryError, match=r"train\(start_step=0\): .* later steps \[2\]"):
            train(lambda s, b: (s, {"loss": 0.0}), _tiny_state(0), lambda i: np.zeros((8, 1), np.float32),
                  mesh=jax.make_mesh((8,), ("data",)), steps=2, checkpointer=ck, progress="none")
        assert ck.steps() == [2]
    with Checkpointer(tmp_path) as ck:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored = ck.restore(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                                           _tiny_state(2)))
    assert restored.step == 2 and restored.state.params["w"].tolist() == [2.0, 2.0]      # the first save's


def test_export_to_a_file_and_a_missing_model_hf_are_named(tmp_path, capsys):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"keep")
    missing = tmp_path / "no-such-checkpoint"
    assert main(["export", HF, f"model.hf={missing}", "--hf", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"jaxpar export: error: export: --hf {target} is a file, not a directory" in err and "Traceback" not in err
    assert target.read_bytes() == b"keep"
    assert main(["train", HF, f"model.hf={missing}", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"model.hf='{missing}': {missing} does not exist; give the directory of a Hugging Face checkpoint" in err
    assert main(["train", HF, f"model.hf={target}", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert f"{target} is a file, not a directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_start_that_crashed_before_its_first_step_can_be_retried(tmp_path, capsys):
    """What a run leaves when it dies while compiling (config.yaml, an empty metrics.jsonl, an empty
    checkpoints/) is no earlier run: the retry takes the directory, no --overwrite, nothing moved aside."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "config.yaml").write_text("crashed: start\n")
    (out / "metrics.jsonl").write_text("")
    assert main(["train", MLP, *_args(out, 2)]) == 0
    assert "moved" not in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (out / "metrics.jsonl").stat().st_size > 0 and (out / "checkpoints" / "2").is_dir()
    assert main(["train", MLP, *_args(out, 2)]) == 2          # now it holds a run: refused as before
    assert "holds an earlier run" in capsys.readouterr().err
