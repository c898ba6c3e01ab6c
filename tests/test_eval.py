"""Held-out evaluation (`jaxrl.eval`): pass@k against enumeration, the held-out split, the `eval` section's
schedule and refusals, `python -m jaxrl.eval` on the engine's own generation path, and the samples log."""

import itertools
import json

import pytest

from jaxrl.config import ConfigError
from jaxrl.config.eval import EvalSection
from jaxrl.data import PromptDataset
from jaxrl.data.tasks import builtin_reward
from jaxrl.eval.__main__ import main as eval_main
from jaxrl.eval.core import pass_at_k
from jaxrl.eval.heldout import split_heldout
from jaxrl.generate import main as generate_main
from jaxrl.train.samples import SamplesLog, spread


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n, c, k in [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 3, 6), (3, 3, 2)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_split_holds_out_distinct_prompts_never_trained():
    rows = [{"prompt": f"p{i % 7}", "answer": str(i), "task": "t"} for i in range(40)]    # 7 distinct, repeated
    ds = PromptDataset(rows, source="mem")
    train, held = split_heldout(ds, 3, seed=0)
    assert len(held) == 3 == len({r["prompt"] for r in held}) and [r["index"] for r in held] == [0, 1, 2]
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len(train) + sum(r["prompt"] in {h["prompt"] for h in held} for r in rows) == len(rows)
    assert split_heldout(ds, 3, seed=0)[1] == held and split_heldout(ds, 3, seed=1)[1] != held
    with pytest.raises(ValueError, match="7 distinct prompts"):
        split_heldout(ds, 7, seed=0)


def test_schedule_and_refusals():
    e = EvalSection(split=4, every=3)
    assert [s for s in range(11) if e.due(s, 10)] == [0, 3, 6, 9, 10]
    assert [s for s in range(11) if EvalSection(split=4, at_start=False, at_end=False).due(s, 10)] == []
    assert not EvalSection().enabled and not EvalSection().due(0, 10)
    assert EvalSection(split=1, samples=4).ks == (4,) and EvalSection(split=1).ks == ()
    with pytest.raises(ConfigError, match="pass@5 needs at least 5 samples"):
        EvalSection(samples=4, pass_k=(5,))
    with pytest.raises(ConfigError, match="not both"):
        EvalSection(data="x.jsonl", split=3)


def _prompts_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_scores_the_engine_greedy_completions(tmp_path):
    """`python -m jaxrl.eval` generates through the rollout engine: its greedy completions are
    `python -m jaxrl.generate`'s on the same prompts, model and chat template, and each is scored by its row's reward."""
    rows = [{"prompt": p, "answer": a, "task": t} for p, a, t in
            [("copy abc", "abc", "copy"), ("rev hello", "olleh", "reverse"), ("add 3+4", "7", "add")]]
    data, out, gen = _prompts_file(tmp_path / "held.jsonl", rows), tmp_path / "eval.json", tmp_path / "gen.jsonl"
    common = ["model.preset=tiny-char", "engine.max_seq_len=128"]
    assert eval_main([*common, f"data={data}", "max_new_tokens=10", f"output={out}", "eval.samples=2",
                      "eval.pass_k=[1,2]"]) == 0
    result = json.loads(out.read_text())
    assert generate_main([*common, f"input={data}", f"output={gen}", "sampling.max_new_tokens=10",
                          "sampling.temperature=0.0", "chat=true"]) == 0
    greedy = {json.loads(line)["index"]: json.loads(line)["completion"] for line in gen.read_text().splitlines()}
    samples = result["samples"]
    assert len(samples) == 6 and {s["completion"] for s in samples if s["index"] == 1} == {greedy[1]}
    assert all(s["completion"] == greedy[s["index"]] for s in samples)
    assert all(s["reward"] == pytest.approx(builtin_reward(s["completion"], s["answer"], rows[s["index"]]["task"]))
               for s in samples)
    m = result["metrics"]
    assert m["eval/prompts"] == 3 and m["eval/samples"] == 6
    assert m["eval/accuracy"] == pytest.approx(sum(s["reward"] for s in samples) / 6)
    assert m["eval/pass@1"] == m["eval/pass@2"]     # greedy: a prompt's samples are equal
    assert len(result["worst"]) == len(result["best"]) == 2


def test_cli_stops_on_a_bad_reward_before_any_work(tmp_path):
    data = _prompts_file(tmp_path / "held.jsonl", [{"prompt": "copy a", "answer": "a"}])
    with pytest.raises(SystemExit, match="rewards: unknown reward 'nope'"):
        eval_main(["model.preset=tiny-char", f"data={data}", "rewards.fn=nope", f"output={tmp_path / 'e.json'}"])
    assert not (tmp_path / "e.json").exists()


def test_samples_log_resumes_and_writes_tensorboard_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = SamplesLog(tmp_path)
    for step in range(3):
        log.write(step, "train", [dict(prompt=f"q{step}", completion="a|b\nc", reward=0.5, answer="x", tokens=3)])
    log.close()
    log = SamplesLog(tmp_path, resume_step=2)       # steps >= 2 are logged again by the resumed run
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["prompt"]) for r in lines] == [(0, "train", "q0"), (1, "train", "q1")]
    acc = EventAccumulator(str(tmp_path / "tb" / "samples"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("samples/train")
    assert [e.step for e in events] == [0, 1]
    assert "a\\|b⏎ c" in events[0].tensor_proto.string_val[0].decode()
    assert spread(10, 4) == [0, 3, 6, 9] and spread(3, 5) == [0, 1, 2] and spread(5, 0) == []
