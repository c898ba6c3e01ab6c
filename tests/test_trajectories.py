"""The trainer's multi-turn rollout (`jaxrl.train.trajectories` driven by `rl.rollout_and_score`): every
trajectory is replayed against a fresh copy of its environment in this process, and what the engine holds must
be exactly what the replay says (observation tokens at the right places, the reward the sum of the steps', the
turn count within max_turns), whatever the mix of environments, failures and turn ends."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl.config import CONFIGS_DIR, load_config
from jaxrl.config.train import TrainConfig
from jaxrl.data import encode_prompts
from jaxrl.data.tasks import CALC_DIRECT_DEMOS, calc_uses_tool
from jaxrl.envs import _testing
from jaxrl.envs.render import ObservationFormat, demonstration
from jaxrl.envs.registry import make_env
from jaxrl.rewards import RewardPool
from jaxrl.rollout import RolloutService
from jaxrl.train import rl
from jaxrl.train.batch import trained_mask
from jaxrl.train.trajectories import MultiTurn, env_metrics
from jaxrl.train.warm_start import demonstrations
from models import PRESETS, init
from models.tokenizer import CharTokenizer
from tests.test_multiturn_engine import turns_of
from tests.train_runs import _metrics, _params, _train

MODEL = PRESETS["tiny-char"]
ECHO = "jaxrl.envs._testing:Echo"
TURN = 5                 # tokens per turn (turn_max_tokens): random weights rarely sample a stop string
G = 3
LOGPROB_ATOL_F32 = 1e-5


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), MODEL)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=5.0) as p:
        yield p


def config(*extra) -> TrainConfig:
    return load_config(TrainConfig, [f"rollout.env={ECHO}", "rollout.turns.max_turns=3", "rollout.turns.stops=[]",
                                     f"rollout.turns.turn_max_tokens={TURN}", "rollout.max_new_tokens=40",
                                     f"algo.group_size={G}", "rollout.turns.step_timeout_s=2.0", *extra],
                       CONFIGS_DIR / "quickstart.yaml")


def rows_of(n: int, **fields) -> list[dict]:
    prompts = ["copy abc", "rev hij?", "rep ab 3", "sort jih?"]
    answers = ["abc", "jih", "ababab", "hij"]
    return [dict(prompt=prompts[i % 4], answer=answers[i % 4], task="copy", index=i, **fields) for i in range(n)]


def run(cfg, weights, pool, rows, step=0):
    tok = CharTokenizer()
    svc = RolloutService(MODEL, weights, tp=1, instances=1, page_size=8, num_pages=96, max_seq_len=96)
    mt = MultiTurn(cfg, tok, pool, rows)
    rnd = mt.round(svc, rows)
    prompts = encode_prompts(rnd.rows, tok, cfg.data.chat)
    comps, rewards, stats = rl.rollout_and_score(svc, pool, tok, cfg, prompts, rows, step, tok.eos_ids, turns=rnd)
    assert not svc.live() and sum(i.pool.used for i in svc.instances) == 0       # every page back
    return tok, mt, prompts, comps, rewards, stats


def replay(tok, fmt, row, c, max_turns):
    """What trajectory `c` must hold: its observations' tokens and its reward, stepping a fresh Echo on its turns."""
    env, reward, obs = _testing.Echo(), 0.0, []
    env.reset(row)
    spans = turns_of(c)
    assert len(spans) <= max_turns
    for k, (a, b) in enumerate(spans):
        step = env.step(tok.decode(c.tokens[a:b]))
        reward += step.reward
        if k < len(spans) - 1:
            obs.append(tok.encode(fmt.render(step.observation)))
    return obs, reward


