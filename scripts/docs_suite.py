"""docs/testing.md's rendered block: how long the suite takes, from scripts/results/suite_time.json
(`scripts/suite_time.py`; registered into `scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

SUITE = "suite_time.json"


def _clock(s: float) -> str:
    m, s = divmod(round(s), 60)
    return f"{m} min {s:02d} s"


def register(renders, load, table, footer, machine):
    @renders("suite-time")
    def suite_time() -> str:
        d = load(SUITE)
        counts = ", ".join(f"{n} {kind}" for kind, n in d["counts"].items())
        verdict = "within" if d["wall_s"] <= d["budget_s"] else "over"
        head = (f"{d['command']} at `{d['commit'][:10]}`, compilation cache {d['cache']}: **{_clock(d['wall_s'])}** "
                f"({verdict} the {d['budget_s'] // 60}-minute budget), venv install included; pytest's own time "
                f"{_clock(d['pytest_s'])}; {counts}; exit status {d['exit_status']}. {d['cpu_s'] / 60:.0f} CPU-min "
                f"in all, {d['cores_busy']:.2f} cores busy on average.")
        files = list(d["by_file_s"].items())[:12]
        rest = sum(list(d["by_file_s"].values())[12:])
        cpu = d.get("cpu_by_file_s", {})            # (runs before the per-test CPU count have none)
        cpu_rest = sum(v for f, v in cpu.items() if f not in dict(files))
        cols = ["test file", "time (all its phases)", "share"] + ["CPU"] * bool(cpu)
        by_file = table(cols, "lrr" + "r" * bool(cpu),
                        [[f"`{f}`", _clock(s), f"{100 * s / d['phases_s']:.0f}%"] + [_clock(cpu.get(f, 0))] * bool(cpu)
                         for f, s in files]
                        + [[f"{len(d['by_file_s']) - len(files)} other files", _clock(rest),
                            f"{100 * rest / d['phases_s']:.0f}%"] + [_clock(cpu_rest)] * bool(cpu)])
        slowest = table(["phase", "test", "s"], "llr",
                        [[x["phase"], f"`{x['test']}`", f"{x['s']:.1f}"] for x in d["slowest"][:10]])
        parts = [head, by_file, "The 10 slowest phases (a phase's time is wall time on a worker that "
                 "shares the 2 cores with the other):", slowest]
        if cpu:      # tests/conftest.py: each test's CPU seconds (its worker's and the processes it waited for)
            parts += [f"The 10 tests that used the most CPU ({d['tests_cpu_s'] / 60:.0f} CPU-min in all tests; a "
                      "test's own process and the processes it started):",
                      table(["test", "CPU s"], "lr", [[f"`{x['test']}`", f"{x['cpu_s']:.1f}"]
                                                      for x in d["cpu_slowest"][:10]])]
        if d.get("programs"):      # jaxrl.compile_log, on for the run (runs before it have none)
            parts += _programs(d["programs"], table)
        return "\n\n".join(parts + [footer(SUITE)])


    @renders("suite-time-line")
    def suite_time_line() -> str:
        """The README's one line: the suite's time as CI runs it, and the machine."""
        d = load(SUITE)
        verdict = "within" if d["wall_s"] <= d["budget_s"] else "over"
        return (f"As CI runs it (a clean clone, an empty compilation cache, the venv included): "
                f"**{_clock(d['wall_s'])}** at `{d['commit'][:7]}` ({verdict} the {d['budget_s'] // 60}-minute "
                f"budget), on {machine(d)}; from `scripts/results/{SUITE}`.")


def _programs(p: dict, table) -> list[str]:
    """Where the program-building time went: trace, lower, compile (a cache miss), load (a hit)."""
    sec, n = p["seconds"], p["counts"]
    kinds = ("trace", "lower", "compile", "load")
    head = (f"Building programs ({p['processes']} processes, `jaxrl.compile_log`; wall seconds in each thread, "
            "waits for a core included, overlapping where a process builds on several threads): "
            + ", ".join(f"{k} {sec[k]:.0f} s ({n[k]})" for k in kinds) + ". The 10 tests that spent the most:")
    rows = [[f"`{t['name']}`", str(t["processes"])] + [f"{t[k]:.1f}" for k in kinds] for t in p["by_test"][:10]]
    return [head, table(["test", "processes", "trace s", "lower s", "compile s", "load s"], "lrrrrr", rows)]
