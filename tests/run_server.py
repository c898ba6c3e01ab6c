"""Train runs for a test worker in long-lived processes: one per device count and XLA optimisation level.

A run with fewer devices than the worker's 8 cannot run in the worker itself (XLA:CPU rounds some reductions
differently with another device count in the process, and the goldens and twins compare bits), so it used to
start a fresh `python -m jaxrl.train` process: the imports, JAX's start-up and the tracing of every program
again, each time (the persistent cache only saves the compilation). A `RunServer` is that fresh process kept
alive: it starts with the run's device count and runs `jaxrl.train.__main__.main(args)` for each request, so
a later run with the same device count reuses the imports and the executables the earlier ones built.

    python -m tests.run_server DEVICES      # a server; started by `RunServer`, not by hand

Protocol: one JSON line per request on the server's stdin (`{"args": [...], "test": the asking test's
PYTEST_CURRENT_TEST}`, which the run's `jaxrl.compile_log` lines name), one JSON line per reply on
the descriptor that was its stdout (`{"code": int, "stdout": str, "stderr": str}`); what the runs print goes
to their own buffers, anything written to the process's descriptors 1 and 2 to the server's log file.
A run that must be a real process (killed with SIGKILL, several processes, an environment of its own) is
not served (tests/train_runs.py decides).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MAPPINGS = 20000        # free the executables well before vm.max_map_count (65530) is near


class RunServer:
    """A served `python -m jaxrl.train` with `devices` fake CPU devices and the environment `env`."""

    def __init__(self, devices: int, env: dict):
        self.devices, self.pending = devices, 0
        self.log = Path(tempfile.mkstemp(prefix=f"run_server_{devices}_", suffix=".log")[1])
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.run_server", str(devices)], cwd=ROOT,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, bufsize=1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_s(self) -> float:
        """CPU seconds the live server has used (all its threads); 0 once closed (then its time is in this
        process's RUSAGE_CHILDREN, where tests/conftest.py's per-test CPU finds it)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime, stime

    def send(self, args: list[str]) -> None:
        """Queue `main(args)`; the server runs its requests one after the other, replying in order."""
        # (the test that asked: a served run's compile log names it, `jaxrl.compile_log`)
        request = {"args": list(args), "test": os.environ.get("PYTEST_CURRENT_TEST")}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.pending += 1

    def receive(self, timeout: float) -> tuple[int, str, str]:
        """The oldest unanswered request's (exit code, stdout, stderr). Raises when the server dies or the
        reply takes longer than `timeout` seconds (the server is then killed: its state is unknown)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            log = self.log.read_text()[-6000:]
            self.close()
            why = f"gave no reply within {timeout} s" if not ready else "died"
            raise AssertionError(f"run server ({self.devices} devices) {why}:\n{log}")
        reply = json.loads(line)
        self.pending -= 1
        return reply["code"], reply["stdout"], reply["stderr"]

    def run(self, args: list[str], timeout: float) -> tuple[int, str, str]:
        self.send(args)
        return self.receive(timeout)

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.log.unlink(missing_ok=True)


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:              # not Linux: no limit to watch
        return 0


def release_executables() -> None:
    """Free this process's compiled executables once they hold too many memory mappings. Each XLA:CPU
    executable holds several (about 30 with 8 devices) and a process may have 65530 (vm.max_map_count); a
    test worker or run server that compiles long enough exceeds that, and LLVM then aborts a compilation."""
    if _mappings() > MAX_MAPPINGS:
        import gc

        import jax

        from jaxrl.rollout import CACHE

        CACHE.clear()
        jax.clear_caches()
        gc.collect()


class _CurrentStderr(io.TextIOBase):
    """The log handler's stream: whatever sys.stderr is when a record is written (each run's own buffer)."""

    def write(self, s):
        return sys.stderr.write(s)

    def flush(self):
        sys.stderr.flush()


def serve(devices: int) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                       # stray writes to descriptor 1 go to the log, not into the replies
    import logging

    import jax

    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(devices)        # as `python -m jaxrl.train` does before its backend starts (its LLVM level)
    assert jax.device_count() == devices, jax.devices()
    # configured once, as main() would on its first call, writing to the current run's buffer
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(_CurrentStderr())])
    from jaxrl.train.__main__ import main

    for line in sys.stdin:
        request = json.loads(line)
        args = request["args"]
        os.environ["PYTEST_CURRENT_TEST"] = request.get("test") or ""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:            # noqa: BLE001 -- reported to the test, as a process's traceback
                traceback.print_exc()
                code = 1
        replies.write(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
        replies.flush()
        release_executables()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
