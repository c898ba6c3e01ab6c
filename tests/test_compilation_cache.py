"""The persistent compilation cache serves one CPU executable to every device group it runs on
(`jaxrl.runtime.enable_compilation_cache`): compiled once on device 0 (or devices 0-1), then loaded, not
compiled, for each other device (or pair), with bit-identical results placed on the devices of the call.

Run in a fresh process: the cache directory and JAX's cache object are process-wide."""

import subprocess
import sys
import textwrap

from tests.test_train_e2e import ROOT, _env

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_num_cpu_devices", 8)
    from jaxrl.runtime import CompileCounter, enable_compilation_cache
    assert enable_compilation_cache(sys.argv[1]) == sys.argv[1]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    def f(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w) + x
        return x.sum(0)

    rng = np.random.default_rng(0)
    x, w = rng.random((32, 32), np.float32), rng.random((32, 32), np.float32) / 32
    devs = np.array(jax.devices())
    counter = CompileCounter()
    for group in ([0], [3], [7], [0, 1], [2, 3], [7, 4]):
        mesh = Mesh(devs[group], ("tp",))
        xs = jax.device_put(x, NamedSharding(mesh, P()))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
        out = jax.jit(f, out_shardings=NamedSharding(mesh, P()))(xs, ws)   # a new jit: no in-memory reuse
        assert {d.id for d in out.devices()} == set(group), (out.devices(), group)
        shards = [np.asarray(s.data) for s in out.addressable_shards]
        if len(group) == 1 or group == [0, 1]:
            want = shards[0]                                 # the first program of each width compiles
        for s in shards:
            np.testing.assert_array_equal(s, want)
        print(len(group), counter.take()["compile_cache_hits"])
""")


def test_one_cpu_executable_serves_every_device_group(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "xla")], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    hits = [tuple(int(v) for v in line.split()) for line in p.stdout.split("\n") if line.strip()]
    # device 0 and the pair (0, 1) compile; every other device and pair is a cache hit
    assert [(n, h > 0) for n, h in hits] == [(1, False), (1, True), (1, True), (2, False), (2, True), (2, True)], hits
