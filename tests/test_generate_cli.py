"""`python -m jaxrl.generate`: JSONL in, JSONL out, bad input named."""

import json

import pytest

from jaxrl.generate import main
from tests.pat_profiles import forcing_profile


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


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_per_prompt_seeds_and_input_order(tmp_path):
    """Two equal prompts sample differently (each prompt has its own seed); lines come in input order; a
    prompt's samples do not depend on the other lines of the file."""
    inp, out = tmp_path / "p.jsonl", tmp_path / "c.jsonl"
    prompts = [{"prompt": "copy abc"}, {"prompt": "copy abc"}, {"prompt": "rev hello world, a longer one"}]
    inp.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = [f"input={inp}", f"output={out}", "sampling.max_new_tokens=12", "sampling.n=2", "engine.max_seq_len=64"]
    assert main(args) == 0
    rows = _lines(out)
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(3) for j in range(2)]
    assert rows[0]["tokens"] != rows[2]["tokens"]
    inp.write_text(json.dumps(prompts[0]) + "\n" + json.dumps({"prompt": "something else entirely"}) + "\n")
    assert main(args) == 0
    assert _lines(out)[0]["tokens"] == rows[0]["tokens"]


def test_no_partial_file_after_an_error(tmp_path, monkeypatch, capsys):
    import jaxrl.rollout.service as service

    inp, out = tmp_path / "p.jsonl", tmp_path / "c.jsonl"
    inp.write_text(json.dumps({"prompt": "copy abc"}) + "\n" + json.dumps({"prompt": "copy de"}) + "\n")
    real = service.RolloutService.stream

    def broken(self):
        for k, c in enumerate(real(self)):
            if k == 1:
                raise RuntimeError("device lost")
            yield c

    monkeypatch.setattr(service.RolloutService, "stream", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        main([f"input={inp}", f"output={out}", "sampling.max_new_tokens=4", "engine.max_seq_len=64"])
    assert list(tmp_path.iterdir()) == [inp]
    assert f"nothing written to {out}" in capsys.readouterr().err


def test_too_long_prompt_is_refused_before_compiling(tmp_path):
    inp = tmp_path / "p.jsonl"
    inp.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt_ids": list(range(3, 60))}) + "\n")
    with pytest.raises(SystemExit, match=r"p.jsonl:2: prompt of 57 tokens .*prompts up to 56 tokens fit"):
        main([f"input={inp}", f"output={tmp_path / 'o.jsonl'}", "sampling.max_new_tokens=8", "engine.max_seq_len=64"])


def test_service_refuses_a_request_longer_than_max_seq_len():
    import jax

    from jaxrl.rollout import RolloutService, SamplingParams
    from models import PRESETS, init

    cfg = PRESETS["tiny-qwen3"]
    svc = RolloutService(cfg, init(jax.random.key(0), cfg), devices=jax.devices()[:1], max_seq_len=32, max_batch=4)
    with pytest.raises(ValueError, match=r"prompt 30 \+ max_new_tokens 8 = 38 tokens > engine.max_seq_len=32"):
        svc.add(list(range(1, 31)), SamplingParams(max_new_tokens=8))
    assert svc.add(list(range(1, 25)), SamplingParams(max_new_tokens=8))


def test_cli_with_adaptive_tp_switches_and_keeps_the_tokens(tmp_path):
    """`python -m jaxrl.generate` with engine.adaptive_tp on a profile that forces tp1x8 -> tp4x2: the same
    completions as the static layout, and the decisions written beside the output."""
    prof = forcing_profile("large")
    prof.key["devices"] = 8
    prof.save(tmp_path / "prof.json")
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("copy abc", "rev hello", "sum 3 4", "xyz")))
    args = [f"input={inp}", "sampling.max_new_tokens=24", "sampling.n=2", "engine.max_seq_len=64",
            "engine.tp=1", "engine.instances=8", "engine.max_batch=4"]
    assert main(args + [f"output={tmp_path / 'static.jsonl'}"]) == 0
    out = tmp_path / "pat.jsonl"
    assert main(args + [f"output={out}", "engine.adaptive_tp.enabled=true", "engine.adaptive_tp.candidates=[1, 4]",
                        f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}", "engine.adaptive_tp.check_every=4"]) == 0
    assert [r["tokens"] for r in _lines(out)] == [r["tokens"] for r in _lines(tmp_path / "static.jsonl")]
    recs = _lines(tmp_path / "pat.jsonl.pat_decisions.jsonl")
    assert any(r["switch"] and r["current"] == 1 and r["tp"] == 4 for r in recs)
