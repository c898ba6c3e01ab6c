"""The README's "At cluster scale" tables: every recipe of configs/sim run through `python -m jaxrl.sim`,
set beside the papers' own figures.

    python scripts/bench_sim_cluster.py --out scripts/results/bench_sim_cluster.json            # everything (hours)
    python scripts/bench_sim_cluster.py --only rollpacker_qwen25_7b_h800 --reuse               # one recipe
    python scripts/bench_sim_cluster.py --reuse       # tables from the run directories already simulated

Each recipe runs into runs/sim/NAME (or is read from there with --reuse). The JSON holds every recipe's rows
(and sweep points) and the papers' figures; scripts/results/bench_sim_cluster.md holds the Markdown tables,
and the Gantt charts worth showing are copied next to it. Times are virtual (the cost model's), so several
recipes may run at once on a busy machine without changing a figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The static TP1 x 8 layout was never the best static layout in these recipes (its 8 instances each hold the
# whole model and the longest responses decode at TP1 speed); the sweeps start at TP2 to save simulation time.
PAT_SWEEP = ["sweep=engine.tp", "values=[2, 4, 8]"]

ASYNC_K = (1, 2)
ASYNC_SWEEP = ["sweep=cluster.gpus", "values=[8, 16, 32, 64, 128]"]
ASYNC_ROW = "disaggregated+async_reward+async_steps"

# name -> (recipe, extra command-line overrides)
RECIPES = {
    "pat_llama8b_h100": ("pat_llama8b_h100.yaml", PAT_SWEEP),
    "pat_qwen3_14b_h100": ("pat_qwen3_14b_h100.yaml", PAT_SWEEP),
    "pat_llama8b_a40": ("pat_llama8b_a40.yaml", PAT_SWEEP),
    "pat_llama8b_h100_nodes": ("pat_llama8b_h100_nodes.yaml", ["steps=2"]),
    "rollpacker_qwen25_7b_h800": ("rollpacker_qwen25_7b_h800.yaml", []),
    "rollpacker_qwen25_14b_h800": ("rollpacker_qwen25_14b_h800.yaml", []),
    "rollpacker_qwen25_32b_h800": ("rollpacker_qwen25_32b_h800.yaml", []),
    "rollpacker_scale_14b_h800": ("rollpacker_qwen25_14b_h800.yaml",
                                  ["rows=[baseline, rollpacker]", "steps=5", "prompts_per_gpu=4",
                                   "sweep=cluster.gpus", "values=[32, 64, 128]"]),
    "streamrl_qwen25_14b_h800": ("rollpacker_qwen25_14b_h800.yaml",
                                 ["rows=[baseline, streamrl, 'disaggregated+skew+async_reward+async_steps', "
                                  "'disaggregated+async_reward']", "steps=6"]),
    "distflow_qwen25_7b_h100": ("distflow_qwen25_7b_h100.yaml",
                                ["sweep=cluster.gpus", "values=[8, 16, 32, 64, 128, 256, 512]", "steps=2"]),
    # the curve's last point: one step (a step of 1024 GPUs' 16K sequences takes ~20 min to simulate on 2 cores)
    "distflow_qwen25_7b_h100_1024": ("distflow_qwen25_7b_h100.yaml", ["cluster.gpus=1024", "steps=1"]),
    # asynchronous RL (issue 38): generation up to k versions ahead on disaggregated pools, 8-128 GPUs, beside the
    # synchronous rows: colocated with one controller per process (multi_controller: the disaggregated rows have
    # no single driver either), the single-controller baseline, disaggregated (k = 1's run). Every run
    # simulates the baseline too (the train pool's time is scaled from its training); the generation pool's
    # size comes from the rollout simulated on each candidate (split=simulated: StreamRL's T_g(x)).
    **{f"async_qwen25_7b_h100_k{k}": ("distflow_qwen25_7b_h100.yaml", [
        "rows=[baseline, disaggregated+async_reward, 'disaggregated+async_reward+async_steps']" if k == 1 else
        "rows=['disaggregated+async_reward+async_steps']", "steps=5", f"max_staleness={k}", "split=simulated",
        *ASYNC_SWEEP])
       for k in ASYNC_K},
    "async_qwen25_7b_h100_sync": ("distflow_qwen25_7b_h100.yaml", ["rows=[multi_controller]", "steps=5",
                                                                   *ASYNC_SWEEP]),
}

# The papers' figures (see jaxrl/sim/hardware.py and the README for where each comes from).
PAPER = {
    "pat_llama8b_h100": {"source": "PAT §5.3, Fig. 11a (8 x H100, 24K)", "baseline_gen_s": 134.3, "pat_gen_s": 87.9,
                         "baseline_step_s": 172.5, "pat_step_s": 125.6, "tokens_per_step": 443_000},
    "pat_qwen3_14b_h100": {"source": "PAT §5.3, Fig. 11b (8 x H100, 16K)", "baseline_gen_s": 133.9, "pat_gen_s": 91.1,
                           "throughput_speedup": 1.29},
    "pat_llama8b_a40": {"source": "PAT §5.2, Fig. 10a (8 x A40, 6K-16K)", "speedup": [1.05, 1.27]},
    "rollpacker_qwen25_7b_h800": {"source": "RollPacker Table 2 (16 x H800, 8K)",
                                  "ladder": [1.30, 2.01, 2.01, 2.03]},
    "rollpacker_qwen25_14b_h800": {"source": "RollPacker Table 2 (32 x H800, 16K)",
                                   "ladder": [1.48, 1.99, 2.02, 2.22]},
    "rollpacker_qwen25_32b_h800": {"source": "RollPacker Table 2 (64 x H800, 32K)",
                                   "ladder": [2.21, 2.48, 2.52, 2.56]},
    "rollpacker_scale_14b_h800": {"source": "RollPacker §6.7, Fig. 14 (14B/16K, batch 128 -> 512 on up to 128 H800)",
                                  "speedup": 2.2, "per_2x_resources": 1.5},
    "distflow_qwen25_7b_h100": {"source": "DistFlow §7.2-7.3 (7B GRPO; Fig. 10, Fig. 11)", "speedup_128": 2.26,
                                "retention_64_512": 0.805},
    "async": {"verl_fully_async": {"source": "verl fully_async (Qwen2.5-7B, 128 GPUs, vs colocated synchronous)",
                                   "speedup": [2.35, 2.67]},
              "areal": {"source": "AReaL (vs synchronous, comparable accuracy)", "speedup": 2.77}},
}

# its files in scripts/results/ (tests/test_docs.py)
OUTPUTS = ("bench_sim_cluster.json", "bench_sim_cluster.md", "sim_*.png")


def run(name: str, reuse: bool) -> Path:
    recipe, extra = RECIPES[name]
    out = ROOT / "runs" / "sim" / name
    if not (reuse and (out / "summary.json").exists()):
        cmd = [sys.executable, "-m", "jaxrl.sim", "--config", str(ROOT / "configs" / "sim" / recipe), *extra,
               "--out", str(out)]
        print("[bench_sim_cluster]", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def load(out: Path) -> dict:
    s = json.loads((out / "summary.json").read_text())
    if "points" in s:
        for p in s["points"]:
            sub = json.loads((out / f"{s['sweep']}={p['value']}" / "summary.json").read_text())
            p["steps_by_row"] = sub["steps_by_row"]
            p["workload"] = sub["workload"]
    return s


def cap_steps(steps: list[dict], cap: int) -> list[dict]:
    """The steps in which some response reached the cap (PAT measures only those)."""
    return [x for x in steps if x["max_response"] >= cap] or steps


def mean(xs, key):
    return sum(x[key] for x in xs) / max(1, len(xs))


def pat_table(name: str, s: dict, cap: int) -> tuple[str, dict]:
    """Per starting TP: static rollout vs PAT's, on the steps that reached the cap."""
    lines = ["| start layout | static: generation s | static: step s | PAT: generation s | PAT: step s | "
             "PAT switches / step | PAT vs this start | PAT vs best static |", "|---|---|---|---|---|---|---|---|"]
    static, pat = {}, {}
    for p in s["points"]:
        tp = int(p["value"])
        st = {r: cap_steps(p["steps_by_row"][r], cap) for r in ("baseline", "pat")}
        static[tp] = (mean(st["baseline"], "rollout_s"), mean(st["baseline"], "step_s"))
        pat[tp] = (mean(st["pat"], "rollout_s"), mean(st["pat"], "step_s"), mean(st["pat"], "switches"))
    best = min(static, key=lambda t: static[t][0])
    for tp in sorted(static):
        g, stp = static[tp]
        pg, ps, sw = pat[tp]
        lines.append(f"| TP{tp} x {8 // tp} | {g:.1f} | {stp:.1f} | {pg:.1f} | {ps:.1f} | {sw:.1f} | "
                     f"{pg / g - 1:+.1%} generation | {pg / static[best][0] - 1:+.1%} (best static: TP{best}) |")
    return "\n".join(lines) + "\n", {"static": static, "pat": pat, "best_static_tp": best}


