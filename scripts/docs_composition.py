"""docs/composition.md's rendered blocks: the pair matrix (scripts/composition.py), the pair runs
(scripts/pair_runs.py) and the all-mechanisms recipes at quickstart size (scripts/bench_recipes.py).
Registered by scripts/docs.py with its helpers."""


def register(renders, load, table, footer, results):
    @renders("composition")
    def composition() -> str:
        """The pair matrix (scripts/composition.py): ✓ accepted by the config, a number = the refusal below."""
        d = load("composition.json")
        names = list(d["mechanisms"])
        refused = [p for p in d["pairs"] if not p["accepted"]]
        ref = {(p["a"], p["b"]): i + 1 for i, p in enumerate(refused)}
        ref.update({(b, a): i for (a, b), i in list(ref.items())})
        rows = [[f"`{a}`"] + ["·" if a == b else (f"✗{ref[a, b]}" if (a, b) in ref else "✓") for b in names]
                for a in names]
        mech = table(["mechanism", "turned on by", "decides", "needs", "paper"], "lllll",
                     [[f"`{n}`", " ".join(f"`{o}`" for o in m["overrides"]), m["decides"], m["needs"], m["paper"]]
                      for n, m in d["mechanisms"].items()])
        why = "\n".join(f"{i + 1}. `{p['a']}` × `{p['b']}` — `{p['key']}`: {p['reason']}" for i, p in enumerate(refused))
        head = (f"**{d['refused']} of {d['total']} pairs refused** by the config checks, each pair loaded on top of "
                f"the quickstart with {' '.join(f'`{o}`' for o in d['base'])}.")
        return "\n\n".join([head, mech, table([""] + [f"`{i + 1}`" for i in range(len(names))], "l" + "c" * len(names),
                                               [[f"{i + 1} {r[0]}"] + r[1:] for i, r in enumerate(rows)]), why,
                             "*Computed from the code, no machine involved. Rendered from `scripts/results/composition.json` "
                             "by `scripts/docs.py`.*"])


    @renders("pair-runs")
    def pair_runs() -> str:
        """Which accepted pairs ran 2 RL steps (scripts/pair_runs.py), and the failures' last lines."""
        if not (results / "pair_runs.json").exists():
            return "**Not run yet:** `scripts/venv.sh python scripts/pair_runs.py`, then `scripts/docs.py`."
        d = load("pair_runs.json")
        failed = [p for p in d["pairs"] if not p["ran"]]
        head = (f"**{d['ran']} of the {d['accepted']} accepted pairs ran** {d['steps']} RL steps on a "
                f"`{d['train_layout']}` train layout ({d['run']} of them run so far); "
                + (f"{len(failed)} failed:" if failed else "none failed."))
        parts = [head]
        if failed:
            last = lambda e: (e or "").strip().splitlines()[-1][:160].replace("|", "\\|") if e else "–"    # noqa: E731
            parts.append(table(["pair", "exit", "last line"], "lll",
                               [[f"`{p['a']}` × `{p['b']}`", p["exit"], f"`{last(p['error'])}`"] for p in failed]))
        return "\n\n".join(parts + [footer("pair_runs.json")])


    @renders("recipes")
    def recipes() -> str:
        """The all-mechanisms recipes at quickstart size (scripts/bench_recipes.py) beside the quickstart's rise."""
        if not (results / "bench_recipes.json").exists():
            return "**Not measured yet:** run `scripts/venv.sh python scripts/bench_recipes.py`, then `scripts/docs.py`."
        d = load("bench_recipes.json")
        f = lambda x, spec: "–" if x is None else format(x, spec)        # noqa: E731
        rows = []
        for name, r in d["recipes"].items():
            s, m = r["summary"], r["mechanisms"]
            wall = s["wall_s"]
            acted = [f"tail batching {f(m['tail_batching']['prompts_trained'], '.0f')} of "
                     f"{f(m['tail_batching']['prompts_launched'], '.0f')} prompts launched trained, "
                     f"{f(m['tail_batching']['long_rounds'], '.0f')} long rounds",
                     f"dynamic sampling {f(m['dynamic_sampling']['dropped_groups'], '.0f')} groups dropped",
                     f"skew placement active {f(m['skew']['active_steps'], '.0f')} steps",
                     f"planner TP {m['planner']['tps_used']} ({m['planner']['tp_changes']} changes)",
                     f"blockwise {f(m['blockwise']['blocks'], '.0f')} blocks",
                     f"repartition {f(m['repartition']['bytes_moved'], '.0f')} bytes moved"]
            if m.get("async"):
                acted.append(f"one-step-async staleness {m['async']['staleness']}")
            rows.append([f"`{r['command']}`", f"{s['steps']} ({int(wall // 60)} min {wall % 60:.0f} s)",
                         f"{f(s['reward_mean_first'], '.3f')} → {f(s['reward_mean_last'], '.3f')} "
                         f"({r['reward_rise']:+.3f})", f"{r['quickstart_reward_rise']:+.3f}", "; ".join(acted)])
        q = d["quickstart"]
        return (table(["recipe", "RL steps (wall)", "mean reward, first 20% → last 20%", "the quickstart's rise",
                       "each mechanism acted"], "lllll", rows)
                + f"\n\nThe quickstart (`python -m jaxrl.train`, {q['steps']} RL steps): {q['reward_mean_first']:.3f} → "
                  f"{q['reward_mean_last']:.3f}.\n\n" + footer("bench_recipes.json"))
