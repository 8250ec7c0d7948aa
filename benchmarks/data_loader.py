"""Throughput of jaxpar.data's loader (a token cache vs tokenizing on the fly), and the host's wait for
the data in ``jaxpar train`` (``data_wait`` against the step time).

The corpus: a synthetic JSONL file (``--mb`` MB, default 40) of English-like text: a Zipfian vocabulary
(the most common English words, then pseudo-words of English syllables), sentences with commas,
capitals and full stops, paragraphs. Document lengths are lognormal (sigma 1.0) with a median of
``--median`` tokens (default 500): the words are one stream, cut into documents of ``lognormal /
(tokens per word)`` words. A byte-level BPE ``tokenizer.json`` (``--vocab`` tokens, default 8192, with
``</s>``) is trained with the ``tokenizers`` library on the first ``--tok-mb`` MB of that stream (the
first documents of the corpus). Everything is written under ``--dir`` (and reused by a later run with
the same arguments).

**Part 1: loader throughput** (no JAX). :class:`jaxpar.data.PackedBatches` (best-fit, pack window 64,
fill 0.99, 2% held out, no prefetch) builds whole global batches, ``data(step)``, of 64 rows of 2048
tokens, from

* ``cache``: :func:`jaxpar.data._cache.prepare_cache` of the corpus, opened by ``open_cache``
  (memory-mapped; just written, so its pages are in the page cache), and
* ``live``: :class:`jaxpar.data.LiveTokens` (``bos=False, eos=True``): the text tokenized as it is
  read. A live store keeps its last 4,096 documents, so it stays within the corpus's first epoch (later
  epochs of a small corpus would find many documents kept); the cache may go on.

Both stores hold the same lengths, so they plan the same batches (checked by ``batch_digest``). The two
alternate in ``--reps`` rounds (about ``--seconds`` in all); each round gives one sample of tokens/s (all
of the batches' tokens, padding included), non-padding tokens/s (``segment_ids > 0``), MB/s read
(``store.bytes_read``: the cache's token bytes, the live store's JSONL bytes) and ms per batch. The table
shows the median sample; ``cache / live`` is the median of the per-round ratios. Also timed:
``prepare_cache``, indexing the JSONL (``open_source``), ``open_cache``, and ``LiveTokens(...)`` (one pass
that tokenizes every document to learn the lengths).

**Part 2: data_wait in training.** ``jaxpar train configs/hf_documents.yaml`` in this process (8 simulated
CPU devices, DP2 x FSDP2 x TP2, as the config has it; the CLI's output is captured) on a tiny Llama
written here with ``transformers`` (hidden 64, 2 layers, 4 heads, 2 K/V heads, MLP 256, the tokenizer's
vocabulary) with ``model.seq_len=128 data.batch_size=32 train.steps=--steps train.log_every=10`` (no
checkpoints, samples, tensorboard or evaluation during the run). Four runs: a cache (``jaxpar data
prepare`` first) and the text tokenized on the fly, each with ``data.prefetch=2`` (the default) and
``0``. From ``metrics.jsonl``'s train records after the first (which holds the compile): ``data_wait``
(seconds per step the host spent getting the batch) over ``step_time`` (wall seconds per step), as
step-weighted means, and the worst record; the target is ``<= 2%``. A probe around the train loop's
``make_global_batch`` splits the wait into ``get`` (the batch function: building the batch, or taking it
from the prefetch thread) and ``place`` (putting it on the 8 devices). The runs are one after the other,
not interleaved: compare step times across them with care.

Usage::

    python benchmarks/data_loader.py [--dir /tmp/jaxpar-data-bench] [--mb 40] [--seconds 20] [--reps 5]
                                     [--steps 60] [--skip-train] [--json out.json]
"""

from __future__ import annotations

import _common  # noqa: F401  (sets up 8 CPU devices first)

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _common import environment, markdown_table, write_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "hf_documents.yaml"
MB = 1e6

# ---------------------------------------------------------------------------------------------- corpus

