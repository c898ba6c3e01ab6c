"""StreamRL's output-length ranker (§5.2) on the built-in long-tail tasks: recall of the longest 20% and
Kendall tau on held-out prompts.

    python scripts/bench_ranker.py                                 # writes scripts/results/bench_ranker.{json,png}
    python scripts/bench_ranker.py --quick --out /tmp/r.json       # smoke sizes (< 60 s)
    python scripts/bench_ranker.py --pairs run/pairs.jsonl         # lengths a training run observed

Prompts are the built-in tasks (`jaxrl.data.tasks.make_suite` over `BUILTIN_TASKS`, cycling copy, reverse,
sort, repeat, add) in the char tokenizer's chat template, as the trainer encodes them. The length of a
prompt's response (`"source"` in the JSON) is, by default, its reference answer + 1 (EOS): the response of a
policy that solves the tasks. That length is a deterministic function of the prompt (the letters to copy,
"rep ab 7" = 14, the digits of a sum), so this measures whether the ranker can learn the rule, not how it
copes with a sampled policy's spread; `--pairs FILE` (JSONL `{"tokens": [...], "length": n}`, an optional
`"task"`) ranks the lengths a real run observed: its first `--train` rows are the history, the next `--eval`
rows the held-out set.

Online schedule (§5.2's refresh with the latest rollouts): the `--train` pairs arrive in `--refreshes`
equal chunks; after each chunk the ranker observes it and refreshes (continues training for
`--train-steps` Adam steps). After every refresh the `--eval` prompts, never observed, are ranked:
`recall_top20` = |predicted top 20% ∩ true top 20%| / k (ties in the true lengths break by index, so many
prompts tied at the cut cap what any ranker can score: `data.recall_ceiling_random_ties`), `kendall_tau` =
tau-b. The JSON's top-level figures are the last refresh's; `per_task` holds each task's tau and recall within its own prompts, and
`baselines` the same figures for the prompt length as the predictor and for random scores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_harness import write_result  # noqa: E402

# its files in scripts/results/ (tests/test_docs.py)
OUTPUTS = ("bench_ranker.json", "bench_ranker.png", "bench_ranker_run.json", "bench_ranker_run.png")


def builtin_pairs(n: int, seed: int) -> tuple[list[list[int]], list[int], list[str]]:
    """(prompt ids, reference answer length + 1, task) of n built-in examples."""
    from jaxrl.data import BUILTIN_TASKS, demonstration, encode_prompts, make_suite
    from models import load_tokenizer

    tok = load_tokenizer("char")
    examples = make_suite(sorted(BUILTIN_TASKS), n, seed)
    lengths = [len(tok.encode(demonstration(ex))) + 1 for ex in examples]
    return encode_prompts(examples, tok, chat=True), lengths, [ex.task for ex in examples]


def file_pairs(path: str) -> tuple[list[list[int]], list[int], list[str]]:
    prompts, lengths, tasks = [], [], []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    prompts.append(list(row["tokens"]))
                    lengths.append(int(row["length"]))
                    tasks.append(str(row.get("task", "all")))
                except (ValueError, KeyError, TypeError) as e:
                    raise SystemExit(f"{path}:{no}: bad pair row ({type(e).__name__}: {e})") from None
    return prompts, lengths, tasks


def scores(pred, true) -> dict:
    from jaxrl.rollout.ranker import kendall_tau, recall_top

    return {"recall_top20": recall_top(pred, true, 0.2), "kendall_tau": kendall_tau(pred, true)}


def recall_ceiling(true) -> float:
    """Expected recall@20% of a ranker that knows every length but orders tied lengths at random (the
    metric breaks true ties by index): all prompts above the cut, plus need^2 / tied of those at it."""
    true = np.asarray(true)
    k = math.ceil(0.2 * len(true))
    cut = np.sort(true)[::-1][k - 1]
    above, tied = int((true > cut).sum()), int((true == cut).sum())
    return (above + (k - above) ** 2 / tied) / k


def run(args) -> dict:
    from jaxrl.rollout.ranker import LengthRanker

    t_start = time.perf_counter()
    if args.pairs:
        prompts, lengths, tasks = file_pairs(args.pairs)
        if len(prompts) < args.train + args.eval:          # a short file: three quarters history, the rest held out
            args.eval = max(2, len(prompts) // 4)
            args.train = len(prompts) - args.eval
        source = f"pairs file {args.pairs}: observed response lengths"
    else:
        prompts, lengths, tasks = builtin_pairs(args.train + args.eval, args.seed)
        source = ("builtin: reference answer length + 1 (EOS) of each example, the response lengths of a policy "
                  "that solves the tasks (deterministic in the prompt)")
    n_tr = args.train
    ev = slice(n_tr, n_tr + args.eval)
    ev_p, ev_l, ev_t = prompts[ev], np.asarray(lengths[ev]), tasks[ev]
    max_len = args.max_prompt_len or -(-max(len(p) for p in prompts[:n_tr + args.eval]) // 8) * 8
    ranker = LengthRanker(max_len, buckets=args.buckets, d_model=args.d_model, layers=args.layers, heads=args.heads,
                          lr=args.lr, train_steps=args.train_steps, batch=args.batch, history=args.history,
                          holdout=args.holdout, seed=args.seed)
    history, chunk = [], -(-n_tr // args.refreshes)
    for i in range(args.refreshes):
        ranker.observe(prompts[i * chunk:min(n_tr, (i + 1) * chunk)], lengths[i * chunk:min(n_tr, (i + 1) * chunk)])
        stats = ranker.refresh()
        t = time.perf_counter()
        pred = ranker.predict(ev_p)
        row = {"refresh": stats["refreshes"], "observed": ranker.count, **scores(pred, ev_l),
               "predict_s": time.perf_counter() - t, "internal": stats}
        history.append(row)
        print(f"refresh {row['refresh']}: {row['observed']} pairs observed, held-out recall@20% "
              f"{row['recall_top20']:.3f} tau {row['kendall_tau']:.3f} (internal {stats['recall_top20']:.3f} / "
              f"{stats['kendall_tau']:.3f}, loss {stats['loss']:.3f}, {stats['seconds']:.1f} s)", flush=True)
    per_task = {}
    for name in sorted(set(ev_t)):
        idx = [j for j, t in enumerate(ev_t) if t == name]
        per_task[name] = {"n": len(idx), "median_length": float(np.median(ev_l[idx])), **scores(pred[idx], ev_l[idx])}
    cut = np.sort(ev_l)[::-1][math.ceil(0.2 * len(ev_l)) - 1]
    rng = np.random.default_rng(args.seed)
    return {"recall_top20": history[-1]["recall_top20"], "kendall_tau": history[-1]["kendall_tau"], "source": source,
            "per_task": per_task, "history": history,
            "baselines": {"prompt_length": scores([len(p) for p in ev_p], ev_l),
                          "random": scores(rng.random(len(ev_l)), ev_l)},
            "data": {"train_pairs": n_tr, "eval_prompts": len(ev_p), "max_prompt_len": max_len,
                     "eval_length_median": float(np.median(ev_l)), "eval_length_p80": float(np.percentile(ev_l, 80)),
                     "eval_length_p99": float(np.percentile(ev_l, 99)), "top20_cut_length": int(cut),
                     "eval_at_cut_length": int((ev_l == cut).sum()), "eval_above_cut": int((ev_l > cut).sum()),
                     "recall_ceiling_random_ties": recall_ceiling(ev_l)},
            "config": {**ranker.config, "refreshes": args.refreshes, "quick": args.quick},
            "train_seconds": sum(h["internal"]["seconds"] for h in history), "seconds": time.perf_counter() - t_start,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = out["history"]
    x = [r["observed"] for r in h]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(x, [r["recall_top20"] for r in h], "o-", color="tab:red", label="recall@top 20% (eval)")
    ax.plot(x, [r["kendall_tau"] for r in h], "s-", color="tab:blue", label="Kendall tau (eval)")
    ax.plot(x, [r["internal"]["recall_top20"] for r in h], "o--", color="tab:red", alpha=0.4,
            label="recall (history held-out)")
    ax.plot(x, [r["internal"]["kendall_tau"] for r in h], "s--", color="tab:blue", alpha=0.4,
            label="tau (history held-out)")
    ax.axhline(0.9, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("pairs observed (one refresh per point)")
    ax.set_ylim(min(0.5, *[r["kendall_tau"] for r in h]) - 0.05, 1.02)
    ax.set_title(f"length ranker: recall@20% {out['recall_top20']:.3f}, tau {out['kendall_tau']:.3f} "
                 f"on {out['data']['eval_prompts']} unseen prompts", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_ranker.json"))
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, < 60 s)")
    ap.add_argument("--pairs", default=None, help="JSONL of {tokens, length[, task]} rows (default: built-in tasks)")
    ap.add_argument("--train", type=int, default=None, help="pairs observed (the history), default 3000")
    ap.add_argument("--eval", type=int, default=None, help="held-out prompts never observed, default 1000")
    ap.add_argument("--refreshes", type=int, default=None, help="the history arrives in this many chunks")
    ap.add_argument("--train-steps", type=int, default=None, help="Adam steps per refresh")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--buckets", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--holdout", type=float, default=0.2, help="fraction of the history the ranker scores itself on")
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--max-prompt-len", type=int, default=None, help="default: longest prompt, rounded up to 8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    args.train = args.train or (600 if q else 3000)
    args.eval = args.eval or (200 if q else 1000)
    args.refreshes = args.refreshes or (2 if q else 6)
    args.train_steps = args.train_steps if args.train_steps is not None else (40 if q else 200)
    out = run(args)
    path = write_result(args.out, out)
    plot(out, path.with_suffix(".png"))
    print(f"recall@top20% {out['recall_top20']:.3f}, Kendall tau {out['kendall_tau']:.3f} on "
          f"{out['data']['eval_prompts']} held-out prompts ({out['seconds']:.0f} s); wrote {path}")
    return out


if __name__ == "__main__":
    main()
