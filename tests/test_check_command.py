"""``jaxpar check CONFIG`` (:func:`jaxpar.commands.run_check`): what ``jaxpar train`` would refuse (the
config on the devices it would find or a ``--target``'s, the data files, the run directory) and every check of
:func:`jaxpar.commands.check_config`, with no step compiled."""
import re
import tempfile
from pathlib import Path

import jax
import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.errors import Fp8Error, TargetError
from jaxpar.cli import main
from jaxpar.commands import check_config

QUICK = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
#: a run directory of its own, never the repo's runs/quickstart (which `make train` fills)
TINY = ["model.layers=1", "model.embed=32", "model.seq_len=16", "train.devices=8",
        f"train.out_dir={tempfile.mkdtemp(prefix='jaxpar-check-')}/run"]


def test_a_good_config_passes_without_compiling_its_programs(capsys):
    compiled = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert main(["check", str(QUICK), *TINY]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    out = capsys.readouterr().out
    assert "quickstart: ok" in out and "strategy dp2-fsdp2-tp2" in out and "programs step" in out
    assert not [name for name in compiled if "traced" in name or "init" in name], compiled   # no step, no init


def test_the_mesh_is_checked_on_the_devices():
    cfg = load_config(QUICK, [*TINY, "mesh.data=4"])        # 4 x 2 x 2 = 16 devices, train.devices=8
    with pytest.raises(ConfigError, match=re.escape("train.devices=8")):
        check_config(cfg)


def test_a_bad_option_is_one_line_naming_its_key(capsys):
    assert main(["check", str(QUICK), *TINY, "optimizer.clip_norm=-1"]) == 2
    assert "optimizer.clip_norm=-1.0: must be a finite number > 0" in capsys.readouterr().err
    assert main(["check", str(QUICK), *TINY, "train.step_timeout=5y"]) == 2
    assert "train.step_timeout '5y': give seconds (600)" in capsys.readouterr().err


def test_muon_options_without_muon_are_named(capsys):
    with pytest.raises(ConfigError, match=r"optimizer.muon.placement='owner': optimizer.muon is only used by "
                                          r"optimizer.name=muon \(here 'adamw'\)"):
        load_config(QUICK, ["optimizer.muon.placement=owner"])
    assert main(["check", str(QUICK), "optimizer.muon.routing={b1: adam}"]) == 2
    assert "optimizer.muon.routing={'b1': 'adam'}: optimizer.muon is only used by" in capsys.readouterr().err
    load_config(QUICK, ["optimizer.name=muon", "optimizer.muon.placement=owner"])      # with Muon: taken


def test_what_train_would_refuse_is_named(tmp_path, capsys):
    """A missing data file, an earlier run in train.out_dir, --resume without a checkpoint: each named as train
    names it; --overwrite, a fresh directory and the files found pass."""
    out = tmp_path / "run"
    run = [*TINY, f"train.out_dir={out}"]
    assert main(["check", str(QUICK), *run, f"data.paths=[{tmp_path}/missing.txt]"]) == 2
    assert f"data path '{tmp_path}/missing.txt' matches no file" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("some text " * 400)
    assert main(["check", str(QUICK), *run, f"data.paths=[{tmp_path}/a.txt]"]) == 0
    text = capsys.readouterr().out
    assert "data     1 file(s) of data.paths found" in text and f"run      a new run in {out}" in text
    assert main(["check", str(QUICK), *run, "--resume"]) == 2
    assert f"no checkpoint to resume from in {out / 'checkpoints'}" in capsys.readouterr().err
    out.mkdir()
    (out / "summary.json").write_text('{"end_step": 300}')        # a run that finished
    assert main(["check", str(QUICK), *run]) == 2
    err = capsys.readouterr().err
    assert f"train.out_dir='{out}' holds an earlier run (summary.json): jaxpar train refuses a new run" in err
    assert main(["check", str(QUICK), *run, "--overwrite"]) == 0
    assert f"run      --overwrite moves the earlier run in {out} aside" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]      # check moves nothing


def test_a_gpu_config_is_checked_on_the_device_count_it_would_find(tmp_path, capsys):
    gpu = str(QUICK.parent / "gpt124m_gpu.yaml")
    small = ["model.layers=1", "model.embed=64", "model.heads=2", "model.vocab=512", f"train.out_dir={tmp_path}"]
    assert main(["check", gpu, *small, "--target", "h100:1x8"]) == 0
    text = capsys.readouterr().out
    assert "mesh     pipe=1 x data=8 x fsdp=1 x tensor=1" in text and "found    8 devices of h100:1x8" in text
    assert main(["check", gpu, *small, "--target", "h100:1x8", "mesh.fsdp=3"]) == 2
    assert "target h100:1x8 has 8 devices" in capsys.readouterr().err
    assert main(["check", gpu, *small]) == 2          # train.devices=0 on this CPU-only JAX: what train says
    assert "train.devices=0 trains on the GPUs or TPUs JAX finds, and this JAX found none" in capsys.readouterr().err
    assert main(["check", gpu, *small, "--target", "h100:1x7"]) == 2      # data=-1 is what the target gives it
    assert ("data.batch_size=16 is not divisible by mesh.data x mesh.fsdp x parallel.microbatches = 7 (mesh.data=-1 "
            "is 7: what the other axes leave of 7 devices)") in capsys.readouterr().err


