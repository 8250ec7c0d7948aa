"""Hugging Face checkpoints from the command line: ``configs/hf_finetune.yaml`` trains an imported
model (``model.hf``) on text tokenized by its tokenizer (``data.tokenizer: hf``), ``jaxpar export``
writes the run's weights back, ``jaxpar sample`` continues a prompt, and the config errors name keys.

One tiny Llama-3 fixture checkpoint serves every test (``hf_fixtures.build_checkpoint``): weights
of std 0.2, so that its loss is far from a random model's, and vocab 132 (the fixtures' 131 is odd,
and the config's mesh has ``tensor=2``). transformers is the independent reference: the loss of
the run's first step is its loss on the first batch, the export loads in it, and the sample is its
greedy continuation of the exported weights.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import hf_fixtures
from jaxpar.cli import main
from jaxpar.config import build_data, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "hf_finetune.yaml")
QUICK = str(ROOT / "configs" / "quickstart.yaml")
TINY = ["data.batch_size=8", "model.seq_len=16", "data.max_bytes=60000", "train.eval_batches=1", "train.log_every=1",
        "train.progress=none", "logging.tensorboard=false", "logging.samples=1", "logging.sample_tokens=4",
        "checkpoint.async_save=false"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return hf_fixtures.build_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama", init_std=0.2,
                                        vocab_size=132)


def _args(source, out_dir):
    return [f"model.hf={source}", f"train.out_dir={out_dir}", *TINY]


@pytest.fixture(scope="module")
def trained(source, tmp_path_factory):
    """A 3-step fine-tuning run of the fixture; returns its overrides."""
    args = _args(source, tmp_path_factory.mktemp("run") / "run")
    assert main(["train", CONFIG, "train.steps=3", *args]) == 0
    return args


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", CONFIG, *trained, "--hf", str(out)]) == 0
    return out


def _tensors(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


def test_finetune_starts_from_the_checkpoint_weights(source, trained):
    out = Path(load_config(CONFIG, trained).train.out_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    # the first batch, tokenized by the checkpoint's tokenizer as the run tokenized it
    from jaxpar.hf import load_tokenizer

    cfg = load_config(CONFIG, trained)
    batch = build_data(cfg.data, seq_len=16, vocab=132, eval_batches=0, tokenizer=load_tokenizer(source))[0](0)
    assert batch["tokens"].shape == (8, 16) and batch["tokens"].max() < 128
    reference = _cross_entropy(hf_fixtures.reference_logits(source, batch["tokens"]), batch["targets"])
    assert losses[0] == pytest.approx(reference, rel=1e-4)        # the imported weights, not random ones
    from jaxpar.hf import open_checkpoint
    from jaxpar.models import decoder_loss

    random_init = float(decoder_loss(open_checkpoint(source).model_fn(0)(), batch))
    assert abs(random_init - reference) > 0.5
    samples = (out / "samples.txt").read_text()      # decoded by the tokenizer, not token ids
    assert samples.startswith("--- sample 0 ---\n[prompt] '") and "[prompt] [" not in samples


@pytest.mark.exhaustive      # an acceptance check (issue 87 / 88) of a minute or more; CI runs it in its share
def test_a_three_layer_llama_trains_on_uneven_pipeline_stages(tmp_path):
    """pipe 2 x data 2 x tensor 2, 1F1B, stage_layers [2, 1]: it trains, and its first loss is transformers'."""
    src = hf_fixtures.build_checkpoint("llama", tmp_path / "llama3", init_std=0.2, vocab_size=132, num_hidden_layers=3)
    args = [*_args(src, tmp_path / "run"), "train.steps=2", "train.eval_batches=0", "logging.samples=0",
            "checkpoint.enabled=false", "mesh.pipe=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2",
            "parallel.microbatches=2", "parallel.schedule=1f1b", "parallel.stage_layers=[2,1]"]
    assert main(["check", CONFIG, *args]) == 0
    assert main(["train", CONFIG, *args]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    from jaxpar.hf import load_tokenizer

    batch = build_data(load_config(CONFIG, args).data, seq_len=16, vocab=132, eval_batches=0,
                       tokenizer=load_tokenizer(src))[0](0)
    reference = _cross_entropy(hf_fixtures.reference_logits(src, batch["tokens"]), batch["targets"])
    assert len(losses) == 2 and losses[0] == pytest.approx(reference, rel=1e-4)


def test_export_of_the_run_loads_in_transformers(source, exported):
    from jaxpar.hf import open_checkpoint

    before, after = _tensors(source), _tensors(exported)
    assert sorted(before) == sorted(after)
    assert not np.array_equal(before["model.layers.0.self_attn.q_proj.weight"],
                              after["model.layers.0.self_attn.q_proj.weight"])          # trained
    assert open_checkpoint(exported).config == open_checkpoint(source).config
    assert (exported / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    tokens = np.arange(12, dtype=np.int64)[None] % 128
    logits = hf_fixtures.reference_logits(exported, tokens)       # transformers loads it
    assert np.isfinite(logits).all() and not np.allclose(logits, hf_fixtures.reference_logits(source, tokens))


def test_export_before_training_is_the_source_byte_for_byte(source, tmp_path, capsys):
    out = tmp_path / "hf"
    args = ["export", CONFIG, *_args(source, tmp_path / "fresh"), "--hf", str(out)]
    assert main(args) == 0
    assert "export   the imported weights of model.hf=" in capsys.readouterr().err
    digest = lambda d: {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in _tensors(d).items()}   # noqa: E731
    assert digest(out) == digest(source)
    assert main(args) == 2                        # OUT is not empty now: refused, without a traceback
    err = capsys.readouterr().err
    assert "jaxpar export: error: export:" in err and "is not empty" in err and "--overwrite" in err
    assert "Traceback" not in err


def test_export_after_a_second_run_writes_its_weights(trained, exported, tmp_path, capsys):
    """A new run in the first run's directory (``--overwrite`` moves the first aside) is the run that
    ``jaxpar export`` reads, and it says so: the step and the directory."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(load_config(CONFIG, trained).train.out_dir, run)
    again = [*trained, f"train.out_dir={run}", "train.steps=3", "data.seed=1", "logging.samples=0"]   # new batches
    assert main(["train", CONFIG, *again, "--overwrite"]) == 0
    out = tmp_path / "hf"
    assert main(["export", CONFIG, *again, "--hf", str(out)]) == 0
    assert f"export   step 3 of {run / 'checkpoints'} (saved " in capsys.readouterr().err
    first, second = _tensors(exported), _tensors(out)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert sorted(first) == sorted(second) and not np.array_equal(first[key], second[key])


def test_sample_continues_the_prompt_with_the_run_weights(source, trained, exported, capsys):
    from jaxpar.hf import load_tokenizer

    prompt = "the lazy dog"
    assert main(["sample", CONFIG, *trained, "--prompt", prompt, "--tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert "from step 3 of" in captured.err
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(source)(prompt)["input_ids"]       # data.bos: auto, as transformers
    expected = load_tokenizer(source).decode(ids + hf_fixtures.reference_greedy(exported, ids, 5))
    assert captured.out == expected + "\n" and captured.out.startswith(prompt)


def test_sample_names_a_tokenizer_other_than_the_runs(trained, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the lazy dog"] * 10, trainers.BpeTrainer(vocab_size=40, show_progress=False))
    (tmp_path / "other").mkdir()
    tok.save(str(tmp_path / "other" / "tokenizer.json"))
    assert main(["sample", CONFIG, *trained, f"data.tokenizer={tmp_path / 'other'}", "--prompt", "the dog"]) == 2
    err = capsys.readouterr().err
    assert "jaxpar sample: error: the tokenizer" in err and "fewer than the" in err, err


def _big_tokenizer(d: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return tok.get_vocab_size()


def test_config_errors_name_the_key(source, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    size = _big_tokenizer(tmp_path / "tok")
    cases = [  # (command line, what the error names)
        (["train", CONFIG, f"model.hf={empty}"], [f"model.hf='{empty}'", "no config.json"]),
        (["train", CONFIG, f"model.hf={source}", "model.embed=64"], ["model.embed", "beside model.hf"]),
        (["train", CONFIG, f"model.hf={source}", "model.loss_chunks=0"], ["model.loss_chunks=0: must be an int >= 1"]),
        (["train", CONFIG, f"model.hf={source}", "model.loss_chunks=5", *TINY],
         ["loss_chunks=5 must divide vocab=132", "model.loss_chunks"]),
        (["train", CONFIG, f"model.hf={source}", f"data.tokenizer={tmp_path / 'tok'}", *TINY],
         ["data.tokenizer=", f"{size} tokens", "vocab_size=132"]),
        (["train", QUICK, "data.tokenizer=hf"], ["data.tokenizer='hf'", "model.hf is not set"]),
        (["train", CONFIG, f"model.hf={source}", "data.tokenizer=null"], ["data.kind='text'", "data.tokenizer: hf"]),
        (["train", CONFIG, f"model.hf={source}", "data.bos=true", "data.tokenizer=null"], ["data.bos=true"]),
        (["export", QUICK, "--hf", str(tmp_path / "out")], ["jaxpar export: error", "model.hf is not set"]),
    ]
    for argv, names in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert all(n in err for n in names) and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "out").exists()


def test_loss_chunks_beside_the_checkpoint_reach_its_decoder_and_the_cost_model(source, tmp_path):
    """``model.loss_chunks`` beside ``model.hf``: the decoder that ``train`` builds and the one the cost model reads
    run the loss in that many pieces (the pieces' numbers: tests/test_cross_entropy.py)."""
    from jaxpar.config._cost_model import cost_model, decoder_config_of
    from jaxpar.config._hf_model import open_hf

    cfg = load_config(CONFIG, [*_args(source, tmp_path / "run"), "model.loss_chunks=4"])
    assert open_hf(cfg.model).config.loss_chunks == decoder_config_of(cfg.model).loss_chunks == 4
    assert cost_model(cfg).loss_chunks == 4


def test_resume_restores_the_run_without_reading_the_import(trained, tmp_path, monkeypatch, capsys):
    import shutil

    from jaxpar.hf import Checkpoint

    run = tmp_path / "run"
    shutil.copytree(load_config(CONFIG, trained).train.out_dir, run)

    def no_import(self, mesh, specs, dtype=None):
        raise AssertionError("a resumed run restores its own weights: the checkpoint's are not read")

    monkeypatch.setattr(Checkpoint, "load", no_import)
    assert main(["train", CONFIG, *trained, f"train.out_dir={run}", "train.steps=4", "--resume"]) == 0
    assert "resume   step 3 from" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
