"""jaxpar.data over 2 real processes on localhost (gloo CPU collectives, 4 simulated devices each, one mesh
of 8): a JSONL + Parquet mixture (weights 3:1), tokenized by a BPE ``tokenizer.json`` into token caches
(``prepare_cache``), packed by :class:`jaxpar.data.PackedBatches` and placed with
:func:`jaxpar.data.make_global_batch` on data-parallel, ZeRO-3 x TP, pipeline, context-parallel and hybrid
DCN meshes (tests/data_mp_driver.py), and on a data-parallel mesh with the sources tokenized on the fly.

Checked, for steps 0..4 of each mesh: each process's gathered global batch has the digest (and the loss
weights) of the batch one process builds for all rows; the two processes print the same digests, and
they are the ones this test computes here with one ``PackedBatches``; each process's stores read
exactly the bytes of its own rows' planned segments, about half the batch where the processes split the
rows (the two halves add up to the whole batch) and the whole batch where each holds every row (pipe)."""
import json
from pathlib import Path

import numpy as np

from jaxpar.data import batch_digest
from jaxpar.data._cache import prepare_cache
from jaxpar.data.sources import open_source
from jaxpar.data import load_tokenizer

from data_mp_driver import BATCH, STEPS, open_stores, packed_batches

#: The two sources' vocabularies: prose-like and code-like words, so that both shape the BPE merges.
PROSE = ("the", "a", "river", "mountain", "quietly", "ran", "under", "over", "bright", "stone", "winter",
         "garden", "lantern", "whisper", "across", "through", "golden", "harbour", "market", "evening",
         "north", "south", "window", "old", "new", "song", "road", "cloud", "and", "of")
CODE = ("def", "return", "self", "if", "else", "for", "in", "range", "x", "y", "value", "items", "append",
        "None", "True", "import", "numpy", "np", "array", "shape")
MESHES = ("dp", "zero3_tp", "pipe", "context", "hybrid_dcn")       # and dp_live: tokenized on the fly


def documents(n: int, words: tuple[str, ...], seed: int) -> list[str]:
    """``n`` documents of 3 to 300 words drawn from ``words``."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(k))) for k in rng.integers(3, 301, n)]


def build_caches(root: Path) -> Path:
    """The corpus (web.jsonl: 400 documents, code.parquet: 160), a BPE tokenizer with ``</s>`` trained on
    it, and a token cache per source (EOS after each document); returns the driver's spec file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    web, code = documents(400, PROSE, 1), documents(160, CODE, 2)
    with open(root / "web.jsonl", "w") as f:
        for i, text in enumerate(web):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(pa.table({"body": code}), root / "code.parquet", row_group_size=32)
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(web + code, trainers.BpeTrainer(vocab_size=160, special_tokens=["</s>"],
                                                            show_progress=False))
    (root / "tokenizer").mkdir()
    bpe.save(str(root / "tokenizer" / "tokenizer.json"))
    tokenizer = load_tokenizer(root / "tokenizer", eos_token="</s>")
    sources = [dict(path=str(root / "web.jsonl"), text_field="text", cache=str(root / "cache" / "web"), weight=3),
               dict(path=str(root / "code.parquet"), text_field="body", cache=str(root / "cache" / "code"), weight=1)]
    for s, texts in zip(sources, (web, code)):
        meta = prepare_cache(open_source(s["path"], text_field=s["text_field"]), tokenizer, s["cache"], bos=False,
                             eos=True, progress=False)
        assert meta["documents"] == len(texts)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"tokenizer": str(root / "tokenizer"), "sources": sources}))
    return spec


def parse(log: str) -> tuple[dict, list, dict]:
    """``({mesh: rows}, [digest of each mesh and step], {(mesh, step): (bytes read, whole batch's bytes)})`` of a
    driver's log."""
    rows, digests, read = {}, [], {}
    for line in log.splitlines():
        words = line.split()
        if line.startswith("mesh "):
            rows[words[1]] = json.loads(line.split(" rows ", 1)[1])
        elif line.startswith("digest "):
            digests.append(words[1])
        elif line.startswith("bytes "):
            read[words[1], int(words[2])] = (int(words[3]), int(words[4]))
    return rows, digests, read