def test_experts_that_the_expert_axis_does_not_divide_are_named_by_their_keys(capsys):
    assert main(["check", str(QUICK.parent / "moe.yaml"), "model.moe.experts=6"]) == 2
    assert "model.moe.experts=6 is not divisible by mesh.expert=4" in capsys.readouterr().err


# ------------------------------------------------------------------------------- check --target = inspect --target
#: Every refusal ``jaxpar inspect --target`` makes before it compiles (``target_refusals``), as a case:
#: config, overrides, target, the error's class and the start of its message. None compiles anything.
TARGET_REFUSALS = {
    "fp8-without-fp8-gemms": ("gpt124m_gpu.yaml", ["parallel.fp8.recipe=tensorwise"], "a100-80gb:1x8", Fp8Error,
                              "target a100-80gb has no FP8 GEMMs: parallel.fp8"),
    "fp8-on-a-tpu": ("gpt124m_gpu.yaml", ["parallel.fp8.recipe=tensorwise"], "tpu-v5e:2x4", Fp8Error,
                     "target tpu-v5e has no FP8 GEMMs"),
    "mesh-of-another-count": ("quickstart.yaml", ["train.devices=0"], "h100:2x8", ConfigError,
                              "target h100:2x8 has 16 devices, but the config's mesh"),
    "train-devices-of-another-count": ("quickstart.yaml", ["train.devices=8"], "h100:2x8", ConfigError,
                                       "target h100:2x8 has 16 devices, but train.devices=8"),
    "tpu-grid-of-no-whole-hosts": ("gpt124m_gpu.yaml", [], "tpu-v5e:3x3", TargetError,
                                   "target tpu-v5e:3x3: a TPU slice is whole hosts of 2x2x1 chips"),
    "gpu-memory-fraction-no-number": ("gpt124m_gpu.yaml", [], "h100:1x8", TargetError,
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION='most' is not a fraction in (0, 1]"),
    "fp8-and-the-mesh": ("quickstart.yaml", ["train.devices=0", "parallel.fp8.recipe=tensorwise"], "a100-80gb:1x16",
                         Fp8Error, "target a100-80gb has no FP8 GEMMs"),
}


@pytest.mark.parametrize("case", sorted(TARGET_REFUSALS))
def test_check_target_refuses_every_refusal_of_inspect_target(case, monkeypatch, tmp_path):
    """``jaxpar check --target`` and ``jaxpar inspect --target`` refuse the same configs with the same error
    (class and message): one list of refusals (``target_refusals``), decided before anything compiles."""
    from jaxpar.commands import inspect_config, run_check
    from jaxpar.commands._job_devices import target_refusals
    from jaxpar.devices import parse_target

    config, overrides, target, error, says = TARGET_REFUSALS[case]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    if "memory" in case:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "most")
    path, overrides = str(QUICK.parent / config), [*overrides, f"train.out_dir={tmp_path}/run"]
    with pytest.raises(error) as inspected:
        inspect_config(load_config(path, overrides), target=target)
    with pytest.raises(error) as checked:
        run_check(path, overrides, target=target)
    assert str(inspected.value).startswith(says) and str(checked.value) == str(inspected.value)
    found = target_refusals(load_config(path, overrides), parse_target(target))
    assert "\n  ".join(map(str, found)) == str(checked.value) and type(found[0]) is error
    if case == "fp8-and-the-mesh":                  # every refusal, the first's class
        assert [type(e) for e in found] == [Fp8Error, ConfigError] and "has 8" in str(checked.value)


def test_the_refusal_cases_walk_every_refusal_of_the_target():
    """Each kind of refusal ``target_refusals`` makes has a case above (a new one needs its case)."""
    import inspect as source

    from jaxpar.commands._job_devices import target_refusals

    kinds = source.getsource(target_refusals).count("found.append(")
    covered = {"fp8", "mesh", "grid", "memory"}
    assert kinds == len(covered) and all(any(k in case for case in TARGET_REFUSALS) for k in covered)


# ------------------------------------------------------------------------------- context parallelism's rules
LONG = QUICK.parent / "long_context.yaml"


