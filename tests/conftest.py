"""Test set-up: 8 fake CPU devices, configured before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two optimisation levels. The train runs the tests start (their processes inherit these variables) and the ones
# they run in this process (`tests/train_runs._train_here`) compile at a user's level: XLA's passes, LLVM level 1
# (`jaxrl.runtime.cpu_compile_level`). This process's own programs (the kernels', models', engine's and train step's
# tests: compile-bound, each program run a few times) compile at level 0 (JAX's jax_disable_most_optimizations,
# LLVM -O0, set below once JAX is imported). Measured: level 0 compiled a tiny 3-step train run's programs in about
# the time level 1 did but ran them twice as slowly (warm cache, 1 process: 18-20 against 9-11 CPU-s); the whole
# suite at level 1 took the train-run files 500 CPU-s less (test_train_processes.py 934 -> 707) and the in-process
# files 300 more (test_blockwise.py 98 -> 167) than at level 0. JAX_DISABLE_MOST_OPTIMIZATIONS=1 runs the train runs
# at level 0 too.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
# XLA:CPU's LLVM IR fusion emitters instead of its newer MLIR ones (--xla_cpu_use_fusion_emitters=false): each
# program compiles in less than half the time (a cold 2-step train run's 49 compilations 7.2 s -> 2.9 s;
# tests/test_paged_attention.py and tests/test_forward_block.py, empty cache: 103 -> 50 CPU-s). The one run whose
# golden records the weights' bits (`tests/train_runs.GOLDEN_OPT`) uses XLA's defaults exactly. XLA_FLAGS= runs the
# suite with XLA's default emitters and LLVM level; a bench script's device count is asked for with
# jax_num_cpu_devices, not XLA_FLAGS.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1")

import sys  # noqa: E402

# Where PYTHONDONTWRITEBYTECODE is set (it is on this machine), no process writes the bytecode of the modules it
# imports, so each of the processes the suite starts (train runs, their several processes, run servers) would
# compile them from source again (`import jaxrl.train.__main__`: 2.8 s from source, 0.8 s from bytecode). The
# session writes it, for itself and the processes it starts: the first process to import a module writes its
# bytecode (importlib writes a temporary file and renames it), every later one reads it; a changed file is
# compiled again (the check is its mtime). This covers our packages (git ignores __pycache__) and the test
# extra's reference stack (torch, transformers, TRL, PEFT), which scripts/venv.sh leaves out of its compileall.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)      # this process's own programs (above)

jax.config.update("jax_num_cpu_devices", 8)
# start the backend now, so the count is fixed for the session: a CLI `main()` run in-process asks for its own
# count (`runtime.request_cpu_devices`), which JAX accepts until the backend starts. Had such a test been the
# first to touch a device, the rest of the session would see its count (found: `python -m jaxrl.rollout.profile`
# asked for 4, and tests/test_sim.py then counted reshard bytes over 4 devices).
assert jax.device_count() == 8, jax.devices()

from jaxrl.runtime import enable_compilation_cache  # noqa: E402

# the persistent cache the train runs use (JAXRL_COMPILATION_CACHE_DIR), on from the start: the two xdist
# workers and the runs they start share what any of them compiled, and on the CPU one executable serves
# every device group it runs on (a TP1 rollout instance per device compiles each bucket once, not 8 times)
enable_compilation_cache()

import resource  # noqa: E402

import pytest  # noqa: E402


# The slowest files (scripts/results/suite_time.json's by_file_s), longest first: handed out first, so that no
# long file starts last and leaves one worker idle at the end. Only an order: a file not listed runs later.
LONGEST_FIRST = ["test_train_e2e.py", "test_train_processes.py", "test_train_pools.py", "test_blockwise.py",
                 "test_lora_mechanisms.py", "test_train_resume.py", "test_opd.py", "test_tp_switch.py", "test_lora.py",
                 "test_train_step.py", "test_smollm2.py", "test_bench_adaptive_tp.py", "test_forward_block.py",
                 "test_rollout.py", "test_movable_state.py", "test_vocab_padding.py",
                 "test_sim_engine.py", "test_gpu_check.py", "test_cuda_export.py", "test_bench_lora.py", "test_pat_processes.py",
                 "test_tail_batching.py", "test_launchers.py", "test_heartbeat.py", "test_stream_trainer.py", "test_scale_up_layouts.py"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The order pyproject's `-n 2 --dist loadfile --no-loadscope-reorder` (two pytest-xdist workers) hands
    out the test files in: each file runs whole on one worker (its module fixtures and the executables its
    tests share are built once), the files in the order of their first test here, LONGEST_FIRST leading."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], len(rank)))   # stable


@pytest.fixture(autouse=True)
def _release_executables():
    """Free compiled executables once they hold too many memory mappings (`tests.run_server.release_executables`:
    the whole suite in one process would exceed the kernel's limit and LLVM abort a compilation)."""
    yield
    from tests.run_server import release_executables

    release_executables()


# CPU seconds per test: this process's threads, every process the test started and waited for (its train
# runs, launch_local's processes) and what the worker's run servers used meanwhile (tests/run_server.py). On two workers sharing two cores a test's wall time depends on what the other
# worker runs at the time; its CPU time does not. Listed at the end of a run ("most CPU"), longest first, as
# many as --durations asks (0: all), and read by scripts/suite_time.py.
_CPU_START: dict[str, float] = {}
_CPU_BY_TEST: dict[str, float] = {}


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    runs = sys.modules.get("tests.train_runs")          # its live run servers (tests/run_server.py)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + (runs.served_cpu_s() if runs else 0.0)


def pytest_runtest_logstart(nodeid, location):
    _CPU_START[nodeid] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and item.nodeid in _CPU_START:
        outcome.get_result().user_properties.append(("cpu_s", _cpu_s() - _CPU_START.pop(item.nodeid)))


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s" and report.when == "teardown":     # (on the xdist controller: the workers' figures)
            _CPU_BY_TEST[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if not _CPU_BY_TEST:
        return
    tr, asked = terminalreporter, terminalreporter.config.option.durations
    n = 25 if asked is None else asked or len(_CPU_BY_TEST)          # --durations=0: every test
    tr.write_sep("=", f"most CPU ({n} tests; {sum(_CPU_BY_TEST.values()) / 60:.1f} CPU-min in all tests)")
    for nodeid, cpu in sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:n]:
        tr.write_line(f"{cpu:8.1f}s cpu  {nodeid}")
