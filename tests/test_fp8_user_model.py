"""FP8 on a user's own Flax NNX model: unstacked ``nnx.Linear`` and ``nnx.MultiHeadAttention`` layers (no
``scan_blocks``), kernels annotated with ``nnx.with_partitioning``, an unannotated bias. Its covered matmuls
(q, k, v, out, up, down) compile to FP8 GEMMs for an H100; under DP8, FSDP8, DP4 x TP2, DP2 x FSDP2 x TP2,
FSDP4 x TP2 and ZeRO-3 DP4 x TP2 its first gradient equals the one-device FP8 run's (the last two also for
examples/patch_attention.py's stacked layers); FP8 options that cover nothing, or devices without FP8 GEMMs,
are refused by name."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from conftest import need_devices
import jaxpar
from jaxpar.analysis._gemms import check_fp8_gemms
from jaxpar.devices import parse_target, target_devices
from jaxpar.errors import Fp8Error
from jaxpar.options import Fp8

VOCAB, EMBED, HEADS, MLP, SEQ = 64, 32, 4, 64, 16
COVERED = ("attn/query/kernel", "attn/key/kernel", "attn/value/kernel", "attn/out/kernel", "up/kernel", "down/kernel")


class Net(nnx.Module):
    """Embedding, one attention and one MLP as plain NNX layers, and an untied head."""

    def __init__(self, rngs: nnx.Rngs):
        wp, init = nnx.with_partitioning, nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs, embedding_init=wp(nnx.initializers.normal(0.5), ("vocab", "embed")))
        self.attn = nnx.MultiHeadAttention(HEADS, EMBED, decode=False, use_bias=False, rngs=rngs,   # a key bias: no gradient
                                           kernel_init=wp(init, ("embed", "heads", "kv")),
                                           out_kernel_init=wp(init, ("heads", "kv", "embed")))
        self.up = nnx.Linear(EMBED, MLP, rngs=rngs, kernel_init=wp(init, ("embed", "mlp")))     # bias: no names
        self.down = nnx.Linear(MLP, EMBED, rngs=rngs, kernel_init=wp(init, ("mlp", "embed")))
        self.head = nnx.Linear(EMBED, VOCAB, rngs=rngs, kernel_init=wp(init, ("embed", "vocab")))

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return self.head(x)


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["targets"]).mean()


def _batch():
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, SEQ + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def first_grads(sizes, fp8, model_fn=lambda: Net(nnx.Rngs(0)), loss_fn=loss, explicit_dp=None, zero=0, batch=None):
    """The first gradient of a train step (SGD with lr 1: the parameters' change), fp32 compute; ``batch``
    defaults to :func:`_batch`."""
    mesh = jaxpar.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    strategy = jaxpar.Strategy(fp8=fp8, zero=zero)
    state, layout = jaxpar.init_train_state(model_fn, optax.sgd(1.0), mesh, strategy)
    before = jax.tree.map(np.asarray, state.params)
    step = jaxpar.make_train_step(loss_fn, optax.sgd(1.0), layout, strategy, explicit_dp=explicit_dp)
    state, _ = step(state, jaxpar.shard_batch(_batch() if batch is None else batch, mesh))
    return jax.tree.map(lambda a, b: a - np.asarray(b, np.float64), before, state.params)


def assert_like_one_device_fp8(got, want, fp32):
    """Both runs quantize the same tensors with the same scales; a sum in another order can put one operand
    element across an FP8 rounding midpoint (one e4m3 ulp, 2^-3 of it), so each leaf is allowed the fp32
    tolerance plus 1e-2 of its largest FP8 effect |g_F8 - g_fp32| (tests/test_pairs.py's FP8_FLIP). Such an
    element that reaches a tensor's maximum moves its scale and draws all its roundings again (docs/strategies.md,
    FP8, "Against one device"); these inputs hold none."""
    for k, w in want.items():
        effect = np.abs(w - fp32[k]).max()
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=1e-5 * np.abs(w).max() + 1e-2 * effect, err_msg=k)


def fp8_ratios(got, want, fp32) -> dict:
    """Per leaf, max |got - want| over FP8's own effect max |want - fp32|: how far a run is from the one-device
    FP8 run, in units of what FP8 moves. Leaves whose gradient is zero up to fp32 round-off (an attention's
    key bias: softmax ignores a shift) are left out."""
    top = max(np.abs(v).max() for v in fp32.values())
    return {k: np.abs(got[k] - w).max() / np.abs(w - fp32[k]).max()
            for k, w in want.items() if np.abs(fp32[k]).max() > 1e-6 * top}


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def one_device():
    return {recipe: _leaves(first_grads({"data": 1}, Fp8(recipe, min_dim=0))) for recipe in ("tensorwise", "rowwise")} | {
        "fp32": _leaves(first_grads({"data": 1}, None))}


@need_devices(8)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sizes", [{"data": 8}, {"fsdp": 8}, {"data": 4, "tensor": 2},
                                   pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, marks=pytest.mark.exhaustive)],
                         ids=["dp8", "fsdp8", "dp4-tp2", "dp2-fsdp2-tp2"])
def test_an_unstacked_model_under_a_layout_equals_one_device_in_fp8(one_device, recipe, sizes):
    want, fp32 = one_device[recipe], one_device["fp32"]
    assert_like_one_device_fp8(_leaves(first_grads(sizes, Fp8(recipe, min_dim=0))), want, fp32)
    for path in ("['attn']['query']['kernel']", "['up']['kernel']", "['down']['kernel']"):
        effect = np.abs(want[path] - fp32[path]).max()
        assert effect > 1e-3 * np.abs(fp32[path]).max(), path                   # FP8 ran on that weight


#: FSDP x TP and ZeRO-3 x TP: each covered weight split over two mesh axes (``embed`` over fsdp / data, its
#: feature axis over tensor)
TWO_AXES = [pytest.param({"fsdp": 4, "tensor": 2}, 0, id="fsdp4-tp2"),
            pytest.param({"data": 4, "tensor": 2}, 3, id="dp4-tp2-zero3", marks=pytest.mark.slow)]


def _patch_attention():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("patch_attention", Path(__file__).resolve().parents[1] / "examples"
                                                  / "patch_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def patch_one_device():
    """examples/patch_attention.py (a conv stem, two stacked attention + MLP blocks): its model, loss, batch
    and one-device first gradients, tensorwise FP8 and fp32."""
    pa = _patch_attention()
    run = dict(model_fn=lambda: pa.PatchAttentionNet(layers=2, rngs=nnx.Rngs(0)), loss_fn=pa.loss,
               batch=pa.batches(0, batch_size=16))
    return run, {name: _leaves(first_grads({"data": 1}, fp8, **run)) for name, fp8 in (
        ("tensorwise", Fp8(min_dim=0)), ("fp32", None))}


@need_devices(8)
@pytest.mark.parametrize("sizes,zero", TWO_AXES)
def test_fp8_with_weights_split_over_two_axes_equals_one_device(one_device, sizes, zero):
    """A covered weight split over two axes has one tensorwise scale, its whole tensor's (XLA's maximum over
    the global array; a scale from half of each weight draws every rounding again: 1.6 x FP8's effect): the
    first gradient is the one-device FP8 run's, per leaf within 0.05 x FP8's own effect (measured 5e-5; these
    inputs put no element that reaches a tensor's maximum across an FP8 rounding midpoint)."""
    want, fp32 = one_device["tensorwise"], one_device["fp32"]
    ratios = fp8_ratios(_leaves(first_grads(sizes, Fp8(min_dim=0), zero=zero)), want, fp32)
    assert len(ratios) == len(want) and max(ratios.values()) <= 0.05, ratios


@need_devices(8)
@pytest.mark.slow
@pytest.mark.parametrize("sizes,zero", TWO_AXES)
def test_fp8_in_stacked_layers_with_weights_split_over_two_axes_equals_one_device(patch_one_device, sizes, zero):
    """The same in a user's stacked layers (scan_blocks) behind a conv stem: per leaf within 0.05 x FP8's effect
    (measured 5e-5), the key bias (no gradient) left out."""
    run, ref = patch_one_device
    ratios = fp8_ratios(_leaves(first_grads(sizes, Fp8(min_dim=0), zero=zero, **run)), ref["tensorwise"], ref["fp32"])
    assert len(ratios) == len(ref["fp32"]) - 1 and max(ratios.values()) <= 0.05, ratios


def test_the_h100_compiler_runs_the_unstacked_covered_matmuls_as_fp8_gemms():
    mesh = jaxpar.make_mesh({"data": 8}, devices=target_devices(parse_target("h100:1x8")))
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", fp8=Fp8(min_dim=0))
    layout = jaxpar.state_layout(lambda: Net(nnx.Rngs(0)), optax.adamw(1e-3), mesh, strategy)
    step = jaxpar.make_train_step(loss, optax.adamw(1e-3), layout, strategy)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batch().items()}
    counts = check_fp8_gemms(step.lower(layout.abstract_state(), batch).compile().as_text())   # none in bf16
    assert set(counts) == set(COVERED)
    flops = {k: c["fp8_flops"] for k, c in counts.items()}
    tokens = 16 * SEQ / 8
    per = {"attn/query/kernel": EMBED * EMBED, "up/kernel": EMBED * MLP, "down/kernel": MLP * EMBED}
    for path, weights in per.items():          # forward, input gradient, weight gradient: 3 GEMMs of 2 t w FLOPs
        assert flops[path] >= 3 * 2 * tokens * weights or path == "attn/query/kernel", (path, flops)
    assert sum(flops.values()) == pytest.approx(3 * 2 * tokens * (4 * EMBED * EMBED + 2 * EMBED * MLP))


def test_fp8_that_covers_nothing_is_refused_by_name():
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    with pytest.raises(Fp8Error, match=r"every covered weight's GEMM is below min_dim=1024 \(the largest, "
                                       r"'[a-z/]+', has 32\).*Fix: Strategy.fp8.min_dim=32 or less"):
        strategy = jaxpar.Strategy(fp8=Fp8())
        _, layout = jaxpar.init_train_state(lambda: Net(nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)
        jaxpar.make_train_step(loss, optax.sgd(0.1), layout, strategy)

    class Plain(nnx.Module):                    # no logical names at all
        def __init__(self, rngs):
            self.w = nnx.Linear(EMBED, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            return self.w(jax.nn.one_hot(tokens, EMBED))
    strategy = jaxpar.Strategy(fp8=Fp8(min_dim=0))
    _, layout = jaxpar.init_train_state(lambda: Plain(nnx.Rngs(0)), optax.sgd(0.1), mesh, strategy)
    with pytest.raises(Fp8Error, match="no weight of the model is covered"):
        jaxpar.make_train_step(loss, optax.sgd(0.1), layout, strategy)


@pytest.mark.parametrize("target,kind", [("a100-80gb:1x8", "A100"), ("tpu-v5e:2x4", "TPU v5 lite")])
def test_fp8_on_devices_without_fp8_gemms_is_refused_by_name(target, kind):
    mesh = jaxpar.make_mesh({"data": 8}, devices=target_devices(parse_target(target)))
    strategy = jaxpar.Strategy(compute_dtype="bfloat16", fp8=Fp8(min_dim=0))
    layout = jaxpar.state_layout(lambda: Net(nnx.Rngs(0)), optax.adamw(1e-3), mesh, strategy)
    with pytest.raises(Fp8Error, match=f"the mesh's devices \\(.*{kind}.*\\) have no FP8 GEMMs"):
        jaxpar.make_train_step(loss, optax.adamw(1e-3), layout, strategy)


@need_devices(8)
def test_rowwise_fp8_under_fsdp8_runs_xlas_collectives_and_equals_one_device():
    """The GPT's stacked layers under FSDP8: rowwise takes XLA's collectives (explicit_dp=None), whose row scales
    are the batch's; the explicit per-layer collectives, where each device's tokens would scale its rows, are
    refused by name (the EX x F8 pair)."""
    from jaxpar.models import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=VOCAB, seq_len=SEQ, embed=32, heads=4, layers=2)
    model_fn = lambda: GPT(cfg, rngs=nnx.Rngs(0))       # noqa: E731
    runs = {name: _leaves(first_grads(sizes, fp8, model_fn, lm_loss)) for name, sizes, fp8 in (
        ("one", {"data": 1}, Fp8("rowwise", min_dim=0)), ("fp32", {"data": 1}, None),
        ("fsdp8", {"fsdp": 8}, Fp8("rowwise", min_dim=0)))}
    assert_like_one_device_fp8(runs["fsdp8"], runs["one"], runs["fp32"])
    with pytest.raises(Fp8Error, match=r"explicit_dp=True with Strategy.fp8=Fp8\(recipe='rowwise'\)"):
        first_grads({"fsdp": 8}, Fp8("rowwise", min_dim=0), model_fn, lm_loss, explicit_dp=True)


def test_fp8_that_covers_nothing_is_named_by_train_inspect_and_plan(tmp_path, capsys):
    """The quickstart GPT (embed 128) under parallel.fp8's default min_dim 1024: train and inspect stop with the
    library's Fp8Error (nothing written), plan says FP8 is not chosen and why."""
    from pathlib import Path

    from jaxpar.cli import main
    quick = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    says = "every covered weight's GEMM is below min_dim=1024 (the largest, 'blocks/w1', has 128)"
    assert main(["train", quick, "parallel.fp8.recipe=tensorwise", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert main(["inspect", quick, "parallel.fp8.recipe=tensorwise"]) == 2
    assert says in capsys.readouterr().err
    config = tmp_path / "fp8.yaml"
    config.write_text(f"base: {quick}\nparallel: {{fp8: {{recipe: tensorwise}}}}\n")
    assert main(["plan", "--config", str(config), "--cluster", "h100", "--devices", "8", "--top", "1"]) == 0
    assert "fp8      considered, not chosen: no GEMM of the model reaches min_dim 1024" in capsys.readouterr().out


@need_devices(2)
def test_eval_runs_as_trained_with_fp8():
    """``make_eval_fn`` runs under the step's ``strategy_context``, FP8 included: its loss is the FP8 loss on its
    own (``fp8_loss``), not the fp32 one."""
    from jaxpar.parallel import fp8_loss
    from jaxpar.run._loop import make_eval_fn

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    batch = _batch()
    state, layout = jaxpar.init_train_state(lambda: Net(nnx.Rngs(0)), optax.sgd(1.0), mesh,
                                            jaxpar.Strategy(fp8=Fp8(min_dim=0)))
    model = nnx.merge(layout.graphdef, state.params)
    want, plain = float(jax.jit(fp8_loss(loss, Fp8(min_dim=0)))(model, batch)), float(loss(model, batch))
    got = make_eval_fn(loss, layout, batches=[batch])(state)
    assert got == pytest.approx(want, rel=1e-5) and abs(want - plain) > 1e-4 * abs(plain)
