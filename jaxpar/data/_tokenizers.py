"""Text to token ids: a Hugging Face ``tokenizer.json``, a SentencePiece ``.model`` or a tiktoken ranks file.

:func:`load_tokenizer` reads a directory or a file into a :class:`Tokenizer`, whose ids are the
reference library's own, with no special token added. BOS and EOS are added only when
``encode(bos=..., eos=...)`` asks: ``True`` for the token, ``"auto"`` for what the tokenizer's
post-processor adds (docs/data.md). :meth:`Tokenizer.fingerprint` names the tokenizer for a token
cache and a run's checkpoint (:func:`check_tokenizer`).

BOS / EOS come from the arguments, else ``tokenizer_config.json`` beside the file, else
SentencePiece's own ids. tiktoken's special tokens come from ``special_tokens``, else that config's
``added_tokens_decoder``, else ``{"<|endoftext|>": largest rank + 1}``; its regex is ``pattern``
(default :data:`CL100K_PATTERN`).

A tiktoken ranks file (one ``base64-token rank`` line per token, all 256 single bytes among the tokens),
with its special token:

>>> import base64, pathlib, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> tokens = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]          # ranks 0..257
>>> lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
>>> _ = (d / "tiny.tiktoken").write_text("\\n".join(lines) + "\\n")
>>> tok = load_tokenizer(d, eos_token="<|endoftext|>")
>>> tok.kind, tok.vocab_size, tok.eos_id
('tiktoken', 259, 258)
>>> ids = tok.encode("abc abd", eos=True)
>>> ids, tok.decode(ids[:-1])
([257, 32, 256, 100, 258], 'abc abd')
>>> len(tok.fingerprint())
64
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from jaxpar.errors import TokenizerError

#: GPT-4's (cl100k_base) pre-tokenization regex, copied from ``tiktoken_ext.openai_public.cl100k_base`` of
#: tiktoken 0.14: that module builds it only inside the function that downloads cl100k's ranks.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")

#: The tokenizer kinds, by the suffix of their file.
KINDS = {".json": "tokenizers", ".model": "sentencepiece", ".tiktoken": "tiktoken"}


@dataclass
class Tokenizer:
    """Text <-> ids through one of three libraries.

    Attributes:
      backend: the library's object (``tokenizers.Tokenizer``, ``sentencepiece.SentencePieceProcessor``,
        ``tiktoken.Encoding``).
      kind: ``"tokenizers"``, ``"sentencepiece"`` or ``"tiktoken"``.
      bos_id: the BOS token's id (``None``: the tokenizer has none).
      eos_id: the EOS token's id (``None``: the tokenizer has none).
      files: the files that define the ids (read again by :meth:`fingerprint`).
      settings: what else defines them (tiktoken: ``pattern`` and ``special_tokens``).
      added_before: the ids transformers' ``tokenizer(text)`` puts before the text (``bos="auto"``).
      added_after: the ids it puts after the text (``eos="auto"``).
    """

    backend: Any
    kind: str
    bos_id: int | None = None
    eos_id: int | None = None
    files: tuple[Path, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    added_before: tuple[int, ...] = ()
    added_after: tuple[int, ...] = ()

    def encode(self, text: str, *, bos: bool | str = False, eos: bool | str = False) -> list[int]:
        """The ids of one text.

        Args:
          text: the text.
          bos: ``True``: put the BOS id first; ``"auto"``: :attr:`added_before`; ``False``: nothing.
          eos: ``True``: put the EOS id last; ``"auto"``: :attr:`added_after`; ``False``: nothing.

        Returns:
          The reference library's ids of ``text`` (no special token), with BOS / EOS when asked.

        Raises:
          TokenizerError: ``bos`` / ``eos`` asked of a tokenizer without that token, or not ``True``,
            ``False`` or ``"auto"``.
        """
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: Iterable[str], *, bos: bool | str = False, eos: bool | str = False
                     ) -> list[list[int]]:
        """The ids of many texts, each as :meth:`encode` gives them, encoded in parallel by the library.

        Args:
          texts: the texts.
          bos: as for :meth:`encode`, for each text.
          eos: as for :meth:`encode`, for each text.

        Returns:
          One list of ids per text.

        Raises:
          TokenizerError: as for :meth:`encode`.
        """
        head, tail = self.special_ids(bos, eos)
        texts = list(texts)
        if self.kind == "tokenizers":    # encode_batch_fast (tokenizers >= 0.21): the same ids, no offsets
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            batch = [e.ids for e in encode(texts, add_special_tokens=False)]
        elif self.kind == "tiktoken":
            batch = self.backend.encode_ordinary_batch(texts)
        else:
            batch = self.backend.encode(texts)
        return [head + ids + tail for ids in batch]

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of ``text`` as transformers' ``tokenizer(text)["input_ids"]`` gives them: with the special
        tokens the tokenizer's own post-processor adds (the BOS of Llama-3 and Gemma-3, none for Qwen3).

        Args:
          text: the text.

        Returns:
          :attr:`added_before`, the text's ids, :attr:`added_after`.
        """
        return self.encode(text, bos="auto", eos="auto")

    def special_ids(self, bos: bool | str, eos: bool | str) -> tuple[list[int], list[int]]:
        """The ids put before and after each text for ``bos`` / ``eos`` (see :meth:`encode`).

        Args:
          bos: ``True``, ``False`` or ``"auto"``.
          eos: ``True``, ``False`` or ``"auto"``.

        Returns:
          ``(ids before, ids after)``.

        Raises:
          TokenizerError: ``True`` for a token the tokenizer lacks, or another value than the three.
        """
        out = []
        for setting, tid, added, name in ((bos, self.bos_id, self.added_before, "bos"),
                                          (eos, self.eos_id, self.added_after, "eos")):
            if not (isinstance(setting, bool) or setting == "auto"):
                raise TokenizerError(f"{name}={setting!r}: choose True (the {name.upper()} token), False (none) or "
                                     "'auto' (what the tokenizer's own post-processor adds).")
            if setting is True and tid is None:
                raise TokenizerError(f"{name}=True: the tokenizer {_where(self)} has no {name.upper()} token; load "
                                     f"it with {name}_token=... or a tokenizer_config.json naming one, or use "
                                     f"{name}='auto' or False.")
            out.append([tid] if setting is True else list(added) if setting == "auto" else [])
        return out[0], out[1]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, as the library decodes it (``tokenizers`` and SentencePiece leave special
        tokens out; tiktoken writes them; invalid UTF-8 becomes U+FFFD).

        Args:
          ids: token ids (ints, or a numpy array).

        Returns:
          The text.
        """
        return self.backend.decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        """The id of a token string (``None``: not in the vocabulary).

        Args:
          token: as the vocabulary spells it (a special token, a SentencePiece piece such as ``"▁the"``,
            a byte-level BPE token such as ``"Ġthe"``; for tiktoken, a special token or a token's text).

        Returns:
          Its id, or ``None``.
        """
        if self.kind == "tokenizers":
            return self.backend.token_to_id(token)
        if self.kind == "tiktoken":
            try:
                return self.backend.encode_single_token(token)
            except KeyError:
                return None
        tid = self.backend.piece_to_id(token)
        return None if tid == self.backend.unk_id() and token != self.backend.id_to_piece(tid) else tid

    @property
    def vocab_size(self) -> int:
        """The largest id :meth:`encode` can give, plus 1 (special tokens included)."""
        if self.kind == "tokenizers":
            return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if self.kind == "tiktoken":
            return self.backend.max_token_value + 1
        return self.backend.get_piece_size()

    def fingerprint(self) -> str:
        """A sha256 hex digest of what defines the ids: the kind, the BOS / EOS ids, the ids ``"auto"`` adds,
        :attr:`settings` and the bytes of :attr:`files` (read now, so an edited file shows). Equal
        fingerprints: equal ids.

        Returns:
          64 hex digits.

        Raises:
          TokenizerError: a file can no longer be read.
        """
        head = {"kind": self.kind, "bos_id": self.bos_id, "eos_id": self.eos_id, "settings": self.settings,
                "added": [list(self.added_before), list(self.added_after)]}
        digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
        for path in self.files:
            data = _read_bytes(path)
            digest.update(len(data).to_bytes(8, "little") + data)
        return digest.hexdigest()


def load_tokenizer(path: str | Path, *, bos_token: str | None = None, eos_token: str | None = None,
                   pattern: str | None = None, special_tokens: dict[str, int] | None = None) -> Tokenizer:
    """A tokenizer from its directory or file.

    Args:
      path: a directory holding ``tokenizer.json`` (preferred), ``tokenizer.model`` (SentencePiece) or one
        ``*.tiktoken`` ranks file; or the file itself (any ``.json``, ``.model`` or ``.tiktoken``).
      bos_token: the BOS token (default: ``tokenizer_config.json``'s, then SentencePiece's own).
      eos_token: the EOS token (likewise).
      pattern: tiktoken only: the pre-tokenization regex (default :data:`CL100K_PATTERN`).
      special_tokens: tiktoken only: ``{token: id}`` (default: ``tokenizer_config.json``'s
        ``added_tokens_decoder``, else ``{"<|endoftext|>": largest rank + 1}``).

    Returns:
      The :class:`Tokenizer`.

    Raises:
      TokenizerError: no tokenizer file there; a file that cannot be read (or a ranks file line that is
        not ``base64 rank``); a BOS / EOS token the vocabulary lacks; ``pattern`` / ``special_tokens``
        for a tokenizer that is not tiktoken. The message names the file and the token.
    """
    file = _tokenizer_file(Path(path).expanduser())
    kind = KINDS[file.suffix]
    config_file = file.parent / "tokenizer_config.json"
    config = _read_config(config_file)
    if kind == "tiktoken":
        specials = special_tokens if special_tokens is not None else _config_specials(config, config_file)
        tok = _load_tiktoken(file, CL100K_PATTERN if pattern is None else pattern, specials)
    elif pattern is not None or special_tokens is not None:
        raise TokenizerError(f"{file}: pattern and special_tokens are for tiktoken ranks files; a {kind} "
                             "tokenizer defines its own. Leave them out.")
    else:
        tok = Tokenizer(_open_library(file, kind), kind, files=(file,))
    for name, given in (("bos", bos_token), ("eos", eos_token)):
        _set_special(tok, name, given, config, config_file)
    tok.added_before, tok.added_after = _added_specials(tok)
    return tok


def check_tokenizer(fingerprint_saved: str | None, tokenizer: Tokenizer, vocab: int | None) -> None:
    """Checks that ``tokenizer`` gives the ids a run trained with.

    Args:
      fingerprint_saved: :meth:`Tokenizer.fingerprint` of the tokenizer the run trained with (``None``: not
        recorded, not compared).
      tokenizer: the tokenizer about to encode or decode the run's ids.
      vocab: the ids the run trained with: its tokenizer's :attr:`Tokenizer.vocab_size` (``None``: not
        checked). Not the model's vocabulary rows, which may be padded beyond the tokenizer's ids.

    Raises:
      TokenizerError: ``tokenizer`` has fewer ids than ``vocab``, or another fingerprint than
        ``fingerprint_saved``; the message names both values and the fix.
    """
    fix = "use the tokenizer the run trained with (its data.tokenizer, or model.hf's tokenizer)."
    if vocab is not None and tokenizer.vocab_size < vocab:
        raise TokenizerError(f"the tokenizer {_where(tokenizer)} has {tokenizer.vocab_size} ids, fewer than the "
                             f"{vocab} of the tokenizer the run trained with; its ids would decode to other text: {fix}")
    found = tokenizer.fingerprint()
    if fingerprint_saved is not None and found != fingerprint_saved:
        raise TokenizerError(f"the tokenizer {_where(tokenizer)} has fingerprint {found[:16]}..., the run trained "
                             f"with {fingerprint_saved[:16]}...: another tokenizer (its files, BOS / EOS or specials "
                             f"differ), whose ids are other text; {fix}")


def token_bytes(ids: Iterable[int]) -> bytes:
    """The bytes that token ids of the byte-level model (no tokenizer) stand for: each id modulo 256.

    >>> token_bytes([104, 105, 256 + 33])
    b'hi!'
    """
    return bytes(int(v) & 0xFF for v in ids)


def decode_ids(tokenizer: Tokenizer | None, ids: Sequence[int]) -> str:
    """The text of token ids: :meth:`Tokenizer.decode`, or with no tokenizer the byte-level model's
    (:func:`token_bytes` as UTF-8, invalid bytes as U+FFFD).

    >>> decode_ids(None, [104, 105])
    'hi'
    """
    if tokenizer is None:
        return token_bytes(ids).decode("utf-8", "replace")
    return tokenizer.decode(ids)


def _added_specials(tok: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``tokenizer.json``'s post-processor puts before and after a text (the special tokens among
    ``encode(probe, add_special_tokens=True)``); none for the kinds without a post-processor."""
    if tok.kind != "tokenizers" or tok.backend.post_processor is None:
        return (), ()
    for probe in ("a", "x", "0", " ", ".", "the"):
        encoding = tok.backend.encode(probe, add_special_tokens=True)
        text = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
        if text:
            return tuple(encoding.ids[:text[0]]), tuple(encoding.ids[text[-1] + 1:])
    return tuple(tok.backend.encode("", add_special_tokens=True).ids), ()


