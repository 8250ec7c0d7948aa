"""``jaxpar sample CONFIG model.hf=DIR --prompt P`` on a Hugging Face checkpoint, before any training, against
transformers: the prompt encoded as ``tokenizer(P)`` (BOS where the tokenizer's post-processor adds it, as
Llama-3's and Gemma-3's do; none for Qwen3's), longer than ``model.seq_len``, and continued with the KV cache
up to the checkpoint's ``max_position_embeddings``: the printed text is transformers' greedy decode. A prompt plus
``--tokens`` beyond ``max_position_embeddings`` is refused with the fixes in the command's terms."""
import json
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


def test_a_prompt_beyond_max_position_embeddings_names_the_tokens_flag(tmp_path, capsys):
    """Refused before any weight is read, with the fixes in ``jaxpar sample``'s own terms: ``--tokens``."""
    from transformers import AutoTokenizer

    source = hf_fixtures.build_checkpoint("llama", tmp_path / "llama", bos=True, vocab_size=132)
    n = len(AutoTokenizer.from_pretrained(source)(PROMPT)["input_ids"])
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": n + 3}))
    args = [f"model.hf={source}", f"train.out_dir={tmp_path / 'run'}", "model.seq_len=16"]
    assert main(["sample", CONFIG, *args, "--prompt", PROMPT, "--tokens", "8"]) == 2
    assert capsys.readouterr().err == (
        f"jaxpar sample: error: the prompt's {n} tokens plus --tokens 8 are {n + 8} tokens, more than model.hf's "
        f"max_position_embeddings={n + 3} (the longest sequence its positions were trained for); ask for fewer "
        f"--tokens: at most 3, or shorten the prompt to {n - 5} tokens.\n")
    assert main(["sample", CONFIG, *args, "logging.sample_tokens=2", "--prompt", f"{PROMPT} {PROMPT}"]) == 2
    err = capsys.readouterr().err
    assert "plus logging.sample_tokens=2 (no --tokens given) are" in err, err
    assert err.endswith(f"shorten the prompt to {n + 1} tokens (the prompt alone fills the {n + 3} positions).\n"), err
