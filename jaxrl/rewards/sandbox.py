"""Run untrusted Python programs: namespaces, a throwaway uid, rlimits, a fresh directory, hard kills.

    from jaxrl.rewards.sandbox import SandboxLimits, run_program, run_tests
    r = run_program("print(input()[::-1])", stdin="abc\\n", timeout_s=2.0)
    r.status, r.stdout, r.seconds, r.reason          # "ok", "cba\\n", 0.04, ""
    rs = run_tests(source, [("1\\n", 2.0), ("2\\n", 2.0)])   # one supervisor, one run per test case

Every run ends with one `status`: `"ok"` (exit code 0), `"timeout"` (killed at its wall-clock limit),
`"killed"` (a limit ended it; `reason` says which: `cpu_time`, `memory`, `output_size`, `processes`,
`signal SIGSEGV`, ...) or `"error"` (it failed by itself: `reason` is the exception name, e.g.
`SyntaxError`, or `exit 3`; `sandbox_exec`/`sandbox` when the sandbox could not start it). `seconds` is
the program's wall time from fork to exit (interpreter start-up included); `stdout`/`stderr` are capped.

**Isolated** (the default, `isolation="auto"`, when the kernel lets this process create namespaces:
root with CAP_SYS_ADMIN, or any user with unprivileged user namespaces):

* processes: a PID namespace per program. The program's supervisor is the namespace's init; after each
  test case it SIGKILLs every process in the namespace and reaps them, and when the supervisor dies the
  kernel kills the whole namespace. `setsid`, double forks and daemonising cannot escape (a process
  group can be left with `setsid`; a PID namespace cannot). `/proc` shows only the namespace.
* user: each run gets its own unprivileged uid/gid (`uid_base` + the supervisor's pid; as a non-root
  user, the caller's own uid inside a new user namespace), no supplementary groups, `no_new_privs`
  (setuid binaries do not elevate). So `RLIMIT_NPROC` binds (it never binds root), counts only this
  run's processes, and the program cannot signal anything outside.
* network: a network namespace with only a loopback that is down: no network, not even localhost.
* filesystem writes: a mount namespace in which every mount is re-mounted read-only; the only writable
  place is the working directory, a fresh tmpfs of `disk_bytes` per test case, gone afterwards.
  System V IPC and POSIX message queues: an IPC namespace; hostname: a UTS namespace.
* resources: wall-clock timeout per run; rlimits `RLIMIT_CPU`, `RLIMIT_AS` (`memory_bytes`),
  `RLIMIT_FSIZE` (`file_bytes`, which caps stdout and stderr too: they are files), `RLIMIT_NPROC`,
  `RLIMIT_NOFILE`, no core dumps.
* environment: scrubbed (PATH, HOME, TMPDIR, LANG only); `python -I -S -B`: no site-packages, no
  PYTHON* variables, no user site, no bytecode writes.

**Not isolated**: filesystem *reads* (no chroot: the program can read every world-readable file —
the code, /etc, world-readable data or weights, the names of other runs' directories in /tmp); /sys and
/dev are visible read-only; memory and CPU are per-process rlimits, not a cgroup (N processes may use
N × `memory_bytes`, and programs compete with the trainer for CPU); no seccomp filter (a kernel exploit
escapes); timing side channels.

**Fallback** (`isolation="auto"` where namespaces cannot be created, or `isolation="none"`): rlimits,
the throwaway uid when running as root, a fresh directory, and after each run a kill of the process
group plus, as root, a `kill(-1)` sweep executed *as the run's uid* (which also catches `setsid`
escapes). The network is reachable and world-writable directories (/tmp, /dev/shm) are writable. As a
non-root user without user namespaces only the process group is killed (a `setsid` escape survives).
Each result's `isolation` says which applied, and the first degraded run logs a warning with the reason.
`isolation="namespaces"` refuses to run without them.

Design: the caller writes the program and each test case's stdin into a fresh root-only directory and
starts a supervisor (`python -I -S` on `sandbox_supervisor.py`, stdlib only, its own session). The supervisor
unshares the namespaces, forks the namespace init, which runs each test case: mount a fresh tmpfs, fork
the program (rlimits, drop to the uid, exec), wait up to the case's timeout, kill everything, unmount.
The supervisor opens every case's stdin/stdout/stderr file before the filesystem turns read-only
(the program cannot touch the run's directory) and prints the per-case verdicts as JSON; the caller
reads them and the output files, then removes the directory. The supervisor and
the program both carry PR_SET_PDEATHSIG=SIGKILL, so killing the caller (e.g. a reward worker killed by
the pool on timeout or cancel) takes the whole tree down; the caller also kills the supervisor's
session if it outlives every case's timeout plus `grace_s`. Directories left by a killed caller are
removed by the next run in any process (their creator's pid is in the name).
This module is the caller's side; `jaxrl.rewards.sandbox_supervisor` holds the supervisor, the
namespace's init and the program's child (rlimits, uid drop, exec, kill sweep, verdicts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

from . import sandbox_supervisor

STATUSES = ("ok", "timeout", "killed", "error")
ISOLATIONS = ("auto", "namespaces", "none")
_PREFIX = "jaxrl-sandbox-"
_SUPERVISOR = os.path.abspath(sandbox_supervisor.__file__)   # run by path: stdlib only


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Every limit of a run (config: `rewards.sandbox`, `jaxrl.config.rewards.SandboxSection`)."""

    memory_bytes: int = 1 << 30          # RLIMIT_AS per process
    cpu_seconds: int | None = None       # RLIMIT_CPU per process; None = int(the run's timeout) + 2
    file_bytes: int = 1 << 20            # RLIMIT_FSIZE: largest file, stdout and stderr included
    max_processes: int = 16              # RLIMIT_NPROC: processes + threads of the run's uid
    open_files: int = 64                 # RLIMIT_NOFILE
    disk_bytes: int = 64 << 20           # size of the working directory's tmpfs (namespaces only)
    grace_s: float = 5.0                 # supervisor start-up/teardown allowance before it is killed too
    isolation: str = "auto"              # auto | namespaces (required) | none (rlimits + kill sweep only)
    uid_base: int = 1 << 30              # as root, each run's uid/gid = uid_base + supervisor pid
    python: str | None = None            # interpreter of the programs; None = this one, if others may run it

    def __post_init__(self):
        for name in ("memory_bytes", "file_bytes", "max_processes", "open_files", "disk_bytes", "uid_base"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r} must be a positive int")
        if self.uid_base + (1 << 22) >= (1 << 32) - 1:
            raise ValueError(f"SandboxLimits.uid_base={self.uid_base} leaves no room for uid_base + pid below 2**32")
        if self.cpu_seconds is not None and (not isinstance(self.cpu_seconds, int) or self.cpu_seconds < 1):
            raise ValueError(f"SandboxLimits.cpu_seconds={self.cpu_seconds!r} must be None or an int >= 1")
        if not self.grace_s > 0:
            raise ValueError(f"SandboxLimits.grace_s={self.grace_s!r} must be > 0")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"SandboxLimits.isolation={self.isolation!r}; valid: {', '.join(ISOLATIONS)}")

    @classmethod
    def from_config(cls, section) -> SandboxLimits:
        """The limits a `jaxrl.config.rewards.SandboxSection` describes (MiB, KiB -> bytes)."""
        return cls(memory_bytes=section.memory_mb << 20, cpu_seconds=section.cpu_s,
                   file_bytes=section.file_kb << 10, max_processes=section.max_processes,
                   open_files=section.open_files, disk_bytes=section.disk_mb << 20, grace_s=float(section.grace_s),
                   isolation=section.isolation, uid_base=section.uid_base, python=section.python)


