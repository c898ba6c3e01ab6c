"""Math answer verifier on HuggingFace's `math-verify` (no hand-written answer parsing).

    math_reward(r"... so the answer is \\boxed{\\frac{1}{2}}", "0.5")   # -> 1.0

The gold answer is parsed as LaTeX (wrapped in `$...$` when it carries no math delimiters, so plain
strings like `1/2` or `(x+1)^2` parse); the response is parsed with `\\boxed{}` at the highest priority,
then math-verify's answer patterns ("final answer is …", the last LaTeX or plain expression). Equivalence
is `math_verify.verify`: exact string, numeric within its float rounding, symbolic via SymPy
simplification, sets/intervals, equations (`x = 3` matches `3`).

Limitation (math-verify's, kept rather than patched with our own regexes): outside `\\boxed{}` or `$...$`
only plain arithmetic is extracted — a bare `x^2+2x+1` in prose is not read as an answer. Prompts should
ask for a boxed final answer, as DeepScaleR-style math prompts do.

Timeouts: math-verify bounds each parse and each comparison with `signal.alarm`, which only works in a
process's main thread. Reward-pool workers run this in their main thread, so those internal timeouts
turn a slow SymPy simplification into a clean 0 without killing the worker; the pool's hard per-sample
timeout (SIGKILL) is the real guarantee. Called from another thread (e.g. an in-process pool driven by a
helper thread) the internal timeouts are switched off rather than raising.
"""

from __future__ import annotations

import functools
import logging
import threading

logger = logging.getLogger(__name__)

# Seconds for each math-verify parse / comparison (signal.alarm takes whole seconds). Below the pool's
# default 5 s hard timeout so a pathological expression usually ends as a 0, not a killed worker.
INTERNAL_TIMEOUT_S = 2

_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


@functools.cache
def _math_verify():
    """(math_verify, gold extraction config, response extraction config), imported at the first use: the
    import pulls SymPy and latex2sympy2 (~0.5 s), which every process that never scores math would pay.
    boxed_match_priority=0 for responses: a \\boxed{} answer beats every other pattern (math-verify's default
    is 50, i.e. after "final answer is" patterns)."""
    import math_verify as mv

    return (mv, (mv.LatexExtractionConfig(), mv.ExprExtractionConfig()),
            (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()))


def _internal_timeout() -> int | None:
    return INTERNAL_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str, *, timeout_s: int | None = None) -> list:
    """Parse a reference answer; a bare string is wrapped in `$...$` so math-verify reads it as LaTeX."""
    text = answer.strip()
    if not any(d in text for d in _DELIMITERS):
        text = f"${text}$"
    mv, gold, _ = _math_verify()
    return mv.parse(text, extraction_config=gold, parsing_timeout=timeout_s)


def parse_response(response: str, *, timeout_s: int | None = None) -> list:
    """Extract the final answer from a model response: `\\boxed{}` first, else math-verify's patterns."""
    mv, _, pred = _math_verify()
    return mv.parse(response, extraction_config=pred, parsing_timeout=timeout_s)


def math_reward(response: str, answer: str) -> float:
    """1.0 if `response`'s final answer is mathematically equivalent to `answer`, else 0.0.

    Never raises: an unparsable response, an unparsable gold answer (logged: that is a data bug) or any
    error inside math-verify/SymPy scores 0.0.
    """
    t = _internal_timeout()
    try:
        gold = parse_gold(answer, timeout_s=t)
        if not gold:
            logger.warning("math_reward: gold answer %r does not parse; scoring 0", answer[:200])
            return 0.0
        pred = parse_response(response, timeout_s=t)
        if not pred:
            return 0.0
        return 1.0 if _math_verify()[0].verify(gold, pred, timeout_seconds=t) else 0.0
    except Exception:  # math-verify/SymPy can raise on odd input; a reward is never an exception
        logger.debug("math_reward failed", exc_info=True)
        return 0.0
