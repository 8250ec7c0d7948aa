"""jaxpar.data._tokenizers against the reference libraries, on ~1 MB of the standard library's sources.

The three tokenizer files are built offline, once per session: a byte-level BPE ``tokenizer.json``
trained with ``tokenizers``, a SentencePiece ``.model`` trained with ``sentencepiece``, and a tiktoken
ranks file derived from the BPE (the 256 bytes, then each merge's bytes in merge order).
"""
import base64
import json
import os
import shutil
import sysconfig
from pathlib import Path
from unittest import mock

import pytest

from jaxpar.errors import DataError, TokenizerError
from jaxpar.data import Tokenizer, load_tokenizer
from jaxpar.data._tokenizers import CL100K_PATTERN

KINDS = ("tokenizers", "sentencepiece", "tiktoken")
CORPUS_BYTES = 1_000_000


def stdlib_documents() -> list[str]:
    """The first standard-library ``.py`` files (sorted) up to ~1 MB, one document each."""
    docs, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= CORPUS_BYTES:
            break
        data = path.read_bytes()
        docs.append(data.decode("utf-8", errors="replace"))
        size += len(data)
    return docs


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (``tokenizers``' ``ByteLevel`` uses it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def train_bpe(docs: list[str], out: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def train_sentencepiece(docs: list[str], out: Path) -> None:
    """A BPE SentencePiece model that round-trips any text (identity normalization, byte fallback)."""
    import sentencepiece

    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"), vocab_size=2000, model_type="bpe",
        input_sentence_size=20000, shuffle_input_sentence=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True, minloglevel=2)


def write_ranks(bpe_json: Path, out: Path) -> int:
    """A tiktoken ranks file of the BPE's merges; returns the number of ranks."""
    merges = json.loads(bpe_json.read_text())["model"]["merges"]
    to_byte = byte_level_alphabet()
    tokens = [bytes([b]) for b in range(256)]
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        tokens.append(bytes(to_byte[c] for c in left + right))
    lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)]
    out.write_text("".join(lines))
    return len(tokens)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """``{"docs", "dirs": {kind: directory}, "n_ranks"}``."""
    root = tmp_path_factory.mktemp("tokenizers")
    docs = stdlib_documents()
    dirs = {kind: root / kind for kind in KINDS}
    for d in dirs.values():
        d.mkdir()
    train_bpe(docs, dirs["tokenizers"])
    train_sentencepiece(docs, dirs["sentencepiece"])
    n_ranks = write_ranks(dirs["tokenizers"] / "tokenizer.json", dirs["tiktoken"] / "stdlib.tiktoken")
    return {"docs": docs, "dirs": dirs, "n_ranks": n_ranks}