@dataclasses.dataclass(frozen=True)
class ProgramResult:
    """One run: `status` (STATUSES), `stdout`, `stderr` (decoded, capped), `seconds`, `reason`
    ("" when ok), `isolation` (what applied, e.g. "pid+net+mount+ipc namespaces, uid 1073762918")."""

    status: str
    stdout: str
    stderr: str
    seconds: float
    reason: str
    isolation: str = ""

    def __repr__(self) -> str:
        return (f"ProgramResult(status={self.status!r}, reason={self.reason!r}, seconds={self.seconds:.3f}, "
                f"stdout={self.stdout[:60]!r}, stderr={self.stderr[-120:]!r})")


def run_program(source: str, stdin: str = "", timeout_s: float = 2.0, *,
                limits: SandboxLimits = SandboxLimits()) -> ProgramResult:
    """Run the Python program `source` with `stdin`, killed after `timeout_s` seconds of wall time."""
    return run_tests(source, [(stdin, timeout_s)], limits=limits, stop_after=())[0]


def run_tests(source: str, cases, *, limits: SandboxLimits = SandboxLimits(),
              stop_after: tuple[str, ...] = ("timeout", "killed")) -> list[ProgramResult]:
    """Run `source` once per `(stdin, timeout_s)` case, each in a fresh directory with its own timeout,
    under one supervisor. Stops after the first case whose status is in `stop_after` (a program that
    hangs or blows a limit on one input is not run on the rest): the result list is then shorter."""
    cases = [(str(stdin), float(t)) for stdin, t in cases]
    if not cases:
        raise ValueError("run_tests needs at least one (stdin, timeout_s) case")
    if any(not t > 0 for _, t in cases):
        raise ValueError(f"every timeout must be > 0, got {[t for _, t in cases]}")
    _sweep_stale_dirs()
    python = limits.python or _default_python()
    d = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
    try:
        os.chmod(d, 0o711)   # others may traverse (to reach the working directory), not list
        _write(os.path.join(d, "main.py"), source)
        for k, (stdin, _) in enumerate(cases):
            _write(os.path.join(d, f"in{k}"), stdin)
        os.mkdir(os.path.join(d, "work"), 0o700)   # the tmpfs mount point (before the fs turns read-only)
        cfg = dict(dir=d, timeouts=[t for _, t in cases], python=python, parent=os.getpid(),
                   stop_after=list(stop_after), limits=dataclasses.asdict(limits))
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", _SUPERVISOR, json.dumps(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=d, env={"PATH": sandbox_supervisor.ENV_PATH, "LANG": "C.UTF-8"},
                                start_new_session=True)
        backstop = sum(t for _, t in cases) + limits.grace_s + 0.5 * len(cases)
        try:
            out, err = proc.communicate(timeout=backstop)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # its session: the supervisor and the namespace's init
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        info = _parse_json(out) or {}
        isolation = info.get("isolation", "")
        if info.get("degraded"):
            _warn_degraded(isolation)
        results = []
        for k, res in enumerate(info.get("results", [])):
            results.append(ProgramResult(res["status"], _read(os.path.join(d, f"out{k}"), limits.file_bytes),
                                         _read(os.path.join(d, f"err{k}"), limits.file_bytes),
                                         float(res["seconds"]), res["reason"], isolation))
        if not results or (len(results) < len(cases) and results[-1].status not in stop_after):
            # the supervisor died or hung before finishing: report it on the first case it did not finish
            why = err.decode("utf-8", "replace").strip()[-400:] or f"supervisor exit code {proc.returncode}"
            status, reason = ("timeout", "supervisor_timeout") if proc.returncode == -signal.SIGKILL \
                else ("error", "sandbox")
            results.append(ProgramResult(status, "", why, backstop if status == "timeout" else 0.0, reason,
                                         isolation))
        return results
    finally:
        shutil.rmtree(d, ignore_errors=True)


