"""jaxrl.runtime's per-cache-key compile lock: processes that miss the persistent cache on the same program at
the same moment compile it once (the others wait and load it); a lock whose holder died is broken."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxrl import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each process waits for the start file, then compiles the same program (an unrolled chain, ~3 s to compile
# here, so both are inside the compilation at once) and reports JAX's compile and cache-hit events.
CHILD = r'''
import json, os, sys, time
import jax, jax.numpy as jnp
from jaxrl.runtime import CompileCounter, enable_compilation_cache
enable_compilation_cache(sys.argv[1])
counter = CompileCounter()
def chain(x):
    for i in range(100):
        x = jnp.tanh(x @ x.T + i)
    return x
x = jnp.ones((16, 16)).block_until_ready()
counter.take()                                  # (only the chain's compilation counts)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.005)
jax.jit(chain)(x).block_until_ready()
print(json.dumps(counter.take()))
'''


def _compile_twice(tmp_path, lock: str) -> list[dict]:
    cache, start = tmp_path / f"cache_{lock}", tmp_path / f"start_{lock}"
    env = {**os.environ, "JAXRL_COMPILE_LOCK": lock, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache), str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        time.sleep(3)                      # both imported JAX and are waiting
        start.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_two_processes_compile_a_program_once(tmp_path):
    """With the lock, one process compiles and the other loads its executable from the cache; without it
    (JAXRL_COMPILE_LOCK=0, the twin that shows the test can fail) both compile."""
    locked, unlocked = _compile_twice(tmp_path, "1"), _compile_twice(tmp_path, "0")
    assert sorted(r["compile_cache_hits"] for r in locked) == [0, 1], locked
    assert [r["compile_cache_hits"] for r in unlocked] == [0, 0], unlocked


def test_a_dead_holders_lock_is_broken(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    lock = tmp_path / "key"
    lock.write_text(f"{socket.gethostname()} {dead}")
    t = time.monotonic()
    runtime._wait_for(lock, time.monotonic() + 60)
    assert not lock.exists() and time.monotonic() - t < 5


def test_a_live_holders_lock_is_waited_for(tmp_path):
    lock = tmp_path / "key"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")          # held by this (live) process
    t = time.monotonic()
    runtime._wait_for(lock, time.monotonic() + 0.3)
    assert lock.exists() and time.monotonic() - t == pytest.approx(0.3, abs=0.2)
