"""What the tests and the scripts that run small jobs share (the scripts must not import `tests/`): the tiny
train-run settings, a PAT latency profile that forces the switch controller's hand, and the engine tests'
prompt lengths and tolerance (the kernels' test cases: `kernels.testing`).

    from jaxrl.testing import TINY, forcing_profile
    subprocess.run([sys.executable, "-m", "jaxrl.train", *TINY, "steps=2"])
"""

from __future__ import annotations

from jaxrl.rollout.adaptive_tp import LayoutProfile, Profile
from models import PRESETS

# One decode batch bucket per doubling and one page-table width: fewer programs to build (tokens depend on
# neither; padding rows cost a tiny model little next to a compilation). The default buckets' warm-up is run by
# test_bench_cold_start.py (and by the quickstart in the README).
FEWER_SHAPES = ["engine.batch_buckets_per_octave=1", "engine.page_buckets=1"]
TINY = ["warm_start.steps=3", "warm_start.batch_size=8", "algo.prompts_per_step=8", "algo.group_size=4",
        "rollout.max_new_tokens=12", "data.num_examples=400", "rewards.num_workers=0", "engine.max_batch=32",
        "engine.max_seq_len=128", "data.max_prompt_len=96",
        "trainer.warmup=false",   # 1-3 step runs use few shapes; the quickstart test covers the warm-up
        *FEWER_SHAPES,
        "curves=false"]    # no curves.png: matplotlib's import and a draw are ~0.7 CPU-s of a ~4 s run (the
                           # run-dir test and the user-path test draw it)

PROFILE_CFG = PRESETS["tiny-qwen3"]       # the shapes forcing_profile describes

# The engine's tests against the model's forward (tests/test_rollout.py, scripts/gpu_check_engine.py).
LOGPROB_ATOL_F32 = 1e-4
ROLLOUT_CFG = PRESETS["tiny-qwen3"]       # 8 heads, 2 kv heads: tp=4 replicates kv heads
PROMPT_LENS = (3, 9, 16, 17, 30, 5)


def forcing_profile(prefer: str) -> Profile:
    """Decode latency falling (prefer="large") or rising (prefer="small") 10x per TP doubling; switches
    nearly free: the controller switches at its first check towards the preferred end of its candidates
    (tiny-qwen3's shapes)."""
    layouts = {}
    for tp in (1, 2, 4, 8):
        f = (1 / tp) if prefer == "large" else tp
        dec = [(b, n, 1.0 * f ** 3.3 * (1 + b * n / 1e4)) for b in (1, 8, 64) for n in (8, 64, 512)]
        pre = [(b, n, 1e-6 * b * n) for b in (1, 8, 64) for n in (8, 64, 512)]
        layouts[tp] = LayoutProfile(tp, dec, pre, 0.0)
    rs = {f"{a}->{b}": 1e-6 for a in layouts for b in layouts if a != b}
    return Profile({"model": "forcing"}, layouts, 1e12, rs, layers=PROFILE_CFG.num_layers,
                   kv_bytes_per_token_layer=2 * PROFILE_CFG.num_kv_heads * PROFILE_CFG.head_dim * 4)