def _tokenizer_file(path: Path) -> Path:
    """The tokenizer file that ``path`` (a directory or a file) names."""
    if path.is_file():
        if path.suffix not in KINDS:
            raise TokenizerError(f"{path}: not a tokenizer file; give a .json (Hugging Face tokenizers), .model "
                                 "(SentencePiece) or .tiktoken (tiktoken ranks) file, or their directory.")
        return path
    if not path.is_dir():
        raise TokenizerError(f"{path} does not exist: no tokenizer.json or tokenizer.model (SentencePiece) or "
                             "*.tiktoken ranks file there.")
    for name in ("tokenizer.json", "tokenizer.model"):
        if (path / name).is_file():
            return path / name
    ranks = sorted(p for p in path.glob("*.tiktoken") if p.is_file())
    if len(ranks) > 1:
        raise TokenizerError(f"{path}: several tiktoken ranks files ({', '.join(p.name for p in ranks)}); "
                             "give the path of the one to use.")
    if not ranks:
        raise TokenizerError(f"{path}: no tokenizer.json or tokenizer.model (SentencePiece) or *.tiktoken "
                             "ranks file in this directory.")
    return ranks[0]


def _where(tok: Tokenizer) -> str:
    return ", ".join(str(f) for f in tok.files) or f"({tok.kind})"


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({e.strerror or e}).") from None


