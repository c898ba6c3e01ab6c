"""A process of a multi-process run killed with -9: the other one stops within the heartbeat timeout with one
line naming the dead process and the checkpoint to resume from (not a Gloo abort after 77 s), and the same
command resumes from that checkpoint to the uninterrupted run's result (`jaxrl/train/heartbeat.py`)."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl.train.heartbeat import DONE, EXIT_CODE, Heartbeat, lost_message
from tests.train_runs import ROOT, TINY, _env, _metrics, _params


class FakeStore:
    """The coordination service's key-value store as the heartbeat uses it; `gone` = the coordinator died."""

    def __init__(self):
        self.kv, self.gone = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.gone:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if self.gone:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key} not found")
        return self.kv[key]


def test_a_process_stuck_after_its_run_prints_every_thread_stack():
    """heartbeat.ExitWatch (Trainer.close closes it first in multi-process runs): a process still alive
    `seconds` after it writes each thread's stack (here: a non-daemon thread that never ends, the main
    thread joining it at exit) and goes on; one that exits in time writes nothing."""
    stuck = ("import threading, time; from jaxrl.train.heartbeat import ExitWatch; ExitWatch(0.5).close(); "
             "threading.Thread(target=lambda: time.sleep(3), name='never-ends').start()")
    r = subprocess.run([sys.executable, "-c", stuck], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Timeout (0:00:00.500000)!" in r.stderr and "Thread 0x" in r.stderr, r.stderr
    assert "<lambda>" in r.stderr                       # the stuck thread's own frame
    # (10 s: a process that imports JAX takes over 0.5 s to finalise when the other worker loads the cores)
    prompt = "from jaxrl.train.heartbeat import ExitWatch; ExitWatch(10).close()"
    r = subprocess.run([sys.executable, "-c", prompt], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_silent_process_is_named_after_the_timeout(tmp_path):
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "2" / "COMMITTED").write_text("")
    (tmp_path / "checkpoints" / "3").mkdir()                 # being written: no marker, not resumable
    store, now = FakeStore(), [0.0]
    a = Heartbeat(store, 0, 3, timeout_s=10, run_dir=tmp_path, clock=lambda: now[0])
    b = Heartbeat(store, 1, 3, timeout_s=10, run_dir=tmp_path, clock=lambda: now[0])
    c = Heartbeat(store, 2, 3, timeout_s=10, run_dir=tmp_path, clock=lambda: now[0])
    for t in range(0, 30, 2):            # all three beat: nobody is lost, whatever the wall time
        now[0] = t
        assert a.check() is None and b.check() is None and c.check() is None
    for t in range(30, 41, 2):           # process 2 falls silent (process 0 last saw it move at 30)
        now[0] = t
        assert a.check() is None and b.check() is None
    now[0] = 42
    line = a.check()
    assert line == lost_message(2, 12, 10, tmp_path)
    assert "process 2 stopped responding (12 s without a heartbeat, timeout 10 s)" in line
    assert str((tmp_path / "checkpoints" / "2").resolve()) in line and "resume" in line
    c.stop(done=True)                    # a process that finished its run is not lost
    assert store.kv["jaxrl/heartbeat/2"] == DONE
    now[0] = 100
    assert b.check() is None and a.check() is None
    b.stop(done=False)                   # one that failed just falls silent
    now[0] = 111
    assert "process 1 stopped" in a.check()
    store.gone = True                    # the coordinator's store is gone: process 0 died
    assert "process 0 (the coordinator) stopped responding" in b.check()
    assert "no checkpoint was written yet" in lost_message(1, 1, 1, tmp_path / "elsewhere")


def _procs(run_dir, args, port):
    env = {**_env(), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", *TINY, *args]
    return [subprocess.Popen(cmd, cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.processes
def test_kill_9_in_a_two_process_run_stops_the_other_and_resumes(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["steps=4", "save_every=1", "export_hf=true", "train_layout.fsdp=4", "engine.instances=2",
            "optim.eps=1e-3", "warm_start.optim.eps=1e-3", "distributed.heartbeat_timeout=10"]
    whole = _procs(full, args, _port())
    victim = _procs(killed, args, _port())
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2" / "COMMITTED").exists():
        assert all(p.poll() is None for p in victim) and time.time() < deadline, "ended or stalled before step 2"
        time.sleep(0.2)
    victim[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    out = victim[0].communicate(timeout=120)[0]
    waited = time.time() - t0
    victim[1].wait()
    assert victim[0].returncode == EXIT_CODE, out[-3000:]
    assert waited < 10 + 15, waited           # the timeout, plus a heartbeat period and the process's exit
    lines = [x for x in out.splitlines() if "stopped responding" in x]
    assert len(lines) == 1 and "process 1 stopped responding" in lines[0], out[-3000:]
    assert "Traceback" not in out and "Gloo" not in out.split(lines[0])[-1]
    newest = max(int(p.name) for p in (killed / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert str((killed / "checkpoints" / str(newest)).resolve()) in lines[0]
    for p in whole:
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0, log[-3000:]
    again = _procs(killed, args, _port())         # the same command: resumes from that checkpoint
    logs = [p.communicate(timeout=600)[0] for p in again]
    assert all(p.returncode == 0 for p in again), logs[0][-3000:] + logs[1][-3000:]
    assert "resumed" in logs[0]
    assert [r["reward_mean"] for r in _metrics(full)] == [r["reward_mean"] for r in _metrics(killed)]
    for a, b in zip(_params(full), _params(killed)):
        np.testing.assert_array_equal(a, b)          # the same processes, the same packing: bit for bit
    assert not os.path.exists(killed / "checkpoints" / f"{newest}.corrupt")
