"""Many processes on localhost (gloo CPU collectives): same losses as one process, own rows per process,
a SIGTERM to one process stops all of them at the same step, text samples, a dead process ends the job
in bounded time, and clear errors for inconsistent flags / environments."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxpar.devices import _distributed as dist
from jaxpar.cli import main
from jaxpar.devices import DistributedError, resolve

from conftest import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: A tiny GPT on synthetic tokens, every step logged; metrics and (at the end) text samples written.
TINY = ["model.embed=32", "model.heads=2", "model.layers=2", "model.seq_len=16", "data.kind=synthetic",
        "data.batch_size=16", "train.log_every=1", "train.eval_batches=0", "train.progress=lines",
        "optimizer.warmup_steps=1", "checkpoint.enabled=false", "logging.tensorboard=false",
        "logging.samples=2", "logging.sample_tokens=8"]
_LAUNCHER_VARS = ("SLURM_", "OMPI_", "PMIX_", "KUBERNETES_", "JOB_COMPLETION_INDEX", "JAX_COORDINATOR",
                  "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict:
    """The environment without launcher variables, and without the test session's compilation cache
    (tests/conftest.py): these jobs compile as a real multi-process start does, which the SIGTERM
    during start-up relies on, and single- and multi-process programs never share cache entries."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_VARS) and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    if TEST_XLA_FLAGS:            # compile like the in-process reference runs (tests/conftest.py)
        env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return env


def launch(args_of, n: int, logs: Path, extra_env=None) -> list[subprocess.Popen]:
    """Start ``n`` processes; process i runs ``args_of(i)`` (environment + ``extra_env(i)``), output in
    ``logs/p{i}.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(args_of(i), cwd=ROOT, env={**clean_env(), **(extra_env(i) if extra_env else {})},
                             stdout=open(logs / f"p{i}.log", "w"), stderr=subprocess.STDOUT) for i in range(n)]


def kill_rest(procs) -> None:
    """Kill (and reap) every process still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def assert_exited_zero(procs, logs: Path) -> None:
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{(logs / f'p{i}.log').read_text()[-3000:]}"


