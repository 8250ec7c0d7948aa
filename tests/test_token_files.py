"""Pre-tokenized token files (nanoGPT-style .bin / .npy): memory-mapped, windowed, checked, trainable."""
import json

import numpy as np
import pytest

import jaxpar
from jaxpar.cli import main
from jaxpar.config import ConfigError, DataConfig, build_data
from jaxpar.data import _windows as D
from jaxpar.data._tokens import map_tokens

from test_cli import QUICK


@pytest.fixture
def token_files(tmp_path):
    ids = (np.arange(5000) * 7 % 509).astype(np.uint16)        # ids < 509, deterministic
    np.asarray(ids).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids.astype(np.int32))
    return ids, tmp_path / "train.bin", tmp_path / "train.npy"


def test_bin_and_npy_are_memory_mapped_and_windowed(token_files):
    ids, bin_path, npy_path = token_files
    for path in (bin_path, npy_path):
        data = map_tokens(path)
        assert isinstance(data, np.memmap)          # nothing read until indexed
        np.testing.assert_array_equal(np.asarray(data), ids)
        train, held = D.split_holdout(data, 0.1)
        batch = D.text_batch(train, 3, batch_size=4, seq_len=16, seed=0)
        for row in range(4):     # every window is a contiguous run of the file, targets shifted by one
            start = np.flatnonzero(ids[: len(train) - 16] == batch["tokens"][row, 0])
            assert any((ids[s:s + 16] == batch["tokens"][row]).all() and (ids[s + 1:s + 17] == batch["targets"][row]).all()
                       for s in start)


def test_build_data_tokens_and_process_rows(token_files):
    _, bin_path, _ = token_files
    cfg = DataConfig(kind="tokens", paths=(str(bin_path),), batch_size=8, eval_fraction=0.1)
    batch_fn, evals = build_data(cfg, seq_len=16, vocab=512, eval_batches=2)
    full = batch_fn(5)
    part = batch_fn(5, rows=np.arange(4, 8))
    np.testing.assert_array_equal(part["tokens"], full["tokens"][4:])
    assert len(evals) == 2 and evals[0]["tokens"].shape == (8, 16)
    mesh = jaxpar.make_mesh({"data": 8})
    glob = D.make_global_batch(batch_fn, 5, mesh)
    np.testing.assert_array_equal(np.asarray(glob["tokens"]), full["tokens"])


@pytest.mark.parametrize("cfg_kw,vocab,match", [
    ({"paths": ()}, 512, "exactly one token file"),
    ({"paths": ("missing.bin",)}, 512, "not found"),
    ({}, 256, r"token id \d+, outside the model's vocabulary \[0, 256\)"),
    ({"token_dtype": "uint32"}, 512, "not a whole number of uint32 tokens"),
])
def test_token_file_errors_name_the_key(token_files, cfg_kw, vocab, match):
    _, bin_path, _ = token_files
    bad = (np.arange(4999) % 100).astype(np.uint16)
    if cfg_kw.get("token_dtype") == "uint32":
        bad.tofile(bin_path)                                   # 9998 bytes: not a multiple of 4
    cfg = DataConfig(**{"kind": "tokens", "paths": (str(bin_path),), **cfg_kw})
    with pytest.raises(ConfigError, match=match):
        build_data(cfg, seq_len=16, vocab=vocab, eval_batches=1)


def test_train_on_a_token_file(token_files, tmp_path):
    _, bin_path, _ = token_files
    out = tmp_path / "run"
    rc = main(["train", QUICK, "data.kind=tokens", f"data.paths=[{bin_path}]", "model.vocab=512",
               "train.steps=3", "train.eval_batches=1", "train.eval_every=3", f"train.out_dir={out}",
               "train.progress=none", "model.embed=32", "model.layers=1", "model.seq_len=16",
               "data.batch_size=8", "optimizer.warmup_steps=0", "checkpoint.enabled=false", "logging.samples=0",
               "logging.tensorboard=false"])
    assert rc == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"][-1] == 3
