"""Real data: document sources, tokenizers, a token cache, packing, and global batches that are a pure
function of the step (docs/data.md).

The layers, bottom up: :mod:`~jaxpar.data.sources` (documents from JSONL, Parquet, ArrayRecord,
Hugging Face ``save_to_disk`` directories), :mod:`~jaxpar.data._tokenizers`, :mod:`~jaxpar.data._tokens`
(documents as tokens: cached, live, or a token file), :mod:`~jaxpar.data._cache` (``jaxpar data
prepare``), :mod:`~jaxpar.data._packing` and :mod:`~jaxpar.data._row_plan` (which pieces fill global row
``i``, from the lengths alone), :mod:`~jaxpar.data._loader` (batches with a background prefetch) and
:mod:`~jaxpar.data._rows` (each process's rows of a global batch).
"""

from jaxpar.errors import CacheError, DataError, SourceError, TokenizerError
from jaxpar.data._loader import PackedBatches, batch_digest
from jaxpar.data._packing import PACK_METHODS
from jaxpar.data._row_plan import StreamPlan, split_documents
from jaxpar.data._rows import make_global_batch, process_rows
from jaxpar.data._tokenizers import Tokenizer, check_tokenizer, load_tokenizer
from jaxpar.data._tokens import CachedTokens, LiveTokens, TokenFile

__all__ = ["DataError", "SourceError", "TokenizerError", "CacheError", "PackedBatches", "batch_digest",
           "PACK_METHODS", "StreamPlan", "split_documents", "make_global_batch", "process_rows", "Tokenizer", "load_tokenizer", "check_tokenizer",
           "CachedTokens", "LiveTokens", "TokenFile"]
