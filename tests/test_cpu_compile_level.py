"""jaxrl.runtime.cpu_compile_level: a process whose only backend is the CPU compiles at LLVM level 1 unless
XLA_FLAGS sets a level; a process that may start a GPU/TPU backend, or whose backend has started, is left alone.
(That the level changes no rollout and no loss beyond float32 rounding: the quickstart goldens,
tests/test_train_e2e.py, run at it.)"""

import json
import os
import subprocess
import sys

from jaxrl import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process: the level its compilations get after `request_cpu_devices` (every entry point calls it
# before JAX's backend starts), and what XLA_FLAGS then holds.
CHILD = r'''
import json, os
from jaxrl.runtime import request_cpu_devices
request_cpu_devices(2)
from jax._src.lib import xla_client
import jax
level = xla_client.CompileOptions().executable_build_options.debug_options.xla_backend_optimization_level
devices = jax.device_count() if os.environ.get("JAX_PLATFORMS") == "cpu" else None    # (no GPU is started here)
print(json.dumps({"level": level, "flags": os.environ.get("XLA_FLAGS", ""), "devices": devices}))
'''


def _child(path=ROOT, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    full.update(env, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_process_compiles_at_level_1_and_keeps_its_other_flags():
    got = _child(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_use_fusion_emitters=false")
    assert got == {"level": 1, "devices": 2,
                   "flags": "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"}


def test_a_level_in_xla_flags_wins():
    got = _child(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=3")
    assert got["level"] == 3 and got["flags"] == "--xla_backend_optimization_level=3"


def test_no_change_where_a_gpu_may_start():
    """JAX_PLATFORMS naming a GPU: the flag would also lower the GPU kernels' LLVM level (no GPU is started)."""
    got = _child(JAX_PLATFORMS="cuda,cpu", XLA_FLAGS="")
    assert got == {"level": 3, "flags": "", "devices": None}


def test_platforms_unset_level_1_unless_a_plugin_is_installed(tmp_path):
    """No JAX_PLATFORMS: level 1 in this environment (no GPU/TPU plugin); with a `jax_plugins` package on the
    path (what a GPU plugin installs), left alone."""
    assert _child(XLA_FLAGS="")["level"] == 1
    (tmp_path / "jax_plugins" / "some_gpu").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "some_gpu" / "__init__.py").write_text("")
    assert _child(path=f"{tmp_path}{os.pathsep}{ROOT}", XLA_FLAGS="") == {"level": 3, "flags": "", "devices": None}


def test_no_change_once_the_backend_has_started():
    runtime.jax.devices()
    env = {}
    assert not runtime.cpu_compile_level(env) and env == {}         # this process's backend has started
