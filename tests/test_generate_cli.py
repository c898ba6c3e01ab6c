"""`python -m jaxrl.generate`: JSONL in, JSONL out, bad input named."""

import json

import pytest

from jaxrl.generate import main


def test_cli_round_trip(tmp_path):
    inp, out = tmp_path / "p.jsonl", tmp_path / "c.jsonl"
    inp.write_text(json.dumps({"prompt": "sum 3 4", "id": "a"}) + "\n\n" + json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    assert main([f"input={inp}", f"output={out}", "sampling.max_new_tokens=5", "sampling.n=2",
                 "sampling.temperature=0.0", "chat=true"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {(r["index"], r["sample"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(len(r["tokens"]) == len(r["logprobs"]) <= 5 for r in rows)
    assert {r.get("id") for r in rows if r["index"] == 0} == {"a"}


def test_cli_bad_line(tmp_path):
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(SystemExit, match="p.jsonl:2: needs a string 'prompt'"):
        main([f"input={inp}", f"output={tmp_path / 'o.jsonl'}"])