def wait_all(procs, logs: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_rest(procs)
    assert_exited_zero(procs, logs)


def train_losses(out_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


# ----------------------------------------------------------------------------- equivalence
CASES = {  # config, overrides: DP over 8 devices; ZeRO-3 (fsdp2 x data2) x TP2
    "dp": ("configs/dp.yaml", []),
    "zero3_tp": ("configs/zero3.yaml", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
}


# ZeRO-3 x TP (cross-process all-gathers and reduce-scatters) in the default run, plain DP in the exhaustive tier
@pytest.mark.parametrize("case", [pytest.param("dp", marks=pytest.mark.exhaustive), "zero3_tp"])
def test_two_processes_match_one_process(case, tmp_path):
    config, extra = CASES[case]
    steps = ["train.steps=5"]
    port = free_port()

    def args_of(i):
        return [PY, "-m", "jaxpar.cli", "train", config, *TINY, *extra, *steps, f"train.out_dir={tmp_path}/p{i}",
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                "--local-devices", "4", "--heartbeat-timeout", "30"]

    procs = launch(args_of, 2, tmp_path)
    # the 1 x 8 reference runs here, in this process (8 simulated devices), while the two processes run
    assert main(["train", config, *TINY, *extra, *steps, f"train.out_dir={tmp_path}/single",
                 "train.devices=8"]) == 0
    wait_all(procs, tmp_path)
    log = (tmp_path / "p1.log").read_text()
    assert "process  process 1 of 2 (explicit flags)" in log
    assert "program  the same on 2 processes (lowered step sha256 " in (tmp_path / "p0.log").read_text()
    one, two = train_losses(tmp_path / "single"), train_losses(tmp_path / "p0")
    assert len(one) == len(two) == 5
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert not (tmp_path / "p1" / "metrics.jsonl").exists()     # only process 0 logs
    # text samples: the parameters spread over both processes are gathered; only process 0 writes
    samples = (tmp_path / "p0" / "samples.txt").read_text()
    assert samples.count("--- sample ") == 2 and not (tmp_path / "p1" / "samples.txt").exists()
    assert "samples  " in (tmp_path / "p0.log").read_text()
    if case == "zero3_tp":          # bit-identical losses here: the greedy tokens are the same too
        assert samples == (tmp_path / "single" / "samples.txt").read_text()


# ----------------------------------------------------------------------------- the same program on every process
@pytest.mark.slow          # 8-20 s: two processes start and build the job (the exchange: tests/test_program_fingerprint.py)
@pytest.mark.parametrize("override,differs", [("optimizer.clip_norm=0.5", "optimizer.clip_norm: 1.0 vs 0.5"),
                                              pytest.param("parallel.microbatches=2", "parallel.microbatches: 1 vs 2",
                                                           marks=pytest.mark.exhaustive)])
def test_processes_with_different_programs_stop_with_the_named_error(override, differs, tmp_path):
    """Process 1 gets an override that changes the step: both stop before the first step with
    ProgramMismatchError (exit 2) naming process 1 and the first differing instruction, within 60 s of
    reaching the check, never a hang (a mismatched collective would wait 300 s, then abort)."""
    port = free_port()

    def args_of(i):
        return [PY, "-m", "jaxpar.cli", "train", "configs/zero3.yaml", *TINY, "mesh.data=2", "mesh.fsdp=2",
                "mesh.tensor=2", "logging.samples=0", "train.steps=3", f"train.out_dir={tmp_path}/p{i}",
                *([override] if i == 1 else []), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                "--process-id", str(i), "--local-devices", "4", "--heartbeat-timeout", "30"]

    procs = launch(args_of, 2, tmp_path)
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    deadline, reached = time.monotonic() + 180, None
    try:
        while any(p.poll() is None for p in procs):
            if reached is None and all("\ndata     " in f.read_text() for f in logs):
                reached = time.monotonic()           # both printed their last line before the loop
            assert time.monotonic() < deadline, "no exit within 180 s (a hang?):\n" + logs[0].read_text()[-3000:]
            time.sleep(0.1)
        ended = time.monotonic()
    finally:
        kill_rest(procs)
    for i, p in enumerate(procs):
        text = logs[i].read_text()
        assert p.returncode == 2, f"process {i} exited {p.returncode}:\n{text[-3000:]}"
        assert ("jaxpar train: error: the processes would run different step programs: process 1 of 2 differs "
                "from process 0") in text, text[-3000:]
        assert "process 0:  " in text and "process 1:  " in text and "step      1/" not in text
        assert "config (process 0 vs 1): " in text and differs in text
    assert reached is not None and ended - reached < 60


def fake_srun(i: int, port: int) -> dict:
    """What ``srun --ntasks=2`` on one node named localhost would export to task ``i``."""
    return {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port)}


@pytest.mark.parametrize("launcher", ["flags", "slurm-env"])
def test_each_process_builds_only_its_rows(launcher, tmp_path):
    """tests/mp_driver.py: rows per process, global batch == one process's batch (DP, FSDP x TP, hybrid DCN).
    ``slurm-env``: no flags, the processes find each other from (simulated) srun variables."""
    port = free_port()
    first = f"127.0.0.1:{port}" if launcher == "flags" else "env"
    procs = launch(lambda i: [PY, "tests/mp_driver.py", first, "2", str(i), "4"], 2, tmp_path,
                   extra_env=(lambda i: fake_srun(i, port)) if launcher == "slurm-env" else None)
    wait_all(procs, tmp_path, timeout=180)
    for i in range(2):
        log = (tmp_path / f"p{i}.log").read_text()
        assert log.rstrip().endswith("OK")
        how = "explicit flags" if launcher == "flags" else "SLURM"
        assert f"joined process {i} of 2 ({how})" in log
        assert f"rows {i} {{'pipe': 1, 'data': 8, 'fsdp': 1, 'tensor': 1}} {list(range(8 * i, 8 * i + 8))}" in log


# ----------------------------------------------------------------------------- SIGTERM to one process
#: ZeRO-3 x TP: parameters and Adam state sharded over both processes, so the checkpoint is a collective save.
STOP_CASE = ["configs/zero3.yaml", *TINY, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "logging.samples=0",
             "checkpoint.enabled=true", "checkpoint.every=0", "train.steps=40"]


def run_job(tmp: Path, logs: str, *extra: str, signal_to: int | None = None, at_step: int = 5,
            timeout: float = 180) -> tuple[list[int], float | None]:
    """Run STOP_CASE as 2 processes x 4 devices (checkpoints in ``tmp/ck``, process i writes ``tmp/p{i}``);
    with ``signal_to``, send SIGTERM to that process alone once process 0 reported ``at_step``
    (``at_step=0``: once that process printed its strategy, before the loop starts).
    Returns the exit codes and the seconds from the signal until both processes had exited."""
    port = free_port()

    def args_of(i):
        return [PY, "-m", "jaxpar.cli", "train", *STOP_CASE, f"train.out_dir={tmp}/p{i}", f"checkpoint.dir={tmp}/ck",
                *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                "--local-devices", "4", "--heartbeat-timeout", "30"]

    log_dir = tmp / logs
    procs = launch(args_of, 2, log_dir)
    deadline, sent = time.monotonic() + timeout, None
    try:
        while signal_to is not None and sent is None:
            text = (log_dir / "p0.log").read_text()
            done = [int(line.split()[1].split("/")[0]) for line in text.splitlines()
                    if line.startswith("step ") and "  loss " in line]
            early = at_step == 0 and "\nstrategy " in (log_dir / f"p{signal_to}.log").read_text()
            if early or (at_step and done and done[-1] >= at_step):
                procs[signal_to].send_signal(signal.SIGTERM)
                sent = time.monotonic()
                break
            assert all(p.poll() is None for p in procs), f"a process ended before step {at_step}:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"no step {at_step} within {timeout:.0f} s:\n{text[-3000:]}"
            time.sleep(0.05)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        elapsed = time.monotonic() - sent if sent is not None else None
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within {timeout:.0f} s (a hang?):\n"
                    + "\n".join((log_dir / f"p{i}.log").read_text()[-2000:] for i in range(2)))
    finally:
        kill_rest(procs)
    assert_exited_zero(procs, log_dir)
    return [p.returncode for p in procs], elapsed


def all_losses(out_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.exhaustive   # 90 s; the start-up variant below checks the same agreement in the default run
@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "coordinator"])
def test_sigterm_to_one_process_stops_all_at_the_same_step(victim, tmp_path):
    """A SIGTERM to one process only (one evicted pod): both stop after the same step, save one checkpoint
    together and exit 0; ``--resume`` on 2 processes continues from it with the uninterrupted run's losses."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_job(ref, "logs")                                          # uninterrupted, 40 steps
    _, elapsed = run_job(run, "logs", signal_to=victim)
    assert elapsed < 60, f"both processes exited 0 {elapsed:.1f} s after SIGTERM to process {victim}"
    logs = [(run / "logs" / f"p{i}.log").read_text() for i in range(2)]
    stopped = {int(line.split()[5].rstrip(";")) for text in logs for line in text.splitlines()
               if line.startswith("stopped  by SIGTERM after step")}
    assert len(stopped) == 1, logs                                 # the same step in both processes
    step = stopped.pop()
    assert 5 <= step < 40
    assert sorted(int(p.name) for p in (run / "ck").iterdir() if p.name.isdigit()) == [step]
    records = [json.loads(line) for line in (run / "p0" / "metrics.jsonl").read_text().splitlines()]
    stops = [r for r in records if r["kind"] == "preempted"]
    assert [{k: v for k, v in r.items() if not k.startswith("goodput/")} for r in stops] == [
        {"kind": "preempted", "step": step, "signal": "SIGTERM", "checkpoint": True, "processes": [victim]}]
    assert stops[0]["goodput/productive_s"] > 0 and stops[0]["goodput/checkpoint_save_s"] > 0   # the run's clock

    run_job(run, "resume", "--resume")
    assert f"resume   step {step} from" in (run / "resume" / "p0.log").read_text()
    reference, resumed = all_losses(ref / "p0"), all_losses(run / "p0")
    assert sorted(resumed) == sorted(reference) == list(range(1, 41))
    assert resumed == reference                                    # bit-identical, before and after the stop


@pytest.mark.exhaustive
def test_sigterm_to_one_process_during_start_up(tmp_path):
    """A SIGTERM before the loop starts (compilation) is not lost to JAX's preemption notifier:
    both processes stop after the first step with a checkpoint of it and exit 0."""
    run_job(tmp_path, "logs", signal_to=1, at_step=0)
    for i in range(2):
        log = (tmp_path / "logs" / f"p{i}.log").read_text()
        assert "stopped  by SIGTERM after step 1; continue with --resume" in log
    assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == [1]


# ----------------------------------------------------------------------------- failure of a peer
@pytest.mark.exhaustive
@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "coordinator"])
def test_killed_process_ends_the_other_in_bounded_time(victim, tmp_path):
    heartbeat, bound = 10, 60.0
    port = free_port()

    def args_of(i):
        return [PY, "-m", "jaxpar.cli", "train", "configs/dp.yaml", *TINY, "train.steps=100000",
                "train.log_every=1", f"train.out_dir={tmp_path}/p{i}", "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", "2", "--process-id", str(i), "--local-devices", "4",
                "--heartbeat-timeout", str(heartbeat)]

    procs = launch(args_of, 2, tmp_path)
    survivor = 1 - victim
    try:
        deadline = time.monotonic() + 180
        while "step      3/" not in (tmp_path / "p0.log").read_text():   # both are training
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the two processes did not start training"
            time.sleep(0.5)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        try:
            code = procs[survivor].wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {survivor} still running {bound:.0f} s after process {victim} was killed")
        elapsed = time.monotonic() - t0
    finally:
        kill_rest(procs)
    log = (tmp_path / f"p{survivor}.log").read_text()
    assert code != 0, f"process {survivor} exited {code} {elapsed:.1f} s after process {victim} was killed"
    assert ("another task died" in log or "Gloo" in log or "unhealthy" in log), log[-3000:]
    assert elapsed < bound


# ----------------------------------------------------------------------------- flags and environments
@pytest.fixture
def no_launcher(monkeypatch):
    for k in list(os.environ):
        if k.startswith(_LAUNCHER_VARS):
            monkeypatch.delenv(k)


FLAG_ERRORS = [  # (coordinator, num_processes, process_id, text the error must contain)
    ("localhost", 2, 0, "--coordinator (coordinator)='localhost': expected HOST:PORT"),
    ("h:99999", 2, 0, "expected HOST:PORT"),
    ("h:1234", None, 0, "--num-processes (num_processes) is missing"),
    (None, None, 1, "--num-processes (num_processes) is missing"),
    ("h:1234", 2, None, "--process-id (process_id) is missing"),
    ("h:1234", 2, 2, "process id 2 (from --process-id) is not in 0..1"),
    (None, 2, 0, "no coordinator address for 2 processes"),
    ("h:1234", 0, 0, "--num-processes (num_processes)=0: must be an int >= 1"),
    ("h:1234", 1, 1, "--process-id (process_id)=1 with --num-processes 1"),
]


@pytest.mark.parametrize("coordinator,n,pid,message", FLAG_ERRORS, ids=[m[3][:30] for m in FLAG_ERRORS])
def test_inconsistent_flags_are_clear_errors(coordinator, n, pid, message, no_launcher):
    with pytest.raises(DistributedError) as err:
        resolve(coordinator, n, pid)
    assert message in str(err.value)


def test_cli_flag_errors_exit_2(no_launcher, capsys):
    quick = str(ROOT / "configs" / "quickstart.yaml")
    assert main(["train", quick, "--num-processes", "2"]) == 2
    assert "--process-id (process_id) is missing" in capsys.readouterr().err
    assert main(["train", quick, "--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    # train.devices counts all processes: 8 devices over 3 processes cannot be split
    assert main(["train", quick, "--coordinator", "127.0.0.1:1", "--num-processes", "3", "--process-id", "0"]) == 2
    assert "train.devices=8 (all processes together) is not divisible by 3 processes" in capsys.readouterr().err


def test_single_process_is_detected(no_launcher):
    assert resolve().method == "single" and not resolve().multiprocess
    assert resolve(num_processes=1).describe() == "single process (--num-processes 1)"
    # an sbatch script that runs Python without srun: one process, with a hint
    os.environ["SLURM_JOB_ID"] = "42"
    try:
        info = resolve()
    finally:
        del os.environ["SLURM_JOB_ID"]
    assert info.method == "single" and "not under srun" in info.note


def test_initialize_needs_a_fresh_backend(no_launcher):
    import jax

    jax.devices()   # the backend is up (8 simulated devices): joining a job now must fail clearly
    with pytest.raises(DistributedError, match="before anything touches JAX's backend"):
        dist.initialize("127.0.0.1:1", 2, 0)
    assert dist.initialize() == dist.ClusterInfo("single")     # a single process: nothing to do


SLURM = {"SLURM_JOB_ID": "4097", "SLURM_STEP_NODELIST": "gpu-[07-08,11]", "SLURM_NTASKS": "24",
         "SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_STEP_NUM_NODES": "3"}


def test_slurm_detection():
    info = resolve(environ=SLURM)   # 8 tasks per node: one GPU each (the task's local id)
    assert (info.method, info.num_processes, info.process_id) == ("slurm", 24, 13)
    assert info.coordinator == "gpu-07:61441" and info.local_device_ids == (5,)
    one_per_node = resolve(environ={**SLURM, "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"})
    assert one_per_node.local_device_ids is None          # every GPU of the node in one process
    assert resolve(environ={**SLURM, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu-07:1234"
    assert resolve(environ={**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).method == "single"
    assert resolve("10.0.0.1:5000", environ=SLURM).coordinator == "10.0.0.1:5000"   # flags win
    with pytest.raises(DistributedError, match=r"process id 13 \(from the SLURM environment\) is not in 0..3"):
        resolve(num_processes=4, environ=SLURM)
    with pytest.raises(DistributedError, match="SLURM_PROCID='x' is not an integer"):
        resolve(environ={**SLURM, "SLURM_PROCID": "x"})


def test_open_mpi_and_kubernetes_detection():
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.1.0.1:3491"}
    info = resolve(environ=ompi)                 # Open MPI 4: the mpirun host, JAX's port rule
    assert (info.method, info.num_processes, info.process_id, info.coordinator, info.local_device_ids) == (
        "ompi", 4, 3, "10.96.0.1:62624", (1,))
    ompi5 = {k: v for k, v in ompi.items() if k != "OMPI_MCA_orte_hnp_uri"}
    with pytest.raises(DistributedError, match=r"Open MPI 5 \(PMIx\)"):
        resolve(environ=ompi5)
    assert resolve(environ={**ompi5, "JAX_COORDINATOR_ADDRESS": "node1:1234"}).coordinator == "node1:1234"

    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2"}
    info = resolve(environ=k8s)                   # count and coordinator: from the Kubernetes API (JAX)
    assert (info.method, info.process_id, info.coordinator) == ("k8s", 2, None)
    info = resolve("trainer-0.jax:1234", 4, environ=k8s)
    assert (info.method, info.num_processes, info.process_id) == ("k8s", 4, 2)
    assert resolve(environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).method == "single"   # a plain pod


# ----------------------------------------------------------------------------- one process, same batches
def test_rows_pick_the_same_rows_of_the_global_batch():
    from jaxpar.data import _windows as D

    corpus = D.load_bytes(max_bytes=50_000)
    idx = np.array([5, 0, 9])
    for fn in (lambda **kw: D.text_batch(corpus, 3, batch_size=12, seq_len=8, seed=1, **kw),
               lambda **kw: D.synthetic_batch(3, batch_size=12, seq_len=8, vocab=40, seed=1, **kw)):
        full, part = fn(), fn(rows=idx)
        for key in full:
            np.testing.assert_array_equal(part[key], full[key][idx])
        with pytest.raises(ValueError, match=r"rows: expected None, a Sharding or a 1-D int array .* \[0, 12\)"):
            fn(rows=np.array([12]))


@pytest.mark.parametrize("spec", [dict(data=8), dict(data=2, fsdp=2, tensor=2), dict(fsdp=4, tensor=2)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_global_batch_on_one_process_equals_shard_batch(spec):
    from functools import partial

    import jaxpar
    from jaxpar.data import _windows as D
    from jaxpar.step import shard_batch
    from jaxpar.step._compose import batch_sharding

    mesh = jaxpar.make_mesh(jaxpar.MeshSpec(**spec))
    assert D.process_rows(batch_sharding(mesh), 16).tolist() == list(range(16))
    synthetic = partial(D.synthetic_batch, batch_size=16, seq_len=8, vocab=64, seed=2)
    for fn in (synthetic, lambda step: synthetic(step)):          # with and without rows=
        placed, reference = D.make_global_batch(fn, 4, mesh), shard_batch(fn(4), mesh)
        for key in reference:
            assert placed[key].sharding == reference[key].sharding
            np.testing.assert_array_equal(np.asarray(placed[key]), np.asarray(reference[key]))
    n = 8 // spec.get("tensor", 1)                                   # shards of the batch dimension
    with pytest.raises(ValueError, match=f"global batch size 10 is not divisible by the {n} shards"):
        D.make_global_batch(partial(synthetic, batch_size=10), 0, mesh)
