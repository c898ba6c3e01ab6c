"""A train run killed with SIGKILL after checkpoint 2 (a real process) and resumed by the same command:
bit-identical to an uninterrupted run, with each mechanism's state in the checkpoint."""

import pytest

from tests.train_runs import POOLS, SKEW, TAIL, TAIL_KINDS, _metrics, kill_and_resume


@pytest.mark.parametrize("tail", [1, 2, 3], ids=["tail_batching", "skew", "async"])
def test_kill_and_resume_is_bit_identical(tmp_path, tail):
    """Killed after checkpoint 2 (with tail batching: a queue of 8 prompts in it; with skew placement: the
    length ranker and its history; asynchronous with k = 2 (trainer.max_staleness) and the decoupled objective,
    with tail batching: the rollouts of steps 2 and 3 (a short round planned after the long one), made on
    step 1's and step 0's weights, their log-probs the behaviour policy's; slime's carried partial responses:
    the queue's prompts with the tokens their short rounds sampled, resumed in the long round),
    resumed: the same final weights and per-step metrics as an uninterrupted run. (A plain synchronous run
    is not killed separately: tail batching's run is the synchronous chain of graph nodes plus its queue.)"""
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["steps=4", "save_every=1"] + TAIL * (tail in (1, 3)) + SKEW * (tail == 2) + (
        POOLS + ["placement=disaggregated", "trainer.max_staleness=2", "algo.objective=decoupled",
                 "rollout.tail_batching.carry_partial=true"]) * (tail == 3)
    kill_and_resume(full, killed, args)
    assert [r["reward_mean"] for r in _metrics(full)] == [r["reward_mean"] for r in _metrics(killed)]
    if tail == 2:         # the resumed ranker trains and ranks as the uninterrupted one did
        rows = _metrics(killed)
        assert [r["skew/active"] for r in rows] == [0, 1, 1, 1] and [r["skew/pairs"] for r in rows] == [8, 16, 24, 32]
        for key in ("skew/loss", "skew/kendall_tau", "skew/long_instances", "skew/predicted_s"):
            assert [r.get(key) for r in _metrics(full)] == [r.get(key) for r in rows], key
        assert len((killed / "length_pairs.jsonl").read_text().splitlines()) >= 32
    if tail == 3:         # the rollouts made ahead, their versions and log-probs, are in the checkpoint
        rows = _metrics(killed)
        assert [r["placement/staleness"] for r in rows] == [0, 1, 2, 2]
        assert rows[2]["tail/carried_samples"] > 0 and rows[2]["async/lag2_frac"] > 0   # the queue's partials
        for key in ("async/is_weight_mean", "async/is_weight_max", "loss", "grad_norm", "tail/carried_tokens",
                    "async/lag2_frac"):
            assert [r[key] for r in _metrics(full)] == [r[key] for r in rows], key
    if tail in (1, 3):    # (async: the queue and the round plans of the rollouts made ahead are in the checkpoint)
        rows = _metrics(killed)
        assert [r["tail/long_round"] for r in rows] == TAIL_KINDS and rows[1]["tail/queue_len"] == 8
        for key in ("tail/queue_len", "tail/aborted_responses", "tail/wasted_tokens", "response_len_max"):
            assert [r[key] for r in _metrics(full)] == [r[key] for r in rows], key
