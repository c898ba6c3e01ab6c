"""Observations as tokens, and demonstration trajectories for the supervised warm start.

An observation enters the conversation the way the tokenizer's chat template renders a tool message after the
assistant's turn: whatever closes the assistant's turn, the tool turn around the text, and the next assistant
header (`ObservationFormat`; with the char tokenizer "\nT: <text>\nA: "). Without a chat template
(`data.chat=false`, or a tokenizer without one) the text itself is appended.

A demonstration trajectory (`demonstration`) is a scripted policy's turns run through the environment itself, so
the warm start sees exactly the observations a rollout would: (response tokens, mask) with the observations
masked out (context, never trained on), the last turn ended by EOS.
"""

from __future__ import annotations

from .base import Environment, Step

_USER, _ASSISTANT, _TOOL = "\x00user\x00", "\x00assistant\x00", "\x00tool\x00"


class ObservationFormat:
    """`render(text)`: the text appended to a paused sequence for observation `text` (see the module docstring)."""

    def __init__(self, tokenizer, chat: bool = True):
        self.before = self.after = ""
        if chat and getattr(tokenizer, "apply_chat_template", None) is not None:
            try:
                full = tokenizer.apply_chat_template([{"role": "user", "content": _USER},
                                                      {"role": "assistant", "content": _ASSISTANT},
                                                      {"role": "tool", "content": _TOOL}], add_generation_prompt=True)
            except ValueError:             # no chat template: the text itself
                return
            if _ASSISTANT not in full or _TOOL not in full:
                raise ValueError("the tokenizer's chat template drops the assistant or tool message: it cannot render "
                                 "observations (set data.chat=false to append them as plain text)")
            between = full[full.index(_ASSISTANT) + len(_ASSISTANT):]
            self.before, self.after = between.split(_TOOL, 1)

    def render(self, text: str) -> str:
        return f"{self.before}{text}{self.after}"


def demonstration(env: Environment, row: dict, turns: list[str], tokenizer, fmt: ObservationFormat,
                  eos_id: int) -> tuple[str, list[int], list[int]]:
    """`turns` (the model's text of each turn, in order) played against `env` reset on `row`, in this process:
    (the reset's opening text, response token ids, mask: 1 for the turns' tokens and the final EOS, 0 for the
    observations). Every turn but the last must leave the trajectory open (ValueError otherwise: the
    demonstration does not fit the env)."""
    opening = env.reset(row)
    tokens, mask = [], []
    for k, text in enumerate(turns):
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [1] * len(ids)
        if k == len(turns) - 1:
            break
        step = env.step(text)
        if not isinstance(step, Step) or step.done:
            raise ValueError(f"demonstration turn {k + 1} of {len(turns)} ended the trajectory ({row.get('prompt')!r})")
        obs = tokenizer.encode(fmt.render(step.observation))
        tokens += obs
        mask += [0] * len(obs)
    return opening, tokens + [eos_id], mask + [1]
