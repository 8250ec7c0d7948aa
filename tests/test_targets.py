"""Compiling for real GPU and TPU targets without the hardware (jaxpar.devices._targets, ``jaxpar inspect --target``).

The real compilers live in their own directory, off ``sys.path`` (``jaxpar.devices.targets_dir``), where
``make test`` and CI install them: a missing compiler fails here, it is not skipped. Each case compiles
jaxpar's real train step with XLA's GPU compiler (a cubin, through ptxas) or libtpu's compiler, for
abstract devices; nothing runs. What is asserted is read from the compiled programs: memory per
device against the device, and the collectives per mesh axis in the scheduled GPU HLO.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from jaxpar.analysis import collectives
from jaxpar.analysis._hlo import parse_instructions
from jaxpar.cli import main
from jaxpar.parallel.moe import send_rows
from jaxpar.config import ConfigError, load_config
from jaxpar.config import build_job
from jaxpar.devices import TargetError, _targets, load_spec, parse_target, presets, target_devices, targets_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def test_the_compilers_are_installed():
    """The target tests need the compilers; CI installs them (a missing one must fail, not skip)."""
    for package in ("jax_plugins/xla_cuda12", "jax_cuda12_plugin", "libtpu", "nvidia/cuda_nvcc/bin"):
        assert (targets_dir() / package).is_dir(), f"{package} missing: make targets"


def test_import_jax_loads_no_compiler():
    """A plain ``import jax`` in this environment prints nothing and loads neither compiler; only a target does."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "XLA_", "TPU_")) and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    code = ("import sys, jax; jax.devices(); from jax._src.lib import xla_client as x; "
            "print(x.pjrt_plugin_loaded('cuda'), x.pjrt_plugin_loaded('tpu'), 'libtpu' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.split() == ["False", "False", "False"], run.stdout


def test_the_no_hardware_notes_are_held_back(capfd):
    """While a compiler loads, its notices that no GPU / TPU is here are dropped; other output is kept."""
    with _targets.without_notes():
        os.write(2, b"I0000 00:00:1.2 1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not "
                    b"be used.\nFailed to find host bounds for accelerator type: WARNING: could not determine\n"
                    b"a real error\n")
    assert capfd.readouterr().err == "a real error\n"


def test_the_gpu_kernels_are_registered():
    """The CUDA plugin's kernels (cuSOLVER's QR here) compile for a GPU target, as on a GPU host."""
    import jax
    import jax.numpy as jnp

    device = target_devices(parse_target("h100:1x1"))[0]
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    assert "cusolver_geqrf_ffi" in jax.jit(jnp.linalg.qr).lower(x).compile().as_text()


# ------------------------------------------------------------------------------- targets as data
@pytest.mark.parametrize("text, devices, hosts, platform", [
    ("h100:2x8", 16, 2, "cuda"), ("h100:8", 8, 1, "cuda"), ("h100", 8, 1, "cuda"), ("a100-80gb:4x8", 32, 4, "cuda"),
    ("tpu-v5e:4x4", 16, 4, "tpu"), ("2xtpu-v5e:2x2", 8, 2, "tpu"), ("tpu-v5p:2x2x2", 8, 2, "tpu"),
])
def test_target_strings(text, devices, hosts, platform):
    t = parse_target(text)
    assert (t.num_devices, t.num_hosts, t.spec.platform) == (devices, hosts, platform)
    assert parse_target(str(t)) == t


@pytest.mark.parametrize("text, says", [
    ("h101:8", "unknown device 'h101'"), ("tpu-v5e", "needs its chip topology"), ("2xh100:8", "HOSTSxGPUS"),
    ("h100:2x2x2", "HOSTSxGPUS"), ("h100:2x", "DEVICE[:TOPOLOGY]"),
])
def test_bad_target_strings_are_named(text, says):
    with pytest.raises(TargetError, match="target") as e:
        parse_target(text)
    assert says in str(e.value) and text.split(":")[0].removeprefix("2x") in str(e.value)


