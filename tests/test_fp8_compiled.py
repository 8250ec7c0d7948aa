"""FP8 proven in the program XLA:GPU compiles for 8 H100s, without the GPUs (issue 55, acceptance 2): a
Llama-3-style decoder's train step under ZeRO-3 runs every covered matmul as an FP8 GEMM, as many as the
model has; ZeRO-3 gathers the covered weights in FP8, at half the bf16 program's bytes; and a
quantize-dequantize matmul (Flax's FP8 op) is named as not FP8."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxpar
from jaxpar.analysis._gemms import check_fp8_gemms, gemms
from jaxpar.analysis._hlo_text import array_shapes, parse_instructions, shape_bytes
from jaxpar.analysis._loops import trip_counts
from jaxpar.batch import batch_sharding
from jaxpar.devices import parse_target, target_devices
from jaxpar.errors import Fp8Error
from jaxpar.models import Decoder, DecoderConfig, decoder_loss
from jaxpar.options import Fp8
from jaxpar.parallel._fp8 import fp8_dot_general, is_covered

#: Llama-3's shape (grouped-query attention, SwiGLU MLP, untied head) at a small width; every size
#: differs, so a gathered array's dims tell a covered weight from a norm or the embedding.
CFG = DecoderConfig(vocab=1000, embed=256, layers=2, heads=4, kv_heads=2, head_dim=64, mlp=768)
#: The smallest of the covered GEMMs' contracted and output sizes (the K and V projections' output):
#: every covered GEMM qualifies, none by a margin.
MIN_DIM = CFG.kv_heads * CFG.head_dim
_COMPUTATION = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _compile(fp8):
    """The ZeRO-3 train step on ``h100:1x8`` (bf16 compute): ``(compiled text, layout)``."""
    mesh = jaxpar.make_mesh({"data": 8}, devices=target_devices(parse_target("h100:1x8")))
    strategy = jaxpar.Strategy(zero=3, compute_dtype="bfloat16", fp8=fp8)
    tx = optax.adamw(1e-3)
    layout = jaxpar.state_layout(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), tx, mesh, strategy)
    step = jaxpar.make_train_step(decoder_loss, tx, layout, strategy)
    tokens = jax.ShapeDtypeStruct((16, 128), np.int32, sharding=batch_sharding(mesh))
    return step.lower(layout.abstract_state(), {"tokens": tokens, "targets": tokens}).compile().as_text(), layout


@pytest.fixture(scope="module")
def programs():
    (fp8, layout), (bf16, _) = _compile(Fp8(min_dim=MIN_DIM)), _compile(None)
    return fp8, bf16, layout


def _covered(layout) -> dict[str, tuple[int, ...]]:
    """The model's covered weights, by path, with their stacked shapes (from its logical names)."""
    is_spec = lambda s: isinstance(s, PartitionSpec)      # noqa: E731
    logical = jax.tree_util.tree_leaves_with_path(layout.logical, is_leaf=is_spec)
    shapes = jax.tree.leaves(layout.shapes)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): s.shape
            for (path, names), s in zip(logical, shapes) if is_covered(tuple(names))}


def _gemms_per_step(hlo: str) -> Counter:
    """``{(op_name's fp8[...] scope or "", FP8 operands): GEMMs per step}``: each GEMM counted as often
    as its computation runs (the scanned layer's body once per layer)."""
    runs, out = trip_counts(hlo), Counter()
    for block in re.split(r"\n(?=\S)", hlo):
        head = _COMPUTATION.match(block)
        for g in gemms(block) if head else ():
            scope = re.search(r"fp8\[([^\]]+)\]", g.op_name)
            out[scope.group(1) if scope else "", g.fp8] += runs.get(head.group(1), 1)
    return out


def _gathered(hlo: str) -> list[tuple[str, tuple[int, ...], float]]:
    """Every array the all-gathers deliver per step: ``(dtype, sorted dims, bytes per step)``."""
    runs, out = trip_counts(hlo), []
    for ins in parse_instructions(hlo):
        if ins.opcode in ("all-gather", "all-gather-done"):
            for array in array_shapes(ins.shape):
                dtype, dims = _ARRAY.fullmatch(array).groups()
                out.append((dtype, tuple(sorted(int(d) for d in dims.split(",") if d)),
                            shape_bytes(array) * runs.get(ins.computation, 1)))
    return out