def _read_config(config_file: Path) -> dict:
    """``tokenizer_config.json`` as a dict (``{}`` when there is none)."""
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(_read_bytes(config_file))
    except ValueError as e:
        raise TokenizerError(f"{config_file}: not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: holds a {type(config).__name__}, not a JSON object.")
    return config


def _library(kind: str, file: Path):
    """The library of ``kind`` (each kind is named after its package), imported."""
    try:
        return importlib.import_module(kind)
    except ImportError:
        raise TokenizerError(f"{file}: reading a {kind} tokenizer needs the {kind} package "
                             "(pip install 'jaxpar[data]').") from None


def _open_library(file: Path, kind: str):
    """The ``tokenizers`` / SentencePiece object of ``file``."""
    library = _library(kind, file)
    try:
        if kind == "tokenizers":
            return library.Tokenizer.from_file(str(file))
        return library.SentencePieceProcessor(model_file=str(file))
    except Exception as e:    # the libraries raise Exception, OSError or RuntimeError
        what = "Hugging Face tokenizer.json" if kind == "tokenizers" else "SentencePiece model"
        raise TokenizerError(f"{file}: cannot be read as a {what}: {e}") from None


def _set_special(tok: Tokenizer, name: str, given: str | None, config: dict, config_file: Path) -> None:
    """Sets ``tok.bos_id`` / ``eos_id`` (``name``) from the argument, the config or SentencePiece's model."""
    key = f"{name}_token"
    token, source = given, f"{key}={given!r}"
    if token is None:
        value = config.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        source = f"{config_file}: {key}={token!r}"
    if token is None:
        own = getattr(tok.backend, f"{name}_id")() if tok.kind == "sentencepiece" else -1
        setattr(tok, f"{name}_id", own if own >= 0 else None)
        return
    tid = tok.token_id(token) if isinstance(token, str) else None
    if tid is None:
        raise TokenizerError(f"{source} is not a token of {_where(tok)}; give a token of its vocabulary.")
    setattr(tok, f"{name}_id", tid)


