"""Root test configuration: 8 simulated CPU devices, set once before any backend use; the tiers.

The tiers (docs/testing.md): unmarked tests are ``make test``'s; ``slow`` ones run in every CI run;
``exhaustive`` ones in one share of three per CI run (``--share K/3``). tests/tiers.py moves cases
between them; ``JAXPAR_TEST_REPORT=DIR`` writes each test's wall time and compiles (the cost report).

Compiled programs are shared through JAX's persistent compilation cache, in a fresh directory
per test session (removed at exit): many tests build the same train step or the same sharded
initialisation (a new ``make_train_step`` / ``init_train_state`` closure is a new ``jax.jit``, so
JAX's in-memory cache never sees the repeat), and the CLI runs of tests/test_faults.py compile
one program again in every subprocess. The cache key is the whole HLO module plus the compile
options, devices and jax/XLA versions, so a hit is the very executable a compile would build
(only the source-location metadata in ``as_text()`` is the first compile's), with one known
exception that deadlocks (docs/testing.md, "The persistent cache's one known bad hit"): a test
must not run that program twice. The variables are
set before ``import jax`` and inherited by subprocesses (CLI runs, notebook kernels).
``JAXPAR_TEST_COMPILATION_CACHE=0`` turns it off; a ``JAX_COMPILATION_CACHE_DIR`` set outside
is used as it is (and kept). Under pytest-xdist (``make test``: ``-n auto``) the controller sets
the directory before it starts the workers, so they share one cache (and it removes it).

XLA:CPU's LLVM back end runs at optimisation level 0 (``--xla_backend_optimization_level=0``,
appended to ``XLA_FLAGS``): it compiles the test programs ~3x faster. The HLO passes are
unchanged, so the optimised HLO (``as_text()``: collectives, shardings) and the memory analysis
are the same as at the default level; only the machine code differs, which moves results by
fp32 round-off (e.g. FMA contraction), within every tolerance of the suite, and the code runs
slower (tiny programs: compile time dominates). XLA:CPU's MLIR fusion emitters are off too
(``--xla_cpu_use_fusion_emitters=false``: the older loop emitters), which halves the compile time
of the suite (``make test``: 240 s of compiles in place of 584 s). The fused loops' code differs,
not the SPMD partitioner's output (the collectives and their shapes); every test of compiled memory,
HLO and collectives passes either way. A test that asserts two *different* programs bit-equal can
depend on the emitters' reduction order: it is marked ``fusion_emitters`` and runs in a subprocess
with XLA's fusion emitters on (the ``-O0`` level kept). Subprocesses inherit the flags
(tests/test_multiprocess.py passes ``TEST_XLA_FLAGS`` on explicitly, since it clears ``XLA_FLAGS``),
so in-process and subprocess runs compile alike. ``JAXPAR_TEST_XLA_OPT=default`` keeps XLA's defaults for both.

Each simulated device also runs its ops single-threaded (``--xla_cpu_multi_thread_eigen=false``):
8 device threads already share the 2 cores, and with Eigen's intra-op pool on top a pipelined
program occasionally deadlocked in a rendezvous (one device of a stage never reached its
all-reduce while the others waited; XLA aborts the process after 40 s), seen about once in 8
runs of the PipeDream-2BW resume test and never in 6 runs with the flag. The same abort was still
seen in a DiLoCo test when other jobs loaded the machine too (twice, both while the suite ran
beside other work), so the rendezvous may wait 300 s before XLA aborts
(``--xla_cpu_collective_call_terminate_timeout_seconds=300``): a starved device thread gets
there late; a real deadlock still ends in the abort, later.

A run ends (docs/testing.md, "A suite that ends"): a test that runs longer than :data:`TEST_TIMEOUT` ends its
process with every thread's stack, and under ``--dist loadfile`` a test whose worker died is reported once and
not run again (:func:`pytest_xdist_make_scheduler`). A test's own loop of steps waits for each one: XLA:CPU
deadlocks when the host dispatches dozens of 8-device programs ahead of the device threads (issue 87).
"""
import atexit
import os
import shutil
import tempfile
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("JAXPAR_TEST_COMPILATION_CACHE", "1") != "0":
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _cache_dir = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")    # every program, not only > 1 s
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAXPAR_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # before this adds any
#: XLA flags this session adds (tests that start processes with a cleared XLA_FLAGS pass these on)
TEST_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false --xla_cpu_collective_call_terminate_timeout_seconds=300"
if os.environ.get("JAXPAR_TEST_XLA_OPT", "0") != "default":
    TEST_XLA_FLAGS += " --xla_backend_optimization_level=0"
    if os.environ.get("JAXPAR_TEST_FUSION_EMITTERS") != "1":
        TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
