"""``jaxpar sample CONFIG model.hf=DIR --prompt P`` on a Hugging Face checkpoint, before any training, against
transformers: the prompt encoded as ``tokenizer(P)`` (BOS where the tokenizer's post-processor adds it, as
Llama-3's and Gemma-3's do; none for Qwen3's), longer than ``model.seq_len``, and continued with the KV cache
up to the checkpoint's ``max_position_embeddings``: the printed text is transformers' greedy decode."""
from pathlib import Path

import pytest

import hf_fixtures
from jaxpar.cli import main

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "hf_finetune.yaml")
BOS = {"llama": True, "qwen3": False, "qwen3_moe": False, "gemma3": True}
PROMPT = "the quick brown fox jumps over the lazy dog and the small cat sleeps in the warm sun by the old red barn"


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if BOS[f] else pytest.mark.exhaustive)
                                    for f in BOS])
def test_sample_is_transformers_greedy_decode_of_the_tokenizers_encoding(family, tmp_path, capsys):
    from transformers import AutoTokenizer

    source = hf_fixtures.build_checkpoint(family, tmp_path / family, init_std=0.2, bos=BOS[family], vocab_size=132)
    ids = AutoTokenizer.from_pretrained(source)(PROMPT)["input_ids"]
    assert (ids[0] == 1) == BOS[family] and len(ids) > 16           # BOS as the tokenizer says; > seq_len
    args = [f"model.hf={source}", f"train.out_dir={tmp_path / 'run'}", "model.seq_len=16"]
    assert main(["sample", CONFIG, *args, "--prompt", PROMPT, "--tokens", "8"]) == 0
    out = capsys.readouterr()
    assert f"sample   {len(ids)} prompt tokens + 8 greedy tokens from the imported weights" in out.err
    expected = AutoTokenizer.from_pretrained(source).decode(ids + hf_fixtures.reference_greedy(source, ids, 8),
                                                            skip_special_tokens=True)
    assert out.out == expected + "\n"
