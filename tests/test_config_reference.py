"""docs/config.md names every key of every entry point's config and no key that does not exist; the README points
to it and to `--help`.

The page's tables are rendered from the dataclasses (scripts/docs_config.py; tests/test_docs.py fails when a
rendered block differs from the code); these checks read the page's text itself, so they also fail on a page
edited by hand or left unrendered, and `test_the_checks_catch_a_missing_and_an_unknown_key` shows that they do."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"


def _module():
    spec = importlib.util.spec_from_file_location("jaxrl_docs_config", ROOT / "scripts" / "docs_config.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


dc = _module()
ROW = re.compile(r"^\| `([a-z_][a-z0-9_.]*)` \|", re.M)


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- render:config-{name} -->\n(.*?)<!-- /render:config-{name} -->", text, re.S)
    return m.group(1) if m else ""


def problems(text: str) -> list[str]:
    """Per entry point: keys its config has that its block's tables miss, and keys they name that it lacks; then
    dotted keys named in the page's prose that no entry point has."""
    out, every = [], set()
    for entry in dc.ENTRY_POINTS:
        have = dc.keys(dc.config_class(entry))
        every |= set(have)
        sections = {k.rsplit(".", 1)[0] for k in have if "." in k}
        every |= {".".join(s.split(".")[:i]) for s in sections for i in range(1, s.count(".") + 2)}
        named = ROW.findall(_block(text, entry.name))
        out += [f"{entry.command}: {k} is missing from the page" for k in have if k not in named]
        out += [f"{entry.command}: the page names {k}, which does not exist" for k in named if k not in have]
        out += [f"{entry.command}: {k} is listed twice" for k in set(named) if named.count(k) > 1]
    prose = re.sub(r"<!-- render:(config-[a-z]+) -->.*?<!-- /render:\1 -->", "", text, flags=re.S)
    for span in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`", prose):
        if span.split(".")[0] in every and span not in every:
            out.append(f"the page's text names {span}, which does not exist")
    return out


def test_page_lists_every_key_and_only_keys_that_exist():
    text = PAGE.read_text()
    assert not problems(text), problems(text)
    assert len(ROW.findall(_block(text, "train"))) == len(dc.keys(dc.config_class(dc.ENTRY_POINTS[0]))) > 150


def test_the_checks_catch_a_missing_and_an_unknown_key():
    text = PAGE.read_text()
    row = re.search(r"^\| `algo\.clip_high` \|.*\n", text, re.M).group(0)
    assert any("algo.clip_high is missing" in p for p in problems(text.replace(row, "", 1)))
    assert any("algo.clip_higher, which does not exist" in p
               for p in problems(text.replace(row, row + row.replace("clip_high", "clip_higher"), 1)))
    assert any("algo.temperature" in p for p in problems(text + "\nSee `algo.temperature`.\n"))


def test_meanings_are_the_help_texts():
    """Each key's meaning is the description `--help` prints (draccus reads the same comments); a key without
    one shows its section's docstring, marked, and only a few keys do."""
    from jaxrl.config.loading import format_help

    for entry in dc.ENTRY_POINTS:
        cls = dc.config_class(entry)
        lines = {m.group(1): m.group(2).strip() for m in re.finditer(r"^  (\S+) = (.*)$", format_help(cls(), prog="x"),
                                                                       re.M)}
        fallback = []
        for group in dc.groups(cls):
            for k in group.keys:
                if k.meaning.startswith(dc.SECTION_MARK):
                    fallback.append(k.key)
                else:
                    assert lines[k.key].endswith(k.meaning), (k.key, k.meaning, lines[k.key])
        assert len(fallback) <= 6, fallback


def test_every_mechanism_prefix_exists():
    """A prefix in scripts/docs_config.py's MECHANISMS names a key or section of some entry point (a renamed
    section would otherwise silently fall back to its parent's mechanism)."""
    names = set()
    for entry in dc.ENTRY_POINTS:
        for k in dc.keys(dc.config_class(entry)):
            parts = k.split(".")
            names |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    assert not [p for p in dc.MECHANISMS if p and p not in names]
    assert all((ROOT / "docs" / page).exists() for _, page in dc.MECHANISMS.values())


def test_readme_points_to_the_reference_and_help():
    readme = (ROOT / "README.md").read_text()
    assert "docs/config.md" in readme and "--help" in readme and "docs/coming_from.md" in readme