COMMON = ("the of and to a in is that for it as was with be by on not he this are or his from at which but "
          "have an they you were her she there their one all we can has been if more when will would who so no "
          "had its what about up out them some could into than then other time only new these two may first "
          "do any like my now over such our man me even most made after also did many before must through "
          "years where much your way well down should because each just those people how too little state "
          "good very make world still see own men work long here get both between life being under never day "
          "same another know while last might us great old year off come since against go came right used "
          "take three himself few house use during without again place american around however home small "
          "found thought went say part once general high upon school every united left number course war "
          "until always away something fact though water less public put think almost hand enough far took "
          "head yet government system better set told nothing night end why called didn't eyes find going "
          "look asked later knew point next city business give group toward young days let room president "
          "side social given present several order national possible rather second face per among form "
          "important often things looked early white case john become large big need four within felt along "
          "children saw best church ever least power development light thing seemed family interest want "
          "members mind country area others although turned done open god service certain kind problem began "
          "different door thus help sense means whole matter perhaps itself york times law human line above "
          "name example action company hands local show whether five history gave today either act feet "
          "across taken past quite anything seen having death week experience body word half really field "
          "am car words already themselves information tell together college shall money period held keep "
          "sure probably free seems political real behind cannot miss question air office making brought "
          "whose special major heard problems ago became federal moment study available known result street "
          "economic boy").split()
ONSETS = ("b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn sp st "
          "str sw th tr tw wh").split() + [""] * 6
VOWELS = "a e i o u a e i o ea ee ou oo ai ie y".split()
CODAS = ("n r s t l d m ng nd st ck ll ss rt nt ct sh th rd ns ble tion ment ness er ed ing ly").split() + [""] * 10


def vocabulary(rng: np.random.Generator, size: int) -> tuple[list[str], np.ndarray]:
    """``size`` distinct words (common English first, then pseudo-words) and their Zipf CDF."""
    words, seen = list(COMMON), set(COMMON)
    while len(words) < size:
        syllables = 1 + min(int(rng.geometric(0.45)) - 1, 3)
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + (rng.choice(CODAS) if k == syllables - 1 or
                                                               rng.random() < 0.3 else "")
                    for k in range(syllables))
        if len(w) > 1 and w not in seen:
            seen.add(w)
            words.append(w)
    p = 1.0 / (np.arange(size) + 2.7) ** 1.07
    return words, np.cumsum(p / p.sum())


