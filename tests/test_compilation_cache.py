"""The persistent compilation cache serves one CPU executable to every device group and process it runs on
(`jaxrl.runtime.enable_compilation_cache`): compiled once on device 0 (or devices 0-1), then loaded, not
compiled, for each other device (or pair), with bit-identical results placed on the devices of the call;
and a program over all 8 devices compiled by one process is loaded by each process of a 2-process job.

Run in fresh processes: the cache directory and JAX's cache object are process-wide."""

import subprocess
import sys
import textwrap

import pytest

from tests.train_runs import ROOT, _env

PRELUDE = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    jax.config.update("jax_num_cpu_devices", 8 // n)
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], n, int(os.environ["JAX_PROCESS_ID"]))
    from jaxrl.runtime import CompileCounter, enable_compilation_cache
    assert enable_compilation_cache(sys.argv[1]) == sys.argv[1]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    def f(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w) + x
        return x.sum(0)

    rng = np.random.default_rng(0)
    x, w = rng.random((32, 32), np.float32), rng.random((32, 32), np.float32) / 32
    counter = CompileCounter()

    def run(devices):
        mesh = Mesh(np.array(devices), ("tp",))
        xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i: x[i])
        ws = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P(None, "tp")), lambda i: w[i])
        out = jax.jit(f, out_shardings=NamedSharding(mesh, P()))(xs, ws)   # a new jit: no in-memory reuse
        assert {d for d in out.devices()} == set(devices), (out.devices(), devices)
        return [np.asarray(s.data) for s in out.addressable_shards], counter.take()["compile_cache_hits"]
""")

DEVICES = PRELUDE + textwrap.dedent("""
    devs = jax.devices()
    for group in ([0], [3], [7], [0, 1], [2, 3], [7, 4]):
        shards, hits = run([devs[i] for i in group])
        if len(group) == 1 or group == [0, 1]:
            want = shards[0]                                 # the first program of each width compiles
        for s in shards:
            np.testing.assert_array_equal(s, want)
        print("OUT", len(group), hits)
""")

ALL_DEVICES = PRELUDE + textwrap.dedent("""
    shards, hits = run(jax.devices())
    print("OUT", hits, shards[0].tobytes().hex())
""")


def _python(script, cache, processes=1):
    cmd = [sys.executable, "-c", script, str(cache)]
    if processes > 1:
        cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(processes), *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [line.split("OUT ")[1].split() for line in p.stdout.splitlines() if "OUT " in line]


def test_one_cpu_executable_serves_every_device_group(tmp_path):
    hits = [(int(n), int(h) > 0) for n, h in _python(DEVICES, tmp_path / "xla")]
    # device 0 and the pair (0, 1) compile; every other device and pair is a cache hit
    assert hits == [(1, False), (1, True), (1, True), (2, False), (2, True), (2, True)]


@pytest.mark.processes
def test_a_two_process_job_loads_what_one_process_compiled(tmp_path):
    [(hits, one)] = _python(ALL_DEVICES, tmp_path / "xla")
    two = _python(ALL_DEVICES, tmp_path / "xla", processes=2)
    assert int(hits) == 0 and len(two) == 2
    for hits, out in two:                        # each process: loaded, and the same bits as one process
        assert int(hits) > 0 and out == one
