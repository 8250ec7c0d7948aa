"""Greedy decoding from a trained language model, for the text samples written at the end of a run.

The parameters are gathered to the host and the model runs on one device (no
mesh, no rules): sampling a few short continuations needs no parallelism. With
several processes the parameters are spread over them: :func:`host_params` gathers
them with one jitted all-gather, so every process must call it (or
:func:`greedy_generate`), and each gets the full parameters. A
:class:`~jaxpar.models.Decoder` decodes with its KV cache: one compilation reads the
prompts, one more adds each token. Any other model runs again over the whole
sequence (or its last ``context`` tokens) for each new token, padded to one length,
so one compilation serves every position.

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
    >>> greedy_generate(graphdef, params, [[1, 2]], new_tokens=2)    # token lists in, lists out; all tokens seen
    [[1, 2, 3, 4]]
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import GenerationError, check_int
from jaxpar.data._tokenizers import token_bytes

_CACHE_ROUND = 64      # KV cache slots are rounded up to a multiple of this (capped at the model's max positions)


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


def greedy_generate(graphdef: Any, params: Any, prompts: Sequence[bytes | Sequence[int]], *, new_tokens: int,
                    context: int | None = None, max_positions: int | None = None) -> list[list[int]] | list[bytes]:
    """Extend each prompt by ``new_tokens`` argmax tokens.

    A model with a KV cache (a :class:`~jaxpar.models.Decoder`: ``init_cache`` and ``decode``) reads
    the prompts once (left-padded to the longest: one compilation) and then one token per call (a
    second compilation), each attending over the whole prompt and continuation. Any other model maps
    ``int32[B, T] -> logits[B, T, vocab]`` causally and runs again over the sequence for each new
    token, padded to a fixed length (one compilation): the last ``context`` tokens, or the whole
    sequence. With parameters spread over several processes every process must call it (see
    :func:`host_params`); each decodes on its first local device and gets the same tokens.

    Args:
      graphdef: the model's graph definition (``layout.graphdef``).
      params: its parameters (``state.params``, or :func:`host_params` of them).
      prompts: ``bytes`` prompts, or token-id lists; each at least one token.
      new_tokens: how many tokens to add (>= 0).
      context: for a model without a KV cache, the most tokens it sees (>= 1; e.g. the length of its
        learned position table): each token is predicted from the last ``context``. ``None``: from
        all. A model with a KV cache sees all; its limit is ``max_positions``.
      max_positions: the longest prompt plus continuation the model takes (e.g. a checkpoint's
        ``max_position_embeddings``); ``None``: the decoder's ``cfg.max_positions``, else no limit.

    Returns:
      Each prompt followed by its new tokens: ``bytes`` for ``bytes`` prompts, else lists of ints.

    Raises:
      GenerationError: ``new_tokens`` < 0, ``context`` or ``max_positions`` < 1, an empty prompt, or a
        prompt plus ``new_tokens`` longer than ``max_positions``.
    """
    for name, value, least in (("new_tokens", new_tokens, 0), ("context", context, 1),
                               ("max_positions", max_positions, 1)):
        if value is not None:
            check_int("greedy_generate", name, value, least, GenerationError)
    if not prompts:
        return []
    as_bytes = isinstance(prompts[0], (bytes, bytearray))
    rows = [list(p) for p in prompts]
    if any(not r for r in rows):
        empty = [i for i, r in enumerate(rows) if not r]
        raise GenerationError(f"greedy_generate: prompts {empty} have no token; give each prompt at least one.")
    if new_tokens:
        device = jax.local_devices()[0]
        params1 = jax.device_put(host_params(params), device)
        model = nnx.merge(graphdef, params1)
        cached = callable(getattr(model, "init_cache", None)) and callable(getattr(model, "decode", None))
        if max_positions is None and cached:
            max_positions = getattr(getattr(model, "cfg", None), "max_positions", None)
        _check_lengths(rows, new_tokens, max_positions)
        if cached:
            new = _cached_decode(graphdef, params1, model, rows, new_tokens, max_positions, device)
        else:
            new = _recompute_decode(graphdef, params1, rows, new_tokens, context, device)
        rows = [r + list(n) for r, n in zip(rows, new.tolist())]
    if as_bytes:
        return [token_bytes(r) for r in rows]
    return rows


def _check_lengths(rows: list[list[int]], new_tokens: int, max_positions: int | None) -> None:
    """A :class:`GenerationError` when a prompt plus ``new_tokens`` exceeds ``max_positions``."""
    longest = max(len(r) for r in rows)
    if max_positions is not None and longest + new_tokens > max_positions:
        raise GenerationError(
            f"greedy_generate: a prompt of {longest} tokens plus new_tokens={new_tokens} is {longest + new_tokens} "
            f"tokens, more than the model's max_positions={max_positions} (the longest sequence its positions "
            f"were trained for); {length_fixes(longest, new_tokens, max_positions)}.")


def length_fixes(prompt: int, new_tokens: int, max_positions: int, tokens: str = "new_tokens") -> str:
    """The fixes, in words, for a prompt of ``prompt`` tokens plus ``new_tokens`` beyond ``max_positions``.

    Args:
      prompt: the (longest) prompt's tokens.
      new_tokens: the new tokens asked for.
      max_positions: the most tokens the model takes.
      tokens: what sets the number of new tokens (``new_tokens``; ``jaxpar sample``'s ``--tokens``).

    Returns:
      The fixes that work: fewer new tokens (while the prompt leaves room), a shorter prompt (while the new
      tokens do), else both.

    >>> length_fixes(6, 5, 10)
    'ask for fewer new_tokens: at most 4, or shorten the prompt to 5 tokens'
    >>> length_fixes(600, 10, 512, "--tokens")
    'shorten the prompt to 502 tokens (the prompt alone fills the 512 positions)'
    >>> length_fixes(600, 600, 512, "--tokens")
    'shorten the prompt and ask for fewer --tokens: the two together at most 512 tokens'
    """
    fixes = [f"ask for fewer {tokens}: at most {max_positions - prompt}"] if prompt < max_positions else []
    if new_tokens < max_positions:
        alone = "" if fixes else f" (the prompt alone fills the {max_positions} positions)"
        fixes.append(f"shorten the prompt to {max_positions - new_tokens} tokens{alone}")
    return ", or ".join(fixes) or (f"shorten the prompt and ask for fewer {tokens}: the two together at most "
                                   f"{max_positions} tokens")


def _cached_decode(graphdef: Any, params: Any, model: Any, rows: list[list[int]], new_tokens: int,
                   max_positions: int | None, device: Any) -> np.ndarray:
    """``int[B, new_tokens]`` by the model's KV cache: a prefill of the left-padded prompts, then steps."""
    longest = max(len(r) for r in rows)
    size = -(-(longest + new_tokens) // _CACHE_ROUND) * _CACHE_ROUND
    size = size if max_positions is None else min(size, max_positions)
    prompt = np.zeros((len(rows), longest), np.int32)
    for i, r in enumerate(rows):
        prompt[i, longest - len(r):] = r
    start = np.asarray([longest - len(r) for r in rows], np.int32)
    cache = jax.device_put(model.init_cache(len(rows), size, start=start), device)

    @functools.partial(jax.jit, donate_argnums=2)
    def cached_step(p, tokens, cache):          # tokens int32[B, t] at slots cache.length ...
        logits, cache = nnx.merge(graphdef, p).decode(tokens, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    out = []
    tokens = jax.device_put(prompt, device)
    for _ in range(new_tokens):
        nxt, cache = cached_step(params, tokens, cache)
        out.append(nxt)
        tokens = nxt[:, None]
    return np.stack([np.asarray(t) for t in out], axis=1)


def _recompute_decode(graphdef: Any, params: Any, rows: list[list[int]], new_tokens: int, context: int | None,
                      device: Any) -> np.ndarray:
    """``int[B, new_tokens]`` by running the model over the last ``context`` tokens (or all) per new token."""
    width = context if context is not None else max(len(r) for r in rows) + new_tokens - 1
    rows = [list(r) for r in rows]

    @jax.jit
    def recompute_step(p, window, last):        # window int32[B, width], last int32[B]: index of the last token
        logits = nnx.merge(graphdef, p)(window)
        picked = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return jnp.argmax(picked, axis=-1).astype(jnp.int32)

    for _ in range(new_tokens):
        window = np.zeros((len(rows), width), np.int32)
        last = np.zeros((len(rows),), np.int32)
        for i, r in enumerate(rows):
            w = r[-width:]
            window[i, :len(w)] = w
            last[i] = len(w) - 1
        nxt = np.asarray(recompute_step(params, jax.device_put(window, device), jax.device_put(last, device)))
        for i, r in enumerate(rows):
            r.append(int(nxt[i]))
    return np.asarray([r[-new_tokens:] for r in rows], np.int32)


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
    prompts = [token_bytes(r[:plen]) if opts.text else [int(t) for t in r[:plen]] for r in rows]
    outs = greedy_generate(graphdef, params, prompts, context=opts.context, new_tokens=opts.new_tokens)
    Path(path).write_text(format_samples(prompts, outs, opts.decode))
    return str(path)
