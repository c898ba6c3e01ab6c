"""GPU acceptance in one prepared command: kernels, engine, train step and memory measured on the device.

    python scripts/gpu_check.py --out DIR            # one GPU, about 8 minutes -> DIR/gpu_check.{json,md,log}
    python scripts/gpu_check.py --out DIR --smoke    # every section at tiny sizes on the CPU (CI)
    python scripts/gpu_check.py --out DIR --sections env,kernels
    python scripts/gpu_check.py --render DIR/gpu_check.json     # its Markdown again (docs/gpu.md's results)

Sections (each in its own module; each has a time budget in seconds, runs its sub-cases in priority order,
skips the rest once the budget is spent and says so, and records a failing sub-case's traceback without
stopping the next one):

  env      versions (jax, jaxlib, CUDA plugin, torch ...), device kind and memory; measured bf16 and f32
           matmul peak and device copy bandwidth (scripts/bench_peak.py's timing)        gpu_check_common.py
  kernels  Pallas flash attention (fwd + grad, f32 and bf16, causal, GQA, q_offset > 0), paged decode
           attention, chunked log-prob/entropy projection, attention_pairs: compiled for the device vs
           their references, at the CPU tests' tolerances                               gpu_check_kernels.py
  programs every program CI lowers for CUDA (`jaxrl.train.gpu_programs`: the kernel grid, the engine's
           decode/prefill steps and the update's programs of qwen3-0.6b, llama-3.2-1b and SmolLM2-135M), listed
           in the report and compiled for the device from abstract inputs       gpu_check_programs.py
  engine   Pallas engine == XLA engine (greedy tokens); decode tok/s at batch 1/16/64/256 at the qwen3-0.6b
           shape with achieved HBM bandwidth / measured copy bandwidth; transformers.generate beside it
                                                                                         gpu_check_engine.py
  train    the RL train step at the qwen3-0.6b shape, bf16, 16K packed tokens: MFU against the measured
           peak (causal FLOPs); torch's step beside it                                   gpu_check_train.py
  memory   blockwise vs full backward at 8K and 16K tokens: compiled peaks, and measured device peaks
  profile  PAT latency profile (TP1, grid=shapes), written as DIR/gpu_check_profile.json for the simulator
  targets  PAT predictor MAPE <= 4% on that profile; tail batching >= 2x synchronous     gpu_check_pat.py

A full run gives each group of sections a process of its own (`--isolate`, the default without --smoke): a
crash or a CUDA error stays in its group, a group past its budget (+ start-up time) is killed and recorded as
`timeout`, device memory peaks are per process, and JAX does not preallocate (torch shares the GPU). The
whole run stops starting groups after `--total-s` (480). DIR/gpu_check.json (and the .md rendered from it)
is rewritten while the run goes, so a run cut short still leaves what it measured. `--smoke` runs every
section in this process on the CPU (Pallas in interpret mode); its figures are structure, not measurements,
and the GPU-only targets are recorded with `applies: false`.

Exit status: 0 when every section ran to the end (or to its budget) and every judged check passed; 1
otherwise. Targets not met do not change it: they are what the run is for.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# name: (module, function, budget in seconds on one GPU, budget with --smoke)
SECTIONS = {
    "env": ("gpu_check_common", "run_env", 25, 60),
    "kernels": ("gpu_check_kernels", "run_kernels", 70, 120),
    "programs": ("gpu_check_programs", "run_programs", 40, 120),
    "engine": ("gpu_check_engine", "run_engine", 85, 120),
    "train": ("gpu_check_train", "run_train", 55, 120),
    "memory": ("gpu_check_train", "run_memory", 50, 120),
    "profile": ("gpu_check_pat", "run_profile_section", 50, 120),
    "targets": ("gpu_check_pat", "run_targets", 90, 120),
}
GROUPS = (("env",), ("kernels", "programs"), ("engine",), ("train",), ("memory",), ("profile", "targets"))
TOTAL_S = 480
STARTUP_S = 25          # a child's imports and device start-up, beyond its sections' budgets
SCHEMA = 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for gpu_check.json/.md/.log and the profile")
    ap.add_argument("--render", type=Path, help="print the Markdown of a gpu_check.json (for docs/gpu.md) and exit")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, Pallas in interpret mode (CI)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset (default: all)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="a process per group of sections (default: on, off with --smoke)")
    ap.add_argument("--total-s", type=float, default=TOTAL_S, help="whole-run budget in seconds (%(default)s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)          # internal: run these sections, write parts
    ap.add_argument("--parts", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None and args.render is None:
        ap.error("--out DIR is required (or --render JSON)")
    args.sections = [s for s in args.sections.split(",") if s]
    bad = sorted(set(args.sections) - set(SECTIONS))
    if bad:
        ap.error(f"--sections: unknown {bad}; valid choices: {', '.join(SECTIONS)}")
    if args.isolate is None:
        args.isolate = not args.smoke
    return args


def setup_jax(smoke: bool) -> None:
    """Choose the platform before JAX reads it (the bench scripts set JAX_PLATFORMS=cpu by default when imported
    first), and turn on the persistent compilation cache as every jaxrl entry point does."""
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")     # torch shares the device
    importlib.import_module("jax")            # JAX reads JAX_PLATFORMS now, before any bench script's default

    from jaxrl.runtime import enable_compilation_cache
    enable_compilation_cache()


def budget(name: str, smoke: bool) -> float:
    return SECTIONS[name][3 if smoke else 2]


def run_section(name: str, smoke: bool, shared: dict, parts: Path, flush=None) -> dict:
    """One section in this process; its record is also written to parts/NAME.json as it goes."""
    from gpu_check_common import Section

    module, fn, _, _ = SECTIONS[name]
    s = Section(name, budget(name, smoke), smoke=smoke, shared=shared, parts=parts, flush=flush)
    s.flush()
    print(f"[gpu_check] {name}: start (budget {s.budget_s:.0f} s)", file=sys.stderr, flush=True)
    try:
        getattr(importlib.import_module(module), fn)(s)
    except Exception:
        s.error = traceback.format_exc()[-4000:]
        print(f"[gpu_check] {name} failed:\n{s.error}", file=sys.stderr, flush=True)
    s.flush(s.status())
    rec = s.record()
    print(f"[gpu_check] {name}: {rec['status']} in {rec['seconds']:.1f} s", file=sys.stderr, flush=True)
    return rec


def child(args) -> int:
    setup_jax(args.smoke)
    shared = {"out": args.out, "tmp": args.parts}
    for name in args.child.split(","):
        run_section(name, args.smoke, shared, args.parts)
    return 0


def collect(parts: Path, names, states: dict) -> dict:
    """Every selected section's record: its part file, else what the parent knows (skipped, timeout, crashed)."""
    out = {}
    for name in names:
        path = parts / f"{name}.json"
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            rec = None
        state = states.get(name)
        if rec is None:
            rec = {"status": state[0] if state else "pending", "budget_s": None, "seconds": None,
                   "error": state[1] if state else None, "info": {}, "cases": {}}
        elif rec["status"] == "running" and state:                 # its process ended mid-section
            rec = {**rec, "status": state[0], "error": state[1]}
        out[name] = rec
    return out


