"""A checkpoint's tokenizer: :mod:`jaxpar.data._tokenizers` under its former names.

:func:`load_tokenizer` reads a checkpoint directory's ``tokenizer.json`` (or ``tokenizer.model``, or a
tiktoken ranks file) with its ``tokenizer_config.json``; ``HFTokenizerError`` is
:class:`jaxpar.errors.TokenizerError`.
"""

from __future__ import annotations

from jaxpar.errors import TokenizerError as HFTokenizerError
from jaxpar.data._tokenizers import Tokenizer, load_tokenizer