def word_stream(rng: np.random.Generator, words: list[str], cdf: np.ndarray, n: int) -> list[str]:
    """``n`` words of running text, each with its punctuation and the space (or paragraph break) after it."""
    idx = np.minimum(np.searchsorted(cdf, rng.random(n)), len(words) - 1)
    spaced = [w + " " for w in words]
    out = [spaced[i] for i in idx]
    sentence_ends = np.cumsum(np.maximum(3, rng.lognormal(np.log(16), 0.5, n // 8 + 16)).astype(np.int64))
    sentence_ends = sentence_ends[sentence_ends < n] - 1
    commas = np.flatnonzero(rng.random(n) < 0.06)
    for i in commas:
        out[i] = words[idx[i]] + ", "
    paragraph = rng.random(len(sentence_ends)) < 0.2
    numbers = np.flatnonzero(rng.random(n) < 0.01)
    for i in numbers:
        out[i] = f"{int(rng.integers(1, 3000))} "
    for k, i in enumerate(sentence_ends):
        w = out[i].rstrip(", ")
        out[i] = w + ("?" if k % 23 == 0 else ".") + ("\n\n" if paragraph[k] else " ")
    for i in np.concatenate([[0], sentence_ends + 1]):
        if i < n:
            out[i] = out[i][:1].upper() + out[i][1:]
    return out


def train_tokenizer(texts: list[str], vocab: int, directory: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` (with ``</s>``) and a ``tokenizer_config.json`` naming it as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def make_corpus(root: Path, mb: float, median: int, vocab: int, tok_mb: float, seed: int = 0) -> dict:
    """The corpus (``root/corpus.jsonl``) and its tokenizer (``root/tokenizer``), unless already there."""
    corpus, tokdir, info_file = root / "corpus.jsonl", root / "tokenizer", root / "corpus.json"
    want = {"mb": mb, "median": median, "vocab": vocab, "tok_mb": tok_mb, "seed": seed}
    if info_file.is_file() and corpus.is_file() and (tokdir / "tokenizer.json").is_file():
        info = json.loads(info_file.read_text())
        if info.get("args") == want:
            return info
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    words, cdf = vocabulary(rng, 30_000)
    stream = word_stream(rng, words, cdf, 1_000_000)
    per_word = sum(map(len, stream[:200_000])) / 200_000      # bytes of text per word
    more = int(mb * MB / per_word) - len(stream)
    if more > 0:
        stream += word_stream(rng, words, cdf, more)
    head = int(tok_mb * MB / per_word)
    sample = ["".join(stream[i:i + 2000]) for i in range(0, head, 2000)]
    train_tokenizer(sample, vocab, tokdir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    probe = sample[:200]
    tokens_per_word = sum(len(e.ids) for e in tok.encode_batch(probe)) / (2000 * len(probe))
    lengths, total = [], 0
    while total < len(stream):
        n = max(1, int(round(rng.lognormal(np.log(median / tokens_per_word), 1.0))))
        lengths.append(min(n, len(stream) - total))
        total += lengths[-1]
    with open(corpus, "w", encoding="utf-8") as f:
        at = 0
        for n in lengths:
            f.write(json.dumps({"text": "".join(stream[at:at + n]).rstrip()}) + "\n")
            at += n
    info = {"args": want, "documents": len(lengths), "words": len(stream), "bytes": corpus.stat().st_size,
            "tokens_per_word": tokens_per_word, "seconds": time.perf_counter() - t0}
    info_file.write_text(json.dumps(info))
    return info


def make_checkpoint(root: Path, tokdir: Path, vocab: int, eos: int, seq_len: int) -> Path:
    """A tiny random Llama (``transformers``) with the corpus's tokenizer beside it."""
    path = root / "llama-tiny"
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text())["vocab_size"] == vocab:
        return path
    import contextlib
    import io

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=vocab, max_position_embeddings=max(seq_len, 2048),
                         bos_token_id=None, eos_token_id=eos, tie_word_embeddings=False)
    with contextlib.redirect_stderr(io.StringIO()):        # its progress bar
        LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / name, path / name)
    return path


# ---------------------------------------------------------------------------------------------- part 1

def batch_tokens(batch: dict) -> tuple[int, int]:
    """``(all tokens, non-padding tokens)`` of a batch."""
    return batch["tokens"].size, int((batch["segment_ids"] > 0).sum())


def loader_throughput(stores: dict, *, seq_len: int, batch_size: int, seconds: float, reps: int) -> dict:
    """Interleaved rounds of ``data(step)`` over each store; per store the rounds' samples."""
    from jaxpar.data import PackedBatches, batch_digest

    data = {name: PackedBatches([s], seq_len=seq_len, batch_size=batch_size, seed=0, method="best_fit",
                                rows_per_window=64, fill=0.99, eval_fraction=0.02, prefetch=0)
            for name, s in stores.items()}
    first, digests = {}, {}
    for name, d in data.items():          # step 0 (the epoch's shuffle), and the per-batch time for the blocks
        t0 = time.perf_counter()
        digests[name] = batch_digest(d(0))
        t1 = time.perf_counter()
        d(1)
        first[name] = (t1 - t0, time.perf_counter() - t1)
    per_block = {name: max(1, int(round(seconds / reps / len(data) / first[name][1]))) for name in data}
    # a live store keeps its last documents: past the first epoch of a small corpus it would re-read them
    # instead of tokenizing, so it stays within the first epoch (the cache, memory-mapped, may go on)
    names = list(data)
    plan = data[names[0]].plan
    epoch_steps = plan.epoch_tokens[0] // plan.budget * plan.rows_per_window // batch_size
    for name, s in stores.items():
        if hasattr(s, "prefetch"):
            per_block[name] = max(1, min(per_block[name], (epoch_steps - 2) // reps))
    step = {name: 2 for name in data}
    samples = {name: [] for name in data}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            d, store = data[name], stores[name]
            read0, tokens, real = store.bytes_read, 0, 0
            t0 = time.perf_counter()
            for _ in range(per_block[name]):
                b = d(step[name])
                step[name] += 1
                n, m = batch_tokens(b)
                tokens, real = tokens + n, real + m
            dt = time.perf_counter() - t0
            samples[name].append({"seconds": dt, "batches": per_block[name], "tokens_per_s": tokens / dt,
                                  "real_tokens_per_s": real / dt, "mb_per_s": (store.bytes_read - read0) / MB / dt,
                                  "ms_per_batch": 1e3 * dt / per_block[name]})
    for d in data.values():
        d.close()
    out = {"same_batches": len(set(digests.values())) == 1, "steps_built": step, "epoch_steps": epoch_steps,
           "first_batch_s": {k: v[0] for k, v in first.items()}, "samples": samples,
           "median": {name: {k: statistics.median(s[k] for s in samples[name]) for k in samples[name][0]}
                      for name in data}}
    if "cache" in data and "live" in data:
        out["cache_over_live"] = statistics.median(c["tokens_per_s"] / l["tokens_per_s"]
                                                   for c, l in zip(samples["cache"], samples["live"]))
    return out


# ---------------------------------------------------------------------------------------------- part 2

def train_overrides(ckpt: Path, corpus: Path, out: Path, steps: int) -> list[str]:
    return [f"model.hf={ckpt}", f"data.sources=[{{path: {corpus}}}]", "model.seq_len=128", "data.batch_size=32",
            f"train.steps={steps}", "train.log_every=10", "train.progress=none", "train.eval_every=0",
            "logging.samples=0", "logging.tensorboard=false", "checkpoint.enabled=false", f"train.out_dir={out}"]


class Probe:
    """Inside ``jaxpar train``: each step's ``make_global_batch`` split into ``get`` (the batch function:
    building the batch, or taking it from the prefetch thread) and ``place`` (the rest: putting it on the
    devices)."""

    def __init__(self):
        self.steps = []

    def __enter__(self):
        import inspect

        import jaxpar.run._loop as loop

        self.loop, self.make_global_batch = loop, loop.make_global_batch

        def make_global_batch(batch_fn, step, mesh):
            got = [0.0]

            def get(step, rows=None):
                t = time.perf_counter()
                out = batch_fn(step, rows=rows) if takes_rows else batch_fn(step)
                got[0] += time.perf_counter() - t
                return out

            takes_rows = "rows" in inspect.signature(batch_fn).parameters
            t0 = time.perf_counter()
            out = self.make_global_batch(get if takes_rows else (lambda step: get(step)), step, mesh)
            total = time.perf_counter() - t0
            self.steps.append({"step": step, "total": total, "get": got[0], "place": total - got[0]})
            return out

        loop.make_global_batch = make_global_batch
        return self

    def __exit__(self, *exc):
        self.loop.make_global_batch = self.make_global_batch

    def means(self, first_step: int = 1) -> dict:
        """Mean seconds per step of each part, over the steps from ``first_step`` (after the compile)."""
        kept = [r for r in self.steps if r["step"] >= first_step]
        return {key: sum(r[key] for r in kept) / len(kept) for key in ("total", "get", "place")} if kept else {}


def train_run(ckpt: Path, corpus: Path, out: Path, steps: int, cache: Path | None, prefetch: int) -> dict:
    """One ``jaxpar train`` in this process (its output captured); data_wait / step_time of the records
    after the first, and the probe's split of the host's wait."""
    import contextlib
    import io

    from jaxpar.cli import main

    shutil.rmtree(out, ignore_errors=True)
    args = ["train", str(CONFIG), *train_overrides(ckpt, corpus, out, steps),
            f"data.cache={cache if cache is not None else 'null'}", f"data.prefetch={prefetch}"]
    log = io.StringIO()
    t0 = time.perf_counter()
    with Probe() as probe, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = main(args)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"jaxpar {' '.join(args)} failed:\n{log.getvalue()}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    prev, rows = train[0]["step"], []
    for r in train[1:]:
        rows.append((r["step"] - prev, r["step_time"], r["data_wait"]))
        prev = r["step"]
    steps_timed = sum(n for n, _, _ in rows)
    step_time = sum(n * t for n, t, _ in rows) / steps_timed
    wait = sum(n * w for n, _, w in rows) / steps_timed
    return {"wall_s": wall, "first_record_s": train[0]["step_time"], "first_data_wait_s": train[0]["data_wait"],
            "steps_timed": steps_timed, "step_time_s": step_time, "data_wait_s": wait, "ratio": wait / step_time,
            "worst_ratio": max(w / t for _, t, w in rows), "final_loss": train[-1]["loss"],
            "probe_s": probe.means(first_step=train[0]["step"]),
            "records": [{"step": r["step"], "step_time": r["step_time"], "data_wait": r["data_wait"]} for r in train]}


# ---------------------------------------------------------------------------------------------- main

def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    return {"nproc": nproc, "cpu": model, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "git": head}


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/jaxpar-data-bench", help="corpus, tokenizer, caches, runs")
    p.add_argument("--mb", type=float, default=40.0, help="corpus size (MB of JSONL)")
    p.add_argument("--median", type=int, default=500, help="median document length (tokens)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    p.add_argument("--tok-mb", type=float, default=4.0, help="MB of the corpus the tokenizer is trained on")
    p.add_argument("--seconds", type=float, default=20.0, help="part 1: seconds of batches over both stores")
    p.add_argument("--reps", type=int, default=5, help="part 1: interleaved rounds")
    p.add_argument("--steps", type=int, default=60, help="part 2: train.steps of each run")
    p.add_argument("--skip-train", action="store_true", help="part 1 only")
    p.add_argument("--threshold", type=float, default=0.02, help="flag data_wait / step_time above this")
    p.add_argument("--json", default=None, help="write all results here")
    args = p.parse_args(argv)

    from jaxpar.data._cache import expected_meta, open_cache, prepare_cache
    from jaxpar.data.sources import open_source
    from jaxpar.data import load_tokenizer
    from jaxpar.data import LiveTokens

    root = Path(args.dir)
    env, mach = environment(), machine()
    print(f"# jaxpar.data loader  (nproc={mach['nproc']}, jax {env['jax']}, jaxpar @ {env['git']})", flush=True)
    info, t_corpus = timed(make_corpus, root, args.mb, args.median, args.vocab, args.tok_mb)
    corpus, tokdir = root / "corpus.jsonl", root / "tokenizer"
    tok = load_tokenizer(tokdir)
    print(f"# corpus {corpus}: {info['documents']:,} documents, {info['bytes'] / MB:.1f} MB, "
          f"{info['tokens_per_word']:.2f} tokens/word; tokenizer: byte-level BPE, {tok.vocab_size} tokens, "
          f"EOS {tok.eos_id} ({t_corpus:.0f} s to make)", flush=True)

    # ---- part 1
    cache_dir = root / "cache-part1"
    meta, t_prepare = timed(prepare_cache, open_source(corpus), tok, cache_dir, bos=False, eos=True, progress=False)
    source, t_index = timed(open_source, corpus)
    cached, t_open_cache = timed(open_cache, cache_dir, expected_meta(source, tok, bos=False, eos=True))
    live_source = open_source(corpus)
    live, t_live = timed(LiveTokens, live_source, tok, bos=False, eos=True)
    assert np.array_equal(live.lengths, cached.lengths)
    lengths = cached.lengths
    n_tokens = int(lengths.sum())
    print(f"# {n_tokens:,} tokens (EOS included), document length median {int(np.median(lengths))}, "
          f"p90 {int(np.percentile(lengths, 90))}, over 2048: {(lengths > 2048).mean():.1%}; "
          f"token bytes {meta['dtype']}", flush=True)
    opens = [["prepare_cache (tokenize + write)", f"{t_prepare:.2f}", f"{n_tokens / t_prepare / 1e6:.2f}",
              f"{info['bytes'] / MB / t_prepare:.1f}"],
             ["open_source (index the JSONL)", f"{t_index:.3f}", "", f"{info['bytes'] / MB / t_index:.0f}"],
             ["open_cache (meta check + memmap)", f"{t_open_cache:.4f}", "", ""],
             ["LiveTokens (length pass: tokenizes all)", f"{t_live:.2f}", f"{n_tokens / t_live / 1e6:.2f}",
              f"{info['bytes'] / MB / t_live:.1f}"]]
    print("\n## Part 1a: building and opening the stores\n")
    print(markdown_table(["operation", "seconds", "M tokens/s", "MB/s of JSONL"], opens), flush=True)

    stores = {"cache": cached, "live": live}
    thr = loader_throughput(stores, seq_len=2048, batch_size=64, seconds=args.seconds, reps=args.reps)
    print(f"\n## Part 1b: PackedBatches data(step), 64 x 2048 tokens, best-fit window 64  "
          f"({args.reps} interleaved rounds, same batches from both stores: {thr['same_batches']})\n")
    rows = []
    for name in stores:
        m = thr["median"][name]
        what = "token bytes (uint16)" if name == "cache" else "JSONL bytes"
        rows.append([name, f"{m['tokens_per_s'] / 1e6:.2f}", f"{m['real_tokens_per_s'] / 1e6:.2f}",
                     f"{m['mb_per_s']:.1f} ({what})", f"{m['ms_per_batch']:.1f}",
                     f"{thr['first_batch_s'][name] * 1e3:.0f}", str(thr["steps_built"][name])])
    print(markdown_table(["store", "M tokens/s (all)", "M tokens/s (non-padding)", "MB/s read",
                          "ms / batch", "first batch ms", "batches built"], rows))
    print(f"\ncache / live tokens/s (median of per-round ratios): x{thr['cache_over_live']:.1f}", flush=True)

    # ---- part 2
    runs, ckpt, train_cache = {}, None, root / "cache-train"
    if not args.skip_train:
        import contextlib
        import io

        from jaxpar.cli import main as cli_main

        vocab = tok.vocab_size + (-tok.vocab_size % 8)
        ckpt = make_checkpoint(root, tokdir, vocab, tok.eos_id, 128)
        log = io.StringIO()
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            rc, t_dp = timed(cli_main, ["data", "prepare", str(CONFIG),
                                        *train_overrides(ckpt, corpus, root / "runs" / "prepare", args.steps),
                                        f"data.cache={train_cache}"])
        if rc != 0:
            raise RuntimeError(f"jaxpar data prepare failed:\n{log.getvalue()}")
        print(f"\n## Part 2: jaxpar train {CONFIG.relative_to(ROOT)}, Llama hidden 64 x 2 layers, vocab {vocab}, "
              f"seq 128, batch 32, {args.steps} steps, 8 CPU devices (`jaxpar data prepare`: {t_dp:.1f} s)\n",
              flush=True)
        for store in ("cache", "live"):
            for prefetch in (2, 0):
                name = f"{store}, prefetch={prefetch}"
                runs[name] = train_run(ckpt, corpus, root / "runs" / f"{store}-p{prefetch}", args.steps,
                                       train_cache if store == "cache" else None, prefetch)
                r = runs[name]
                print(f"{name:>20}: step {r['step_time_s'] * 1e3:7.1f} ms  data_wait {r['data_wait_s'] * 1e3:6.2f} ms "
                      f"({r['ratio']:.2%}, worst window {r['worst_ratio']:.2%})  [{r['wall_s']:.0f} s]", flush=True)
        rows = [[name, f"{r['step_time_s'] * 1e3:.1f}",
                 f"{r['step_time_s'] / runs[name.split(',')[0] + ', prefetch=2']['step_time_s']:.3f}",
                 f"{r['data_wait_s'] * 1e3:.2f}", f"{r['ratio']:.2%}",
                 f"{r['worst_ratio']:.2%}", "yes" if r["ratio"] <= args.threshold else "NO",
                 f"{r['probe_s']['get'] * 1e3:.2f}", f"{r['probe_s']['place'] * 1e3:.2f}",
                 f"{r['first_record_s']:.1f}", f"{r['wall_s']:.0f}"] for name, r in runs.items()]
        print()
        print(markdown_table(["data", "step_time ms", "step_time / prefetch=2's", "data_wait ms",
                              "data_wait / step_time", "worst window", f"<= {args.threshold:.0%}",
                              "get ms (build / prefetch)", "place ms (onto devices)", "first step s (compile)",
                              "run wall s"], rows), flush=True)

    # ---- summary
    print("\n## Summary\n")
    c, l = thr["median"]["cache"], thr["median"]["live"]
    print(f"- loader, 64 x 2048: cache {c['tokens_per_s'] / 1e6:.2f} M tokens/s ({c['real_tokens_per_s'] / 1e6:.2f} M "
          f"non-padding, {c['mb_per_s']:.0f} MB/s of tokens), live {l['tokens_per_s'] / 1e6:.2f} M tokens/s "
          f"({l['real_tokens_per_s'] / 1e6:.2f} M non-padding, {l['mb_per_s']:.1f} MB/s of JSONL); "
          f"cache x{thr['cache_over_live']:.1f}")
    print(f"- prepare_cache {t_prepare:.1f} s ({n_tokens / t_prepare / 1e6:.2f} M tokens/s); opening: cache "
          f"{t_open_cache * 1e3:.1f} ms, live {t_live:.1f} s (+ {t_index:.2f} s to index the JSONL, either way)")
    for name, r in runs.items():
        flag = "" if r["ratio"] <= args.threshold else f"  ABOVE {args.threshold:.0%}"
        print(f"- train, {name}: data_wait / step_time {r['ratio']:.2%}{flag}")
    print(f"- machine: nproc {mach['nproc']}, {mach['cpu']}; {mach['date']}; git {mach['git']}")
    write_json(args.json, {"env": env, "machine": mach, "config": vars(args), "corpus": info,
                           "open": {"prepare_s": t_prepare, "index_s": t_index, "open_cache_s": t_open_cache,
                                    "live_s": t_live, "tokens": n_tokens},
                           "throughput": thr, "train": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
