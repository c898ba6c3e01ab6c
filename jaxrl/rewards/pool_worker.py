"""The worker side of `jaxrl.rewards.pool.RewardPool`: the item a worker scores, the call itself, the
worker and check process loops, and the parent's handle on a worker process (split out of pool.py)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait as _mp_wait

from . import registry
from .calling import RewardItem, invoke    # (the item lives beside the rules of how its function is called)


def _call(it: RewardItem) -> tuple[float, dict | None]:
    """Run one item's function (`calling.invoke`: as its signature says): (finite score, info or None); raises
    on a bad return value."""
    out = invoke(registry.resolve(it.fn), it)
    info = None
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(f"a reward returns a float or (float, dict), got a {len(out)}-tuple")
        out, info = out
    score = float(out)
    if not math.isfinite(score):
        raise ValueError(f"non-finite score {score}")
    return score, info


# ---------------------------------------------------------------------------------------- worker side
def _exit_with_parent(sentinel) -> None:
    _mp_wait([sentinel])
    os._exit(0)


def _child_setup() -> None:
    """Common start of worker and check processes: no SIGINT, exit with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()


def _error_text(e: BaseException) -> str:
    return registry.one_line(f"{type(e).__name__}: {e}", 500)


def _check_main(conn, names: list[tuple[str, tuple | None]]) -> None:
    """Check process: send (name, problem-or-None) for each (name, its rows' columns) as it is resolved and its
    signature checked, then None."""
    _child_setup()
    for name, columns in names:
        try:
            problem = registry.problem(name, columns)
        except Exception as e:  # e.g. a module-level __getattr__ that raises
            problem = f"reward {name!r}: {_error_text(e)}"
        conn.send((name, problem))
    conn.send(None)


def _worker_main(conn) -> None:
    """Worker loop: recv (id, fn, response, answer, task, extra) -> send (id, "ok", (score, info)) |
    (id, "error", msg)."""
    _child_setup()
    registry.warmup()
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        item_id, *fields = msg
        try:
            conn.send((item_id, "ok", _call(RewardItem(*fields))))
        except Exception as e:
            conn.send((item_id, "error", _error_text(e)))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class _Worker:
    """Parent-side handle: process, pipe, and the item in flight (id, fn) with its start and deadline."""

    def __init__(self, ctx, startup_timeout_s: float):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True, name="reward-worker")
        self.proc.start()
        child_conn.close()
        self.ready = False
        self.item: tuple[int, str] | None = None
        self.timeout_s = 0.0  # the item's timeout
        self.started = 0.0  # when the item was sent
        self.deadline = time.monotonic() + startup_timeout_s  # start-up deadline until ready

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL: works on a worker stuck in C code
        self.proc.join(timeout=5.0)
        self.conn.close()
