"""docs/benchmarks.md's end-to-end blocks (jaxrl against TRL, from scripts/results/bench_e2e.json; the
quickstart's cold start, from bench_cold_start.json, and its second run, from bench_warm_start.json), registered into `scripts/docs.py`'s RENDERERS by
`register`."""

from __future__ import annotations

E2E = "bench_e2e.json"
COLD = "bench_cold_start.json"
WARM = "bench_warm_start.json"
# The end-to-end issue's targets: the long tail's step against TRL's, the 58M step's fraction of the machine's
# float32 peak, and a whole 7-step run (cold compilation cache) against TRL's.
TARGETS = {"3.2m": {"step_ratio": 0.5}, "58m": {"peak_fraction": 0.75}, "process_ratio_cold": 1.0,
           "first_step_s": 20.0}     # the quickstart's first RL step, from its start on a cold cache


def register(renders, load, table, footer, results_dir, machines):
    """`results_dir()`: scripts/docs.py's RESULTS at call time (tests point it elsewhere); `machines`: its
    `per_machine` (a table of the targets on every machine a benchmark ran on)."""

    def e2e_cells(d):
        ok = lambda good: "✓" if good else "✗"                               # noqa: E731
        w3, w58 = d["workloads"].get("3.2m"), d["workloads"].get("58m")
        cells = [f"{w3['step_ratio']:.2f} {ok(w3['step_ratio'] <= TARGETS['3.2m']['step_ratio'])}" if w3 else "–",
                 f"{100 * w58['jaxrl']['peak_fraction']:.0f}% "
                 f"{ok(w58['jaxrl']['peak_fraction'] >= TARGETS['58m']['peak_fraction'])}" if w58 else "–"]
        cells += [" / ".join(f"{w['process_ratio_cold']:.2f}" for w in (w3, w58) if w)
                  + f" {ok(all(w['process_ratio_cold'] <= TARGETS['process_ratio_cold'] for w in (w3, w58) if w))}",
                  f"{d['peak']['gflops']:.0f}" if d.get("peak") else "–"]
        return cells

    def cold_cells(d):
        m = d["summary"]["modes"]
        first = m["background"]["first_step_s"]
        return [f"{first:.1f} {'✓' if first <= TARGETS['first_step_s'] else '✗'}",
                f"{m['blocking']['first_step_s']:.1f}", f"{m['background']['process_s']:.1f}"]

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
                      "lrrrrrrr", rows) + "\n\n" + how + "\n\n" + footer(E2E) + "\n\n"
                + machines(E2E, ["3.2M step ÷ TRL's (≤ 0.5)", "58M of peak (≥ 75%)",
                                 "cold whole run ÷ TRL's, 3.2M / 58M (≤ 1.0)", "peak GFLOP/s"], e2e_cells))

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


    @renders("cold-start")
    def cold_start() -> str:
        """docs/benchmarks.md: the quickstart's first RL step on a cold compilation cache, with and without the
        warm-up's background compilation (scripts/bench_cold_start.py)."""
        if not (results_dir() / COLD).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/bench_cold_start.py`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        d = load(COLD)
        s, rows = d["summary"], []
        for mode, label in (("blocking", "everything before step 0 (`background_compile=false`)"),
                            ("background", "step 0's shapes on a thread beside the warm start, the rest after step 0 (default)"),
                            ("llvm3", "the default at XLA's LLVM level 3 (`XLA_FLAGS=--xla_backend_optimization_level=3`)")):
            runs = [r for r in d["runs"] if r["mode"] == mode]
            m = s["modes"][mode]
            first = m["first_step_s"]
            goal = f" {'✓' if first <= TARGETS['first_step_s'] else '✗'}" if mode == "background" else ""
            wait = [r["background_wait_s"] for r in runs if r["background_wait_s"] is not None]
            rows.append([label, f"**{first:.1f}**{goal}", f"{m['second_step_s']:.1f}",
                         f"{runs[0]['warmup_executables']} in {min(r['warmup_s'] for r in runs):.1f} s",
                         f"{m['step0_blocking_compiles']:.0f}", f"{m['background_compiles']:.0f}",
                         f"{min(wait):.1f}" if wait else "–", f"{m['later_blocking_compiles']:.0f}",
                         f"{m['process_s']:.1f}"])
        n = len(d["runs"]) // len(s["modes"])
        diff = ", ".join(f"{k} {v:.1e}" for k, v in s["llvm3_max_rel_diff"].items())
        how = (f"Median of {n} cold run{'s' * (n > 1)} of each (`{d['command']}`, an empty compilation cache each, "
               f"interleaved). First / second step: seconds from the process's start to the end of RL step 0 / 1; "
               f"warm-up: what it compiled before step 0 (fewest seconds of the runs); step 0's blocking compilations "
               f"include the warm start's and the warm-up's; step 1's wait: for the thread (fewest seconds). "
               f"First step {s['first_step_speedup']:.2f}× sooner, whole run {s['process_ratio']:.2f}× the blocking "
               f"one's; the same rewards, losses and gradient norms at every step: "
               f"{'yes' if s['same_training'] else '**no**'}. At XLA's own LLVM level 3 instead of the level 1 a CPU "
               f"run compiles at (`jaxrl.runtime.cpu_compile_level`): first step {s['llvm3_first_step_ratio']:.2f}×, "
               f"whole run {s['llvm3_process_ratio']:.2f}× level 1's; the same rollouts: "
               f"{'yes' if s['llvm3_same_rollouts'] else '**no**'}; largest relative difference from level 1's: "
               f"{diff}. Target: the first step within "
               f"{TARGETS['first_step_s']:.0f} s of the start. Load average (1 min) before / after: "
               f"{d['loadavg_before'][0]:.2f} / {d['loadavg_after'][0]:.2f}.")
        return (table(["warm-up", "first step s", "second step s", "warm-up executables", "step 0 blocking compiles",
                       "background compiles", "step 1 waits s", "later blocking compiles",
                       f"whole {d['steps']}-step run s"], "lrrrrrrrr", rows) + "\n\n" + how + "\n\n" + footer(COLD)
                + "\n\n" + machines(COLD, [f"first step s (≤ {TARGETS['first_step_s']:.0f})",
                                            "first step s, everything before step 0", "whole run s"], cold_cells))

    @renders("warm-start")
    def warm_start() -> str:
        """docs/benchmarks.md: the quickstart's second run on the cache its first filled, with and without the
        executable store (scripts/bench_warm_start.py)."""
        if not (results_dir() / WARM).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/bench_warm_start.py`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        d = load(WARM)
        s, rows = d["summary"], []
        for mode, label in (("no_store", "JAX's persistent cache alone (`JAXRL_EXECUTABLE_STORE=0`)"),
                            ("store", "with the executable store (default)")):
            m = s["modes"][mode]
            rows.append([label, f"**{m['first_step_s']:.1f}**", f"{m['process_s']:.1f}",
                         f"{m['trace_s']:.1f} / {m['lower_s']:.1f} / {m['compile_s']:.1f} / {m['load_s']:.1f}",
                         f"{m['rollout_trace_s']:.1f} / {m['rollout_lower_s']:.1f} / {m['rollout_load_s']:.1f}",
                         f"{m['rollout_traces']:.0f}", f"{m['rollout_loads']:.0f}"])
        n = len(d["runs"]) // len(s["modes"])
        p = d["prime"]
        how = (f"Median of {n} run{'s' * (n > 1)} of each (`{d['command']}`, interleaved), all on the compilation "
               f"cache a first, cold run filled (first step {p['first_step_s']:.1f} s, whole run "
               f"{p['process_s']:.1f} s; not counted). Program seconds: `jaxrl.compile_log`'s wall seconds per thread "
               f"(a run builds on several threads at once, so they overlap and can exceed the run's own time); "
               f"rollout: its prefill and decode steps. First step {s['first_step_ratio']:.2f}×, whole run "
               f"{s['process_ratio']:.2f}× the run without the store; the same rewards, losses and gradient norms "
               f"at every step: {'yes' if s['same_training'] else '**no**'}. Load average (1 min) before / after: "
               f"{d['loadavg_before'][0]:.2f} / {d['loadavg_after'][0]:.2f}.")
        return (table(["second run", "first step s", f"whole {d['steps']}-step run s",
                       "all programs: trace / lower / compile / load s", "rollout steps: trace / lower / load s",
                       "rollout steps traced", "rollout steps loaded"], "lrrrrrr", rows)
                + "\n\n" + how + "\n\n" + footer(WARM))
