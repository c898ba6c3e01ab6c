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
starts a supervisor (`python -I -S` on this file, stdlib only, its own session). The supervisor
unshares the namespaces, forks the namespace init, which runs each test case: mount a fresh tmpfs, fork
the program (rlimits, drop to the uid, exec), wait up to the case's timeout, kill everything, unmount.
The supervisor opens every case's stdin/stdout/stderr file before the filesystem turns read-only
(the program cannot touch the run's directory) and prints the per-case verdicts as JSON; the caller
reads them and the output files, then removes the directory. The supervisor and
the program both carry PR_SET_PDEATHSIG=SIGKILL, so killing the caller (e.g. a reward worker killed by
the pool on timeout or cancel) takes the whole tree down; the caller also kills the supervisor's
session if it outlives every case's timeout plus `grace_s`. Directories left by a killed caller are
removed by the next run in any process (their creator's pid is in the name).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import signal
import sys
import time

STATUSES = ("ok", "timeout", "killed", "error")
ISOLATIONS = ("auto", "namespaces", "none")
_PREFIX = "jaxrl-sandbox-"
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"


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
    import shutil
    import subprocess
    import tempfile

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
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=d, env={"PATH": _ENV_PATH, "LANG": "C.UTF-8"}, start_new_session=True)
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
    import stat

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
    import shutil
    import tempfile

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
    import logging

    logging.getLogger(__name__).warning("code sandbox without namespaces: %s (see jaxrl.rewards.sandbox)", isolation)


# ===================================================================================== supervisor side
# Everything below runs in the supervisor (`python -I -S sandbox.py CONFIG`), as the caller's user.
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 2, 1, 38, 36
# statvfs f_flag bit -> mount flag to keep when re-mounting read-only (locked flags in a user namespace)
_KEEP_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src, target, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_c().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _prctl(option: int, value: int) -> None:
    _check(_c().prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    unescape = lambda p: p.encode().decode("unicode_escape").encode("latin-1").decode()  # noqa: E731 (\040)
    return list(dict.fromkeys(unescape(p) for p in points))


def _read_only_everything() -> list[str]:
    """Re-mount every mount point of this (new, private) mount namespace read-only; the failures. (The
    supervisor opened every file it writes before this: the run's directory is read-only too.)"""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    failed = []
    for mp in _mount_points():
        try:
            vfs = os.statvfs(mp).f_flag
            flags = sum(ms for st, ms in _KEEP_FLAGS.items() if vfs & st)
            _mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            failed.append(mp)
    return failed


def _unshare(root: bool) -> str:
    """Enter new mount/net/ipc/uts namespaces (and user, as non-root); children get a new PID namespace."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    uid, gid = os.getuid(), os.getgid()
    if not root:
        flags |= CLONE_NEWUSER
    _check(_c().unshare(flags), "unshare")
    if not root:   # map our own ids to themselves: unprivileged inside, RLIMIT_NPROC counted per namespace
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    failed = _read_only_everything()
    return "" if not failed else f"; not read-only: {', '.join(failed[:5])}"


def _program_child(cfg: dict, k: int, work: str, uid: int, gid: int, root: bool, errw: int, fds) -> None:
    """In the forked child: limits, fds, identity, exec the program. Never returns."""
    import resource

    try:
        lim, t = cfg["limits"], cfg["timeouts"][k]
        if os.getpid() != 1 and cfg["mode"] == "fallback":
            os.setsid()   # own process group (the fallback kills it)
        for target, fd in enumerate(fds):   # this case's stdin, stdout, stderr (opened by the supervisor)
            os.dup2(fd, target)
        cpu = lim["cpu_seconds"] or int(t) + 2
        for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, lim["memory_bytes"]),
                           (resource.RLIMIT_FSIZE, lim["file_bytes"]), (resource.RLIMIT_NOFILE, lim["open_files"]),
                           (resource.RLIMIT_NPROC, lim["max_processes"]), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
        if root:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # after the uid change, which clears it
        os.chdir(work)
        env = {"PATH": _ENV_PATH, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "main.py"], env)
    except BaseException as e:  # noqa: BLE001 - report anything, then exit without running Python cleanup
        os.write(errw, f"{type(e).__name__}: {e}".encode()[:1000])
    os._exit(127)


def _wait(pid: int, timeout: float):
    """(wait status, rusage, timed out): SIGKILL `pid` at the deadline."""
    import select

    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except OSError:   # kernel < 5.3: poll
        fd = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if fd is not None:
                if select.select([fd], [], [], left)[0]:
                    break
            else:
                got, status, ru = os.wait4(pid, os.WNOHANG)
                if got:
                    return status, ru, False
                time.sleep(min(0.005, left))
    finally:
        if fd is not None:
            os.close(fd)
    timed_out = time.monotonic() >= deadline
    if timed_out:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status, ru = os.wait4(pid, 0)
    return status, ru, timed_out


def _kill_rest(cfg: dict, pid: int, uid: int, root: bool) -> None:
    """After a case: nothing the program started may survive."""
    if cfg["mode"] == "namespaces" and os.getpid() == 1:   # init of the run's PID namespace: kill all
        # in it, then reap until none is left (orphans are re-parented to us)
        try:
            os.kill(-1, signal.SIGKILL)   # inside the PID namespace only (we are its pid 1)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if root:   # fallback as root: kill(-1) *as the run's uid* reaches exactly its processes
        for _ in range(100):
            child = os.fork()
            if child == 0:
                code = 0
                try:
                    os.setresuid(uid, uid, uid)
                    os.kill(-1, signal.SIGKILL)
                    code = 1   # something was killed: sweep again
                except ProcessLookupError:
                    pass
                finally:
                    os._exit(code)
            if os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0:
                break
    end = time.monotonic() + 0.5   # reap what the kills left (we are a child subreaper)
    while time.monotonic() < end:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            return


def _classify(cfg: dict, k: int, status: int, cpu_used: float, timed_out: bool, exec_error: str,
              fds) -> tuple[str, str]:
    lim = cfg["limits"]
    cpu_limit = lim["cpu_seconds"] or int(cfg["timeouts"][k]) + 2
    _, out, err = fds
    err_size = os.fstat(err).st_size
    big = max(os.fstat(out).st_size, err_size) >= lim["file_bytes"]
    if exec_error:
        os.write(err, f"sandbox: could not start the program: {exec_error}\n".encode())
        return "error", "sandbox_exec"
    if timed_out:
        return "timeout", "wall_time"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_limit - 0.05):
            return "killed", "cpu_time"
        if sig == signal.SIGXFSZ or big:
            return "killed", "output_size"
        return "killed", f"signal {name}"
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return "ok", ""
    if big:
        return "killed", "output_size"
    tail = os.pread(err, 2048, max(0, err_size - 2048)).decode("utf-8", "replace")
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    exc = last.split(":", 1)[0].strip()
    if exc == "MemoryError":
        return "killed", "memory"
    if "File too large" in last or "[Errno 27]" in last:
        return "killed", "output_size"
    if "[Errno 30]" in last or "Read-only file system" in last:
        return "error", "read_only_fs"
    if "[Errno 101]" in last or "Network is unreachable" in last:
        return "error", "no_network"
    if "Resource temporarily unavailable" in last and ("fork" in tail or "Thread" in tail or exc == "BlockingIOError"):
        return "killed", "processes"
    import builtins

    if isinstance(getattr(builtins, exc, None), type) and issubclass(getattr(builtins, exc), BaseException):
        return "error", exc
    return "error", f"exit {code}"


def _run_cases(cfg: dict, root: bool, uid: int, gid: int, files, emit) -> None:
    """The case loop (the namespace's init, or the supervisor in fallback mode); `emit(result)` per case."""
    ns = cfg["mode"] == "namespaces"
    lim = cfg["limits"]
    if ns:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass   # the read-only host /proc stays visible
    with open(os.path.join(cfg["dir"], "main.py"), encoding="utf-8") as f:
        source = f.read()
    for k, timeout in enumerate(cfg["timeouts"]):
        work = os.path.join(cfg["dir"], "work" if ns else f"work{k}")   # "work": made by the caller
        if ns:
            _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={lim['disk_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={gid}")
        else:
            os.mkdir(work, 0o700)
            if root:
                os.chown(work, uid, gid)
        prog = os.path.join(work, "main.py")
        with open(prog, "w", encoding="utf-8") as f:
            f.write(source)
        os.chmod(prog, 0o444)
        errr, errw = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(errr)
            _program_child(cfg, k, work, uid, gid, root, errw, files[k])
        os.close(errw)
        with os.fdopen(errr, "rb") as f:   # closes empty on a successful exec (close-on-exec)
            exec_error = f.read().decode("utf-8", "replace")
        status, ru, timed_out = _wait(pid, timeout)
        seconds = min(time.monotonic() - t0, timeout) if timed_out else time.monotonic() - t0
        _kill_rest(cfg, pid, uid, root)
        if ns:
            _c().umount2(work.encode(), MNT_DETACH)
        verdict, reason = _classify(cfg, k, status, ru.ru_utime + ru.ru_stime, timed_out, exec_error, files[k])
        emit(dict(status=verdict, reason=reason, seconds=round(seconds, 6)))
        if verdict in cfg["stop_after"]:
            break


def _open_case_files(cfg: dict) -> list[tuple[int, int, int]]:
    """(stdin, stdout, stderr) descriptors of every case, opened before the filesystem turns read-only
    (and so before the program could touch the run's directory). Close-on-exec: the program of case k
    gets only its own three, as 0, 1, 2."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    files = []
    for k in range(len(cfg["timeouts"])):
        path = lambda name: os.path.join(cfg["dir"], f"{name}{k}")  # noqa: E731
        rw = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        files.append((os.open(path("in"), os.O_RDONLY), os.open(path("out"), rw, 0o600),
                      os.open(path("err"), rw, 0o600)))
    return files


def _supervise(cfg: dict) -> dict:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["parent"]:   # the caller died before the line above
        os._exit(1)
    root = os.geteuid() == 0
    uid, gid = ((cfg["limits"]["uid_base"] + os.getpid(),) * 2) if root else (os.getuid(), os.getgid())
    who = f"uid {uid}" if root else f"own uid {uid} (not root)"
    files = _open_case_files(cfg)
    mode, why = "fallback", ""
    if cfg["limits"]["isolation"] != "none":
        try:
            note = _unshare(root)
            mode = "namespaces"
        except OSError as e:
            if cfg["limits"]["isolation"] == "namespaces":
                raise
            why = f"{e.strerror or e}"
    else:
        why = "isolation=none"
    cfg["mode"] = mode
    results: list[dict] = []
    if mode == "fallback":
        _prctl(PR_SET_CHILD_SUBREAPER, 1)   # orphans of the program come back to us, to be reaped
        kill = "process group + kill sweep as the run's uid" if root else "process group only"
        _run_cases(cfg, root, uid, gid, files, results.append)
        return dict(isolation=f"no namespaces ({why}): rlimits, {who}, {kill}; network and /tmp reachable",
                    degraded=True, results=results)
    r, w = os.pipe()
    pid = os.fork()   # pid 1 of the new PID namespace
    if pid == 0:
        code = 0
        try:
            os.close(r)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            emit = lambda res: os.write(w, (json.dumps(res) + "\n").encode())  # noqa: E731
            _run_cases(cfg, root, uid, gid, files, emit)
        except BaseException as e:  # noqa: BLE001
            sys.stderr.write(f"sandbox init: {type(e).__name__}: {e}\n")
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:   # EOF when the init exits (the programs never hold it: close-on-exec)
        results = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    _, status = os.waitpid(pid, 0)   # the caller's backstop kills us (and so the namespace) if this hangs
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"sandbox init failed ({os.waitstatus_to_exitcode(status)})")
    return dict(isolation=f"pid+net+mount+ipc namespaces, {who}{note}", degraded=False, results=results)


if __name__ == "__main__":
    print(json.dumps(_supervise(json.loads(sys.argv[1]))), flush=True)