def test_trajectories_are_what_their_environments_say(weights, pool):
    cfg = config()
    rows = rows_of(4)
    tok, mt, prompts, comps, rewards, stats = run(cfg, weights, pool, rows)
    assert len(comps) == len(rows) * G
    fmt, n = ObservationFormat(tok, True), stats["env"]
    turns = []
    for k, (c, r) in enumerate(zip(comps, rewards)):
        row = rows[k // G]
        opening = " go" if row["prompt"].endswith("?") else ""
        assert c.prompt == prompts[k // G] == encode_prompts([{**row, "prompt": row["prompt"] + opening}], tok)[0]
        obs, reward = replay(tok, fmt, row, c, 3)
        assert [c.tokens[a:b] for a, b in c.appended] == obs
        assert r == pytest.approx(reward, abs=1e-6)
        assert trained_mask(c) == (None if not c.appended else
                                   [0 if any(a <= i < b for a, b in c.appended) else 1 for i in range(len(c.tokens))])
        turns.append(len(c.appended) + 1)
        # a trajectory short of max_turns ended in the engine (EOS or the budget), not at a turn stop
        assert len(c.appended) == 2 or c.finish_reason in ("stop", "length")
    assert max(turns) == 3, "no trajectory reached max_turns: the test exercises nothing"
    assert n["trajectories"] == len(comps) and n["turns"] == sum(turns) == n["steps"] == stats["items"]
    assert n["turns_max"] == max(turns) and n["turn_limit"] == turns.count(3)
    assert n["prefill_saved"] == sum(len(c.prompt) + a for c in comps for a, _ in c.appended)
    assert n["observation_tokens"] == sum(b - a for c in comps for a, b in c.appended)
    m = env_metrics(n)
    assert m["env/turns_mean"] == pytest.approx(np.mean(turns)) and m["env/turns_max"] == 3


def test_the_same_step_rolls_out_the_same_trajectories(weights, pool):
    """Seeds from (run seed, step, row): a resumed step redoes its in-flight trajectories. With
    rollout.turns.deterministic (the default) bit for bit; without, when each environment answers decides which
    sequences decode together, and XLA's batched matmuls round a row differently in another batch shape
    (measured: 1 ulp), so log-probs agree to float32 rounding and the tokens are the same."""
    for extra, exact in ((), True), (("rollout.turns.deterministic=false",), False):
        cfg = config(*extra)
        a = run(cfg, weights, pool, rows_of(2), step=5)[3]
        b = run(cfg, weights, pool, rows_of(2), step=5)[3]
        assert [(c.tokens, c.appended) for c in a] == [(c.tokens, c.appended) for c in b]
        for x, y in zip(a, b):
            if exact:
                np.testing.assert_array_equal(x.logprobs, y.logprobs)
            else:
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=LOGPROB_ATOL_F32, rtol=0)


def test_failing_environments_per_row_never_stall_the_rollout(weights, pool):
    """Rows pick their environment (`"env"`): a Broken one crashes every step; its trajectories get the error
    observation and carry on to max_turns, counted; the Echo rows are unaffected."""
    cfg = config("rollout.max_new_tokens=80", "rollout.turns.max_observation_chars=64")   # (room for an error)
    rows = [dict(r, env="jaxrl.envs._testing:Broken" if i % 2 else ECHO) for i, r in enumerate(rows_of(4))]
    tok, mt, _, comps, rewards, stats = run(cfg, weights, pool, rows)
    fmt = ObservationFormat(tok, True)
    broken = [c for k, c in enumerate(comps) if (k // G) % 2]
    assert stats["crashes"] == stats["env"]["env_errors"] == sum(len(c.appended) + 1 for c in broken) > 0
    assert "crash in environment jaxrl.envs._testing:Broken" in stats["first_error"]
    assert any(c.appended for c in broken), "no broken trajectory continued after its error"
    for c in broken:
        for a, b in c.appended:
            assert tok.decode(c.tokens[a:b]).startswith(fmt.render("<tool_response>environment error:")[:20])
    for k, (c, r) in enumerate(zip(comps, rewards)):
        if (k // G) % 2 == 0:
            assert r == pytest.approx(replay(tok, fmt, rows[k // G], c, 3)[1], abs=1e-6)
        else:
            assert r == 0.0


def test_an_observation_without_room_ends_the_trajectory(weights, pool):
    """Budget 12: the second observation would leave no room to generate, so the trajectory ends there
    (counted `truncated`); nothing is appended past max_new_tokens."""
    cfg = config("rollout.max_new_tokens=12")
    _, _, _, comps, _, stats = run(cfg, weights, pool, rows_of(2))
    assert all(len(c.tokens) <= 12 for c in comps)
    assert stats["env"]["truncated"] > 0


def test_observation_format_follows_the_chat_template():
    tok = CharTokenizer()
    assert ObservationFormat(tok, True).render("<tool_response>7</tool_response>") == \
        "\nT: <tool_response>7</tool_response>\nA: "
    assert ObservationFormat(tok, False).render("x") == "x"
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                    {"role": "tool", "content": "o"}])
    assert text == "Q: q\nA: a" + ObservationFormat(tok, True).render("o")


def test_calc_demonstration_calls_the_tool_and_masks_its_answer():
    """The warm start's calc trajectory: the call, the calculator's real output (masked), the answer + EOS;
    for the CALC_DIRECT_DEMOS share of the prompts (stable, by hash) the answer alone, no tool."""
    cfg = load_config(TrainConfig, [], CONFIGS_DIR / "multiturn.yaml")
    tok = CharTokenizer()
    prompts = [f"calc {a}*{b}" for a in range(10, 100) for b in range(10, 100)]
    direct = [p for p in prompts if not calc_uses_tool(p)]
    assert len(direct) / len(prompts) == pytest.approx(CALC_DIRECT_DEMOS, abs=0.02)
    (d,) = demonstrations([dict(prompt=direct[0], answer="1", task="calc")], tok, cfg)
    assert tok.decode(d.response) == "1" and d.response[-1] == tok.eos_ids[0] and all(d.mask)
    row = dict(prompt="calc 48*39", answer="1872", task="calc")
    (s,) = demonstrations([row], tok, cfg)
    text = tok.decode(s.response)
    assert text == ('<tool_call>{"name":"calculator","arguments":{"expression":"48*39"}}</tool_call>'
                    '\nT: <tool_response>1872</tool_response>\nA: 1872')
    masked = tok.decode([t for t, m in zip(s.response, s.mask) if not m])
    assert masked == "\nT: <tool_response>1872</tool_response>\nA: "
    assert s.response[-1] == tok.eos_ids[0] and s.mask[-1] == 1
    with pytest.raises(ValueError, match="ended the trajectory"):
        demonstration(make_env("calculator"), row, ["1872", "again"], tok, ObservationFormat(tok), 2)


def test_multi_turn_config_refusals():
    from jaxrl.config.base import ConfigError
    with pytest.raises(ConfigError, match="rollout.env"):
        config("algo.advantage=gae")
    with pytest.raises(ConfigError, match="turn_max_tokens"):
        config("rollout.turns.turn_max_tokens=0")
    cfg = dataclasses.replace(config(), rollout=dataclasses.replace(config().rollout, env="no_such_env"))
    with pytest.raises(ValueError, match="unknown environment"):
        MultiTurn(cfg, CharTokenizer(), None)


def test_one_turn_trains_bit_for_bit_as_the_single_turn_trainer(tmp_path):
    """rollout.env=tools with max_turns=1: each response is one turn, scored by the tools environment with the
    row's reward in a worker (no tool is called at this size), so the rewards, the samples (all-ones masks) and
    the updates are the single-turn trainer's, bit for bit."""
    _train(tmp_path / "single", "steps=2", "save_every=null")
    _train(tmp_path / "turns", "steps=2", "save_every=null", "rollout.env=tools", "rollout.turns.max_turns=1")
    single, turns = _metrics(tmp_path / "single"), _metrics(tmp_path / "turns")
    for key in ("reward_mean", "response_len_mean", "loss", "grad_norm", "entropy", "kl", "clip_frac"):
        assert [r[key] for r in single] == [r[key] for r in turns], key
    assert [r["env/turns_max"] for r in turns] == [1, 1] and all(r["env/tool_calls"] == 0 for r in turns)
    for a, b in zip(_params(tmp_path / "single"), _params(tmp_path / "turns")):
        np.testing.assert_array_equal(a, b)


def test_the_readme_environment_runs(tmp_path, weights, monkeypatch):
    """README's "Your own environment" class, as written there, in the multi-turn rollout (its module imported by
    path in the reward workers, as `rollout.env=my_envs:Guess` does)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("```python\n# my_envs.py\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config("rollout.env=my_envs:Guess", 'rollout.turns.stops=["\\n"]', "rollout.max_new_tokens=80")
    rows = [dict(prompt=f"guess {n}", answer=str(n), task="guess", index=n) for n in (3, 7)]
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:        # (started after the path is set)
        tok, _, _, comps, rewards, stats = run(cfg, weights, pool, rows)
    assert stats["env"]["trajectories"] == 2 * G and stats["crashes"] == 0
    hints = [tok.decode(c.tokens[a:b]) for c in comps for a, b in c.appended]
    assert hints and all(h.split("<tool_response>")[1].split("<")[0] in ("higher", "lower") for h in hints)


def test_rollouts_in_a_row_are_independent(weights, pool):
    """Keys (prompt, sample) repeat from one rollout to the next: a trajectory that ended in the engine (EOS, the
    budget) must not leave its turn count behind, or the next rollout's trajectory of that key would reach
    max_turns early. Two rollouts through one MultiTurn equal each through a fresh one. (Budget 30: the second
    observation does not fit, so trajectories end `truncated`, not at the runner's turn limit.)"""
    cfg, tok = config("rollout.max_new_tokens=30"), CharTokenizer()
    svc = RolloutService(MODEL, weights, tp=1, instances=1, page_size=8, num_pages=96, max_seq_len=96)
    mt = MultiTurn(cfg, tok, pool)
    shared = []
    for step in (1, 2):
        rnd = mt.round(svc, rows_of(4))
        prompts = encode_prompts(rnd.rows, tok, True)
        shared.append(rl.rollout_and_score(svc, pool, tok, cfg, prompts, rows_of(4), step, tok.eos_ids, turns=rnd)[0])
    assert sum(len(c.appended) == 1 for c in shared[0]) > 0            # (some did end truncated)
    fresh = [run(cfg, weights, pool, rows_of(4), step=step)[3] for step in (1, 2)]
    assert [[(c.tokens, c.appended) for c in cs] for cs in shared] == [[(c.tokens, c.appended) for c in cs]
                                                                       for cs in fresh]
