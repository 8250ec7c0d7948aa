"""A test that crashes or hangs its worker ends ``make test`` with a failure that names it (issue 87).

``make test``'s pytest (the Makefile's xdist options, with this suite's conftest) over a tiny suite in a
temporary directory: one test aborts its process, as XLA:CPU does at a rendezvous timeout; another sleeps
past the per-test limit (``JAXPAR_TEST_TIMEOUT``, tests/conftest.py). Each is reported once as the test its
worker crashed in, the tests after them in their files still run in the replacement workers, and the run ends
in seconds. Before, a crashed test ran again in each replacement worker (xdist's ``--dist loadfile``), and a
hung one waited without end.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

FILES = {
    "test_crash.py": "import os\n\ndef test_before():\n    pass\n\ndef test_aborts():\n    os.abort()\n\n"
                     "def test_after_abort():\n    pass\n",
    "test_hang.py": "import time\n\ndef test_hangs():\n    time.sleep(600)\n\ndef test_after_hang():\n    pass\n",
}


def make_test_options() -> list[str]:
    """``make test``'s xdist options (the Makefile's ``PARALLEL``)."""
    return re.search(r"^PARALLEL := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()


def test_a_crashed_or_hung_worker_fails_its_test_once_and_the_run_ends(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "JAXPAR_TEST_REPORT"}
    env.update(PYTHONPATH=str(TESTS), JAXPAR_TEST_TIMEOUT="3")
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", *make_test_options(), "."]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not end in 240 s:\n{out[-4000:]}") from None
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, out[-4000:]
    for test in ("test_crash.py::test_aborts", "test_hang.py::test_hangs"):
        assert len(re.findall(rf"^FAILED {test}\b", out, re.M)) == 1, out[-4000:]       # failed once
        assert re.search(rf"worker 'gw\d+' crashed while running '{test}'", out), out[-4000:]
    assert out.count("Fatal Python error: Aborted") == 1, out[-4000:]           # and aborted once, not rerun
    assert 'test_hang.py", line 4 in test_hangs' in out, out[-4000:]       # the hung test's stack
    assert re.search(r"\b2 failed, 3 passed\b", out), out[-4000:]              # the others ran, once each
    assert elapsed < 180, elapsed
