"""docs/benchmarks.md's end-to-end block (jaxrl against TRL), from scripts/results/bench_e2e.json (registered
into `scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

E2E = "bench_e2e.json"
# The end-to-end issue's targets: the long tail's step against TRL's, the 58M step's fraction of the machine's
# float32 peak, and a whole 7-step run (cold compilation cache) against TRL's.
TARGETS = {"3.2m": {"step_ratio": 0.5}, "58m": {"peak_fraction": 0.75}, "process_ratio_cold": 1.0}


def register(renders, load, table, footer, results_dir):
    """`results_dir()`: scripts/docs.py's RESULTS at call time (tests point it elsewhere)."""

    @renders("e2e")
    def e2e() -> str:
        if not (results_dir() / E2E).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/bench_e2e.py`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        d = load(E2E)
        ok = lambda good: "✓" if good else "✗"                               # noqa: E731
        rows = []
        for name, w in d["workloads"].items():
            j, t, goal = w["jaxrl"], w["trl"], TARGETS.get(name, {})
            ratio = f"**{w['step_ratio']:.2f}**" + (f" {ok(w['step_ratio'] <= goal['step_ratio'])} (≤ "
                                                     f"{goal['step_ratio']:g})" if "step_ratio" in goal else "")
            peak = f"{100 * t.get('peak_fraction', 0):.0f}% / {100 * j.get('peak_fraction', 0):.0f}%"
            if "peak_fraction" in goal:
                peak += f" {ok(j.get('peak_fraction', 0) >= goal['peak_fraction'])} (≥ {100 * goal['peak_fraction']:.0f}%)"
            cold, warm = w["runs"]["jaxrl_cold"][0]["process_s"], [r["process_s"] for r in w["runs"]["jaxrl_warm"]]
            trl_proc = sorted(t["process_s"])[len(t["process_s"]) // 2]
            proc = f"{trl_proc:.0f} / {cold:.0f}" + (f" / {warm[0]:.0f}" if warm else "")
            pr = w["process_ratio_cold"]
            rows.append([f"{name.upper()}, ≤ {w['max_new']} new tokens, {w['sequences']} sequences",
                         f"{t['step_s']:.2f} ({t['generate_s']:.2f} / {t['train_s']:.2f})",
                         f"{j['step_s']:.2f} ({j['generate_s']:.2f} / {j['train_s']:.2f})", ratio,
                         f"{t['completion_len_mean']:.0f} / {j['completion_len_mean']:.0f}", peak, proc,
                         f"{pr:.2f} {ok(pr <= TARGETS['process_ratio_cold'])}"])
        h, peak = d["hyper"], d.get("peak") or {}
        how = (f"Each side's median step over {h['steps']} steps of every run (TRL: 2 runs; jaxrl: a cold and a warm "
               f"run), split into rollout (TRL: `generate`) and the rest; response tokens: each side's mean per "
               f"response (both sample the same distribution, mean ≈ 66 before the cap; where TRL's came out "
               f"shorter it did less work, so its step is flattered). Of peak: the "
               f"step's FLOPs (counted as computed: causal attention, the LM head on response tokens only; "
               f"`scripts/bench_e2e.py`) ÷ its seconds ÷ {peak.get('gflops', 0):.0f} GFLOP/s, this machine's float32 "
               f"matmul measured at the start. Whole process: start to exit of `python -m jaxrl.train` (cold: an "
               f"empty compilation cache, a user's first run; warm: the same command again) and of TRL's script. "
               f"Load average (1 min) before / after: {d['loadavg_before'][0]:.2f} / {d['loadavg_after'][0]:.2f}.")
        return (table(["workload", "TRL step s (generate / rest)", "jaxrl step s (rollout / train)",
                       "jaxrl / TRL step", "response tokens, TRL / jaxrl", "of peak, TRL / jaxrl",
                       f"whole {h['steps']}-step run s: TRL / jaxrl cold / warm", "cold / TRL (≤ 1.0)"],
                      "lrrrrrrr", rows) + "\n\n" + how + "\n\n" + footer(E2E))

    @renders("e2e-summary")
    def e2e_summary() -> str:
        """The README's one paragraph: each workload's step and cold whole-run ratio against TRL."""
        if not (results_dir() / E2E).exists():
            return "Against TRL: not measured yet (`scripts/venv.sh python scripts/bench_e2e.py`)."
        d = load(E2E)
        parts = [f"{name.upper()} (≤ {w['max_new']} new tokens): step **{w['step_ratio']:.2f}×** TRL's, a whole cold "
                 f"{d['hyper']['steps']}-step run {w['process_ratio_cold']:.2f}×" for name, w in d["workloads"].items()]
        return ("Against TRL 1.16's `GRPOTrainer` on the same HF weights, prompts and reward ([docs/benchmarks.md]"
                "(docs/benchmarks.md#end-to-end-against-trl), `scripts/bench_e2e.py`): " + "; ".join(parts) + ". "
                + footer(E2E))