@pytest.mark.slow
def test_every_covered_matmul_is_an_fp8_gemm_as_many_as_the_model_has(programs):
    fp8, bf16, layout = programs
    covered = _covered(layout)
    assert sorted(p.rsplit("/", 1)[-1] for p in covered) == ["w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]
    per_step = _gemms_per_step(fp8)
    named = check_fp8_gemms(fp8)                 # no GEMM named after a covered weight has other operands
    assert set(named) == {p.rsplit("/", 1)[-1] for p in covered}
    # forward, input gradient and weight gradient of each covered weight in each layer
    assert sum(n for (scope, f8), n in per_step.items() if scope and f8) == 3 * sum(s[0] for s in covered.values())
    assert not [(k, n) for k, n in per_step.items() if k[1] and not k[0]]      # no FP8 GEMM outside a covered name
    assert all(n == 3 * CFG.layers for (scope, f8), n in per_step.items() if scope)
    assert not [k for k in _gemms_per_step(bf16) if k[0] or k[1]]              # the bf16 program has none


@pytest.mark.slow
def test_zero3_gathers_the_covered_weights_in_fp8_at_half_the_bf16_bytes(programs):
    fp8, bf16, layout = programs
    per_layer = {tuple(sorted(s[1:])) for s in _covered(layout).values()}
    fp8_rows = [r for r in _gathered(fp8) if r[1] in per_layer]
    bf16_rows = [r for r in _gathered(bf16) if r[1] in per_layer]
    assert {r[0] for r in fp8_rows} == {"f8e4m3fn"}
    assert {r[0] for r in bf16_rows} == {"bf16"}
    assert Counter(r[1] for r in fp8_rows) == Counter(r[1] for r in bf16_rows)      # the same weights, as often
    one_copy = sum(int(np.prod(s)) for s in _covered(layout).values())               # FP8: a byte per element
    fp8_bytes, bf16_bytes = sum(r[2] for r in fp8_rows), sum(r[2] for r in bf16_rows)
    assert fp8_bytes >= one_copy
    assert abs(fp8_bytes / bf16_bytes - 0.5) <= 0.005, (fp8_bytes, bf16_bytes)       # half, within 1%


def _flax_qdq_matmul(x, w):
    """A matmul as Flax's quantize-dequantize FP8 op runs it (``flax.linen.fp8_ops.Fp8DotGeneralOp``):
    both operands cast to e4m3 and back to bf16, then a plain ``dot_general``, under a covered
    weight's scope."""
    from flax.linen import fp8_ops

    one, history = jnp.ones((1,), jnp.float32), jnp.zeros((16,), jnp.float32)
    with jax.named_scope("fp8[layers/w_up]"):
        xq = fp8_ops.in_qdq(jnp.bfloat16, jnp.float8_e4m3fn, x, one, history)
        wq = fp8_ops.in_qdq(jnp.bfloat16, jnp.float8_e4m3fn, w, one, history)
        return jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())))


def _scaled_matmul(x, w):
    with jax.named_scope("fp8[layers/w_up]"):
        return fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).astype(jnp.bfloat16)


def _h100_grad(matmul) -> str:
    mesh = Mesh(target_devices(parse_target("h100:1x1")), ("x",))
    spec = NamedSharding(mesh, PartitionSpec())
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=spec) for s in ((256, 512), (512, 1024)))
    loss = lambda a, b: jnp.sum(matmul(a, b).astype(jnp.float32) ** 2)       # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()


@pytest.mark.slow
def test_a_quantize_dequantize_matmul_is_caught_by_name():
    """Flax's op hands the GEMM dequantized bf16 operands, so on H100 its three GEMMs run in bf16: the
    check names the weight. The same matmul through jaxpar's FP8 GEMM passes."""
    with pytest.raises(Fp8Error, match=r"compiled without FP8 operands: \{'layers/w_up': 3\}"):
        check_fp8_gemms(_h100_grad(_flax_qdq_matmul))
    assert check_fp8_gemms(_h100_grad(_scaled_matmul))["layers/w_up"]["fp8"] == 3
