"""Test set-up: 8 fake CPU devices, configured before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

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

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The order and grouping pyproject's `-n 2 --dist loadgroup` (two pytest-xdist workers) runs in.

    Each test file is one xdist group, so a file's module fixtures and the executables its tests share are
    built once, in one worker. The tests marked `processes` (runs of several `jax.distributed` processes at
    once) form their own group instead, run first and one after another: a 2-process run already uses both
    cores, and two at once beside a third compile would starve the heartbeat of tests/test_heartbeat.py.
    test_train_e2e.py (the longest file: ~12 of a serial run's ~75 minutes) follows, so no long file starts last."""
    def group(item):
        return "processes" if item.get_closest_marker("processes") else item.nodeid.split("::")[0]

    rank = {"processes": 0, "tests/test_train_e2e.py": 1}
    items.sort(key=lambda item: rank.get(group(item), 2))       # stable: collection order within a rank
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:              # not Linux: no limit to watch
        return 0


@pytest.fixture(autouse=True)
def _release_executables():
    """Free compiled executables once they hold too many memory mappings. Each XLA:CPU executable holds
    several (about 30 with 8 devices) and a process may have 65530 (vm.max_map_count); the whole suite
    in one process compiles enough to exceed that, and LLVM then aborts a compilation."""
    yield
    if _mappings() > 20000:
        from jaxrl.rollout import CACHE

        CACHE.clear()
        jax.clear_caches()
        gc.collect()
