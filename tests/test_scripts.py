"""scripts/venv.sh and scripts/launch_local.sh from another directory, and TensorBoard's Profile tab."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_SH = ROOT / "scripts" / "venv.sh"
LAUNCH = ROOT / "scripts" / "launch_local.sh"


def _plain_env() -> dict[str, str]:
    """This environment without the project's venv on PATH, as a user's shell would be."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    venv_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != venv_bin)
    return env


def _run(cmd, cwd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_plain_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_venv_sh_keeps_the_callers_directory(tmp_path):
    (tmp_path / "data.txt").write_text("mine")
    code = ("import os, sys, jaxrl; print(os.getcwd()); print(sys.prefix); print(jaxrl.__file__); "
            "print(open('data.txt').read())")
    for script in (VENV_SH, os.path.relpath(VENV_SH, tmp_path)):   # absolute, and ../../x/scripts/venv.sh
        res = _run([script, "python", "-c", code], cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        cwd, prefix, package, data = res.stdout.splitlines()
        assert Path(cwd).resolve() == tmp_path.resolve()
        assert Path(prefix).resolve() == Path(sys.prefix).resolve()
        assert Path(package).resolve().is_relative_to(ROOT)        # the editable install, from anywhere
        assert data == "mine"
    # `python -m` finds the package from any directory, and the command's own PATH is the venv's.
    res = _run([VENV_SH, "python", "-m", "jaxrl.train", "--help"], cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m jaxrl.train"), res.stderr
    res = _run([VENV_SH, "sh", "-c", 'command -v python; echo "$VIRTUAL_ENV"'], cwd=tmp_path)
    python, venv = map(Path, res.stdout.split())
    assert (python.name, python.parent.resolve(), venv.resolve()) == (
        "python", Path(sys.prefix).resolve() / "bin", Path(sys.prefix).resolve())


def test_launch_local_runs_python_from_the_venv(tmp_path):
    code = 'import sys, os; print(sys.prefix, os.environ["JAX_PROCESS_ID"], os.environ["JAX_NUM_PROCESSES"], os.getcwd())'
    res = _run([LAUNCH, 2, "python", "-c", code], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    prefix, cwd = Path(sys.prefix).resolve(), tmp_path.resolve()
    rows = sorted(line.split() for line in res.stdout.splitlines())
    assert [(r[0], Path(r[1]).resolve(), r[2], r[3], Path(r[4]).resolve()) for r in rows] == [
        ("[0]", prefix, "0", "2", cwd), ("[1]", prefix, "1", "2", cwd)]


def test_launch_local_stops_at_the_first_failure(tmp_path):
    """Process 1 fails at once while process 0 would sleep a minute: the launcher kills 0 and exits with
    1's status right away (not after waiting for 0 in order)."""
    code = ('import os, sys, time; i = os.environ["JAX_PROCESS_ID"]; print("up", flush=True); '
            'time.sleep(60) if i == "0" else sys.exit(3)')
    proc = subprocess.Popen([str(LAUNCH), "2", "python", "-c", code], cwd=tmp_path, env=_plain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3, out
    assert time.monotonic() - start < 20, "the sleeping process was not killed"
    assert "[1] up" in out
    assert _run([LAUNCH, "two", "true"], cwd=tmp_path).returncode == 2


def test_tensorboard_has_the_profile_plugin_and_it_reads_a_jax_trace(tmp_path):
    """The Profile tab's plugin is installed (`xprof`, registered as TensorBoard plugin "profile") and its
    converter reads a trace written by this JAX, laid out as `--profile-steps` writes it (RUN_DIR/tb)."""
    from importlib.metadata import entry_points

    import jax
    import jax.numpy as jnp
    from tensorboard import default

    (ep,) = [ep for ep in entry_points(group="tensorboard_plugins") if ep.name == "profile"]
    assert ep.load() in default.get_dynamic_plugins()

    f = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((16, 16))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "tb")):
        f(x).block_until_ready()
    xplanes = list((tmp_path / "tb" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(xplanes) == 1

    from xprof.convert import raw_to_tool_data

    tools = raw_to_tool_data.xspace_to_tool_names([str(xplanes[0])])
    assert "overview_page" in tools and any(t.startswith("trace_viewer") for t in tools), tools
