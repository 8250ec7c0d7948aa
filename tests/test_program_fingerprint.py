"""The same program on every process (jaxpar/run/_same_program.py): the fingerprint of a step, the
exchange through a real coordination service (in this process, one client per simulated process,
each in a thread), the named error of a mismatch and of a silent process. The two-process runs of the
CLI are in tests/test_multiprocess.py."""
import socket
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import LoopError, ProgramMismatchError
from jaxpar.run import SameProgram
from jaxpar.run._same_program import (check_same_program, compare_programs, config_differences, first_difference,
                                      program_text)


@pytest.fixture
def clients():
    """``clients(n)``: ``n`` connected clients of one coordination service on localhost (the key-value
    store ``jax.distributed`` gives each process); shut down after the test."""
    from jax._src.lib import _jax

    made = []

    def make(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=10, shutdown_timeout=5)
        cs = [_jax.get_distributed_runtime_client(address, i, init_timeout=20, heartbeat_timeout=10,
                                                  shutdown_timeout=5, shutdown_on_destruction=False)
              for i in range(n)]
        _each(lambda c: c.connect(), cs)
        made.append((service, cs))
        return cs

    yield make
    for service, cs in made:
        _each(lambda c: c.shutdown(), cs)
        service.shutdown()


def _each(fn, items) -> list:
    """``fn(item)`` for every item, each in its own thread (the processes of a job); results or exceptions."""
    out = [None] * len(items)

    def run(i):
        try:
            out[i] = fn(items[i])
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def _compare(cs, texts, configs=None, check=1):
    """Process ``i`` (a thread) compares ``texts[i]``; what each returned or raised."""
    configs = configs or [None] * len(texts)
    return _each(lambda i: compare_programs(texts[i], configs[i], client=cs[i], timeout_s=10.0, process_index=i,
                                            process_count=len(texts), check=check), list(range(len(texts))))


PROGRAM = "// jax\n// program step\n%0 = stablehlo.add %a, %b\n%1 = stablehlo.constant dense<1.0>\n%2 = mul"
OTHER = PROGRAM.replace("dense<1.0>", "dense<0.5>")
CONFIG = "optimizer: {clip_norm: 1.0, lr: 0.003}\ntrain: {out_dir: runs/a, steps: 10}\n"


def test_the_same_program_passes_and_a_different_one_is_named_on_every_process(clients):
    cs = clients(3)
    same = _compare(cs, [PROGRAM] * 3)
    assert all(isinstance(r, dict) and len(r) == 3 for r in same), same
    assert len({r[0] for r in same[0].values()}) == 1

    configs = [CONFIG, CONFIG, CONFIG.replace("clip_norm: 1.0", "clip_norm: 0.5")]
    got = _compare(cs, [PROGRAM, PROGRAM, OTHER], configs, check=2)   # the job's second check: its own keys
    assert all(isinstance(e, ProgramMismatchError) for e in got), got
    assert len({str(e) for e in got}) == 1                   # every process says the same
    message = str(got[0])
    assert "process 2 of 3 differs from process 0 (process 1 the same as process 0)" in message
    assert "first difference in program 'step', line 4 of the lowered StableHLO" in message
    assert "process 0:  %1 = stablehlo.constant dense<1.0>" in message
    assert "process 2:  %1 = stablehlo.constant dense<0.5>" in message
    assert "config (process 0 vs 2): optimizer.clip_norm: 1.0 vs 0.5" in message


def test_a_process_that_never_reports_is_the_named_error_not_a_hang(clients):
    cs = clients(2)
    t0 = time.monotonic()
    with pytest.raises(ProgramMismatchError, match=r"process 0 waited 0.5 s for the program fingerprint of "
                                                    r"process 1 and got none \(DEADLINE_EXCEEDED\)"):
        compare_programs(PROGRAM, None, client=cs[0], timeout_s=0.5, process_index=0, process_count=2)
    assert time.monotonic() - t0 < 5


def test_groups_of_processes_each_show_their_first_difference(clients):
    cs = clients(4)
    third = PROGRAM + "\n%3 = stablehlo.negate %2"             # longer: the extra line is the difference
    got = _compare(cs, [PROGRAM, OTHER, OTHER, third])
    message = str(got[3])
    assert all(str(e) == message for e in got)
    assert "processes 1-3 of 4 differ from process 0." in message
    assert "processes 1-2 (sha256" in message and "process 3 (sha256" in message
    assert "process 0:  <end of program>" in message and "process 3:  %3 = stablehlo.negate %2" in message


def test_first_difference_and_config_differences():
    assert first_difference(PROGRAM, OTHER) == ("step", 4, "%1 = stablehlo.constant dense<1.0>",
                                                "%1 = stablehlo.constant dense<0.5>")
    assert first_difference(PROGRAM, PROGRAM)[1] == 0
    assert config_differences(CONFIG, CONFIG) == []
    assert config_differences(CONFIG, CONFIG.replace("lr: 0.003", "lr: 0.001") + "extra: 1\n") == [
        "extra: <none> vs 1", "optimizer.lr: 0.003 vs 0.001"]


def _mlp_step(clip: float):
    from jaxpar.models._mlp import MLPClassifier, classifier_loss

    mesh = jaxpar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(0.1))
    state, layout = jaxpar.init_train_state(
        lambda: MLPClassifier(features=4, embed=8, mlp=8, classes=2, depth=1, rngs=nnx.Rngs(0)), tx, mesh)
    batch = jaxpar.shard_batch({"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)}, mesh)
    return jaxpar.make_train_step(classifier_loss, tx, layout), state, batch


def test_the_fingerprint_is_the_lowered_step_and_sees_an_option_of_the_update():
    step, state, batch = _mlp_step(1.0)
    text = program_text(step, state, batch)
    assert text.startswith(f"// jax {jax.__version__}") and "\n// program step\n" in text
    assert program_text(step, state, batch) == text                # deterministic
    other = program_text(*_mlp_step(0.5))
    _, line, ours, theirs = first_difference(text, other)
    assert line > 0 and "1.000000e+00" in ours and "5.000000e-01" in theirs
    assert program_text(lambda s, b: (s, {}), state, batch) is None   # nothing to lower: no check
    assert check_same_program(step, state, batch) is None          # one process: nothing is done


def test_same_program_options_are_checked():
    with pytest.raises(LoopError, match=r"SameProgram\(timeout_s=0\): must be a number of seconds > 0"):
        SameProgram(timeout_s=0)
