"""A checkpoint's tokenizer: ``tokenizer.json`` through ``tokenizers``, or a SentencePiece ``tokenizer.model``.

``transformers`` 5 names tokenizer classes that 4.x does not know, so jaxpar reads the files
directly: the ids are those of the reference library's own encoder. BOS and EOS are never added
silently: :meth:`Tokenizer.encode` adds them only when asked.

>>> import tempfile, pathlib, tokenizers
>>> from tokenizers import models, pre_tokenizers, decoders, trainers
>>> tok = tokenizers.Tokenizer(models.BPE())
>>> tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
>>> tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
>>> d = pathlib.Path(tempfile.mkdtemp()); tok.save(str(d / "tokenizer.json"))
>>> t = load_tokenizer(d)
>>> ids = t.encode("hello world")
>>> t.decode(ids), t.token_id("</s>")
('hello world', 1)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HFTokenizerError", "Tokenizer", "load_tokenizer"]


class HFTokenizerError(ValueError):
    """The checkpoint has no tokenizer jaxpar can read, or a special token it names is unknown."""


@dataclass
class Tokenizer:
    """Text <-> ids. ``bos_id`` / ``eos_id``: from ``tokenizer_config.json`` (or ``None``)."""

    backend: Any
    kind: str
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """The ids of ``text`` (no special tokens unless ``bos`` / ``eos``)."""
        if self.kind == "tokenizers":
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self.backend.encode(text)
        for flag, tid, name in ((bos, self.bos_id, "bos"), (eos, self.eos_id, "eos")):
            if flag and tid is None:
                raise HFTokenizerError(f"encode({name}=True): the tokenizer has no {name} token.")
        return ([self.bos_id] if bos else []) + list(ids) + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids))

    def token_id(self, token: str) -> int | None:
        """The id of a token string (``None``: not in the vocabulary)."""
        if self.kind == "tokenizers":
            return self.backend.token_to_id(token)
        tid = self.backend.piece_to_id(token)
        return None if tid == self.backend.unk_id() and token != self.backend.id_to_piece(tid) else tid

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size() if self.kind == "tokenizers" else self.backend.get_piece_size()


def _special(config: dict, name: str) -> str | None:
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory.

    Args:
      path: the directory, holding ``tokenizer.json`` (preferred) or ``tokenizer.model``.

    Returns:
      The :class:`Tokenizer`.

    Raises:
      HFTokenizerError: neither file is there, or ``tokenizer_config.json`` names a BOS / EOS token
        that the vocabulary lacks.
    """
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        import tokenizers

        tok = Tokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), "tokenizers")
    elif (path / "tokenizer.model").is_file():
        import sentencepiece

        tok = Tokenizer(sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model")),
                        "sentencepiece")
    else:
        raise HFTokenizerError(f"{path}: no tokenizer.json or tokenizer.model (SentencePiece).")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for name in ("bos", "eos"):
        token = _special(config, f"{name}_token")
        if token is None:
            continue
        tid = tok.token_id(token)
        if tid is None:
            raise HFTokenizerError(f"{config_file}: {name}_token={token!r} is not in the tokenizer's vocabulary.")
        setattr(tok, f"{name}_id", tid)
    return tok
