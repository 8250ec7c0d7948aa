"""The FSDP token lookup moves rows, not the table (jaxpar.parallel.embed_lookup): exact against one device,
the table stored split on ``embed``, the compiled collectives and the cost model's bytes per axis."""
import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar.analysis._cost_check import compare
from jaxpar.analysis._hlo import collectives
from jaxpar.cost import Plan, gpt
from jaxpar.models import GPTConfig

from helpers import CFG, GLOBAL_BATCH, assert_runs_match, compile_step, run
from jaxpar.strategy import Strategy

TABLE_BYTES = CFG.vocab * CFG.embed * 4


def _kinds(compiled, mesh) -> dict:
    out: dict = {}
    for c in collectives(compiled, mesh):
        out.setdefault(c.kind, []).append(c.bytes)
    return out


def test_fsdp_moves_token_rows_and_matches_one_device():
    # 16 x 16 tokens over 8 devices: 32 a device, fewer than the vocabulary's 64
    mesh, layout, compiled = compile_step({"fsdp": 8})
    assert layout.params["wte"][1] == "fsdp"                            # stored split on embed
    kinds = _kinds(compiled, mesh)
    assert len(kinds["all-to-all"]) == 2                                # the rows, forward and backward
    assert kinds["all-gather"].count(TABLE_BYTES) == 1                  # the head's [embed, vocab], not the table
    model = gpt(CFG.layers, CFG.embed, CFG.heads, CFG.seq_len, CFG.vocab, GLOBAL_BATCH, CFG.mlp_dim)
    row = compare(model, Plan(fsdp=8), compiled, mesh)
    assert row["axes"]["fsdp"]["error"] < 0.01
    assert_runs_match(run({"fsdp": 8}), run({}))


def test_zero3_over_data_and_fsdp_moves_rows_and_matches_one_device():
    # the table's embed split fsdp-major, the batch data-major: a permute beside each all-to-all
    strategy = jaxpar.Strategy(zero=3)
    mesh, layout, compiled = compile_step({"data": 2, "fsdp": 4}, strategy)
    kinds = _kinds(compiled, mesh)
    assert len(kinds["all-to-all"]) == 2 and kinds["all-gather"].count(TABLE_BYTES) == 1
    model = gpt(CFG.layers, CFG.embed, CFG.heads, CFG.seq_len, CFG.vocab, GLOBAL_BATCH, CFG.mlp_dim)
    row = compare(model, Plan(data=2, fsdp=4, strategy=Strategy(zero=3)), compiled, mesh)
    assert all(axis["error"] < 0.01 for axis in row["axes"].values())
    assert_runs_match(run({"data": 2, "fsdp": 4}, strategy), run({}))


def test_a_device_with_as_many_tokens_as_the_vocabulary_gathers_the_table():
    cfg = GPTConfig(vocab=16, seq_len=16, embed=32, heads=8, layers=2)      # 32 tokens a device >= 16
    mesh, _, compiled = compile_step({"fsdp": 8}, cfg=cfg)
    assert "all-to-all" not in _kinds(compiled, mesh)
    model = gpt(cfg.layers, cfg.embed, cfg.heads, cfg.seq_len, cfg.vocab, GLOBAL_BATCH, cfg.mlp_dim)
    assert compare(model, Plan(fsdp=8), compiled, mesh)["axes"]["fsdp"]["error"] < 0.01     # the table gathered


def test_outside_a_strategy_and_under_tensor_parallelism_the_lookup_is_take():
    table, tokens = jnp.arange(24.0).reshape(8, 3), jnp.array([[5, 1], [0, 7]])
    assert (jaxpar.parallel.embed_lookup(table, tokens) == jnp.take(table, tokens, axis=0)).all()
    mesh, _, compiled = compile_step({"fsdp": 4, "tensor": 2})         # the vocabulary split over tensor
    assert "all-to-all" not in _kinds(compiled, mesh)
