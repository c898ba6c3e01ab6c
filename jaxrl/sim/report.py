"""What `python -m jaxrl.sim` writes: summary.json, a Markdown table, a Gantt chart per row, the breakdown
bars, and a curve per sweep."""

from __future__ import annotations

import json
from pathlib import Path

COLORS = {"decode": "#4c72b0", "switch": "#c44e52", "reward": "#55a868", "grad": "#dd8452", "forward": "#8172b3",
          "train": "#937860", "sync": "#8c8c8c", "driver": "#222222"}
BREAKDOWN = ("rollout_s", "reward_s", "driver_s", "forward_s", "train_s", "sync_s")


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows (seconds are per step)."""
    head = ("| row | GPUs (gen/train) | step s | rollout s | reward s | train s (fwd + update) | sync s | data s | "
            "switch s | engine steps | preempt. | switches | GPU busy | speedup |")
    out = [head, "|" + "---|" * 14]
    for r in rows:
        split = "disaggregated" in r["mechanisms"] or "async_steps" in r["mechanisms"]
        gpus = f"{r['gen_gpus']}/{r['train_gpus']}" if split else f"{r['gen_gpus']}"
        out.append(f"| {r['row']} | {gpus} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['reward_s']:.1f} | "
                   f"{r['forward_s'] + r['train_s']:.1f} | {r['sync_s']:.1f} | {r['driver_s']:.1f} | "
                   f"{r['switch_s']:.1f} | {r['engine_steps']:.0f} | {r['preemptions']} | {r['switches']} | "
                   f"{r.get('gpu_busy', 0):.0%} | {r['speedup_vs_baseline']:.2f}x |")
    return "\n".join(out) + "\n"


def gantt(timeline, path: Path, *, title: str, max_devices: int = 8) -> None:
    """Busy spans per device group: the first `max_devices` generation GPUs, then the reward workers and the
    training side's rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = timeline.spans
    gens = sorted({s.pool for s in spans if s.pool.startswith("gen")}, key=lambda p: int(p[3:]))[:max_devices]
    others = [p for p in ("reward", "freed", "train", "driver") if any(s.pool == p for s in spans)]
    pools = gens + others
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(pools) + 1.2))
    for y, pool in enumerate(pools):
        for kind in COLORS:
            bars = [(s.start, s.end - s.start) for s in spans if s.pool == pool and s.kind == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS[kind], label=kind)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7, ncol=len(uniq))
    ax.set_yticks(range(len(pools)), [p.replace("gen", "GPU ") for p in pools], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (virtual clock)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def breakdown(rows: list[dict], path: Path, *, title: str) -> None:
    """Stacked per-step seconds of each row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 3.6))
    bottom = [0.0] * len(rows)
    for key in BREAKDOWN:
        vals = [r[key] for r in rows]
        ax.bar([r["row"] for r in rows], vals, bottom=bottom, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, r["step_s"], f"{r['speedup_vs_baseline']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per step (stages; disaggregated ones overlap)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sweep_curve(points: list[dict], key: str, path: Path, *, metric: str = "tokens_per_s") -> None:
    """`metric` of every row against the swept value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["value"] for p in points]
    numeric = all(isinstance(x, (int, float)) for x in xs)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name in [r["row"] for r in points[0]["rows"]]:
        ys = [next(r[metric] for r in p["rows"] if r["row"] == name) for p in points]
        ax.plot(xs if numeric else range(len(xs)), ys, marker="o", label=name)
    if numeric and max(xs) / max(min(xs), 1e-9) >= 8:
        ax.set_xscale("log", base=2)
    if not numeric:
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_xlabel(key)
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(result: dict, out: Path, *, title: str) -> None:
    """summary.json (timelines out), table.md, a Gantt PNG per row, breakdown.png."""
    out.mkdir(parents=True, exist_ok=True)
    timelines = result.pop("timelines", {})
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=float))
    (out / "table.md").write_text(table(result["rows"]))
    for row, tl in timelines.items():
        gantt(tl, out / f"gantt_{row}.png", title=f"{title}: {row}")
    breakdown(result["rows"], out / "breakdown.png", title=title)