def _config_specials(config: dict, config_file: Path) -> dict[str, int] | None:
    """``{token: id}`` of ``added_tokens_decoder`` (``None``: the config has none)."""
    added = config.get("added_tokens_decoder")
    if added is None:
        return None
    try:
        return {entry["content"]: int(tid) for tid, entry in added.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise TokenizerError(f"{config_file}: added_tokens_decoder is not {{\"<id>\": {{\"content\": token}}}}."
                             ) from None


def _read_ranks(file: Path) -> dict[bytes, int]:
    """The ``{token bytes: rank}`` of a tiktoken ranks file, checked."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(_read_bytes(file).splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        token = _base64(fields[0]) if len(fields) == 2 and fields[1].isdigit() else None
        if token is None:
            raise TokenizerError(f"{file}, line {number}: {line[:60]!r} is not 'base64-token rank' (a tiktoken "
                                 "ranks file has one such line per token).")
        if token in ranks:
            raise TokenizerError(f"{file}, line {number}: token {token!r} is already ranked {ranks[token]}.")
        ranks[token] = int(fields[1])
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{file}: a tiktoken ranks file must rank every single byte; "
                             f"{len(missing)} are missing (e.g. {bytes(missing[:4])!r}).")
    return ranks


def _base64(text: bytes) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        return None


def _check_ids(file: Path, ranks: dict[bytes, int], specials: dict[str, int]) -> None:
    """Every id used once: tiktoken aborts the process on a repeated one."""
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{file}: some rank is given to two tokens; each rank must be unique.")
    taken = set(ranks.values())
    bad = {t: i for t, i in specials.items() if not isinstance(i, int) or i < 0 or i in taken}
    if bad or len(set(specials.values())) != len(specials):
        raise TokenizerError(f"{file}: special tokens {bad or specials} need ids of their own (ints >= 0, "
                             f"unique, not ranks of the file, e.g. from {max(ranks.values()) + 1}).")


def _load_tiktoken(file: Path, pattern: str, specials: dict[str, int] | None) -> Tokenizer:
    """A tiktoken tokenizer of a ranks file (read here, not by ``tiktoken.load.load_tiktoken_bpe``, which
    keeps a copy of each path's contents in a temporary cache and would serve an edited file stale)."""
    library = _library("tiktoken", file)
    ranks = _read_ranks(file)
    specials = dict({"<|endoftext|>": max(ranks.values()) + 1} if specials is None else specials)
    _check_ids(file, ranks, specials)
    try:
        backend = library.Encoding(file.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError as e:    # a pattern that does not compile
        raise TokenizerError(f"{file}: tiktoken refuses pattern={pattern!r}: {e}") from None
    return Tokenizer(backend, "tiktoken", files=(file,), settings={"pattern": pattern, "special_tokens": specials})
