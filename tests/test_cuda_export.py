"""Every program a GPU run compiles lowers for CUDA (`jax.export(..., platforms=["cuda"])`), without a GPU.

The list is `jaxrl.train.gpu_programs.programs()` (its docstring says what it covers: the Pallas kernels over
the engine's and trainer's shape grid, the engine's decode and prefill steps and the update's programs for
qwen3-0.6b and llama-3.2-1b at TP1/TP2 and SmolLM2-135M); `scripts/gpu_check.py` compiles the same list on a
GPU. Lowering runs Pallas -> Triton IR and checks the Pallas rules (tile shapes, block specs, supported ops);
Triton's own compile (register and shared-memory limits, its verifier) and the numbers need the device.

`pip install -e .[cuda]` is checked with the resolver alone (`pip install --dry-run` against PyPI, of the extra and
the main requirements it can conflict with; skipped when PyPI is unreachable): the CPU pin in the main
dependencies and the extra resolve to one CUDA JAX.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

from jaxrl.config import EngineSection
from jaxrl.train import gpu_programs as gp
from models import PRESETS
from tests.real_model import _pypi_reachable

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {p.name: p for p in gp.programs()}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_lowers_for_cuda(name):
    p = PROGRAMS[name]
    exported = gp.export(p, jax.devices())
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",) and exported.nr_devices == p.devices
    calls = text.count(gp.TRITON)
    assert calls >= len(p.kernels), (name, calls)
    if name.startswith("kernel/paged/"):     # one kernel per grid point; flash: prefill fwd, fwd + dq + dk/dv
        assert calls == len(gp.paged_grid()), (name, calls)
    if name.startswith("kernel/flash/"):
        assert calls == len(gp.prefill_grid()) + 3 * (len(gp.PACK_LENS) + len(gp.BLOCKS)), (name, calls)
    for kernel in p.kernels:                 # each named Pallas kernel is in the module (fwd, dq, dk/dv, paged)
        assert kernel in text, (name, kernel)


def test_the_list_covers_the_grid():
    """What the issue asks for is in the list: every decode batch bucket and page-table width of the default
    buckets and the widths 1-8 (3, 5, 6, 7 among them), every prefill (chunk width, table width), the presets'
    GQA ratios (SmolLM2's 9/3 too) at head dims 64 and 128, the engine and train programs of the three models at
    their TP sizes, each name once."""
    buckets = gp.engine_buckets(EngineSection())
    grid = gp.paged_grid()
    assert {b for b, _ in grid} == set(buckets.batch) and {p for _, p in grid} == set(buckets.pages) | set(range(1, 9))
    assert {(w, s // buckets.page_size) for _, w, s in gp.prefill_grid()} == {(w, p) for _, w, p in
                                                                             buckets.prefill_shapes()}
    pairs = set(gp.gqa_head_dims())
    assert {(c.num_heads // c.num_kv_heads, c.head_dim) for c in PRESETS.values() if c.head_dim >= 64} <= pairs
    smol = next(r for r in gp.model_runs() if r.name == "smollm2-135m").cfg
    assert (smol.num_heads, smol.num_kv_heads, smol.head_dim) == (9, 3, 64) and (3, 64) in pairs
    assert {d for _, d in pairs} == {64, 128} and {g for g, _ in pairs} == {2, 3, 4, 5, 7}
    for g, d in pairs:
        assert {f"kernel/paged/g{g}/d{d}/bfloat16", f"kernel/flash/g{g}/d{d}/float32",
                f"kernel/flash/g{g}/d{d}/bfloat16"} <= set(PROGRAMS)
    assert len(PROGRAMS) == len(gp.programs())
    for model, tps in (("qwen3-0.6b", (1, 2)), ("llama-3.2-1b", (1, 2)), ("smollm2-135m", (1,))):
        for tp in tps:
            for kind in ("engine/decode", "engine/prefill", "train/logprobs", "train/grad", "train/blockwise_kv",
                         "train/blockwise_block"):
                n = [p for p in PROGRAMS.values() if p.name.startswith(f"{kind}/{model}/tp{tp}")]
                assert len(n) == 1 and n[0].devices == tp, (kind, model, tp)
    assert PROGRAMS["engine/decode/smollm2-135m/tp1/b32xp6"].shape == (32, 6)     # its recipe's 6-page table


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_cuda_extra_resolves_to_a_cuda_jax(tmp_path):
    """The resolver alone, nothing installed: `pip --isolated install --dry-run --ignore-installed` against PyPI,
    as on a fresh Linux x86-64 box, of the `cuda` extra together with the main requirements it could conflict
    with (the `jax[cpu]` pin, every requirement that depends on JAX, numpy; read from pyproject.toml). The
    whole `-e .[cuda]` resolves the same (measured: 135 packages, about 35 s against 15 s for these). The
    report's jax, jaxlib, CUDA plugin and PJRT are one version, the pinned one."""
    if not _pypi_reachable():
        pytest.skip("PyPI is unreachable: the resolver cannot be asked")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    main = [d for d in project["dependencies"]
            if _name(d) in ("jax", "flax", "optax", "orbax-checkpoint", "jaxtyping", "numpy")]
    reqs = main + project["optional-dependencies"]["cuda"]
    assert len(main) == 6, main
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
                          "--quiet", "--report", str(report), *reqs], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    pin = next(re.fullmatch(r"jax\[cpu\]==(\S+)", d).group(1) for d in main if d.startswith("jax[cpu]"))
    plugin = [n for n in got if re.fullmatch(r"jax-cuda\d+-plugin", n)]
    assert len(plugin) == 1, sorted(got)
    pjrt = plugin[0].replace("plugin", "pjrt")
    versions = {k: got.get(k) for k in ("jax", "jaxlib", plugin[0], pjrt)}
    assert set(versions.values()) == {pin}, versions