@pytest.mark.parametrize("name", sorted(presets()))
def test_each_preset_gives_its_devices(name):
    spec = load_spec(name)
    assert spec.sources, f"{name}: a preset says where its numbers come from"
    t = parse_target(f"{name}:2x4" if spec.platform == "cuda" else f"{name}:2x2" + ("x2" if name == "tpu-v5p" else ""))
    devices = target_devices(t)
    assert len(devices) == t.num_devices
    assert {d.device_kind for d in devices} == {spec.device}
    assert len({d.process_index for d in devices}) == t.num_hosts


@pytest.mark.parametrize("name", [n for n in sorted(presets()) if load_spec(n).platform == "tpu"])
def test_the_whole_hosts_rule_is_libtpus(name):
    """``topology_problem`` (what ``jaxpar check --target`` refuses without the compiler) refuses exactly the
    chip grids libtpu rejects, over grids of one to three sizes and one or two slices; its fix is taken."""
    import itertools

    from jaxpar.devices._targets import topology_problem

    grids = [g for n in (1, 2, 3) for g in itertools.product((1, 2, 3, 4, 8), repeat=n)]
    for slices, grid in itertools.product(("", "2x"), grids):
        t = parse_target(f"{slices}{name}:{'x'.join(map(str, grid))}")
        why = topology_problem(t)
        try:
            target_devices(t)
            assert why is None, why
        except TargetError as e:
            assert why is not None and "the tpu compiler rejected the topology" in str(e), str(t)
            fix = why.split("choose e.g. ")[1].split(" ")[0]
            assert topology_problem(parse_target(fix)) is None and target_devices(parse_target(fix)), why


def test_a_missing_compiler_is_named_with_its_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(TargetError, match=r"needs libtpu, which is not installed in .+ -m pip install --no-deps "
                                          r"--upgrade --target .+ 'libtpu==.+ \(from a checkout: make targets"):
        target_devices(parse_target("tpu-v5e:3x3"))        # a topology no other test made (they are cached)


