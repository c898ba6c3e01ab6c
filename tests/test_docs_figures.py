"""Measured numbers live only in rendered blocks: a figure that looks measured (a time, a memory size, a throughput,
a ratio, a percentage, a parameter count) in README.md or docs/*.md outside a `<!-- render:NAME -->` block, a code
block or an inline code span fails, unless ALLOWED names it. A measured figure belongs in a JSON under
scripts/results/ rendered by scripts/docs.py (which names its machine), or in docs/CHANGELOG.md when it is history;
a page otherwise says "see the table above".

Not measurements, so the pattern leaves them alone: `N × M` with spaces (a product or a mesh, not a speed-up;
a measured ratio is written `1.08×`), model names (`SmolLM2-135M`, no unit), a figure right after a bound or a
target word (`≥ 2×`, `≤ 4%`, `target: 20 s`, `under 3 minutes`, `past 4 GiB`, `timeout 20 s`) or right before
one (`20 s timeout`, `15 minutes budget`), and a percentage naming a window (`first 20%`, `top 20%`). A
configuration value is written as its key in a code span (`engine.check_every=4`), which is never scanned."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = "CHANGELOG.md"           # history, by definition: its figures are the ones a release replaced

_NUM = r"(?<![\w.\-/])[~≈]?\d+(?:[.,]\d+)*"
_UNITS = [
    r"\s?(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?|h|hours?|CPU-s|CPU-min|CPU-h)(?![\w/-])",   # time
    r"\s?(?:[KMGT]i?B|bytes?)(?![\w/])",                                                       # memory
    r"\s?(?:[KMGT]?FLOP|tokens?|tok|steps?|samples?|sequences?|rows?|[KMGT]i?B|it)/s(?!\w)",   # throughput
    r"[×x](?!\w)",                                                                             # ratio: 1.08×, 2x
    r"\s?%",                                                                                   # percentage
    r"\s?(?:[KMB]\s?)?parameters",                                                             # parameter count
]
FIGURE = re.compile(_NUM + "(?:" + "|".join(_UNITS) + ")")
BOUND_BEFORE = re.compile(r"(?:[≥≤]|(?<!-)[<>]=?|\bat (?:most|least)|\bunder|\bbelow|\bpast|\bbeyond|\btargets?|"
                          r"\bexceeds?|\bdefaults?|\bbudget|\btimeout|\blimit)\W{0,3}(?:of\s)?(?:\w+\s)?$")
BOUND_AFTER = re.compile(r"^[\s-]*(?:budget|timeout|time-out|limit|cap|deadline|target)\b")
WINDOW = re.compile(r"\b(?:first|last|top|bottom)\s$")
OPEN = re.compile(r"^<!-- render:(?P<name>[a-z0-9-]+) -->\s*$")

# (page, regex on the line, why it is not a measured figure of ours). Keep it short; every entry must still match.
ALLOWED = [
    # cited figures of the five papers (../shared/papers/), each checked against the paper's text
    ("docs/metrorlhf.md", r"the paper's 3\.8–5\.9×", "MetroRLHF's reported memory reduction"),
    ("docs/simulator.md", r"StreamRL reports up to 2\.66×", "StreamRL's reported throughput gain"),
    ("docs/pat.md", r"the paper: 3\.07–4\.04%", "PAT's predictor errors (Fig. 14)"),
    # the simulator's hardware presets: vendor datasheet values (jaxrl/sim/hardware.py), inputs, not results
    ("docs/simulator.md", r"^\| `(?:h100|h800|a40)`", "vendor datasheet figures of the cost model's presets"),
]


def prose(text: str):
    """(line number, line, the line with its inline code spans blanked out) outside rendered blocks and fences.
    A code span may wrap onto the next line (an odd number of backticks leaves it open)."""
    block = fence = None
    tick = False                      # a code span left open by the line before
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if block:
            block = None if s == f"<!-- /render:{block} -->" else block
        elif fence:
            fence = None if s.startswith(fence) else fence
        elif m := OPEN.match(s):
            block = m.group("name")
        elif s.startswith(("```", "~~~")):
            fence = s[:3]
        else:
            blank = ("`" if tick else "") + line + ("`" if (line.count("`") + tick) % 2 else "")
            blank = re.sub(r"`[^`]*`", lambda c: " " * len(c.group()), blank)
            yield i, line, blank[1:] if tick else blank
            tick = bool((line.count("`") + tick) % 2)
        if not s:
            tick = False              # a blank line ends a paragraph, and any span in it


def figures(text: str):
    """(line number, figure, line) for each measured-looking figure outside rendered blocks and code."""
    for i, raw, line in prose(text):
        for m in FIGURE.finditer(line):
            before, after = line[max(0, m.start() - 30):m.start()], line[m.end():]
            if BOUND_BEFORE.search(before) or BOUND_AFTER.match(after):
                continue
            if m.group().endswith("%") and WINDOW.search(line[:m.start()]):
                continue
            yield i, m.group(), raw


def _pages():
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != HISTORY)


def _allowed(page: str, line: str) -> bool:
    return any(p == page and re.search(rx, line) for p, rx, _ in ALLOWED)


def test_no_measured_figure_outside_a_rendered_block():
    found = []
    for path in _pages():
        page = str(path.relative_to(ROOT))
        found += [f"{page}:{i}: {fig!r} in: {line.strip()[:160]}" for i, fig, line in figures(path.read_text())
                  if not _allowed(page, line)]
    assert not found, ("measured-looking figures outside rendered blocks (render them from scripts/results/, point "
                       "to the table, or move history to docs/CHANGELOG.md):\n" + "\n".join(found))


def test_every_allowed_entry_still_matches():
    text = {str(p.relative_to(ROOT)): p.read_text() for p in _pages()}
    stale = [(p, rx) for p, rx, _ in ALLOWED if not any(re.search(rx, ln) for _, ln, _ in prose(text.get(p, "")))]
    assert not stale, f"ALLOWED entries that match no line any more (remove them): {stale}"


def test_the_pattern_finds_measured_figures_and_leaves_the_rest():
    measured = ["the suite took 27 s", "1.3 min of it", "decode is 0.85× generate()", "83 GFLOP/s on 2 cores",
                "38% of the peak", "a 540 MB cache", "~14 ms a step", "1.08x faster", "4,196,864 parameters",
                "26 min 08 s in all", "498 CPU-s", "2.2 tokens/s"]
    for s in measured:
        assert [f for _, f, _ in figures(s)], s
    plain = ["SmolLM2-135M-Instruct", "a 2 × 4 mesh", "fsdp 2 × tp 2", "the ≥ 2× target", "MAPE ≤ 4%",
             "(target: 20 s)", "under the 20 minutes budget", "a 30 s timeout", "the first 20% of the steps",
             "index-sharded past 4 GiB", "`engine.timeout_s=20`", "`a\n27 s` b", "(default 20 s)", "8 fake devices on 2 cores", "Qwen3-0.6B, 16K tokens",
             "<!-- render:x -->\n1.08×\n<!-- /render:x -->", "```\n27 s\n```"]
    for s in plain:
        assert not list(figures(s)), s