@pytest.mark.parametrize("overrides, fixed, says", [
    (["model.seq_len=1004"], ["model.seq_len=1008"],
     "model.seq_len=1004 is not divisible by 8 (balanced layout (parallel.context.balance=true), 2*C = 8 chunks over "
     "mesh.context=4). Fix: pad or cut the sequence to a multiple of 8 (e.g. model.seq_len=1008), or change "
     "mesh.context or set parallel.context.balance=false."),
    (["parallel.context.balance=false", "model.seq_len=1002"], ["parallel.context.balance=false", "model.seq_len=1004"],
     "model.seq_len=1002 is not divisible by 4 (natural order (parallel.context.balance=false), C = 4 shards over "
     "mesh.context=4). Fix: pad or cut the sequence to a multiple of 4 (e.g. model.seq_len=1004), or change "
     "mesh.context."),
    (["parallel.context.method=ulysses", "model.heads=2"], ["parallel.context.method=ulysses", "model.heads=8"],
     "model.heads=2 with mesh.tensor=1 and parallel.context.method=ulysses: the 2 query heads on each device are not "
     "divisible by mesh.context=4 (Ulysses gives each device heads / 4 heads). Fix: parallel.context.method=ring or "
     "all_gather, a mesh.context that divides 2, or a smaller mesh.tensor."),
    (["parallel.context.method=ulysses", "mesh.data=1", "mesh.tensor=2"],       # 4 heads: 2 a device
     ["parallel.context.method=ulysses", "mesh.data=1", "mesh.tensor=2", "model.heads=8", "model.embed=64"],
     "model.heads=4 with mesh.tensor=2 and parallel.context.method=ulysses: the 2 query heads on each device"),
], ids=["balanced-seq", "natural-seq", "ulysses-heads", "ulysses-heads-after-tensor"])
def test_what_the_context_axis_cannot_split_is_refused_by_check_in_yaml_keys(overrides, fixed, says):
    """The library's rules (check_length, ulysses_kv_repeat), which train met after building the job; the fix
    passes."""
    with pytest.raises(ConfigError) as refused:
        load_config(LONG, [*overrides, *TINY[-1:]])
    assert says in str(refused.value), str(refused.value)
    load_config(LONG, [*fixed, *TINY[-1:]])


def test_a_context_method_without_a_context_axis_is_refused_and_removable(capsys):
    assert main(["check", str(QUICK), *TINY, "parallel.context={method: ring}"]) == 2
    err = capsys.readouterr().err
    assert ("parallel.context={method: ring} on a mesh with no context axis of size > 1 (mesh.context=1): there is no "
            "split sequence for a context-parallel method to run over") in err
    assert "Remove parallel.context (~parallel.context, or parallel.context={})" in err
    no_axis = ["mesh.context=1", "mesh.data=8", *TINY[-1:]]
    with pytest.raises(ConfigError, match=r"parallel.context=\{method: ring, balance: true\} on a mesh with no"):
        load_config(LONG, no_axis)
    for removed in ("~parallel.context", "parallel.context={}"):        # {} empties the file's mapping
        assert load_config(LONG, [*no_axis, removed]).parallel.context == {}


def _tiny_hf(folder: Path, heads: int, kv_heads: int) -> Path:
    import json

    shape = json.loads((QUICK.parent / "hf" / "llama3-8b" / "config.json").read_text())
    shape.update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads, head_dim=16,
                 num_hidden_layers=1, intermediate_size=64, vocab_size=256)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    return folder


def test_ulysses_heads_of_a_hugging_face_model_are_checked_from_its_config_json(tmp_path, capsys):
    hf = _tiny_hf(tmp_path / "hf6", heads=6, kv_heads=2)
    args = ["check", str(QUICK.parent / "llama3_8b_gpu.yaml"), "--target", "h100:1x8", f"model.hf={hf}",
            "mesh.fsdp=2", "mesh.context=4", "data.batch_size=2", "model.seq_len=64", f"train.out_dir={tmp_path}/run"]
    assert main([*args, "parallel.context={method: ulysses}"]) == 2
    assert (f"model.hf='{hf}': its num_attention_heads=6 with mesh.tensor=1 and parallel.context.method=ulysses: the 6 "
            "query heads on each device are not divisible by mesh.context=4") in capsys.readouterr().err
    assert main([*args, "parallel.context={method: ring}"]) == 0


DECODER = '''
import numpy as np
from jaxpar.models import Decoder, DecoderConfig, decoder_loss as loss


def model(*, rngs):
    return Decoder(DecoderConfig(vocab=64, embed=48, layers=1, heads=6, kv_heads=2, head_dim=8, mlp=64), rngs=rngs)


def batches(step, *, batch_size, seed, eval=False):
    t = np.random.default_rng(step).integers(0, 64, (batch_size, 17))
    return {"tokens": t[:, :-1].astype(np.int32), "targets": t[:, 1:].astype(np.int32)}
'''


def test_ulysses_heads_of_a_model_target_decoder_are_checked_from_its_config(tmp_path):
    (tmp_path / "dec.py").write_text(DECODER)
    cfg = load_config(QUICK, ["~model", f"model.target={tmp_path}/dec.py:model", f"model.loss={tmp_path}/dec.py:loss",
                              "data.kind=import", f"data.target={tmp_path}/dec.py:batches", "mesh.fsdp=1",
                              "mesh.tensor=1", "mesh.data=2", "mesh.context=4", "data.batch_size=4",
                              "parallel.context={method: ulysses}", "train.devices=8", "train.eval_batches=0",
                              "logging.samples=0", f"train.out_dir={tmp_path}/run"])
    with pytest.raises(ConfigError, match=re.escape(
            f"model.target='{tmp_path}/dec.py:model': its DecoderConfig.heads=6 with mesh.tensor=1 and "
            "parallel.context.method=ulysses: the 6 query heads on each device are not divisible by mesh.context=4")):
        check_config(cfg)