def test_a_plugin_of_another_jax_is_named(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.9.0" if name == "jax-cuda12-plugin" else real(name))
    with pytest.raises(TargetError, match=r"jax-cuda12-plugin==0\.9\.0 is installed beside jax==0\.10\.\d+; the plugin "
                                          r"must match jax exactly"):
        target_devices(parse_target("h100:3x8"))            # a topology no other test made


# ------------------------------------------------------------------------------- jaxpar inspect --target
def _inspect(capsys, config, target, *overrides):
    rc = main(["inspect", str(CONFIGS / config), "--target", target, *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_quickstart_compiles_for_h100(capsys):
    rc, out, _ = _inspect(capsys, "quickstart.yaml", "h100:1x8")
    assert rc == 0, out
    assert "compiled ahead of time by the cuda compiler for h100:1x8" in out
    assert "devices  8 x gpu (NVIDIA H100 80GB HBM3)" in out
    table = out.split("collectives of the compiled step")[1]
    assert "all-gather     | fsdp" in table and "| yes   |" in table, table       # async on the GPU
    assert "fits     with" in out and "capacity 59.3 GiB usable" in out


@pytest.mark.slow
def test_the_gradient_all_reduce_is_counted_in_bf16_as_the_gpu_compiler_runs_it(capsys):
    """gpt124m_gpu (bf16 compute, DP8): XLA's GPU program all-reduces the gradients in bf16, before
    they become fp32; the cost model's bytes over ``data`` match it (they were fp32's, 2.000x)."""
    rc, out, _ = _inspect(capsys, "gpt124m_gpu.yaml", "h100:1x8")
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("bytes over data per step"))
    assert abs(float(line.rsplit("|", 1)[1]) - 1) <= 0.05, line


@pytest.mark.slow
def test_tpu_inspect_predicts_the_tiled_arguments_and_one_peak(capsys):
    """quickstart on tpu-v5e:2x4: the arguments in libtpu's tiled layout (they were 0.760 of the compiled in
    the dense one), and the table's predicted peak is the one the memory line quotes."""
    rc, out, _ = _inspect(capsys, "quickstart.yaml", "tpu-v5e:2x4")
    assert rc == 0, out
    args = next(x for x in out.splitlines() if x.startswith("arguments (state + batch)"))
    assert abs(float(args.rsplit("|", 1)[1]) - 1) <= 0.02, args
    peak = next(x for x in out.splitlines() if x.startswith("peak (")).split("|")[1].strip()
    assert f"the cost model predicted {peak}" in out, out


@pytest.mark.exhaustive
@pytest.mark.parametrize("config, target", [("quickstart.yaml", "tpu-v5e:2x4"), ("gpt124m_gpu.yaml", "h100:1x8"),
                                            ("gpt124m_gpu.yaml", "tpu-v5e:2x4")])
def test_configs_compile_for_gpu_and_tpu(capsys, config, target):
    rc, out, _ = _inspect(capsys, config, target)
    assert rc == 0, out
    assert "fits     with" in out and "memory   per device: peak" in out
    assert "collectives of the compiled step" in out and "async" in out


@pytest.mark.exhaustive
def test_a_model_too_big_is_reported_with_the_plan_that_fits(capsys):
    """A 65B GPT with FSDP on 8 H100s: compiled, reported as not fitting (exit status 3), with the
    amount and the cost model's plan that would fit."""
    rc, out, _ = _inspect(capsys, "gpt124m_gpu.yaml", "h100:1x8", "model.layers=80", "model.embed=8192",
                          "model.heads=64", "model.seq_len=4096", "model.vocab=32000", "data.batch_size=8",
                          "mesh.data=1", "mesh.fsdp=8", "parallel.zero=3", "model.remat=full")
    assert rc == 3, out
    assert "DOES NOT FIT by" in out and "the cost model predicted" in out
    assert "the cost model's best plan that fits on" in out and "times the target's devices" in out


@pytest.mark.exhaustive
def test_a_7b_model_on_64_gpus_in_8_processes(capsys):
    rc, out, _ = _inspect(capsys, "gpt124m_gpu.yaml", "h100:8x8", "model.layers=32", "model.embed=4096",
                          "model.heads=32", "model.seq_len=2048", "model.vocab=32000", "data.batch_size=64",
                          "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=8", "parallel.zero=3", "model.remat=full")
    assert rc == 0, out
    assert "devices  64 x gpu (NVIDIA H100 80GB HBM3) in 8 processes" in out
    peak = next(line for line in out.splitlines() if line.startswith("memory   per device"))
    assert "the cost model predicted" in peak


def test_a_mesh_that_does_not_match_the_target_is_named(capsys):
    rc, _, err = _inspect(capsys, "quickstart.yaml", "h100:2x8", "train.devices=0")
    assert rc == 2
    assert "target h100:2x8 has 16 devices, but the config's mesh" in err and "has 8" in err
    assert "mesh.data=4" in err


def test_an_unknown_target_is_named(capsys):
    rc, _, err = _inspect(capsys, "quickstart.yaml", "h101:8")
    assert rc == 2 and "unknown device 'h101'" in err and "h100" in err


def test_a_ptxas_too_old_for_the_device_is_named(capsys, tmp_path):
    """A device whose compute capability the installed ptxas does not know (a made-up sm_13.0)."""
    text = (CONFIGS / "targets" / "h100.yaml").read_text().replace("compute_capability: [9, 0]",
                                                                   "compute_capability: [13, 0]")
    (tmp_path / "sm130.yaml").write_text(text)
    rc, _, err = _inspect(capsys, "quickstart.yaml", f"{tmp_path / 'sm130.yaml'}:1x8", "model.layers=1")
    assert rc == 2
    assert "ptxas (nvidia-cuda-nvcc-cu12" in err and "too old for compute capability 13.0" in err
    assert "pip install -U nvidia-cuda-nvcc-cu12" in err


# ------------------------------------------------------------------------------- every strategy on h100:2x8
def _compiled(config, *overrides, target="h100:2x8"):
    cfg = load_config(CONFIGS / config, ["train.devices=0", *overrides])
    job = build_job(cfg, target_devices(parse_target(target)), data=False)
    return job, job.compile(job.state_layout())


def _over(colls, kind, axes):
    return [c for c in colls if c.kind == kind and c.axes is not None and set(c.axes) == set(axes)]


def test_zero3_gathers_and_scatters_over_data_asynchronously():
    job, compiled = _compiled("quickstart.yaml", "mesh.data=16", "mesh.fsdp=1", "mesh.tensor=1", "parallel.zero=3")
    colls = collectives(compiled["step"], job.mesh)
    gathers, scatters = _over(colls, "all-gather", ["data"]), _over(colls, "reduce-scatter", ["data"])
    assert gathers and scatters, [(c.kind, c.axes) for c in colls]
    assert all(c.asynchronous for c in gathers + scatters)
    assert not _over(colls, "all-reduce", ["data"]) or sum(c.bytes for c in _over(colls, "all-reduce", ["data"])) < \
        sum(c.bytes for c in scatters)        # the gradients are reduce-scattered, not all-reduced


PIPELINES = ["gpipe", "1f1b", "interleaved", "zb-h1", "pipedream-2bw", "pipedream"]


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule", PIPELINES)
def test_pipelines_send_over_pipe(schedule):
    virtual = ["parallel.virtual_stages=2", "model.layers=4"] if schedule == "interleaved" else []
    virtual += ["optimizer.clip_norm=null"] if schedule == "pipedream" else []     # stashing: per-stage updates
    job, compiled = _compiled("quickstart.yaml", "mesh.pipe=2", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1",
                              f"parallel.schedule={schedule}", "parallel.microbatches=4", *virtual)
    colls = collectives(compiled["step"], job.mesh)
    assert _over(colls, "collective-permute", ["pipe"]), [(c.kind, c.axes) for c in colls]


@pytest.mark.exhaustive
@pytest.mark.parametrize("overrides, kinds", [
    (["mesh.data=8", "mesh.tensor=2"], {"all-reduce"}),
    (["mesh.data=8", "mesh.tensor=2", "parallel.sequence_parallel=true"], {"all-gather", "reduce-scatter"}),
])
def test_tensor_parallelism_reduces_over_tensor(overrides, kinds):
    job, compiled = _compiled("quickstart.yaml", "mesh.fsdp=1", *overrides)
    colls = collectives(compiled["step"], job.mesh)
    for kind in kinds:
        assert _over(colls, kind, ["tensor"]), (kind, [(c.kind, c.axes) for c in colls])


def _dtypes(compiled, colls):
    """The element types of each collective's result, read from the GPU HLO."""
    shapes = {i.name: i.shape for i in parse_instructions(compiled.as_text())}
    return {c.name: set(re.findall(r"\b([a-z]+\d*)\[", shapes[c.name])) for c in colls}


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["topk.yaml", "onebit_adam.yaml", "powersgd.yaml"])
def test_compression_sends_the_packed_codes(config):
    """Over the data axis a compressed step moves the codec's codes: packed bytes (u8) for top-k and
    1-bit Adam's signs, low-rank fp32 factors far smaller than the gradient for PowerSGD."""
    dense_job, dense = _compiled("quickstart.yaml", "mesh.data=16", "mesh.fsdp=1", "mesh.tensor=1")
    job, compiled = _compiled(config, "mesh.data=16", "parallel.zero=0")     # ZeRO-2 would gather fp32 weights
    colls = [c for c in collectives(compiled["step"], job.mesh) if c.axes == ("data",) and c.bytes > 64]
    assert colls, config
    if config == "powersgd.yaml":
        full = sum(c.bytes for c in collectives(dense["step"], dense_job.mesh) if c.axes == ("data",))
        assert 0 < sum(c.bytes for c in colls) < full / 4
    else:                          # 1-bit Adam's warm-up steps all-reduce in fp32 (the other branch)
        kinds = _dtypes(compiled["step"], colls)
        codes = [c for c in colls if kinds[c.name] == {"u8"}]
        assert codes and all(kinds[c.name] == {"f32"} for c in colls if c not in codes and c.kind != "all-reduce"), kinds


@pytest.mark.exhaustive
def test_relaxed_sync_syncs_over_the_replica_axis():
    job, compiled = _compiled("diloco.yaml", "mesh.replica=8")
    assert not [c for c in collectives(compiled["step"], job.mesh) if c.axes and "replica" in c.axes]
    assert [c for c in collectives(compiled["outer"], job.mesh) if c.axes and "replica" in c.axes]


@pytest.mark.exhaustive
def test_k_steps_per_call_and_the_noise_scale_compile():
    job, compiled = _compiled("quickstart.yaml", "parallel.steps_per_call=5", "mesh.pipe=2", "mesh.data=4", "mesh.tensor=1",
                              "parallel.schedule=pipedream-2bw", "parallel.microbatches=2")
    assert compiled["step"].in_avals[0][1]["tokens"].shape[0] == 5        # 5 stacked batches per call
    job, compiled = _compiled("quickstart.yaml", "mesh.data=4", "logging.noise_scale.every=2")
    assert set(compiled) == {"step", "measure"}


@pytest.mark.exhaustive
@pytest.mark.parametrize("pipe", [1, 2])
def test_the_ring_hops_by_collective_permute_on_gpus(pipe):
    """On GPUs a collective-permute pairs sends with receives, so the ring keeps its permutes over
    context, inside a pipeline stage too (XLA:CPU hops by all-gather there: test_context_train)."""
    job, compiled = _compiled("long_context.yaml", "model.seq_len=256", f"mesh.pipe={pipe}", f"mesh.data={4 // pipe}",
                              "parallel.microbatches=2", target="h100:2x8")
    colls = collectives(compiled["step"], job.mesh)
    assert _over(colls, "collective-permute", ["context"]), [(c.kind, c.axes) for c in colls]
    # K/V never gathered (that would be 2 per layer): at most one gather, of the position table or of
    # the embedding's cotangent for the token table's scatter-add
    assert len(_over(colls, "all-gather", ["context"])) <= 1, _over(colls, "all-gather", ["context"])


@pytest.mark.exhaustive
def test_expert_parallelism_dispatches_with_asynchronous_all_to_alls_on_gpus():
    """configs/moe.yaml (8 experts over expert=4 x data=2, a router bias) compiles for 8 H100s: per MoE
    layer the sorted dispatch's all-to-alls over expert, asynchronous (tests/test_moe.py::exchange_sizes:
    the counts, the rows [E_p, S, D] out and back and their gradients, the weights and theirs, and the
    further rounds' loops), and no gather of the experts' weights over expert."""
    job, compiled = _compiled("moe.yaml", target="h100:1x8")
    colls = collectives(compiled["step"], job.mesh)
    a2a = _over(colls, "all-to-all", ["expert"])
    peers, experts, embed = 4, 8, 128
    send = send_rows(32 // 8, 64, 2, experts, peers, -(-125 * 64 * 2 // (100 * experts)))   # C = 20: S = 160
    assert all(c.asynchronous and c.in_loop for c in a2a), a2a
    assert Counter(c.bytes for c in a2a) == {experts * 4: 1, peers * send * embed * 4: 4 + 5, peers * send * 4: 4}, a2a
    assert not _over(colls, "all-gather", ["expert"]), [(c.kind, c.axes) for c in colls]
