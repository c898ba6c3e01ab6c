"""A dense reward for short test runs (`rewards.fn=tests.dense_reward:score`): the tiny models of the e2e tests
rarely solve a task in a few steps, so the built-in 0/1 rewards are almost all 0 there; this one scores the
response's similarity to the answer, so every step has a reward signal to learn from."""

import difflib


def score(response: str, answer: str, task: str) -> float:
    return difflib.SequenceMatcher(None, response.strip(), str(answer)).ratio()
