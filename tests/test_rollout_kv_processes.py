"""MetroRLHF's blockwise backward on the rollout's K/V (`trainer.kv_source=rollout`) with several processes:
each process stages its own instances' K/V and gathers its own rows of every micro-batch
(`jaxrl.train.rollout_kv`); 2 processes x 4 devices == 1 process x 8 devices (the same train layout), and
`trainer.repartition=tokens` (samples moved between processes, their K/V not) is refused."""

import subprocess
import sys

import numpy as np
import pytest

from jaxrl.config import train as train_cfg
from jaxrl.config.base import ConfigError
from jaxrl.config.loading import load_config
from tests.train_runs import PARAM_ATOL_F32, ROOT, TINY, _env, _metrics, _params, _train

ROLLOUT_KV = ["trainer.backward=blockwise", "trainer.block_size=48", "trainer.kv_source=rollout"]
# eps=1e-3: the two layouts sum gradients in another order (see test_train_processes.test_processes_equal_one); the
# dense reward gives both steps a gradient (the 0/1 rewards of the tiny model are all 0 at step 0)
COMMON = ["steps=2", "save_every=null", "train_layout.fsdp=8", "optim.eps=1e-3", "warm_start.optim.eps=1e-3",
          "rewards.fn=tests.dense_reward:score", *ROLLOUT_KV]


def test_two_processes_config_loads_and_repartition_is_refused():
    load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "distributed.num_processes=2"])
    with pytest.raises(ConfigError) as info:
        load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "distributed.num_processes=2", "trainer.repartition=tokens"])
    assert "trainer.repartition" in str(info.value) and "kv_source=rollout" in str(info.value)
    load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "trainer.repartition=tokens"])      # one process: nothing moves


@pytest.mark.processes
def test_two_processes_equal_one(tmp_path):
    """Each process's micro-batch rows come with its own sequences' K/V, placed on the rows `rl.micro_batches`
    gave its tokens: the same rollouts, blockwise blocks over the rollout's K/V, and within float tolerance
    the same weights as one process. The 2-process run warms up (its local gather shape included): nothing
    compiles after step 0."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(one, *COMMON, "engine.instances=8")
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train", f"run_dir={two}",
           *TINY, *COMMON, "engine.instances=4", "trainer.warmup=true"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    m1, m2 = _metrics(one), _metrics(two)
    assert len(m1) == len(m2) == 2
    for k in ("reward_mean", "response_len_mean", "response_len_max", "pass_rate", "flow/samples"):
        assert [r[k] for r in m1] == [r[k] for r in m2], k            # the same rollouts
    assert all(r["blockwise/blocks"] > 0 and r["grad_norm"] > 0 for r in m1 + m2)
    np.testing.assert_allclose([r["loss"] for r in m2], [r["loss"] for r in m1], rtol=1e-5)
    assert [r["compiles"] for r in m2[1:]] == [0]
    for a, b in zip(_params(one), _params(two), strict=True):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL_F32, rtol=0)