#: whether this process compiles with XLA:CPU's fusion emitters (a ``fusion_emitters`` test runs here)
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false" not in TEST_XLA_FLAGS
for _flag in TEST_XLA_FLAGS.split():
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--share", default=None, metavar="K/N",
                     help="run share K (0-based) of N of the tests marked exhaustive (CI: docs/testing.md)")
    parser.addoption("--all-tiers", default="", metavar="ID,ID",
                     help="with --share: the exhaustive tests of these files or functions (tests/x.py, "
                          "tests/x.py::test_f) run whatever their share (CI: the change's own, .ci/share files)")


def _share(config) -> tuple[int, int] | None:
    text = config.getoption("--share")
    if text is None:
        return None
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--share {text}: expected K/N, e.g. --share 1/3") from None
    if not 0 <= k < n:
        raise pytest.UsageError(f"--share {text}: K must be in 0..N-1")
    return k, n


def share_of(nodeid: str, n: int) -> int:
    """The share (0..n-1) an exhaustive test belongs to: a stable hash of its id."""
    return zlib.crc32(nodeid.encode()) % n


def tier_of(item) -> str:
    """``fast`` (``make test``), ``slow`` (CI, every run) or ``exhaustive`` (CI, one share a run)."""
    return next((m for m in ("slow", "exhaustive") if item.get_closest_marker(m)), "fast")


# --- a crash or a hang ends as a failure that names the test (docs/testing.md, "A suite that ends") ----------
#: Seconds a test may run before its process writes every thread's Python stack and ends (exit status 1), so
#: that a hang becomes a failure naming the test (under xdist: "worker 'gw1' crashed while running <test>"),
#: not a run that waits without end. By tier: the fast tier's longest test takes ~20 s here, CI's ~440 s
#: under coverage (docs/testing.md §3), each with room for a loaded machine; XLA:CPU aborts a stuck rendezvous
#: after 300 s (above), before these. ``JAXPAR_TEST_TIMEOUT=S`` sets one limit for every tier (0: none);
#: pytest's own ``-o faulthandler_timeout=S`` replaces it.
TEST_TIMEOUT = {"fast": 600.0, "slow": 1800.0, "exhaustive": 1800.0}


def timeout_of(item) -> float:
    """The seconds ``item`` may run (0: no limit)."""
    if os.environ.get("JAXPAR_TEST_TIMEOUT"):
        return float(os.environ["JAXPAR_TEST_TIMEOUT"])
    return TEST_TIMEOUT[tier_of(item)]


