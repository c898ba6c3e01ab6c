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
        by_file = table(["test file", "time (all its phases)", "share"], "lrr",
                        [[f"`{f}`", _clock(s), f"{100 * s / d['phases_s']:.0f}%"] for f, s in files]
                        + [[f"{len(d['by_file_s']) - len(files)} other files", _clock(rest),
                            f"{100 * rest / d['phases_s']:.0f}%"]])
        slowest = table(["phase", "test", "s"], "llr",
                        [[x["phase"], f"`{x['test']}`", f"{x['s']:.1f}"] for x in d["slowest"][:10]])
        return "\n\n".join([head, by_file, "The 10 slowest phases (a phase's time is wall time on a worker that "
                            "shares the 2 cores with the other):", slowest, footer(SUITE)])