def write(args, parts: Path, states: dict, t0: float, started: str) -> dict:
    from gpu_check_report import markdown, summary

    result = {"schema": SCHEMA, "mode": "smoke" if args.smoke else "full", "started": started,
              "command": "python scripts/gpu_check.py " + shlex.join(args.argv), "wall_s": time.time() - t0,
              "total_budget_s": args.total_s, "isolate": args.isolate,
              "budgets_s": {n: budget(n, args.smoke) for n in args.sections},
              "sections": collect(parts, args.sections, states)}
    result["summary"] = summary(result)
    result["exit_status"] = exit_status(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(result))
    return result


def exit_status(result: dict) -> int:
    s = result["summary"]
    return 0 if not s["sections_not_ok"] and not s["failed_checks"] and not s["failures"] else 1


def run_group(args, group, parts: Path, states: dict, deadline: float, refresh) -> None:
    """The sections of `group` in a child process, killed past their budgets (+ start-up) or the whole run's."""
    limit = min(sum(budget(n, args.smoke) for n in group) + STARTUP_S, deadline - time.time())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(group), "--out", str(args.out),
           "--parts", str(parts)] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(args.out / "gpu_check.log", "a") as log:
        log.write(f"\n===== {','.join(group)} (limit {limit:.0f} s) =====\n")
        log.flush()
        # a session of its own, so that a kill takes whatever the child started with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent),
                                start_new_session=True)
        t0 = time.time()
        try:
            while proc.poll() is None and time.time() - t0 < limit:
                try:
                    proc.wait(timeout=max(0.1, min(5.0, limit - (time.time() - t0))))
                except subprocess.TimeoutExpired:
                    refresh()
        finally:
            killed = proc.poll() is None
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if killed:
            why = f"killed after {time.time() - t0:.0f} s (group limit {limit:.0f} s)"
            for n in group:
                states[n] = ("timeout", why)
        elif proc.returncode != 0:
            for n in group:
                states[n] = ("crashed", f"process exited with status {proc.returncode} (see gpu_check.log)")
            for n in group:          # sections it never reached: say why
                if not (parts / f"{n}.json").is_file():
                    states[n] = ("crashed", f"not reached: the group's process exited with {proc.returncode}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    if args.render:
        from gpu_check_report import markdown
        print(markdown(json.loads(args.render.read_text())), end="")
        return 0
    if args.child:
        return child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    t0, started = time.time(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    deadline = t0 + args.total_s
    states: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        parts = Path(tmp)
        refresh = lambda: write(args, parts, states, t0, started)  # noqa: E731
        if args.isolate:
            (args.out / "gpu_check.log").write_text("")
            for group in GROUPS:
                group = tuple(n for n in group if n in args.sections)
                if not group:
                    continue
                if deadline - time.time() < 30:
                    for n in group:
                        states[n] = ("skipped", f"whole-run budget of {args.total_s:.0f} s spent")
                    continue
                run_group(args, group, parts, states, deadline, refresh)
                refresh()
                print(f"[gpu_check] {','.join(group)} done at {time.time() - t0:.0f} s", flush=True)
        else:
            setup_jax(args.smoke)
            shared = {"out": args.out, "tmp": parts}
            for name in args.sections:
                if time.time() > deadline:
                    states[name] = ("skipped", f"whole-run budget of {args.total_s:.0f} s spent")
                    continue
                run_section(name, args.smoke, shared, parts, flush=refresh)
        result = write(args, parts, states, t0, started)
    s = result["summary"]
    print(f"[gpu_check] {len(s['sections_ok'])}/{len(result['sections'])} sections ok in {result['wall_s']:.0f} s; "
          f"failures {len(s['failures'])}, failed checks {len(s['failed_checks'])}; "
          f"targets {[(t['name'], t['value'], t['met']) for t in s['targets']]} -> {args.out / 'gpu_check.json'}",
          flush=True)
    for line in s["failures"] + s["failed_checks"]:
        print(f"[gpu_check]   {line}", flush=True)
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
