"""docs/opd.md's recipe block: on-policy distillation against GRPO on the CPU, from scripts/results/bench_opd.json
(`scripts/bench_opd.py`; registered into `scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

RUN = "bench_opd.json"


def _commit(d: dict) -> str:
    c = (d.get("provenance") or {}).get("commit")
    if not c:
        return "commit not recorded"
    return f"commit `{c['sha'][:10]}`" + (" with uncommitted changes" if c.get("dirty") else "")


def register(renders, load, table, footer, results_dir):
    """`results_dir()`: scripts/docs.py's RESULTS at call time (tests point it elsewhere)."""

    @renders("opd-recipe")
    def opd_recipe() -> str:
        if not (results_dir() / RUN).exists():
            return "**Not measured yet:** `scripts/venv.sh python scripts/bench_opd.py`, then `scripts/venv.sh python scripts/docs.py`."
        d = load(RUN)
        arms = d["arms"]
        rows = [["student", f"the teacher's first {d['layers']} decoder layers, warm-started for {d['sft_steps']} "
                            f"steps on the teacher's greedy answers to {d['prompts']} training prompts"],
                ["teacher's held-out accuracy (greedy)", f"{d['teacher_heldout_accuracy']:.2f}"],
                ["RL budget per arm (minutes of RL steps; the warm-up's compilation not counted)", f"{d['budget_min']:g}"]]
        head = ["", *arms]
        body = [
            ["RL steps in the budget (median step)", *(f"{a['steps']} ({a['step_s_median']:.1f} s)" for a in arms.values())],
            ["held-out accuracy, greedy: first → last evaluation",
             *(f"{a['evals'][0]['accuracy']:.2f} → **{a['evals'][-1]['accuracy']:.2f}**" for a in arms.values())],
            ["held-out accuracy, sampled at temperature 1: before → after",
             *(f"{d['before']['accuracy_sampled']:.2f} → {a['after']['accuracy_sampled']:.2f}" for a in arms.values())],
            ["held-out reverse KL to the teacher per token: before → after",
             *(f"{d['before']['reverse_kl']:.3f} → **{a['after']['reverse_kl']:.3f}**" for a in arms.values())],
            ["held-out accuracy at each evaluation (minutes: accuracy)",
             *(", ".join(f"{e['minutes']:.1f}: {e['accuracy']:.2f}" for e in a["evals"]) for a in arms.values())],
        ]
        return (table(["setting", "value"], "ll", rows) + "\n\n" + table(head, "l" * len(head), body) + "\n\n"
                + footer(RUN).replace(". Rendered", f", {_commit(d)}. Rendered"))
