"""Real data: document sources, tokenizers, a token cache, packing, and global batches that are a pure
function of the step (docs/data.md).

The layers, bottom up: :mod:`~jaxpar.data.sources` (documents from JSONL, Parquet, ArrayRecord,
Hugging Face ``save_to_disk`` directories), :mod:`~jaxpar.data.tokenizers`, :mod:`~jaxpar.data.tokens`
(documents as tokens: cached, live, or a token file), :mod:`~jaxpar.data.cache` (``jaxpar data
prepare``), :mod:`~jaxpar.data.packing` and :mod:`~jaxpar.data.row_plan` (which pieces fill global row
``i``, from the lengths alone), :mod:`~jaxpar.data.loader` (batches with a background prefetch) and
:mod:`~jaxpar.data.rows` (each process's rows of a global batch).
"""

from jaxpar.errors import CacheError as CacheError, DataError as DataError, SourceError as SourceError
from jaxpar.errors import TokenizerError as TokenizerError
from jaxpar.data.loader import PackedBatches as PackedBatches, batch_digest as batch_digest
from jaxpar.data.packing import PACK_METHODS as PACK_METHODS
from jaxpar.data.row_plan import StreamPlan as StreamPlan, split_documents as split_documents
from jaxpar.data.rows import make_global_batch as make_global_batch, process_rows as process_rows

__all__ = ["DataError", "SourceError", "TokenizerError", "CacheError", "PackedBatches", "batch_digest",
           "PACK_METHODS", "StreamPlan", "split_documents", "make_global_batch", "process_rows"]
