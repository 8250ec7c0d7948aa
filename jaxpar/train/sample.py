"""Greedy decoding from a trained language model, for the text samples written at the end of a run.

The parameters are gathered to the host and the model runs on one device (no
mesh, no rules): sampling a few short continuations needs no parallelism. Each new
token recomputes the model over a fixed window of ``context`` tokens (the last
``context`` generated), so one compilation serves every position.

Example::

    >>> out = greedy_generate(layout.graphdef, state.params, [b"def main(", b"import "],
    ...                       context=64, new_tokens=32)                        # doctest: +SKIP
    >>> out[0]                                                                  # doctest: +SKIP
    b'def main(self, name):\\n        return self._...'
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["greedy_generate", "format_samples"]


def greedy_generate(graphdef: Any, params: Any, prompts: Sequence[bytes | Sequence[int]], *, context: int,
                    new_tokens: int) -> list[list[int]] | list[bytes]:
    """Extend each prompt by ``new_tokens`` argmax tokens; returns bytes for ``bytes`` prompts, else token lists.

    ``graphdef`` / ``params`` are the model's (``layout.graphdef``, ``state.params``);
    the model maps ``int32[B, T<=context] -> logits[B, T, vocab]`` causally.
    """
    if context < 1 or new_tokens < 0:
        raise ValueError(f"greedy_generate(context={context!r}, new_tokens={new_tokens!r}): context must be "
                         ">= 1 and new_tokens >= 0.")
    if not prompts:
        return []
    as_bytes = isinstance(prompts[0], (bytes, bytearray))
    rows = [list(p) for p in prompts]
    if any(not r for r in rows):
        raise ValueError("greedy_generate: every prompt needs at least one token.")
    host = jax.device_get(params)
    device = jax.devices()[0]
    params1 = jax.device_put(host, device)

    @jax.jit
    def next_tokens(p, window, last):          # window int32[B, context], last int32[B]: index of the last token
        logits = nnx.merge(graphdef, p)(window)
        picked = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return jnp.argmax(picked, axis=-1).astype(jnp.int32)

    for _ in range(new_tokens):
        window = np.zeros((len(rows), context), np.int32)
        last = np.zeros((len(rows),), np.int32)
        for i, r in enumerate(rows):
            w = r[-context:]
            window[i, :len(w)] = w
            last[i] = len(w) - 1
        nxt = np.asarray(next_tokens(params1, jax.device_put(window, device), jax.device_put(last, device)))
        for i, r in enumerate(rows):
            r.append(int(nxt[i]))
    if as_bytes:
        return [bytes(v & 0xFF for v in r) for r in rows]
    return rows


def format_samples(prompts: Sequence[bytes | Sequence[int]], outputs: Sequence[bytes | Sequence[int]]) -> str:
    """Human-readable samples: ``--- sample i ---`` headers; bytes decoded as UTF-8 (invalid bytes replaced)."""
    parts = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if isinstance(o, (bytes, bytearray)):
            text = (f"[prompt] {bytes(p).decode('utf-8', 'replace')!r}\n"
                    f"{bytes(o).decode('utf-8', 'replace')}")
        else:
            text = f"[prompt] {list(p)}\n{list(o)}"
        parts.append(f"--- sample {i} ---\n{text}\n")
    return "\n".join(parts)
