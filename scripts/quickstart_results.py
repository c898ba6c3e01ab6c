"""The quickstart's measured files in scripts/results/, copied from real runs of `python -m jaxrl.train`.

    scripts/venv.sh python scripts/quickstart_results.py                    # all four runs, one after another
    scripts/venv.sh python scripts/quickstart_results.py ppo                # one of them (minutes on 2 cores)
    scripts/venv.sh python scripts/quickstart_results.py quickstart --from runs/quickstart   # copy a finished run
    scripts/venv.sh python scripts/docs.py                                  # then re-render the docs

`RUNS` below: each run's overrides on top of configs/quickstart.yaml and what is copied from its run directory:

  quickstart    (no overrides: the README's command, run in its default runs/quickstart)
                summary.json -> quickstart.json, curves.png -> quickstart_curves.png     (README's table, figure)
  ppo           algo.advantage=gae (docs/training.md, "PPO with a critic")
                summary.json -> ppo_quickstart.json, curves.png -> ppo_quickstart_curves.png
  lora          model.lora.rank=8 optim.lr=0.002 (docs/lora.md: LoRA beside full fine-tuning; 4x the lr)
                summary.json -> lora_quickstart.json, curves.png -> lora_quickstart_curves.png
  length-pairs  rollout.skew.enabled=true steps=40 warm_start.steps=400 (docs/streamrl.md: the ranker's history)
                length_pairs.jsonl -> quickstart_length_pairs.jsonl      (`bench_ranker.py --pairs`'s input)
  multiturn     --config configs/multiturn.yaml (docs/multiturn.md: the calc task with the calculator tool)
                summary.json -> multiturn.json (+ the env/ metrics' first/last windows), curves.png ->
                multiturn_curves.png
  smollm2       --config configs/smollm2_arith.yaml (docs/real_model.md: SmolLM2-135M-Instruct on the sum task;
                needs `python -m models.fetch smollm2-135m-instruct checkpoints/smollm2-135m-instruct` first)
                summary.json -> smollm2_arith.json (+ the first and last evaluation's completions of a few held-out
                prompts), curves.png -> smollm2_arith_curves.png

A summary is copied as the run wrote it (`jaxrl/train/summary.py`). ppo_quickstart.json adds the critic's
mean `critic/explained_var` over the same first and last windows as the summary's rewards
(`critic_explained_var_first`, `_last`), from the run's metrics.jsonl.

Without `--from` a run goes to runs/quickstart (the quickstart) or runs/<name>_quickstart and the script stops
if that directory exists (the trainer would resume it). With `--from DIR` nothing runs: DIR's summary.json
must record the run's own overrides (a `run_dir=` override aside), so a different run is never copied under
these names. A run's wall time and medians are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"
sys.path.insert(0, str(ROOT))

from jaxrl.train.metrics import read_rows  # noqa: E402

# name -> (overrides, run directory, {file in the run directory: file in scripts/results/})
RUNS: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {
    "quickstart": ((), "runs/quickstart",
                   {"summary.json": "quickstart.json", "curves.png": "quickstart_curves.png"}),
    "ppo": (("algo.advantage=gae",), "runs/ppo_quickstart",
            {"summary.json": "ppo_quickstart.json", "curves.png": "ppo_quickstart_curves.png"}),
    "lora": (("model.lora.rank=8", "optim.lr=0.002"), "runs/lora_quickstart",
             {"summary.json": "lora_quickstart.json", "curves.png": "lora_quickstart_curves.png"}),
    "length-pairs": (("rollout.skew.enabled=true", "steps=40", "warm_start.steps=400"), "runs/length_pairs_quickstart",
                     {"length_pairs.jsonl": "quickstart_length_pairs.jsonl"}),
    "multiturn": (("--config", "configs/multiturn.yaml"), "runs/multiturn",
                  {"summary.json": "multiturn.json", "curves.png": "multiturn_curves.png"}),
    "smollm2": (("--config", "configs/smollm2_arith.yaml"), "runs/smollm2_arith",
                {"summary.json": "smollm2_arith.json", "curves.png": "smollm2_arith_curves.png"}),
}
SMOLLM2_EXAMPLES = 6      # smollm2_arith.json adds the first and last evaluation's completions of this many prompts
ENV_WINDOWS = ("env/tool_success", "env/tool_calls_mean", "env/tool_calls", "env/format_errors", "env/turns_mean")   # multiturn.json adds
OUTPUTS = ("quickstart.json", "quickstart_curves.png", "ppo_quickstart.json", "ppo_quickstart_curves.png",
           "lora_quickstart.json", "lora_quickstart_curves.png", "quickstart_length_pairs.jsonl",
           "multiturn.json", "multiturn_curves.png", "smollm2_arith.json", "smollm2_arith_curves.png")   # what it writes into scripts/results/ (tests/test_docs.py)
COMMAND = "python -m jaxrl.train"


def recorded_overrides(summary: dict) -> tuple[str, ...]:
    """The overrides a summary's `command` records, without `run_dir=` / `--run-dir DIR` (where the run wrote
    does not change what it measured)."""
    cmd = summary.get("command", "")
    if not cmd.startswith(COMMAND):
        raise SystemExit(f"summary command {cmd!r} is not a `{COMMAND}` run")
    words, out = iter(shlex.split(cmd[len(COMMAND):])), []
    for w in words:
        if w == "--run-dir":
            next(words, None)
        elif not (w.startswith("run_dir=") or w.startswith("--run-dir=")):
            out.append(w)
    return tuple(out)


def window_mean(rows: list[dict], key: str, window: int, last: bool) -> float | None:
    """Mean of `key` over the first (or last) `window` RL steps (rows with `reward_mean`, as `summarize`)."""
    rows = [r for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    part = rows[-window:] if last else rows[:window]
    vals = [float(r[key]) for r in part if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return sum(vals) / len(vals) if vals else None


def result_files(name: str, run_dir: Path) -> dict[str, str]:
    """{file name in scripts/results/: its text or bytes} for run `name` from its finished `run_dir`."""
    overrides, _, files = RUNS[name]
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise SystemExit(f"{summary_path}: missing (the run did not finish; the trainer writes it last)")
    summary = json.loads(summary_path.read_text())
    got = recorded_overrides(summary)
    if got != overrides:
        raise SystemExit(f"{run_dir} ran `{summary['command']}`: overrides {list(got)}, but the {name!r} run is "
                         f"{list(overrides)}")
    missing = [f for f in files if not (run_dir / f).exists()]
    if missing:
        raise SystemExit(f"{run_dir}: missing {missing}")
    out = {}
    for src, dst in files.items():
        if src == "summary.json" and name == "ppo":
            rows, k = read_rows(run_dir), summary["window_steps"]
            summary = summary | {"critic_explained_var_first": window_mean(rows, "critic/explained_var", k, False),
                                 "critic_explained_var_last": window_mean(rows, "critic/explained_var", k, True)}
            out[dst] = json.dumps(summary, indent=1) + "\n"
        elif src == "summary.json" and name == "multiturn":
            rows, k = read_rows(run_dir), summary["window_steps"]
            summary = summary | {f"{key}_{end}": window_mean(rows, key, k, end == "last")
                                 for key in ENV_WINDOWS for end in ("first", "last")}
            out[dst] = json.dumps(summary, indent=1) + "\n"
        elif src == "summary.json" and name == "smollm2":
            out[dst] = json.dumps(summary | {"examples": eval_examples(run_dir, summary)}, indent=1) + "\n"
        else:
            out[dst] = (run_dir / src).read_bytes()
    return out


def eval_examples(run_dir: Path, summary: dict) -> list[dict]:
    """The first and the last evaluation's completions of the first `SMOLLM2_EXAMPLES` held-out prompts, side by
    side (`run_dir/evals/step<N>.jsonl`, `jaxrl.eval.periodic`)."""
    evals = summary.get("evals") or []
    if len(evals) < 2:
        raise SystemExit(f"{run_dir}: the summary has {len(evals)} evaluations; the recipe evaluates at its start "
                         "and end")
    first, last = ([json.loads(line) for line in (run_dir / "evals" / f"step{e['step']}.jsonl").read_text()
                    .splitlines()] for e in (evals[0], evals[-1]))
    after = {(s["index"], s["sample"]): s for s in last}
    return [{"prompt": s["prompt"], "answer": s["answer"], "before": s["completion"], "reward_before": s["reward"],
             "after": after[s["index"], s["sample"]]["completion"],
             "reward_after": after[s["index"], s["sample"]]["reward"], "step_before": evals[0]["step"],
             "step_after": evals[-1]["step"]} for s in first if s["sample"] == 0][:SMOLLM2_EXAMPLES]


def run(name: str) -> Path:
    overrides, run_dir, _ = RUNS[name]
    path = ROOT / run_dir
    if path.exists():
        raise SystemExit(f"{path} exists (the trainer would resume it): remove it, or copy it with "
                         f"`{Path(__file__).name} {name} --from {run_dir}`")
    extra = [] if name in ("quickstart", "multiturn", "smollm2") else [f"run_dir={run_dir}"]    # the documented commands
    cmd = [sys.executable, "-m", "jaxrl.train", *overrides, *extra]
    print(f"[quickstart_results] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", metavar="RUN", help=f"which runs (default: all of {', '.join(RUNS)})")
    ap.add_argument("--from", dest="src", type=Path, default=None, metavar="RUN_DIR",
                    help="copy this finished run directory instead of running (one RUN)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where to write (default %(default)s)")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.runs or RUNS))
    if set(names) - set(RUNS):
        ap.error(f"unknown run {sorted(set(names) - set(RUNS))}; valid: {', '.join(RUNS)}")
    if args.src is not None and len(names) != 1:
        ap.error(f"--from takes one run directory: name one RUN ({', '.join(RUNS)})")
    written = []
    for name in names:
        files = result_files(name, args.src if args.src is not None else run(name))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for dst, data in files.items():
            path = args.out_dir / dst
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
            written.append(path)
            print(f"[quickstart_results] wrote {path}", file=sys.stderr)
    print("next: scripts/venv.sh python scripts/docs.py", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