def isolation_report(limits: SandboxLimits = SandboxLimits()) -> str:
    """What a run gets on this machine (one trivial run): e.g. "pid+net+mount+ipc namespaces, uid ..."."""
    return run_program("pass", limits=limits).isolation


# ------------------------------------------------------------------------------------- caller helpers
def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _read(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _parse_json(data: bytes):
    try:
        return json.loads(data.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _world_usable(path: str) -> bool:
    """Every directory on the way to `path` is searchable, and the file executable, by 'others'."""
    real = os.path.realpath(path)
    try:
        parts = real.split(os.sep)
        for i in range(2, len(parts)):
            if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
                return False
        return bool(os.stat(real).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@functools.cache
def _default_python() -> str:
    """This interpreter if an unprivileged uid can run it, else a system one of the same version."""
    v = f"{sys.version_info[0]}.{sys.version_info[1]}"
    names = [sys.executable] if os.geteuid() != 0 else \
        [sys.executable, f"/usr/bin/python{v}", f"/usr/local/bin/python{v}", "/usr/bin/python3",
         "/usr/local/bin/python3"]
    found = next((n for n in names if os.path.exists(n) and (os.geteuid() != 0 or _world_usable(n))), None)
    if found is None:
        raise RuntimeError(f"no Python interpreter that an unprivileged uid may execute (tried {names}); "
                           "set rewards.sandbox.python (SandboxLimits.python)")
    return os.path.realpath(found)


@functools.cache
def _sweep_stale_dirs() -> None:
    """Once per process: remove run directories whose creating process is gone (it was killed)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


@functools.cache
def _warn_degraded(isolation: str) -> None:
    logging.getLogger(__name__).warning("code sandbox without namespaces: %s (see jaxrl.rewards.sandbox)", isolation)