LADDER = ("tail_batching", "tail_batching+async_reward", "tail_batching+async_reward+planner", "rollpacker")


def ladder_table(rows_by_name: dict[str, dict]) -> str:
    lines = ["| model, GPUs, cap | + tail batching | + reward scheduler | + planner | + stream trainer |",
             "|---|---|---|---|---|"]
    for name, s in rows_by_name.items():
        rows = {r["row"]: r for r in s["rows"]}
        paper = PAPER[name]["ladder"]
        cells = [f"{rows[k]['speedup_vs_baseline']:.2f}x (paper {p:.2f}x)" for k, p in zip(LADDER, paper)]
        label = f"{s['model']}, {s['gpus']} x H800, {max(r['max_response'] for r in s['rows']) // 1024}K"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rows_table(s: dict) -> str:
    from jaxrl.sim.report import table

    return table(s["rows"])


def sweep_table(s: dict, rows: list[str], metric: str = "tokens_per_s") -> str:
    head = "| " + s["sweep"] + " | steps | " + " | ".join(f"{r} step s" for r in rows) + " | " + \
           " | ".join(f"{r} {metric}" for r in rows) + " | " + " | ".join(f"{r} speedup" for r in rows[1:]) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(rows) - 1)]
    for p in s["points"]:
        by = {r["row"]: r for r in p["rows"]}
        steps = len(p["steps_by_row"][rows[0]])
        secs = [f"{by[r]['step_s']:.1f}" for r in rows]
        vals = [f"{1 / by[r]['s_per_prompt']:.2f}" if metric == "prompts_per_s" else f"{by[r][metric]:.0f}"
                for r in rows]
        sp = [f"{by[r]['speedup_vs_baseline']:.2f}x" for r in rows[1:]]
        lines.append(f"| {p['value']} | {steps} | " + " | ".join(secs) + " | " + " | ".join(vals) + " | " +
                     " | ".join(sp) + " |")
    return "\n".join(lines) + "\n"


