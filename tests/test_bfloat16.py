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
from models import PRESETS, init
from tests.test_train_e2e import ROOT, _env

CFG = PRESETS["tiny-qwen3"]
PROMPT_LENS = (3, 9, 16, 17)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def params_bf16():
    return init(jax.random.key(0), CFG, jnp.bfloat16)


def test_generate_bf16_across_tp_and_against_f32(params_bf16):
    assert {x.dtype for x in jax.tree.leaves(params_bf16)} == {jnp.dtype(jnp.bfloat16)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    kw = dict(page_size=8, num_pages=64)
    tp1 = generate(CFG, params_bf16, prompts, sp, tp=1, **kw)
    tp2 = generate(CFG, params_bf16, prompts, sp, tp=2, **kw)
    assert [o.tokens for o in tp1] == [o.tokens for o in tp2]
    assert all(len(o.tokens) == NEW_TOKENS for o in tp1)
    assert all(np.isfinite(o.logprobs).all() for o in tp1)
    f32 = generate(CFG, jax.tree.map(lambda x: x.astype(jnp.float32), params_bf16), prompts, sp, **kw)
    assert [o.tokens[0] for o in tp1] == [o.tokens[0] for o in f32]
    agree = np.mean([a == b for o, r in zip(tp1, f32) for a, b in zip(o.tokens, r.tokens)])
    assert agree >= 0.8, agree


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
