"""No input makes the engine wait forever: groups larger than max_batch or than the pool are admitted
in parts; requests that can never fit are refused at submission with both numbers."""

import jax
import pytest

from jaxrl.rollout import RolloutService, SamplingParams, generate
from models import PRESETS, init

CFG = PRESETS["tiny-qwen3"]


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG)


PROMPT = list(range(1, 20))                  # 19 tokens: 2 full pages of 8 + 3


@pytest.mark.parametrize("n,max_batch,num_pages", [(8, 8, 64), (12, 8, 64), (6, 8, 6)],
                         ids=["group=max_batch", "group>max_batch", "group>pool"])
def test_groups_beyond_the_limits_finish(weights, n, max_batch, num_pages):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=n, seed=4)
    outs = generate(CFG, weights, [PROMPT], params, page_size=8, num_pages=num_pages, max_batch=max_batch)
    alone = generate(CFG, weights, [PROMPT], params, page_size=8, num_pages=256, max_batch=64, prefix_sharing=False)
    assert len(outs) == n and [o.tokens for o in outs] == [o.tokens for o in alone]


def test_prompt_filling_the_pool_finishes_and_larger_is_refused(weights):
    # 19 + 13 = 32 tokens = 4 pages of 8 = the whole pool (5 pages, page 0 is scratch)
    outs = generate(CFG, weights, [PROMPT], SamplingParams(max_new_tokens=13, temperature=0.0), page_size=8, num_pages=5)
    assert len(outs[0].tokens) == 13
    svc = RolloutService(CFG, weights, page_size=8, num_pages=5)
    with pytest.raises(ValueError, match="needs 5 pages; the pool has 4"):
        svc.add(PROMPT, SamplingParams(max_new_tokens=14))
    assert not svc.has_work()