def async_table(by_k: dict[int, dict], sync: dict) -> tuple[str, dict]:
    """Step throughput against k at each GPU count, as speed-ups in mean step time over the synchronous colocated
    multi-controller row (`sync`'s run; the same GPUs and workload): the single-controller baseline and the
    synchronous disaggregated row (k = 1's run), the async row of each k."""
    def row_of(s, value, row):
        p = next(p for p in s["points"] if str(p["value"]) == str(value))
        return next(r for r in p["rows"] if r["row"] == row)

    def step_s(s, value, row):
        return row_of(s, value, row)["step_s"]

    ks = sorted(by_k)
    lines = ["| GPUs | sync colocated step s | sync, single controller | split, GPUs (gen / train) | "
             "sync disaggregated | " + " | ".join(f"async, k = {k}" for k in ks) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(ks)]
    out = {}
    for p in sync["points"]:
        g = p["value"]
        ref = step_s(sync, g, "multi_controller")
        single = ref / step_s(by_k[ks[0]], g, "baseline")
        dis = ref / step_s(by_k[ks[0]], g, "disaggregated+async_reward")
        sp = {k: ref / step_s(by_k[k], g, ASYNC_ROW) for k in ks}
        a = row_of(by_k[ks[0]], g, ASYNC_ROW)
        out[str(g)] = {"sync_step_s": ref, "single_controller_speedup": single, "disaggregated_speedup": dis,
                       "async_speedup": {str(k): v for k, v in sp.items()},
                       "split": [a["gen_gpus"], a["train_gpus"]], "split_rollout_s": a.get("split_rollout_s")}
        lines.append(f"| {g} | {ref:.1f} | {single:.2f}x | {a['gen_gpus']} / {a['train_gpus']} | {dis:.2f}x | "
                     + " | ".join(f"{sp[k]:.2f}x" for k in ks) + " |")
    return "\n".join(lines) + "\n", out


