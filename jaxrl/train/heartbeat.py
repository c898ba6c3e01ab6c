"""A lost process stops the run in one line, not a collective's C++ abort (multi-process runs).

    hb = Heartbeat.start(timeout_s=20, run_dir="runs/x")    # after jax.distributed.initialize; one thread
    ...                                                     # every process beats every timeout/10 s
    hb.stop()                                               # at the end of the run: "done", not lost
    hb.after_failure()                                      # the run raised: name a lost peer, or exit 1

When one process of a multi-process run dies (kill -9, OOM, a lost host), the others block in their next
collective; Gloo gives up after its own timeout with an `AllGather` error and aborts the process with a C++
stack trace (77 s on this machine), and JAX's coordination service declares the task dead only after its
heartbeat timeout (100 s). Neither says which process died or how to go on.

Here each process runs a daemon thread that writes a counter under `jaxrl/heartbeat/<process>` in the
coordination service's key-value store every `timeout_s / 10` seconds and reads every other process's.
A process whose counter has not moved for `timeout_s` seconds, or a store that no longer answers (the
coordinator, process 0, is gone), ends this process at once (`os._exit(EXIT_CODE)`, from the thread: the
main thread may be blocked inside a collective) after one line on stderr naming the silent process and
the newest committed checkpoint of the run directory, which the same command resumes from. The heartbeat
thread is independent of the main thread's progress, so a long compile or a slow step never trips it.

Under a launcher that stops the others itself when one process dies (Open MPI's mpirun: SIGTERM to every
other rank, SIGKILL one second later; `srun --kill-on-bad-exit`: SIGTERM, SIGKILL after SLURM's KillWait), the
timeout never comes. So a multi-process run also answers SIGTERM in one line (`Heartbeat.on_terminate`,
from a thread woken by the signal's wakeup fd: the main thread may be blocked in a collective, where no
Python signal handler runs): it marks this process as stopping in the store, waits `TERM_GRACE_S` for the
others to mark themselves too, and names the processes that did not (the one that died; the coordinator when
the store is gone), or says every process was stopped at once (a cancelled job, a time limit), with the
newest checkpoint, then exits EXIT_CODE. The launcher's own message (mpirun's "process rank 1 ... exited on
signal 9") is printed beside it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
from jax._src import distributed as jax_distributed

from .checkpoint import MARKER

EXIT_CODE = 75          # EX_TEMPFAIL: the run can be resumed
PREFIX = "jaxrl/heartbeat/"
DONE = "done"
STOPPING = "stopping"   # this process got SIGTERM (on_terminate)
TERM_GRACE_S = 0.4      # Open MPI's mpirun sends SIGKILL 1 s after SIGTERM (odls_base_sigkill_timeout)


EXIT_WATCH_S = 120      # JAX's shutdown barrier waits 300 s for every process (jax.distributed's default)


class ExitWatch:
    """Closed at the end of a multi-process run, after its last collective (`Trainer.close` closes it first):
    if this process has not exited `seconds` later (a close that blocks, a thread that never ends, so
    Python's exit never reaches JAX's shutdown barrier), every thread's stack goes to stderr
    (`faulthandler`), once, and the process goes on. Its peers then fail that barrier after 300 s ("tasks that
    reached the barrier: 1/2"); the stacks say where this one stood. Exiting in time cancels it."""

    def __init__(self, seconds: float = EXIT_WATCH_S):
        self.seconds = seconds

    def close(self) -> None:
        faulthandler.dump_traceback_later(self.seconds, repeat=False, exit=False)


def newest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest step directory of `run_dir/checkpoints` with its COMMITTED marker (None: none yet)."""
    root = Path(run_dir) / "checkpoints"
    steps = [p for p in root.iterdir() if p.name.isdigit() and (p / MARKER).exists()] if root.is_dir() else []
    return max(steps, key=lambda p: int(p.name), default=None)


def _resume_hint(run_dir) -> str:
    ckpt = newest_checkpoint(run_dir)
    return (f"the newest checkpoint is {ckpt.resolve()}: run the same command again to resume from it"
            if ckpt is not None else "no checkpoint was written yet: run the same command again to start over")


def lost_message(process: int, silent_s: float, timeout_s: float, run_dir, *, coordinator: bool = False) -> str:
    """The one line a surviving process prints before it stops."""
    who = f"process {process}" + (" (the coordinator)" if coordinator else "")
    return (f"[train] {who} stopped responding ({silent_s:.0f} s without a heartbeat, timeout {timeout_s:g} s); "
            f"stopping this process; {_resume_hint(run_dir)}")


def terminated_message(lost: list[int], run_dir, *, store_gone: bool = False) -> str:
    """The one line a process stopped by SIGTERM prints: `lost`, the processes that were not stopped with it
    (they had died), or none (every process was stopped at once)."""
    if store_gone:
        why = "process 0 (the coordinator) stopped, and the launcher stopped this one (SIGTERM)"
    elif lost:
        names = ", ".join(str(p) for p in lost)
        why = f"process{'es' if len(lost) > 1 else ''} {names} stopped, and the launcher stopped this one (SIGTERM)"
    else:
        why = "every process of the run was stopped (SIGTERM: the job was cancelled or reached its time limit)"
    return f"[train] {why}; stopping this process; {_resume_hint(run_dir)}"


class Heartbeat:
    def __init__(self, client, process: int, processes: int, *, timeout_s: float, run_dir,
                 exit_fn=os._exit, clock=time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout {timeout_s} must be > 0")
        self.client, self.process, self.processes = client, process, processes
        self.timeout_s, self.run_dir = float(timeout_s), run_dir
        self.exit_fn, self.clock = exit_fn, clock
        self.beats = 0
        self.seen: dict[int, tuple[str | None, float]] = {}      # process -> (last value, when it last changed)
        self._stop = threading.Event()
        self._terminating = threading.Event()     # SIGTERM came: on_terminate has the last word
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, *, timeout_s: float, run_dir) -> Heartbeat | None:
        """The heartbeat of this process of a jax.distributed run (None in a single-process run)."""
        client = jax_distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return None
        hb = cls(client, jax.process_index(), jax.process_count(), timeout_s=timeout_s,
                 run_dir=run_dir)
        hb._thread = threading.Thread(target=hb._loop, name="jaxrl-heartbeat", daemon=True)
        hb._thread.start()
        hb._watch_sigterm()
        return hb

    def _watch_sigterm(self) -> None:
        """SIGTERM -> `on_terminate` on a thread (module docstring). Main thread only (signal.set_wakeup_fd)."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.signal(signal.SIGTERM, lambda *_: None)    # (the Python-level handler: the thread below acts)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def wait():
            while True:
                got = os.read(r, 64)
                if signal.SIGTERM in got:
                    self.on_terminate()
                    return

        threading.Thread(target=wait, name="jaxrl-sigterm", daemon=True).start()

    def on_terminate(self, grace_s: float = TERM_GRACE_S) -> None:
        """The launcher (or the scheduler) stopped this process: one line naming who had died, then exit. (The beat
        stops, so that the mark stays; a failure the dead peer caused here waits for this line: after_failure.)"""
        self._terminating.set()
        store_gone, lost = False, []
        try:
            self.client.key_value_set(f"{PREFIX}{self.process}", STOPPING, allow_overwrite=True)
            time.sleep(grace_s)
            values = {p: self._get(p) for p in range(self.processes) if p != self.process}
            lost = [p for p, v in values.items() if v not in (STOPPING, DONE)]
        except Exception:        # the store is gone: the coordinator (process 0) stopped
            store_gone = True
        print("\n" + terminated_message(lost, self.run_dir, store_gone=store_gone), file=sys.stderr, flush=True)
        if self.process == 0 and not store_gone:      # the store lives in process 0: let the others read it
            time.sleep(grace_s)
        self.exit_fn(EXIT_CODE)

    def check(self) -> str | None:
        """Beat once and look at the others: the line to stop with, or None when every process is alive."""
        now = self.clock()
        if self._terminating.is_set():      # (on_terminate's mark must stay)
            return None
        try:
            self.beats += 1
            self.client.key_value_set(f"{PREFIX}{self.process}", str(self.beats), allow_overwrite=True)
            values = {p: self._get(p) for p in range(self.processes) if p != self.process}
        except Exception:        # the store is gone: the coordinator (process 0) died
            last = self.seen.get(0, (None, now))[1]
            return lost_message(0, now - last, self.timeout_s, self.run_dir, coordinator=True)
        for p, value in values.items():
            if value == DONE:          # that process finished its run: nothing more to hear from it
                continue
            old, since = self.seen.get(p, (None, now))
            if value != old or p not in self.seen:
                self.seen[p] = (value, now)
            elif now - since > self.timeout_s:
                return lost_message(p, now - since, self.timeout_s, self.run_dir, coordinator=p == 0)
        return None

    def _get(self, p: int) -> str | None:
        try:
            return self.client.key_value_try_get(f"{PREFIX}{p}")
        except Exception as e:       # not written yet (NOT_FOUND) is "no beat yet"; anything else propagates
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def _loop(self):
        while not self._stop.wait(self.timeout_s / 10):
            if self._terminating.is_set():
                return
            line = self.check()
            if line is not None and not self._stop.is_set() and not self._terminating.is_set():
                print("\n" + line, file=sys.stderr, flush=True)      # (a progress bar may hold the line)
                self.exit_fn(EXIT_CODE)
                return

    def after_failure(self) -> None:
        """This process's run raised (in a multi-process run). When another process died, the collective that
        raised here was its symptom: wait for the heartbeat to name it (one line, exit EXIT_CODE). When none
        is lost within the timeout the failure is this process's own: its traceback, then exit 1 at once
        (JAX's shutdown barrier would wait for the others until its own heartbeat timeout), and the others
        stop within the timeout, naming this process."""
        deadline = self.clock() + 1.5 * self.timeout_s
        while (self._terminating.is_set() or self._thread is not None and self._thread.is_alive()) \
                and self.clock() < deadline:
            time.sleep(self.timeout_s / 20)
        self._stop.set()
        traceback.print_exc()
        print(f"[train] process {self.process} failed (above); the others stop within {self.timeout_s:g} s",
              file=sys.stderr, flush=True)
        self.exit_fn(1)

    def stop(self, done: bool = True):
        """Stop beating; `done`: the run ended well here, so the others are told this process is done (not
        lost). A process that failed stops silently, and the others stop after the timeout, naming it."""
        self._stop.set()
        if not done:
            return
        try:
            self.client.key_value_set(f"{PREFIX}{self.process}", DONE, allow_overwrite=True)
        except Exception:
            pass
