"""Per-device busy timeline of colocated vs disaggregated vs one-step-async training (StreamRL §4.1) on
8 fake CPU devices, showing where each pool waits.

    python scripts/bench_pipeline.py --out scripts/results/bench_pipeline.json     # + .png
    python scripts/bench_pipeline.py --out /tmp/p.json --quick

Each mode is a real `jaxrl.train` run (the quickstart's tiny char model and built-in long-tail tasks,
`--steps` RL steps after a short warm start, every shape compiled before the first step), in its own
process with a `pipeline.Timeline`: each engine step is a busy span of the generation pool, each task
of the train worker (streamed gradient micro-batches, the update) a busy span of the train pool, each
weight sync a span of the generation pool.
  * colocated      — 8 instances and an fsdp=8 train mesh on the same 8 devices: rollout, then update;
  * disaggregated  — 4 generation instances on devices 4-7, the fsdp=4 train mesh on devices 0-3;
                     groups' gradients stream to the train pool during the rollout, one update after;
  * async          — disaggregated with trainer.max_staleness=1: step n's update overlaps step n+1's rollout.
Reported per mode: wall seconds per step, each pool's busy fraction (busy seconds / wall seconds of
the measured steps, the pool's devices counted once), the train pool's idle wait at the end of each
rollout, staleness. The 8 fake devices share 2 CPU cores, so the pools cannot run in parallel in wall
time here: the figure shows *where* each pool waits (the pipeline bubbles), not a speed-up; the
cluster-scale numbers belong to the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402

MODES = {
    "colocated": ["engine.instances=8", "train_layout.fsdp=8"],
    "disaggregated": ["engine.instances=4", "train_layout.fsdp=4", "placement=disaggregated"],
    "async": ["engine.instances=4", "train_layout.fsdp=4", "placement=disaggregated", "trainer.max_staleness=1"],
}
DEVICES = {"colocated": {"gen": list(range(8)), "train": list(range(8))},
           "disaggregated": {"gen": [4, 5, 6, 7], "train": [0, 1, 2, 3]},
           "async": {"gen": [4, 5, 6, 7], "train": [0, 1, 2, 3]}}

# its files in scripts/results/ (tests/test_docs.py)
OUTPUTS = ("bench_pipeline.json", "bench_pipeline.png", "bench_pipeline_timelines.json")


def one_mode(mode: str, args, out: Path) -> None:
    """Run inside a fresh process (8 CPU devices): train with a timeline, dump it."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT))
    from jaxrl.config import CONFIGS_DIR, parse_cli
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.pipeline import Timeline
    from jaxrl.train.trainer import Trainer

    over = [f"run_dir={out.parent / ('run_' + mode)}", f"steps={args.steps}", "save_every=null", "export_hf=false",
            f"warm_start.steps={args.warm_start}", f"algo.prompts_per_step={args.prompts}", "algo.group_size=8",
            f"rollout.max_new_tokens={args.max_new_tokens}", "engine.max_batch=64", "rewards.num_workers=0",
            "trainer.micro_batch_tokens=1280", *MODES[mode]]
    cfg = parse_cli(TrainConfig, over, default_yaml=CONFIGS_DIR / "quickstart.yaml", prog="bench")
    tl = Timeline()
    tr = Trainer(cfg, timeline=tl)
    hist = [dict(m, step=k) for k, m in enumerate(tr.run())]
    out.write_text(json.dumps({"spans": tl.to_json(), "metrics": hist}, default=float))


def summarise(mode: str, data: dict, skip: int) -> dict:
    spans = [s for s in data["spans"] if s["step"] >= skip]
    steps = [m for m in data["metrics"] if m["step"] >= skip]
    t0, t1 = min(s["start"] for s in spans), max(s["end"] for s in spans)
    busy = {p: sum(s["end"] - s["start"] for s in spans if s["pool"] == p) for p in ("gen", "train")}
    out = {"steps": len(steps), "wall_s": t1 - t0, "seconds_per_step": (t1 - t0) / max(len(steps), 1),
           "gen_busy_fraction": busy["gen"] / (t1 - t0), "train_busy_fraction": busy["train"] / (t1 - t0),
           "gen_busy_s": busy["gen"], "train_busy_s": busy["train"],
           "rollout_s_mean": sum(m["rollout_s"] for m in steps) / len(steps),
           "train_s_mean": sum(m["train_s"] for m in steps) / len(steps),
           "response_len_max": max(m["response_len_max"] for m in steps),
           "compiles_after_warmup": sum(m["compiles"] for m in data["metrics"][1:])}
    if mode != "colocated":
        out["train_wait_s_mean"] = sum(m["placement/train_wait_s"] for m in steps) / len(steps)
        out["staleness"] = [m["placement/staleness"] for m in data["metrics"]]
        if mode == "disaggregated":
            out["groups_streamed_fraction"] = (sum(m["placement/groups_streamed"] for m in steps)
                                               / sum(m["placement/groups"] for m in steps))
    return out


