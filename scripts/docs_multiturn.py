"""docs/rollout.md's and docs/multiturn.md's multi-turn blocks, from scripts/results/bench_multiturn.json and the
multi-turn recipe's summary (registered into `scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

BENCH, RUN = "bench_multiturn.json", "multiturn.json"


def register(renders, load, table, footer, spaced, results_dir):
    """`results_dir()`: scripts/docs.py's RESULTS at call time (tests point it elsewhere)."""

    @renders("multiturn")
    def multiturn() -> str:
        d = load(BENCH)
        rows = []
        for t, r in sorted(d["turns"].items(), key=lambda kv: int(kv[0])):
            c, f = r["continuation"], r["reprefill"]
            rows.append([t, spaced(c["prefilled"]), spaced(f["prefilled"]), f"{r['prefill_ratio']:.2f}×",
                         f"{c['seconds_median']:.2f}", f"{f['seconds_median']:.2f}", f"{r['speedup']:.2f}×",
                         "yes" if r["tokens_identical"] else "**no**"])
        return (table(["turns", "prefilled, continuation", "prefilled, re-prefill", "ratio", "s, continuation",
                       "s, re-prefill", "speed-up", "same tokens"], "rrrrrrrl", rows)
                + f"\n\n{d['trajectories']} greedy trajectories of the {d['model']} model: {d['prompt']}-token "
                  f"prompts, {d['gen']} sampled tokens per turn, a {d['obs']}-token observation after each turn but "
                  f"the last; seconds are medians of {d['repeats']} interleaved repeats.\n\n" + footer(BENCH))

    @renders("multiturn-run")
    def multiturn_run() -> str:
        """configs/multiturn.yaml's run (scripts/quickstart_results.py multiturn): reward and tool use over RL."""
        if not (results_dir() / RUN).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/quickstart_results.py multiturn`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        q = load(RUN)
        f = lambda x, spec: "–" if x is None else format(x, spec)        # noqa: E731

        def span(key, spec):
            return f"{f(q.get(key + '_first'), spec)} → {f(q.get(key + '_last'), spec)}"

        wall = q["wall_s"]
        rows = [["command (warm start, then RL)", f"`{q['command']}`"],
                ["wall time", f"{int(wall // 60)} min {wall % 60:.0f} s" if wall is not None else "not recorded"],
                [f"mean reward, first 20% of RL steps ({q['window_steps']}) → last 20%", span("reward_mean", ".3f")],
                ["pass rate (exact products), first 20% → last 20%", span("pass_rate", ".3f")],
                ["tool success (calls that ran, of all calls), first 20% → last 20%", span("env/tool_success", ".2f")],
                ["tool calls per trajectory, first 20% → last 20%", span("env/tool_calls_mean", ".2f")],
                ["malformed tool calls per step, first 20% → last 20%", span("env/format_errors", ".1f")],
                ["turns per trajectory, first 20% → last 20%", span("env/turns_mean", ".2f")],
                ["RL step, median (rollout with the tool calls + update)",
                 f"{f(q['step_seconds_median'], '.2f')} s (rollout {f(q['rollout_s_median'], '.2f')} s + update "
                 f"{f(q['train_s_median'], '.2f')} s)"],
                ["XLA compilations after RL step 0", f(q.get("compiles_after_step0"), ".0f")]]
        return table(["figure", "value"], "ll", rows) + "\n\n" + footer(RUN)
