"""A model cut for a pipeline: embedding (first stage), one repeated layer, head + loss (last stage).

Example:
    >>> parts = gpt_parts(remat="none")
    >>> parts.pre_keys, parts.blocks_key, parts.post_keys
    (('wte', 'wpe'), 'blocks', ('lnf_scale', 'lnf_bias', 'head'))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..models import gpt

__all__ = ["PipelineParts", "gpt_parts"]


@dataclass(frozen=True)
class PipelineParts:
    """How the executor runs a model.

    - ``pre(pre_params, batch) -> x``: runs on the first stage (embedding).
    - ``layer(layer_params, x) -> x``: one block; its parameters are stacked on
      a leading ``layers`` axis under ``params[blocks_key]``.
    - ``post(post_params, x, batch) -> loss``: head and loss, averaged over the
      micro-batch's rows; runs on the last stage.
    - ``pre_keys`` / ``post_keys``: the top-level parameter names of each part.
    """

    pre: Callable
    layer: Callable
    post: Callable
    pre_keys: tuple[str, ...]
    post_keys: tuple[str, ...]
    blocks_key: str = "blocks"

    def split(self, params: dict) -> tuple[dict, Any, dict]:
        """``params -> (pre, blocks, post)``; every top-level key must belong to one part."""
        known = set(self.pre_keys) | set(self.post_keys) | {self.blocks_key}
        extra = sorted(set(params) - known)
        missing = sorted(known - set(params))
        if extra or missing:
            raise ValueError(f"PipelineParts: parameters {extra} belong to no part and {missing} are missing; "
                             f"the parts are pre={self.pre_keys}, blocks={self.blocks_key!r}, "
                             f"post={self.post_keys}. List every top-level parameter in one of them.")
        return ({k: params[k] for k in self.pre_keys}, params[self.blocks_key],
                {k: params[k] for k in self.post_keys})

    def merge(self, pre: dict, blocks: Any, post: dict) -> dict:
        """Inverse of :meth:`split`."""
        return {**pre, self.blocks_key: blocks, **post}


def gpt_parts(remat: str = "none") -> PipelineParts:
    """The GPT decoder (:mod:`jaxpar.models.gpt`) with its next-token loss."""
    return PipelineParts(
        pre=lambda p, batch: gpt.embed_apply(p, batch["tokens"]),
        layer=gpt.remat_block(remat),
        post=lambda p, x, batch: gpt.cross_entropy(gpt.head_apply(p, x), batch["targets"]),
        pre_keys=gpt.EMBED_KEYS, post_keys=gpt.HEAD_KEYS)
