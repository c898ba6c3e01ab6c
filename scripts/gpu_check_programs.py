"""`scripts/gpu_check.py` section "programs": the programs CI lowers for CUDA, compiled for the device.

The list is `jaxrl.train.gpu_programs.programs()`, the one tests/test_cuda_export.py exports with
`jax.export(..., platforms=["cuda"])`: the Pallas kernels over the engine's and trainer's shape grid, the
engine's decode and prefill steps and the update's programs (log-probs, fused-loss gradient, blockwise K/V pass
and block step) for qwen3-0.6b, llama-3.2-1b and SmolLM2-135M. Here each is compiled for the GPU from the same
abstract inputs (`gpu_programs.compile_here`: nothing is allocated, nothing runs), so Triton compiles every
kernel configuration CI lowered (what CI cannot check: Triton's verifier, register and shared-memory limits)
and XLA:GPU partitions and compiles the rest.

The section's info lists every program's name, so the report says what CI exported; a compiled program is a case
with its compile seconds; a program whose mesh needs more devices than the machine has (TP2 on one GPU) is
skipped with that reason; once the budget is spent the rest are skipped, each listed. Order: the step programs
on one device (per model: its decode and prefill steps at the cover shapes a run starts with, the log-prob,
gradient and blockwise programs), then the kernel grid (one program per GQA ratio, head dim and dtype, each
holding many Triton kernels), then the TP2 steps. With --smoke (the CPU, no Triton compiler): the list, and one
kernel program and one step program lowered for CUDA as CI does (their Triton call counts recorded).
"""

from __future__ import annotations

from gpu_check_common import Section


def priority(programs) -> list:
    """The order they are compiled in: the step programs on one device (what a run compiles first), the kernel
    grid, then the rest (the TP2 steps)."""
    steps = [p for p in programs if not p.name.startswith("kernel/") and p.devices == 1]
    kernels = [p for p in programs if p.name.startswith("kernel/")]
    names = {p.name for p in steps + kernels}
    return steps + kernels + [p for p in programs if p.name not in names]


def _export(p) -> dict:
    from jaxrl.train import gpu_programs as gp

    text = gp.export(p).mlir_module()
    return {"mode": "cuda export", "triton_calls": text.count(gp.TRITON), "kernels": list(p.kernels)}


def _compile(p, devices) -> dict:
    from jaxrl.train import gpu_programs as gp

    gp.compile_here(p, devices)
    return {"mode": "compiled", "devices": p.devices, "kernels": list(p.kernels)}


def run_programs(s: Section) -> None:
    import jax

    from jaxrl.train import gpu_programs as gp

    programs = gp.programs()
    s.info["programs"] = [p.name for p in programs]
    s.info["count"] = len(programs)
    s.info["backend"] = jax.default_backend()
    order = priority(programs)
    if s.smoke:      # no Triton compiler on the CPU: CI's export of one small kernel program and one step
        picks = [next(p for p in order if p.name.startswith("kernel/paged/")),
                 next(p for p in order if p.name.startswith("engine/decode/smollm2-135m/"))]
        for p in picks:
            s.case(p.name, _export, p)
        return
    devices = jax.devices()
    for p in order:
        if p.devices > len(devices):
            s.skip(p.name, f"needs {p.devices} devices, {len(devices)} here")
            continue
        s.case(p.name, _compile, p, devices)
