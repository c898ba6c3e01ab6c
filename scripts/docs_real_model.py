"""docs/real_model.md's recipe block: SmolLM2-135M-Instruct trained on the `arith` task (configs/smollm2_arith.yaml),
from scripts/results/smollm2_arith.json (`scripts/quickstart_results.py smollm2`; registered into
`scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

RUN = "smollm2_arith.json"


def _commit(q: dict) -> str:
    c = q.get("commit")
    if not c:
        return "commit not recorded"
    return f"commit `{c['sha'][:10]}`" + (" with uncommitted changes" if c.get("dirty") else "")


def _cell(text: str, limit: int = 140) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def register(renders, load, table, footer, results_dir):
    """`results_dir()`: scripts/docs.py's RESULTS at call time (tests point it elsewhere)."""

    @renders("smollm2-recipe")
    def smollm2_recipe() -> str:
        if not (results_dir() / RUN).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/quickstart_results.py smollm2`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        q = load(RUN)
        evals = q["evals"]
        first, last = evals[0], evals[-1]
        wall = q["wall_s"]
        f3 = lambda x: "–" if x is None else f"{x:.3f}"               # noqa: E731
        rows = [
            ["command", f"`{q['command']}`"],
            [f"held-out accuracy, greedy ({first['eval/prompts']} prompts never trained), after {first['step']} → "
             f"{last['step']} updates", f"**{first['eval/accuracy']:.2f} → {last['eval/accuracy']:.2f}** "
             f"({last['eval/accuracy'] - first['eval/accuracy']:+.2f})"],
            ["held-out accuracy at each evaluation (updates: accuracy)",
             ", ".join(f"{e['step']}: {e['eval/accuracy']:.2f}" for e in evals)],
            ["held-out mean response length, first → last evaluation",
             f"{first['eval/len_mean']:.1f} → {last['eval/len_mean']:.1f} tokens"],
            [f"training reward, first {q['window_steps']} → last {q['window_steps']} RL steps",
             f"{f3(q['reward_mean_first'])} → {f3(q['reward_mean_last'])}"],
            ["RL step, median (rollout + update)",
             f"{q['step_seconds_median']:.1f} s ({q['rollout_s_median']:.1f} + {q['train_s_median']:.1f} s)"],
            ["wall time of the whole run (load, compile, evaluations, RL steps, checkpoints, HF export)",
             "not recorded" if wall is None else f"{int(wall // 60)} min {wall % 60:.0f} s"],
            ["XLA compilations after RL step 0", f"{q.get('compiles_after_step0', 0):.0f}"],
        ]
        ex = [[_cell(e["prompt"], 40), e["answer"], f"{_cell(e['before'])} ({e['reward_before']:.0f})",
               f"{_cell(e['after'])} ({e['reward_after']:.0f})"] for e in q.get("examples", [])]
        before_after = ""
        if ex:
            s0, s1 = q["examples"][0]["step_before"], q["examples"][0]["step_after"]
            before_after = ("\n\nGreedy completions of the first held-out prompts, after "
                            f"{s0} and after {s1} updates (reward in brackets):\n\n"
                            + table(["prompt", "answer", "before", "after"], "llll", ex))
        return (table(["figure", "value"], "ll", rows) + before_after + "\n\n"
                + footer(RUN).replace(". Rendered", f", {_commit(q)}. Rendered"))
