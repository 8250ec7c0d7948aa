"""Resuming with another ``train.steps`` changes the learning-rate schedule
(warm-up and decay follow ``train.steps``): every checkpoint records the schedule's length and the
learning rate it resumes with, and a resume under another length warns with both learning rates
(:class:`jaxpar.errors.CheckpointWarning`). A checkpoint without the record still restores, quietly.

Real tiny runs of ``jaxpar train``: jaxpar's MLP classifier (tests/cli_mlp.yaml) on 8-way data
parallelism, cosine decay, a checkpoint at step 4."""
import json
import shutil
import warnings
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.errors import CheckpointWarning


TESTS = Path(__file__).resolve().parent
MLP = str(TESTS / "cli_mlp.yaml")
RUN = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "optimizer.lr_schedule=cosine", "optimizer.warmup_steps=2",
       "checkpoint.enabled=true", "checkpoint.async_save=false", "train.eval_every=0", "train.log_every=1",
       "train.progress=none"]


def _train(out: Path, steps: int, *extra: str) -> int:
    return main(["train", MLP, f"train.out_dir={out}", f"train.steps={steps}", *RUN, *extra])


def _lr(out: Path, step: int) -> float:
    """The learning rate the run logged at ``step`` (metrics.jsonl's ``step`` counts the steps done)."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["lr"] for r in records if r["kind"] == "train" and r["step"] == step + 1)


def _record(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert _train(out, 4) == 0
    return out


def test_checkpoint_records_the_schedule(first_run):
    """The record holds the schedule's length; the learning rate is the optimizer state's (the logged one)."""
    assert _record(first_run, 4)["schedule"] == {"steps": 4}
    assert [_lr(first_run, s) for s in range(4)] == pytest.approx([0.0, 0.005, 0.01, 0.0055], rel=1e-6)


def test_resume_with_another_length_warns_with_both_learning_rates(first_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    with pytest.warns(CheckpointWarning) as caught:
        assert _train(out, 8, "--resume") == 0
    texts = [str(w.message) for w in caught if "train.steps" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    new_lr, old_lr = _lr(out, 4), _lr(first_run, 3)
    text = texts[0]
    assert "checkpoint step 4 was written by a run with train.steps=4; this run has train.steps=8" in text
    assert f"at step 4 the learning rate is {new_lr:.3g} now, after {old_lr:.3g} at step 3 in the original run" in text
    assert "The original schedule ended at step 4; to train on, keep train.steps=8" in text
    assert _record(out, 8)["schedule"]["steps"] == 8


def test_resume_before_the_end_names_the_original_length_and_same_length_is_quiet(tmp_path):
    out = tmp_path / "run"
    every2 = ("checkpoint.every=2", "optimizer.warmup_steps=0")     # step 1 is in the decay: the rates differ
    assert _train(out, 4, *every2) == 0
    shutil.rmtree(out / "checkpoints" / "4")                 # resume from step 2, inside the original schedule
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert _train(out, 4, *every2, "--resume") == 0
    shutil.rmtree(out / "checkpoints" / "4")
    with pytest.warns(CheckpointWarning, match=r"checkpoint step 2 was written by a run with train\.steps=4; this "
                                               r"run has train\.steps=6.* To continue the original schedule, resume "
                                               r"with train\.steps=4; to change its length on purpose, keep "
                                               r"train\.steps=6 \(the learning rate jumps at step 2\)"):
        assert _train(out, 6, *every2, "--resume") == 0


def test_schedule_change_words_an_unchanged_learning_rate():
    """At the end of the warm-up both schedules are at the peak: no jump, but another decay."""
    from jaxpar.run._resume import schedule_change

    text = schedule_change({"schedule": {"steps": 4}}, 2, 10, lambda step: 0.01, 0.01)
    assert "at step 1 the learning rate was 0.01 in both runs, and it decays differently from there" in text
    assert "jumps" not in text and text.endswith("keep train.steps=10.")


def test_checkpoint_from_before_the_record_restores_quietly(first_run, tmp_path):
    """A record without ``schedule`` (every checkpoint written before it was recorded) resumes without a word."""
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    meta = out / "checkpoints" / "4" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    del record["schedule"]
    meta.write_text(json.dumps(record))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert _train(out, 6, "--resume") == 0
    assert _record(out, 6)["schedule"]["steps"] == 6