def test_each_process_packs_and_reads_only_its_rows(tmp_path):
    from test_multiprocess import PY, free_port, launch, wait_all

    spec_file = build_caches(tmp_path)
    coordinator, logs = f"127.0.0.1:{free_port()}", tmp_path / "logs"
    procs = launch(lambda i: [PY, "tests/data_mp_driver.py", coordinator, "2", str(i), "4", str(spec_file)], 2, logs)
    # the one-process reference, here, while the two processes run
    spec = json.loads(spec_file.read_text())
    reference = packed_batches(spec, open_stores(spec))
    expected = [batch_digest(reference(step)) for step in range(STEPS)]
    assert len(set(expected)) == STEPS                        # the steps' batches differ
    wait_all(procs, logs, timeout=180)

    parsed = [parse((logs / f"p{i}.log").read_text()) for i in range(2)]
    for i in range(2):
        log = (logs / f"p{i}.log").read_text()
        assert log.rstrip().endswith("OK"), log[-3000:]
        assert f"joined process {i} of 2 (explicit flags)" in log
        rows, digests, _ = parsed[i]
        assert list(rows) == [*MESHES, "dp_live"]
        assert rows["dp"] == list(range(8 * i, 8 * i + 8)) and rows["pipe"] == list(range(BATCH))
        assert digests == expected * (len(MESHES) + 1)
    for mesh in MESHES:
        held = [set(parsed[i][0][mesh]) for i in range(2)]
        for step in range(STEPS):
            (read0, whole0), (read1, whole1) = (parsed[i][2][mesh, step] for i in range(2))
            assert whole0 == whole1 > 0
            if held[0] | held[1] == set(range(BATCH)) and not held[0] & held[1]:   # the rows split in two
                assert read0 + read1 == whole0 and max(read0, read1) < 0.75 * whole0, (mesh, step, read0, read1)
            else:                                                                  # both hold every row
                assert held[0] == held[1] == set(range(BATCH)) and read0 == read1 == whole0, (mesh, step)


def test_data_show_in_two_processes_prints_one_process_digests(tmp_path):
    """``jaxpar data show`` run as two processes (``--coordinator``, 4 devices each) prints the digests that
    one process computes for the config's batches: each process built only its own rows."""
    import re

    import hf_fixtures
    from test_multiprocess import PY, free_port, launch, wait_all

    from jaxpar.config import build_data, load_config
    from jaxpar.data import load_tokenizer

    ckpt = hf_fixtures.build_checkpoint("llama", tmp_path / "llama", vocab_size=132)
    corpus = tmp_path / "web.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(hf_fixtures.corpus_lines(k % 9 + 1, k))}) + "\n"
                              for k in range(200)))
    args = ["configs/hf_documents.yaml", f"model.hf={ckpt}", f"data.sources=[{{path: {corpus}}}]", "data.cache=null",
            "model.seq_len=32", "data.batch_size=16", "data.pack_window=8", "mesh.data=8", "mesh.fsdp=1",
            "mesh.tensor=1", "train.eval_batches=0", "train.steps=10"]
    coordinator, logs = f"127.0.0.1:{free_port()}", tmp_path / "logs"
    procs = launch(lambda i: [PY, "-m", "jaxpar.cli", "data", "show", *args, "--steps", "0:3",
                              "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
                              "--local-devices", "4"], 2, logs)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / args[0]), args[1:])
    data, _ = build_data(cfg.data, seq_len=32, vocab=132, eval_batches=0, tokenizer=load_tokenizer(ckpt))
    expected = [batch_digest(data(step)) for step in range(3)]
    wait_all(procs, logs, timeout=180)
    printed = [re.findall(r"sha256 ([0-9a-f]{64})", (logs / f"p{i}.log").read_text()) for i in range(2)]
    assert printed == [expected, []], (logs / "p0.log").read_text()[-2000:]
