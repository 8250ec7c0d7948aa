"""``data.kind: documents`` end to end: ``configs/hf_documents.yaml`` fine-tunes a Hugging Face fixture on a
JSONL + Parquet mixture, tokenized by its tokenizer and packed; ``jaxpar data prepare`` writes the cache
and ``jaxpar data show`` prints the same batch digests under every mesh; resumes continue the stream;
the loss weights give the global batch's masked mean; bad input is named."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import hf_fixtures
from jaxpar.cli import main
from jaxpar.config import build_data, load_config
from jaxpar.data import batch_digest
from jaxpar.hf import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "hf_documents.yaml")
TINY = ["data.batch_size=16", "model.seq_len=32", "data.pack_window=8", "train.eval_batches=1",
        "train.log_every=1", "train.progress=none", "logging.tensorboard=false", "logging.samples=0",
        "checkpoint.async_save=false", "optimizer.lr_schedule=constant", "optimizer.warmup_steps=0"]


def documents(n: int, seed: int) -> list[str]:
    """Documents of 1 to 40 of the fixtures' lines (lengths from a few tokens to a few rows)."""
    lines = hf_fixtures.corpus_lines(3000, seed)
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(1, 40, n))
    return [" ".join(lines[(a % 2900):(a % 2900) + (b - a)]) for a, b in zip(np.r_[0, cuts[:-1]], cuts)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    with open(d / "web.jsonl", "w") as f:
        for i, text in enumerate(documents(300, 1)):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": documents(120, 2)}), d / "code.parquet", row_group_size=32)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf_fixtures.build_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama", init_std=0.2,
                                        vocab_size=132)


def args(ckpt, corpus, tmp, *extra, cache=True):
    sources = (f"data.sources=[{{path: {corpus / 'web.jsonl'}, weight: 3}}, "
               f"{{path: {corpus / 'code.parquet'}, text_field: body, weight: 1}}]")
    return [f"model.hf={ckpt}", sources, f"data.cache={tmp / 'cache' if cache else 'null'}",
            f"train.out_dir={tmp / 'run'}", *TINY, *extra]


def shown(capsys, argv, steps="0:3") -> list[str]:
    capsys.readouterr()
    assert main(["data", "show", CONFIG, *argv, "--steps", steps]) == 0
    return re.findall(r"sha256 ([0-9a-f]{64})", capsys.readouterr().out)


def test_prepare_then_show_the_same_batches_on_every_mesh(ckpt, corpus, tmp_path, capsys):
    base = args(ckpt, corpus, tmp_path)
    assert main(["data", "prepare", CONFIG, *base]) == 0
    out = capsys.readouterr().out
    assert "300 documents" in out and "120 documents" in out and (tmp_path / "cache" / "lengths.png").is_file()
    assert main(["data", "prepare", CONFIG, *base]) == 0
    assert out.count("up to date") == 0 and capsys.readouterr().out.count("up to date") == 2
    cfg = load_config(CONFIG, base)             # one process, every row: the reference
    data, _ = build_data(cfg.data, seq_len=32, vocab=132, eval_batches=0, tokenizer=load_tokenizer(ckpt))
    reference = [batch_digest(data(step)) for step in range(3)]
    assert len(set(reference)) == 3
    one = ["mesh.data=1", "mesh.fsdp=1"]
    for mesh in ([*one, "mesh.tensor=2", "mesh.pipe=2", "mesh.context=2", "parallel.microbatches=2"],   # DP1
                 ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=4"],                      # DP2
                 [],                                                               # DP2 x FSDP2 x TP2: DP4
                 ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipe=2", "parallel.microbatches=2"],
                 ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=2"],
                 ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]):                                     # DP8
        assert shown(capsys, [*base, *mesh]) == reference, mesh
    live = args(ckpt, corpus, tmp_path, cache=False)          # tokenized on the fly: the same ids
    assert shown(capsys, live) == reference
    ramp = [*base, "data.batch_ramp={sizes: [16, 32], steps: [0, 20]}"]     # steps 37, 38 of a ramped run
    cfg = load_config(CONFIG, ramp)
    data, _ = build_data(cfg.data, seq_len=32, vocab=132, eval_batches=0, tokenizer=load_tokenizer(ckpt))
    reference = [batch_digest(data(step)) for step in (37, 38)]
    for mesh in (["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"],
                 ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "mesh.pipe=2", "parallel.microbatches=2"]):
        assert shown(capsys, [*ramp, *mesh], "37:39") == reference, mesh