def plot(result: dict, timelines: dict, path: Path, skip: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {("gen", "decode"): "tab:blue", ("gen", "sync"): "tab:purple", ("train", "grad"): "tab:orange",
              ("train", "update"): "tab:red"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.3 * len(timelines)), sharex=False)
    for ax, (mode, data) in zip(axes, timelines.items()):
        spans = [s for s in data["spans"] if s["step"] >= skip]
        t0 = min(s["start"] for s in spans)
        for s in spans:
            for d in DEVICES[mode][s["pool"]]:
                y = d + (0.2 if mode == "colocated" and s["pool"] == "train" else 0)
                ax.barh(y, s["end"] - s["start"], left=s["start"] - t0, height=0.6 if mode != "colocated" else 0.4,
                        color=colors.get((s["pool"], s["kind"]), "gray"), linewidth=0)
        r = result["modes"][mode]
        ax.set_title(f"{mode}: {r['seconds_per_step']:.2f} s/step, generation pool busy "
                     f"{100 * r['gen_busy_fraction']:.0f}%, train pool busy {100 * r['train_busy_fraction']:.0f}%",
                     fontsize=9)
        ax.set_yticks(range(8))
        ax.set_ylabel("device")
        ax.invert_yaxis()
    axes[-1].set_xlabel("seconds (8 fake devices on 2 CPU cores: pools cannot overlap in wall time here)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0].legend(handles, ["decode step", "weight sync", "streamed gradients", "update"], fontsize=7,
                   loc="upper right", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_pipeline.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--warm-start", type=int, default=None)
    ap.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)     # internal: one mode's run
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    args.steps = args.steps or (2 if q else 4)
    args.prompts = args.prompts or (8 if q else 16)
    args.max_new_tokens = args.max_new_tokens or (16 if q else 64)
    args.warm_start = args.warm_start if args.warm_start is not None else (0 if q else 50)
    if args.mode:
        return one_mode(args.mode, args, Path(args.part))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))      # the runs' directories (checkpoints: large)
    timelines, t0 = {}, time.perf_counter()
    for mode in MODES:
        part = work / f"{mode}.json"
        shutil.rmtree(work / f"run_{mode}", ignore_errors=True)      # a fresh run, never a resume
        cmd = [sys.executable, __file__, "--mode", mode, "--part", str(part), f"--steps={args.steps}",
               f"--prompts={args.prompts}", f"--max-new-tokens={args.max_new_tokens}", f"--warm-start={args.warm_start}"]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{mode} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        timelines[mode] = json.loads(part.read_text())
        print(f"[{mode}] done", flush=True)
    skip = 1                       # step 0 includes the warm-up's first-touch costs
    result = {"steps": args.steps, "measured_steps": args.steps - skip, "prompts_per_step": args.prompts,
              "group_size": 8, "max_new_tokens": args.max_new_tokens, "warm_start_steps": args.warm_start,
              "devices": DEVICES, "seconds": time.perf_counter() - t0,
              "note": "8 fake CPU devices share 2 cores: the pools cannot run in parallel in wall time here; the "
                      "timeline shows where each pool waits. Wall-clock gains need real devices (simulator issue).",
              "modes": {m: summarise(m, d, skip) for m, d in timelines.items()}}
    shutil.rmtree(work, ignore_errors=True)
    write_result(out, result)
    plot(result, timelines, out.with_suffix(".png"), skip)
    # after the plot, which reads one entry per mode
    write_result(out.parent / (out.stem + "_timelines.json"), timelines, indent=None, default=float)
    for m, r in result["modes"].items():
        print(f"{m:14s} {r['seconds_per_step']:.2f} s/step  gen busy {100 * r['gen_busy_fraction']:.0f}%  "
              f"train busy {100 * r['train_busy_fraction']:.0f}%")
    return result


if __name__ == "__main__":
    main()