class _TestTimeout:
    """Arms :mod:`faulthandler` for each test (:func:`timeout_of`), writing to the stderr pytest keeps for it."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        import faulthandler
        from _pytest.faulthandler import fault_handler_stderr_fd_key, get_timeout_config_value
        limit, fd = timeout_of(item), item.config.stash.get(fault_handler_stderr_fd_key, None)
        if limit <= 0 or fd is None or get_timeout_config_value(item.config) > 0:
            return (yield)
        faulthandler.dump_traceback_later(limit, exit=True, file=fd)
        try:
            return (yield)
        finally:
            faulthandler.cancel_dump_traceback_later()


def pytest_configure(config):
    config.pluginmanager.register(_TestTimeout(), "jaxpar-test-timeout")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``make test``, ``.ci/run``): xdist's own scheduler, except that a test whose worker
    died is not run again.

    xdist reports that test failed ("worker 'gw1' crashed while running ...") and hands the rest of its file to
    another worker, a new one replacing the dead one, but with the crashed test still among those to run: a
    test that crashes every time ran again in each replacement worker, up to ``--max-worker-restart`` (4 per
    worker) times, and one that XLA aborts at its rendezvous timeout (issue 87) kept the workers idle 300 s a
    time. Here the file's other tests still run, the crashed one once."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileRunOnce(LoadFileScheduling):
        def remove_node(self, node):
            # xdist's remove_node, but the crashed test is marked done before the rest goes back in the queue
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            scope, crashed = pending[0]             # the first test a worker has not finished is the one it ran
            workload[scope][crashed] = True
            self.workqueue.update((s, unit) for s, unit in workload.items() if not all(unit.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return LoadFileRunOnce(config, log)


def pytest_report_header(config):
    share = _share(config)
    return None if share is None else f"exhaustive tier: share {share[0]} of {share[1]} (--share {share[0]}/{share[1]})"


def pytest_pyfunc_call(pyfuncitem):
    """A ``fusion_emitters`` test, where this process compiles without them: the same test id in a
    subprocess that compiles with them (its result is this test's)."""
    if FUSION_EMITTERS or not pyfuncitem.get_closest_marker("fusion_emitters"):
        return None
    import subprocess
    import sys
    env = {**os.environ, "XLA_FLAGS": os.environ["JAXPAR_TEST_USER_XLA_FLAGS"], "JAXPAR_TEST_FUSION_EMITTERS": "1"}
    env.pop("JAXPAR_TEST_REPORT", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "",
                          pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(f"with XLA:CPU's fusion emitters (a subprocess):\n{run.stdout[-6000:]}{run.stderr[-2000:]}",
                    pytrace=False)
    return True


def need_devices(n: int):
    """Skip a test that needs more devices than the backend has."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")


#: The heaviest test files, run first (docs/testing.md §3, 2026-11-26): first those whose single longest
#: test is long (the convergence runs of CI's second pass: MoE 442 s, compression 431 s, relaxed
#: synchronisation 251 s, two processes 246 s, batch ramp 169 s, under coverage), then by total time.
#: ``make test`` hands out whole files in collection order (``--dist loadfile --no-loadscope-reorder``),
#: so a long file cannot be handed out last, whatever xdist's own order (by number of tests) would do:
#: at the end of a pass the other worker would wait for it.
HEAVIEST_FIRST = (
    "test_moe_train.py", "test_compression_train.py", "test_pairs.py", "test_relaxed_sync.py", "test_batch_ramp.py",
    "test_compression_step.py", "test_targets.py", "test_cost_layout.py", "test_checkpoint.py", "test_byo_model.py",
    "test_multiprocess.py", "test_notebooks.py", "test_pipeline.py", "test_moe.py", "test_cli.py",
    "test_async_pipeline.py", "test_context_attention.py", "test_context_train.py", "test_doctests.py",
)


def _apply_tiers(items):
    """Mark what tests/tiers.py moves: a function's cases beyond ``FAST_CASES``, the ``MOVED`` and the
    ``COVERED_ELSEWHERE`` tests are exhaustive, the ``SLOW`` tests slow. A name there that matches none
    of the collected tests is an error when every file it names was collected."""
    from tiers import COVERED_ELSEWHERE, FAST_CASES, MOVED, SLOW

    seen = set()
    for item in items:
        function, _, case = item.nodeid.partition("[")
        if function in FAST_CASES:
            seen.add(function)
            if case[:-1] not in FAST_CASES[function]:
                item.add_marker(pytest.mark.exhaustive)
        if item.nodeid in MOVED or item.nodeid in COVERED_ELSEWHERE:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.exhaustive)
        if item.nodeid in SLOW:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.slow)
    named = {*FAST_CASES, *MOVED, *COVERED_ELSEWHERE, *SLOW}
    files = {i.nodeid.split("::")[0] for i in items}
    stale = [n for n in named - seen if n.split("::")[0] in files]
    if stale and all(n.split("::")[0] in files for n in named):
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {sorted(stale)}")


@pytest.hookimpl(tryfirst=True)         # before -m deselects by the markers this adds
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order
    _apply_tiers(items)
    if os.environ.get("JAXPAR_TEST_REPORT"):       # every collected test's tier, for tests/tools/coverage_tiers.py
        import json
        os.makedirs(os.environ["JAXPAR_TEST_REPORT"], exist_ok=True)
        with open(os.path.join(os.environ["JAXPAR_TEST_REPORT"], "tiers.json"), "w") as f:
            json.dump({i.nodeid: tier_of(i) for i in items}, f)
    share = _share(config)
    if share is not None:
        whole = set(filter(None, config.getoption("--all-tiers").split(",")))
        other = {i for i in items if tier_of(i) == "exhaustive" and share_of(i.nodeid, share[1]) != share[0]
                 and not whole & {i.nodeid.split("::")[0], i.nodeid.split("[")[0]}}
        if other:
            config.hook.pytest_deselected(items=list(other))
            items[:] = [i for i in items if i not in other]


# --- cost report: JAXPAR_TEST_REPORT=DIR writes one JSON line per test (wall time, compiles) ---------------
_COUNTED = {"/jax/compilation_cache/compile_requests_use_cache": "compiles",
            "/jax/compilation_cache/cache_hits": "cache_hits",
            "/jax/compilation_cache/cache_misses": "cache_misses"}
_TIMED = {"/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/core/compile/jaxpr_trace_duration": "trace_s"}
_test_cost: dict = {}


def _count_event(event, **_):
    if event in _COUNTED:
        _test_cost[_COUNTED[event]] = _test_cost.get(_COUNTED[event], 0) + 1


def _time_event(event, seconds, **_):
    if event in _TIMED:
        _test_cost[_TIMED[event]] = _test_cost.get(_TIMED[event], 0.0) + seconds


if os.environ.get("JAXPAR_TEST_REPORT"):
    jax.monitoring.register_event_listener(_count_event)
    jax.monitoring.register_event_duration_secs_listener(_time_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time
        _test_cost.clear()
        start = time.perf_counter()
        yield
        record = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                  "tier": tier_of(item), **_test_cost}
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(os.environ["JAXPAR_TEST_REPORT"], exist_ok=True)
        with open(os.path.join(os.environ["JAXPAR_TEST_REPORT"], f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