@pytest.mark.exhaustive
def test_train_and_resume_continue_the_stream(ckpt, corpus, tmp_path, capsys):
    base = args(ckpt, corpus, tmp_path, cache=False)
    assert main(["train", CONFIG, *base, "train.steps=3", "checkpoint.every=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"packing +\d+\.\d+% non-padding", out)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) and r["data_wait"] >= 0 for r in train)
    # the loss of step 0 is transformers' mean loss over the first batch's real targets, each packed
    # segment run on its own (positions restart per segment) with its last target when that counts
    cfg = load_config(CONFIG, base)
    data, _ = build_data(cfg.data, seq_len=32, vocab=132, eval_batches=0, tokenizer=load_tokenizer(ckpt))
    b = data(0)
    segments = []
    for i in range(16):
        for s in range(1, b["segment_ids"][i].max() + 1):
            at = np.flatnonzero(b["segment_ids"][i] == s)
            tail = [b["targets"][i][at[-1]]] if b["loss_mask"][i][at[-1]] else []
            if len(at) + len(tail) >= 2:
                segments.append(np.r_[b["tokens"][i][at], np.asarray(tail, np.int32)])
    expected = np.concatenate(hf_fixtures.reference_doc_losses(ckpt, segments)).mean()
    assert sum(len(x) - 1 for x in segments) == b["loss_mask"].sum()
    assert abs(train[0]["loss"] - expected) < 1e-4
    # resumed at step 3 on another mesh, steps 4 and 5 train on an uninterrupted run's batches
    assert main(["train", CONFIG, *base, "train.steps=5", "--resume", "mesh.data=4", "mesh.fsdp=1",
                 "mesh.tensor=1", "mesh.pipe=2", "parallel.microbatches=2"]) == 0
    whole = args(ckpt, corpus, tmp_path / "whole", cache=False)
    assert main(["train", CONFIG, *whole, "train.steps=5"]) == 0
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (d / "run" / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"} for d in (tmp_path, tmp_path / "whole")]
    assert set(losses[0]) == set(losses[1]) == {1, 2, 3, 4, 5}
    assert all(abs(losses[0][s] - losses[1][s]) < 1e-4 for s in (4, 5))


def test_bad_input_is_named(ckpt, corpus, tmp_path, capsys):
    corpus = Path(shutil.copytree(corpus, tmp_path / "corpus"))      # this test edits its files
    def error(*extra) -> str:
        capsys.readouterr()
        assert main(["data", "show", CONFIG, *args(ckpt, corpus, tmp_path, *extra, cache=False)]) == 2
        return capsys.readouterr().err

    assert "data.sources[0].weight=0" in error(f"data.sources=[{{path: {corpus / 'web.jsonl'}, weight: 0}}]")
    assert "missing.jsonl" in error("data.sources=[{path: /nowhere/missing.jsonl}]")
    assert "body" in error(f"data.sources=[{{path: {corpus / 'web.jsonl'}, text_field: body}}]")
    assert "data.sources[0].colour" in error(f"data.sources=[{{path: {corpus / 'web.jsonl'}, colour: red}}]")
    assert "data.pack='tight'" in error("data.pack=tight")
    assert "data.paths" in error("data.paths=[a.txt]")
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "no documents" in error(f"data.sources=[{{path: {tmp_path / 'empty.jsonl'}}}]").lower()
    bad = tmp_path / "bad.jsonl"
    bad.write_text((corpus / "web.jsonl").read_text() + '{"text": "cut off\n' + '{"text": "the end"}\n')
    assert re.search(r"bad\.jsonl.*line 301", error(f"data.sources=[{{path: {bad}}}]"))
    big = tmp_path / "ids.bin"
    np.arange(1000, dtype=np.uint16).tofile(big)
    assert "token id 999" in error(f"data.sources=[{{path: {big}, format: tokens}}]")
    assert "max_position_embeddings=128" in error("model.seq_len=256")
    assert "data.repeat" in error("train.steps=100000")
    capsys.readouterr()                      # malformed records skipped and counted
    assert main(["train", CONFIG, *args(ckpt, corpus, tmp_path, f"data.sources=[{{path: {bad}}}]", cache=False),
                 "data.on_malformed=skip", "train.steps=1"]) == 0
    assert "1 malformed records skipped" in capsys.readouterr().out
    skip = args(ckpt, corpus, tmp_path / "skip", f"data.sources=[{{path: {bad}}}]")
    assert main(["data", "prepare", CONFIG, *skip, "data.on_malformed=skip"]) == 0
    assert "301 documents" in capsys.readouterr().out         # 302 records, 1 skipped
    assert main(["data", "show", CONFIG, *skip]) == 2         # on_malformed: error refuses that cache
    assert re.search(r"data\.sources\[0\] \(path .*bad\.jsonl'\): .*1 malformed records, which "
                     r"on_malformed='error' \(data\.on_malformed\) refuses", capsys.readouterr().err)
    assert main(["data", "prepare", CONFIG, *args(ckpt, corpus, tmp_path, "data.sources=[{path: /no/where.jsonl}]")]) == 2
    assert "data.sources[0] (path '/no/where.jsonl'): " in capsys.readouterr().err
    base = args(ckpt, corpus, tmp_path)
    assert main(["data", "show", CONFIG, *base]) == 2        # no cache yet
    assert "jaxpar data prepare" in capsys.readouterr().err
    assert main(["data", "prepare", CONFIG, *base]) == 0
    assert main(["data", "show", CONFIG, *base, "data.eos=false"]) == 2      # a cache of other options
    assert "the ids after each document (eos) are [2] in the cache, [] now" in capsys.readouterr().err
    web = corpus / "web.jsonl"
    web.write_text(web.read_text())                          # the corpus changed since the cache
    assert main(["data", "show", CONFIG, *base]) == 2
    assert "source differs in files" in capsys.readouterr().err


def test_inspect_compiles_the_packed_step(ckpt, corpus, tmp_path, capsys):
    """``jaxpar inspect`` compiles the step on the packed batch's five arrays and loss weights, as train runs it."""
    from jaxpar.config import build_job

    cfg = load_config(CONFIG, args(ckpt, corpus, tmp_path, cache=False))
    batch = build_job(cfg, data=False).abstract_batch()
    assert sorted(batch) == sorted(["tokens", "targets", "segment_ids", "positions", "loss_mask", "loss_weights"])
    assert main(["inspect", CONFIG, *args(ckpt, corpus, tmp_path, cache=False)]) == 0
    assert "collectives" in capsys.readouterr().out.lower()
