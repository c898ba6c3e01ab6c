"""The sandbox's supervisor: the process side of `jaxrl.rewards.sandbox` that runs around each program.

`jaxrl.rewards.sandbox.run_tests` starts it as `python -I -S -B sandbox_supervisor.py CONFIG_JSON`, by path,
as the caller's user, in its own session, with the run's directory as cwd. So this file imports only the
standard library (`-I -S` keep `jaxrl` off `sys.path`). CONFIG_JSON: `dir` (the run's directory, holding
`main.py`, `in<k>` per case and the `work` mount point), `timeouts` (one per case), `python` (the
programs' interpreter), `parent` (the caller's pid), `stop_after` (statuses that end the loop) and
`limits` (`dataclasses.asdict(SandboxLimits)`). It prints one JSON line: `isolation` (what applied),
`degraded` (no namespaces) and `results` (per case: `status`, `reason`, `seconds`); each case's output
is in `out<k>` and `err<k>` in the run's directory.

What it does, in order: PR_SET_PDEATHSIG (dies with the caller); opens every case's stdin/stdout/stderr;
unshares mount/net/ipc/uts (+ user as non-root) namespaces and re-mounts everything read-only; forks the
init of a new PID namespace, which runs each case: mount a fresh tmpfs as the working directory, fork
the program (rlimits, drop to the run's uid, no_new_privs, exec), wait up to the case's timeout, SIGKILL
everything in the namespace, unmount, classify the outcome. Where namespaces cannot be created it runs
the same loop itself (fallback: process-group kill, plus a `kill(-1)` sweep as the run's uid when root).
What this isolates, and what it does not, is stated in `jaxrl.rewards.sandbox`.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

ENV_PATH = "/usr/local/bin:/usr/bin:/bin"   # the only PATH the supervisor and the programs see

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
        env = {"PATH": ENV_PATH, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "main.py"], env)
    except BaseException as e:  # noqa: BLE001 - report anything, then exit without running Python cleanup
        os.write(errw, f"{type(e).__name__}: {e}".encode()[:1000])
    os._exit(127)


def _wait(pid: int, timeout: float):
    """(wait status, rusage, timed out): SIGKILL `pid` at the deadline."""
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


def _is_exception_name(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    cls = getattr(builtins, leaf, None)
    return (isinstance(cls, type) and issubclass(cls, BaseException)) or leaf.endswith(("Error", "Exception"))


def exception_line(tail: str) -> str:
    """The line of a stderr tail that says how the program died: the last exception line ("Name: message" or a
    bare "Name", an exception's name), else the last non-empty line. Not simply the last line: the processes
    a program forked write to the same stderr, and a fork bomb's children, killed mid-traceback, leave their
    partial tracebacks after the program's own last line (seen: a tail ending in a child's "File ..." line)."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        name, sep, _ = line.partition(":")
        if (sep or name == line) and name.replace(".", "").replace("_", "").isalnum() and _is_exception_name(name):
            return line
    return lines[-1] if lines else ""


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
    last = exception_line(tail)
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
