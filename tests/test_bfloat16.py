"""bfloat16 params run on the CPU (XLA:CPU has no BF16 x BF16 = F32 dot): rollout at tp=1/2, a train
step, and `python -m jaxrl.train model.dtype=bfloat16` end to end."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.rollout import SamplingParams, generate
from jaxrl.train.batch import Sample, pack
from jaxrl.train.step import LossSpec, make_train_step
from models import PRESETS, forward, init
from tests.train_runs import ROOT, _env

CFG = PRESETS["tiny-qwen3"]
PROMPT_LENS = (3, 9, 16, 17)
NEW_TOKENS = 8
# Greedy bf16 vs f32 on this setup (`measure(range(10))`: init key and prompts of seeds 0-9, the test's is 0):
# the largest |bf16 − f32| logit on the f32 greedy path is 0.0129 (0.0094 at seed 0), so a greedy token can flip
# only where the f32 top-2 margin is below 2 x 0.0129. Seeds 1, 4 and 7 diverged (5, 4 and 6 of 32 tokens differ,
# up to 19%; the other seven, 0 included, none), each from one position whose f32 margin was 0.0023, 0.0022 and
# 0.0006, every later token differing. Before a divergence the chosen tokens' log-probs differ by at most 0.0059.
BF16_MARGIN = 0.03           # 2 x 0.0129, rounded up: the bf16 logit error scale
BF16_LOGPROB_ATOL = 0.01     # measured at most 0.0059


@pytest.fixture(scope="module")
def params_bf16():
    return init(jax.random.key(0), CFG, jnp.bfloat16)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


def _path_logits(params, prompts, outs) -> list[np.ndarray]:
    """Per prompt, the [NEW_TOKENS, vocab] logits (one forward) that chose each token of `outs`' greedy path."""
    seqs = [p + o.tokens[:-1] for p, o in zip(prompts, outs)]
    width = max(map(len, seqs))
    logits = np.asarray(forward(params, CFG, jnp.asarray([s + [0] * (width - len(s)) for s in seqs])))
    return [logits[k, len(p) - 1:len(p) - 1 + NEW_TOKENS] for k, p in enumerate(prompts)]


def _first(flags) -> int:
    return next((i for i, f in enumerate(flags) if f), NEW_TOKENS)


def measure(seeds) -> None:
    """The measurement behind BF16_MARGIN and BF16_LOGPROB_ATOL (prints one line per seed)."""
    sp, kw = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), dict(page_size=8, num_pages=64)
    for seed in seeds:
        bf16 = init(jax.random.key(seed), CFG, jnp.bfloat16)
        f32 = jax.tree.map(lambda x: x.astype(jnp.float32), bf16)
        prompts = _prompts(seed)
        ob, of = generate(CFG, bf16, prompts, sp, **kw), generate(CFG, f32, prompts, sp, **kw)
        lf, lb = _path_logits(f32, prompts, of), _path_logits(bf16, prompts, of)
        first = [_first(a != b for a, b in zip(o.tokens, r.tokens)) for o, r in zip(ob, of)]
        margin = [np.diff(np.sort(x, -1)[:, -2:], axis=-1)[:, 0] for x in lf]
        lp = max((np.abs(np.subtract(o.logprobs[:d], r.logprobs[:d])).max(initial=0.0)
                  for o, r, d in zip(ob, of, first)))
        print(f"seed {seed}: {sum(a != b for o, r in zip(ob, of) for a, b in zip(o.tokens, r.tokens))}/"
              f"{len(prompts) * NEW_TOKENS} tokens differ, first divergences {first}, f32 margin there "
              f"{[round(float(m[d]), 4) for m, d in zip(margin, first) if d < NEW_TOKENS]}, max |logit diff| "
              f"{max(np.abs(a - b).max() for a, b in zip(lf, lb)):.4f}, max |logprob diff| before {lp:.4f}")


def test_generate_bf16_across_tp_and_against_f32(params_bf16):
    """bf16 greedy agrees with f32 up to the first position where the f32 top-2 logit margin is within the
    bf16 error scale (after a divergence the two paths see different contexts), and its log-probs agree
    wherever the paths have not diverged."""
    assert {x.dtype for x in jax.tree.leaves(params_bf16)} == {jnp.dtype(jnp.bfloat16)}
    prompts = _prompts(0)
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    kw = dict(page_size=8, num_pages=64)
    tp1 = generate(CFG, params_bf16, prompts, sp, tp=1, **kw)
    tp2 = generate(CFG, params_bf16, prompts, sp, tp=2, **kw)
    assert [o.tokens for o in tp1] == [o.tokens for o in tp2]
    assert all(len(o.tokens) == NEW_TOKENS for o in tp1)
    assert all(np.isfinite(o.logprobs).all() for o in tp1)
    params_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params_bf16)
    f32 = generate(CFG, params_f32, prompts, sp, **kw)
    checked = 0
    for o, r, logits in zip(tp1, f32, _path_logits(params_f32, prompts, f32)):
        top2 = np.sort(logits, -1)[:, -2:]
        sure = _first(top2[:, 1] - top2[:, 0] < BF16_MARGIN)          # the first close call of the f32 path
        assert logits[:sure].argmax(-1).tolist() == r.tokens[:sure]    # the margins are of r's own choices
        assert o.tokens[:sure] == r.tokens[:sure], (sure, o.tokens, r.tokens)
        same = _first(a != b for a, b in zip(o.tokens, r.tokens))
        np.testing.assert_allclose(o.logprobs[:same], r.logprobs[:same], atol=BF16_LOGPROB_ATOL)
        checked += sure
    assert checked >= 8                  # seed 0: 1 + 6 + 1 + 0 of the 32 tokens come before a close call


def test_train_step_bf16(params_bf16):
    rng = np.random.default_rng(2)
    samples = [Sample(rng.integers(3, 100, rng.integers(3, 12)).tolist(),
                      rng.integers(3, 100, rng.integers(1, 20)).tolist(), float(rng.normal())) for _ in range(4)]
    batch = {k: jnp.asarray(v) for k, v in pack(samples, np.ones(4), pack_len=64).items()}
    tx = optax.adamw(1e-2)
    step = make_train_step(CFG, LossSpec(), tx, micro_batches=1)
    before = jax.tree.map(np.asarray, params_bf16)
    new, _, m = step(jax.tree.map(jnp.copy, params_bf16), tx.init(params_bf16), batch)
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new)))


def test_train_cli_bf16(tmp_path):
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={tmp_path}", "model.dtype=bfloat16", "steps=1", "trainer.warmup=false",
           "warm_start.steps=2", "warm_start.batch_size=8", "algo.prompts_per_step=4", "algo.group_size=2",
           "rollout.max_new_tokens=8", "data.num_examples=50", "rewards.num_workers=0", "engine.max_batch=16",
           "engine.max_seq_len=128", "data.max_prompt_len=96", "export_hf=false", "save_every=null"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
