"""The token-embedding lookup that moves rows, not the table, under ZeRO-3 / FSDP.

A model that looks its token table ``[vocab, embed]`` up with :func:`embed_lookup` names it
:data:`jaxpar.logical.ROW_TABLE` (``("vocab", "table_embed")``), and ZeRO-3 / FSDP stores it split on
``embed`` over the axes that shard the parameters (the rule ``stored_rows``, :meth:`jaxpar.Strategy.rules`).
A table named ``("vocab", "embed")`` is split on its largest dimension, as a plain ``jnp.take`` needs: split
on ``embed``, XLA would carry that split into the activations. Gathering the whole table for a lookup
moves ``vocab x embed`` per device, and its gradient as much again. Where a device holds fewer tokens than
the vocabulary, :func:`embed_lookup` gathers the token ids over those axes instead, looks up
its own slice of ``embed`` for all of them, and one all-to-all gives every device its tokens' whole rows;
the backward runs the same in reverse, so no whole-table gradient is formed (Levanter's lookup).

Example::

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jaxpar.parallel import embed_lookup
    >>> table, tokens = jnp.arange(12.0).reshape(4, 3), jnp.array([[3, 0]])
    >>> embed_lookup(table, tokens).tolist()          # outside a strategy: jnp.take
    [[[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]]
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.errors import RulesError
from jaxpar.parallel._regions import spec_entry
from jaxpar.logical import ROW_TABLE, TOKEN_TABLE
from jaxpar.rules import axes_of, constrain, constrain_spec, current_rules, logical_to_spec, manual_axes

TABLE_EMBED = ROW_TABLE[1]     # the logical name of a row-looked-up token table's ``embed`` dimension
STORED_ROWS = "stored_rows"    # no parameter's name: its rule gives the axes ZeRO splits a ROW_TABLE's embed over


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows of ``table`` for ``tokens``, moving rows rather than the table where that is fewer bytes.

    Args:
      table: the token table ``[vocab, embed]``, named :data:`~jaxpar.logical.ROW_TABLE` in the model.
      tokens: int token ids, batch first (``[batch, ...]``).

    Returns:
      ``table[tokens]``, ``[*tokens.shape, embed]``; the caller constrains it to its own layout.
    """
    axes, batch = _row_axes(table, tokens)
    if not axes:
        return jnp.take(constrain(table, TOKEN_TABLE), tokens, axis=0)
    kept = spec_entry(tuple(a for a in batch if a not in axes))      # the ids, gathered over ``axes``
    rows = jnp.take(constrain_spec(table, PartitionSpec(None, spec_entry(axes))),
                    constrain_spec(tokens, PartitionSpec(kept)), axis=0)
    return constrain_spec(rows, PartitionSpec(kept, *(None,) * (tokens.ndim - 1), spec_entry(axes)))


def _row_axes(table: jax.Array, tokens: jax.Array) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes the rows move over and those that split the batch; ``()`` for the former for the plain
    lookup: outside a strategy, with the vocabulary or ``embed`` split for compute (tensor parallelism), inside
    a ``shard_map`` (a pipeline stage), when they do not split the batch, or when a device holds as many
    tokens as the vocabulary."""
    ctx = current_rules()
    if ctx is None or table.ndim != 2 or manual_axes():
        return (), ()
    mesh, rules = ctx
    sizes = dict(mesh.shape)
    try:
        stored = axes_of(logical_to_spec((None, STORED_ROWS), rules, mesh, shape=table.shape)[1])
        compute = logical_to_spec(TOKEN_TABLE, rules, mesh, shape=table.shape)
        batch = axes_of(logical_to_spec(("batch",), rules, mesh, shape=tokens.shape[:1])[0])
    except RulesError:          # rules without these names: the plain lookup
        return (), ()
    axes = tuple(a for a in stored if sizes[a] > 1)
    unsplit = all(sizes[a] == 1 for e in compute for a in axes_of(e))
    few_tokens = tokens.size // math.prod(sizes[a] for a in batch) < table.shape[0]
    moves = axes and unsplit and set(axes) <= set(batch) and few_tokens
    return (axes if moves else ()), batch