def scaling_plot(s: dict, path: Path) -> dict:
    """DistFlow's scaling curve: tokens/s of both rows against GPUs, with linear scaling from 8 GPUs; returns
    each row's per-GPU throughput retention from 64 GPUs to the largest point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(p["value"]) for p in s["points"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    out = {}
    for row, style in (("baseline", "o-"), ("distflow", "s-")):
        ys = [next(r["tokens_per_s"] for r in p["rows"] if r["row"] == row) for p in s["points"]]
        ax.plot(xs, ys, style, label={"baseline": "single controller (veRL-like)",
                                      "distflow": "multi-controller (DistFlow)"}[row])
        per = {x: y / x for x, y in zip(xs, ys)}
        if 64 in per:
            out[row] = {"retention_64_to_max": per[max(xs)] / per[64], "max_gpus": max(xs)}
    y0 = next(r["tokens_per_s"] for r in s["points"][0]["rows"] if r["row"] == "distflow")
    ax.plot(xs, [y0 * x / xs[0] for x in xs], "k:", label="linear from 8 GPUs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (H100, 8 per node; 16 sequences per GPU)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Qwen2.5-7B GRPO, simulated")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "scripts/results/bench_sim_cluster.json"))
    ap.add_argument("--only", action="append", choices=sorted(RECIPES))
    ap.add_argument("--reuse", action="store_true", help="read runs/sim/NAME/summary.json when present")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    from bench_harness import write_result          # (here: scripts/docs.py loads this module for its tables)

    names = args.only or list(RECIPES)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        s = load(run(name, args.reuse))
        results[name] = {"summary": s, "paper": PAPER.get(name)}
    write_result(out, results, default=float)
    md = []
    for name, cap in (("pat_llama8b_h100", 24576), ("pat_qwen3_14b_h100", 16384), ("pat_llama8b_a40", 16384)):
        if name in results:
            text, extra = pat_table(name, results[name]["summary"], cap)
            results[name]["pat"] = extra
            md.append(f"#### {name} ({PAPER[name]['source']})\n\n{text}")
    ladder = {n: results[n]["summary"] for n in ("rollpacker_qwen25_7b_h800", "rollpacker_qwen25_14b_h800",
                                                    "rollpacker_qwen25_32b_h800") if n in results}
    if ladder:
        md.append("#### RollPacker's ladder (cumulative speedup over the baseline)\n\n" + ladder_table(ladder))
        for n, s in ladder.items():
            md.append(f"#### {n}\n\n" + rows_table(s))
    if "distflow_qwen25_7b_h100" in results and "distflow_qwen25_7b_h100_1024" in results:
        extra = results["distflow_qwen25_7b_h100_1024"]["summary"]       # the curve's last point
        points = results["distflow_qwen25_7b_h100"]["summary"]["points"]
        points[:] = [p for p in points if int(p["value"]) != 1024]
        points.append({"value": 1024, "rows": extra["rows"], "steps_by_row": extra["steps_by_row"],
                       "workload": extra["workload"]})
    if "distflow_qwen25_7b_h100" in results:
        results["distflow_qwen25_7b_h100"]["scaling"] = scaling_plot(
            results["distflow_qwen25_7b_h100"]["summary"], out.parent / "sim_distflow_scaling.png")
    for name, rows in (("rollpacker_scale_14b_h800", ["baseline", "rollpacker"]),
                       ("distflow_qwen25_7b_h100", ["baseline", "distflow"]),
                       ("pat_llama8b_h100_nodes", ["baseline", "pat"])):
        if name in results:
            metric = "prompts_per_s" if name == "rollpacker_scale_14b_h800" else "tokens_per_s"   # RollPacker Fig. 14
            md.append(f"#### {name}\n\n" + sweep_table(results[name]["summary"], rows, metric))
    by_k = {k: results[f"async_qwen25_7b_h100_k{k}"]["summary"] for k in ASYNC_K
            if f"async_qwen25_7b_h100_k{k}" in results}
    if 1 in by_k and "async_qwen25_7b_h100_sync" in results:
        text, points = async_table(by_k, results["async_qwen25_7b_h100_sync"]["summary"])
        results["async"] = {"points": points, "paper": PAPER["async"]}
        md.append("#### Asynchronous RL: step throughput vs k (speed-up over synchronous colocated, one controller "
                  "per process)\n\n" + text)
    if "streamrl_qwen25_14b_h800" in results:
        md.append("#### streamrl_qwen25_14b_h800\n\n" + rows_table(results["streamrl_qwen25_14b_h800"]["summary"]))
    write_result(out, results, default=float)
    out.with_suffix(".md").write_text("\n".join(md))
    for name, row in (("rollpacker_qwen25_14b_h800", "baseline"), ("rollpacker_qwen25_14b_h800", "rollpacker"),
                      ("streamrl_qwen25_14b_h800", "streamrl")):
        src = ROOT / "runs" / "sim" / name / f"gantt_{row}.png"
        if src.exists():
            shutil.copy(src, out.parent / f"sim_{name}_{row}.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
