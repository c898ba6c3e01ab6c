"""`jaxrl.compile_log`: every trace, lowering and compilation of a process as one JSON line, a compilation the
persistent cache served told from one it compiled, and the summary `scripts/suite_time.py` records."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import compile_log


@pytest.fixture
def every_program_cached():
    """The suite's persistent cache keeps every compiled program, however fast it compiled."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_a_miss_then_a_hit_named_by_program_and_test(tmp_path, every_program_cached):
    c = float(time.time_ns() % 1_000_003)        # a program no earlier session put in the cache
    make = lambda: jax.jit(lambda x: jnp.sin(x) * c + 1)  # noqa: E731 -- (two functions: traced twice)
    log = compile_log.CompileLog(tmp_path)
    try:
        make()(np.ones(3, np.float32))            # traced, lowered, compiled and written to the cache
        make()(np.ones(3, np.float32))            # traced and lowered again, then loaded from the cache
    finally:
        log.stop()
    make()(np.ones(3, np.float32))                # after stop: not logged
    rows = compile_log.read(tmp_path)
    assert [(r["event"], r.get("hit")) for r in rows] == [("trace", None), ("lower", None), ("compile", False),
                                                          ("trace", None), ("lower", None), ("compile", True)]
    assert {r["pid"] for r in rows} == {os.getpid()} and all(r["s"] >= 0 for r in rows)
    this_test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    assert all(r["test"].startswith(this_test) for r in rows)
    s = compile_log.summarize(rows)
    assert s["counts"] == {"trace": 2, "lower": 2, "compile": 1, "load": 1} and s["processes"] == 1
    assert [p["name"] for p in s["by_program"]] == ["<lambda>"]      # trace's `f` and lowering's `jit(f)`: one
    assert [(t["name"], t["processes"]) for t in s["by_test"]] == [(this_test, 1)]
    for kind in ("trace", "lower", "compile", "load"):
        kind_of = lambda r: r["event"] if r["event"] != "compile" else ("load" if r["hit"] else "compile")  # noqa: E731
        want = sum(r["s"] for r in rows if kind_of(r) == kind)
        assert s["seconds"][kind] == pytest.approx(want, abs=0.006)
        assert s["by_program"][0][kind] == pytest.approx(want, abs=0.006)


def test_a_line_cut_short_is_skipped_and_the_cli_prints_the_summary(tmp_path, capsys):
    (tmp_path / "12.jsonl").write_text('{"event": "trace", "fn": "f", "s": 1.5, "test": null}\n'
                                       '{"event": "compile", "fn": "jit(f)", "s": 2.0, "test": null, "hit": false}\n'
                                       '{"event": "compi')             # (a process killed mid-line)
    (tmp_path / "notes.jsonl").write_text("not a process's log\n")
    assert [r["pid"] for r in compile_log.read(tmp_path)] == [12, 12]
    assert compile_log.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 processes: trace 1.5 s (1), lower 0.0 s (0), compile 2.0 s (1), load 0.0 s (0)" in out
    assert compile_log.main([str(tmp_path / "missing")]) == 2
