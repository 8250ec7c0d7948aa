"""``bos`` / ``eos`` = ``"auto"`` against transformers: the special tokens a tokenizer's own post-processor adds
(Llama-3's and Gemma-3's BOS, none for Qwen3), each family's tokenizer.json built in the shape its
transformers class rebuilds, from the fixtures' corpus; the tokenizer check of a run's ids; the token cache
and the live store under ``auto``."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import hf_fixtures
from jaxpar.data import LiveTokens, TokenizerError, check_tokenizer, load_tokenizer
from jaxpar.data._cache import expected_meta, open_cache, prepare_cache
from jaxpar.data.sources import open_source

PROMPTS = ["the quick brown fox", "a cat sat on the mat.", "model"]
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def llama3(tok):
    """Llama-3: byte-level BPE, ``TemplateProcessing`` puts BOS first (transformers reads the file as it is)."""
    from tokenizers import processors

    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])])
    return tok, {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}


def qwen3(tok):
    """Qwen3: NFC, the split regex then byte-level, a ``ByteLevel`` post-processor (no BOS); no BOS token."""
    from tokenizers import Regex, normalizers, pre_tokenizers, processors

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, {"bos_token": None, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "</s>",
                 "tokenizer_class": "Qwen2Tokenizer"}


def gemma3(_):
    """Gemma-3: a SentencePiece-style BPE (``▁`` for spaces, byte fallback), ``<bos>`` by its
    ``TemplateProcessing`` and ``add_bos_token: true``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(hf_fixtures.corpus_lines(), trainers.BpeTrainer(
        vocab_size=96, show_progress=False, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    return tok, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                 "mask_token": "<mask>", "add_bos_token": True, "add_eos_token": False,
                 "tokenizer_class": "GemmaTokenizer"}


FAMILIES = {"llama3": llama3, "gemma3": gemma3, "qwen3": qwen3}


def save(directory, family: str, **config_edits):
    """``tokenizer.json`` and ``tokenizer_config.json`` of ``family`` in ``directory``."""
    tok, config = FAMILIES[family](hf_fixtures.train_tokenizer())
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **config_edits}))
    return directory


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save(root / family, family) for family in FAMILIES}


def test_auto_is_what_transformers_tokenizer_gives(families, tmp_path):
    from transformers import AutoTokenizer

    added = {}
    for family, d in families.items():
        ours, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
        for text in PROMPTS:
            assert ours.encode_prompt(text) == ref(text)["input_ids"], (family, text)
            assert ours.encode(text, bos="auto", eos="auto") == ours.encode_prompt(text)
        added[family] = (ours.added_before, ours.added_after)
    assert added == {"llama3": ((1,), ()), "gemma3": ((2,), ()), "qwen3": ((), ())}
    # transformers follows the post-processor over the config's add_bos_token / add_eos_token
    d = save(tmp_path / "llama3", "llama3", add_bos_token=False, add_eos_token=True)
    ours, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert ours.encode_prompt(PROMPTS[0]) == ref(PROMPTS[0])["input_ids"] == [1, *ours.encode(PROMPTS[0])]


def test_an_explicit_setting_wins_over_auto(families):
    llama, qwen = load_tokenizer(families["llama3"]), load_tokenizer(families["qwen3"])
    plain = llama.encode(PROMPTS[0])
    assert llama.encode(PROMPTS[0], bos=False, eos="auto") == plain
    assert llama.encode(PROMPTS[0], bos=True, eos=True) == [1, *plain, 2]
    assert llama.encode_batch(PROMPTS[:2], bos="auto") == [[1, *llama.encode(t)] for t in PROMPTS[:2]]
    assert qwen.encode(PROMPTS[0], bos="auto") == qwen.encode(PROMPTS[0])
    with pytest.raises(TokenizerError, match=r"bos=True: the tokenizer .* has no BOS token.*bos='auto' or False"):
        qwen.encode(PROMPTS[0], bos=True)
    with pytest.raises(TokenizerError, match=r"eos='yes': choose True .*, False .* or 'auto'"):
        qwen.encode(PROMPTS[0], eos="yes")


def test_check_tokenizer_refuses_other_ids(families, tmp_path):
    llama = load_tokenizer(families["llama3"])
    saved = llama.fingerprint()
    check_tokenizer(saved, load_tokenizer(shutil.copytree(families["llama3"], tmp_path / "copy")), llama.vocab_size)
    check_tokenizer(None, llama, None)
    with pytest.raises(TokenizerError, match=r"fingerprint .* the run trained with .*another tokenizer"):
        check_tokenizer(saved, load_tokenizer(families["gemma3"]), None)
    with pytest.raises(TokenizerError, match=r"has 96 ids, fewer than the 128 of the tokenizer the run trained with"):
        check_tokenizer(None, load_tokenizer(families["gemma3"]), llama.vocab_size)
    other_eos = save(tmp_path / "eos", "llama3", eos_token="<pad>")       # the same tokenizer.json
    with pytest.raises(TokenizerError, match="another tokenizer"):
        check_tokenizer(saved, load_tokenizer(other_eos), llama.vocab_size)


def test_the_cache_and_the_live_store_put_autos_specials(families, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    llama = load_tokenizer(families["llama3"])
    meta = prepare_cache(open_source(path), llama, tmp_path / "cache", bos="auto", eos=True, progress=False)
    assert (meta["bos"], meta["eos"]) == ([1], [2])
    store = open_cache(tmp_path / "cache", expected_meta(open_source(path), llama, "auto", True))
    live = LiveTokens(open_source(path), llama, bos="auto", eos=True)
    for doc, text in enumerate(PROMPTS):
        want = [1, *llama.encode(text), 2]
        assert store.read(doc, 0, store.lengths[doc]).tolist() == live.read(doc, 0, live.lengths[doc]).tolist() == want
    from jaxpar.errors import CacheError

    with pytest.raises(CacheError, match=r"the ids before each document \(bos\) are \[1\] in the cache, \[\] now"):
        open_cache(tmp_path / "cache", expected_meta(open_source(path), llama, False, True))


def test_the_config_names_a_bos_it_does_not_take():
    from dataclasses import replace

    from jaxpar.config import load_config
    from jaxpar.config._checks import data_problems

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    problems = data_problems(replace(cfg, data=replace(cfg.data, bos="maybe", eos="auto")))
    assert [p for p in problems if p.startswith("data.bos") or p.startswith("data.eos")] == [
        "data.bos='maybe': choose true, false or auto (what the tokenizer's own post-processor adds, as "
        "transformers' tokenizer(text) does)."]
