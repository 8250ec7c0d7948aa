"""The errors of :mod:`jaxpar.data`: each names the file, field or value at fault and the fix."""

from __future__ import annotations

__all__ = ["DataError", "SourceError", "TokenizerError", "CacheError"]


class DataError(ValueError):
    """Data that jaxpar cannot turn into batches (the base of the errors below)."""


class SourceError(DataError):
    """A document source that cannot be read: a missing file or field, an empty source, a malformed record."""


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded, or a special token it lacks."""


class CacheError(DataError):
    """A token cache that is missing, damaged, or was built from other sources, tokenizer or options."""
