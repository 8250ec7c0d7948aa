"""The token cache and the live store with malformed records skipped: a skipped record is counted and is no
document, in both stores alike; a cache that skipped records is refused under ``on_malformed="error"``."""
import json

import pytest
import tokenizers

from jaxpar.data import CacheError, LiveTokens, SourceError, load_tokenizer
from jaxpar.data._cache import expected_meta, open_cache, prepare_cache
from jaxpar.data.sources import open_source

TEXTS = ["big world", "hello", "hello big big world", "world"]


@pytest.fixture
def corpus(tmp_path):
    """Five records, the second one malformed, and a word-level tokenizer with ``</s>`` as EOS."""
    lines = [json.dumps({"text": t}) for t in TEXTS]
    (tmp_path / "docs.jsonl").write_text("\n".join([lines[0], '{"text": "cut off', *lines[1:]]) + "\n")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "big": 1, "world": 2, "</s>": 3},
                                                             unk_token="</s>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "docs.jsonl", load_tokenizer(tmp_path, eos_token="</s>")


def test_a_skipped_record_is_no_document(corpus, tmp_path):
    path, tok = corpus
    meta = prepare_cache(open_source(path, on_malformed="skip"), tok, tmp_path / "cache", bos=False, eos=True,
                         progress=False)
    assert (meta["documents"], meta["skipped"], meta["on_malformed"]) == (4, 1, "skip")
    want = [tok.encode(t, eos=True) for t in TEXTS]
    assert meta["tokens"] == sum(map(len, want))
    expected = expected_meta(open_source(path, on_malformed="skip"), tok, False, True)
    stores = [open_cache(tmp_path / "cache", expected, on_malformed="skip"),
              LiveTokens(open_source(path, on_malformed="skip"), tok, bos=False, eos=True)]
    for store in stores:
        assert store.skipped == 1 and store.lengths.tolist() == [len(ids) for ids in want]
        assert [store.read(d, 0, len(ids)).tolist() for d, ids in enumerate(want)] == want
    with pytest.raises(CacheError, match=r"built with on_malformed='skip' and left out 1 malformed records, "
                                         r"which on_malformed='error' \(data.on_malformed\) refuses\. Set "
                                         r"data.on_malformed: skip .*jaxpar data prepare CONFIG"):
        open_cache(tmp_path / "cache", expected)


def test_a_failed_build_leaves_nothing(corpus, tmp_path):
    path, tok = corpus
    with pytest.raises(SourceError, match=r"docs\.jsonl, line 2: not valid JSON"):
        prepare_cache(open_source(path), tok, tmp_path / "cache", bos=False, eos=True, progress=False)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "cache.partial").exists()
