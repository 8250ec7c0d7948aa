"""A hang becomes an error: a step with no progress within its bound ends every process of the job, each with
its Python stacks in the run directory and exit status 124 (jaxpar.run.Watchdog, ``jaxpar train --step-timeout``).

* Two processes on this machine (gloo CPU collectives): process 1's data loader stops at step 3, so process 0
  waits for it inside the step's collectives; both end within the bound with the named error (process 0, the
  coordination service's host, last: jaxpar.run._watchdog.LEADER_GRACE).
* One process, the watchdog alone: the stacks name the stuck function; a loop that beats in time is left alone.
"""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.run import HUNG_EXIT

from test_multiprocess import PY, ROOT, free_port, kill_rest, launch

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow      # ~12 s idle (two processes start and compile); CI runs every slow test
def test_a_stuck_process_ends_both_with_the_named_error_and_their_stacks(tmp_path):
    bound, port = 3, free_port()

    def args_of(i):
        return [PY, "-m", "jaxpar.cli", "train", str(TESTS / "cli_mlp.yaml"), f"data.target={TESTS}/hang_data.py:stalls",
                "data.kwargs={stall_step: 3, stall_process: 1}", "train.steps=1000", "train.log_every=1000",
                "train.eval_batches=0", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "logging.tensorboard=false",
                f"train.out_dir={tmp_path}/p{i}", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                "--process-id", str(i), "--local-devices", "4", "--heartbeat-timeout", "60",
                f"train.step_timeout={bound}"]

    procs = launch(args_of, 2, tmp_path, extra_env=lambda i: {"PYTHONPATH": f"{ROOT}:{TESTS}"})
    try:
        deadline = time.monotonic() + 180
        while "step      1/1000" not in (tmp_path / "p0.log").read_text():
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the two processes did not start training"
            time.sleep(0.2)
        started = time.monotonic()           # the first step's line: compiled, both processes stepping
        codes = [p.wait(timeout=bound + 60) for p in procs]
        elapsed = time.monotonic() - started
    finally:
        kill_rest(procs)
    logs = [(tmp_path / f"p{i}.log").read_text() for i in (0, 1)]
    assert codes == [HUNG_EXIT, HUNG_EXIT], logs[0][-2000:] + logs[1][-2000:]
    assert elapsed < bound + 30, elapsed          # the bound, plus polling and a loaded machine's start of step 3
    for i, log in enumerate(logs):
        assert "jaxpar train: error: StepHangError: no progress for" in log and f"over the bound of {bound}.0 s" in log
        assert f"process {i} of 2" in log and f"{tmp_path}/p{i}/hang-p{i}.txt" in log and "Traceback" not in log
    stacks = [(tmp_path / f"p{i}" / f"hang-p{i}.txt").read_text() for i in (0, 1)]
    assert 'hang_data.py", line' in stacks[1] and "in stalls" in stacks[1]        # where the stuck one stopped
    # process 0 waits for the step's collectives: inside the step's program, or for a step in flight before it
    assert "in step" in stacks[0] and ("_program.py" in stacks[0] or "in wait_inflight" in stacks[0]), stacks[0]
    assert "hang_data.py" not in stacks[0]


SCRIPT = """
import sys, time
from jaxpar.run import Watchdog
dog = Watchdog(seconds=float(sys.argv[2]), directory=sys.argv[1], poll=0.05)
def stuck_loader():
    time.sleep(60)
with dog:
    for step in range(1, 6):
        time.sleep(0.01)
        dog.beat(step)
    print("beat in time", flush=True)
    stuck_loader()
"""


def test_one_process_past_its_bound_dumps_its_stacks_and_exits_hung(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), "0.5"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == HUNG_EXIT and time.monotonic() - t0 < 30, r.stderr
    assert r.stdout == "beat in time\n"                 # five steps within the bound: nothing happened
    assert "StepHangError: no progress for" in r.stderr and "after step 5 was dispatched" in r.stderr
    stacks = (tmp_path / "hang-p0.txt").read_text()
    assert "in stuck_loader" in stacks and "in _fire" in stacks      # every thread: the stuck one and the watchdog's