def reference(kind: str, built):
    """The library's own encoder and decoder, called directly."""
    d = built["dirs"][kind]
    if kind == "tokenizers":
        import tokenizers

        ref = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        return (lambda text: ref.encode(text, add_special_tokens=False).ids), ref.decode
    if kind == "sentencepiece":
        import sentencepiece

        ref = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
        return ref.encode, ref.decode
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):       # no copy in a temporary cache
        ranks = load_tiktoken_bpe(str(d / "stdlib.tiktoken"))
    ref = tiktoken.Encoding("ref", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    return ref.encode_ordinary, ref.decode


def test_corpus_is_about_a_megabyte(built):
    size = sum(len(d.encode()) for d in built["docs"])
    assert CORPUS_BYTES <= size < 2 * CORPUS_BYTES and len(built["docs"]) > 10


@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_the_reference_library(built, kind):
    tok, (ref_encode, _) = load_tokenizer(built["dirs"][kind]), reference(kind, built)
    want = [ref_encode(doc) for doc in built["docs"]]
    assert tok.kind == kind
    assert [tok.encode(doc) for doc in built["docs"]] == want
    assert tok.encode_batch(built["docs"]) == want
    assert sum(map(len, want)) > 100_000        # the ids were really compared on the whole text


@pytest.mark.parametrize("kind", KINDS)
def test_decode_inverts_encode(built, kind):
    tok, (ref_encode, ref_decode) = load_tokenizer(built["dirs"][kind]), reference(kind, built)
    for doc in built["docs"]:
        ids = tok.encode(doc)
        assert tok.decode(ids) == ref_decode(ref_encode(doc)) == doc
    assert tok.decode([]) == ""


def test_bos_and_eos(built):
    dirs = built["dirs"]
    hf = load_tokenizer(dirs["tokenizers"])          # from tokenizer_config.json (str and {"content": ...})
    assert (hf.bos_id, hf.eos_id) == (hf.token_id("<s>"), hf.token_id("</s>")) == (0, 1)
    plain = hf.encode("x = 1")
    assert hf.encode("x = 1", bos=True, eos=True) == [0, *plain, 1]
    assert hf.encode_batch(["x = 1", "y"], eos=True) == [plain + [1], hf.encode("y") + [1]]
    swapped = load_tokenizer(dirs["tokenizers"], bos_token="</s>", eos_token="<s>")   # arguments first
    assert (swapped.bos_id, swapped.eos_id) == (1, 0)

    sp = load_tokenizer(dirs["sentencepiece"])       # the model's own
    assert (sp.bos_id, sp.eos_id) == (sp.backend.bos_id(), sp.backend.eos_id()) == (1, 2)
    assert sp.encode("pass", bos=True)[0] == 1 and sp.encode("pass", eos=True)[-1] == 2

    tt = load_tokenizer(dirs["tiktoken"], eos_token="<|endoftext|>")
    assert (tt.bos_id, tt.eos_id) == (None, built["n_ranks"])
    assert tt.encode("pass", eos=True) == tt.encode("pass") + [built["n_ranks"]]
    for call in (lambda: tt.encode("pass", bos=True), lambda: tt.encode_batch(["a"], bos=True)):
        with pytest.raises(TokenizerError, match=r"bos=True.*stdlib\.tiktoken.*no BOS"):
            call()


def test_vocab_size_and_token_id(built):
    dirs, n_ranks = built["dirs"], built["n_ranks"]
    hf, sp = load_tokenizer(dirs["tokenizers"]), load_tokenizer(dirs["sentencepiece"])
    tt = load_tokenizer(dirs["tiktoken"], special_tokens={"<|endoftext|>": n_ranks, "<|pad|>": n_ranks + 5})
    assert hf.vocab_size == 2000 and sp.vocab_size == 2000 and tt.vocab_size == n_ranks + 6
    for tok in (hf, sp, tt):
        ids = tok.encode_batch(built["docs"])
        assert max(max(row) for row in ids) < tok.vocab_size
        assert tok.token_id("no such token \x00") is None
    assert tt.token_id("<|pad|>") == n_ranks + 5 and tt.token_id("a") == ord("a")
    assert sp.token_id("<unk>") == sp.backend.unk_id()


def test_fingerprint(built, tmp_path):
    dirs = built["dirs"]
    prints = {kind: load_tokenizer(d).fingerprint() for kind, d in dirs.items()}
    assert len(set(prints.values())) == 3 and all(len(p) == 64 for p in prints.values())
    assert load_tokenizer(dirs["tiktoken"]).fingerprint() == prints["tiktoken"]      # stable
    assert load_tokenizer(dirs["tokenizers"] / "tokenizer.json").fingerprint() == prints["tokenizers"]
    assert load_tokenizer(dirs["tiktoken"], eos_token="<|endoftext|>").fingerprint() != prints["tiktoken"]
    assert load_tokenizer(dirs["tiktoken"], pattern=r"\S+|\s+").fingerprint() != prints["tiktoken"]

    copy = shutil.copytree(dirs["tiktoken"], tmp_path / "tt")
    tok = load_tokenizer(copy)
    assert tok.fingerprint() == prints["tiktoken"]                       # the path is not part of it
    tokens = [line.split()[0] for line in (copy / "stdlib.tiktoken").read_text().splitlines()]
    tokens[300], tokens[301] = tokens[301], tokens[300]                  # two merges swapped
    (copy / "stdlib.tiktoken").write_text("".join(f"{t} {rank}\n" for rank, t in enumerate(tokens)))
    assert tok.fingerprint() != prints["tiktoken"]                       # read again: the edit shows
    assert load_tokenizer(copy).fingerprint() == tok.fingerprint()
    (copy / "stdlib.tiktoken").unlink()
    with pytest.raises(TokenizerError, match="stdlib.tiktoken: cannot be read"):
        tok.fingerprint()


def test_a_file_or_its_directory(built, tmp_path):
    dirs, doc = built["dirs"], built["docs"][0]
    renamed = tmp_path / "bpe.json"
    shutil.copy(dirs["tokenizers"] / "tokenizer.json", renamed)
    for d, file in ((dirs["tokenizers"], renamed), (dirs["sentencepiece"], dirs["sentencepiece"] / "tokenizer.model"),
                    (dirs["tiktoken"], dirs["tiktoken"] / "stdlib.tiktoken")):
        assert load_tokenizer(file).encode(doc) == load_tokenizer(d).encode(doc)
    assert load_tokenizer(renamed).bos_id is None         # no tokenizer_config.json beside it
    both = shutil.copytree(dirs["sentencepiece"], tmp_path / "both")
    shutil.copy(dirs["tokenizers"] / "tokenizer.json", both)
    assert load_tokenizer(both).kind == "tokenizers"       # tokenizer.json is preferred


def test_tiktoken_special_tokens_from_the_config(built, tmp_path):
    d, n = shutil.copytree(built["dirs"]["tiktoken"], tmp_path / "tt"), built["n_ranks"]
    config = {"added_tokens_decoder": {str(n): {"content": "<|begin|>"}, str(n + 1): {"content": "<|end|>"}},
              "bos_token": "<|begin|>", "eos_token": "<|end|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(d)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 2)
    assert tok.encode("<|end|>") == tok.backend.encode_ordinary("<|end|>")      # text, not the special token


def test_errors_name_the_path_and_what_is_missing(built, tmp_path):
    assert issubclass(TokenizerError, DataError)
    assert issubclass(TokenizerError, ValueError)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(lambda: load_tokenizer(empty), [str(empty), "no tokenizer.json or tokenizer.model", "tiktoken"]),
             (lambda: load_tokenizer(tmp_path / "nowhere"), [str(tmp_path / "nowhere"), "does not exist"]),
             (lambda: load_tokenizer(built["dirs"]["tokenizers"], bos_token="<bos>"),
              ["bos_token='<bos>'", "tokenizer.json"]),
             (lambda: load_tokenizer(built["dirs"]["tiktoken"], eos_token="<|eot|>"),
              ["eos_token='<|eot|>'", "stdlib.tiktoken"])]
    bad_config = shutil.copytree(built["dirs"]["tokenizers"], tmp_path / "bad_config")
    (bad_config / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    cases.append((lambda: load_tokenizer(bad_config), [str(bad_config / "tokenizer_config.json"), "'<|im_end|>'"]))
    for call, parts in cases:
        with pytest.raises(TokenizerError) as info:
            call()
        assert all(p in str(info.value) for p in parts), (str(info.value), parts)


@pytest.mark.parametrize("name, content, words", [
    ("tokenizer.json", b'{"version": "1.0", "model"', ["cannot be read as a Hugging Face tokenizer.json"]),
    ("tokenizer.model", b"not a protobuf", ["cannot be read as a SentencePiece model"]),
    ("x.tiktoken", b"IQ== 0\nnot-a-rank-line\n", ["line 2", "'not-a-rank-line'", "base64-token rank"]),
    ("x.tiktoken", b"IQ== zero\n", ["line 1", "base64-token rank"]),
    ("x.tiktoken", b"!!! 0\n", ["line 1", "base64-token rank"]),
    ("x.tiktoken", b"IQ== 0\n", ["every single byte", "255 are missing"]),
    ("x.vocab", b"", ["not a tokenizer file"]),
])
def test_unreadable_files(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


def test_wrong_options(built, tmp_path):
    d, n = built["dirs"]["tiktoken"], built["n_ranks"]
    with pytest.raises(TokenizerError, match="stdlib.tiktoken.*special tokens.*ids of their own"):
        load_tokenizer(d, special_tokens={"<|x|>": 5})                  # 5 is the rank of a byte
    with pytest.raises(TokenizerError, match="stdlib.tiktoken.*pattern"):
        load_tokenizer(d, pattern="(")
    with pytest.raises(TokenizerError, match="tokenizer.json: pattern and special_tokens are for tiktoken"):
        load_tokenizer(built["dirs"]["tokenizers"], special_tokens={"<|x|>": n})
    two = shutil.copytree(d, tmp_path / "two")
    shutil.copy(two / "stdlib.tiktoken", two / "other.tiktoken")
    with pytest.raises(TokenizerError, match="several tiktoken ranks files"):
        load_tokenizer(two)


def test_hf_names_are_the_data_names():
    import jaxpar.hf

    assert jaxpar.hf.Tokenizer is Tokenizer
    assert jaxpar.hf.load_tokenizer is load_tokenizer
