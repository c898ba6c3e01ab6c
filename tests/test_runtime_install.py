"""The quickstart needs the runtime dependencies only (README, scripts/venv.sh): pyproject's runtime set resolves
without the reference stack the tests compare against (torch, transformers, TRL, PEFT: the `test` extra), and
`python -m jaxrl.train` runs with that stack unimportable."""

import json
import subprocess
import sys
import tomllib

import pytest

from tests.real_model import _pypi_reachable
from tests.train_runs import ROOT, TINY, _env

REFERENCE = ("torch", "transformers", "trl", "peft", "accelerate")

# A meta-path finder that refuses the reference stack, then the entry point as `python -m jaxrl.train` runs it.
BLOCKED_RUN = f"""
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {REFERENCE!r}:
            raise ImportError(f"{{name}} is not installed (the runtime set has no reference stack)")
sys.meta_path.insert(0, Refuse())
sys.argv = ["jaxrl.train", *sys.argv[1:]]
runpy.run_module("jaxrl.train", run_name="__main__", alter_sys=True)
"""


def _name(requirement: str) -> str:
    return requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()


def test_the_runtime_set_has_no_reference_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    assert not runtime & set(REFERENCE), runtime & set(REFERENCE)
    assert set(REFERENCE) - {"accelerate"} <= {_name(r) for r in project["optional-dependencies"]["test"]}


@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI unreachable: the resolver cannot be asked")
def test_the_runtime_set_resolves_without_torch_or_cuda(tmp_path):
    """pip's resolver on `pip install .` (no extras), as the quickstart's first run installs it: nothing of the
    reference stack and no CUDA libraries come with it."""
    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert {"jax", "jaxlib", "flax", "optax"} <= names
    assert not [n for n in names if n in REFERENCE or n.startswith("nvidia")], sorted(names)


def test_the_quickstart_runs_with_the_reference_stack_unimportable(tmp_path):
    p = subprocess.run([sys.executable, "-c", BLOCKED_RUN, f"run_dir={tmp_path / 'run'}", *TINY, "steps=1"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()
