"""Greedy decoding from a trained language model, for the text samples written at the end of a run.

The parameters are gathered to the host and the model runs on one device (no
mesh, no rules): sampling a few short continuations needs no parallelism. With
several processes the parameters are spread over them: :func:`host_params` gathers
them with one jitted all-gather, so every process must call it (or
:func:`greedy_generate`), and each gets the full parameters. Each new
token recomputes the model over a fixed window of ``context`` tokens (the last
``context`` generated), so one compilation serves every position.

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Next(nnx.Module):                  # a causal byte "model" that always predicts token + 1
    ...     def __init__(self, vocab):
    ...         self.table = nnx.Param(jnp.roll(jnp.eye(vocab), 1, axis=1))   # row t: one-hot of t + 1
    ...     def __call__(self, tokens):          # int32[B, T] -> logits[B, T, vocab]
    ...         return self.table[...][tokens]
    >>> graphdef, params = nnx.split(Next(256))  # a trained run: layout.graphdef, state.params
    >>> greedy_generate(graphdef, params, [b"abc", b"x"], context=4, new_tokens=3)
    [b'abcdef', b'xyz{']
    >>> greedy_generate(graphdef, params, [[1, 2]], context=4, new_tokens=2)    # token lists in, lists out
    [[1, 2, 3, 4]]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["greedy_generate", "host_params", "format_samples", "SampleOptions", "write_samples"]


class SampleOptions(NamedTuple):
    """The text samples written at the end of a run (``jaxpar train``: ``logging.samples`` and
    ``logging.sample_tokens``): ``count`` prompts of the first ``min(16, context // 2)`` tokens of
    held-out rows, each continued by ``new_tokens`` greedy tokens; ``text``: the tokens are bytes;
    ``decode``: ``ids -> str``, a tokenizer's (e.g. :meth:`jaxpar.hf.Tokenizer.decode`), for token ids
    that are no bytes (None: written as numbers)."""

    count: int
    context: int
    new_tokens: int
    text: bool = True
    decode: Callable[[list[int]], str] | None = None


def host_params(params: Any) -> Any:
    """``params`` as host NumPy arrays, also when they are spread over several processes.

    Fully addressable arrays: :func:`jax.device_get`. Otherwise one jitted identity
    with a replicated output (an all-gather over every device of the mesh, a collective:
    every process must call this with the same tree), then this process's copy.

    Args:
      params: a pytree of (possibly sharded, possibly multi-process) arrays.

    Returns:
      The same tree with NumPy arrays holding the full values.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in leaves):
        return jax.device_get(params)
    meshes = {x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)}
    if len(meshes) != 1 or not all(isinstance(x.sharding, NamedSharding) for x in leaves):
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)      # one program per leaf
    replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(meshes.pop(), PartitionSpec()))(params)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x,
                        replicated)


def greedy_generate(graphdef: Any, params: Any, prompts: Sequence[bytes | Sequence[int]], *, context: int,
                    new_tokens: int) -> list[list[int]] | list[bytes]:
    """Extend each prompt by ``new_tokens`` argmax tokens.

    The model maps ``int32[B, T<=context] -> logits[B, T, vocab]`` causally. With parameters spread
    over several processes every process must call it (see :func:`host_params`); each decodes on its
    first local device and gets the same tokens.

    Args:
      graphdef: the model's graph definition (``layout.graphdef``).
      params: its parameters (``state.params``, or :func:`host_params` of them).
      prompts: ``bytes`` prompts, or token-id lists; each at least one token.
      context: the window of last tokens the model sees (>= 1); one compilation serves every position.
      new_tokens: how many tokens to add (>= 0).

    Returns:
      Each prompt followed by its new tokens: ``bytes`` for ``bytes`` prompts, else lists of ints.
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
    host = host_params(params)
    device = jax.local_devices()[0]
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


def format_samples(prompts: Sequence[bytes | Sequence[int]], outputs: Sequence[bytes | Sequence[int]],
                   decode: Callable[[list[int]], str] | None = None) -> str:
    """Human-readable samples: ``--- sample i ---`` headers, the prompt, then the output.

    Args:
      prompts: the prompts, ``bytes`` or token-id lists.
      outputs: the prompts with their continuations, as :func:`greedy_generate` returns them.
      decode: ``ids -> str`` for token ids (None: written as numbers); bytes are decoded as UTF-8
        (invalid bytes replaced).

    Returns:
      The text, one block per sample.

    >>> print(format_samples([[72, 105]], [[72, 105, 33]], decode=lambda ids: "".join(map(chr, ids))))
    --- sample 0 ---
    [prompt] 'Hi'
    Hi!
    <BLANKLINE>
    """
    parts = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if isinstance(o, (bytes, bytearray)):
            text = (f"[prompt] {bytes(p).decode('utf-8', 'replace')!r}\n"
                    f"{bytes(o).decode('utf-8', 'replace')}")
        elif decode is not None:
            text = f"[prompt] {decode([int(t) for t in p])!r}\n{decode([int(t) for t in o])}"
        else:
            text = f"[prompt] {list(p)}\n{list(o)}"
        parts.append(f"--- sample {i} ---\n{text}\n")
    return "\n".join(parts)


def write_samples(graphdef: Any, params: Any, batch: Any, path: str | Path, opts: SampleOptions) -> str:
    """Greedy continuations of the first rows of ``batch`` -> ``path`` (:func:`format_samples`).

    Args:
      graphdef: the model's graph definition (``layout.graphdef``).
      params: the parameters, on the host (:func:`host_params`: with several processes every
        process gathers them, then only one writes).
      batch: a batch with a ``tokens`` leaf ``[B, T]`` (e.g. the first eval batch); its first
        ``opts.count`` rows give the prompts.
      path: the file to write.
      opts: how many samples, the context, the new tokens, bytes or token ids, how to decode them.

    Returns:
      ``path`` as a string.

    Example:
      >>> import tempfile, jax.numpy as jnp, numpy as np
      >>> class Next(nnx.Module):                  # always predicts token + 1
      ...     def __init__(self, vocab):
      ...         self.table = nnx.Param(jnp.roll(jnp.eye(vocab), 1, axis=1))
      ...     def __call__(self, tokens):
      ...         return self.table[...][tokens]
      >>> graphdef, params = nnx.split(Next(256))
      >>> batch = {"tokens": np.array([list(b"hello world!")], np.int32)}
      >>> path = write_samples(graphdef, params, batch, tempfile.mkdtemp() + "/samples.txt",
      ...                      SampleOptions(count=1, context=8, new_tokens=2))
      >>> print(Path(path).read_text())
      --- sample 0 ---
      [prompt] 'hell'
      hellmn
      <BLANKLINE>
    """
    rows = batch["tokens"][: opts.count]
    plen = max(1, min(16, opts.context // 2))
    prompts = [bytes(r[:plen].astype("uint8")) if opts.text else [int(t) for t in r[:plen]] for r in rows]
    outs = greedy_generate(graphdef, params, prompts, context=opts.context, new_tokens=opts.new_tokens)
    Path(path).write_text(format_samples(prompts, outs, opts.decode))
    return str(path)
