"""docs/simulator.md's rendered blocks: the simulator's validation against the real engine, the cluster-scale tables
(`scripts/bench_sim_cluster.py`) and the fit's fitted and held-out points (`scripts/sim_fit.py`); registered into
`scripts/docs.py`'s RENDERERS by `register`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = "bench_sim_cluster.json"
SIM_WHO = ("simulated on the analytic GPU presets (`jaxrl/sim/hardware.py`; virtual time); the host that ran "
           "the simulator: not recorded")
SIM_FIT = "sim_fit.json"


def register(renders, load, table, footer, machine, load_module):
    @renders("sim-validation")
    def sim_validation() -> str:
        d = load("bench_sim_validation.json")
        rows = []
        for r in d["rows"]:
            real = [s["real"] for s in r["steps"]]
            sim = [s["sim"] for s in r["steps"]]
            rows.append([f"{r['row']} (TP{real[0]['tp']})", len(real), "/".join(s["kind"] for s in real),
                         sum(s["engine_steps"] for s in real), sum(s["preemptions"] for s in real),
                         sum(s["switches"] for s in real), "yes" if r["counts_equal"] else "**no**",
                         f"{r['rollout_s_real']:.2f}", f"{r['rollout_s_sim']:.2f}",
                         f"{r['rollout_s_sim'] / r['rollout_s_real'] - 1:+.1%}"])
            assert sum(s["engine_steps"] for s in sim) == rows[-1][3] or not r["counts_equal"]
        return (table(["row (start layout)", "steps", "round types", "engine steps", "preemptions", "PAT switches",
                       "counts equal", "rollout s, measured", "rollout s, simulated", "error"], "llllllllll", rows)
                + f"\n\nAll rows together: {d['total_time_error']:+.1%}; the largest single-step error "
                  f"{d['max_abs_time_error']:.0%}. The model: {d['model_params']:,} parameters (`model_params`)."
                  "\n\n" + footer("bench_sim_validation.json"))

    def _sim():
        """bench_sim_cluster.py's own table functions (one formatting for its .md and for these pages)."""
        return load_module("bench_sim_cluster", ROOT / "scripts" / "bench_sim_cluster.py"), load(SIM)

    def _sim_block(text: str) -> str:
        return text.rstrip("\n") + "\n\n" + footer(SIM, who=SIM_WHO)

    def _sim_pat(run: str, cap: int) -> str:
        """One PAT recipe's table (responses capped at `cap` tokens)."""
        b, d = _sim()
        return _sim_block(b.pat_table(run, d[run]["summary"], cap)[0])

    def _sim_summary(run: str) -> str:
        """One recipe's rows, as jaxrl/sim/report.py prints them."""
        report = load_module("jaxrl_sim_report", ROOT / "jaxrl" / "sim" / "report.py")
        return _sim_block(report.table(_sim()[1][run]["summary"]["rows"]))

    renders("sim-pat-llama8b")(lambda: _sim_pat("pat_llama8b_h100", 24576))
    renders("sim-pat-qwen14b")(lambda: _sim_pat("pat_qwen3_14b_h100", 16384))
    renders("sim-rollpacker-14b")(lambda: _sim_summary("rollpacker_qwen25_14b_h800"))
    renders("sim-streamrl")(lambda: _sim_summary("streamrl_qwen25_14b_h800"))

    @renders("sim-pat-nodes")
    def sim_pat_nodes() -> str:
        b, d = _sim()
        return _sim_block(b.sweep_table(d["pat_llama8b_h100_nodes"]["summary"], ["baseline", "pat"]))

    @renders("sim-rollpacker-ladder")
    def sim_rollpacker_ladder() -> str:
        b, d = _sim()
        names = ("rollpacker_qwen25_7b_h800", "rollpacker_qwen25_14b_h800", "rollpacker_qwen25_32b_h800")
        return _sim_block(b.ladder_table({n: d[n]["summary"] for n in names}))

    @renders("sim-rollpacker-scale")
    def sim_rollpacker_scale() -> str:
        b, d = _sim()
        return _sim_block(b.sweep_table(d["rollpacker_scale_14b_h800"]["summary"], ["baseline", "rollpacker"],
                                        "prompts_per_s"))

    @renders("sim-distflow")
    def sim_distflow() -> str:
        b, d = _sim()
        return _sim_block(b.sweep_table(d["distflow_qwen25_7b_h100"]["summary"], ["baseline", "distflow"]))

    def _sim_fit_footer(d: dict) -> str:
        return (f"*Computed from the code and the committed simulator runs (`scripts/results/{SIM}`); no figure "
                f"depends on the machine that computed it ({machine(d)}). Rendered from `scripts/results/{SIM_FIT}` "
                f"by `scripts/docs.py`.*")

    @renders("sim-fit-fitted")
    def sim_fit_fitted() -> str:
        d = load(SIM_FIT)
        def used(points):
            by = {}
            for p in points:
                by.setdefault((p["paper"], p["where"], p["units"]), []).append(f"{p['value']:g}")
            return "; ".join(f"{paper} {where}: {', '.join(v)} {units}" for (paper, where, units), v in by.items())

        rows = [[f"`{f['constant']}`", f"{f['value']:.4g}", f"{f['in_use']:.4g}", f"{f['in_use_vs_fit']:+.1%}"
                 + (" (stale)" if f["tolerance"].startswith("stale") else ""), used(f["points"])] for f in d["fitted"]]
        return (table(["constant", "fitted", "in use", "in use vs fit", "points it is fitted to"], "lrrrl", rows)
                + "\n\n" + _sim_fit_footer(d))

    @renders("sim-fit-held-out")
    def sim_fit_held_out() -> str:
        d = load(SIM_FIT)
        rows = [[h["what"], f"{h['paper']} {h['figure']}", f"{h['published']:g} {h['units']}", f"{h['simulated']:.3g}",
                 f"`{h['simulated_by']}`", f"{h['rel_error']:+.1%}", h["verdict"]] for h in d["held_out"]]
        within = sum(abs(h["rel_error"]) <= 0.15 for h in d["held_out"])
        return (table(["point", "paper, figure", "published", "simulated", "simulated by", "error", "verdict"],
                      "llrrlrl", rows)
                + f"\n\n{within} of {len(rows)} held-out points within 15%.\n\n" + _sim_fit_footer(d))

    @renders("sim-async")
    def sim_async() -> str:
        b, d = _sim()
        by_k = {k: d[f"async_qwen25_7b_h100_k{k}"]["summary"] for k in b.ASYNC_K}
        text, points = b.async_table(by_k, d["async_qwen25_7b_h100_sync"]["summary"])
        paper = d["async"]["paper"]
        verl, areal = paper["verl_fully_async"], paper["areal"]
        top = points[max(points, key=int)]
        best = max(top["async_speedup"].values())
        probe = ""
        if top.get("split_rollout_s"):          # split=simulated: the rollouts the split was chosen from
            t = {int(x): s for x, s in top["split_rollout_s"].items()}
            lo, hi = min(t), max(t)
            probe = (f" Its split simulated {len(t)} rollouts, on {lo} to {hi} generation GPUs: {t[lo]:.1f} s on {lo}, "
                     f"{t[hi]:.1f} s on {hi}.")
        return _sim_block(text + f"\nAt {max(points, key=int)} GPUs the best k gives {best:.2f}x over the synchronous "
                          f"colocated step; published: {verl['source']} {verl['speedup'][0]}-{verl['speedup'][1]}x; "
                          f"{areal['source']} {areal['speedup']}x.{probe}")
