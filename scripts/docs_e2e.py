"""docs/benchmarks.md's end-to-end blocks (jaxrl against TRL, from scripts/results/bench_e2e.json; the
quickstart's cold start, from bench_cold_start.json, and its second run, from bench_warm_start.json), registered into `scripts/docs.py`'s RENDERERS by
`register`."""

from __future__ import annotations

E2E = "bench_e2e.json"
REAL = "bench_real_e2e.json"
PROFILE = "bench_real_profile.json"
COLD = "bench_cold_start.json"
WARM = "bench_warm_start.json"
# The end-to-end issue's targets: the long tail's step against TRL's, the 58M step's fraction of the machine's
# float32 peak, and a whole 7-step run (cold compilation cache) against TRL's.
TARGETS = {"3.2m": {"step_ratio": 0.5}, "58m": {"peak_fraction": 0.75}, "process_ratio_cold": 1.0,
           "first_step_s": 20.0}     # the quickstart's first RL step, from its start on a cold cache
# The real-model issue's targets (SmolLM2-135M-Instruct, scripts/bench_e2e.py --real).
REAL_TARGETS = {"step_ratio": 0.5, "process_ratio_cold": 1.0, "first_step_s": 60.0, "train_fraction": 0.70,
                "decode_roofline_ratio": 1.5}


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
        files = [E2E]
        if (results_dir() / REAL).exists():
            r = load(REAL)["workloads"]["smollm2"]
            parts.append(f"the real model, SmolLM2-135M-Instruct (≤ {r['max_new']} new tokens): step "
                         f"**{r['step_ratio']:.2f}×**, a whole cold {r['hyper']['steps']}-step run "
                         f"{r['process_ratio_cold']:.2f}× ([real model](docs/benchmarks.md#the-real-model-against-trl))")
            files.append(REAL)
        return ("Against TRL 1.16's `GRPOTrainer` on the same HF weights, prompts and reward ([docs/benchmarks.md]"
                "(docs/benchmarks.md#end-to-end-against-trl), `scripts/bench_e2e.py`): " + "; ".join(parts) + ". "
                + footer(*files))


    @renders("e2e-real")
    def e2e_real() -> str:
        """docs/benchmarks.md: the real model against TRL, and the issue's targets (scripts/bench_e2e.py --real)."""
        if not (results_dir() / REAL).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/bench_e2e.py --real`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        d = load(REAL)
        w = d["workloads"]["smollm2"]
        h, lim, runs = w["hyper"], w["limits"], w["runs"]
        med = lambda xs: sorted(xs)[len(xs) // 2]                              # noqa: E731
        first = lambda rs: f"{rs[0]['first_step_done_s']:.0f}" if rs and "first_step_done_s" in rs[0] else "–"  # noqa: E731
        rows = [["TRL 1.16 `GRPOTrainer`", f"{w['trl']['step_s']:.2f} ({w['trl']['generate_s']:.2f} / "
                 f"{w['trl']['train_s']:.2f})", f"{w['trl']['completion_len_mean']:.1f}",
                 " / ".join(f"{r['process_s']:.0f}" for r in runs["trl"]), "–", "1.00"]]
        for key, label, rs in (("jaxrl", "jaxrl (`REAL_ARGS` + `REAL_TRAIN`): cold / warm",
                                runs["jaxrl_cold"] + runs["jaxrl_warm"]),
                               ("jaxrl_default_train", "jaxrl, the train section's defaults (warm)",
                                runs["jaxrl_default_train"])):
            j = w[key]
            rows.append([label, f"{j['step_s']:.2f} ({j['generate_s']:.2f} / {j['train_s']:.2f})",
                         f"{j['completion_len_mean']:.1f}", " / ".join(f"{r['process_s']:.0f}" for r in rs),
                         first(rs), f"**{j['step_s'] / w['trl']['step_s']:.2f}**"])
        ok = lambda good: "✓" if good else "✗"                               # noqa: E731
        t, cold = REAL_TARGETS, runs["jaxrl_cold"][0]
        first_s = cold.get("first_step_done_s", float("inf"))
        jl, tl = lim["jaxrl"], lim["trl"]
        goals = [
            ["median step ÷ TRL's", f"≤ {t['step_ratio']:g}", f"{w['step_ratio']:.2f} {ok(w['step_ratio'] <= t['step_ratio'])}"],
            [f"whole cold {h['steps']}-step process ÷ TRL's", f"≤ {t['process_ratio_cold']:g}",
             f"{w['process_ratio_cold']:.2f} {ok(w['process_ratio_cold'] <= t['process_ratio_cold'])}"],
            ["first RL step done, cold cache (s from start)", f"≤ {t['first_step_s']:.0f}",
             f"{first_s:.0f} {ok(first_s <= t['first_step_s'])}"],
            ["train phase, of the float32 matmul peak: real tokens / as computed (TRL: real / as computed)",
             f"≥ {100 * t['train_fraction']:.0f}%",
             f"{100 * jl['train_ideal_fraction']:.0f}% / {100 * jl['train_computed_fraction']:.0f}% "
             f"{ok(jl['train_ideal_fraction'] >= t['train_fraction'])} (TRL {100 * tl['train_ideal_fraction']:.0f}% / "
             f"{100 * tl['train_computed_fraction']:.0f}%)"],
            [f"rollout per engine step at {lim['decode_rows']} rows ÷ the decode roofline ({lim['decode_roofline_ms']:.1f} ms)",
             f"≤ {t['decode_roofline_ratio']:g}",
             f"{jl['rollout_ms_per_engine_step']:.0f} ms = {jl['decode_roofline_ratio']:.1f}× "
             f"{ok(jl['decode_roofline_ratio'] <= t['decode_roofline_ratio'])}"]]
        how = (f"{h['steps']} steps of {h['prompts_per_step']} prompts × {h['group']} samples, ≤ {w['max_new']} new "
               f"tokens, chat prompts of {w['prompt_len']['mean']:.0f} tokens, lr {h['lr']:g}, clip {h['clip_low']:g}, "
               f"no KL, float32, in the order jaxrl cold, TRL, jaxrl warm, TRL, jaxrl with the default train "
               f"section. Step: each side's median over every step of its runs (rollout / the rest). jaxrl's "
               f"overrides besides the workload's own: `{' '.join(w['jaxrl_args'])}`. The roofline of a decode step: "
               f"the larger of reading the float32 weights once ({lim['weight_read_ms']:.1f} ms at "
               f"{lim['read_gbs']:.0f} GB/s) and its matmuls at the peak ({lim['decode_matmul_ms']:.1f} ms at "
               f"{lim['peak_gflops']:.0f} GFLOP/s); the rollout's seconds per engine step include the prefill, so "
               f"they bound a decode step from above. Load average (1 min) before / after: "
               f"{d['loadavg_before'][0]:.2f} / {d['loadavg_after'][0]:.2f}.")
        return (table(["system", "step s (rollout / train)", "response tokens", f"whole {h['steps']}-step process s",
                       "first step done s", "step ÷ TRL's"], "lrrrrr", rows) + "\n\n"
                + table(["target", "goal", "measured"], "lrr", goals) + "\n\n" + how + "\n\n" + footer(REAL))

    @renders("real-profile")
    def real_profile() -> str:
        """docs/benchmarks.md: where the real model's step goes (scripts/bench_real_profile.py)."""
        if not (results_dir() / PROFILE).exists():
            return ("**Not measured yet:** `scripts/venv.sh python scripts/bench_real_profile.py`, then "
                    "`scripts/venv.sh python scripts/docs.py`.")
        d = load(PROFILE)
        base = next(r for r in d["train"] if r["remat"] == "dots" and r["micro_batches"] == 2)
        rows = [[f"`{r['remat']}`", f"{r['micro_batches']} × {r['rows']} rows ({r['tokens_computed']} tokens)",
                 f"{r['seconds']:.2f}", f"{base['seconds'] / r['seconds']:.2f}×", f"{100 * r['computed_fraction']:.0f}%",
                 f"{100 * r['ideal_fraction']:.0f}%", f"{r['compile_s']:.1f}"] for r in d["train"]]
        th = d["threads"]
        busy = th["seconds_by_busy_threads"]
        alone = ", ".join(f"{k} {v:.2f} s" for k, v in list(th["alone_by_op"].items())[:3])
        dec = d["decode"]
        drows = [[k, f"{v['ms']:.1f}", f"{v['ms'] / dec['roofline_ms']:.1f}×"] for k, v in dec["steps"].items()]
        wl = d["workload"]
        how = (f"The update of bench_e2e's real-model step ({wl['sequences']} sequences of a {wl['prompt']}-token "
               f"prompt and a {wl['response']}-token response, pack length {wl['pack_len']}) on one device, the "
               f"gradient program only, best of interleaved rounds; of peak: FLOPs as computed (every position of "
               f"every row) / real tokens only, ÷ {d['peak']['gflops']:.0f} GFLOP/s. One update of the fastest "
               f"(`{th['remat']}`, {th['rows']} rows, {th['wall_s']:.2f} s) traced: of its XLA:CPU worker threads' "
               f"time line, {busy.get('2', 0):.2f} s had both cores running an op, {busy.get('1', 0):.2f} s one "
               f"and {busy.get('0', 0):.2f} s none; alone the longest: {alone} (a matmul that starts while the "
               f"other core is busy stays on its own core to the end).")
        return (table(["remat", "micro-batches", "update s", "vs default", "of peak, as computed", "of peak, real tokens",
                       "compile s"], "llrrrrr", rows) + "\n\n" + how + "\n\n"
                + table([f"decode, {dec['rows']} rows at context {dec['context']}", "ms", "÷ roofline"], "lrr", drows)
                + f"\n\nRoofline {dec['roofline_ms']:.1f} ms: the larger of reading the weights "
                  f"({dec['weight_read_ms']:.1f} ms) and the matmuls at the peak ({dec['matmul_ms']:.1f} ms)."
                + "\n\n" + footer(PROFILE))

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
